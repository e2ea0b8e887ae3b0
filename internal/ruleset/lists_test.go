package ruleset

import (
	"math/rand/v2"
	"net/netip"
	"slices"
	"strconv"
	"strings"
	"testing"
)

func prefixes(s ...string) []netip.Prefix {
	var out []netip.Prefix
	for _, x := range s {
		out = append(out, netip.MustParsePrefix(x))
	}
	return out
}

func TestCover(t *testing.T) {
	cases := []struct {
		in, want []string
	}{
		{[]string{"10.0.0.0/25", "10.0.0.128/25"}, []string{"10.0.0.0/24"}},
		{[]string{"10.0.0.1/8", "10.5.0.0/16"}, []string{"10.0.0.0/8"}},
		{[]string{"10.0.0.0/32", "10.0.0.1/32", "10.0.0.2/32"}, []string{"10.0.0.0/31", "10.0.0.2/32"}},
		{[]string{"192.168.1.0/24", "10.0.0.0/8"}, []string{"10.0.0.0/8", "192.168.1.0/24"}},
		{[]string{"0.0.0.0/0"}, []string{"0.0.0.0/1", "128.0.0.0/1"}},
		{[]string{"0.0.0.0/1", "128.0.0.0/1"}, []string{"0.0.0.0/1", "128.0.0.0/1"}},
		{[]string{"255.255.255.255/32", "255.255.255.254/32"}, []string{"255.255.255.254/31"}},
		{[]string{"::/0"}, []string{"::/1", "8000::/1"}},
		{[]string{"fd00::/64", "fd00:0:0:1::/64", "fd00::1/128"}, []string{"fd00::/63"}},
		{[]string{"ffff:ffff:ffff:ffff:ffff:ffff:ffff:ffff/128"}, []string{"ffff:ffff:ffff:ffff:ffff:ffff:ffff:ffff/128"}},
		{[]string{"::ffff:10.0.0.0/104"}, []string{"::ffff:10.0.0.0/104"}},
	}
	for _, c := range cases {
		got := Cover(prefixes(c.in...))
		if !slices.Equal(got, prefixes(c.want...)) {
			t.Errorf("Cover(%v) = %v, want %v", c.in, got, c.want)
		}
	}
}

// TestCoverIsExact checks on random lists that the cover matches exactly
// the addresses the list matches, probing each prefix's edges and their
// neighbours, and that no two cover prefixes could merge.
func TestCoverIsExact(t *testing.T) {
	r := rand.New(rand.NewPCG(1, 2))
	for round := 0; round < 200; round++ {
		v6 := round%2 == 1
		var in []netip.Prefix
		for i := 0; i < 1+r.IntN(40); i++ {
			in = append(in, randomPrefix(r, v6))
		}
		cover := Cover(in)
		matches := func(set []netip.Prefix, a netip.Addr) bool {
			return slices.ContainsFunc(set, func(p netip.Prefix) bool { return p.Contains(a) })
		}
		var probes []netip.Addr
		for _, p := range append(slices.Clone(in), cover...) {
			first := p.Masked().Addr()
			last := lastAddr(p)
			probes = append(probes, first, last, first.Prev(), last.Next())
		}
		for _, a := range probes {
			if a.IsValid() && matches(in, a) != matches(cover, a) {
				t.Fatalf("list %v, cover %v: %s differs", in, cover, a)
			}
		}
		if !slices.IsSortedFunc(cover, func(a, b netip.Prefix) int { return a.Addr().Compare(b.Addr()) }) {
			t.Fatalf("cover not sorted: %v", cover)
		}
		for i := 0; i+1 < len(cover); i++ {
			if cover[i].Bits() == cover[i+1].Bits() && cover[i].Bits() > 0 {
				parent, _ := cover[i].Addr().Prefix(cover[i].Bits() - 1)
				if parent.Contains(cover[i+1].Addr()) && parent.Addr() == cover[i].Addr() {
					t.Fatalf("cover %v is not minimal: %s and %s make %s", cover, cover[i], cover[i+1], parent)
				}
			}
		}
	}
}

func randomPrefix(r *rand.Rand, v6 bool) netip.Prefix {
	if v6 {
		var b [16]byte
		b[0], b[1] = 0xfd, 0x00
		b[15] = byte(r.IntN(256))
		b[14] = byte(r.IntN(4))
		return netip.PrefixFrom(netip.AddrFrom16(b), 112+r.IntN(17))
	}
	a := netip.AddrFrom4([4]byte{10, 0, byte(r.IntN(4)), byte(r.IntN(256))})
	return netip.PrefixFrom(a, 20+r.IntN(13))
}

