package iptables

import (
	"errors"
	"net/netip"
	"slices"
	"sort"
	"strings"
	"testing"

	"github.com/containernetworking/plugins/pkg/ns"

	"github.com/istio-cni-go/istio-cni/internal/redirect"
	"github.com/istio-cni-go/istio-cni/internal/ruleset"
	"github.com/istio-cni-go/istio-cni/internal/testenv"
	"github.com/istio-cni-go/istio-cni/internal/testutil"
)

func listPlan(t testing.TB, ann map[string]string, v6 bool) *ruleset.Plan {
	t.Helper()
	plan, err := testenv.ListPlan(ann, v6)
	if err != nil {
		t.Fatal(err)
	}
	return plan
}

// setsIn lists the ipsets of ours in a namespace.
func setsIn(t *testing.T, n ns.NetNS) map[string]*ruleset.IPSet {
	t.Helper()
	var out map[string]*ruleset.IPSet
	if err := n.Do(func(ns.NetNS) error {
		c, err := dialIPSet()
		if err != nil {
			return err
		}
		defer c.close()
		out, err = c.list()
		return err
	}); err != nil {
		t.Fatal(err)
	}
	return out
}

func names(m map[string]*ruleset.IPSet) []string {
	var out []string
	for k := range m {
		out = append(out, k)
	}
	sort.Strings(out)
	return out
}

// TestListCasesInKernel applies every long-list case with each variant,
// IPv4 only and dual, and proves: the kernel holds exactly the plan's
// sets with exactly their entries, CHECK passes, a second apply changes
// nothing, another plan replaces rules and sets alike, removal leaves no
// set behind.
func TestListCasesInKernel(t *testing.T) {
	testutil.RequireRoot(t)
	other := listPlan(t, testenv.Lists{N: 30}.IncludeAnnotations(), true)
	for _, variant := range []string{VariantLegacy, VariantNFT} {
		for _, v6 := range []bool{false, true} {
			for _, c := range testenv.ListCases() {
				name := variant + "/" + c.Name
				if v6 {
					name += "/v6"
				}
				t.Run(name, func(t *testing.T) {
					n := newNS(t)
					a := &Applier{Force: variant}
					plan := listPlan(t, c.Annotations, v6)
					if _, err := a.Apply(n.Path(), plan); err != nil {
						t.Fatal(err)
					}
					if err := a.Check(n.Path(), plan); err != nil {
						t.Fatalf("check after apply: %v", err)
					}
					have := setsIn(t, n)
					for _, w := range plan.IPSets() {
						if h := have[w.Name]; h == nil || !h.SameContents(w) {
							t.Fatalf("set %s: kernel has %v, want %v", w.Name, h, w.Entries())
						}
					}
					if len(have) != len(plan.IPSets()) {
						t.Fatalf("kernel has sets %v, plan %d", names(have), len(plan.IPSets()))
					}
					rep, err := a.Apply(n.Path(), plan)
					if err != nil {
						t.Fatal(err)
					}
					if got := actions(rep); strings.Contains(got, "applied") || strings.Contains(got, "replaced") {
						t.Fatalf("second apply was not a no-op: %s", rep)
					}
					if _, err := a.Apply(n.Path(), other); err != nil {
						t.Fatalf("replacing: %v", err)
					}
					if err := a.Check(n.Path(), other); err != nil {
						t.Fatalf("check after replace: %v", err)
					}
					if got, want := names(setsIn(t, n)), len(other.IPSets()); len(got) != want {
						t.Fatalf("after replacement the kernel has sets %v, want the %d of the new plan", got, want)
					}
					if _, err := a.Remove(n.Path()); err != nil {
						t.Fatal(err)
					}
					if left := setsIn(t, n); len(left) > 0 {
						t.Fatalf("sets left after remove: %v", names(left))
					}
				})
			}
		}
	}
}

