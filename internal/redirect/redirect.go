// Package redirect turns a pod's annotations and its istio-proxy container
// into validated redirect parameters. It is pure (no I/O, no clock); long
// lists are parsed once and kept by their text.
package redirect

import (
	"encoding/binary"
	"fmt"
	"math/bits"
	"net/netip"
	"slices"
	"strconv"
	"strings"

	"github.com/istio-cni-go/istio-cni/internal/memo"

	"github.com/istio-cni-go/istio-cni/internal/podspec"
)

// Annotation keys read from the pod, the same as Istio's.
const (
	AnnotationInterceptionMode     = "sidecar.istio.io/interceptionMode"
	AnnotationIncludeOutboundCIDRs = "traffic.sidecar.istio.io/includeOutboundIPRanges"
	AnnotationExcludeOutboundCIDRs = "traffic.sidecar.istio.io/excludeOutboundIPRanges"
	AnnotationIncludeInboundPorts  = "traffic.sidecar.istio.io/includeInboundPorts"
	AnnotationExcludeInboundPorts  = "traffic.sidecar.istio.io/excludeInboundPorts"
	AnnotationIncludeOutboundPorts = "traffic.sidecar.istio.io/includeOutboundPorts"
	AnnotationExcludeOutboundPorts = "traffic.sidecar.istio.io/excludeOutboundPorts"
	AnnotationExcludeInterfaces    = "traffic.sidecar.istio.io/excludeInterfaces"
	AnnotationRerouteVirtualIfaces = "istio.io/reroute-virtual-interfaces"
	// AnnotationKubevirtInterfaces is deprecated; it is read only when
	// AnnotationRerouteVirtualIfaces is absent.
	AnnotationKubevirtInterfaces = "traffic.sidecar.istio.io/kubevirtInterfaces"
	AnnotationInject             = "sidecar.istio.io/inject"
	AnnotationStatus             = "sidecar.istio.io/status"
)

// Proxy container facts.
const (
	ProxyContainerName = "istio-proxy"
	EnvDNSCapture      = "ISTIO_META_DNS_CAPTURE"
	EnvDualStack       = "ISTIO_DUAL_STACK"
	EnvInvalidDrop     = "INVALID_DROP"
	EnvDisableEnvoy    = "DISABLE_ENVOY"
	DefaultProxyID     = 1337
)

// Mode is the inbound interception mode.
type Mode string

const (
	ModeRedirect Mode = "REDIRECT"
	ModeTProxy   Mode = "TPROXY"
	// ModeNone asks for no interception at all. Istio's plugin rejects it
	// and blocks the pod; this plugin honours it and programs nothing.
	ModeNone Mode = "NONE"
)

// Ports that the proxy itself serves and that inbound capture never takes:
// the status port, the health port and the Prometheus port.
var alwaysExcludedInboundPorts = []string{"15020", "15021", "15090"}

// Params are the redirect parameters for one pod. Port and CIDR lists keep
// the textual order the pod gave, so the generated rules match Istio's
// byte for byte.
type Params struct {
	Mode Mode
	// IncludeOutboundCIDRs is "*" or a list of prefixes; empty means none.
	IncludeOutboundAll   bool
	IncludeOutboundCIDRs []netip.Prefix
	ExcludeOutboundCIDRs []netip.Prefix
	// IncludeInboundAll is the "*" form; otherwise IncludeInboundPorts.
	IncludeInboundAll    bool
	IncludeInboundPorts  []string
	ExcludeInboundPorts  []string
	IncludeOutboundPorts []string
	ExcludeOutboundPorts []string
	ExcludeInterfaces    []string
	RerouteInterfaces    []string
	// RerouteSource is the annotation RerouteInterfaces came from (the
	// current or the deprecated one), when it lists any.
	RerouteSource string
	ProxyUID      []string
	ProxyGID      []string
	DNSCapture    bool
	DualStack     bool
	DropInvalid   bool
}

// InvalidAnnotationError names the annotation and value that were rejected.
type InvalidAnnotationError struct {
	Key, Value, Reason string
}

// maxQuotedValue bounds how much of a rejected value an error repeats:
// a list may run to the API server's 256 KiB, and the error ends up in
// the runtime's and the agent's logs; the reason names the bad entry.
const maxQuotedValue = 256

