package nftables

import (
	"bytes"
	"crypto/sha256"
	"encoding/binary"
	"encoding/hex"
	"fmt"
	"net/netip"
	"slices"
	"strconv"
	"strings"

	"github.com/google/nftables"
	"github.com/google/nftables/expr"

	"github.com/istio-cni-go/istio-cni/internal/redirect"
	"github.com/istio-cni-go/istio-cni/internal/ruleset"
)

// addSet adds a set to the ruleset once per table and name (the IPv4
// and IPv6 rules of a port list share one), numbering it for the
// transaction.
func (rs *Ruleset) addSet(s *Set) *Set {
	for _, x := range rs.Sets {
		if x.Table == s.Table && x.Name == s.Name {
			return x
		}
	}
	s.ID = uint32(len(rs.Sets) + 1)
	rs.Sets = append(rs.Sets, s)
	return s
}

// tableSet finds the set a rule of table looks up: an ipset of the plan
// (by its name, from "--match-set"), made into a set of that table on
// first use, or a set already added under its nftables name.
func (rs *Ruleset) tableSet(table, name string, plan *ruleset.Set) (*Set, error) {
	bits := 0
	if base, l, ok := strings.Cut(name, "/"); ok {
		name = base
		bits, _ = strconv.Atoi(l)
	}
	ip := plan.IPSet(name)
	if ip != nil {
		name = ChainName(ip.Name)
		if bits > 0 {
			name += "-" + strconv.Itoa(bits)
		}
	}
	for _, x := range rs.Sets {
		if x.Table == table && x.Name == name {
			return x, nil
		}
	}
	if ip == nil {
		return nil, fmt.Errorf("no set %s", name)
	}
	if bits > 0 {
		return rs.addSet(prefixSet(table, name, ip, bits)), nil
	}
	return rs.addSet(fromIPSet(table, ip)), nil
}

// maxHashLengths is how many prefix lengths a CIDR list may have and
// still be looked up as a hash set per length (a rule each); a list of
// more lengths is one interval set instead.
const maxHashLengths = 8

// prefixLengths lists the lengths of a list's prefixes, longest first.
func prefixLengths(ip *ruleset.IPSet) []int {
	seen := map[int]bool{}
	var out []int
	for _, p := range ip.Nets {
		if !seen[p.Bits()] {
			seen[p.Bits()] = true
			out = append(out, p.Bits())
		}
	}
	slices.Sort(out)
	slices.Reverse(out)
	return out
}

// splitNetMatches writes a rule matching a CIDR list of at most
// maxHashLengths prefix lengths as one rule per length, each against the
// set of that length ("NAME/LEN"): the rules of a list are alike but for
// the match and run one after another, so together they decide as the
// one rule did.
func splitNetMatches(items []runItem, plan *ruleset.Set) []runItem {
	var out []runItem
	for _, it := range items {
		ip := plan.IPSet(it.MatchSet())
		if ip == nil || ip.Kind != ruleset.SetNets {
			out = append(out, it)
			continue
		}
		lengths := prefixLengths(ip)
		if len(lengths) > maxHashLengths {
			out = append(out, it)
			continue
		}
		for _, l := range lengths {
			x := it
			x.Args = slices.Clone(it.Args)
			for i := range x.Args {
				if i > 0 && x.Args[i-1] == "--match-set" {
					x.Args[i] = ip.Name + "/" + strconv.Itoa(l)
				}
			}
			out = append(out, x)
		}
	}
	return out
}

// prefixSet makes the hash set of a list's prefixes of one length.
func prefixSet(table, name string, ip *ruleset.IPSet, bits int) *Set {
	width := 4
	s := &Set{Table: table, Name: name, KeyType: nftables.TypeIPAddr, Bits: bits, Origin: ip.Origin, Listed: ip.Listed}
	if ip.Family == ruleset.IPv6 {
		width, s.KeyType = 16, nftables.TypeIP6Addr
	}
	n := 0
	for _, p := range ip.Nets {
		if p.Bits() == bits {
			n++
		}
	}
	a := newArena(width, n)
	s.Elements = make([]nftables.SetElement, 0, n)
	for _, p := range ip.Nets {
		if p.Bits() == bits {
			s.Elements = append(s.Elements, nftables.SetElement{Key: a.addr(p.Addr())})
			s.names = append(s.names, p.String())
		}
	}
	s.Size = uint32(n)
	return s
}

// portKey is the key of a port set: a protocol and a port, each padded
// to 4 bytes as the registers a rule loads them into are.
var portKey = nftables.MustConcatSetType(nftables.TypeInetProto, nftables.TypeInetService)

