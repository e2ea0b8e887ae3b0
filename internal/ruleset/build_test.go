package ruleset

import (
	"net/netip"
	"slices"
	"strconv"
	"strings"
	"testing"

	"github.com/istio-cni-go/istio-cni/internal/podinfo"
	"github.com/istio-cni-go/istio-cni/internal/redirect"
	"github.com/istio-cni-go/istio-cni/internal/testutil"
)

func render(p *Plan) string {
	var b strings.Builder
	for _, s := range p.Sets() {
		b.WriteString("# " + s.Family.String() + "\n")
		b.WriteString(s.Restore())
	}
	if p.TProxyRoutes {
		b.WriteString("# policy routing: fwmark 1337 lookup 133; local default dev lo table 133\n")
	}
	return b.String()
}

func TestBuildGolden(t *testing.T) {
	for _, tc := range testutil.RedirectCases {
		t.Run(tc.Name, func(t *testing.T) {
			params, _, err := redirect.FromPod(tc.Pod())
			if err != nil {
				t.Fatal(err)
			}
			testutil.CompareGolden(t, tc.Name+".v4.golden", render(Build(params, false)))
			testutil.CompareGolden(t, tc.Name+".v6.golden", render(Build(params, true)))
		})
	}
}

// TestBasicMatchesIstio pins the default rule set to Istio's own golden
// text, so the validation probe and troubleshooting guides keep working.
func TestBasicMatchesIstio(t *testing.T) {
	const istioBasic = `* nat
-N ISTIO_INBOUND
-N ISTIO_REDIRECT
-N ISTIO_IN_REDIRECT
-N ISTIO_OUTPUT
-A ISTIO_INBOUND -p tcp --dport 15008 -j RETURN
-A ISTIO_REDIRECT -p tcp -j REDIRECT --to-ports 15001
-A ISTIO_IN_REDIRECT -p tcp -j REDIRECT --to-ports 15006
-A PREROUTING -p tcp -j ISTIO_INBOUND
-A ISTIO_INBOUND -p tcp --dport 15020 -j RETURN
-A ISTIO_INBOUND -p tcp --dport 15021 -j RETURN
-A ISTIO_INBOUND -p tcp --dport 15090 -j RETURN
-A ISTIO_INBOUND -p tcp -j ISTIO_IN_REDIRECT
-A OUTPUT -j ISTIO_OUTPUT
-A ISTIO_OUTPUT -p tcp --dport 15020 -j RETURN
-A ISTIO_OUTPUT -p udp --dport 15020 -j RETURN
-A ISTIO_OUTPUT -o lo -s 127.0.0.6/32 -j RETURN
-A ISTIO_OUTPUT -o lo ! -d 127.0.0.1/32 -p tcp ! --dport 15008 -m owner --uid-owner 1337 -j ISTIO_IN_REDIRECT
-A ISTIO_OUTPUT -o lo -m owner ! --uid-owner 1337 -j RETURN
-A ISTIO_OUTPUT -m owner --uid-owner 1337 -j RETURN
-A ISTIO_OUTPUT -o lo ! -d 127.0.0.1/32 -p tcp ! --dport 15008 -m owner --gid-owner 1337 -j ISTIO_IN_REDIRECT
-A ISTIO_OUTPUT -o lo -m owner ! --gid-owner 1337 -j RETURN
-A ISTIO_OUTPUT -m owner --gid-owner 1337 -j RETURN
-A ISTIO_OUTPUT -d 127.0.0.1/32 -j RETURN
-A ISTIO_OUTPUT -j ISTIO_REDIRECT
COMMIT
`
	pod := &podinfo.Pod{
		Annotations: map[string]string{redirect.AnnotationStatus: "true"},
		Containers:  []podinfo.Container{{Name: redirect.ProxyContainerName}},
	}
	params, _, err := redirect.FromPod(pod)
	if err != nil {
		t.Fatal(err)
	}
	if got := Build(params, false).V4.Restore(); got != istioBasic {
		t.Errorf("default rules differ from Istio's:\n%s", got)
	}
}

