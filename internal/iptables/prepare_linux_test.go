package iptables

import (
	"fmt"
	"os"
	"path/filepath"
	"regexp"
	"strings"
	"testing"

	"github.com/containernetworking/plugins/pkg/ns"

	"github.com/istio-cni-go/istio-cni/internal/nlsteps"
	"github.com/istio-cni-go/istio-cni/internal/prepared"
	"github.com/istio-cni-go/istio-cni/internal/redirect"
	"github.com/istio-cni-go/istio-cni/internal/ruleset"
	"github.com/istio-cni-go/istio-cni/internal/testenv"
	"github.com/istio-cni-go/istio-cni/internal/testutil"
)

// nsState is what a namespace holds of a pod's redirection, as the tools
// an operator uses list it: iptables-nft-save of both families, the
// routing the rules need, and our ipsets with their entries.
func nsState(t *testing.T, n ns.NetNS) string {
	t.Helper()
	testutil.WaitLocalRoutes(t, n)
	var b strings.Builder
	strip := regexp.MustCompile(`(?m)^#.*\n`)
	for _, cmd := range [][]string{
		{"iptables-nft-save"}, {"ip6tables-nft-save"},
		{"ip", "rule"}, {"ip", "-6", "rule"},
		{"ip", "route", "show", "table", "all"}, {"ip", "-6", "route", "show", "table", "all"},
		{"ip", "-6", "addr", "show", "dev", "lo"},
	} {
		b.WriteString("$ " + strings.Join(cmd, " ") + "\n")
		b.WriteString(strip.ReplaceAllString(testutil.RunIn(t, n, cmd...), ""))
	}
	sets := setsIn(t, n)
	for _, name := range names(sets) {
		b.WriteString("ipset " + name + " " + strings.Join(sets[name].Entries(), ","))
	}
	return b.String()
}

// sendTxn sends a prepared transaction from inside n, as the relay does.
func sendTxn(n ns.NetNS, txn *nlsteps.Txn) error {
	return n.Do(func(ns.NetNS) error { return nlsteps.Run(txn) })
}

// TestPrepareMatchesApply: for every rule set of the goldens and every
// long-list case, IPv4 only and dual stack, the requests Prepare reads
// from iptables-nft, sent to a fresh namespace, leave it holding exactly
// what iptables-nft-restore (Apply) leaves in another: the same
// iptables-save text in both families, the same routing, the same
// ipsets; the backend's own CHECK passes; and the second pod of a plan is
// served from the cache.
func TestPrepareMatchesApply(t *testing.T) {
	testutil.RequireRoot(t)
	testutil.RequireTools(t, "iptables-nft-save", "ip6tables-nft-save", "ip")
	type tc struct {
		name string
		plan func(v6 bool) *ruleset.Plan
	}
	var cases []tc
	for _, c := range testutil.RedirectCases {
		cases = append(cases, tc{c.Name, func(v6 bool) *ruleset.Plan {
			params, _, err := redirect.FromPod(c.Pod())
			if err != nil {
				t.Fatal(err)
			}
			return ruleset.Build(params, v6)
		}})
	}
	for _, c := range testenv.ListCases() {
		cases = append(cases, tc{c.Name, func(v6 bool) *ruleset.Plan { return listPlan(t, c.Annotations, v6) }})
	}
	for _, c := range cases {
		for _, v6 := range []bool{false, true} {
			name := c.name
			if v6 {
				name += "/dual"
			}
			t.Run(name, func(t *testing.T) {
				plan := c.plan(v6)
				a := &Applier{}
				direct := newNS(t)
				if _, err := (&Applier{Force: VariantNFT}).Apply(direct.Path(), plan); err != nil {
					t.Fatal(err)
				}
				want := nsState(t, direct)
				for i := 0; i < 2; i++ {
					before := preparedTxns.Len()
					pod := newNS(t)
					txn, why, err := a.Prepare(pod.Path(), plan)
					if err != nil || txn == nil {
						t.Fatalf("prepare: %v (%s)", err, why)
					}
					if i == 1 && preparedTxns.Len() != before {
						t.Fatalf("the second pod of a plan was prepared again (%d cached, %d before)", preparedTxns.Len(), before)
					}
					if err := sendTxn(pod, txn); err != nil {
						t.Fatalf("sending:\n%s\n%v", txn.Describe(), err)
					}
					if got := nsState(t, pod); got != want {
						t.Fatalf("after the prepared requests the namespace holds\n%s\nApply leaves\n%s", got, want)
					}
					if err := a.Check(pod.Path(), plan); err != nil {
						t.Fatalf("check: %v", err)
					}
				}
			})
		}
	}
}