// fromIPSet makes the nftables set of a list: prefixes as merged
// intervals; ports keyed by protocol, whose elements each rule that looks
// the set up adds for its protocol (withProto), or, when the ports run
// on for more than two in a row on average, as merged intervals.
//
// A set of bare ports would be the kernel's bitmap type (2-byte keys),
// whose every insert walks all the elements before it. An interval set
// takes two elements a run of ports, in a tree, for all protocols; the
// keyed set one element a port and protocol, in a hash. Measured on the
// 2-core VM, a fresh namespace's batch holding 1,000 ports two apart
// took 1.67 ms (p50) as an interval set, 2.2 ms as a bitmap, and keyed
// by protocol 0.93 ms for TCP rules alone and 1.13 ms for TCP and UDP
// (2,000 hash elements). Maps hash bare ports, but a rule may only look
// a map's keys up from kernel 6.5 on; keyed sets need no newer kernel
// than nftables NAT does.
func fromIPSet(table string, ip *ruleset.IPSet) *Set {
	s := &Set{Table: table, Name: ChainName(ip.Name), list: ip, Origin: ip.Origin, Listed: ip.Listed}
	var rs []keyRange
	switch {
	case ip.Kind == ruleset.SetPorts && portCount(ip) <= 2*len(ip.Ports):
		s.KeyType = portKey
		return s
	case ip.Kind == ruleset.SetPorts:
		s.KeyType, s.Interval = nftables.TypeInetService, true
		a := newArena(2, 2*len(ip.Ports))
		for _, p := range ip.Ports {
			lo, hi := a.key(), a.key()
			binary.BigEndian.PutUint16(lo, p.First)
			binary.BigEndian.PutUint16(hi, p.Last)
			rs = append(rs, keyRange{lo, hi})
		}
	default:
		width := 4
		s.KeyType, s.Interval = nftables.TypeIPAddr, true
		if ip.Family == ruleset.IPv6 {
			width, s.KeyType = 16, nftables.TypeIP6Addr
		}
		ranges := ruleset.AddrRanges(ip.Nets)
		a := newArena(width, 2*len(ranges))
		rs = make([]keyRange, 0, len(ranges))
		for _, r := range ranges {
			rs = append(rs, keyRange{a.addr(r.First), a.addr(r.Last)})
		}
	}
	s.Elements = intervalElements(rs)
	return s
}

// portCount is how many ports a port list's ranges hold.
func portCount(ip *ruleset.IPSet) int {
	n := 0
	for _, r := range ip.Ports {
		n += int(r.Last-r.First) + 1
	}
	return n
}

// withProto adds to a port set the elements pairing proto with each of
// its ports, once per protocol.
func (s *Set) withProto(proto byte) {
	if slices.Contains(s.protos, proto) {
		return
	}
	s.protos = append(s.protos, proto)
	n := portCount(s.list)
	a := newArena(int(portKey.Bytes), n)
	s.Elements = slices.Grow(s.Elements, n)
	for _, r := range s.list.Ports {
		for p := uint32(r.First); p <= uint32(r.Last); p++ {
			k := a.key()
			k[0] = proto
			binary.BigEndian.PutUint16(k[4:], uint16(p))
			s.Elements = append(s.Elements, nftables.SetElement{Key: k})
		}
	}
	s.Size = uint32(len(s.Elements))
}

// arena hands out keys of one width from one allocation: a set of
// thousands of entries would otherwise cost an allocation per key.
type arena struct {
	buf   []byte
	width int
}

func newArena(width, n int) *arena { return &arena{buf: make([]byte, 0, width*n), width: width} }

func (a *arena) key() []byte {
	if len(a.buf)+a.width > cap(a.buf) {
		a.buf = make([]byte, 0, cap(a.buf)+a.width*64)
	}
	a.buf = a.buf[:len(a.buf)+a.width]
	return a.buf[len(a.buf)-a.width : len(a.buf) : len(a.buf)]
}

func (a *arena) addr(x netip.Addr) []byte {
	k := a.key()
	if a.width == 4 {
		b := x.As4()
		copy(k, b[:])
	} else {
		b := x.As16()
		copy(k, b[:])
	}
	return k
}