func TestNeedsIPv6(t *testing.T) {
	a := func(s ...string) []netip.Addr {
		var out []netip.Addr
		for _, x := range s {
			out = append(out, netip.MustParseAddr(x))
		}
		return out
	}
	cases := []struct {
		addrs []netip.Addr
		dual  bool
		want  bool
	}{
		{a("10.0.0.5"), false, false},
		{a("fd00::5"), false, true},
		{a("127.0.0.1", "fe80::1", "fd00::5"), false, true},
		{a("10.0.0.5", "fd00::5"), false, false},
		{a("10.0.0.5", "fd00::5"), true, true},
		{a("10.0.0.5"), true, false},
		{nil, true, false},
	}
	for _, c := range cases {
		if got := NeedsIPv6(c.addrs, c.dual); got != c.want {
			t.Errorf("NeedsIPv6(%v, %v) = %v, want %v", c.addrs, c.dual, got, c.want)
		}
	}
}

func TestFinalResolvesInserts(t *testing.T) {
	pod := &podinfo.Pod{Annotations: map[string]string{
		redirect.AnnotationInterceptionMode: "TPROXY",
	}}
	params, _, err := redirect.FromPod(pod)
	if err != nil {
		t.Fatal(err)
	}
	final := Build(params, false).V4.Final()
	in := final["mangle"][ChainInbound]
	if len(in) < 3 || strings.Join(in[0].Args, " ") != "-p tcp -m mark --mark 1337 -j RETURN" ||
		strings.Join(in[2].Args, " ") != "-p tcp -i lo -m mark ! --mark 1338 -j RETURN" {
		t.Fatalf("inserts not at the head of ISTIO_INBOUND: %q", in)
	}
}

// TestBuildSharesPlans: equal parameters give the rules built once, with
// their fingerprint; a caller adding a rule to its plan changes neither
// the next caller's plan nor keeps the old fingerprint; parameters that
// differ (or the IPv6 choice) give their own plan.
func TestBuildSharesPlans(t *testing.T) {
	params := func(ports string) redirect.Params {
		p, _, err := redirect.FromPod(&podinfo.Pod{
			Annotations: map[string]string{redirect.AnnotationStatus: "{}", redirect.AnnotationExcludeOutboundPorts: ports},
			Containers:  []podinfo.Container{{Name: redirect.ProxyContainerName}},
		})
		if err != nil {
			t.Fatal(err)
		}
		return p
	}
	a := Build(params("5555"), true)
	b := Build(params("5555"), true)
	if &a.V4.Rules[0] != &b.V4.Rules[0] || a.Fingerprint() != b.Fingerprint() {
		t.Fatal("equal parameters built their rules again")
	}
	fresh := build(params("5555"), true)
	if a.Fingerprint() != fresh.Fingerprint() || render(a) != render(fresh) {
		t.Fatal("a shared plan differs from one built afresh")
	}
	n := len(a.V4.Rules)
	a.V4.Rules = append(a.V4.Rules, Rule{Table: "nat", Chain: ChainOutput, Args: []string{"-j", "RETURN"}})
	if a.Fingerprint() == b.Fingerprint() {
		t.Fatal("a plan with a rule added kept the fingerprint of the rules it had")
	}
	if c := Build(params("5555"), true); len(c.V4.Rules) != n || len(b.V4.Rules) != n {
		t.Fatalf("a rule added to one caller's plan reached others: %d and %d rules, want %d", len(c.V4.Rules), len(b.V4.Rules), n)
	}
	d := Build(params("5555"), true)
	d.TProxyRoutes = !d.TProxyRoutes
	if d.Fingerprint() == b.Fingerprint() {
		t.Fatal("a plan with its routing flag changed kept its fingerprint")
	}
	e := Build(params("5555"), true)
	e.V6 = nil
	if e.Fingerprint() == b.Fingerprint() {
		t.Fatal("a plan with its IPv6 rules dropped kept its fingerprint")
	}
	if c := Build(params("5556"), true); c.Fingerprint() == b.Fingerprint() {
		t.Fatal("different parameters share a plan")
	}
	if c := Build(params("5555"), false); c.V6 != nil || c.Fingerprint() == b.Fingerprint() {
		t.Fatal("the IPv4-only plan is the dual one")
	}
}