func (e *InvalidAnnotationError) Error() string {
	v := e.Value
	if len(v) > maxQuotedValue {
		v = v[:maxQuotedValue/2] + " ... " + v[len(v)-maxQuotedValue/2:]
		return fmt.Sprintf("invalid annotation %s (%d bytes, abridged: %q): %s", e.Key, len(e.Value), v, e.Reason)
	}
	return fmt.Sprintf("invalid annotation %s=%q: %s", e.Key, v, e.Reason)
}

// FromPod derives the parameters. Warnings are returned for values that are
// ignored with a fallback (proxy env flags that do not parse), as Istio does.
func FromPod(pod *podspec.Pod) (Params, []string, error) {
	var p Params
	var warnings []string
	a := pod.Annotations
	get := func(key, def string) (string, bool) {
		v, ok := a[key]
		if !ok {
			return def, false
		}
		return v, true
	}

	mode, _ := get(AnnotationInterceptionMode, string(ModeRedirect))
	switch Mode(mode) {
	case ModeRedirect, ModeTProxy, ModeNone:
		p.Mode = Mode(mode)
	default:
		return p, nil, &InvalidAnnotationError{AnnotationInterceptionMode, mode, "must be REDIRECT, TPROXY or NONE"}
	}

	var err error
	if v, _ := get(AnnotationIncludeOutboundCIDRs, "*"); v == "*" {
		p.IncludeOutboundAll = true
	} else if p.IncludeOutboundCIDRs, err = cached(parsedCIDRs, AnnotationIncludeOutboundCIDRs, v, parseCIDRs); err != nil {
		return p, nil, err
	}
	if v, _ := get(AnnotationExcludeOutboundCIDRs, ""); v != "" {
		if p.ExcludeOutboundCIDRs, err = cached(parsedCIDRs, AnnotationExcludeOutboundCIDRs, v, parseCIDRs); err != nil {
			return p, nil, err
		}
	}

	if v, _ := get(AnnotationIncludeInboundPorts, "*"); v == "*" {
		p.IncludeInboundAll = true
	} else if p.IncludeInboundPorts, err = cached(parsedPorts, AnnotationIncludeInboundPorts, v, parsePorts); err != nil {
		return p, nil, err
	}
	v, _ := get(AnnotationExcludeInboundPorts, "")
	if p.ExcludeInboundPorts, err = cached(parsedPorts, AnnotationExcludeInboundPorts, v, parseExcludeInbound); err != nil {
		return p, nil, err
	}

	v, _ = get(AnnotationIncludeOutboundPorts, "")
	if p.IncludeOutboundPorts, err = cached(parsedPorts, AnnotationIncludeOutboundPorts, v, parsePorts); err != nil {
		return p, nil, err
	}
	// The status port is excluded from outbound capture only when the pod
	// says nothing; an explicit value replaces the default, as in Istio.
	v, _ = get(AnnotationExcludeOutboundPorts, "15020")
	if p.ExcludeOutboundPorts, err = cached(parsedPorts, AnnotationExcludeOutboundPorts, v, parsePorts); err != nil {
		return p, nil, err
	}

	v, _ = get(AnnotationExcludeInterfaces, "")
	if p.ExcludeInterfaces, err = parseInterfaces(AnnotationExcludeInterfaces, v); err != nil {
		return p, nil, err
	}
	key := AnnotationRerouteVirtualIfaces
	v, ok := get(key, "")
	if !ok {
		key = AnnotationKubevirtInterfaces
		v, _ = get(key, "")
	}
	if p.RerouteInterfaces, err = parseInterfaces(key, v); err != nil {
		return p, nil, err
	}
	if len(p.RerouteInterfaces) > 0 {
		p.RerouteSource = key
	}

	p.ProxyUID = []string{strconv.Itoa(DefaultProxyID)}
	p.ProxyGID = []string{strconv.Itoa(DefaultProxyID)}
	if proxy, ok := pod.FindContainer(ProxyContainerName); ok {
		if id, err := proxyID(proxy.RunAsUser, "runAsUser"); err != nil {
			return p, nil, err
		} else if id != "" {
			p.ProxyUID = []string{id}
		}
		if id, err := proxyID(proxy.RunAsGroup, "runAsGroup"); err != nil {
			return p, nil, err
		} else if id != "" {
			p.ProxyGID = []string{id}
		}
		p.DNSCapture, warnings = envBool(proxy.Env, EnvDNSCapture, warnings)
		p.DualStack, warnings = envBool(proxy.Env, EnvDualStack, warnings)
		p.DropInvalid, warnings = envBool(proxy.Env, EnvInvalidDrop, warnings)
	}
	return p, warnings, nil
}