// ifnameSet makes the set of interface names of a merged run: a name is
// the range of itself, a "name+" wildcard the range of every name it
// starts.
func ifnameSet(table, origin string, names []string) *Set {
	sorted := slices.Clone(names)
	slices.Sort(sorted)
	sorted = slices.Compact(sorted)
	h := sha256.Sum256([]byte(strings.Join(sorted, ",")))
	role := "excl-if"
	if origin != redirect.AnnotationExcludeInterfaces {
		role = "reroute-if"
	}
	s := &Set{Table: table, Name: "istio-" + role + "-" + hex.EncodeToString(h[:4]),
		KeyType: nftables.TypeIFName, Interval: true, Origin: origin, Listed: len(names)}
	var rs []keyRange
	for _, n := range sorted {
		lo := make([]byte, 16)
		hi := make([]byte, 16)
		if prefix, ok := strings.CutSuffix(n, "+"); ok {
			copy(lo, prefix)
			copy(hi, prefix)
			for i := len(prefix); i < 16; i++ {
				hi[i] = 0xff
			}
			s.names = append(s.names, strconv.Quote(prefix+"*"))
		} else {
			copy(lo, n)
			copy(hi, n)
			s.names = append(s.names, strconv.Quote(n))
		}
		rs = append(rs, keyRange{lo, hi})
	}
	s.Elements = intervalElements(rs)
	return s
}

// Entries renders the set's contents, for goldens and logs.
func (s *Set) Entries() []string {
	if s.KeyType.Name == portKey.Name {
		out := make([]string, len(s.Elements))
		for i := range s.Elements {
			k := s.Elements[i].Key
			proto := strconv.Itoa(int(k[0]))
			for name, n := range protoNumbers {
				if n == k[0] {
					proto = name
				}
			}
			out[i] = proto + " . " + strconv.Itoa(int(binary.BigEndian.Uint16(k[4:])))
		}
		return out
	}
	if s.list != nil {
		return s.list.Entries()
	}
	return s.names
}

// keyRange is an inclusive range of fixed-width big-endian keys; the
// elements made from it share its slices.
type keyRange struct{ lo, hi []byte }

// intervalElements turns ranges into the elements of an interval set,
// as nft writes them: merged ranges, each a start element and an end
// element one past its last key (none for a range reaching the top), and
// an end element at zero before the first range unless it starts there.
func intervalElements(rs []keyRange) []nftables.SetElement {
	if len(rs) == 0 {
		return nil
	}
	slices.SortFunc(rs, func(a, b keyRange) int { return bytes.Compare(a.lo, b.lo) })
	width := len(rs[0].lo)
	ends := newArena(width, len(rs)+1)
	// next writes k+1 into a new key; false when k is the largest.
	next := func(k []byte) ([]byte, bool) {
		out := ends.key()
		copy(out, k)
		for i := len(out) - 1; i >= 0; i-- {
			out[i]++
			if out[i] != 0 {
				return out, true
			}
		}
		return nil, false
	}
	merged := make([]keyRange, 0, len(rs))
	for _, r := range rs {
		if n := len(merged); n > 0 {
			last := merged[n-1].hi
			// Overlapping or touching: one range (a range that reaches the
			// top swallows all that follow).
			if isTop(last) || bytes.Compare(r.lo, last) <= 0 || adjacent(last, r.lo) {
				if bytes.Compare(r.hi, last) > 0 {
					merged[n-1].hi = r.hi
				}
				continue
			}
		}
		merged = append(merged, r)
	}
	out := make([]nftables.SetElement, 0, 2*len(merged)+1)
	if !isZero(merged[0].lo) {
		out = append(out, nftables.SetElement{Key: make([]byte, width), IntervalEnd: true})
	}
	for _, r := range merged {
		out = append(out, nftables.SetElement{Key: r.lo})
		if end, ok := next(r.hi); ok {
			out = append(out, nftables.SetElement{Key: end, IntervalEnd: true})
		}
	}
	return out
}

func isZero(k []byte) bool { return !slices.ContainsFunc(k, func(b byte) bool { return b != 0 }) }
func isTop(k []byte) bool  { return !slices.ContainsFunc(k, func(b byte) bool { return b != 0xff }) }

// adjacent reports whether b is a+1.
func adjacent(a, b []byte) bool {
	carry := true
	for i := len(a) - 1; i >= 0; i-- {
		want := a[i]
		if carry {
			want++
			carry = want == 0
		}
		if b[i] != want {
			return false
		}
	}
	return !carry
}

// runItem is a rule, or a run of interface rules merged into one rule
// that looks the name up in a set: names is the run's names and at the
// position of the name in Args.
type runItem struct {
	ruleset.Rule
	names []string
	at    int
}

// ifaceAt returns the position of the value of the rule's only "-i" or
// "-o" option, or -1 when it has none, more, or a negated one.
func ifaceAt(args []string) int {
	at := -1
	for i := 0; i+1 < len(args); i++ {
		if args[i] == "-i" || args[i] == "-o" {
			if at >= 0 || (i > 0 && args[i-1] == "!") {
				return -1
			}
			at = i + 1
		}
	}
	return at
}