// TestCheckFindsSetTampering: CHECK fails when a set's entries change,
// naming the set, and the next apply refills it.
func TestCheckFindsSetTampering(t *testing.T) {
	testutil.RequireRoot(t)
	n := newNS(t)
	a := &Applier{Force: VariantNFT}
	plan := listPlan(t, testenv.Lists{N: 40}.ExcludeAnnotations(""), false)
	if _, err := a.Apply(n.Path(), plan); err != nil {
		t.Fatal(err)
	}
	var victim *ruleset.IPSet
	for _, s := range plan.IPSets() {
		if s.Kind == ruleset.SetNets {
			victim = s
		}
	}
	if err := n.Do(func(ns.NetNS) error {
		c, err := dialIPSet()
		if err != nil {
			return err
		}
		defer c.close()
		short := *victim
		short.Nets = short.Nets[1:]
		return c.flushAndFill(&short)
	}); err != nil {
		t.Fatal(err)
	}
	err := a.Check(n.Path(), plan)
	if err == nil || !strings.Contains(err.Error(), victim.Name) || !strings.Contains(err.Error(), victim.Nets[0].String()+" missing") {
		t.Fatalf("CHECK after removing an entry: %v", err)
	}
	rep, err := a.Apply(n.Path(), plan)
	if err != nil || !strings.Contains(actions(rep), "replaced") {
		t.Fatalf("re-apply over a tampered set: %s %v", rep, err)
	}
	if err := a.Check(n.Path(), plan); err != nil {
		t.Fatal(err)
	}
}

// TestWithoutIPSet: on a kernel that cannot make the sets, long lists
// become a rule per entry (what Istio writes), and CHECK agrees.
func TestWithoutIPSet(t *testing.T) {
	testutil.RequireRoot(t)
	n := newNS(t)
	a := &Applier{Force: VariantNFT, expandSets: true}
	l := testenv.Lists{N: 40}
	plan := listPlan(t, l.ExcludeAnnotations(""), true)
	if _, err := a.Apply(n.Path(), plan); err != nil {
		t.Fatal(err)
	}
	if err := a.Check(n.Path(), plan); err != nil {
		t.Fatal(err)
	}
	if s := setsIn(t, n); len(s) > 0 {
		t.Fatalf("sets made without ipset: %v", names(s))
	}
	save := saveAll(t, n, VariantNFT)
	for _, i := range l.Probes() {
		for _, want := range []string{"-d " + l.CIDR4(i).String() + " -j RETURN", "-d " + l.CIDR6(i).String() + " -j RETURN"} {
			if !strings.Contains(save, want) {
				t.Fatalf("no rule %q in\n%s", want, save)
			}
		}
	}
}

// TestFailedRestoreLeavesNoSets: when iptables-restore refuses the rules,
// the sets made for them are gone again and the error names the setting
// of the refused rule.
func TestFailedRestoreLeavesNoSets(t *testing.T) {
	testutil.RequireRoot(t)
	n := newNS(t)
	a := &Applier{Force: VariantNFT}
	plan := listPlan(t, testenv.Lists{N: 40}.ExcludeAnnotations(""), false)
	// A rule iptables refuses, after the set rules: a match against a set
	// that does not exist, as from the exclude-ports setting.
	bad := plan.V4.Rules[len(plan.V4.Rules)-1]
	bad.Args = []string{"-p", "tcp", "-m", "set", "--match-set", "ISTIO_NO_SUCH_SET", "dst", "-j", "RETURN"}
	bad.Origin = redirect.AnnotationExcludeOutboundPorts
	plan.V4.Rules = append(plan.V4.Rules, bad)
	_, err := a.Apply(n.Path(), plan)
	if err == nil || !strings.Contains(err.Error(), "at a rule for "+redirect.AnnotationExcludeOutboundPorts) {
		t.Fatalf("want an error naming %s, got %v", redirect.AnnotationExcludeOutboundPorts, err)
	}
	if s := setsIn(t, n); len(s) > 0 {
		t.Fatalf("sets left after a failed apply: %v", names(s))
	}
	if save := saveAll(t, n, VariantNFT); strings.Contains(save, "ISTIO_") {
		t.Fatalf("rules left after a failed apply:\n%s", save)
	}
}

// TestRefusedCommitNamesLongestList: when the kernel refuses a table as
// a whole (iptables-nft reports its COMMIT line), the error names the
// list with the most rules in that table.
func TestRefusedCommitNamesLongestList(t *testing.T) {
	testutil.RequireRoot(t)
	n := newNS(t)
	a := &Applier{Force: VariantNFT}
	plan := listPlan(t, testenv.Lists{N: 40}.ExcludeAnnotations(""), false)
	bad := plan.V4.Rules[len(plan.V4.Rules)-1]
	bad.Args = []string{"-j", "NO_SUCH_TARGET"}
	plan.V4.Rules = append(plan.V4.Rules, bad)
	_, err := a.Apply(n.Path(), plan)
	want := redirect.AnnotationExcludeInterfaces + " (80 rules, the most of any list in table nat)"
	if err == nil || !strings.Contains(err.Error(), want) {
		t.Fatalf("want an error naming %s, got %v", want, err)
	}
	if s := setsIn(t, n); len(s) > 0 {
		t.Fatalf("sets left after a failed apply: %v", names(s))
	}
}

