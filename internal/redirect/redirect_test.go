package redirect

import (
	"errors"
	"reflect"
	"strings"
	"testing"

	"github.com/istio-cni-go/istio-cni/internal/podspec"
)

func pod(ann map[string]string, proxy podspec.Container) *podspec.Pod {
	proxy.Name = ProxyContainerName
	return &podspec.Pod{Annotations: ann, Containers: []podspec.Container{{Name: "app"}, proxy}}
}

func TestDefaults(t *testing.T) {
	p, warns, err := FromPod(pod(map[string]string{AnnotationStatus: "x"}, podspec.Container{}))
	if err != nil || len(warns) > 0 {
		t.Fatal(err, warns)
	}
	want := Params{
		Mode: ModeRedirect, IncludeOutboundAll: true, IncludeInboundAll: true,
		ExcludeInboundPorts:  []string{"15020", "15021", "15090"},
		ExcludeOutboundPorts: []string{"15020"},
		ProxyUID:             []string{"1337"}, ProxyGID: []string{"1337"},
	}
	if !reflect.DeepEqual(p, want) {
		t.Fatalf("defaults:\n got %+v\nwant %+v", p, want)
	}
}

func TestExcludeInboundDedup(t *testing.T) {
	p, _, err := FromPod(pod(map[string]string{AnnotationExcludeInboundPorts: "3306, 15021,3306"}, podspec.Container{}))
	if err != nil {
		t.Fatal(err)
	}
	if got := strings.Join(p.ExcludeInboundPorts, ","); got != "3306,15021,15020,15090" {
		t.Fatalf("got %s", got)
	}
}

func TestExplicitOutboundExcludeReplacesDefault(t *testing.T) {
	p, _, err := FromPod(pod(map[string]string{AnnotationExcludeOutboundPorts: "5555"}, podspec.Container{}))
	if err != nil {
		t.Fatal(err)
	}
	if got := strings.Join(p.ExcludeOutboundPorts, ","); got != "5555" {
		t.Fatalf("got %s", got)
	}
}

func TestRerouteOverridesKubevirt(t *testing.T) {
	p, _, err := FromPod(pod(map[string]string{AnnotationRerouteVirtualIfaces: "a0", AnnotationKubevirtInterfaces: "b0"}, podspec.Container{}))
	if err != nil || !reflect.DeepEqual(p.RerouteInterfaces, []string{"a0"}) {
		t.Fatal(err, p.RerouteInterfaces)
	}
	p, _, err = FromPod(pod(map[string]string{AnnotationKubevirtInterfaces: "b0"}, podspec.Container{}))
	if err != nil || !reflect.DeepEqual(p.RerouteInterfaces, []string{"b0"}) {
		t.Fatal(err, p.RerouteInterfaces)
	}
}

func TestProxyIDsAndEnv(t *testing.T) {
	u, g := int64(1000), int64(0)
	p, warns, err := FromPod(pod(nil, podspec.Container{RunAsUser: &u, RunAsGroup: &g,
		Env: map[string]string{EnvDNSCapture: "true", EnvDualStack: "maybe", EnvInvalidDrop: "1"}}))
	if err != nil {
		t.Fatal(err)
	}
	if p.ProxyUID[0] != "1000" || p.ProxyGID[0] != "1337" || !p.DNSCapture || p.DualStack || !p.DropInvalid {
		t.Fatalf("got %+v", p)
	}
	if len(warns) != 1 || !strings.Contains(warns[0], "ISTIO_DUAL_STACK") {
		t.Fatalf("want one warning about ISTIO_DUAL_STACK, got %q", warns)
	}
}

// TestInvalidAnnotations: every bad value is refused with an error that
// names the annotation and the value.
func TestInvalidAnnotations(t *testing.T) {
	cases := []struct{ key, value string }{
		{AnnotationInterceptionMode, "REDIRECTT"},
		{AnnotationInterceptionMode, "redirect"},
		{AnnotationIncludeOutboundCIDRs, "10.0.0.0/33"},
		{AnnotationIncludeOutboundCIDRs, "10.0.0.0/8,,192.168.0.0/16"},
		{AnnotationExcludeOutboundCIDRs, "not-a-cidr"},
		{AnnotationExcludeOutboundCIDRs, "*"},
		{AnnotationIncludeInboundPorts, "70000"},
		{AnnotationIncludeInboundPorts, "80,"},
		{AnnotationExcludeInboundPorts, "-1"},
		{AnnotationExcludeInboundPorts, "*"},
		{AnnotationIncludeOutboundPorts, "http"},
		{AnnotationExcludeOutboundPorts, "1 2"},
		{AnnotationExcludeInterfaces, "eth0 -j ACCEPT"},
		{AnnotationExcludeInterfaces, "averyveryverylongname"},
		{AnnotationRerouteVirtualIfaces, "-i"},
		{AnnotationExcludeInterfaces, "eth1,+"},
		{AnnotationKubevirtInterfaces, "eth\n0"},
	}
	for _, c := range cases {
		_, _, err := FromPod(pod(map[string]string{c.key: c.value}, podspec.Container{}))
		var ia *InvalidAnnotationError
		if !errors.As(err, &ia) {
			t.Errorf("%s=%q: want InvalidAnnotationError, got %v", c.key, c.value, err)
			continue
		}
		if !strings.Contains(err.Error(), c.key) || !strings.Contains(err.Error(), strings.TrimSpace(strings.ReplaceAll(c.value, "\n", `\n`))) {
			t.Errorf("%s=%q: error does not name key and value: %v", c.key, c.value, err)
		}
	}
}

// FuzzFromPod: whatever the annotations say, parsing never panics and
// nothing that could break out of an iptables-restore line gets through.
func FuzzFromPod(f *testing.F) {
	f.Add("REDIRECT", "*", "10.0.0.0/8", "80,443", "15020", "eth1")
	f.Add("TPROXY", "fd00::/8,10.0.0.0/8", "", "*", "", "net1,eth+")
	f.Add("NONE", "", "1.2.3.4/32", "", "22", "")
	f.Fuzz(func(t *testing.T, mode, incl, excl, inPorts, outPorts, ifaces string) {
		p, _, err := FromPod(pod(map[string]string{
			AnnotationInterceptionMode:     mode,
			AnnotationIncludeOutboundCIDRs: incl,
			AnnotationExcludeOutboundCIDRs: excl,
			AnnotationIncludeInboundPorts:  inPorts,
			AnnotationExcludeOutboundPorts: outPorts,
			AnnotationExcludeInterfaces:    ifaces,
		}, podspec.Container{}))
		if err != nil {
			return
		}
		all := append(append(append([]string{}, p.IncludeInboundPorts...), p.ExcludeOutboundPorts...), p.ExcludeInterfaces...)
		for _, s := range all {
			if s == "" || strings.ContainsAny(s, " \t\n\r\"'!") || strings.HasPrefix(s, "-") {
				t.Fatalf("unsafe value %q accepted", s)
			}
		}
	})
}
