package redirect

import (
	"errors"
	"fmt"
	"net/netip"
	"reflect"
	"slices"
	"strconv"
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

// TestLongListsKeptParsed: the pods of a Deployment with long lists get
// their parameters from one parse, and what one pod does with its lists
// (appending, as the inbound exclusions do) reaches no other pod.
func TestLongListsKeptParsed(t *testing.T) {
	var cidrs, ports []string
	for i := 0; i < 300; i++ {
		cidrs = append(cidrs, fmt.Sprintf("10.%d.%d.0/24", i/256, i%256))
		ports = append(ports, strconv.Itoa(20000+i))
	}
	ann := map[string]string{
		AnnotationExcludeOutboundCIDRs: strings.Join(cidrs, ","),
		AnnotationExcludeOutboundPorts: strings.Join(ports, ","),
		AnnotationExcludeInboundPorts:  strings.Join(ports, ",") + ",15021",
	}
	first, _, err := FromPod(pod(ann, podspec.Container{}))
	if err != nil {
		t.Fatal(err)
	}
	kept := parsedCIDRs.Len() + parsedPorts.Len()
	second, _, err := FromPod(pod(ann, podspec.Container{}))
	if err != nil {
		t.Fatal(err)
	}
	// A caller appending to its lists must not write into another pod's.
	a, b := first.ExcludeInboundPorts, second.ExcludeInboundPorts
	a, b = append(a, "1"), append(b, "2")
	c, d := first.ExcludeOutboundCIDRs, second.ExcludeOutboundCIDRs
	c, d = append(c, netip.MustParsePrefix("192.0.2.0/24")), append(d, netip.MustParsePrefix("198.51.100.0/24"))
	if a[len(a)-1] != "1" || b[len(b)-1] != "2" || c[len(c)-1] == d[len(d)-1] {
		t.Fatal("two pods' lists share what lies past their ends")
	}
	if parsedCIDRs.Len()+parsedPorts.Len() != kept {
		t.Fatalf("the second pod parsed its lists again (%d kept, then %d)", kept, parsedCIDRs.Len()+parsedPorts.Len())
	}
	if !reflect.DeepEqual(first, second) {
		t.Fatal("two pods with the same annotations got different parameters")
	}
	if len(second.ExcludeOutboundCIDRs) != 300 || second.ExcludeOutboundCIDRs[299].String() != "10.1.43.0/24" {
		t.Fatalf("excluded CIDRs: %d, last %v", len(second.ExcludeOutboundCIDRs), second.ExcludeOutboundCIDRs[len(second.ExcludeOutboundCIDRs)-1])
	}
	if got := second.ExcludeInboundPorts; len(got) != 303 || got[300] != "15021" || got[302] != "15090" {
		t.Fatalf("excluded inbound ports: %d, ending %v", len(got), got[len(got)-3:])
	}
	// A long value that does not parse fails every pod that carries it.
	ann[AnnotationExcludeOutboundPorts] += ",http"
	for i := 0; i < 2; i++ {
		var bad *InvalidAnnotationError
		if _, _, err := FromPod(pod(ann, podspec.Container{})); !errors.As(err, &bad) || bad.Key != AnnotationExcludeOutboundPorts {
			t.Fatalf("pod %d: %v, want an error naming %s", i, err, AnnotationExcludeOutboundPorts)
		}
	}
}

// TestKeyCoversEveryParameter: a parameter AppendKey leaves out would let
// pods that differ in it share one plan. Every field, set alone, must
// change the key, and items moved between neighbouring lists too.
func TestKeyCoversEveryParameter(t *testing.T) {
	key := func(p Params) string { return string(p.AppendKey(nil)) }
	seen := map[string]string{key(Params{}): "zero"}
	typ := reflect.TypeOf(Params{})
	for i := 0; i < typ.NumField(); i++ {
		var p Params
		f := reflect.ValueOf(&p).Elem().Field(i)
		switch v := f.Addr().Interface().(type) {
		case *Mode:
			*v = ModeTProxy
		case *string:
			*v = "x"
		case *bool:
			*v = true
		case *[]string:
			*v = []string{"x"}
		case *[]netip.Prefix:
			*v = []netip.Prefix{netip.MustParsePrefix("10.0.0.0/8")}
		default:
			t.Fatalf("field %s has type %s: teach AppendKey and this test about it", typ.Field(i).Name, f.Type())
		}
		k := key(p)
		if other, dup := seen[k]; dup {
			t.Fatalf("setting %s leaves the key as for %s", typ.Field(i).Name, other)
		}
		seen[k] = typ.Field(i).Name
	}
	a := Params{IncludeInboundPorts: []string{"1", "2"}}
	b := Params{IncludeInboundPorts: []string{"1"}, ExcludeInboundPorts: []string{"2"}}
	c := Params{IncludeInboundPorts: []string{"12"}}
	if key(a) == key(b) || key(a) == key(c) {
		t.Fatal("lists that differ only in where their items end share a key")
	}
	v4 := Params{ExcludeOutboundCIDRs: []netip.Prefix{netip.MustParsePrefix("10.0.0.0/8")}}
	mapped := Params{ExcludeOutboundCIDRs: []netip.Prefix{netip.MustParsePrefix("::ffff:10.0.0.0/8")}}
	if key(v4) == key(mapped) {
		t.Fatal("an IPv4 prefix and its IPv4-mapped IPv6 form share a key")
	}
}

// TestInterfaceListsDeduplicatedAndBounded: a name repeated is one name
// (256 KiB of "a," was a million iptables rules for the agent to build),
// and a list of more distinct names than MaxInterfaces fails naming the
// annotation and the count.
func TestInterfaceListsDeduplicatedAndBounded(t *testing.T) {
	for _, key := range []string{AnnotationExcludeInterfaces, AnnotationRerouteVirtualIfaces, AnnotationKubevirtInterfaces} {
		p, _, err := FromPod(pod(map[string]string{AnnotationStatus: "x", key: strings.Repeat("a,", 128<<10) + "b,a"}, podspec.Container{}))
		if err != nil {
			t.Fatalf("%s: %v", key, err)
		}
		got := p.ExcludeInterfaces
		if key != AnnotationExcludeInterfaces {
			got = p.RerouteInterfaces
		}
		if !slices.Equal(got, []string{"a", "b"}) {
			t.Fatalf("%s: %d names (%.40q...), want [a b]", key, len(got), got)
		}
		names := make([]string, MaxInterfaces+1)
		for i := range names {
			names[i] = fmt.Sprintf("v%d", i)
		}
		_, _, err = FromPod(pod(map[string]string{AnnotationStatus: "x", key: strings.Join(names, ",")}, podspec.Container{}))
		var ie *InvalidAnnotationError
		if !errors.As(err, &ie) || !strings.Contains(err.Error(), key) || !strings.Contains(err.Error(), fmt.Sprintf("%d interfaces", MaxInterfaces+1)) {
			t.Fatalf("%s with %d names: %v", key, len(names), err)
		}
		if _, _, err := FromPod(pod(map[string]string{AnnotationStatus: "x", key: strings.Join(names[:MaxInterfaces], ",")}, podspec.Container{})); err != nil {
			t.Fatalf("%s with %d names: %v", key, MaxInterfaces, err)
		}
	}
}