// TestPrepareRefusesWhatItCannotExpress: a namespace that holds rules of
// any iptables variant, a TPROXY policy rule, or (for a plan with sets)
// any ipset gets Apply, named why, and Prepare leaves it as it was;
// FORCE_IPTABLES_BINARY=legacy is always Apply's.
func TestPrepareRefusesWhatItCannotExpress(t *testing.T) {
	testutil.RequireRoot(t)
	basic := func(tproxy bool) *ruleset.Plan {
		ann := map[string]string{}
		if tproxy {
			ann[redirect.AnnotationInterceptionMode] = "TPROXY"
		}
		params, _, err := redirect.FromPod(testutil.RedirectCase{Annotations: ann}.Pod())
		if err != nil {
			t.Fatal(err)
		}
		return ruleset.Build(params, false)
	}
	withSets := listPlan(t, testenv.Lists{N: 50}.ExcludeAnnotations(""), false)
	run := func(args ...string) func(*testing.T, ns.NetNS) {
		return func(t *testing.T, n ns.NetNS) { testutil.RunIn(t, n, args...) }
	}
	for _, c := range []struct {
		name  string
		setup func(*testing.T, ns.NetNS)
		force string
		plan  *ruleset.Plan
		why   string
	}{
		{"nft rules", run("iptables-nft", "-t", "nat", "-N", "OTHER"), "", basic(false), "has iptables rules already"},
		{"nft rules, IPv6", run("ip6tables-nft", "-t", "mangle", "-N", "OTHER"), "", basic(false), "has iptables rules already"},
		{"legacy rules", run("iptables-legacy", "-w", "30", "-t", "nat", "-N", "OTHER"), "", basic(false), "legacy iptables tables"},
		{"tproxy rule", run("ip", "rule", "add", "fwmark", "1337", "lookup", "133"), "", basic(true), "TPROXY policy rule"},
		{"ipset", func(t *testing.T, n ns.NetNS) {
			// Another plan's set: the kernel would number the plan's
			// after it.
			other := listPlan(t, testenv.Lists{N: 20}.IncludeAnnotations(), false).IPSets()[0]
			if err := n.Do(func(ns.NetNS) error {
				c, err := dialIPSet()
				if err != nil {
					return err
				}
				defer c.close()
				return c.create(other)
			}); err != nil {
				t.Fatal(err)
			}
		}, "", withSets, "holds ipsets"},
		{"forced legacy", nil, VariantLegacy, basic(false), "FORCE_IPTABLES_BINARY=legacy"},
		{"user namespace", nil, "", basic(false), "user namespace of its own"},
	} {
		t.Run(c.name, func(t *testing.T) {
			n := newNS(t)
			if c.name == "user namespace" {
				n = userNSPod(t)
			}
			if c.setup != nil {
				c.setup(t, n)
			}
			before := nsState(t, n)
			txn, why, err := (&Applier{Force: c.force}).Prepare(n.Path(), c.plan)
			if err != nil || txn != nil || !strings.Contains(why, c.why) {
				t.Fatalf("got %v, %q, %v; want no transaction because %q", txn != nil, why, err, c.why)
			}
			if after := nsState(t, n); after != before {
				t.Fatalf("Prepare changed the namespace:\n%s\nwas\n%s", after, before)
			}
		})
	}
}

