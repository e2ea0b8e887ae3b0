package podnet

import (
	"net/netip"
	"slices"
	"strings"
	"testing"

	"github.com/containernetworking/plugins/pkg/ns"
	"github.com/vishvananda/netlink"

	"github.com/istio-cni-go/istio-cni/internal/nsfacts"
	"github.com/istio-cni-go/istio-cni/internal/ruleset"
	"github.com/istio-cni-go/istio-cni/internal/testutil"
)

func TestPodAddrsListsIPv4First(t *testing.T) {
	n := testutil.NewNS(t)
	if err := n.Do(func(ns.NetNS) error { return SyncRouting(dual(false)) }); err != nil {
		t.Fatal(err)
	}
	addrs, err := PodAddrs(n.Path())
	if err != nil {
		t.Fatal(err)
	}
	want := []netip.Addr{netip.MustParseAddr("127.0.0.1"), netip.MustParseAddr("::1"), netip.MustParseAddr("::6")}
	for _, w := range want {
		if !slices.Contains(addrs, w) {
			t.Errorf("addresses %v lack %v", addrs, w)
		}
	}
	if len(addrs) == 0 || !addrs[0].Is4() {
		t.Errorf("addresses %v do not start with IPv4", addrs)
	}
}

// TestTProxyRoutingFollowsThePlan: the policy rule and its table come with
// a TPROXY plan, Mismatch sees them missing before and present after, and
// a plan without TPROXY takes them away again.
func TestTProxyRoutingFollowsThePlan(t *testing.T) {
	n := testutil.NewNS(t)
	err := n.Do(func(ns.NetNS) error {
		if err := Mismatch(dual(true), nil); err == nil || !strings.Contains(err.Error(), "fwmark 1337 lookup 133 missing") {
			t.Errorf("before: Mismatch = %v, want the policy rule missing", err)
		}
		if err := Mismatch(dual(false), nil); err != nil {
			t.Errorf("a plan without TPROXY: Mismatch = %v", err)
		}
		if err := SyncRouting(dual(true)); err != nil {
			return err
		}
		// Twice: a namespace already set up is no error.
		if err := SyncRouting(dual(true)); err != nil {
			return err
		}
		if err := Mismatch(dual(true), nil); err != nil {
			t.Errorf("after: Mismatch = %v", err)
		}
		for _, fam := range []int{netlink.FAMILY_V4, netlink.FAMILY_V6} {
			if has, err := hasTProxyRule(fam); err != nil || !has {
				t.Errorf("family %d: policy rule present %v, %v", fam, has, err)
			}
		}
		if err := Mismatch(dual(true), []string{"a rule differs"}); err == nil || !strings.Contains(err.Error(), "a rule differs") {
			t.Errorf("Mismatch dropped the backend's differences: %v", err)
		}
		if err := SyncRouting(dual(false)); err != nil {
			return err
		}
		for _, fam := range []int{netlink.FAMILY_V4, netlink.FAMILY_V6} {
			if has, err := hasTProxyRule(fam); err != nil || has {
				t.Errorf("family %d after removal: policy rule present %v, %v", fam, has, err)
			}
		}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
}

func dual(tproxy bool) *ruleset.Plan {
	return &ruleset.Plan{V4: &ruleset.Set{Family: ruleset.IPv4}, V6: &ruleset.Set{Family: ruleset.IPv6}, TProxyRoutes: tproxy}
}

func TestReportString(t *testing.T) {
	r := Report{Families: []FamilyReport{
		{Family: ruleset.IPv4, Variant: "nft", Action: "applied"},
		{Family: ruleset.IPv6, Variant: "nft", Action: "unchanged", Note: "kernel replies lost"},
	}}
	if got, want := r.String(), "IPv4:applied(nft,0s) IPv6:unchanged(nft,0s,kernel replies lost)"; got != want {
		t.Errorf("String() = %q, want %q", got, want)
	}
}

// TestReadFactsAgreesWithTheLibrary: ReadFacts' one-socket reading of a
// namespace lists the addresses PodAddrs lists, in its order (a
// point-to-point address included, by its own side), sees the TPROXY
// policy rule in either family and no other rule, and sees an ipset.
func TestReadFactsAgreesWithTheLibrary(t *testing.T) {
	n := testutil.NewNS(t)
	testutil.RunIn(t, n, "ip", "link", "add", "eth0", "type", "veth", "peer", "name", "peer0")
	testutil.RunIn(t, n, "ip", "addr", "add", "10.1.0.2/24", "dev", "eth0")
	testutil.RunIn(t, n, "ip", "addr", "add", "10.9.0.1", "peer", "10.9.0.2", "dev", "eth0")
	testutil.RunIn(t, n, "ip", "-6", "addr", "add", "fd00::2/64", "dev", "eth0", "nodad")
	facts := func() nsfacts.Facts {
		var f nsfacts.Facts
		if err := n.Do(func(ns.NetNS) error {
			var err error
			f, err = nsfacts.ReadFacts()
			return err
		}); err != nil {
			t.Fatal(err)
		}
		return f
	}
	want, err := PodAddrs(n.Path())
	if err != nil {
		t.Fatal(err)
	}
	if got := facts(); !slices.Equal(got.Addrs, want) || got.TProxyRule || got.IPSets {
		t.Fatalf("ReadFacts: %+v; PodAddrs: %v", got, want)
	}
	// An ipset of any name is seen (prepared rules number sets as a
	// namespace with none would); another namespace's is not.
	mkset := func(in ns.NetNS, name string) {
		if err := in.Do(func(ns.NetNS) error {
			return netlink.IpsetCreate(name, "hash:net", netlink.IpsetCreateOptions{})
		}); err != nil {
			t.Fatalf("creating ipset %s: %v", name, err)
		}
	}
	mkset(testutil.NewNS(t), "elsewhere")
	if facts().IPSets {
		t.Fatal("another namespace's ipset seen here")
	}
	mkset(n, "someones")
	if !facts().IPSets {
		t.Fatal("the namespace's ipset not seen")
	}
	testutil.RunIn(t, n, "ip", "rule", "add", "fwmark", "1338", "lookup", "133")
	testutil.RunIn(t, n, "ip", "rule", "add", "fwmark", "1337", "lookup", "134")
	if facts().TProxyRule {
		t.Fatal("another mark's or table's rule taken for TPROXY's")
	}
	testutil.RunIn(t, n, "ip", "-6", "rule", "add", "fwmark", "1337", "lookup", "133")
	if !facts().TProxyRule {
		t.Fatal("the IPv6 TPROXY rule not seen")
	}
	testutil.RunIn(t, n, "ip", "-6", "rule", "del", "fwmark", "1337", "lookup", "133")
	testutil.RunIn(t, n, "ip", "rule", "add", "fwmark", "1337", "lookup", "133")
	if !facts().TProxyRule {
		t.Fatal("the IPv4 TPROXY rule not seen")
	}
}

// TestReadFactsForAnswersAsReadFacts: the relay reads only what its
// prepared rules' kind needs (nsfacts.ReadFactsFor), and Unfit answers
// over those facts as over all of them, in a namespace that gains, one by
// one, each thing that keeps some rules out. Native nftables rules do not
// look for ipsets or legacy tables, so those stay unread.
func TestReadFactsForAnswersAsReadFacts(t *testing.T) {
	testutil.RequireTools(t, "iptables-legacy", "iptables-nft", "nft")
	n := testutil.NewNS(t)
	read := func(fn func() (nsfacts.Facts, error)) nsfacts.Facts {
		t.Helper()
		var f nsfacts.Facts
		if err := n.Do(func(ns.NetNS) error {
			var err error
			f, err = fn()
			return err
		}); err != nil {
			t.Fatal(err)
		}
		return f
	}
	steps := []struct {
		what string
		add  func()
		// The reasons Unfit gives iptables-nft rules without and with
		// ipsets, and nftables rules.
		iptables, iptablesSets, nftables string
	}{
		{"nothing", func() {}, "", "", ""},
		{"an ipset", func() {
			if err := n.Do(func(ns.NetNS) error {
				return netlink.IpsetCreate("someones", "hash:net", netlink.IpsetCreateOptions{})
			}); err != nil {
				t.Fatal(err)
			}
		}, "", "the namespace holds ipsets", ""},
		{"iptables-nft's nat table", func() { testutil.RunIn(t, n, "iptables-nft", "-t", "nat", "-N", "SOMEONES") },
			"the namespace has iptables rules already", "the namespace holds ipsets", ""},
		{"a legacy table", func() { testutil.RunIn(t, n, "iptables-legacy", "-w", "30", "-t", "nat", "-N", "SOMEONES") },
			"the namespace has legacy iptables tables", "the namespace has legacy iptables tables", ""},
		{"our nftables table", func() { testutil.RunIn(t, n, "nft", "add", "table", "inet", "istio-proxy-nat") },
			"the namespace has legacy iptables tables", "the namespace has legacy iptables tables", "the namespace has tables of ours already"},
	}
	for _, st := range steps {
		st.add()
		all := read(nsfacts.ReadFacts)
		for _, c := range []struct {
			kind   string
			ipsets bool
			want   string
		}{{nsfacts.KindIPTablesNFT, false, st.iptables}, {nsfacts.KindIPTablesNFT, true, st.iptablesSets}, {nsfacts.KindNFTables, false, st.nftables}, {nsfacts.KindNFTables, true, st.nftables}} {
			some := read(func() (nsfacts.Facts, error) { return nsfacts.ReadFactsFor(c.kind, c.ipsets) })
			if got, over := some.Unfit(c.kind, c.ipsets), all.Unfit(c.kind, c.ipsets); got != c.want || over != c.want {
				t.Errorf("with %s, %s rules (ipsets %t): %q over what the kind needs, %q over all, want %q", st.what, c.kind, c.ipsets, got, over, c.want)
			}
			if !slices.Equal(some.Addrs, all.Addrs) || !slices.Equal(some.Tables, all.Tables) {
				t.Errorf("with %s, %s rules: addresses or tables differ: %+v, all: %+v", st.what, c.kind, some, all)
			}
			if c.kind == nsfacts.KindNFTables && (some.IPSets || some.LegacyTables) {
				t.Errorf("with %s, nftables rules read what they do not need: %+v", st.what, some)
			}
		}
	}
}

// BenchmarkReadFacts: what reading a pod's namespace costs the relay
// before it sends prepared rules, per kind, against reading all of it.
func BenchmarkReadFacts(b *testing.B) {
	n := testutil.NewNS(b)
	for _, c := range []struct {
		name string
		read func() (nsfacts.Facts, error)
	}{
		{"all", nsfacts.ReadFacts},
		{"nftables", func() (nsfacts.Facts, error) { return nsfacts.ReadFactsFor(nsfacts.KindNFTables, false) }},
		{"iptables", func() (nsfacts.Facts, error) { return nsfacts.ReadFactsFor(nsfacts.KindIPTablesNFT, false) }},
		{"iptables-ipsets", func() (nsfacts.Facts, error) { return nsfacts.ReadFactsFor(nsfacts.KindIPTablesNFT, true) }},
	} {
		b.Run(c.name, func(b *testing.B) {
			if err := n.Do(func(ns.NetNS) error {
				for i := 0; i < b.N; i++ {
					if _, err := c.read(); err != nil {
						return err
					}
				}
				return nil
			}); err != nil {
				b.Fatal(err)
			}
		})
	}
}
