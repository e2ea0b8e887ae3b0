package ruleset

import (
	"net/netip"

	"github.com/istio-cni-go/istio-cni/internal/redirect"
)

// Plan is what to program in one pod: a rule set per family. V6 is nil
// when the pod gets no IPv6 rules.
type Plan struct {
	V4 *Set
	V6 *Set
	// TProxyRoutes asks for the fwmark policy route that TPROXY needs.
	TProxyRoutes bool
}

// Sets returns the non-nil sets, IPv4 first.
func (p *Plan) Sets() []*Set {
	out := []*Set{p.V4}
	if p.V6 != nil {
		out = append(out, p.V6)
	}
	return out
}

// versioned is a placeholder replaced by the family's own address.
type versioned struct{ v4, v6 string }

var (
	hostLoopback    = versioned{"127.0.0.1/32", "::1/128"}
	passthroughAddr = versioned{"127.0.0.6/32", "::6/128"}
)

// builder appends rules to both families in call order, so that each
// family's text is the same sequence Istio's istio-iptables produces.
type builder struct {
	v4, v6 *Set
}

func (b *builder) sets(only Family) []*Set {
	var out []*Set
	if only != IPv6 {
		out = append(out, b.v4)
	}
	if only != IPv4 && b.v6 != nil {
		out = append(out, b.v6)
	}
	return out
}

// add appends (pos 0) or inserts a rule for the given family (0 = both).
// Arguments of type versioned are substituted per family.
func (b *builder) add(only Family, table, chain string, pos int, args ...any) {
	for _, s := range b.sets(only) {
		out := make([]string, 0, len(args))
		for _, a := range args {
			switch v := a.(type) {
			case string:
				out = append(out, v)
			case versioned:
				if s.Family == IPv6 {
					out = append(out, v.v6)
				} else {
					out = append(out, v.v4)
				}
			default:
				panic("ruleset: unsupported argument type")
			}
		}
		s.Rules = append(s.Rules, Rule{Table: table, Chain: chain, Pos: pos, Args: out})
	}
}

func (b *builder) appendRule(table, chain string, args ...any) { b.add(0, table, chain, 0, args...) }

