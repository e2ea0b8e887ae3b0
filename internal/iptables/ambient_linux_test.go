package iptables

import (
	"errors"
	"fmt"
	"net/netip"
	"os/exec"
	"strings"
	"testing"

	"github.com/containernetworking/plugins/pkg/ns"
	"github.com/vishvananda/netlink"

	"github.com/istio-cni-go/istio-cni/internal/podnet"
	"github.com/istio-cni-go/istio-cni/internal/ruleset"
	"github.com/istio-cni-go/istio-cni/internal/testutil"
	"github.com/istio-cni-go/istio-cni/internal/testutil/testplan"
)

func ipRules(t *testing.T, n ns.NetNS) string {
	t.Helper()
	var out []byte
	err := n.Do(func(ns.NetNS) error {
		var err error
		out, err = exec.Command("sh", "-c", "ip -4 rule; ip -6 rule; ip -4 route show table 100; ip -6 route show table 100 2>/dev/null; true").CombinedOutput()
		return err
	})
	if err != nil {
		t.Fatalf("ip rule: %v: %s", err, out)
	}
	return string(out)
}

// TestAmbientApplyEveryCase applies every ambient case with each iptables
// variant, IPv4 only and both families: it reads back as planned, a
// second apply writes nothing, another component's rule stays through
// apply and removal, and removal leaves nothing of ours, routing included.
func TestAmbientApplyEveryCase(t *testing.T) {
	testutil.RequireRoot(t)
	testutil.RequireTools(t, "iptables-legacy-restore", "iptables-nft-restore", "ip6tables-legacy-restore", "ip6tables-nft-restore", "ip")
	for _, variant := range []string{VariantLegacy, VariantNFT} {
		t.Run(variant, func(t *testing.T) {
			testplan.EachAmbientCase(t, func(t *testing.T, p ruleset.AmbientParams) {
				n := newNS(t)
				a := &Applier{Force: variant}
				if err := n.Do(func(ns.NetNS) error {
					return exec.Command("iptables-"+variant, "-w", "30", "-t", "nat", "-A", "OUTPUT", "-p", "tcp", "--dport", "9999", "-j", "RETURN").Run()
				}); err != nil {
					t.Fatal(err)
				}
				rep, err := a.ApplyAmbient(n.Path(), p)
				if err != nil {
					t.Fatal(err)
				}
				if actions(rep) != "applied,"+map[bool]string{false: "none", true: "applied"}[p.IPv6] {
					t.Fatalf("first apply: %s", rep)
				}
				if err := a.CheckAmbient(n.Path(), p); err != nil {
					t.Fatalf("check after apply: %v\nkernel has:\n%s", err, saveAll(t, n, variant))
				}
				rules := ipRules(t, n)
				if !strings.Contains(rules, "32764:\tfrom all fwmark 0x111/0xfff lookup 100") || !strings.Contains(rules, "local default dev lo") {
					t.Fatalf("policy routing missing:\n%s", rules)
				}
				rep, err = a.ApplyAmbient(n.Path(), p)
				if err != nil {
					t.Fatal(err)
				}
				for _, f := range rep.Families {
					if f.Action != "unchanged" && f.Action != "none" {
						t.Fatalf("second apply was not a no-op: %s", rep)
					}
				}
				if got := ipRules(t, n); got != rules {
					t.Fatalf("second apply changed the routing:\n%s\nwas:\n%s", got, rules)
				}
				other := p
				other.DNSCapture = !p.DNSCapture
				if err := a.CheckAmbient(n.Path(), other); err == nil {
					t.Fatal("check passed against other DNS capture")
				}
				if _, err := a.RemoveAmbient(n.Path()); err != nil {
					t.Fatalf("remove: %v", err)
				}
				got := saveAll(t, n, variant)
				if strings.Contains(got, "ISTIO_") || strings.Contains(got, "0x539") || strings.Contains(got, "0x111") {
					t.Fatalf("rules left after remove:\n%s", got)
				}
				if !strings.Contains(got, "--dport 9999 -j RETURN") {
					t.Fatalf("another component's rule lost:\n%s", got)
				}
				if r := ipRules(t, n); strings.Contains(r, "0x111") || strings.Contains(r, "local default") {
					t.Fatalf("routing left after remove:\n%s", r)
				}
				if _, err := a.RemoveAmbient(n.Path()); err != nil {
					t.Fatalf("second remove: %v", err)
				}
			})
		})
	}
}

