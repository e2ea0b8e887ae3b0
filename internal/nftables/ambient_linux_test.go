package nftables

import (
	"fmt"
	"net/netip"
	"slices"
	"strings"
	"testing"

	"github.com/containernetworking/plugins/pkg/ns"
	"github.com/google/nftables"

	"github.com/istio-cni-go/istio-cni/internal/podnet"
	"github.com/istio-cni-go/istio-cni/internal/ruleset"
	"github.com/istio-cni-go/istio-cni/internal/testutil"
	"github.com/istio-cni-go/istio-cni/internal/testutil/testplan"
)

func inNS(t *testing.T, n ns.NetNS, args ...string) string {
	t.Helper()
	return testutil.RunIn(t, n, args...)
}

// addForeignTable gives the namespace another component's table, which
// ours must never touch.
func addForeignTable(t *testing.T, n ns.NetNS) {
	t.Helper()
	if err := n.Do(func(ns.NetNS) error {
		conn, err := nftables.New()
		if err != nil {
			return err
		}
		conn.AddTable(&nftables.Table{Name: "someone-else", Family: nftables.TableFamilyINet})
		return conn.Flush()
	}); err != nil {
		t.Fatal(err)
	}
}

// TestAmbientApplyEveryCase: the kernel takes every ambient case in one
// transaction, it reads back equal (a second apply is a no-op), a check
// against other settings fails, and removal leaves nothing of ours while
// another component's table stays.
func TestAmbientApplyEveryCase(t *testing.T) {
	testutil.RequireRoot(t)
	testutil.RequireTools(t, "ip")
	testplan.EachAmbientCase(t, func(t *testing.T, p ruleset.AmbientParams) {
		n := newNS(t)
		addForeignTable(t, n)
		a := &Applier{}
		rep, err := a.ApplyAmbient(n.Path(), p)
		if err != nil {
			t.Fatal(err)
		}
		if rep.Families[0].Action != "applied" {
			t.Fatalf("first apply: %s", rep)
		}
		if err := a.CheckAmbient(n.Path(), p); err != nil {
			t.Fatalf("check after apply: %v", err)
		}
		if rep, err = a.ApplyAmbient(n.Path(), p); err != nil || rep.Families[0].Action != "unchanged" {
			t.Fatalf("second apply: %s, %v", rep, err)
		}
		other := p
		other.BypassInbound = !p.BypassInbound
		if err := a.CheckAmbient(n.Path(), other); err == nil {
			t.Fatal("check passed against other inbound capture")
		}
		if rep, err = a.ApplyAmbient(n.Path(), other); err != nil || rep.Families[0].Action != "replaced" {
			t.Fatalf("changed settings: %s, %v", rep, err)
		}
		want := []string{"istio-ambient-mangle", "istio-ambient-nat", "someone-else"}
		if p.DNSCapture {
			want = append(want, "istio-ambient-raw")
		}
		got := tablesIn(t, n)
		slices.Sort(got)
		slices.Sort(want)
		if !slices.Equal(got, want) {
			t.Fatalf("tables %v, want %v", got, want)
		}
		if r := inNS(t, n, "ip", "rule"); !strings.Contains(r, "32764:\tfrom all fwmark 0x111/0xfff lookup 100") {
			t.Fatalf("policy rule missing:\n%s", r)
		}
		if rep, err = a.RemoveAmbient(n.Path()); err != nil || rep.Families[0].Action != "removed" {
			t.Fatalf("remove: %s, %v", rep, err)
		}
		if got := tablesIn(t, n); !slices.Equal(got, []string{"someone-else"}) {
			t.Fatalf("tables after remove: %v", got)
		}
		if r := inNS(t, n, "ip", "rule"); strings.Contains(r, "0x111") {
			t.Fatalf("policy rule left:\n%s", r)
		}
		if err := a.CheckAmbient(n.Path(), p); err == nil {
			t.Fatal("check passed after remove")
		}
	})
}

