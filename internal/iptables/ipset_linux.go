package iptables

import (
	"encoding/binary"
	"errors"
	"fmt"
	"net/netip"
	"slices"
	"strings"
	"sync"

	"github.com/mdlayher/netlink"
	"github.com/vishvananda/netlink/nl"
	"golang.org/x/sys/unix"

	"github.com/istio-cni-go/istio-cni/internal/nlsteps"
	"github.com/istio-cni-go/istio-cni/internal/ruleset"
)

// The sets a long list becomes (package ruleset decides): hash:net holds
// prefixes of one family and matches the longest; bitmap:port holds any
// of the 65536 ports in 8 KiB and serves ip6tables as well as iptables.
const (
	typeNets  = "hash:net"
	typePorts = "bitmap:port"
)

// adtBatch is how many entries one ADD message carries: a netlink
// attribute is at most 64 KiB, and an IPv6 entry takes 36 bytes.
const adtBatch = 1000

// ipsetClient speaks the kernel's ipset protocol (the one the ipset
// command uses) over netlink in the calling thread's network namespace,
// which the socket is bound to when it is made. Its attributes are
// encoded and decoded with mdlayher/netlink; the socket is a blocking
// one (nlsteps.Conn), since its callers hold a locked thread in a pod's
// namespace.
type ipsetClient struct {
	c *nlsteps.Conn
	// rec, when set, takes the requests that change sets instead of the
	// kernel, for a relay to send (recordingIPSet).
	rec *nlsteps.Step
}

func dialIPSet() (*ipsetClient, error) {
	c, err := nlsteps.Dial(unix.NETLINK_NETFILTER)
	if err != nil {
		return nil, fmt.Errorf("opening ipset netlink: %w", err)
	}
	return &ipsetClient{c: c}, nil
}

func (c *ipsetClient) close() { _ = c.c.Close() }

func ipsetFamily(s *ruleset.IPSet) uint8 {
	switch {
	case s.Kind == ruleset.SetPorts:
		return unix.NFPROTO_UNSPEC
	case s.Family == ruleset.IPv6:
		return unix.NFPROTO_IPV6
	}
	return unix.NFPROTO_IPV4
}

func ipsetType(s *ruleset.IPSet) string {
	if s.Kind == ruleset.SetPorts {
		return typePorts
	}
	return typeNets
}

// request sends one ipset command and returns the kernel's replies; what
// names it where it is recorded.
func (c *ipsetClient) request(cmd int, flags netlink.HeaderFlags, what string, attrs func(*netlink.AttributeEncoder)) ([]nlsteps.Message, error) {
	ae := netlink.NewAttributeEncoder()
	ae.Uint8(nl.IPSET_ATTR_PROTOCOL, nl.IPSET_PROTOCOL)
	attrs(ae)
	b, err := ae.Encode()
	if err != nil {
		return nil, err
	}
	// nfgenmsg: family, version, resource id; ipset ignores the family.
	data := append([]byte{unix.NFPROTO_IPV4, unix.NFNETLINK_V0, 0, 0}, b...)
	if c.rec != nil {
		if flags&netlink.Dump == netlink.Dump || cmd == nl.IPSET_CMD_TYPE {
			return nil, fmt.Errorf("ipset command %d cannot be recorded: it asks the kernel", cmd)
		}
		c.rec.Add(uint16(unix.NFNL_SUBSYS_IPSET<<8|cmd), uint16(flags), data, what)
		return nil, nil
	}
	// A refusal reads in ipset's words (nlsteps.Refusal).
	return c.c.Request(uint16(unix.NFNL_SUBSYS_IPSET<<8|cmd), uint16(flags), data)
}

// typeKey names a set type for one family.
type typeKey struct {
	name   string
	family uint8
}

// revisions remembers, per set type, the newest revision the kernel has:
// what it supports does not change while the process runs, so only the
// first pod pays for asking. A failure is not remembered.
var revisions sync.Map

