package ruleset

import (
	"crypto/sha256"
	"encoding/hex"
	"fmt"
	"net/netip"
	"slices"

	"github.com/istio-cni-go/istio-cni/internal/memo"
	"github.com/istio-cni-go/istio-cni/internal/nsfacts"
	"github.com/istio-cni-go/istio-cni/internal/redirect"
)

// Plan is what to program in one pod: a rule set per family. V6 is nil
// when the pod gets no IPv6 rules.
type Plan struct {
	V4 *Set
	V6 *Set
	// TProxyRoutes asks for the fwmark policy route that TPROXY needs.
	TProxyRoutes bool

	// fingerprint is kept by Build for the plans it shares, of the sets
	// as they were then (printed).
	fingerprint string
	printed     planShape
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

// setMatch is an argument that matches a set's entries: the rule gets
// "-m set --match-set NAME dst" and the set is recorded for its family.
type setMatch struct{ set *IPSet }

// add appends (pos 0) or inserts a rule for the given family (0 = both).
// Arguments of type versioned are substituted per family.
func (b *builder) add(only Family, table, chain string, pos int, args ...any) {
	b.addFrom("", only, table, chain, pos, args...)
}

// addFrom is add for a rule that matches entries of the list-valued
// setting origin.
func (b *builder) addFrom(origin string, only Family, table, chain string, pos int, args ...any) {
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
			case setMatch:
				out = append(out, "-m", "set", "--match-set", v.set.Name, "dst")
				if s.IPSet(v.set.Name) == nil {
					s.IPSets = append(s.IPSets, v.set)
				}
			default:
				panic("ruleset: unsupported argument type")
			}
		}
		s.Rules = append(s.Rules, Rule{Table: table, Chain: chain, Pos: pos, Args: out, Origin: origin})
	}
}

func (b *builder) appendRule(table, chain string, args ...any) { b.add(0, table, chain, 0, args...) }

// appendFrom appends a rule matching entries of the setting origin.
func (b *builder) appendFrom(origin, table, chain string, args ...any) {
	b.addFrom(origin, 0, table, chain, 0, args...)
}

// IPSets returns the sets the plan's rules use, each once, IPv4's first.
func (p *Plan) IPSets() []*IPSet {
	var out []*IPSet
	seen := map[string]bool{}
	for _, s := range p.Sets() {
		for _, x := range s.IPSets {
			if !seen[x.Name] {
				seen[x.Name] = true
				out = append(out, x)
			}
		}
	}
	return out
}

// Expanded returns the plan with every set match written out per entry.
func (p *Plan) Expanded() *Plan {
	out := &Plan{V4: p.V4.Expanded(), TProxyRoutes: p.TProxyRoutes}
	if p.V6 != nil {
		out.V6 = p.V6.Expanded()
	}
	return out
}

// portList is a list-valued port setting: one rule per port up to
// SetThreshold entries, as Istio writes it, else one rule against a set.
type portList struct {
	origin string
	ports  []string
	set    *IPSet
}

func newPortList(origin, role string, ports []string) *portList {
	l := &portList{origin: origin, ports: ports}
	if len(ports) > SetThreshold {
		l.set = NewPortSet(role, origin, ports)
	}
	return l
}

// each adds the rules that match the list: per port, the rules rule(p)
// gives with p the "--dport N" arguments; or once, with the set match.
func (l *portList) each(b *builder, table, chain string, rule func(match []any) [][]any) {
	if l.set != nil {
		for _, args := range rule([]any{setMatch{l.set}}) {
			b.appendFrom(l.origin, table, chain, args...)
		}
		return
	}
	for _, port := range l.ports {
		for _, args := range rule([]any{"--dport", port}) {
			b.appendFrom(l.origin, table, chain, args...)
		}
	}
}

// cidrsOf returns the prefixes of one family, in the order given.
func cidrsOf(all []netip.Prefix, fam Family) []netip.Prefix {
	var out []netip.Prefix
	for _, c := range all {
		if familyOf(c) == fam {
			out = append(out, c)
		}
	}
	return out
}

// cidrMatches returns, for one family, the argument lists that match a
// CIDR list: one per prefix up to SetThreshold, as Istio writes them,
// else a single set match. A list Istio writes once more for each of
// repeat interfaces is a set as soon as all those rules together pass
// the threshold.
func cidrMatches(origin, role string, fam Family, cidrs []netip.Prefix, repeat int) [][]any {
	if len(cidrs) > SetThreshold || (len(cidrs) > 1 && len(cidrs)*(1+repeat) > SetThreshold) {
		suffix := "4"
		if fam == IPv6 {
			suffix = "6"
		}
		return [][]any{{setMatch{NewNetSet(role+suffix, origin, fam, cidrs)}}}
	}
	out := make([][]any, 0, len(cidrs))
	for _, c := range cidrs {
		out = append(out, []any{"-d", c.String()})
	}
	return out
}

func cat(parts ...[]any) []any {
	var out []any
	for _, p := range parts {
		out = append(out, p...)
	}
	return out
}