func lastAddr(p netip.Prefix) netip.Addr {
	b := p.Masked().Addr().AsSlice()
	for i := p.Bits(); i < len(b)*8; i++ {
		b[i/8] |= 0x80 >> (i % 8)
	}
	a, _ := netip.AddrFromSlice(b)
	return a
}

func TestPortRanges(t *testing.T) {
	got := PortRanges([]uint16{80, 22, 81, 82, 65535, 0, 82, 1})
	want := []PortRange{{0, 1}, {22, 22}, {80, 82}, {65535, 65535}}
	if !slices.Equal(got, want) {
		t.Fatalf("got %v want %v", got, want)
	}
	if got := PortRanges([]uint16{65534, 65535, 65535}); !slices.Equal(got, []PortRange{{65534, 65535}}) {
		t.Fatalf("top of the range: %v", got)
	}
}

// TestSetNamesFollowContents: a set's name changes with its contents and
// only with them (order and duplicates of the list do not count), and
// fits ipset's 31 characters.
func TestSetNamesFollowContents(t *testing.T) {
	a := NewNetSet("OUT_EXCL_NET4", "x", IPv4, prefixes("10.0.0.0/8", "192.168.0.0/16"))
	b := NewNetSet("OUT_EXCL_NET4", "x", IPv4, prefixes("192.168.0.0/16", "10.0.0.0/8", "10.1.0.0/16"))
	c := NewNetSet("OUT_EXCL_NET4", "x", IPv4, prefixes("10.0.0.0/8", "192.168.0.0/17"))
	if a.Name != b.Name || a.Name == c.Name {
		t.Fatalf("names %s %s %s", a.Name, b.Name, c.Name)
	}
	for _, role := range []string{"OUT_EXCL_NET4", "OUT_EXCL_PORT", "OUT_INCL_NET6", "IN_INCL_PORT"} {
		if n := NewPortSet(role, "x", []string{"1"}).Name; len(n) > 31 || !strings.HasPrefix(n, SetPrefix) {
			t.Fatalf("set name %q", n)
		}
	}
}

// TestSetsBuiltOncePerInput: the sets of equal lists are one set (pods of
// one Deployment), a list differing in anything its set records (role,
// origin, an entry, the order of entries) another, and a fingerprint
// follows the contents either way.
func TestSetsBuiltOncePerInput(t *testing.T) {
	var nets []netip.Prefix
	var ports []string
	for i := 0; i < 1000; i++ {
		nets = append(nets, netip.PrefixFrom(netip.AddrFrom4([4]byte{10, byte(i >> 8), byte(i), 0}), 24))
		ports = append(ports, strconv.Itoa(20000+2*i))
	}
	a := NewNetSet("OUT_EXCL_NET4", "x", IPv4, nets)
	if b := NewNetSet("OUT_EXCL_NET4", "x", IPv4, slices.Clone(nets)); b != a {
		t.Fatal("an equal list built its set again")
	}
	if b := NewNetSet("OUT_EXCL_NET4", "y", IPv4, nets); b == a || b.Origin != "y" {
		t.Fatal("a list from another annotation shares a set that names the first")
	}
	if b := NewNetSet("OUT_INCL_NET4", "x", IPv4, nets); b == a || b.Name == a.Name {
		t.Fatal("a list of another role shares its set")
	}
	reordered := slices.Clone(nets)
	reordered[0], reordered[1] = reordered[1], reordered[0]
	if b := NewNetSet("OUT_EXCL_NET4", "x", IPv4, reordered); b == a || b.Name != a.Name {
		t.Fatalf("reordered list: same set %v, names %s %s; want its own set of the same contents", b == a, b.Name, a.Name)
	}
	changed := slices.Clone(nets)
	changed[999] = netip.MustParsePrefix("10.3.231.0/25")
	if b := NewNetSet("OUT_EXCL_NET4", "x", IPv4, changed); b.Name == a.Name || b.digest() == a.digest() {
		t.Fatal("a list differing in its last entry got the same contents")
	}
	p := NewPortSet("OUT_EXCL_PORT", "x", ports)
	if q := NewPortSet("OUT_EXCL_PORT", "x", slices.Clone(ports)); q != p {
		t.Fatal("an equal port list built its set again")
	}
	if q := NewPortSet("OUT_EXCL_PORT", "x", append(slices.Clone(ports[:999]), "1")); q == p || q.digest() == p.digest() {
		t.Fatal("a port list differing in its last entry got the same contents")
	}
	if a.digest() != a.contentSum() || p.digest() != p.contentSum() {
		t.Fatal("a kept digest is not the contents'")
	}
	// A copy given other entries (as tests make) is digested afresh.
	cp := *a
	cp.Nets = cp.Nets[:len(cp.Nets)-1]
	if cp.digest() == a.digest() || cp.digest() != cp.contentSum() {
		t.Fatal("a copy with fewer entries kept the original's digest")
	}
}
