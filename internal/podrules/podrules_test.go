package podrules

import (
	"net/netip"
	"strings"
	"testing"

	"github.com/istio-cni-go/istio-cni/internal/podnet"
	"github.com/istio-cni-go/istio-cni/internal/redirect"
	"github.com/istio-cni-go/istio-cni/internal/ruleset"
)

// fakeRules holds addrs.
type fakeRules struct {
	addrs []netip.Addr
}

func (f *fakeRules) Apply(_ string, p *ruleset.Plan) (podnet.Report, error) {
	return podnet.Report{}, nil
}
func (f *fakeRules) Check(string, *ruleset.Plan) error     { return nil }
func (f *fakeRules) PodAddrs(string) ([]netip.Addr, error) { return f.addrs, nil }

func addrs(s ...string) []netip.Addr {
	var out []netip.Addr
	for _, a := range s {
		out = append(out, netip.MustParseAddr(a))
	}
	return out
}

// TestBuildPlan: the plan follows the namespace's addresses (IPv6 rules
// only with an IPv6 address), and a namespace with no address yet is an
// error, never an empty plan.
func TestBuildPlan(t *testing.T) {
	params := redirect.Params{Mode: redirect.ModeRedirect, IncludeOutboundAll: true, IncludeInboundAll: true, ExcludeOutboundPorts: []string{"5432"}, DualStack: true}
	for _, c := range []struct {
		name    string
		rules   *fakeRules
		wantErr string
		wantV6  bool
	}{
		{"IPv4", &fakeRules{addrs: addrs("127.0.0.1", "10.1.0.2")}, "", false},
		{"dual stack", &fakeRules{addrs: addrs("10.1.0.2", "fd00::2")}, "", true},
		{"no address yet", &fakeRules{addrs: addrs("127.0.0.1", "fe80::1")}, "no address yet", false},
	} {
		t.Run(c.name, func(t *testing.T) {
			plan, err := BuildPlan(c.rules, "/proc/self/ns/net", params)
			if c.wantErr != "" {
				if err == nil || !strings.Contains(err.Error(), c.wantErr) {
					t.Fatalf("got %v; want the error %q", err, c.wantErr)
				}
				return
			}
			if err != nil || (plan.V6 != nil) != c.wantV6 {
				t.Fatalf("got %+v, %v", plan, err)
			}
			if !strings.Contains(plan.V4.Restore(), "--dport 5432 -j RETURN") {
				t.Fatalf("the pod's parameters are not in the plan:\n%s", plan.V4.Restore())
			}
		})
	}
}

// TestPrepareNeedsAPreparer: a backend without Prepare is applied in
// place, and says so, with the plan for the namespace's addresses.
func TestPrepareNeedsAPreparer(t *testing.T) {
	plan, txn, why, err := PreparePod(&fakeRules{addrs: addrs("10.1.0.2")}, "/proc/self/ns/net", redirect.Params{Mode: redirect.ModeRedirect})
	if plan == nil || txn != nil || err != nil || !strings.Contains(why, "only in place") {
		t.Fatalf("got %v, %v, %q, %v", plan, txn, why, err)
	}
}