// mergeInterfaceRuns merges each run of more than SetThreshold adjacent
// rules of one interface list that differ only in the interface name
// into one rule against a set of the names. Interface lists stay a rule
// per name in the plan (iptables has no set of names); one rule per name
// here would be a netlink message per name.
func mergeInterfaceRuns(rules []ruleset.Rule) []runItem {
	var out []runItem
	for i := 0; i < len(rules); {
		r := rules[i]
		at := ifaceAt(r.Args)
		j := i + 1
		if r.Origin != "" && at >= 0 {
			for j < len(rules) && sameButAt(rules[j], r, at) {
				j++
			}
		}
		if j-i <= ruleset.SetThreshold {
			for _, x := range rules[i:j] {
				out = append(out, runItem{Rule: x})
			}
			i = j
			continue
		}
		item := runItem{Rule: r, at: at}
		for _, x := range rules[i:j] {
			item.names = append(item.names, x.Args[at])
		}
		out = append(out, item)
		i = j
	}
	return out
}

func sameButAt(x, r ruleset.Rule, at int) bool {
	if x.Origin != r.Origin || len(x.Args) != len(r.Args) || ifaceAt(x.Args) != at {
		return false
	}
	for k := range x.Args {
		if k != at && x.Args[k] != r.Args[k] {
			return false
		}
	}
	return true
}

// lookup matches the value the load expression puts in register 1
// against a set.
func (b *builder) lookup(word string, neg bool, s *Set, load expr.Any) {
	t := ""
	if neg {
		t = "!= "
	}
	b.add(word+" "+t+"@"+s.Name, load, &expr.Lookup{SourceRegister: 1, SetName: s.Name, SetID: s.ID, Invert: neg})
}

// lookupAddr looks the destination address up in a set, masked to the
// set's prefix length when it holds prefixes of one length.
func (b *builder) lookupAddr(word string, neg bool, s *Set, off, size uint32) {
	load := &expr.Payload{DestRegister: 1, Base: expr.PayloadBaseNetworkHeader, Offset: off, Len: size}
	if s.Bits == 0 || s.Bits == int(size*8) {
		b.lookup(word, neg, s, load)
		return
	}
	mask := make([]byte, size)
	for i := 0; i < s.Bits; i++ {
		mask[i/8] |= 0x80 >> (i % 8)
	}
	m, _ := netip.AddrFromSlice(mask)
	t := ""
	if neg {
		t = "!= "
	}
	b.add(word+" & "+m.String()+" "+t+"@"+s.Name, load,
		&expr.Bitwise{SourceRegister: 1, DestRegister: 1, Len: size, Mask: mask, Xor: make([]byte, size)},
		&expr.Lookup{SourceRegister: 1, SetName: s.Name, SetID: s.ID, Invert: neg})
}

// matchSet is "-m set --match-set NAME dst": the destination address or
// port, by the set's kind, looked up in it.
func (b *builder) matchSet(neg bool, name, dir string) error {
	if dir != "dst" {
		return fmt.Errorf("only destination set matches are supported, not %q", dir)
	}
	s, err := b.sets(name)
	if err != nil {
		return err
	}
	switch s.KeyType.Name {
	case nftables.TypeInetService.Name:
		if b.proto == "" {
			return fmt.Errorf("port set match without a protocol")
		}
		b.lookup(b.proto+" dport", neg, s, &expr.Payload{DestRegister: 1, Base: expr.PayloadBaseTransportHeader, Offset: 2, Len: 2})
		return nil
	case portKey.Name:
		proto, ok := protoNumbers[b.proto]
		if !ok {
			return fmt.Errorf("port set match without a protocol")
		}
		s.withProto(proto)
		t := ""
		if neg {
			t = "!= "
		}
		// The protocol into the first register, the port into the one
		// after it (NFT_REG32_01): the key as the set lays it out.
		b.add("meta l4proto . "+b.proto+" dport "+t+"@"+s.Name,
			&expr.Meta{Key: expr.MetaKeyL4PROTO, Register: 1},
			&expr.Payload{DestRegister: 9, Base: expr.PayloadBaseTransportHeader, Offset: 2, Len: 2},
			&expr.Lookup{SourceRegister: 1, SetName: s.Name, SetID: s.ID, Invert: neg})
		return nil
	case nftables.TypeIPAddr.Name:
		if b.fam != ruleset.IPv4 {
			return fmt.Errorf("IPv4 set %s in an IPv6 rule", name)
		}
		b.lookupAddr("ip daddr", neg, s, 16, 4)
	case nftables.TypeIP6Addr.Name:
		if b.fam != ruleset.IPv6 {
			return fmt.Errorf("IPv6 set %s in an IPv4 rule", name)
		}
		b.lookupAddr("ip6 daddr", neg, s, 24, 16)
	default:
		return fmt.Errorf("set %s of type %s cannot be matched", name, s.KeyType.Name)
	}
	return nil
}