// requireIPSetEntries reads the probe sets through vishvananda's ipset
// client, not the code under test, and compares them with want (address
// to UID).
func requireIPSetEntries(t *testing.T, n ns.NetNS, want map[netip.Addr]string) {
	t.Helper()
	got := map[netip.Addr]string{}
	if err := n.Do(func(ns.NetNS) error {
		for _, name := range []string{ruleset.ProbeSetV4, ruleset.ProbeSetV6} {
			res, err := netlink.IpsetList(name)
			if err != nil {
				return fmt.Errorf("listing %s: %w", name, err)
			}
			for i := range res.Entries {
				ip, _ := netip.AddrFromSlice(res.Entries[i].IP)
				got[ip.Unmap()] = res.Entries[i].Comment
			}
		}
		return nil
	}); err != nil {
		t.Fatal(err)
	}
	if fmt.Sprint(got) != fmt.Sprint(want) {
		t.Fatalf("probe sets hold %v, want %v", got, want)
	}
}

// TestHostProbeLifecycle drives the node's probe SNAT with each variant:
// ensure writes once, a flushed chain and a flushed POSTROUTING come back,
// the sets follow the wanted entries by difference (an address reused by
// another pod re-commented, never emptied), an entry is forgotten only
// with its own UID, and removal leaves nothing.
func TestHostProbeLifecycle(t *testing.T) {
	testutil.RequireRoot(t)
	testutil.RequireTools(t, "iptables-legacy-restore", "iptables-nft-restore")
	a4, a6, b4 := netip.MustParseAddr("198.18.5.1"), netip.MustParseAddr("fd05::1"), netip.MustParseAddr("198.18.5.2")
	for _, variant := range []string{VariantLegacy, VariantNFT} {
		t.Run(variant, func(t *testing.T) {
			n := newNS(t)
			a := &Applier{Force: variant}
			p := ruleset.HostParams{IPv6: true}
			run := func(args ...string) string {
				t.Helper()
				return runIn(t, n, args...)
			}
			ensure := func(want bool) {
				t.Helper()
				changed, err := a.EnsureHost(n.Path(), p)
				if err != nil {
					t.Fatal(err)
				}
				if changed != want {
					t.Fatalf("ensure wrote %v, want %v:\n%s", changed, want, run("iptables-"+variant+"-save", "-t", "nat"))
				}
			}
			ensure(true)
			ensure(false)
			save := run("iptables-"+variant+"-save", "-t", "nat")
			if !strings.Contains(save, "-A ISTIO_POSTRT -p tcp -m owner --socket-exists -m set --match-set istio-inpod-probes-v4 dst -j SNAT --to-source 169.254.7.127") {
				t.Fatalf("SNAT rule missing:\n%s", save)
			}
			if s := run("ip6tables-"+variant+"-save", "-t", "nat"); !strings.Contains(s, "istio-inpod-probes-v6 dst -j SNAT --to-source fd16:9254:7127:1337:ffff:ffff:ffff:ffff") {
				t.Fatalf("IPv6 SNAT rule missing:\n%s", s)
			}
			want := map[netip.Addr]string{a4: "uid-a", a6: "uid-a", b4: "uid-b"}
			ch, err := a.SyncProbes(n.Path(), want)
			if err != nil || len(ch.Added) != 3 {
				t.Fatalf("first sync: %+v, %v", ch, err)
			}
			run("iptables-"+variant, "-w", "30", "-t", "nat", "-F", "ISTIO_POSTRT")
			ensure(true)
			run("iptables-"+variant, "-w", "30", "-t", "nat", "-F", "POSTROUTING")
			ensure(true)
			ensure(false)
			have, err := a.ProbeEntries(n.Path())
			if err != nil || len(have) != 3 {
				t.Fatalf("entries after re-asserting the rules: %v, %v", have, err)
			}
			ch, err = a.SyncProbes(n.Path(), map[netip.Addr]string{a4: "uid-a", a6: "uid-a", b4: "uid-c"})
			if err != nil || len(ch.Updated) != 1 || len(ch.Added)+len(ch.Removed) != 0 {
				t.Fatalf("re-commenting sync: %+v, %v", ch, err)
			}
			if ch, err = a.SyncProbes(n.Path(), map[netip.Addr]string{a4: "uid-a", a6: "uid-a", b4: "uid-c"}); err != nil || !ch.Empty() {
				t.Fatalf("repeated sync changed %+v, %v", ch, err)
			}
			if have, err := a.ProbeEntries(n.Path()); err != nil || have[b4] != "uid-c" {
				t.Fatalf("set lacks the new comment: %v, %v", have, err)
			}
			// Blind changes, read back through another ipset client than
			// the code under test: an entry added and one re-commented;
			// an entry deleted behind the change's back is not put back
			// (nothing is read); the deletion of an entry already gone is
			// no error.
			c4, gone := netip.MustParseAddr("198.18.5.3"), netip.MustParseAddr("198.18.5.9")
			before := map[netip.Addr]string{a4: "uid-a", a6: "uid-a", b4: "uid-c"}
			if del, err := a.ForgetProbe(n.Path(), b4, "uid-c"); err != nil || !del {
				t.Fatalf("deleting b4 behind the change's back: %v, %v", del, err)
			}
			now := map[netip.Addr]string{a4: "uid-e", a6: "uid-a", b4: "uid-c", c4: "uid-d"}
			if err := a.ChangeProbes(n.Path(), podnet.ProbeChanges{Added: []netip.Addr{c4}, Updated: []netip.Addr{a4}, Removed: []netip.Addr{gone}}, now); err != nil {
				t.Fatal(err)
			}
			requireIPSetEntries(t, n, map[netip.Addr]string{a4: "uid-e", a6: "uid-a", c4: "uid-d"})
			if err := a.ChangeProbes(n.Path(), podnet.ProbeChanges{Removed: []netip.Addr{c4}, Updated: []netip.Addr{a4}}, before); err != nil {
				t.Fatal(err)
			}
			requireIPSetEntries(t, n, map[netip.Addr]string{a4: "uid-a", a6: "uid-a"})
			if ch, err := a.SyncProbes(n.Path(), before); err != nil || len(ch.Added) != 1 || ch.Added[0] != b4 || len(ch.Updated)+len(ch.Removed) != 0 {
				t.Fatalf("a sync after the changes: %+v, %v", ch, err)
			}
			requireIPSetEntries(t, n, before)
			if del, err := a.ForgetProbe(n.Path(), b4, "uid-b"); err != nil || del {
				t.Fatalf("forgetting with another pod's UID deleted %v, %v", del, err)
			}
			if del, err := a.ForgetProbe(n.Path(), b4, "uid-c"); err != nil || !del {
				t.Fatalf("forgetting with its own UID deleted %v, %v", del, err)
			}
			if ch, err = a.SyncProbes(n.Path(), map[netip.Addr]string{a4: "uid-a"}); err != nil || len(ch.Removed) != 1 || ch.Removed[0] != a6 {
				t.Fatalf("pruning sync: %+v, %v", ch, err)
			}
			if err := a.RemoveHost(n.Path()); err != nil {
				t.Fatal(err)
			}
			if s := run("iptables-"+variant+"-save", "-t", "nat"); strings.Contains(s, "ISTIO_POSTRT") {
				t.Fatalf("rules left after remove:\n%s", s)
			}
			if have, err := a.ProbeEntries(n.Path()); err != nil || len(have) != 0 {
				t.Fatalf("sets left after remove: %v, %v", have, err)
			}
			if err := n.Do(func(ns.NetNS) error {
				c, err := dialIPSet()
				if err != nil {
					return err
				}
				defer c.close()
				_, err = c.addrs(ruleset.ProbeSetV4)
				return err
			}); !errors.Is(err, errNoSet) {
				t.Fatalf("set %s still there after remove: %v", ruleset.ProbeSetV4, err)
			}
			if err := a.RemoveHost(n.Path()); err != nil {
				t.Fatalf("second remove: %v", err)
			}
		})
	}
}