// revision asks the kernel for the newest revision of a set type; an
// error means this kernel cannot make such sets.
func (c *ipsetClient) revision(name string, family uint8) (uint8, error) {
	key := typeKey{name, family}
	if v, ok := revisions.Load(key); ok {
		return v.(uint8), nil
	}
	msgs, err := c.request(nl.IPSET_CMD_TYPE, 0, "", func(ae *netlink.AttributeEncoder) {
		ae.String(nl.IPSET_ATTR_TYPENAME, name)
		ae.Uint8(nl.IPSET_ATTR_FAMILY, family)
	})
	if err != nil {
		return 0, err
	}
	for _, m := range msgs {
		if len(m.Body) < 4 {
			continue
		}
		ad, err := netlink.NewAttributeDecoder(m.Body[4:])
		if err != nil {
			return 0, err
		}
		for ad.Next() {
			if ad.Type() == nl.IPSET_ATTR_REVISION {
				rev := ad.Uint8()
				revisions.Store(key, rev)
				return rev, nil
			}
		}
	}
	return 0, fmt.Errorf("the kernel named no revision of %s", name)
}

// supports reports whether the kernel can make every set of the plan.
func (c *ipsetClient) supports(sets []*ruleset.IPSet) error {
	for _, s := range sets {
		if _, err := c.revision(ipsetType(s), ipsetFamily(s)); err != nil {
			return fmt.Errorf("%s sets: %w", ipsetType(s), err)
		}
	}
	return nil
}

func be16(v uint16) []byte { return binary.BigEndian.AppendUint16(nil, v) }
func be32(v uint32) []byte { return binary.BigEndian.AppendUint32(nil, v) }

// create makes the set and fills it.
func (c *ipsetClient) create(s *ruleset.IPSet) error {
	if err := c.make(s); err != nil {
		return err
	}
	return c.fill(s)
}

// make makes the set, empty.
func (c *ipsetClient) make(s *ruleset.IPSet) error {
	rev, err := c.revision(ipsetType(s), ipsetFamily(s))
	if err != nil {
		return err
	}
	_, err = c.request(nl.IPSET_CMD_CREATE, netlink.Acknowledge|netlink.Create|netlink.Excl, "ipset create "+s.Name+" "+ipsetType(s), func(ae *netlink.AttributeEncoder) {
		ae.String(nl.IPSET_ATTR_SETNAME, s.Name)
		ae.String(nl.IPSET_ATTR_TYPENAME, ipsetType(s))
		ae.Uint8(nl.IPSET_ATTR_REVISION, rev)
		ae.Uint8(nl.IPSET_ATTR_FAMILY, ipsetFamily(s))
		ae.Nested(nl.IPSET_ATTR_DATA, func(d *netlink.AttributeEncoder) error {
			if s.Kind == ruleset.SetPorts {
				d.Bytes(nl.IPSET_ATTR_PORT_FROM|netlink.NetByteOrder, be16(0))
				d.Bytes(nl.IPSET_ATTR_PORT_TO|netlink.NetByteOrder, be16(65535))
				return nil
			}
			// Sized for its entries up front: a hash that grows is
			// rebuilt each time it doubles.
			n := uint32(max(len(s.Nets), 64))
			d.Bytes(nl.IPSET_ATTR_HASHSIZE|netlink.NetByteOrder, be32(n))
			d.Bytes(nl.IPSET_ATTR_MAXELEM|netlink.NetByteOrder, be32(max(n, 65536)))
			return nil
		})
	})
	return err
}

