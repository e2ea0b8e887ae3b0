package testenv

import (
	"fmt"
	"net/netip"
	"strconv"
	"strings"

	"github.com/istio-cni-go/istio-cni/internal/podinfo"
	"github.com/istio-cni-go/istio-cni/internal/redirect"
	"github.com/istio-cni-go/istio-cni/internal/ruleset"
)

// ListPlan builds the rules of an injected pod with the annotations,
// with IPv6 rules or without.
func ListPlan(ann map[string]string, v6 bool) (*ruleset.Plan, error) {
	all := map[string]string{redirect.AnnotationStatus: "{}"}
	for k, v := range ann {
		all[k] = v
	}
	p, _, err := redirect.FromPod(&podinfo.Pod{Annotations: all, Containers: []podinfo.Container{{Name: redirect.ProxyContainerName}}})
	if err != nil {
		return nil, err
	}
	return ruleset.Build(p, v6), nil
}

// MaxListLen is the longest list Lists lays out: its ranges must stay
// inside the test ranges (198.18.128.0-198.19.247.255, fd01::/16).
const MaxListLen = 6000

// Lists are values for every list-valued annotation with N entries each
// (N IPv4 and N IPv6 CIDRs in a CIDR list), laid out with a gap after
// every entry, so a test knows an address or port inside each entry and
// one just outside it. Every address is in a range the tests own and
// assign only inside their namespaces, never a real one.
type Lists struct{ N int }

var listBase4 = netip.MustParseAddr("198.18.128.0")

const listPortBase = 20000

// CIDR4 is entry i of the IPv4 list: a /29 every 16 addresses.
func (Lists) CIDR4(i int) netip.Prefix {
	return netip.PrefixFrom(addAddr(listBase4, uint64(16*i)), 29)
}

// CIDR6 is entry i of the IPv6 list: every other /32 of fd01::/16, as
// short to write as IPv6 gets (a pod's annotations hold 256 KiB at most,
// and a list of 5000 runs to 100 KiB).
func (Lists) CIDR6(i int) netip.Prefix {
	return netip.PrefixFrom(netip.AddrFrom16([16]byte{0xfd, 0x01, byte(2 * i >> 8), byte(2 * i)}), 32)
}

// Port is entry i of a port list: every other port from 20000.
func (Lists) Port(i int) int { return listPortBase + 2*i }

// OutsidePort is the port just after entry i, in no list.
func (l Lists) OutsidePort(i int) int { return l.Port(i) + 1 }

// Inside is an address within CIDR entry i of a family.
func (l Lists) Inside(v6 bool, i int) netip.Addr {
	p := l.CIDR4(i)
	if v6 {
		p = l.CIDR6(i)
	}
	return p.Addr().Next()
}

// Outside is the address just past CIDR entry i of a family: in the gap
// before the next entry, so in no entry.
func (l Lists) Outside(v6 bool, i int) netip.Addr {
	if v6 {
		b := l.CIDR6(i).Addr().As16()
		b[3]++
		return netip.AddrFrom16(b).Next()
	}
	return addAddr(l.CIDR4(i).Addr(), 8)
}

// Probes are the entries a test sends traffic at: the first, a middle
// and the last (fewer when the list is shorter).
func (l Lists) Probes() []int {
	out := []int{0}
	for _, i := range []int{l.N / 2, l.N - 1} {
		if i > out[len(out)-1] {
			out = append(out, i)
		}
	}
	return out
}

// CIDRs is the CIDR list, IPv4 and IPv6 entries interleaved.
func (l Lists) CIDRs() string {
	parts := make([]string, 0, 2*l.N)
	for i := 0; i < l.N; i++ {
		parts = append(parts, l.CIDR4(i).String(), l.CIDR6(i).String())
	}
	return strings.Join(parts, ",")
}

// CIDRs4 is the IPv4 CIDR list alone.
func (l Lists) CIDRs4() string {
	parts := make([]string, 0, l.N)
	for i := 0; i < l.N; i++ {
		parts = append(parts, l.CIDR4(i).String())
	}
	return strings.Join(parts, ",")
}

// Ports is the port list.
func (l Lists) Ports() string {
	parts := make([]string, 0, l.N)
	for i := 0; i < l.N; i++ {
		parts = append(parts, strconv.Itoa(l.Port(i)))
	}
	return strings.Join(parts, ",")
}