// TestHostVariantChoice: without FORCE_IPTABLES_BINARY the node's probe
// SNAT stays in the variant that holds it, even once a stray legacy table
// exists (a tool listing it loads one), goes where the node's own rules
// are when it is new, and is removed from every variant.
func TestHostVariantChoice(t *testing.T) {
	testutil.RequireRoot(t)
	testutil.RequireTools(t, "iptables-legacy", "iptables-nft", "iptables-legacy-save", "iptables-nft-save")
	p := ruleset.HostParams{IPv6: true}
	has := func(t *testing.T, n ns.NetNS, variant string) bool {
		t.Helper()
		return strings.Contains(runIn(t, n, "iptables-"+variant+"-save", "-t", "nat"), "-A ISTIO_POSTRT")
	}
	t.Run("stays-in-nft-beside-a-stray-legacy-table", func(t *testing.T) {
		n := newNS(t)
		a := &Applier{}
		if _, err := a.EnsureHost(n.Path(), p); err != nil {
			t.Fatal(err)
		}
		if !has(t, n, "nft") {
			t.Fatal("a new node's probe SNAT is not in the nft variant")
		}
		runIn(t, n, "iptables-legacy", "-w", "30", "-t", "nat", "-L", "-n")
		if changed, err := a.EnsureHost(n.Path(), p); err != nil || changed {
			t.Fatalf("re-assert beside a stray legacy table: wrote %v, %v", changed, err)
		}
		if has(t, n, "legacy") || !has(t, n, "nft") {
			t.Fatal("the probe SNAT moved to the stray legacy table")
		}
		if err := a.RemoveHost(n.Path()); err != nil {
			t.Fatal(err)
		}
		if has(t, n, "nft") || has(t, n, "legacy") {
			t.Fatal("rules left after remove")
		}
	})
	t.Run("goes-where-the-node's-rules-are", func(t *testing.T) {
		n := newNS(t)
		for i := 1; i <= 3; i++ {
			runIn(t, n, "iptables-legacy", "-w", "30", "-t", "nat", "-A", "POSTROUTING", "-d", fmt.Sprintf("198.18.9.%d", i), "-j", "MASQUERADE")
		}
		a := &Applier{}
		if _, err := a.EnsureHost(n.Path(), p); err != nil {
			t.Fatal(err)
		}
		if !has(t, n, "legacy") || has(t, n, "nft") {
			t.Fatal("the probe SNAT is not beside the node's legacy rules")
		}
		if err := a.RemoveHost(n.Path()); err != nil {
			t.Fatal(err)
		}
		if has(t, n, "legacy") {
			t.Fatal("rules left after remove")
		}
	})
	t.Run("one-copy", func(t *testing.T) {
		// Ours in both variants (an agent forced to one, then not): the
		// one beside the node's rules stays, the other goes.
		n := newNS(t)
		for _, v := range []string{VariantNFT, VariantLegacy} {
			if _, err := (&Applier{Force: v}).EnsureHost(n.Path(), p); err != nil {
				t.Fatal(err)
			}
		}
		runIn(t, n, "iptables-nft", "-t", "nat", "-A", "POSTROUTING", "-d", "198.18.9.9", "-j", "MASQUERADE")
		if changed, err := (&Applier{}).EnsureHost(n.Path(), p); err != nil || !changed {
			t.Fatalf("re-assert with two copies: wrote %v, %v", changed, err)
		}
		if !has(t, n, "nft") || has(t, n, "legacy") {
			t.Fatal("want the nft copy only")
		}
	})
}