// fill adds the set's entries, adtBatch per message.
func (c *ipsetClient) fill(s *ruleset.IPSet) error {
	n := len(s.Nets) + len(s.Ports)
	for first := 0; first < n; first += adtBatch {
		adt := encodeEntries(s, first, min(first+adtBatch, n))
		what := fmt.Sprintf("ipset add %s: entries %d to %d of %d, from %s", s.Name, first+1, min(first+adtBatch, n), n, s.Origin)
		_, err := c.request(nl.IPSET_CMD_ADD, netlink.Acknowledge, what, func(ae *netlink.AttributeEncoder) {
			ae.String(nl.IPSET_ATTR_SETNAME, s.Name)
			// The kernel takes a list of entries only with a line number,
			// which its errors would cite; there is no file here.
			ae.Uint32(nl.IPSET_ATTR_LINENO, 0)
			ae.Bytes(nl.IPSET_ATTR_ADT|netlink.Nested, adt)
		})
		if err != nil {
			return err
		}
	}
	return nil
}

// encodeEntries writes entries [from, to) of a set (its prefixes, then
// its port ranges) as the attributes of an ADT list, directly into one
// buffer: a general encoder costs a dozen allocations an entry, which at
// thousands of entries is most of a pod's time here.
func encodeEntries(s *ruleset.IPSet, from, to int) []byte {
	b := make([]byte, 0, (to-from)*40)
	for i := from; i < to; i++ {
		data := len(b)
		b = attrHeader(b, nl.IPSET_ATTR_DATA|netlink.Nested)
		if i < len(s.Nets) {
			p := s.Nets[i]
			ip := len(b)
			b = attrHeader(b, nl.IPSET_ATTR_IP|netlink.Nested)
			typ := uint16(nl.IPSET_ATTR_IPADDR_IPV4)
			if p.Addr().Is6() {
				typ = nl.IPSET_ATTR_IPADDR_IPV6
			}
			b = appendAttr(b, typ|netlink.NetByteOrder, p.Addr().AsSlice())
			b = endAttr(b, ip)
			b = appendAttr(b, nl.IPSET_ATTR_CIDR, []byte{byte(p.Bits())})
		} else {
			r := s.Ports[i-len(s.Nets)]
			b = appendAttr(b, nl.IPSET_ATTR_PORT|netlink.NetByteOrder, be16(r.First))
			if r.Last != r.First {
				b = appendAttr(b, nl.IPSET_ATTR_PORT_TO|netlink.NetByteOrder, be16(r.Last))
			}
		}
		b = endAttr(b, data)
	}
	return b
}

// attrHeader starts a nested attribute whose length endAttr fills in.
func attrHeader(b []byte, typ uint16) []byte {
	return binary.NativeEndian.AppendUint16(binary.NativeEndian.AppendUint16(b, 0), typ)
}

func endAttr(b []byte, start int) []byte {
	binary.NativeEndian.PutUint16(b[start:], uint16(len(b)-start))
	return b
}

// appendAttr appends one attribute, padded to 4 bytes as netlink wants.
func appendAttr(b []byte, typ uint16, data []byte) []byte {
	b = binary.NativeEndian.AppendUint16(b, uint16(4+len(data)))
	b = binary.NativeEndian.AppendUint16(b, typ)
	b = append(b, data...)
	for len(b)%4 != 0 {
		b = append(b, 0)
	}
	return b
}

// flushAndFill gives an existing set exactly the wanted entries.
func (c *ipsetClient) flushAndFill(s *ruleset.IPSet) error {
	if _, err := c.request(nl.IPSET_CMD_FLUSH, netlink.Acknowledge, "ipset flush "+s.Name, func(ae *netlink.AttributeEncoder) {
		ae.String(nl.IPSET_ATTR_SETNAME, s.Name)
	}); err != nil {
		return err
	}
	return c.fill(s)
}

// errSetInUse is the kernel refusing to destroy a set rules still use.
var errSetInUse = errors.New("set in use")

func (c *ipsetClient) destroy(name string) error {
	_, err := c.request(nl.IPSET_CMD_DESTROY, netlink.Acknowledge, "ipset destroy "+name, func(ae *netlink.AttributeEncoder) {
		ae.String(nl.IPSET_ATTR_SETNAME, name)
	})
	var errno unix.Errno
	if err != nil && errors.As(err, &errno) && (errno == unix.EBUSY || errno == nl.IPSET_ERR_BUSY) {
		return errSetInUse
	}
	return err
}

