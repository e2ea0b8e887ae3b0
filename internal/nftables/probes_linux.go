package nftables

import (
	"errors"
	"fmt"
	"net/netip"

	"github.com/google/nftables"
	"github.com/google/nftables/userdata"
	"golang.org/x/sys/unix"

	"github.com/istio-cni-go/istio-cni/internal/nlsteps"
	"github.com/istio-cni-go/istio-cni/internal/podnet"
	"github.com/istio-cni-go/istio-cni/internal/ruleset"
)

// The node's probe sets are read and written over a blocking socket made
// in the node's namespace and kept (nlsteps.Kept): every enrolled pod's
// ADD changes them, and the library's sockets on Go's poller, each answer
// woken through it, cost that ADD about a millisecond for four reads and
// a write; a socket closed after a deletion, 11-12 ms more.

// hostSocket is the kept socket of the node's namespace; one for the
// process, as iptables' (a node has one namespace; a change of path makes
// a new socket).
var hostSocket nlsteps.Kept

// onHost runs fn with the kept socket of the node's namespace.
func (a *Applier) onHost(netnsPath string, fn func(*nlsteps.Conn) error) error {
	return hostSocket.Do(netnsPath, unix.NETLINK_NETFILTER, fn)
}

// probeFamilies pairs each probe set with its part of a wanted map.
func probeFamilies(want map[netip.Addr]string) [2]struct {
	name string
	want map[netip.Addr]string
} {
	v4, v6 := podnet.SplitFamilies(want)
	return [2]struct {
		name string
		want map[netip.Addr]string
	}{{ruleset.ProbeSetV4, v4}, {ruleset.ProbeSetV6, v6}}
}

// SyncProbes brings the probe sets to want (pod address to pod UID) by
// difference, in one transaction: missing elements added, elements of
// another pod's UID replaced, elements no longer wanted deleted, the
// rest untouched. want must be complete: an address left out is taken
// as gone.
func (a *Applier) SyncProbes(netnsPath string, want map[netip.Addr]string) (podnet.ProbeChanges, error) {
	var out podnet.ProbeChanges
	err := a.onHost(netnsPath, func(c *nlsteps.Conn) error {
		var sets []probeChange
		for _, fam := range probeFamilies(want) {
			have, ok, err := readProbeSet(c, fam.name)
			if err != nil {
				return err
			}
			if !ok {
				if len(fam.want) > 0 {
					return fmt.Errorf("set %s of table inet %s is missing (EnsureHost makes it)", fam.name, AmbientNATTable)
				}
				continue
			}
			d := podnet.DiffProbes(have, fam.want)
			sets = append(sets, probeChange{fam.name, d, fam.want})
			out.Added = append(out.Added, d.Added...)
			out.Updated = append(out.Updated, d.Updated...)
			out.Removed = append(out.Removed, d.Removed...)
		}
		return writeProbes(c, sets)
	})
	return out, err
}

// ChangeProbes makes the changes ch, found against what the sets held
// after the caller's last write, without reading the sets: Removed and
// Updated deleted, Added and Updated added with want's UIDs, in one
// transaction. A set that no longer holds what ch was found against
// refuses it whole (an element to delete is gone, or one to add is there
// already), and the caller syncs instead.
func (a *Applier) ChangeProbes(netnsPath string, ch podnet.ProbeChanges, want map[netip.Addr]string) error {
	if ch.Empty() {
		return nil
	}
	return a.onHost(netnsPath, func(c *nlsteps.Conn) error {
		var sets []probeChange
		for _, fam := range probeFamilies(want) {
			if d := ch.InSet(fam.name); !d.Empty() {
				sets = append(sets, probeChange{fam.name, d, fam.want})
			}
		}
		return writeProbes(c, sets)
	})
}

// ForgetProbe deletes ip from its probe set only if its element is
// uid's: a deleted pod's address may already be a new pod's. It reports
// whether it deleted.
func (a *Applier) ForgetProbe(netnsPath string, ip netip.Addr, uid string) (bool, error) {
	ip = ip.Unmap()
	name := ruleset.ProbeSetOf(ip)
	deleted := false
	err := a.onHost(netnsPath, func(c *nlsteps.Conn) error {
		have, ok, err := readProbeSet(c, name)
		if err != nil || !ok {
			return err
		}
		if got, ok := have[ip]; !ok || got != uid {
			return nil
		}
		if err := writeProbes(c, []probeChange{{name, podnet.ProbeChanges{Removed: []netip.Addr{ip}}, nil}}); err != nil {
			return err
		}
		deleted = true
		return nil
	})
	return deleted, err
}

// ProbeEntries lists the probe sets' elements: address to pod UID.
func (a *Applier) ProbeEntries(netnsPath string) (map[netip.Addr]string, error) {
	out := map[netip.Addr]string{}
	err := a.onHost(netnsPath, func(c *nlsteps.Conn) error {
		for _, name := range []string{ruleset.ProbeSetV4, ruleset.ProbeSetV6} {
			have, _, err := readProbeSet(c, name)
			if err != nil {
				return err
			}
			for ip, uid := range have {
				out[ip] = uid
			}
		}
		return nil
	})
	return out, err
}