// Build computes the rules for a pod. ipv6 says whether the pod gets IPv6
// rules as well (see NeedsIPv6). A pod in ModeNone gets an empty plan.
func Build(p redirect.Params, ipv6 bool) *Plan {
	b := &builder{v4: &Set{Family: IPv4}}
	if ipv6 {
		b.v6 = &Set{Family: IPv6}
	}
	plan := &Plan{V4: b.v4, V6: b.v6}
	if p.Mode == redirect.ModeNone {
		return plan
	}
	tproxy := p.Mode == redirect.ModeTProxy

	for _, iface := range p.ExcludeInterfaces {
		b.appendRule("nat", "PREROUTING", "-i", iface, "-j", "RETURN")
		b.appendRule("nat", "OUTPUT", "-o", iface, "-j", "RETURN")
	}
	if tproxy {
		for _, iface := range p.ExcludeInterfaces {
			b.appendRule("mangle", "PREROUTING", "-i", iface, "-j", "RETURN")
			b.appendRule("mangle", "OUTPUT", "-o", iface, "-j", "RETURN")
		}
	}
	for _, iface := range p.RerouteInterfaces {
		b.add(0, "nat", "PREROUTING", 1, "-i", iface, "-j", "RETURN")
	}
	if p.DropInvalid {
		b.appendRule("mangle", "PREROUTING", "-m", "conntrack", "--ctstate", "INVALID", "-j", ChainDrop)
		b.appendRule("mangle", ChainDrop, "-j", "DROP")
	}

	b.appendRule("nat", ChainInbound, "-p", "tcp", "--dport", TunnelPort, "-j", "RETURN")
	b.appendRule("nat", ChainRedirect, "-p", "tcp", "-j", "REDIRECT", "--to-ports", ProxyOutboundPort)
	b.appendRule("nat", ChainInRedirect, "-p", "tcp", "-j", "REDIRECT", "--to-ports", ProxyInboundPort)

	buildInbound(b, p, tproxy)

	b.appendRule("nat", "OUTPUT", "-j", ChainOutput)
	for _, port := range p.ExcludeOutboundPorts {
		b.appendRule("nat", ChainOutput, "-p", "tcp", "--dport", port, "-j", "RETURN")
		b.appendRule("nat", ChainOutput, "-p", "udp", "--dport", port, "-j", "RETURN")
	}
	b.appendRule("nat", ChainOutput, "-o", "lo", "-s", passthroughAddr, "-j", "RETURN")

	includesLoopback := false
	for _, c := range p.IncludeOutboundCIDRs {
		if c.Addr().IsLoopback() {
			includesLoopback = true
		}
	}
	ownerRules := func(kind, id string, dnsAware bool) {
		if dnsAware && p.DNSCapture {
			b.appendRule("nat", ChainOutput, "-o", "lo", "!", "-d", hostLoopback, "-p", "tcp",
				"-m", "multiport", "!", "--dports", "53,"+TunnelPort,
				"-m", "owner", kind, id, "-j", ChainInRedirect)
		} else {
			b.appendRule("nat", ChainOutput, "-o", "lo", "!", "-d", hostLoopback, "-p", "tcp",
				"!", "--dport", TunnelPort, "-m", "owner", kind, id, "-j", ChainInRedirect)
		}
		if !includesLoopback {
			if p.DNSCapture {
				b.appendRule("nat", ChainOutput, "-o", "lo", "-p", "tcp", "!", "--dport", "53",
					"-m", "owner", "!", kind, id, "-j", "RETURN")
			} else {
				b.appendRule("nat", ChainOutput, "-o", "lo", "-m", "owner", "!", kind, id, "-j", "RETURN")
			}
		}
		b.appendRule("nat", ChainOutput, "-m", "owner", kind, id, "-j", "RETURN")
	}
	// Istio makes only the uid rule skip port 53 on the loopback redirect;
	// the gid rule keeps the plain form. Kept as is for identical rules.
	for _, uid := range p.ProxyUID {
		ownerRules("--uid-owner", uid, true)
	}
	for _, gid := range p.ProxyGID {
		ownerRules("--gid-owner", gid, false)
	}

	if p.DNSCapture {
		buildDNS(b, p)
	}

	b.appendRule("nat", ChainOutput, "-d", hostLoopback, "-j", "RETURN")
	for _, c := range p.ExcludeOutboundCIDRs {
		b.add(familyOf(c), "nat", ChainOutput, 0, "-d", c.String(), "-j", "RETURN")
	}
	for _, port := range p.IncludeOutboundPorts {
		b.appendRule("nat", ChainOutput, "-p", "tcp", "--dport", port, "-j", ChainRedirect)
	}
	for _, fam := range []Family{IPv4, IPv6} {
		if p.IncludeOutboundAll {
			b.add(fam, "nat", ChainOutput, 0, "-j", ChainRedirect)
			for _, iface := range p.RerouteInterfaces {
				b.add(fam, "nat", "PREROUTING", 1, "-i", iface, "-j", ChainRedirect)
			}
			continue
		}
		for _, c := range p.IncludeOutboundCIDRs {
			if familyOf(c) != fam {
				continue
			}
			for _, iface := range p.RerouteInterfaces {
				b.add(fam, "nat", "PREROUTING", 1, "-i", iface, "-d", c.String(), "-j", ChainRedirect)
			}
			b.add(fam, "nat", ChainOutput, 0, "-d", c.String(), "-j", ChainRedirect)
		}
	}

	if tproxy {
		b.appendRule("mangle", "PREROUTING", "-p", "tcp", "-m", "mark", "--mark", TProxyMark, "-j", "CONNMARK", "--save-mark")
		b.appendRule("mangle", "OUTPUT", "-p", "tcp", "-o", "lo", "-m", "mark", "--mark", TProxyMark, "-j", "RETURN")
		for _, uid := range p.ProxyUID {
			b.appendRule("mangle", "OUTPUT", "!", "-d", hostLoopback, "-p", "tcp", "-o", "lo",
				"-m", "owner", "--uid-owner", uid, "-j", "MARK", "--set-mark", OutboundMark)
		}
		for _, gid := range p.ProxyGID {
			b.appendRule("mangle", "OUTPUT", "!", "-d", hostLoopback, "-p", "tcp", "-o", "lo",
				"-m", "owner", "--gid-owner", gid, "-j", "MARK", "--set-mark", OutboundMark)
		}
		b.appendRule("mangle", "OUTPUT", "-p", "tcp", "-m", "connmark", "--mark", TProxyMark, "-j", "CONNMARK", "--restore-mark")
		b.add(0, "mangle", ChainInbound, 1, "-p", "tcp", "-m", "mark", "--mark", TProxyMark, "-j", "RETURN")
		b.add(0, "mangle", ChainInbound, 2, "-p", "tcp", "-s", passthroughAddr, "-i", "lo", "-j", "RETURN")
		b.add(0, "mangle", ChainInbound, 3, "-p", "tcp", "-i", "lo", "-m", "mark", "!", "--mark", OutboundMark, "-j", "RETURN")
		plan.TProxyRoutes = p.IncludeInboundAll || len(p.IncludeInboundPorts) > 0
	}
	return plan
}

