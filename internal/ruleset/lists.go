package ruleset

import (
	"crypto/sha256"
	"encoding/binary"
	"encoding/hex"
	"fmt"
	"math/bits"
	"net/netip"
	"slices"
	"strconv"

	"github.com/istio-cni-go/istio-cni/internal/memo"
)

// SetThreshold is the longest list that keeps Istio's shape, one rule per
// entry; a longer one is matched by a single rule against a set of its
// entries. Lists this short are what operators and Istio's docs write (a
// handful of CIDRs or ports), so their rules stay byte-identical to
// Istio's. Measured on the 2-core development VM, one excluded CIDR and
// port (three rules) costs a fresh pod's apply about 95 us with
// iptables-nft, 55 us with iptables-legacy and 200 us with nftables,
// while a set costs about the same at 17 entries as at 128: the
// iptables shapes cross between 10 and 17 entries. nftables would gain
// from sets sooner, but keeps the shape of Istio's native nftables mode
// for short lists too, at 3 ms at most.
const SetThreshold = 16

// SetKind says what a set holds.
type SetKind int

const (
	// SetNets holds address prefixes of one family.
	SetNets SetKind = iota + 1
	// SetPorts holds TCP/UDP port numbers; one set serves both families.
	SetPorts
)

// PortRange is an inclusive range of ports.
type PortRange struct{ First, Last uint16 }

func (r PortRange) String() string {
	if r.First == r.Last {
		return strconv.Itoa(int(r.First))
	}
	return fmt.Sprintf("%d-%d", r.First, r.Last)
}

// IPSet is the entries of one list-valued setting, for one family, as one
// set: an ipset for iptables (matched with -m set --match-set), a named
// set for nftables. Its name carries a digest of its contents, so new
// contents get a new set that the rules switch to in the same transaction
// that changes them, and unchanged contents keep their set.
type IPSet struct {
	Name   string
	Kind   SetKind
	Family Family // of Nets; 0 for ports
	// Nets is the smallest list of prefixes covering exactly the listed
	// ones, sorted, never /0 (an ipset hash:net cannot hold it; two /1
	// cover the same).
	Nets []netip.Prefix
	// Ports are the listed ports as sorted, merged ranges.
	Ports []PortRange
	// Origin is the annotation the entries come from, for messages.
	Origin string
	// Listed is how many entries the annotation gave for this set.
	Listed int

	// sum is the SHA-256 of the contents, kept by setName, of the
	// entries' slices as they were then (summed).
	sum    [sha256.Size]byte
	summed setShape
}

// setShape is what of a set's entries a copy of the set could have
// replaced.
type setShape struct {
	nets  sliceID[netip.Prefix]
	ports sliceID[PortRange]
}

func (s *IPSet) shape() setShape { return setShape{idOf(s.Nets), idOf(s.Ports)} }

// Len is the number of entries the kernel holds for the set.
func (s *IPSet) Len() int {
	if s.Kind == SetPorts {
		n := 0
		for _, r := range s.Ports {
			n += int(r.Last-r.First) + 1
		}
		return n
	}
	return len(s.Nets)
}

// Entries renders the contents, one string per prefix or port range.
func (s *IPSet) Entries() []string {
	var out []string
	for _, p := range s.Nets {
		out = append(out, p.String())
	}
	for _, r := range s.Ports {
		out = append(out, r.String())
	}
	return out
}

// SameContents reports whether two sets hold the same entries.
func (s *IPSet) SameContents(o *IPSet) bool {
	return s.Kind == o.Kind && s.Family == o.Family && slices.Equal(s.Nets, o.Nets) && slices.Equal(s.Ports, o.Ports)
}

// builtSets are the sets of long lists already built, by their inputs
// (see package memo).
var builtSets = memo.New(2<<20, (*IPSet).memSize)

// SetPrefix starts the name of every set this plugin owns.
const SetPrefix = ChainPrefix

// setName is SetPrefix, the set's role and 8 hex digits of its contents:
// at most 28 characters, within ipset's 31. It keeps the whole digest in
// the set, for plan fingerprints.
func setName(role string, s *IPSet) string {
	s.sum, s.summed = s.contentSum(), s.shape()
	return SetPrefix + role + "_" + hex.EncodeToString(s.sum[:4])
}