// eachEntry is a decoder of a set's IPSET_ATTR_ADT attribute that calls
// fn with the attributes of each entry (one IPSET_ATTR_DATA each).
func eachEntry(fn func(d *netlink.AttributeDecoder)) func(*netlink.AttributeDecoder) error {
	return func(adt *netlink.AttributeDecoder) error {
		for adt.Next() {
			if adt.Type() == nl.IPSET_ATTR_DATA {
				adt.Nested(func(d *netlink.AttributeDecoder) error {
					fn(d)
					return nil
				})
			}
		}
		return nil
	}
}

// entryIP reads the address in an entry's IPSET_ATTR_IP attribute.
func entryIP(d *netlink.AttributeDecoder) netip.Addr {
	var addr netip.Addr
	d.Nested(func(ip *netlink.AttributeDecoder) error {
		for ip.Next() {
			addr, _ = netip.AddrFromSlice(ip.Bytes())
		}
		return nil
	})
	return addr
}

// list reads every set of ours in the namespace with its entries, as
// package ruleset describes a set (so the two compare directly).
func (c *ipsetClient) list() (map[string]*ruleset.IPSet, error) {
	msgs, err := c.request(nl.IPSET_CMD_LIST, netlink.Dump, "", func(*netlink.AttributeEncoder) {})
	if err != nil {
		return nil, fmt.Errorf("listing ipsets: %w", err)
	}
	out := map[string]*ruleset.IPSet{}
	ports := map[string][]uint16{}
	for _, m := range msgs {
		if len(m.Body) < 4 {
			continue
		}
		ad, err := netlink.NewAttributeDecoder(m.Body[4:])
		if err != nil {
			return nil, err
		}
		var name, typ string
		var family uint8
		var nets []netip.Prefix
		var pts []uint16
		for ad.Next() {
			switch ad.Type() {
			case nl.IPSET_ATTR_SETNAME:
				name = ad.String()
			case nl.IPSET_ATTR_TYPENAME:
				typ = ad.String()
			case nl.IPSET_ATTR_FAMILY:
				family = ad.Uint8()
			case nl.IPSET_ATTR_ADT:
				ad.Nested(eachEntry(func(d *netlink.AttributeDecoder) {
					var addr netip.Addr
					var bits = -1
					for d.Next() {
						switch d.Type() {
						case nl.IPSET_ATTR_IP:
							addr = entryIP(d)
						case nl.IPSET_ATTR_CIDR:
							bits = int(d.Uint8())
						case nl.IPSET_ATTR_PORT:
							pts = append(pts, binary.BigEndian.Uint16(d.Bytes()))
						}
					}
					if addr.IsValid() {
						if bits < 0 {
							bits = addr.BitLen()
						}
						nets = append(nets, netip.PrefixFrom(addr, bits))
					}
				}))
			}
		}
		if err := ad.Err(); err != nil {
			return nil, fmt.Errorf("reading ipset %s: %w", name, err)
		}
		if !strings.HasPrefix(name, ruleset.SetPrefix) {
			continue
		}
		s := out[name]
		if s == nil {
			s = &ruleset.IPSet{Name: name}
			out[name] = s
		}
		switch {
		case typ == typePorts:
			s.Kind = ruleset.SetPorts
		case typ != "":
			s.Kind = ruleset.SetNets
			s.Family = ruleset.IPv4
			if family == unix.NFPROTO_IPV6 {
				s.Family = ruleset.IPv6
			}
		}
		s.Nets = append(s.Nets, nets...)
		ports[name] = append(ports[name], pts...)
	}
	for name, s := range out {
		slices.SortFunc(s.Nets, func(a, b netip.Prefix) int { return a.Addr().Compare(b.Addr()) })
		if p := ports[name]; len(p) > 0 {
			s.Ports = ruleset.PortRanges(p)
		}
	}
	return out, nil
}
