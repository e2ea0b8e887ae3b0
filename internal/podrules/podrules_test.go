package podrules

import (
	"encoding/json"
	"errors"
	"net/netip"
	"strings"
	"testing"

	"github.com/istio-cni-go/istio-cni/internal/podnet"
	"github.com/istio-cni-go/istio-cni/internal/redirect"
	"github.com/istio-cni-go/istio-cni/internal/ruleset"
)

// fakeRules holds addrs and applies by recording, or fails with err.
type fakeRules struct {
	addrs   []netip.Addr
	err     error
	applied []*ruleset.Plan
}

func (f *fakeRules) Apply(_ string, p *ruleset.Plan) (podnet.Report, error) {
	if f.err != nil {
		return podnet.Report{}, f.err
	}
	f.applied = append(f.applied, p)
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

// TestCommit: the plan follows the namespace's addresses (IPv6 rules only
// with an IPv6 address), a namespace with no address yet and a failed
// apply are the commit's error, never a silent success.
func TestCommit(t *testing.T) {
	params := redirect.Params{Mode: redirect.ModeRedirect, IncludeOutboundAll: true, IncludeInboundAll: true, ExcludeOutboundPorts: []string{"5432"}, DualStack: true}
	p := &Prepared{Pod: "ns/web", Params: params}
	for _, c := range []struct {
		name    string
		rules   *fakeRules
		wantErr string
		wantV6  bool
	}{
		{"IPv4", &fakeRules{addrs: addrs("127.0.0.1", "10.1.0.2")}, "", false},
		{"dual stack", &fakeRules{addrs: addrs("10.1.0.2", "fd00::2")}, "", true},
		{"no address yet", &fakeRules{addrs: addrs("127.0.0.1", "fe80::1")}, "no address yet", false},
		{"apply fails", &fakeRules{addrs: addrs("10.1.0.2"), err: errors.New("iptables-restore: line 3 failed")}, "line 3 failed", false},
	} {
		t.Run(c.name, func(t *testing.T) {
			got := Commit(p, c.rules, "/proc/self/ns/net")
			if c.wantErr != "" {
				if !strings.Contains(got.Error, c.wantErr) || len(c.rules.applied) != 0 {
					t.Fatalf("got %+v, %d applied; want the error %q", got, len(c.rules.applied), c.wantErr)
				}
				return
			}
			if got.Error != "" || got.IPv6 != c.wantV6 || len(c.rules.applied) != 1 {
				t.Fatalf("got %+v, %d applied", got, len(c.rules.applied))
			}
			if !strings.Contains(c.rules.applied[0].V4.Restore(), "--dport 5432 -j RETURN") {
				t.Fatalf("the pod's parameters are not in the plan:\n%s", c.rules.applied[0].V4.Restore())
			}
		})
	}
}

// TestPreparedWire: the agent and the relay may be different versions for
// a while (an upgrade), so the names are pinned; what does not decode
// fails the ADD with a message naming the agent's answer.
func TestPreparedWire(t *testing.T) {
	b, err := json.Marshal(&Prepared{Pod: "ns/p", NativeNftables: true, ForceIPTables: "legacy", Params: redirect.Params{Mode: redirect.ModeTProxy,
		ExcludeOutboundCIDRs: []netip.Prefix{netip.MustParsePrefix("10.0.0.0/8")}}})
	if err != nil {
		t.Fatal(err)
	}
	for _, want := range []string{`"pod":"ns/p"`, `"nativeNftables":true`, `"forceIPTables":"legacy"`, `"Mode":"TPROXY"`, `"ExcludeOutboundCIDRs":["10.0.0.0/8"]`} {
		if !strings.Contains(string(b), want) {
			t.Errorf("%s lacks %s", b, want)
		}
	}
	var back Prepared
	if err := json.Unmarshal(b, &back); err != nil || back.Params.ExcludeOutboundCIDRs[0].String() != "10.0.0.0/8" {
		t.Fatalf("round trip: %+v %v", back, err)
	}
	if _, err := CommitJSON([]byte(`{"params":`), "/proc/self/ns/net"); err == nil || !strings.Contains(err.Error(), "prepared rules do not decode") {
		t.Fatalf("garbage from the agent: %v", err)
	}
	if (&Prepared{NativeNftables: true}).Backend() == (&Prepared{}).Backend() {
		t.Fatal("the same backend for both settings")
	}
}
