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

// TestHoldsRules: a namespace holds our rules once any backend or
// iptables variant has applied a plan, whatever the agent asking uses
// now, and no longer once they are removed; tables of other writers (an
// empty legacy filter table, an nftables table of their own) are not
// ours.
func TestHoldsRules(t *testing.T) {
	testutil.RequireRoot(t)
	testutil.RequireTools(t, "iptables-legacy", "nft")
	writers := []struct {
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
	plan := ruleset.Build(redirect.Params{Mode: redirect.ModeRedirect, IncludeOutboundAll: true, IncludeInboundAll: true, ExcludeOutboundPorts: []string{"5432"}}, true)
	for _, w := range writers {
		t.Run(w.name, func(t *testing.T) {
			n := testutil.NewNS(t)
			holds := func(want bool) {
				t.Helper()
				got, err := HoldsRules(n.Path())
				if err != nil || got != want {
					t.Fatalf("HoldsRules = %v, %v; want %v", got, err, want)
				}
			}
			holds(false)
			// Other writers' tables of every kind.
			testutil.RunIn(t, n, "iptables-legacy", "-w", "30", "-t", "filter", "-L")
			testutil.RunIn(t, n, "nft", "add", "table", "ip", "theirs")
			testutil.RunIn(t, n, "nft", "add", "table", "inet", "istio")
			holds(false)
			if _, err := w.rules.Apply(n.Path(), plan); err != nil {
				t.Fatal(err)
			}
			holds(true)
			if _, err := w.rules.Remove(n.Path()); err != nil {
				t.Fatal(err)
			}
			holds(false)
		})
	}
	if _, err := HoldsRules("/nonexistent/netns"); err == nil {
		t.Fatal("a namespace that cannot be entered holds no rules, without an error")
	}
}