func proxyID(v *int64, field string) (string, error) {
	if v == nil || *v == 0 {
		// uid/gid 0 would exempt every root process from capture; Istio
		// treats it as "not set", and so do we.
		return "", nil
	}
	if *v < 0 || *v > 0xfffffffe {
		return "", fmt.Errorf("invalid %s %d on container %s: out of range", field, *v, ProxyContainerName)
	}
	return strconv.FormatInt(*v, 10), nil
}

func envBool(env map[string]string, key string, warnings []string) (bool, []string) {
	v, ok := env[key]
	if !ok {
		return false, warnings
	}
	b, err := strconv.ParseBool(v)
	if err != nil {
		return false, append(warnings, fmt.Sprintf("ignoring %s=%q on %s: not a boolean", key, v, ProxyContainerName))
	}
	return b, warnings
}

// splitList splits a comma list, trimming spaces. An empty value is an
// empty list; an empty item inside a non-empty list is an error, since it
// is almost always a typo that would silently change what is captured.
func splitList(key, value string) ([]string, error) {
	if strings.TrimSpace(value) == "" {
		return nil, nil
	}
	parts := strings.Split(value, ",")
	for i, s := range parts {
		parts[i] = strings.TrimSpace(s)
		if parts[i] == "" {
			return nil, &InvalidAnnotationError{key, value, fmt.Sprintf("empty item in list (item %d of %d)", i+1, len(parts))}
		}
	}
	return parts, nil
}

// Long list values already parsed, by annotation and value (see package
// memo). The lists are shared: Params' slices are never changed.
var (
	parsedCIDRs = memo.New(2<<20, func(l []netip.Prefix) int { return 32 * len(l) })
	parsedPorts = memo.New(1<<20, func(l []string) int { return 24 * len(l) })
)

// memoFrom is the shortest value kept parsed: a short list parses in less
// time than finding it takes.
const memoFrom = 256

// cached parses value with parse, or takes it from m when it is long.
// Only values that parse are kept: a bad one fails every pod carrying it,
// with the same error, at the same cost.
func cached[V any](m *memo.LRU[V], key, value string, parse func(key, value string) (V, error)) (V, error) {
	if len(value) < memoFrom {
		return parse(key, value)
	}
	k := make([]byte, 0, len(key)+1+len(value))
	k = append(append(append(k, key...), 0), value...)
	return m.Get(k, func() (V, error) { return parse(key, value) })
}

// parseExcludeInbound is the excluded inbound ports the pod gives, then
// the proxy's own, each once.
func parseExcludeInbound(key, value string) ([]string, error) {
	ports, err := parsePorts(key, value)
	if err != nil {
		return nil, err
	}
	return slices.Clip(dedup(append(ports, alwaysExcludedInboundPorts...))), nil
}

func parsePorts(key, value string) ([]string, error) {
	items, err := splitList(key, value)
	if err != nil {
		return nil, err
	}
	for i, s := range items {
		n, err := strconv.ParseUint(s, 10, 16)
		if err != nil {
			return nil, &InvalidAnnotationError{key, value, fmt.Sprintf("%q%s is not a port number (0-65535)", s, position(i, len(items)))}
		}
		items[i] = strconv.FormatUint(n, 10)
	}
	// Clipped: a caller appending to a list kept for other pods copies it.
	return slices.Clip(items), nil
}

func parseCIDRs(key, value string) ([]netip.Prefix, error) {
	items, err := splitList(key, value)
	if err != nil {
		return nil, err
	}
	out := make([]netip.Prefix, 0, len(items))
	for i, s := range items {
		pfx, err := netip.ParsePrefix(s)
		if err != nil {
			return nil, &InvalidAnnotationError{key, value, fmt.Sprintf("%q%s is not a CIDR", s, position(i, len(items)))}
		}
		out = append(out, pfx)
	}
	return slices.Clip(out), nil
}