// TestStoredPlans: an applier told to store plans (the agent's) leaves
// each plan it prepares in the directory; another applier (a fallback's)
// finds it there by the plan, and the requests it reads, sent to a fresh
// namespace, leave what Apply leaves: for the default rules and for long
// lists matched through ipsets (whose requests make the sets), IPv4 only
// and dual stack. A plan never prepared, a file holding another plan, a
// legacy-forced applier, and a namespace that already holds the rules
// get no stored requests, each with why. A plan the cache held is stored
// again in a directory emptied since.
func TestStoredPlans(t *testing.T) {
	testutil.RequireRoot(t)
	testutil.RequireTools(t, "iptables-nft-save", "ip6tables-nft-save", "ip")
	params, _, err := redirect.FromPod(testutil.RedirectCases[0].Pod())
	if err != nil {
		t.Fatal(err)
	}
	list := testenv.ListCases()[0]
	plans := map[string]func(v6 bool) *ruleset.Plan{
		testutil.RedirectCases[0].Name: func(v6 bool) *ruleset.Plan { return ruleset.Build(params, v6) },
		list.Name:                      func(v6 bool) *ruleset.Plan { return listPlan(t, list.Annotations, v6) },
	}
	for name, build := range plans {
		for _, v6 := range []bool{false, true} {
			t.Run(fmt.Sprintf("%s/v6=%v", name, v6), func(t *testing.T) {
				plan := build(v6)
				if name == list.Name && len(plan.IPSets()) == 0 {
					t.Fatal("the list case matches no ipset")
				}
				dir := t.TempDir()
				fallback := &Applier{}
				fresh := newNS(t)
				facts, why, err := fallback.Examine(fresh.Path())
				if err != nil || why != "" {
					t.Fatalf("examine: %v (%s)", err, why)
				}
				if txn, why, err := fallback.PrepareStored(dir, facts, plan); err != nil || txn != nil || !strings.Contains(why, "stored no requests") {
					t.Fatalf("nothing stored yet: txn %v, why %q, err %v", txn != nil, why, err)
				}
				agent := &Applier{}
				agent.StorePlansIn(dir)
				// Twice: the second is served from the cache, and stores
				// nothing new.
				for i := 0; i < 2; i++ {
					if txn, why, err := agent.PrepareFresh(facts, plan); err != nil || txn == nil {
						t.Fatalf("agent prepare: %v (%s)", err, why)
					}
				}
				txn, why, err := fallback.PrepareStored(dir, facts, plan)
				if err != nil || txn == nil {
					t.Fatalf("stored: %v (%s)", err, why)
				}
				if len(plan.IPSets()) > 0 && len(txn.Undo) == 0 {
					t.Fatal("a plan with ipsets stored without the requests that undo them")
				}
				direct := newNS(t)
				if _, err := (&Applier{Force: VariantNFT}).Apply(direct.Path(), plan); err != nil {
					t.Fatal(err)
				}
				if err := sendTxn(fresh, txn); err != nil {
					t.Fatalf("sending:\n%s\n%v", txn.Describe(), err)
				}
				if got, want := nsState(t, fresh), nsState(t, direct); got != want {
					t.Fatalf("after the stored requests the namespace holds\n%s\nApply leaves\n%s", got, want)
				}
				// The namespace now holds the rules: in place, whatever
				// is stored.
				held, why, err := fallback.Examine(fresh.Path())
				if err != nil {
					t.Fatal(err)
				}
				if why == "" {
					if txn, why, _ := fallback.PrepareStored(dir, held, plan); txn != nil || why == "" {
						t.Fatalf("a namespace with rules got stored requests (why %q)", why)
					}
				}
				if txn, why, _ := (&Applier{Force: VariantLegacy}).PrepareStored(dir, facts, plan); txn != nil || !strings.Contains(why, "legacy") {
					t.Fatalf("legacy-forced: txn %v, why %q", txn != nil, why)
				}
				// Forced to nft, the fallback finds what the unforced
				// agent stored: both prepare alike.
				if txn, why, _ := (&Applier{Force: VariantNFT}).PrepareStored(dir, facts, plan); txn == nil {
					t.Fatalf("nft-forced fallback: %s", why)
				}
				// Emptied (a new agent's Reset): stored again from the
				// cache on the next prepare.
				if err := prepared.Dir(dir).Reset(); err != nil {
					t.Fatal(err)
				}
				if txn, _, err := agent.PrepareFresh(facts, plan); err != nil || txn == nil {
					t.Fatalf("agent prepare after reset: %v", err)
				}
				if txn, why, _ := fallback.PrepareStored(dir, facts, plan); txn == nil {
					t.Fatalf("not stored again after a reset: %s", why)
				}
				// Another plan's file under this plan's name.
				other := ruleset.Build(params, !v6)
				if name == testutil.RedirectCases[0].Name {
					other = listPlan(t, list.Annotations, v6)
				}
				if txn, _, err := agent.PrepareFresh(facts, other); err != nil || txn == nil {
					t.Fatalf("agent prepare, the other plan: %v", err)
				}
				entries, err := os.ReadDir(dir)
				if err != nil || len(entries) != 2 {
					t.Fatalf("stored plans %v (%v), want 2", entries, err)
				}
				if err := os.Rename(filepath.Join(dir, entries[0].Name()), filepath.Join(dir, entries[1].Name())); err != nil {
					t.Fatal(err)
				}
				for _, p := range []*ruleset.Plan{plan, other} {
					if txn, why, err := fallback.PrepareStored(dir, facts, p); err != nil || txn != nil || why == "" {
						t.Fatalf("a file swapped under another plan's name: txn %v, why %q, err %v", txn != nil, why, err)
					}
				}
			})
		}
	}
}