func buildInbound(b *builder, p redirect.Params, tproxy bool) {
	if !p.IncludeInboundAll && len(p.IncludeInboundPorts) == 0 {
		return
	}
	table := "nat"
	if tproxy {
		table = "mangle"
		b.appendRule("mangle", ChainDivert, "-j", "MARK", "--set-mark", TProxyMark)
		b.appendRule("mangle", ChainDivert, "-j", "ACCEPT")
		b.appendRule("mangle", ChainTProxy, "!", "-d", hostLoopback, "-p", "tcp", "-j", "TPROXY",
			"--tproxy-mark", TProxyMark+"/0xffffffff", "--on-port", ProxyInboundPort)
	}
	b.appendRule(table, "PREROUTING", "-p", "tcp", "-j", ChainInbound)
	if p.IncludeInboundAll {
		for _, port := range p.ExcludeInboundPorts {
			b.appendRule(table, ChainInbound, "-p", "tcp", "--dport", port, "-j", "RETURN")
		}
		if tproxy {
			b.appendRule("mangle", ChainInbound, "-p", "tcp", "-m", "conntrack", "--ctstate", "RELATED,ESTABLISHED", "-j", ChainDivert)
			b.appendRule("mangle", ChainInbound, "-p", "tcp", "-j", ChainTProxy)
		} else {
			b.appendRule("nat", ChainInbound, "-p", "tcp", "-j", ChainInRedirect)
		}
		return
	}
	for _, port := range p.IncludeInboundPorts {
		if tproxy {
			b.appendRule("mangle", ChainInbound, "-p", "tcp", "--dport", port, "-m", "conntrack", "--ctstate", "RELATED,ESTABLISHED", "-j", ChainDivert)
			b.appendRule("mangle", ChainInbound, "-p", "tcp", "--dport", port, "-j", ChainTProxy)
		} else {
			b.appendRule("nat", ChainInbound, "-p", "tcp", "--dport", port, "-j", ChainInRedirect)
		}
	}
}

// buildDNS captures all DNS: a plugin cannot read the pod's resolv.conf at
// sandbox creation, so it cannot narrow capture to the pod's servers.
func buildDNS(b *builder, p redirect.Params) {
	b.appendRule("raw", "OUTPUT", "-j", ChainOutputDNS)
	b.appendRule("nat", ChainOutput, "-j", ChainOutputDNS)
	b.appendRule("nat", ChainOutputDNS, "-p", "tcp", "--dport", "53", "-j", "REDIRECT", "--to-ports", DNSPort)
	b.appendRule("nat", ChainOutputDNS, "-p", "udp", "--dport", "53", "-j", "REDIRECT", "--to-port", DNSPort)
	// Separate conntrack zones for proxy-to-upstream and app-to-proxy DNS,
	// so the two UDP flows of one query never collide in conntrack.
	for _, uid := range p.ProxyUID {
		b.appendRule("raw", ChainOutputDNS, "-p", "udp", "--dport", "53", "-m", "owner", "--uid-owner", uid, "-j", "CT", "--zone", "1")
		b.appendRule("raw", ChainOutputDNS, "-p", "udp", "--sport", DNSPort, "-m", "owner", "--uid-owner", uid, "-j", "CT", "--zone", "2")
	}
	for _, gid := range p.ProxyGID {
		b.appendRule("raw", ChainOutputDNS, "-p", "udp", "--dport", "53", "-m", "owner", "--gid-owner", gid, "-j", "CT", "--zone", "1")
		b.appendRule("raw", ChainOutputDNS, "-p", "udp", "--sport", DNSPort, "-m", "owner", "--gid-owner", gid, "-j", "CT", "--zone", "2")
	}
	b.appendRule("raw", "PREROUTING", "-j", ChainInbound)
	b.appendRule("raw", ChainOutputDNS, "-p", "udp", "--dport", "53", "-j", "CT", "--zone", "2")
	b.appendRule("raw", ChainInbound, "-p", "udp", "--sport", "53", "-j", "CT", "--zone", "1")
}

func familyOf(p netip.Prefix) Family {
	if p.Addr().Is4() {
		return IPv4
	}
	return IPv6
}

// NeedsIPv6 decides whether a pod gets IPv6 rules, from its addresses in
// the order the network reports them: the first global address decides,
// unless dual stack is asked for, in which case any IPv6 address does.
func NeedsIPv6(addrs []netip.Addr, dualStack bool) bool {
	for _, a := range addrs {
		if a.IsLoopback() || a.IsLinkLocalUnicast() || a.IsUnspecified() {
			continue
		}
		if a.Is6() && !a.Is4In6() {
			return true
		}
		if !dualStack {
			return false
		}
	}
	return false
}
