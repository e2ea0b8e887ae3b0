package ruleset

import (
	"fmt"
	"net/netip"

	"github.com/istio-cni-go/istio-cni/internal/redirect"
)

// Ambient mode's chains, marks and addresses: ztunnel, the reference's
// agent and its troubleshooting guides know these values, so they are
// not settings.
const (
	// ChainPrerouting is the in-pod chain PREROUTING jumps to.
	ChainPrerouting = "ISTIO_PRERT"
	// ChainPostrouting is the node's chain of the probe SNAT.
	ChainPostrouting = "ISTIO_POSTRT"

	// ZtunnelMark is the mark ztunnel puts on its own sockets (1337),
	// matched under MarkMask so other users of the mark's high bits keep
	// theirs.
	ZtunnelMark      = "0x539/0xfff"
	ZtunnelMarkValue = 0x539
	// ConnMark is what a connection ztunnel opened inbound carries, so
	// the app's replies are routed back to ztunnel (InboundRouteTable).
	ConnMark      = "0x111/0xfff"
	ConnMarkValue = 0x111
	MarkMask      = 0xfff

	// InboundRouteTable delivers everything locally; packets carrying
	// ConnMark look it up at InboundRulePriority.
	InboundRouteTable   = 100
	InboundRulePriority = 32764

	// ProbeSetV4 and ProbeSetV6 hold the addresses of the node's enrolled
	// pods, each entry commented with its pod's UID.
	ProbeSetV4 = "istio-inpod-probes-v4"
	ProbeSetV6 = "istio-inpod-probes-v6"

	// DNSPortUpstream is the port DNS capture takes over.
	DNSPortUpstream = "53"
)

// ProbeSourceV4 and ProbeSourceV6 are the sources the node SNATs its own
// connections to enrolled pods to (kubelet's probes), which the in-pod
// rules let through to the app without ztunnel.
var (
	ProbeSourceV4 = netip.MustParseAddr("169.254.7.127")
	ProbeSourceV6 = netip.MustParseAddr("fd16:9254:7127:1337:ffff:ffff:ffff:ffff")
)

var probeSource = versioned{ProbeSourceV4.String() + "/32", ProbeSourceV6.String() + "/128"}

// AmbientParams is what shapes one enrolled pod's rules.
type AmbientParams struct {
	// DNSCapture sends the pod's DNS (UDP and TCP 53) to ztunnel's DNS
	// proxy (ambient.istio.io/dns-capture, else the node's default).
	DNSCapture bool
	// IPv6 adds the IPv6 rules.
	IPv6 bool
	// RerouteInterfaces are interfaces whose inbound TCP is the pod's own
	// outbound (istio.io/reroute-virtual-interfaces: VMs, nested
	// containers).
	RerouteInterfaces []string
	// BypassInbound leaves inbound traffic to the app
	// (ambient.istio.io/bypass-inbound-capture).
	BypassInbound bool
}