func runIn(t *testing.T, n ns.NetNS, args ...string) string {
	t.Helper()
	return testutil.RunIn(t, n, args...)
}

// TestAmbientUserNamespacedPod: a pod with hostUsers: false gets its
// ambient rules (whose owner and mark matches the kernel takes only from
// its own user namespace) and routing, read back as written, and has
// them removed, with each variant.
func TestAmbientUserNamespacedPod(t *testing.T) {
	testutil.RequireTools(t, "nsenter", "iptables-legacy-restore", "iptables-nft-restore")
	p := ruleset.AmbientParams{DNSCapture: true}
	for _, variant := range []string{VariantLegacy, VariantNFT} {
		t.Run(variant, func(t *testing.T) {
			pod := userNSPod(t)
			a := &Applier{Force: variant}
			if _, err := a.ApplyAmbient(pod.Path(), p); err != nil {
				t.Fatal(err)
			}
			if err := a.CheckAmbient(pod.Path(), p); err != nil {
				t.Fatalf("the rules as written: %v", err)
			}
			if _, err := a.RemoveAmbient(pod.Path()); err != nil {
				t.Fatal(err)
			}
			if err := a.CheckAmbient(pod.Path(), p); err == nil {
				t.Fatal("the rules are still there after the removal")
			}
		})
	}
}

