package nftables

import (
	"strings"
	"testing"

	"github.com/istio-cni-go/istio-cni/internal/redirect"
	"github.com/istio-cni-go/istio-cni/internal/ruleset"
	"github.com/istio-cni-go/istio-cni/internal/testutil"
)

// TestBuildGolden renders every redirect case for IPv4 only and for both
// families; every rule the iptables backend has must translate.
func TestBuildGolden(t *testing.T) {
	for _, c := range testutil.RedirectCases {
		t.Run(c.Name, func(t *testing.T) {
			p, _, err := redirect.FromPod(c.Pod())
			if err != nil {
				t.Fatal(err)
			}
			for _, v6 := range []bool{false, true} {
				plan := ruleset.Build(p, v6)
				rs, err := Build(plan)
				if err != nil {
					t.Fatal(err)
				}
				n := 0
				for _, s := range plan.Sets() {
					for _, tbl := range s.Final() {
						for _, rules := range tbl {
							n += len(rules)
						}
					}
				}
				if len(rs.Rules) != n {
					t.Fatalf("%d iptables rules became %d nftables rules", n, len(rs.Rules))
				}
				suffix := ".v4.golden"
				if v6 {
					suffix = ".v6.golden"
				}
				testutil.CompareGolden(t, c.Name+suffix, rs.Text())
			}
		})
	}
}

// TestInterfaceNamedLikeASet: '@' may be in a Linux interface name, and
// such a name matches as itself, as with iptables; it was read as the
// name of a set of ours and failed the pod's ADD ("no set foo").
func TestInterfaceNamedLikeASet(t *testing.T) {
	p, _, err := redirect.FromPod(testutil.RedirectCase{Name: "at", Annotations: map[string]string{redirect.AnnotationExcludeInterfaces: "@foo,eth1"}}.Pod())
	if err != nil {
		t.Fatal(err)
	}
	for _, v6 := range []bool{false, true} {
		rs, err := Build(ruleset.Build(p, v6))
		if err != nil {
			t.Fatalf("v6 %t: %v", v6, err)
		}
		if !strings.Contains(rs.Text(), `iifname "@foo"`) {
			t.Fatalf("v6 %t: no rule for @foo:\n%s", v6, rs.Text())
		}
	}
	rs, err := BuildAmbient(ruleset.BuildAmbient(ruleset.AmbientParams{RerouteInterfaces: []string{"@tap0"}}))
	if err != nil {
		t.Fatal(err)
	}
	if !strings.Contains(rs.Text(), `iifname "@tap0"`) {
		t.Fatalf("ambient: no rule for @tap0:\n%s", rs.Text())
	}
}
