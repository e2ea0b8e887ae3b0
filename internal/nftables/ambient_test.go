package nftables

import (
	"strings"
	"testing"

	"github.com/istio-cni-go/istio-cni/internal/ruleset"
	"github.com/istio-cni-go/istio-cni/internal/testutil"
	"github.com/istio-cni-go/istio-cni/internal/testutil/testplan"
)

// TestAmbientGolden pins ambient mode's tables for every shape of
// enrolled pod, IPv4 only and both families: every iptables rule has its
// nftables rule, under the reference's table and chain names.
func TestAmbientGolden(t *testing.T) {
	for _, c := range testplan.AmbientCases {
		t.Run(c.Name, func(t *testing.T) {
			for _, v6 := range []bool{false, true} {
				p := c.Params
				p.IPv6 = v6
				plan := ruleset.BuildAmbient(p)
				rs, err := BuildAmbient(plan)
				if err != nil {
					t.Fatal(err)
				}
				n := 0
				for _, s := range plan.Sets() {
					n += len(s.Rules)
				}
				if len(rs.Rules) != n {
					t.Fatalf("%d iptables rules became %d nftables rules", n, len(rs.Rules))
				}
				text := rs.Text()
				if strings.Contains(text, TablePrefix) || strings.Contains(text, "istio-prert") {
					t.Fatalf("sidecar table or chain names left:\n%s", text)
				}
				suffix := ".v4.golden"
				if v6 {
					suffix = ".v6.golden"
				}
				testutil.CompareGolden(t, "ambient/"+c.Name+suffix, text)
			}
		})
	}
}

// TestHostProbeGolden pins the node's table: the probe sets and the SNAT
// of the kubelet's connections to their addresses.
func TestHostProbeGolden(t *testing.T) {
	uid := uint32(1000)
	for _, v6 := range []bool{false, true} {
		rs, err := BuildHostProbe(ruleset.BuildHostProbe(ruleset.HostParams{IPv6: v6, KubeletUID: &uid}))
		if err != nil {
			t.Fatal(err)
		}
		name := "ambient/host.v4.golden"
		if v6 {
			name = "ambient/host.v6.golden"
		}
		testutil.CompareGolden(t, name, rs.Text())
	}
	// Without the kubelet's uid, the node's own connections are matched
	// as iptables' --socket-exists does: by having a local socket.
	rs, err := BuildHostProbe(ruleset.BuildHostProbe(ruleset.HostParams{}))
	if err != nil {
		t.Fatal(err)
	}
	if text := rs.Text(); !strings.Contains(text, "skuid >= 0") || strings.Contains(text, "skuid 0 ") {
		t.Fatalf("the probe SNAT without the kubelet's uid:\n%s", text)
	}
}