// TestInspectShowsSets: the diagnostics' view names each set with its
// size.
func TestInspectShowsSets(t *testing.T) {
	testutil.RequireRoot(t)
	n := newNS(t)
	a := &Applier{Force: VariantNFT}
	plan := listPlan(t, testenv.Lists{N: 40}.ExcludeAnnotations(""), false)
	if _, err := a.Apply(n.Path(), plan); err != nil {
		t.Fatal(err)
	}
	in, err := a.Inspect(n.Path())
	if err != nil {
		t.Fatal(err)
	}
	text := strings.Join(in[0].Rules, "\n")
	for _, s := range plan.IPSets() {
		if !strings.Contains(text, "ipset "+s.Name+": ") {
			t.Fatalf("set %s not in the inspection:\n%s", s.Name, text)
		}
	}
	if !strings.Contains(text, "40 entries") {
		t.Fatalf("no sizes in the inspection:\n%s", text)
	}
}

// TestIPSetRefusalsInWords: the kernel's ipset refusals (its own
// numbers, 4096 and up) reach the pod's error in ipset's words with the
// set and the setting named, and a refused fill leaves no set behind.
func TestIPSetRefusalsInWords(t *testing.T) {
	testutil.RequireRoot(t)
	n := newNS(t)
	plan := listPlan(t, testenv.Lists{N: 40}.ExcludeAnnotations(""), false)
	// The same plan but for a prefix of length 0, which hash:net
	// refuses, at the end of its CIDR list: the set is made, then its
	// fill refused. Plans are shared (built once per pod shape), so this
	// one is a copy.
	bad := *plan
	v4 := *plan.V4
	bad.V4 = &v4
	v4.IPSets = slices.Clone(v4.IPSets)
	var nets *ruleset.IPSet
	for i, s := range v4.IPSets {
		if s.Kind == ruleset.SetNets {
			c := *s
			c.Nets = append(slices.Clone(s.Nets), netip.MustParsePrefix("0.0.0.0/0"))
			v4.IPSets[i], nets = &c, &c
		}
	}
	_, err := (&Applier{Force: VariantLegacy}).Apply(n.Path(), &bad)
	if err == nil || !strings.Contains(err.Error(), nets.Name) || !strings.Contains(err.Error(), nets.Origin) || !strings.Contains(err.Error(), "ipset: ") || strings.Contains(err.Error(), "errno") {
		t.Fatalf("a refused entry: want ipset's words naming %s and %s, got %v", nets.Name, nets.Origin, err)
	}
	if s := setsIn(t, n); len(s) > 0 {
		t.Fatalf("sets left after a refused fill: %v", names(s))
	}
	// The plan it was copied from goes in whole.
	if _, err := (&Applier{Force: VariantLegacy}).Apply(n.Path(), plan); err != nil {
		t.Fatal(err)
	}
}

// TestDestroyReferencedSet: a set our rules still match against is not
// destroyed, and the kernel's refusal (ipset's own number) is told apart
// from a failure, so a stale set in use is left for the next call.
func TestDestroyReferencedSet(t *testing.T) {
	testutil.RequireRoot(t)
	n := newNS(t)
	plan := listPlan(t, testenv.Lists{N: 40}.ExcludeAnnotations(""), false)
	if _, err := (&Applier{Force: VariantLegacy}).Apply(n.Path(), plan); err != nil {
		t.Fatal(err)
	}
	name := plan.IPSets()[0].Name
	err := n.Do(func(ns.NetNS) error {
		c, err := dialIPSet()
		if err != nil {
			return err
		}
		defer c.close()
		return c.destroy(name)
	})
	if !errors.Is(err, errSetInUse) {
		t.Fatalf("destroying %s while rules match against it: %v", name, err)
	}
	if s := setsIn(t, n); s[name] == nil {
		t.Fatalf("%s is gone", name)
	}
}
