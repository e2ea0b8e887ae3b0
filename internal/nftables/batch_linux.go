package nftables

import (
	"errors"
	"fmt"
	"sort"
	"strings"

	"github.com/google/nftables"
	"github.com/google/nftables/expr"
	"github.com/mdlayher/netlink"
	"golang.org/x/sys/unix"
)

// ackBytes bounds what one reply to a batch message costs the socket's
// receive queue: with capped acknowledgements a reply is a 36-byte
// message whatever the size of the message it answers, but the queue
// counts the kernel's whole buffer for it, about 1.3 KiB on this kernel
// (TestReceiveBufferPerReply holds the bound).
const ackBytes = 2048

// bufferSlack is room beyond what a batch needs: the library's reads of
// tables and rules on the same socket, and the kernel's own overhead.
const bufferSlack = 64 << 10

// batchSize is how many messages the batch that programs rs sends and
// about how many bytes it takes, for sizing the socket: the kernel takes
// a batch in one send, which fails when it exceeds the send buffer, and
// answers every message before the library reads any answer, so the
// receive buffer must hold every reply at once.
func (rs *Ruleset) batchSize() (msgs, size int) {
	// Batch begin and end, the old tables' deletion, tables, chains.
	msgs = 2 + 2*len(rs.Tables) + len(rs.Chains)
	size = msgs * 256
	for _, st := range rs.Sets {
		chunks := (len(st.Elements) + elemBatch - 1) / elemBatch
		msgs += 1 + chunks
		// Per element: nested element, key and flags attributes.
		size += 256 + len(st.Elements)*(int(st.KeyType.Bytes)+32)
	}
	for _, r := range rs.Rules {
		msgs++
		size += 128
		for _, e := range r.Exprs {
			if b, err := expr.Marshal(byte(nftables.TableFamilyINet), e); err == nil {
				size += len(b) + 8
			}
		}
	}
	return msgs, size
}

// sizeFor returns the socket option that fits the connection to rs.
func (a *Applier) sizeFor(rs *Ruleset) nftables.SockOption {
	msgs, size := rs.batchSize()
	snd, rcv := size+bufferSlack, msgs*ackBytes+bufferSlack
	forced := false
	if a.sndBuf > 0 {
		snd, forced = a.sndBuf, true
	}
	if a.rcvBuf > 0 {
		rcv, forced = a.rcvBuf, true
	}
	return func(c *netlink.Conn) error {
		// A reply to a refused message would otherwise repeat the
		// message, up to 64 KiB for a set's elements.
		if err := c.SetOption(netlink.CapAcknowledge, true); err != nil {
			return fmt.Errorf("capping nftables acknowledgements: %w", err)
		}
		raw, err := c.SyscallConn()
		if err != nil {
			return err
		}
		var serr error
		if err := raw.Control(func(fd uintptr) {
			serr = errors.Join(setBuffer(int(fd), unix.SO_SNDBUF, unix.SO_SNDBUFFORCE, snd, forced),
				setBuffer(int(fd), unix.SO_RCVBUF, unix.SO_RCVBUFFORCE, rcv, forced))
		}); err != nil {
			return err
		}
		return serr
	}
}

// setBuffer makes a socket buffer at least n bytes (exactly n when
// exact), past the node's sysctl limit where the process may (it needs
// CAP_NET_ADMIN, which programming rules needs anyway).
func setBuffer(fd, opt, force, n int, exact bool) error {
	if exact {
		return unix.SetsockoptInt(fd, unix.SOL_SOCKET, opt, n)
	}
	// The kernel reports twice what was set (its bookkeeping share).
	if cur, err := unix.GetsockoptInt(fd, unix.SOL_SOCKET, opt); err == nil && cur/2 >= n {
		return nil
	}
	if err := unix.SetsockoptInt(fd, unix.SOL_SOCKET, force, n); err == nil {
		return nil
	}
	return unix.SetsockoptInt(fd, unix.SOL_SOCKET, opt, n)
}

// landed reports, after the kernel's replies to a batch were lost for
// want of room, whether the batch went through: its tables are there,
// exactly. (The kernel answers after committing; a batch it refused left
// the namespace as it was.) It runs in the pod's namespace.
func landed(rs *Ruleset, err error) bool {
	if !errors.Is(err, unix.ENOBUFS) {
		return false
	}
	conn, cerr := nftables.New(nftables.AsLasting())
	if cerr != nil {
		return false
	}
	defer func() { _ = conn.CloseLasting() }()
	existing, lerr := ourTables(conn, rs.tablePrefix())
	if lerr != nil {
		return false
	}
	diffs, derr := diff(conn, existing, rs)
	return derr == nil && len(diffs) == 0
}

// sizeErrors are the kernel's ways of saying a batch is too large: for
// the socket, for its replies, or for memory.
var sizeErrors = []error{unix.EMSGSIZE, unix.ENOBUFS, unix.ENOMEM, unix.E2BIG, unix.ENOSPC}

