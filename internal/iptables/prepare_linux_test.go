package iptables

import (
	"os"
	"path/filepath"
	"regexp"
	"strings"
	"testing"

	"github.com/containernetworking/plugins/pkg/ns"

	"github.com/istio-cni-go/istio-cni/internal/nlsteps"
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
		{"legacy rules", run("iptables-legacy", "-t", "nat", "-N", "OTHER"), "", basic(false), "legacy iptables tables"},
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
// namespace, leave what Apply leaves. A plan never prepared, one whose
// file holds another plan, a legacy-forced applier, and a namespace that
// already holds rules get no stored requests, each with why.
func TestStoredPlans(t *testing.T) {
	testutil.RequireRoot(t)
	testutil.RequireTools(t, "iptables-nft-save", "ip6tables-nft-save", "ip")
	dir := t.TempDir()
	c := testutil.RedirectCases[0]
	params, _, err := redirect.FromPod(c.Pod())
	if err != nil {
		t.Fatal(err)
	}
	// A plan of its own, so the package's cache has not prepared it yet.
	params.ExcludeOutboundPorts = append(params.ExcludeOutboundPorts, "47111")
	plan := ruleset.Build(params, false)

	fallback := &Applier{}
	fresh := newNS(t)
	facts, why, err := fallback.Examine(fresh.Path())
	if err != nil || why != "" {
		t.Fatalf("examine: %v (%s)", err, why)
	}
	if txn, why, err := fallback.PrepareStored(dir, facts, plan); err != nil || txn != nil || why == "" {
		t.Fatalf("nothing stored yet: txn %v, why %q, err %v", txn != nil, why, err)
	}

	agent := &Applier{}
	agent.StorePlansIn(dir)
	if txn, why, err := agent.PrepareFresh(facts, plan); err != nil || txn == nil {
		t.Fatalf("agent prepare: %v (%s)", err, why)
	}
	txn, why, err := fallback.PrepareStored(dir, facts, plan)
	if err != nil || txn == nil {
		t.Fatalf("stored: %v (%s)", err, why)
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

	// The namespace now holds rules: in place, whatever is stored.
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
	// Another plan's file under this plan's name is not this plan's.
	other := ruleset.Build(params, true)
	if txn, _, err := agent.PrepareFresh(facts, other); err != nil || txn == nil {
		t.Fatalf("agent prepare, dual stack: %v", err)
	}
	entries, err := os.ReadDir(dir)
	if err != nil || len(entries) != 2 {
		t.Fatalf("stored plans %v (%v), want 2", entries, err)
	}
	a, b := filepath.Join(dir, entries[0].Name()), filepath.Join(dir, entries[1].Name())
	if err := os.Rename(a, b); err != nil {
		t.Fatal(err)
	}
	for _, p := range []*ruleset.Plan{plan, other} {
		if txn, why, err := fallback.PrepareStored(dir, facts, p); err != nil || txn != nil || why == "" {
			t.Fatalf("a file swapped under another plan's name: txn %v, why %q, err %v", txn != nil, why, err)
		}
	}
}
