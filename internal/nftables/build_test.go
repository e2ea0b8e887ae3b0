package nftables

import (
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