// contentSum is the SHA-256 of the set's kind, family and entries in a
// fixed-width binary form.
func (s *IPSet) contentSum() [sha256.Size]byte {
	b := make([]byte, 0, 2+17*len(s.Nets)+4*len(s.Ports))
	b = append(b, byte(s.Kind), byte(s.Family))
	for _, p := range s.Nets {
		b = append(b, p.Addr().AsSlice()...)
		b = append(b, byte(p.Bits()))
	}
	for _, r := range s.Ports {
		b = binary.BigEndian.AppendUint16(b, r.First)
		b = binary.BigEndian.AppendUint16(b, r.Last)
	}
	return sha256.Sum256(b)
}

// memSize is roughly the bytes the set takes.
func (s *IPSet) memSize() int { return 128 + 32*len(s.Nets) + 4*len(s.Ports) }

// digest is the contents' SHA-256, as setName took it, unless the set has
// none kept (one read back from the kernel) or is a copy given other
// entries.
func (s *IPSet) digest() [sha256.Size]byte {
	if s.sum == ([sha256.Size]byte{}) || s.shape() != s.summed {
		return s.contentSum()
	}
	return s.sum
}

// NewNetSet makes the set of the prefixes of one family, named for role
// (for example OUT_EXCL_NET4). The set is shared with every other caller
// passing the same arguments: it must not be changed.
func NewNetSet(role, origin string, fam Family, prefixes []netip.Prefix) *IPSet {
	key := make([]byte, 0, len(role)+len(origin)+3+17*len(prefixes))
	key = append(append(append(append(key, 'n', byte(fam)), role...), 0), origin...)
	for _, p := range prefixes {
		a := p.Addr().As16()
		key = append(append(key, a[:]...), byte(p.Bits()))
	}
	s, _ := builtSets.Get(key, func() (*IPSet, error) {
		s := &IPSet{Kind: SetNets, Family: fam, Nets: Cover(prefixes), Origin: origin, Listed: len(prefixes)}
		s.Name = setName(role, s)
		return s, nil
	})
	return s
}

// NewPortSet makes the set of ports (decimal strings, already validated),
// named for role. The set is shared as NewNetSet's is.
func NewPortSet(role, origin string, ports []string) *IPSet {
	key := make([]byte, 0, len(role)+len(origin)+2+6*len(ports))
	key = append(append(append(append(key, 'p'), role...), 0), origin...)
	for _, p := range ports {
		key = append(append(key, ','), p...)
	}
	s, _ := builtSets.Get(key, func() (*IPSet, error) {
		nums := make([]uint16, 0, len(ports))
		for _, p := range ports {
			n, err := strconv.ParseUint(p, 10, 16)
			if err != nil {
				panic("ruleset: unvalidated port " + strconv.Quote(p))
			}
			nums = append(nums, uint16(n))
		}
		s := &IPSet{Kind: SetPorts, Ports: PortRanges(nums), Origin: origin, Listed: len(ports)}
		s.Name = setName(role, s)
		return s, nil
	})
	return s
}

// PortRanges sorts ports and merges runs into ranges.
func PortRanges(ports []uint16) []PortRange {
	s := slices.Clone(ports)
	slices.Sort(s)
	var out []PortRange
	for _, p := range s {
		if n := len(out); n > 0 && uint32(p) <= uint32(out[n-1].Last)+1 {
			out[n-1].Last = max(out[n-1].Last, p)
			continue
		}
		out = append(out, PortRange{p, p})
	}
	return out
}

// u128 is an address as a number, so ranges of either family can be
// merged and cut into prefixes with the same arithmetic.
type u128 struct{ hi, lo uint64 }

func addrNum(a netip.Addr) u128 {
	b := a.As16()
	return u128{binary.BigEndian.Uint64(b[:8]), binary.BigEndian.Uint64(b[8:])}
}

func (x u128) addr(fam Family) netip.Addr {
	var b [16]byte
	binary.BigEndian.PutUint64(b[:8], x.hi)
	binary.BigEndian.PutUint64(b[8:], x.lo)
	a := netip.AddrFrom16(b)
	if fam == IPv4 {
		return a.Unmap()
	}
	return a
}

func (x u128) cmp(y u128) int {
	switch {
	case x.hi != y.hi:
		if x.hi < y.hi {
			return -1
		}
		return 1
	case x.lo < y.lo:
		return -1
	case x.lo > y.lo:
		return 1
	}
	return 0
}

