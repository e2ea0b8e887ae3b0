package testutil

import (
	"github.com/istio-cni-go/istio-cni/internal/podinfo"
	"github.com/istio-cni-go/istio-cni/internal/redirect"
)

// RedirectCase is a pod shape whose redirect rules are pinned by goldens
// and exercised for real by the namespace tests.
type RedirectCase struct {
	Name        string
	Annotations map[string]string
	Proxy       podinfo.Container
}

// Pod returns an injected pod with the case's annotations and proxy.
func (c RedirectCase) Pod() *podinfo.Pod {
	ann := map[string]string{redirect.AnnotationStatus: "{}"}
	for k, v := range c.Annotations {
		ann[k] = v
	}
	proxy := c.Proxy
	proxy.Name = redirect.ProxyContainerName
	return &podinfo.Pod{Namespace: "default", Name: "pod-" + c.Name, Annotations: ann,
		Containers: []podinfo.Container{{Name: "app"}, proxy}}
}

func I64(v int64) *int64 { return &v }

// RedirectCases are the pods of Istio's plugin goldens plus the options its
// plugin goldens do not cover. Each renders for IPv4 only and dual family.
var RedirectCases = []RedirectCase{
	{Name: "basic"},
	{Name: "custom-uid-zero", Proxy: podinfo.Container{RunAsUser: I64(0), RunAsGroup: I64(0)}},
	{Name: "include-exclude-ip", Annotations: map[string]string{
		redirect.AnnotationIncludeOutboundCIDRs: "127.0.0.0/8",
		redirect.AnnotationExcludeOutboundCIDRs: "10.0.0.0/8",
	}},
	{Name: "include-exclude-ports", Annotations: map[string]string{
		redirect.AnnotationIncludeInboundPorts:  "1111,2222",
		redirect.AnnotationExcludeInboundPorts:  "3333,4444",
		redirect.AnnotationExcludeOutboundPorts: "5555,6666",
	}},
	{Name: "tproxy", Annotations: map[string]string{redirect.AnnotationInterceptionMode: "TPROXY"}},
	{Name: "tproxy-include-ports", Annotations: map[string]string{
		redirect.AnnotationInterceptionMode:    "TPROXY",
		redirect.AnnotationIncludeInboundPorts: "8080,9090",
	}},
	{Name: "dns", Proxy: podinfo.Container{Env: map[string]string{redirect.EnvDNSCapture: "true"}}},
	{Name: "invalid-drop", Proxy: podinfo.Container{Env: map[string]string{redirect.EnvInvalidDrop: "true"}}},
	{Name: "custom-uid", Proxy: podinfo.Container{RunAsUser: I64(1000670000), RunAsGroup: I64(1000670001)}},
	{Name: "custom-uid-tproxy",
		Annotations: map[string]string{redirect.AnnotationInterceptionMode: "TPROXY"},
		Proxy:       podinfo.Container{RunAsUser: I64(1000670000), RunAsGroup: I64(1000670001)}},
	{Name: "exclude-interfaces", Annotations: map[string]string{
		redirect.AnnotationExcludeInterfaces: "net1,eth2",
		redirect.AnnotationInterceptionMode:  "TPROXY",
	}},
	{Name: "reroute-virtual-interfaces", Annotations: map[string]string{
		redirect.AnnotationRerouteVirtualIfaces: "eth1,eth2",
		redirect.AnnotationKubevirtInterfaces:   "ignored0",
	}},
	{Name: "kubevirt-interfaces-cidrs", Annotations: map[string]string{
		redirect.AnnotationKubevirtInterfaces:   "eth1",
		redirect.AnnotationIncludeOutboundCIDRs: "10.96.0.0/12,fd00:10:96::/112",
	}},
	{Name: "include-outbound-ports", Annotations: map[string]string{
		redirect.AnnotationIncludeOutboundCIDRs: "",
		redirect.AnnotationIncludeOutboundPorts: "3306,5432",
	}},
	{Name: "dual-stack-cidrs", Annotations: map[string]string{
		redirect.AnnotationIncludeOutboundCIDRs: "10.0.0.0/8,fd00::/8",
		redirect.AnnotationExcludeOutboundCIDRs: "10.1.0.0/16,fd00:1::/32",
	}},
	{Name: "no-inbound", Annotations: map[string]string{redirect.AnnotationIncludeInboundPorts: ""}},
	{Name: "none-mode", Annotations: map[string]string{redirect.AnnotationInterceptionMode: "NONE"}},
}