// builtPlans are the plans already built, by their parameters: the pods
// of one Deployment share theirs, and building and fingerprinting the
// same rules again was a third of what preparing a pod cost the agent.
var builtPlans = memo.New(2<<20, (*Plan).memSize)

// Build computes the rules for a pod. ipv6 says whether the pod gets IPv6
// rules as well (see NeedsIPv6). A pod in ModeNone gets an empty plan.
// The plan is shared with every other caller passing equal parameters:
// it must not be changed.
func Build(p redirect.Params, ipv6 bool) *Plan {
	key := []byte{0}
	if ipv6 {
		key[0] = 1
	}
	kept, _ := builtPlans.Get(p.AppendKey(key), func() (*Plan, error) {
		plan := build(p, ipv6)
		// Before it is shared: later callers only read it.
		plan.fingerprint, plan.printed = plan.computeFingerprint(), plan.shape()
		return plan, nil
	})
	// A plan of the caller's own over the shared rules: a caller adding
	// rules to it (tests do) then neither reaches the shared plan nor
	// keeps the fingerprint of the rules it had.
	out := *kept
	for _, s := range []**Set{&out.V4, &out.V6} {
		if *s != nil {
			c := **s
			c.Rules, c.IPSets = slices.Clip(c.Rules), slices.Clip(c.IPSets)
			*s = &c
		}
	}
	return &out
}

// planShape is what of a plan a caller could have replaced or added to:
// each family's set, its rules' and sets' slices, the routing flag. (A
// rule or a set changed in place is not seen: the rules are shared, and
// Build says they must not be changed.)
type planShape struct {
	tproxy bool
	fams   [2]struct {
		present bool
		rules   sliceID[Rule]
		sets    sliceID[*IPSet]
	}
}

func (p *Plan) shape() planShape {
	sh := planShape{tproxy: p.TProxyRoutes}
	for i, s := range []*Set{p.V4, p.V6} {
		if s != nil {
			f := &sh.fams[i]
			f.present, f.rules, f.sets = true, idOf(s.Rules), idOf(s.IPSets)
		}
	}
	return sh
}

// sliceID tells slices apart by where they start and how long they are:
// a slice replaced, or appended to past its capacity, has another.
type sliceID[T any] struct {
	first *T
	n     int
}

func idOf[T any](s []T) sliceID[T] {
	if len(s) == 0 {
		return sliceID[T]{}
	}
	return sliceID[T]{&s[0], len(s)}
}

// memSize is roughly the bytes the plan takes, its sets included.
func (p *Plan) memSize() int {
	n := 64
	for _, s := range p.Sets() {
		// Its sets too: a set the set memo has let go lives on here.
		for _, x := range s.IPSets {
			n += x.memSize()
		}
		for _, r := range s.Rules {
			n += 96
			for _, a := range r.Args {
				n += 16 + len(a)
			}
		}
	}
	return n
}