// parseInterfaces accepts Linux interface names, and the trailing "+"
// wildcard iptables understands. Anything that could be read as another
// option by iptables is refused.
func parseInterfaces(key, value string) ([]string, error) {
	items, err := splitList(key, value)
	if err != nil {
		return nil, err
	}
	for i, s := range items {
		if s == "+" {
			// iptables reads it as every interface: listed here it would
			// switch capture off for the whole pod, as "*" would.
			return nil, &InvalidAnnotationError{key, value, fmt.Sprintf("%q%s would match every interface", s, position(i, len(items)))}
		}
		if !ValidInterfaceName(s) {
			return nil, &InvalidAnnotationError{key, value, fmt.Sprintf("%q%s is not a valid interface name", s, position(i, len(items)))}
		}
	}
	// Each name is rules of its own with iptables: a name repeated is
	// the same rules again (a 256 KiB list of one name was a million
	// rules for the agent to build and apply), and a list is bounded.
	items = dedup(items)
	if len(items) > MaxInterfaces {
		return nil, &InvalidAnnotationError{key, value, fmt.Sprintf("%d interfaces, more than the %d a list may name", len(items), MaxInterfaces)}
	}
	return items, nil
}

// MaxInterfaces bounds an interface list's distinct names. A pod has a
// handful of interfaces; each name costs up to eight iptables rules (two,
// or four with TPROXY, per family), which the agent builds and applies.
const MaxInterfaces = 8192

// position says where an entry is in a list long enough to need saying.
func position(i, n int) string {
	if n <= 1 {
		return ""
	}
	return fmt.Sprintf(" (item %d of %d)", i+1, n)
}

// ValidInterfaceName says whether s is a Linux interface name, or a prefix
// with iptables' trailing "+", that no iptables option could be read from.
func ValidInterfaceName(s string) bool {
	if s == "" || len(s) > 15 || s == "." || s == ".." || s[0] == '-' || s[0] == '!' {
		return false
	}
	for i := 0; i < len(s); i++ {
		c := s[i]
		switch {
		case c >= 'a' && c <= 'z', c >= 'A' && c <= 'Z', c >= '0' && c <= '9':
		case c == '-' || c == '_' || c == '.' || c == '@':
		case c == '+' && i == len(s)-1:
		default:
			return false
		}
	}
	return true
}

func dedup(in []string) []string {
	seen := make(map[string]bool, len(in))
	out := in[:0:0]
	for _, s := range in {
		if !seen[s] {
			seen[s] = true
			out = append(out, s)
		}
	}
	return out
}

// AppendKey appends an encoding of every parameter to b: two Params
// encode alike exactly when they are equal, so a key serves to look up
// what was built from equal parameters. Lists of thousands are on every
// pod's path here, so the key is sized first and written without growing.
func (p *Params) AppendKey(b []byte) []byte {
	lists := [...][]string{p.IncludeInboundPorts, p.ExcludeInboundPorts, p.IncludeOutboundPorts, p.ExcludeOutboundPorts,
		p.ExcludeInterfaces, p.RerouteInterfaces, p.ProxyUID, p.ProxyGID}
	vlen := func(n int) int { return 1 + max(bits.Len(uint(n))-1, 0)/7 }
	n := vlen(len(p.Mode)) + len(p.Mode) + vlen(len(p.RerouteSource)) + len(p.RerouteSource) + 1
	for _, l := range [...][]netip.Prefix{p.IncludeOutboundCIDRs, p.ExcludeOutboundCIDRs} {
		n += vlen(len(l)) + 18*len(l)
	}
	for _, l := range lists {
		n += vlen(len(l))
		for _, s := range l {
			n += vlen(len(s)) + len(s)
		}
	}
	b = slices.Grow(b, n)
	str := func(s string) {
		b = binary.AppendUvarint(b, uint64(len(s)))
		b = append(b, s...)
	}
	nets := func(l []netip.Prefix) {
		b = binary.AppendUvarint(b, uint64(len(l)))
		off := len(b)
		b = b[:off+18*len(l)]
		for _, n := range l {
			e := b[off : off+18]
			*(*[16]byte)(e) = n.Addr().As16()
			e[16], e[17] = byte(n.Bits()), byte(n.Addr().BitLen())
			off += 18
		}
	}
	var flags byte
	for i, f := range []bool{p.IncludeOutboundAll, p.IncludeInboundAll, p.DNSCapture, p.DualStack, p.DropInvalid} {
		if f {
			flags |= 1 << i
		}
	}
	str(string(p.Mode))
	b = append(b, flags)
	nets(p.IncludeOutboundCIDRs)
	nets(p.ExcludeOutboundCIDRs)
	for _, l := range lists {
		b = binary.AppendUvarint(b, uint64(len(l)))
		for _, s := range l {
			str(s)
		}
	}
	str(p.RerouteSource)
	return b
}