// refusal says why the kernel did not take the batch, naming the
// list-valued settings it carried, the largest first: when the batch
// was too large, that is the setting to shorten. The batch is one
// transaction, so the namespace is as it was before.
func refusal(rs *Ruleset, err error) error {
	lists := rs.lists()
	msgs, size := rs.batchSize()
	what := fmt.Sprintf("%d messages, about %d KiB", msgs, (size+1023)/1024)
	tooLarge := false
	for _, e := range sizeErrors {
		tooLarge = tooLarge || errors.Is(err, e)
	}
	switch {
	case tooLarge && len(lists) > 0:
		return fmt.Errorf("programming nftables rules: the batch (%s) is too large for the kernel: %s is the largest list (%s); nothing was changed: %w",
			what, lists[0].origin, lists[0].describe(), err)
	case len(lists) > 0:
		var parts []string
		for _, l := range lists {
			parts = append(parts, l.origin+" ("+l.describe()+")")
		}
		return fmt.Errorf("programming nftables rules: the kernel refused the batch (%s; lists from %s); nothing was changed: %w",
			what, strings.Join(parts, ", "), err)
	}
	return fmt.Errorf("programming nftables rules: the kernel refused the batch (%s); nothing was changed: %w", what, err)
}

// listSize is what one list-valued setting puts into a batch.
type listSize struct {
	origin   string
	entries  int
	elements int
	rules    int
}

func (l listSize) describe() string {
	if l.elements > 0 {
		return fmt.Sprintf("%d entries, %d set elements", l.entries, l.elements)
	}
	return fmt.Sprintf("%d rules", l.rules)
}

// lists sums, per setting, its sets' elements and its rules, largest
// first.
func (rs *Ruleset) lists() []listSize {
	by := map[string]*listSize{}
	get := func(origin string) *listSize {
		if by[origin] == nil {
			by[origin] = &listSize{origin: origin}
		}
		return by[origin]
	}
	for _, st := range rs.Sets {
		l := get(st.Origin)
		l.entries = max(l.entries, st.Listed)
		l.elements += len(st.Elements)
	}
	for _, r := range rs.Rules {
		if r.Origin != "" {
			get(r.Origin).rules++
		}
	}
	out := make([]listSize, 0, len(by))
	for _, l := range by {
		out = append(out, *l)
	}
	sort.Slice(out, func(i, j int) bool {
		wi, wj := out[i].elements+out[i].rules, out[j].elements+out[j].rules
		if wi != wj {
			return wi > wj
		}
		return out[i].origin < out[j].origin
	})
	return out
}

// diffSets compares the sets of our tables with the ruleset's: each one
// wanted must be there with the same type and elements, and no other.
func diffSets(conn *nftables.Conn, have map[string]*nftables.Table, rs *Ruleset) ([]string, error) {
	var diffs []string
	want := map[string]*Set{}
	for _, st := range rs.Sets {
		want[st.Table+"/"+st.Name] = st
	}
	tables := make([]string, 0, len(have))
	for name := range have {
		tables = append(tables, name)
	}
	sort.Strings(tables)
	seen := map[string]bool{}
	for _, name := range tables {
		sets, err := conn.GetSets(have[name])
		if err != nil {
			return nil, fmt.Errorf("listing sets of %s: %w", name, err)
		}
		for _, ks := range sets {
			key := name + "/" + ks.Name
			w := want[key]
			if w == nil {
				diffs = append(diffs, "unexpected set "+key)
				continue
			}
			seen[key] = true
			if ks.KeyType.Name != w.KeyType.Name || ks.Interval != w.Interval {
				diffs = append(diffs, fmt.Sprintf("set %s has type %s (interval %v), want %s (interval %v)", key, ks.KeyType.Name, ks.Interval, w.KeyType.Name, w.Interval))
				continue
			}
			if w.KeepElements {
				continue
			}
			elems, err := conn.GetSetElements(ks)
			if err != nil {
				return nil, fmt.Errorf("reading set %s: %w", key, err)
			}
			if !sameElements(elems, w.Elements) {
				diffs = append(diffs, fmt.Sprintf("set %s holds %d elements, want %d (from %s)", key, len(elems), len(w.Elements), w.Origin))
			}
		}
	}
	for _, st := range rs.Sets {
		key := st.Table + "/" + st.Name
		if !seen[key] && have[st.Table] != nil {
			diffs = append(diffs, fmt.Sprintf("set %s (from %s) missing", key, st.Origin))
		}
	}
	return diffs, nil
}

// sameElements compares elements as key and interval-end flag, in any
// order (the kernel lists them in its own).
func sameElements(a, b []nftables.SetElement) bool {
	if len(a) != len(b) {
		return false
	}
	key := func(e nftables.SetElement) string {
		if e.IntervalEnd {
			return string(e.Key) + "\x00end"
		}
		return string(e.Key)
	}
	ka, kb := make([]string, len(a)), make([]string, len(b))
	for i := range a {
		ka[i], kb[i] = key(a[i]), key(b[i])
	}
	sort.Strings(ka)
	sort.Strings(kb)
	for i := range ka {
		if ka[i] != kb[i] {
			return false
		}
	}
	return true
}