// TestHostProbeLifecycle: ensure writes once; a flushed chain, a deleted
// table and a flushed ruleset come back (the elements with the table
// only if the set survived, which Sync then restores); the sets follow the
// wanted entries by difference in one transaction; an element is
// forgotten only with its own UID; removal leaves nothing.
func TestHostProbeLifecycle(t *testing.T) {
	testutil.RequireRoot(t)
	a4, a6, b4 := netip.MustParseAddr("198.18.5.1"), netip.MustParseAddr("fd05::1"), netip.MustParseAddr("198.18.5.2")
	n := newNS(t)
	addForeignTable(t, n)
	a := &Applier{}
	uid := uint32(0)
	p := ruleset.HostParams{IPv6: true, KubeletUID: &uid}
	ensure := func(want bool) {
		t.Helper()
		changed, err := a.EnsureHost(n.Path(), p)
		if err != nil {
			t.Fatal(err)
		}
		if changed != want {
			t.Fatalf("ensure wrote %v, want %v", changed, want)
		}
	}
	// Without the kubelet's uid (any local socket), then with it: each
	// is a change, and then nothing is.
	if changed, err := a.EnsureHost(n.Path(), ruleset.HostParams{IPv6: true}); err != nil || !changed {
		t.Fatalf("ensure without the kubelet's uid: wrote %v, %v", changed, err)
	}
	ensure(true)
	ensure(false)
	want := map[netip.Addr]string{a4: "uid-a", a6: "uid-a", b4: "uid-b"}
	ch, err := a.SyncProbes(n.Path(), want)
	if err != nil || len(ch.Added) != 3 {
		t.Fatalf("first sync: %+v, %v", ch, err)
	}
	if err := n.Do(func(ns.NetNS) error {
		conn, err := nftables.New()
		if err != nil {
			return err
		}
		conn.FlushChain(&nftables.Chain{Name: "postrouting", Table: &nftables.Table{Name: AmbientNATTable, Family: nftables.TableFamilyINet}})
		return conn.Flush()
	}); err != nil {
		t.Fatal(err)
	}
	ensure(true)
	ensure(false)
	if have, err := a.ProbeEntries(n.Path()); err != nil || len(have) != 3 {
		t.Fatalf("elements after re-asserting the chain: %v, %v", have, err)
	}
	p.IPv6 = false
	ensure(true)
	p.IPv6 = true
	ensure(true)
	ch, err = a.SyncProbes(n.Path(), map[netip.Addr]string{a4: "uid-a", a6: "uid-a", b4: "uid-c"})
	if err != nil || len(ch.Added) != 1 || len(ch.Updated) != 1 {
		t.Fatalf("sync after the IPv6 set was re-made: %+v, %v", ch, err)
	}
	if ch, err = a.SyncProbes(n.Path(), map[netip.Addr]string{a4: "uid-a", a6: "uid-a", b4: "uid-c"}); err != nil || !ch.Empty() {
		t.Fatalf("repeated sync changed %+v, %v", ch, err)
	}
	if have, err := a.ProbeEntries(n.Path()); err != nil || have[b4] != "uid-c" || have[a6] != "uid-a" {
		t.Fatalf("elements: %v, %v", have, err)
	}
	// Blind changes, read back with the library rather than the code
	// under test. One that deletes an element no longer there, or adds
	// one there already (another pod's UID), is refused whole.
	c4 := netip.MustParseAddr("198.18.5.3")
	gone := netip.MustParseAddr("198.18.5.9")
	before := map[netip.Addr]string{a4: "uid-a", a6: "uid-a", b4: "uid-c"}
	err = a.ChangeProbes(n.Path(), podnet.ProbeChanges{Added: []netip.Addr{c4}, Removed: []netip.Addr{gone}}, map[netip.Addr]string{c4: "uid-d"})
	if err == nil || !strings.Contains(err.Error(), "deleting elements of set "+ruleset.ProbeSetV4) || !strings.Contains(err.Error(), "no such file") {
		t.Fatalf("a change deleting a missing element: %v", err)
	}
	requireProbeElements(t, n, before)
	err = a.ChangeProbes(n.Path(), podnet.ProbeChanges{Added: []netip.Addr{c4, b4}}, map[netip.Addr]string{c4: "uid-d", b4: "uid-x"})
	if err == nil || !strings.Contains(err.Error(), "elements of set "+ruleset.ProbeSetV4) || !strings.Contains(err.Error(), "file exists") {
		t.Fatalf("a change adding an element there already: %v", err)
	}
	requireProbeElements(t, n, before)
	// Made against what the set held: b4, deleted behind its back, is
	// not put back (nothing is read), the rest is made.
	if del, err := a.ForgetProbe(n.Path(), b4, "uid-c"); err != nil || !del {
		t.Fatalf("deleting b4 behind the change's back: %v, %v", del, err)
	}
	now := map[netip.Addr]string{a4: "uid-e", a6: "uid-a", b4: "uid-c", c4: "uid-d"}
	if err := a.ChangeProbes(n.Path(), podnet.ProbeChanges{Added: []netip.Addr{c4}, Updated: []netip.Addr{a4}}, now); err != nil {
		t.Fatal(err)
	}
	requireProbeElements(t, n, map[netip.Addr]string{a4: "uid-e", a6: "uid-a", c4: "uid-d"})
	if err := a.ChangeProbes(n.Path(), podnet.ProbeChanges{Removed: []netip.Addr{c4}, Updated: []netip.Addr{a4}}, before); err != nil {
		t.Fatal(err)
	}
	requireProbeElements(t, n, map[netip.Addr]string{a4: "uid-a", a6: "uid-a"})
	if ch, err := a.SyncProbes(n.Path(), before); err != nil || len(ch.Added) != 1 || ch.Added[0] != b4 || len(ch.Updated)+len(ch.Removed) != 0 {
		t.Fatalf("a sync after the changes: %+v, %v", ch, err)
	}
	requireProbeElements(t, n, before)
	if del, err := a.ForgetProbe(n.Path(), b4, "uid-b"); err != nil || del {
		t.Fatalf("forgetting with another pod's UID deleted %v, %v", del, err)
	}
	if del, err := a.ForgetProbe(n.Path(), b4, "uid-c"); err != nil || !del {
		t.Fatalf("forgetting with its own UID deleted %v, %v", del, err)
	}
	if err := a.RemoveHost(n.Path()); err != nil {
		t.Fatal(err)
	}
	if got := tablesIn(t, n); !slices.Equal(got, []string{"someone-else"}) {
		t.Fatalf("tables after remove: %v", got)
	}
	if _, err := a.SyncProbes(n.Path(), want); err == nil || !strings.Contains(err.Error(), "missing") {
		t.Fatalf("sync without the sets: %v", err)
	}
	if err := a.RemoveHost(n.Path()); err != nil {
		t.Fatalf("second remove: %v", err)
	}
}