// Interfaces is a list of N interface names ending with last (when not
// empty), so a test can make the last one a real interface.
func (l Lists) Interfaces(prefix, last string) string {
	parts := make([]string, 0, l.N)
	for i := 0; i < l.N; i++ {
		parts = append(parts, fmt.Sprintf("%s%d", prefix, i))
	}
	if last != "" && l.N > 0 {
		parts[l.N-1] = last
	}
	return strings.Join(parts, ",")
}

// ExcludeAnnotations sets every exclude list: outbound CIDRs and ports,
// inbound ports (inbound capture stays "*") and interfaces.
func (l Lists) ExcludeAnnotations(lastInterface string) map[string]string {
	return map[string]string{
		redirect.AnnotationExcludeOutboundCIDRs: l.CIDRs(),
		redirect.AnnotationExcludeOutboundPorts: l.Ports(),
		redirect.AnnotationExcludeInboundPorts:  l.Ports(),
		redirect.AnnotationExcludeInterfaces:    l.Interfaces("xl", lastInterface),
	}
}

// IncludeAnnotations sets every include list: outbound CIDRs and ports,
// inbound ports, and the interfaces rerouted to the proxy.
func (l Lists) IncludeAnnotations() map[string]string {
	return map[string]string{
		redirect.AnnotationIncludeOutboundCIDRs: l.CIDRs(),
		redirect.AnnotationIncludeOutboundPorts: l.Ports(),
		redirect.AnnotationIncludeInboundPorts:  l.Ports(),
		redirect.AnnotationRerouteVirtualIfaces: l.Interfaces("vl", ""),
	}
}

func addAddr(a netip.Addr, n uint64) netip.Addr {
	b := a.As4()
	v := uint64(b[0])<<24 | uint64(b[1])<<16 | uint64(b[2])<<8 | uint64(b[3])
	v += n
	return netip.AddrFrom4([4]byte{byte(v >> 24), byte(v >> 16), byte(v >> 8), byte(v)})
}

// ListCase is a pod shape with long lists, for goldens and kernel tests.
type ListCase struct {
	Name        string
	Annotations map[string]string
}

// ListCases are the long-list shapes the goldens pin: every exclude list,
// every include list, TPROXY with long lists in the mangle table, and
// lists on either side of the set threshold (16 entries).
func ListCases() []ListCase {
	l := Lists{N: 40}
	tproxy := map[string]string{
		redirect.AnnotationInterceptionMode:     "TPROXY",
		redirect.AnnotationIncludeInboundPorts:  l.Ports(),
		redirect.AnnotationExcludeInterfaces:    l.Interfaces("xl", ""),
		redirect.AnnotationExcludeOutboundCIDRs: l.CIDRs(),
	}
	seq := func(format string, from, n int) string {
		parts := make([]string, n)
		for i := range parts {
			parts[i] = fmt.Sprintf(format, from+i)
		}
		return strings.Join(parts, ",")
	}
	threshold := map[string]string{
		// 17 consecutive IPv4 hosts (a set, merged to two prefixes) and 16
		// IPv6 ones (a rule each): the shape is chosen per family.
		redirect.AnnotationExcludeOutboundCIDRs: seq("10.0.0.%d/32", 0, 17) + "," + seq("fd00::%x/128", 1, 16),
		redirect.AnnotationExcludeOutboundPorts: seq("%d", 5000, 16),
		redirect.AnnotationIncludeOutboundPorts: seq("%d", 3000, 17),
		redirect.AnnotationExcludeInterfaces:    seq("net%d", 0, 16),
	}
	// Eighteen prefixes of as many lengths per family, overlapping and
	// touching: more lengths than nftables looks up by hash, so an
	// interval set there.
	var mixed []string
	for i := 0; i < 18; i++ {
		mixed = append(mixed, fmt.Sprintf("10.%d.0.0/%d", 2*i, 14+i), fmt.Sprintf("fd00:%x::/%d", 2*i, 32+i))
	}
	mixed = append(mixed, "10.0.0.0/17", "10.0.128.0/17", "10.3.0.0/16")
	return []ListCase{
		{Name: "lists-exclude", Annotations: l.ExcludeAnnotations("")},
		{Name: "lists-mixed-lengths", Annotations: map[string]string{redirect.AnnotationExcludeOutboundCIDRs: strings.Join(mixed, ",")}},
		{Name: "lists-include", Annotations: l.IncludeAnnotations()},
		{Name: "lists-tproxy", Annotations: tproxy},
		{Name: "lists-threshold", Annotations: threshold},
	}
}