func (x u128) add1() u128 {
	lo, carry := bits.Add64(x.lo, 1, 0)
	return u128{x.hi + carry, lo}
}

// hostMask has the low n bits set.
func hostMask(n int) u128 {
	switch {
	case n <= 0:
		return u128{}
	case n < 64:
		return u128{0, 1<<n - 1}
	case n == 64:
		return u128{0, ^uint64(0)}
	case n < 128:
		return u128{1<<(n-64) - 1, ^uint64(0)}
	}
	return u128{^uint64(0), ^uint64(0)}
}

func (x u128) or(y u128) u128 { return u128{x.hi | y.hi, x.lo | y.lo} }

// trailingZeros of x, or 128 for zero.
func (x u128) trailingZeros() int {
	if x.lo != 0 {
		return bits.TrailingZeros64(x.lo)
	}
	if x.hi != 0 {
		return 64 + bits.TrailingZeros64(x.hi)
	}
	return 128
}

// AddrRange is an inclusive range of addresses of one family.
type AddrRange struct{ First, Last netip.Addr }

// numRange is an AddrRange as numbers; IPv4 lives in the IPv4-mapped
// part of the space, so its bits are the low 32.
type numRange struct{ first, last u128 }

// hostBits is how many bits of the 128 belong to one family's address.
func hostBits(fam Family) int {
	if fam == IPv4 {
		return 32
	}
	return 128
}

var topAddr = u128{^uint64(0), ^uint64(0)}

// numRanges turns prefixes of one family into sorted, merged (overlapping
// or adjacent), inclusive ranges.
func numRanges(prefixes []netip.Prefix) []numRange {
	rs := make([]numRange, 0, len(prefixes))
	for _, p := range prefixes {
		p = p.Masked()
		fam := IPv6
		if p.Addr().Is4() {
			fam = IPv4
		}
		first := addrNum(p.Addr())
		rs = append(rs, numRange{first, first.or(hostMask(hostBits(fam) - p.Bits()))})
	}
	slices.SortFunc(rs, func(a, b numRange) int { return a.first.cmp(b.first) })
	var out []numRange
	for _, r := range rs {
		if n := len(out); n > 0 {
			last := out[n-1].last
			if r.first.cmp(last) <= 0 || (last != topAddr && r.first.cmp(last.add1()) == 0) {
				if r.last.cmp(last) > 0 {
					out[n-1].last = r.last
				}
				continue
			}
		}
		out = append(out, r)
	}
	return out
}

// AddrRanges turns prefixes of one family into sorted inclusive ranges,
// merging those that overlap or touch: the form an nftables interval set
// takes.
func AddrRanges(prefixes []netip.Prefix) []AddrRange {
	if len(prefixes) == 0 {
		return nil
	}
	fam := IPv6
	if prefixes[0].Addr().Is4() {
		fam = IPv4
	}
	var out []AddrRange
	for _, r := range numRanges(prefixes) {
		out = append(out, AddrRange{r.first.addr(fam), r.last.addr(fam)})
	}
	return out
}

// Cover returns the fewest prefixes that match exactly the addresses the
// given prefixes of one family match, sorted. A whole family comes out
// as its two halves.
func Cover(prefixes []netip.Prefix) []netip.Prefix {
	if len(prefixes) == 0 {
		return nil
	}
	fam := IPv6
	if prefixes[0].Addr().Is4() {
		fam = IPv4
	}
	width := hostBits(fam)
	var out []netip.Prefix
	for _, r := range numRanges(prefixes) {
		cur := r.first
		for {
			// The largest block aligned at cur that stays within the range.
			size := min(cur.trailingZeros(), width)
			for size > 0 && cur.or(hostMask(size)).cmp(r.last) > 0 {
				size--
			}
			if size == width {
				// The whole family: two halves, as hash:net refuses /0.
				second := cur.or(hostMask(width - 1)).add1()
				out = append(out, netip.PrefixFrom(cur.addr(fam), 1), netip.PrefixFrom(second.addr(fam), 1))
				break
			}
			out = append(out, netip.PrefixFrom(cur.addr(fam), width-size))
			end := cur.or(hostMask(size))
			if end.cmp(r.last) >= 0 {
				break
			}
			cur = end.add1()
		}
	}
	return out
}