// TestUDPExclusionOnlyForDNS: a long excludeOutboundPorts list gets its
// UDP rule only with DNS capture, because without it no rule a UDP packet
// meets in the nat table's output path after the exclusion does anything
// but return: dropping the rule changes no packet's fate. Checked over
// plans with every setting that adds output rules; a rule added later
// that acts on UDP fails here and needs the UDP exclusion back.
func TestUDPExclusionOnlyForDNS(t *testing.T) {
	ports := make([]string, SetThreshold+1)
	for i := range ports {
		ports[i] = strconv.Itoa(20000 + i)
	}
	variants := []map[string]string{
		{},
		{redirect.AnnotationInterceptionMode: "TPROXY", redirect.AnnotationIncludeInboundPorts: "*"},
		{redirect.AnnotationIncludeOutboundCIDRs: "*", redirect.AnnotationRerouteVirtualIfaces: "eth1"},
		{redirect.AnnotationIncludeOutboundCIDRs: "10.0.0.0/8,127.0.0.0/8,fd00::/8", redirect.AnnotationExcludeOutboundCIDRs: "10.1.0.0/16"},
		{redirect.AnnotationIncludeOutboundPorts: strings.Join(ports, ","), redirect.AnnotationKubevirtInterfaces: "net1"},
	}
	for _, dns := range []bool{false, true} {
		for i, ann := range variants {
			a := map[string]string{redirect.AnnotationStatus: "{}", redirect.AnnotationExcludeOutboundPorts: strings.Join(ports, ",")}
			for k, v := range ann {
				a[k] = v
			}
			env := map[string]string{}
			if dns {
				env[redirect.EnvDNSCapture] = "true"
			}
			pod := &podinfo.Pod{Annotations: a, Containers: []podinfo.Container{{Name: redirect.ProxyContainerName, Env: env}}}
			params, _, err := redirect.FromPod(pod)
			if err != nil {
				t.Fatal(err)
			}
			for _, s := range Build(params, true).Sets() {
				past, udpExcl, actsOnUDP := false, false, ""
				rules := s.Final()["nat"]
				for _, r := range rules[ChainOutput] {
					if r.Origin == redirect.AnnotationExcludeOutboundPorts {
						past = true
						udpExcl = udpExcl || slices.Contains(r.Args, "udp")
						continue
					}
					if past && actsOnUDP == "" {
						actsOnUDP = udpEffect(rules, r, 0)
					}
				}
				switch {
				case !past:
					t.Errorf("variant %d, %v: no exclusion rule", i, s.Family)
				case dns && !udpExcl:
					t.Errorf("variant %d, %v, DNS capture: no UDP exclusion", i, s.Family)
				case !dns && udpExcl:
					t.Errorf("variant %d, %v: a UDP exclusion without DNS capture", i, s.Family)
				case !dns && actsOnUDP != "":
					t.Errorf("variant %d, %v: without DNS capture, a UDP packet past the exclusion meets %s", i, s.Family, actsOnUDP)
				case dns && actsOnUDP == "":
					t.Errorf("variant %d, %v: DNS capture, but no rule past the exclusion acts on UDP (the check sees nothing)", i, s.Family)
				}
			}
		}
	}
}

// udpEffect says which rule, r or one in a chain it jumps to, can do to a
// UDP packet anything but return to the caller or fall through; "" if
// none can.
func udpEffect(rules map[string][]Rule, r Rule, depth int) string {
	if depth > 8 {
		return "a jump loop at " + strings.Join(r.Args, " ")
	}
	for i := 0; i+1 < len(r.Args); i++ {
		if r.Args[i] == "-p" && r.Args[i+1] == "tcp" && (i == 0 || r.Args[i-1] != "!") {
			return ""
		}
	}
	target := ""
	for i := 0; i+1 < len(r.Args); i++ {
		if r.Args[i] == "-j" {
			target = r.Args[i+1]
		}
	}
	switch {
	case target == "RETURN" || target == "":
		return ""
	case rules[target] != nil:
		for _, x := range rules[target] {
			if what := udpEffect(rules, x, depth+1); what != "" {
				return what
			}
		}
		return ""
	}
	return strings.Join(r.Args, " ")
}