// readProbeSet reads a probe set: address to pod UID, from the elements'
// comments; ok is false when the set does not exist.
func readProbeSet(c *nlsteps.Conn, name string) (have map[netip.Addr]string, ok bool, err error) {
	body := nlsteps.NfGen(unix.NFPROTO_INET, 0)
	body = nlsteps.Attr(body, unix.NFTA_SET_ELEM_LIST_TABLE, append([]byte(AmbientNATTable), 0))
	body = nlsteps.Attr(body, unix.NFTA_SET_ELEM_LIST_SET, append([]byte(name), 0))
	msgs, err := c.Request(unix.NFNL_SUBSYS_NFTABLES<<8|unix.NFT_MSG_GETSETELEM, unix.NLM_F_DUMP, body)
	if errors.Is(err, unix.ENOENT) {
		return nil, false, nil
	}
	if err != nil {
		return nil, false, fmt.Errorf("reading set %s of %s: %w", name, AmbientNATTable, err)
	}
	have = map[netip.Addr]string{}
	for _, m := range msgs {
		if err := elementsOf(m.Body, have); err != nil {
			return nil, false, fmt.Errorf("reading set %s of %s: %w", name, AmbientNATTable, err)
		}
	}
	return have, true, nil
}

// elementsOf adds the address elements of one GETSETELEM answer to have,
// with their comments.
func elementsOf(body []byte, have map[netip.Addr]string) error {
	if len(body) < nlsteps.NfGenLen {
		return errors.New("short answer")
	}
	attrs, err := nlsteps.ParseAttrs(body[nlsteps.NfGenLen:])
	if err != nil {
		return err
	}
	for _, a := range attrs {
		if a.Type&^unix.NLA_F_NESTED != unix.NFTA_SET_ELEM_LIST_ELEMENTS {
			continue
		}
		elems, err := nlsteps.ParseAttrs(a.Data)
		if err != nil {
			return err
		}
		for _, e := range elems {
			fields, err := nlsteps.ParseAttrs(e.Data)
			if err != nil {
				return err
			}
			var ip netip.Addr
			comment := ""
			for _, f := range fields {
				switch f.Type &^ unix.NLA_F_NESTED {
				case unix.NFTA_SET_ELEM_KEY:
					vals, err := nlsteps.ParseAttrs(f.Data)
					if err != nil {
						return err
					}
					for _, v := range vals {
						if v.Type&^unix.NLA_F_NESTED == unix.NFTA_DATA_VALUE {
							ip, _ = netip.AddrFromSlice(v.Data)
						}
					}
				case unix.NFTA_SET_ELEM_USERDATA:
					comment, _ = userdata.GetString(f.Data, userdata.NFTNL_UDATA_SET_ELEM_COMMENT)
				}
			}
			if ip.IsValid() {
				have[ip] = comment
			}
		}
	}
	return nil
}

// probeChange is what one probe set is to change, with the wanted UIDs.
type probeChange struct {
	name string
	ch   podnet.ProbeChanges
	want map[netip.Addr]string
}

// elemListBytes bounds the element list of one message: the list is one
// netlink attribute, whose 16-bit length wraps past 64 KiB, and the kernel
// then reads (and acknowledges) a cut list: a few elements of thousands.
const elemListBytes = 32 << 10

// elementMessages splits elems into lists that each fit one message's
// element attribute, by their encoded size (key, comment and the
// attributes around them) rather than by count, since a comment's length
// is the caller's.
func elementMessages(elems []nftables.SetElement) [][]nftables.SetElement {
	var out [][]nftables.SetElement
	start, size := 0, 0
	for i := range elems {
		n := 48 + len(elems[i].Key) + len(elems[i].Comment)
		if i > start && size+n > elemListBytes {
			out = append(out, elems[start:i])
			start, size = i, 0
		}
		size += n
	}
	if start < len(elems) {
		out = append(out, elems[start:])
	}
	return out
}

// writeProbes sends the changes as one transaction on c: deletions
// first, so an updated element is deleted and added back with its new
// UID.
func writeProbes(c *nlsteps.Conn, sets []probeChange) error {
	queued := false
	step, err := recordBatch(func(conn *nftables.Conn) error {
		table := &nftables.Table{Name: AmbientNATTable, Family: nftables.TableFamilyINet}
		for _, s := range sets {
			set := &nftables.Set{Table: table, Name: s.name}
			var del, add []nftables.SetElement
			for _, ip := range append(append([]netip.Addr{}, s.ch.Removed...), s.ch.Updated...) {
				del = append(del, nftables.SetElement{Key: ip.AsSlice()})
			}
			for _, ip := range append(append([]netip.Addr{}, s.ch.Added...), s.ch.Updated...) {
				add = append(add, nftables.SetElement{Key: ip.AsSlice(), Comment: s.want[ip]})
			}
			for _, part := range elementMessages(del) {
				if err := conn.SetDeleteElements(set, part); err != nil {
					return err
				}
			}
			for _, part := range elementMessages(add) {
				if err := conn.SetAddElements(set, part); err != nil {
					return err
				}
			}
			queued = queued || len(del)+len(add) > 0
		}
		return nil
	}, func(typ, flags uint16, data []byte) (uint16, string) {
		if typ&0xff == unix.NFT_MSG_NEWSETELEM {
			// An element there already would otherwise be kept as it
			// is, with another pod's UID, and the change reported made.
			flags |= nlsteps.FlagExcl
		}
		return flags, describeMsg(typ, data)
	})
	if err != nil || !queued {
		return err
	}
	if err := c.Send(&step); err != nil {
		return fmt.Errorf("updating the probe sets of table inet %s: %w", AmbientNATTable, err)
	}
	return nil
}