// requireProbeElements reads the probe sets through the library, not the
// code under test, and compares them with want (address to UID).
func requireProbeElements(t *testing.T, n ns.NetNS, want map[netip.Addr]string) {
	t.Helper()
	got := map[netip.Addr]string{}
	if err := n.Do(func(ns.NetNS) error {
		conn, err := nftables.New()
		if err != nil {
			return err
		}
		for _, name := range []string{ruleset.ProbeSetV4, ruleset.ProbeSetV6} {
			set, err := conn.GetSetByName(&nftables.Table{Name: AmbientNATTable, Family: nftables.TableFamilyINet}, name)
			if err != nil {
				return err
			}
			elems, err := conn.GetSetElements(set)
			if err != nil {
				return err
			}
			for i := range elems {
				ip, _ := netip.AddrFromSlice(elems[i].Key)
				got[ip] = elems[i].Comment
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

// TestAmbientPreparedMatchesInPlace: an enrolling pod's fresh namespace
// gets ambient mode's tables as prepared requests, which leave exactly
// what an apply in place leaves (nft list ruleset alike, routing alike);
// CHECK passes and a second apply writes nothing. A namespace holding a
// table of ambient mode's already is applied in place.
func TestAmbientPreparedMatchesInPlace(t *testing.T) {
	testutil.RequireRoot(t)
	testutil.RequireTools(t, "nft", "ip")
	testplan.EachAmbientCase(t, func(t *testing.T, p ruleset.AmbientParams) {
		a := &Applier{}
		fresh, used := newNS(t), newNS(t)
		if err := used.Do(func(ns.NetNS) error {
			conn, err := nftables.New()
			if err != nil {
				return err
			}
			conn.AddTable(&nftables.Table{Name: AmbientTablePrefix + "nat", Family: nftables.TableFamilyINet})
			return conn.Flush()
		}); err != nil {
			t.Fatal(err)
		}
		rep, err := a.ApplyAmbient(fresh.Path(), p)
		if err != nil || rep.Families[0].Note != podnet.NotePrepared || rep.Families[0].Action != "applied" {
			t.Fatalf("a fresh namespace: %s, %v; want prepared requests", rep, err)
		}
		if rep, err = a.ApplyAmbient(used.Path(), p); err != nil || rep.Families[0].Note == podnet.NotePrepared || rep.Families[0].Action != "replaced" {
			t.Fatalf("a namespace with a table of ours: %s, %v; want it replaced in place", rep, err)
		}
		if got, want := inNS(t, fresh, "nft", "list", "ruleset"), inNS(t, used, "nft", "list", "ruleset"); got != want || !strings.Contains(got, AmbientTablePrefix) {
			t.Fatalf("prepared:\n%s\nin place:\n%s", got, want)
		}
		routing := "ip -4 rule; ip -6 rule; ip -4 route show table 100; ip -6 route show table 100 2>/dev/null; ip -o addr show dev lo; true"
		if got, want := inNS(t, fresh, "sh", "-c", routing), inNS(t, used, "sh", "-c", routing); got != want || !strings.Contains(got, "lookup 100") {
			t.Fatalf("routing, prepared:\n%s\nin place:\n%s", got, want)
		}
		if err := a.CheckAmbient(fresh.Path(), p); err != nil {
			t.Fatalf("check after a prepared apply: %v", err)
		}
		if rep, err = a.ApplyAmbient(fresh.Path(), p); err != nil || rep.Families[0].Action != "unchanged" {
			t.Fatalf("second apply: %s, %v", rep, err)
		}
	})
}

// TestAmbientBeyondRelayBound: an enrolling pod whose ambient tables are
// more requests than the prepared-transaction cache keeps (hundreds of
// rerouted interfaces) is applied in place, not "sent" as the cache's
// empty stand-in: the tables are there and CHECK passes.
func TestAmbientBeyondRelayBound(t *testing.T) {
	testutil.RequireRoot(t)
	testutil.RequireTools(t, "nft", "ip")
	p := ruleset.AmbientParams{IPv6: true}
	for i := range 600 {
		p.RerouteInterfaces = append(p.RerouteInterfaces, fmt.Sprintf("vif%d", i))
	}
	pod := newNS(t)
	a := &Applier{}
	rep, err := a.ApplyAmbient(pod.Path(), p)
	if err != nil {
		t.Fatal(err)
	}
	txn, hit, err := preparedTxns.Get("ambient "+ruleset.BuildAmbient(p).Fingerprint(), nil)
	if err != nil || !hit || txn.Oversize == 0 {
		t.Fatalf("the cached requests (found %t): %v; want them over the relay's bound (the case this test is for)", hit, err)
	}
	if rep.Families[0].Note == podnet.NotePrepared {
		t.Fatalf("applied as prepared requests: %s", rep)
	}
	if err := a.CheckAmbient(pod.Path(), p); err != nil {
		t.Fatalf("check: %.2000s", err)
	}
	if rules := inNS(t, pod, "nft", "list", "ruleset"); !strings.Contains(rules, `"vif599"`) {
		t.Fatalf("the last rerouted interface has no rule:\n%.2000s", rules)
	}
}

// TestHostProbesAtScale: thousands of probe elements added, and then
// deleted, in one sync all arrive, read back through the library. Sent
// as one element list, past 64 KiB the list's length wrapped and the
// kernel kept a few elements of thousands while the sync reported them
// all added, again at every resync.
func TestHostProbesAtScale(t *testing.T) {
	testutil.RequireRoot(t)
	n := newNS(t)
	a := &Applier{}
	uid := uint32(0)
	if _, err := a.EnsureHost(n.Path(), ruleset.HostParams{IPv6: true, KubeletUID: &uid}); err != nil {
		t.Fatal(err)
	}
	want := map[netip.Addr]string{}
	for i := range 3000 {
		want[netip.AddrFrom4([4]byte{10, 64, byte(i >> 8), byte(i)})] = fmt.Sprintf("%08x-5d1e-4b9a-9c3f-%012x", i, i)
	}
	for i := range 1500 {
		want[netip.AddrFrom16([16]byte{0xfd, 0x64, 14: byte(i >> 8), 15: byte(i)})] = fmt.Sprintf("%08x-5d1e-4b9a-9c3f-%012x", i, i+1<<20)
	}
	ch, err := a.SyncProbes(n.Path(), want)
	if err != nil || len(ch.Added) != len(want) {
		t.Fatalf("sync of %d: added %d, %v", len(want), len(ch.Added), err)
	}
	requireProbeElements(t, n, want)
	if ch, err := a.SyncProbes(n.Path(), want); err != nil || !ch.Empty() {
		t.Fatalf("a second sync changed %d/%d/%d, %v", len(ch.Added), len(ch.Updated), len(ch.Removed), err)
	}
	few := map[netip.Addr]string{}
	for ip, u := range want {
		if len(few) == 10 {
			break
		}
		few[ip] = u
	}
	if ch, err := a.SyncProbes(n.Path(), few); err != nil || len(ch.Removed) != len(want)-len(few) {
		t.Fatalf("sync down to %d: removed %d, %v", len(few), len(ch.Removed), err)
	}
	requireProbeElements(t, n, few)
}