func build(p redirect.Params, ipv6 bool) *Plan {
	b := &builder{v4: &Set{Family: IPv4}}
	if ipv6 {
		b.v6 = &Set{Family: IPv6}
	}
	plan := &Plan{V4: b.v4, V6: b.v6}
	if p.Mode == redirect.ModeNone {
		return plan
	}
	tproxy := p.Mode == redirect.ModeTProxy

	// Interface lists keep a rule per name at any length: iptables has no
	// set of interface names (the nftables backend merges long runs).
	exclIf := redirect.AnnotationExcludeInterfaces
	for _, iface := range p.ExcludeInterfaces {
		b.appendFrom(exclIf, "nat", "PREROUTING", "-i", iface, "-j", "RETURN")
		b.appendFrom(exclIf, "nat", "OUTPUT", "-o", iface, "-j", "RETURN")
	}
	if tproxy {
		for _, iface := range p.ExcludeInterfaces {
			b.appendFrom(exclIf, "mangle", "PREROUTING", "-i", iface, "-j", "RETURN")
			b.appendFrom(exclIf, "mangle", "OUTPUT", "-o", iface, "-j", "RETURN")
		}
	}
	reroute := p.RerouteSource
	for _, iface := range p.RerouteInterfaces {
		b.addFrom(reroute, 0, "nat", "PREROUTING", 1, "-i", iface, "-j", "RETURN")
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
	exclOut := newPortList(redirect.AnnotationExcludeOutboundPorts, "OUT_EXCL_PORT", p.ExcludeOutboundPorts)
	exclOut.each(b, "nat", ChainOutput,
		func(m []any) [][]any {
			tcp := cat([]any{"-p", "tcp"}, m, []any{"-j", "RETURN"})
			// Without DNS capture nothing after this rule acts on UDP
			// (TestUDPExclusionOnlyForDNS), so a set's UDP rule would
			// only cost every pod's start: the ports again, as nftables
			// set elements. Istio's rule per port stays as Istio writes it.
			if exclOut.set != nil && !p.DNSCapture {
				return [][]any{tcp}
			}
			return [][]any{tcp, cat([]any{"-p", "udp"}, m, []any{"-j", "RETURN"})}
		})
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
	exclNet := redirect.AnnotationExcludeOutboundCIDRs
	for _, fam := range []Family{IPv4, IPv6} {
		for _, m := range cidrMatches(exclNet, "OUT_EXCL_NET", fam, cidrsOf(p.ExcludeOutboundCIDRs, fam), 0) {
			b.addFrom(exclNet, fam, "nat", ChainOutput, 0, cat(m, []any{"-j", "RETURN"})...)
		}
	}
	newPortList(redirect.AnnotationIncludeOutboundPorts, "OUT_INCL_PORT", p.IncludeOutboundPorts).each(b, "nat", ChainOutput,
		func(m []any) [][]any { return [][]any{cat([]any{"-p", "tcp"}, m, []any{"-j", ChainRedirect})} })
	inclNet := redirect.AnnotationIncludeOutboundCIDRs
	for _, fam := range []Family{IPv4, IPv6} {
		if p.IncludeOutboundAll {
			b.add(fam, "nat", ChainOutput, 0, "-j", ChainRedirect)
			for _, iface := range p.RerouteInterfaces {
				b.addFrom(reroute, fam, "nat", "PREROUTING", 1, "-i", iface, "-j", ChainRedirect)
			}
			continue
		}
		for _, m := range cidrMatches(inclNet, "OUT_INCL_NET", fam, cidrsOf(p.IncludeOutboundCIDRs, fam), len(p.RerouteInterfaces)) {
			for _, iface := range p.RerouteInterfaces {
				b.addFrom(reroute, fam, "nat", "PREROUTING", 1, cat([]any{"-i", iface}, m, []any{"-j", ChainRedirect})...)
			}
			b.addFrom(inclNet, fam, "nat", ChainOutput, 0, cat(m, []any{"-j", ChainRedirect})...)
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
		newPortList(redirect.AnnotationExcludeInboundPorts, "IN_EXCL_PORT", p.ExcludeInboundPorts).each(b, table, ChainInbound,
			func(m []any) [][]any { return [][]any{cat([]any{"-p", "tcp"}, m, []any{"-j", "RETURN"})} })
		if tproxy {
			b.appendRule("mangle", ChainInbound, "-p", "tcp", "-m", "conntrack", "--ctstate", "RELATED,ESTABLISHED", "-j", ChainDivert)
			b.appendRule("mangle", ChainInbound, "-p", "tcp", "-j", ChainTProxy)
		} else {
			b.appendRule("nat", ChainInbound, "-p", "tcp", "-j", ChainInRedirect)
		}
		return
	}
	// Per port in TPROXY mode: established flows divert, new ones go to
	// TPROXY; a packet matches only its own port's pair, so one pair
	// against the set of all ports decides the same.
	newPortList(redirect.AnnotationIncludeInboundPorts, "IN_INCL_PORT", p.IncludeInboundPorts).each(b, table, ChainInbound,
		func(m []any) [][]any {
			if tproxy {
				return [][]any{
					cat([]any{"-p", "tcp"}, m, []any{"-m", "conntrack", "--ctstate", "RELATED,ESTABLISHED", "-j", ChainDivert}),
					cat([]any{"-p", "tcp"}, m, []any{"-j", ChainTProxy}),
				}
			}
			return [][]any{cat([]any{"-p", "tcp"}, m, []any{"-j", ChainInRedirect})}
		})
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

// NeedsIPv6 decides whether a pod gets IPv6 rules (nsfacts.NeedsIPv6).
func NeedsIPv6(addrs []netip.Addr, dualStack bool) bool { return nsfacts.NeedsIPv6(addrs, dualStack) }

// Fingerprint identifies the plan by everything it programs: each
// family's rules and every entry of their sets, by the SHA-256 of the
// set's contents (its name carries only 32 bits of that). Equal plans have equal fingerprints, so what
// is prepared for one serves the other.
func (p *Plan) Fingerprint() string {
	if p.fingerprint != "" && p.shape() == p.printed {
		return p.fingerprint
	}
	return p.computeFingerprint()
}

func (p *Plan) computeFingerprint() string {
	h := sha256.New()
	var b []byte
	for _, s := range p.Sets() {
		b = fmt.Appendf(b[:0], "family %d\n%s", s.Family, s.Restore())
		for _, x := range s.IPSets {
			// The digest the set was named from: a list of thousands is
			// on every pod's path, and hashing its entries again cost as
			// much as the rest of the pod's preparation.
			sum := x.digest()
			b = fmt.Appendf(b, "set %s %d %d %d %d %x\n", x.Name, x.Kind, x.Family, len(x.Nets), len(x.Ports), sum[:])
		}
		h.Write(b)
	}
	fmt.Fprintf(h, "v6 %v tproxy %v\n", p.V6 != nil, p.TProxyRoutes)
	return hex.EncodeToString(h.Sum(nil))
}
