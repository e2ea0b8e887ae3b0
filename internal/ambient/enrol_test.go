package ambient

import (
	"fmt"
	"net/netip"
	"reflect"
	"slices"
	"strings"
	"testing"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/istio-cni-go/istio-cni/internal/redirect"
	"github.com/istio-cni-go/istio-cni/internal/ruleset"
)

func pod(ns, name string, lbls, ann map[string]string) *corev1.Pod {
	return &corev1.Pod{ObjectMeta: metav1.ObjectMeta{Namespace: ns, Name: name, Labels: lbls, Annotations: ann}}
}

var (
	ambientLabel = map[string]string{LabelDataplaneMode: ModeAmbient}
	noneLabel    = map[string]string{LabelDataplaneMode: ModeNone}
)

func TestDecideDefaults(t *testing.T) {
	policy := Policy{ExcludeNamespaces: []string{"kube-system"}, SystemNamespace: "istio-system"}
	hostNet := pod("a", "p", ambientLabel, nil)
	hostNet.Spec.HostNetwork = true
	for _, c := range []struct {
		name string
		pod  *corev1.Pod
		ns   map[string]string
		want bool
	}{
		{"pod label", pod("a", "p", ambientLabel, nil), nil, true},
		{"namespace label", pod("a", "p", nil, nil), ambientLabel, true},
		{"namespace label, other pod labels", pod("a", "p", map[string]string{"app": "x"}, nil), ambientLabel, true},
		{"namespace label, pod opts out", pod("a", "p", noneLabel, nil), ambientLabel, false},
		{"pod label none, namespace unlabelled", pod("a", "p", noneLabel, nil), nil, false},
		{"pod label with another value", pod("a", "p", map[string]string{LabelDataplaneMode: "sidecar"}, nil), nil, false},
		{"namespace label, pod label with another value", pod("a", "p", map[string]string{LabelDataplaneMode: "other"}, nil), ambientLabel, true},
		{"nothing", pod("a", "p", nil, nil), map[string]string{"x": "y"}, false},
		{"namespace none", pod("a", "p", nil, nil), noneLabel, false},
		{"pod label wins over namespace none", pod("a", "p", ambientLabel, nil), noneLabel, true},
		{"hostNetwork", hostNet, ambientLabel, false},
		{"sidecar", pod("a", "p", ambientLabel, map[string]string{"sidecar.istio.io/status": "{}"}), ambientLabel, false},
		{"excluded namespace", pod("kube-system", "p", ambientLabel, nil), ambientLabel, false},
		{"agent's own pod", pod("istio-system", "istio-cni-node-x7k2p", nil, nil), ambientLabel, false},
		{"ztunnel", pod("istio-system", "ztunnel-abc", map[string]string{"app": "ztunnel"}, nil), ambientLabel, false},
		{"app=ztunnel elsewhere is a pod like any", pod("a", "ztunnel-abc", map[string]string{"app": "ztunnel"}, nil), ambientLabel, true},
		{"other pod of the system namespace", pod("istio-system", "istiod-1", nil, nil), ambientLabel, true},
	} {
		t.Run(c.name, func(t *testing.T) {
			d := decide(policy, c.pod, c.ns)
			if d.Enrol != c.want {
				t.Errorf("Decide = %+v, want enrol %v", d, c.want)
			}
			if d.Reason == "" {
				t.Error("no reason given")
			}
		})
	}
}

func TestSelectors(t *testing.T) {
	custom := `
- podSelector:
    matchLabels: {mesh: "yes"}
- namespaceSelector:
    matchExpressions:
      - {key: team, operator: In, values: [blue, green]}
  podSelector:
    matchExpressions:
      - {key: istio.io/dataplane-mode, operator: DoesNotExist}
`
	s, err := ParseSelectors(custom)
	if err != nil {
		t.Fatal(err)
	}
	for _, c := range []struct {
		pod, ns map[string]string
		want    bool
	}{
		{map[string]string{"mesh": "yes"}, nil, true},
		{nil, map[string]string{"team": "blue"}, true},
		{noneLabel, map[string]string{"team": "blue"}, false},
		{ambientLabel, ambientLabel, false},
		{nil, map[string]string{"team": "red"}, false},
	} {
		if got := s.Match(c.pod, c.ns); got != c.want {
			t.Errorf("Match(%v, %v) = %v, want %v", c.pod, c.ns, got, c.want)
		}
	}
	if len(s.Source()) != 2 {
		t.Errorf("Source() = %v", s.Source())
	}

	// An empty podSelector or namespaceSelector matches everything.
	all, err := ParseSelectors(`[{}]`)
	if err != nil || !all.Match(nil, nil) {
		t.Errorf("[{}]: err %v, match %v; want every pod", err, all != nil && all.Match(nil, nil))
	}
	none, err := ParseSelectors(`[]`)
	if err != nil || none.Match(ambientLabel, ambientLabel) {
		t.Errorf("[]: err %v; want no pod", err)
	}
	// Empty text is the default, the same as the chart's values.
	def, err := ParseSelectors("  \n")
	if err != nil || !reflect.DeepEqual(def.Source(), DefaultSelectors().Source()) {
		t.Errorf("empty text: %v", err)
	}
	// The policy with explicit selectors uses them, not the default.
	p := Policy{Selectors: s}
	if decide(p, pod("a", "p", ambientLabel, nil), nil).Enrol {
		t.Error("custom selectors: a pod with only the default's label was enrolled")
	}
}