// TestAmbientPreparedMatchesInPlace: an enrolling pod's fresh namespace
// gets ambient mode's rules as prepared requests, which leave exactly
// what an apply in place leaves (iptables-nft-save alike, routing alike);
// CHECK passes and a second apply writes nothing. A namespace with
// another component's nat table already is applied in place.
func TestAmbientPreparedMatchesInPlace(t *testing.T) {
	testutil.RequireRoot(t)
	testutil.RequireTools(t, "iptables-nft-restore", "ip6tables-nft-restore", "ip")
	const foreign = "-A OUTPUT -p tcp -m tcp --dport 9999 -j RETURN"
	testplan.EachAmbientCase(t, func(t *testing.T, p ruleset.AmbientParams) {
		a := &Applier{Force: VariantNFT}
		fresh, used := newNS(t), newNS(t)
		if err := used.Do(func(ns.NetNS) error {
			return exec.Command("iptables-nft", "-t", "nat", "-A", "OUTPUT", "-p", "tcp", "--dport", "9999", "-j", "RETURN").Run()
		}); err != nil {
			t.Fatal(err)
		}
		rep, err := a.ApplyAmbient(fresh.Path(), p)
		if err != nil {
			t.Fatal(err)
		}
		if rep.Families[0].Note != podnet.NotePrepared || actions(rep) != "applied,"+map[bool]string{false: "none", true: "applied"}[p.IPv6] {
			t.Fatalf("a fresh namespace: %s, want prepared requests", rep)
		}
		if rep, err = a.ApplyAmbient(used.Path(), p); err != nil || rep.Families[0].Note == podnet.NotePrepared {
			t.Fatalf("a namespace with a nat table: %s, %v; want an apply in place", rep, err)
		}
		ours := func(n ns.NetNS) string {
			var out []string
			for _, l := range strings.Split(saveAll(t, n, VariantNFT), "\n") {
				if !strings.HasPrefix(l, "#") && l != foreign {
					out = append(out, l)
				}
			}
			return strings.Join(out, "\n")
		}
		if got, want := ours(fresh), ours(used); got != want {
			t.Fatalf("prepared:\n%s\nin place:\n%s", got, want)
		}
		if got, want := ipRules(t, fresh), ipRules(t, used); got != want || !strings.Contains(got, "lookup 100") {
			t.Fatalf("routing, prepared:\n%s\nin place:\n%s", got, want)
		}
		lo := func(n ns.NetNS) string { return testutil.RunIn(t, n, "ip", "-o", "addr", "show", "dev", "lo") }
		if got, want := lo(fresh), lo(used); got != want {
			t.Fatalf("lo's addresses, prepared:\n%s\nin place:\n%s", got, want)
		}
		if err := a.CheckAmbient(fresh.Path(), p); err != nil {
			t.Fatalf("check after a prepared apply: %v", err)
		}
		if rep, err = a.ApplyAmbient(fresh.Path(), p); err != nil || rep.Families[0].Action != "unchanged" {
			t.Fatalf("second apply: %s, %v", rep, err)
		}
	})
}

// TestAmbientBeyondRelayBound: an enrolling pod whose ambient rules are
// more requests than the prepared-transaction cache keeps (thousands of
// rerouted interfaces, two rules each per family) is applied in place,
// not "sent" as the cache's empty stand-in: the rules are there and
// CHECK passes.
func TestAmbientBeyondRelayBound(t *testing.T) {
	testutil.RequireRoot(t)
	testutil.RequireTools(t, "iptables-nft-restore", "ip6tables-nft-restore", "ip")
	p := ruleset.AmbientParams{IPv6: true}
	for i := range 3000 {
		p.RerouteInterfaces = append(p.RerouteInterfaces, fmt.Sprintf("vif%d", i))
	}
	a := &Applier{Force: VariantNFT}
	pod := newNS(t)
	facts, why, err := a.Examine(pod.Path())
	if err != nil || why != "" {
		t.Fatalf("examine a fresh namespace: %v (%s)", err, why)
	}
	if txn, _, err := a.prepareFresh(facts, ruleset.BuildAmbient(p), ""); err != nil || txn == nil || txn.Oversize == 0 {
		t.Fatalf("the prepared requests: %v; want them over the relay's bound (the case this test is for)", err)
	}
	rep, err := a.ApplyAmbient(pod.Path(), p)
	if err != nil {
		t.Fatal(err)
	}
	if rep.Families[0].Note == podnet.NotePrepared {
		t.Fatalf("applied as prepared requests: %s", rep)
	}
	if err := a.CheckAmbient(pod.Path(), p); err != nil {
		t.Fatalf("check: %.2000s", err)
	}
	if save := saveAll(t, pod, VariantNFT); !strings.Contains(save, "vif2999") {
		t.Fatalf("the last rerouted interface has no rule:\n%.2000s", save)
	}
}
