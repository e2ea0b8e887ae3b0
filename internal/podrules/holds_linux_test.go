package podrules

import (
	"testing"

	"github.com/istio-cni-go/istio-cni/internal/iptables"
	"github.com/istio-cni-go/istio-cni/internal/nftables"
	"github.com/istio-cni-go/istio-cni/internal/podnet"
	"github.com/istio-cni-go/istio-cni/internal/redirect"
	"github.com/istio-cni-go/istio-cni/internal/ruleset"
	"github.com/istio-cni-go/istio-cni/internal/testutil"
)

// TestHoldsRules: on every backend, a namespace holds our rules once any
// plan is applied, whichever plan a Check is then made against, and no
// longer once they are removed.
func TestHoldsRules(t *testing.T) {
	testutil.RequireRoot(t)
	backends := []struct {
		name  string
		rules interface {
			Rules
			Remove(string) (podnet.Report, error)
		}
	}{
		{"nftables", &nftables.Applier{}},
		{"iptables-nft", &iptables.Applier{Force: iptables.VariantNFT}},
		{"iptables-legacy", &iptables.Applier{Force: iptables.VariantLegacy}},
	}
	applied := ruleset.Build(redirect.Params{Mode: redirect.ModeRedirect, IncludeOutboundAll: true, IncludeInboundAll: true, ExcludeOutboundPorts: []string{"5432"}}, false)
	other := ruleset.Build(redirect.Params{Mode: redirect.ModeRedirect, IncludeOutboundAll: true, IncludeInboundAll: true}, true)
	for _, b := range backends {
		t.Run(b.name, func(t *testing.T) {
			n := testutil.NewNS(t)
			holds := func(want bool) {
				t.Helper()
				got, err := HoldsRules(b.rules, n.Path())
				if err != nil || got != want {
					t.Fatalf("HoldsRules = %v, %v; want %v", got, err, want)
				}
			}
			holds(false)
			if _, err := b.rules.Apply(n.Path(), applied); err != nil {
				t.Fatal(err)
			}
			holds(true)
			if b.rules.Check(n.Path(), other) == nil {
				t.Fatal("a plan other than the applied one checks equal")
			}
			holds(true)
			if _, err := b.rules.Remove(n.Path()); err != nil {
				t.Fatal(err)
			}
			holds(false)
		})
	}
	if _, err := HoldsRules(&nftables.Applier{}, "/nonexistent/netns"); err == nil {
		t.Fatal("a namespace that cannot be entered holds no rules, without an error")
	}
}