// BuildAmbient computes the rules of an enrolled pod, in the reference's
// order, so its text reads the same as the reference's.
func BuildAmbient(p AmbientParams) *Plan {
	b := &builder{v4: &Set{Family: IPv4}}
	if p.IPv6 {
		b.v6 = &Set{Family: IPv6}
	}
	b.appendRule("mangle", "PREROUTING", "-j", ChainPrerouting)
	b.appendRule("mangle", "OUTPUT", "-j", ChainOutput)
	b.appendRule("nat", "OUTPUT", "-j", ChainOutput)
	if p.DNSCapture {
		b.appendRule("raw", "PREROUTING", "-j", ChainPrerouting)
		b.appendRule("raw", "OUTPUT", "-j", ChainOutput)
	}
	b.appendRule("nat", "PREROUTING", "-j", ChainPrerouting)

	// Rerouted interfaces come first: their traffic is outbound, whatever
	// follows says about inbound.
	for _, iface := range p.RerouteInterfaces {
		b.appendFrom(redirect.AnnotationRerouteVirtualIfaces, "nat", ChainPrerouting, "-i", iface, "-p", "tcp", "-j", "REDIRECT", "--to-ports", ProxyOutboundPort)
		b.appendFrom(redirect.AnnotationRerouteVirtualIfaces, "nat", ChainPrerouting, "-i", iface, "-p", "tcp", "-j", "RETURN")
	}
	// Kept when inbound capture is bypassed: HBONE still reaches ztunnel,
	// whose transparent dial to the app needs the app's replies marked
	// back to it (Istio's #58546, fixed by its PR #58577).
	b.appendRule("mangle", ChainPrerouting, "-m", "mark", "--mark", ZtunnelMark, "-j", "CONNMARK", "--set-xmark", ConnMark)
	if !p.BypassInbound {
		b.appendRule("nat", ChainPrerouting, "-s", probeSource, "-p", "tcp", "-m", "tcp", "-j", "ACCEPT")
	}
	b.appendRule("nat", ChainOutput, "-d", probeSource, "-p", "tcp", "-m", "tcp", "-j", "ACCEPT")
	if !p.BypassInbound {
		// HBONE (15008) reaches ztunnel's own listener as addressed.
		b.appendRule("nat", ChainPrerouting, "!", "-d", hostLoopback, "-p", "tcp", "!", "--dport", TunnelPort,
			"-m", "mark", "!", "--mark", ZtunnelMark, "-j", "REDIRECT", "--to-ports", ProxyInboundPort)
	}
	b.appendRule("mangle", ChainOutput, "-m", "connmark", "--mark", ConnMark,
		"-j", "CONNMARK", "--restore-mark", "--nfmask", "0xffffffff", "--ctmask", "0xffffffff")
	if p.DNSCapture {
		b.appendRule("nat", ChainOutput, "!", "-o", "lo", "-p", "udp", "-m", "mark", "!", "--mark", ZtunnelMark,
			"-m", "udp", "--dport", DNSPortUpstream, "-j", "REDIRECT", "--to-port", DNSPort)
		b.appendRule("nat", ChainOutput, "!", "-d", hostLoopback, "-p", "tcp", "--dport", DNSPortUpstream,
			"-m", "mark", "!", "--mark", ZtunnelMark, "-j", "REDIRECT", "--to-ports", DNSPort)
		// ztunnel's queries upstream and their answers get a conntrack
		// zone of their own: the app's query and ztunnel's can share a
		// source port (istio/istio#33469).
		b.appendRule("raw", ChainOutput, "-p", "udp", "-m", "mark", "--mark", ZtunnelMark,
			"-m", "udp", "--dport", DNSPortUpstream, "-j", "CT", "--zone", "1")
		b.appendRule("raw", ChainPrerouting, "-p", "udp", "-m", "mark", "!", "--mark", ZtunnelMark,
			"-m", "udp", "--sport", DNSPortUpstream, "-j", "CT", "--zone", "1")
	}
	b.appendRule("nat", ChainOutput, "-p", "tcp", "-m", "mark", "--mark", ConnMark, "-j", "ACCEPT")
	// The app calling itself by its own address goes over lo and stays
	// there, as without the mesh.
	b.appendRule("nat", ChainOutput, "!", "-d", hostLoopback, "-o", "lo", "-j", "ACCEPT")
	b.appendRule("nat", ChainOutput, "!", "-d", hostLoopback, "-p", "tcp", "-m", "mark", "!", "--mark", ZtunnelMark,
		"-j", "REDIRECT", "--to-ports", ProxyOutboundPort)
	return &Plan{V4: b.v4, V6: b.v6}
}

// HostParams is what shapes the node's probe SNAT.
type HostParams struct {
	// IPv6 adds the IPv6 rule.
	IPv6 bool
	// KubeletUID, when set, matches the connections of that uid's
	// sockets (nftables has no "a socket exists"); else every connection
	// the node itself opens, which forwarded traffic never is.
	KubeletUID *uint32
}

// ProbeSetOf names the probe set an address belongs in.
func ProbeSetOf(ip netip.Addr) string {
	if ip.Unmap().Is6() {
		return ProbeSetV6
	}
	return ProbeSetV4
}

// BuildHostProbe computes the node's rules that SNAT its own TCP
// connections to enrolled pods (the addresses in ProbeSetV4/V6) to the
// probe source. The jump goes first in POSTROUTING: a masquerade before
// it would otherwise take the connection.
func BuildHostProbe(p HostParams) *Plan {
	b := &builder{v4: &Set{Family: IPv4}}
	if p.IPv6 {
		b.v6 = &Set{Family: IPv6}
	}
	b.add(0, "nat", "POSTROUTING", 1, "-j", ChainPostrouting)
	owner := []any{"-m", "owner", "--socket-exists"}
	if p.KubeletUID != nil {
		owner = []any{"-m", "owner", "--uid-owner", fmt.Sprint(*p.KubeletUID)}
	}
	b.appendRule("nat", ChainPostrouting, cat(owner, []any{"-p", "tcp",
		"-m", "set", "--match-set", versioned{ProbeSetV4, ProbeSetV6}, "dst",
		"-j", "SNAT", "--to-source", versioned{ProbeSourceV4.String(), ProbeSourceV6.String()}})...)
	return &Plan{V4: b.v4, V6: b.v6}
}
