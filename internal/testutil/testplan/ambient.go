package testplan

import (
	"testing"

	"github.com/istio-cni-go/istio-cni/internal/ruleset"
)

// AmbientCase is an enrolled pod's shape whose rules are pinned by goldens
// on every backend.
type AmbientCase struct {
	Name   string
	Params ruleset.AmbientParams
}

// AmbientCases cover each setting alone and all of them together; the
// goldens render each for IPv4 only and for both families.
var AmbientCases = []AmbientCase{
	{Name: "default"},
	{Name: "dns", Params: ruleset.AmbientParams{DNSCapture: true}},
	{Name: "bypass-inbound", Params: ruleset.AmbientParams{BypassInbound: true}},
	{Name: "reroute-interfaces", Params: ruleset.AmbientParams{RerouteInterfaces: []string{"virt0", "virt1"}}},
	{Name: "all", Params: ruleset.AmbientParams{DNSCapture: true, BypassInbound: true, RerouteInterfaces: []string{"virt0"}}},
}

// EachAmbientCase runs fn as a subtest for every case, IPv4 only and with
// IPv6 ("NAME" and "NAME/v6"), with the case's parameters for that family.
func EachAmbientCase(t *testing.T, fn func(t *testing.T, p ruleset.AmbientParams)) {
	for _, v6 := range []bool{false, true} {
		for _, c := range AmbientCases {
			name := c.Name
			if v6 {
				name += "/v6"
			}
			p := c.Params
			p.IPv6 = v6
			t.Run(name, func(t *testing.T) { fn(t, p) })
		}
	}
}
