package ruleset_test

import (
	"fmt"
	"strings"
	"testing"

	"github.com/istio-cni-go/istio-cni/internal/redirect"
	"github.com/istio-cni-go/istio-cni/internal/ruleset"
	"github.com/istio-cni-go/istio-cni/internal/testenv"
	"github.com/istio-cni-go/istio-cni/internal/testutil"
)

// renderWithSets is the restore text of each family followed by the sets
// its rules match against, as the iptables backend creates them.
func renderWithSets(p *ruleset.Plan) string {
	var b strings.Builder
	for _, s := range p.Sets() {
		b.WriteString("# " + s.Family.String() + "\n")
		b.WriteString(s.Restore())
		for _, x := range s.IPSets {
			kind := "bitmap:port"
			if x.Kind == ruleset.SetNets {
				kind = "hash:net " + x.Family.String()
			}
			fmt.Fprintf(&b, "# set %s %s, from %s (%d listed): %s\n", x.Name, kind, x.Origin, x.Listed, strings.Join(x.Entries(), ","))
		}
	}
	return b.String()
}

func listPlan(t *testing.T, c testenv.ListCase, v6 bool) *ruleset.Plan {
	t.Helper()
	plan, err := testenv.ListPlan(c.Annotations, v6)
	if err != nil {
		t.Fatal(err)
	}
	return plan
}

// TestListsGolden pins the rules of long lists: one rule against a set
// per list (per family for CIDRs), Istio's rule-per-entry shape up to
// the threshold, interface lists per entry at any length.
func TestListsGolden(t *testing.T) {
	for _, c := range testenv.ListCases() {
		t.Run(c.Name, func(t *testing.T) {
			testutil.CompareGolden(t, c.Name+".v4.golden", renderWithSets(listPlan(t, c, false)))
			testutil.CompareGolden(t, c.Name+".v6.golden", renderWithSets(listPlan(t, c, true)))
		})
	}
}

// TestExpandedMatchesIstioShape: writing the sets out per entry gives
// Istio's rule-per-entry text for lists that need no merging, in the
// same positions: the equivalence the set shape rests on, and what a
// kernel without ipset gets.
func TestExpandedMatchesIstioShape(t *testing.T) {
	l := testenv.Lists{N: 40}
	for _, ann := range []map[string]string{l.ExcludeAnnotations(""), l.IncludeAnnotations()} {
		plan := listPlan(t, testenv.ListCase{Annotations: ann}, true)
		for _, s := range plan.Sets() {
			if len(s.IPSets) == 0 {
				t.Fatalf("%s: no sets for lists of %d", s.Family, l.N)
			}
			exp := s.Expanded()
			if len(exp.IPSets) != 0 || strings.Contains(exp.Restore(), "--match-set") {
				t.Fatalf("%s: expansion still matches sets", s.Family)
			}
			// Every listed entry has its own rule, in list order.
			text := exp.Restore()
			last := -1
			for i := 0; i < l.N; i++ {
				want := "-A ISTIO_OUTPUT -d " + l.CIDR4(i).String() + " -j "
				if s.Family == ruleset.IPv6 {
					want = "-A ISTIO_OUTPUT -d " + l.CIDR6(i).String() + " -j "
				}
				at := strings.Index(text, want)
				if at < 0 || at < last {
					t.Fatalf("%s: entry %d (%q) missing or out of order", s.Family, i, want)
				}
				last = at
			}
			for i := 0; i < l.N; i++ {
				if !strings.Contains(text, fmt.Sprintf("--dport %d -j", l.Port(i))) {
					t.Fatalf("%s: port %d missing", s.Family, l.Port(i))
				}
			}
		}
	}
}

// TestFingerprintFollowsEveryEntry: what is prepared for one plan serves
// another with the same fingerprint, so a plan differing in any one entry
// of a thousand-entry list, in family or in shape must not share it, and
// equal plans built apart must.
func TestFingerprintFollowsEveryEntry(t *testing.T) {
	l := testenv.Lists{N: 1000}
	base := map[string]string{
		redirect.AnnotationExcludeOutboundCIDRs: l.CIDRs4(),
		redirect.AnnotationExcludeOutboundPorts: l.Ports(),
	}
	with := func(key, value string) map[string]string {
		m := map[string]string{}
		for k, v := range base {
			m[k] = v
		}
		m[key] = value
		return m
	}
	cidrs := strings.Split(l.CIDRs4(), ",")
	ports := strings.Split(l.Ports(), ",")
	seen := map[string]string{}
	for name, c := range map[string]struct {
		ann map[string]string
		v6  bool
	}{
		"base":              {ann: base},
		"base, dual stack":  {ann: base, v6: true},
		"last CIDR changed": {ann: with(redirect.AnnotationExcludeOutboundCIDRs, strings.Join(append(cidrs[:len(cidrs)-1:len(cidrs)-1], "203.0.113.0/24"), ","))},
		"a CIDR narrower":   {ann: with(redirect.AnnotationExcludeOutboundCIDRs, strings.Replace(l.CIDRs4(), cidrs[500], strings.TrimSuffix(cidrs[500], "/29")+"/30", 1))},
		"last port changed": {ann: with(redirect.AnnotationExcludeOutboundPorts, strings.Join(append(ports[:len(ports)-1:len(ports)-1], "65000"), ","))},
		"one port fewer":    {ann: with(redirect.AnnotationExcludeOutboundPorts, strings.Join(ports[1:], ","))},
		"ten CIDRs":         {ann: with(redirect.AnnotationExcludeOutboundCIDRs, strings.Join(cidrs[:10], ","))},
	} {
		fp := listPlan(t, testenv.ListCase{Annotations: c.ann}, c.v6).Fingerprint()
		if again := listPlan(t, testenv.ListCase{Annotations: c.ann}, c.v6).Fingerprint(); again != fp {
			t.Errorf("%s: built twice, fingerprints %s and %s", name, fp, again)
		}
		if other, ok := seen[fp]; ok {
			t.Errorf("%s and %s share fingerprint %s", name, other, fp)
		}
		seen[fp] = name
	}
}
