package ruleset_test

import (
	"net/netip"
	"strings"
	"testing"

	"github.com/istio-cni-go/istio-cni/internal/ruleset"
	"github.com/istio-cni-go/istio-cni/internal/testutil"
	"github.com/istio-cni-go/istio-cni/internal/testutil/testplan"
)

func renderPlan(p *ruleset.Plan) string {
	var b strings.Builder
	for _, s := range p.Sets() {
		b.WriteString("# " + s.Family.String() + "\n")
		b.WriteString(s.Restore())
	}
	return b.String()
}

// TestAmbientGolden pins the in-pod rules of every shape an enrolled pod
// can ask for, as the iptables backend writes them, per family.
func TestAmbientGolden(t *testing.T) {
	for _, c := range testplan.AmbientCases {
		t.Run(c.Name, func(t *testing.T) {
			p := c.Params
			p.IPv6 = false
			testutil.CompareGolden(t, "ambient/"+c.Name+".v4.golden", renderPlan(ruleset.BuildAmbient(p)))
			p.IPv6 = true
			testutil.CompareGolden(t, "ambient/"+c.Name+".v6.golden", renderPlan(ruleset.BuildAmbient(p)))
		})
	}
}

// TestHostProbeGolden pins the node's probe SNAT: by "a socket exists"
// (iptables) and by kubelet's uid (nftables).
func TestHostProbeGolden(t *testing.T) {
	uid := uint32(1000)
	for _, c := range []struct {
		name string
		p    ruleset.HostParams
	}{
		{"host.v4", ruleset.HostParams{}},
		{"host.v6", ruleset.HostParams{IPv6: true}},
		{"host-uid.v6", ruleset.HostParams{IPv6: true, KubeletUID: &uid}},
	} {
		testutil.CompareGolden(t, "ambient/"+c.name+".golden", renderPlan(ruleset.BuildHostProbe(c.p)))
	}
}

// TestAmbientShape checks what the goldens cannot say at a glance: raw
// rules only with DNS capture, no inbound capture when bypassed, and
// the rerouted interfaces ahead of everything else in ISTIO_PRERT.
func TestAmbientShape(t *testing.T) {
	tables := func(p ruleset.AmbientParams) string { return strings.Join(ruleset.BuildAmbient(p).V4.Tables(), ",") }
	if got := tables(ruleset.AmbientParams{}); got != "mangle,nat" {
		t.Errorf("without DNS capture: tables %s, want mangle,nat", got)
	}
	if got := tables(ruleset.AmbientParams{DNSCapture: true}); got != "mangle,nat,raw" {
		t.Errorf("with DNS capture: tables %s, want mangle,nat,raw", got)
	}
	bypass := ruleset.BuildAmbient(ruleset.AmbientParams{BypassInbound: true}).V4.Restore()
	for _, s := range []string{ruleset.ProxyInboundPort, "-s 169.254.7.127"} {
		if strings.Contains(bypass, s) {
			t.Errorf("bypassed inbound still has %q:\n%s", s, bypass)
		}
	}
	// HBONE still reaches ztunnel, whose dial to the app needs the
	// connmark (Istio's #58546).
	if !strings.Contains(bypass, "CONNMARK --set-xmark") {
		t.Errorf("bypassed inbound lost the connmark of ztunnel's connections:\n%s", bypass)
	}
	final := ruleset.BuildAmbient(ruleset.AmbientParams{RerouteInterfaces: []string{"virt0"}}).V4.Final()
	if first := final["nat"][ruleset.ChainPrerouting][0]; first.Args[1] != "virt0" {
		t.Errorf("first ISTIO_PRERT rule is %v, want the rerouted interface's", first.Args)
	}
	if v6 := ruleset.BuildAmbient(ruleset.AmbientParams{IPv6: true}).V6.Restore(); !strings.Contains(v6, "fd16:9254:7127:1337:ffff:ffff:ffff:ffff/128") || strings.Contains(v6, "127.0.0.1") {
		t.Errorf("IPv6 rules lack the IPv6 probe source or name an IPv4 address:\n%s", v6)
	}
}

func TestProbeSetOf(t *testing.T) {
	for ip, want := range map[string]string{"10.1.2.3": ruleset.ProbeSetV4, "::ffff:10.1.2.3": ruleset.ProbeSetV4, "fd00::1": ruleset.ProbeSetV6} {
		if got := ruleset.ProbeSetOf(netip.MustParseAddr(ip)); got != want {
			t.Errorf("ProbeSetOf(%s) = %s, want %s", ip, got, want)
		}
	}
}