func TestSelectorErrors(t *testing.T) {
	for text, want := range map[string]string{
		"- podSelecter: {}": "unknown field",
		"- podSelector:\n    matchExpressions:\n      - {key: a, operator: Maybe}":          "selector 1: podSelector",
		"- {}\n- namespaceSelector:\n    matchExpressions:\n      - {key: a, operator: In}": "selector 2: namespaceSelector",
		"podSelector: {}": "cannot unmarshal",
	} {
		_, err := ParseSelectors(text)
		if err == nil || !strings.Contains(err.Error(), want) || !strings.Contains(err.Error(), "enablement selector") {
			t.Errorf("ParseSelectors(%q) = %v, want an error with %q", text, err, want)
		}
	}
}

func TestPodParams(t *testing.T) {
	d := Defaults{DNSCapture: true, IPv6: true}
	for _, c := range []struct {
		name string
		ann  map[string]string
		want ruleset.AmbientParams
		err  string
	}{
		{"defaults", nil, ruleset.AmbientParams{DNSCapture: true, IPv6: true}, ""},
		{"dns off", map[string]string{AnnotationDNSCapture: "false"}, ruleset.AmbientParams{IPv6: true}, ""},
		{"bypass inbound", map[string]string{AnnotationBypassInbound: "True"}, ruleset.AmbientParams{DNSCapture: true, IPv6: true, BypassInbound: true}, ""},
		{"bypass inbound off", map[string]string{AnnotationBypassInbound: "0"}, ruleset.AmbientParams{DNSCapture: true, IPv6: true}, ""},
		{"virtual interfaces", map[string]string{AnnotationRerouteVirtualInterfaces: " tap0, ,veth+,tap0"},
			ruleset.AmbientParams{DNSCapture: true, IPv6: true, RerouteInterfaces: []string{"tap0", "veth+"}}, ""},
		{"empty virtual interfaces", map[string]string{AnnotationRerouteVirtualInterfaces: ""}, ruleset.AmbientParams{DNSCapture: true, IPv6: true}, ""},
		{"bad bool", map[string]string{AnnotationDNSCapture: "yes"}, ruleset.AmbientParams{},
			`invalid annotation ambient.istio.io/dns-capture="yes": must be true or false`},
		{"bad bypass", map[string]string{AnnotationBypassInbound: "enabled"}, ruleset.AmbientParams{},
			`invalid annotation ambient.istio.io/bypass-inbound-capture="enabled"`},
		{"interface option", map[string]string{AnnotationRerouteVirtualInterfaces: "tap0,-j"}, ruleset.AmbientParams{},
			`invalid annotation istio.io/reroute-virtual-interfaces="tap0,-j": "-j" is not a valid interface name`},
		{"every interface", map[string]string{AnnotationRerouteVirtualInterfaces: "+"}, ruleset.AmbientParams{},
			`"+" would match every interface`},
		{"too long", map[string]string{AnnotationRerouteVirtualInterfaces: "abcdefghijklmnop"}, ruleset.AmbientParams{},
			`"abcdefghijklmnop" is not a valid interface name`},
		// A set's name in the nftables rules is marked apart: an '@' is a
		// name's own.
		{"at sign", map[string]string{AnnotationRerouteVirtualInterfaces: "@tap0"},
			ruleset.AmbientParams{DNSCapture: true, IPv6: true, RerouteInterfaces: []string{"@tap0"}}, ""},
		{"one name repeated", map[string]string{AnnotationRerouteVirtualInterfaces: strings.Repeat("tap0,", 50000)},
			ruleset.AmbientParams{DNSCapture: true, IPv6: true, RerouteInterfaces: []string{"tap0"}}, ""},
		{"too many", map[string]string{AnnotationRerouteVirtualInterfaces: manyInterfaces(redirect.MaxInterfaces + 1)}, ruleset.AmbientParams{},
			fmt.Sprintf("%d interfaces, more than the %d", redirect.MaxInterfaces+1, redirect.MaxInterfaces)},
	} {
		t.Run(c.name, func(t *testing.T) {
			got, err := PodParams(pod("a", "p", nil, c.ann), d)
			if c.err != "" {
				if err == nil || !strings.Contains(err.Error(), c.err) || !IsInvalidAnnotation(err) {
					t.Fatalf("err = %v, want %q", err, c.err)
				}
				return
			}
			if err != nil {
				t.Fatal(err)
			}
			if !reflect.DeepEqual(got, c.want) {
				t.Errorf("PodParams = %+v, want %+v", got, c.want)
			}
		})
	}
}

// TestProbeIPsOrderFree: a dual-stack pod's addresses compare equal in
// the status's order (IPv6 first on an IPv6-primary cluster) and the
// namespace's (IPv4 first), so its status update does not enrol it again.
func TestProbeIPsOrderFree(t *testing.T) {
	c := &Controller{cfg: Config{HostParams: ruleset.HostParams{IPv6: true}}}
	v4, v6 := netip.MustParseAddr("10.1.0.7"), netip.MustParseAddr("fd00:1::7")
	if a, b := c.probeIPs([]netip.Addr{v6, v4}), c.probeIPs([]netip.Addr{v4, v6}); !slices.Equal(a, b) {
		t.Fatalf("%v != %v", a, b)
	}
}

func manyInterfaces(n int) string {
	names := make([]string, n)
	for i := range names {
		names[i] = fmt.Sprintf("v%d", i)
	}
	return strings.Join(names, ",")
}
