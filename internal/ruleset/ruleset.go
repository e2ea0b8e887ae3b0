// Package ruleset turns redirect parameters into netfilter rules as data,
// one set per IP family, and renders them. Building is pure; applying is
// the job of package iptables.
package ruleset

import (
	"github.com/istio-cni-go/istio-cni/internal/nsfacts"

	"fmt"
	"slices"
	"sort"
	"strconv"
	"strings"
)

// Chain names, the same as Istio's so existing troubleshooting guides apply.
const (
	ChainInbound    = "ISTIO_INBOUND"
	ChainRedirect   = "ISTIO_REDIRECT"
	ChainInRedirect = "ISTIO_IN_REDIRECT"
	ChainOutput     = "ISTIO_OUTPUT"
	ChainOutputDNS  = "ISTIO_OUTPUT_DNS"
	ChainDivert     = "ISTIO_DIVERT"
	ChainTProxy     = "ISTIO_TPROXY"
	ChainDrop       = "ISTIO_DROP"
	// ChainPrefix marks every chain this plugin owns.
	ChainPrefix = "ISTIO_"
)

// Fixed ports and marks of the sidecar proxy.
const (
	ProxyOutboundPort = "15001"
	ProxyInboundPort  = "15006"
	TunnelPort        = "15008"
	DNSPort           = "15053"
	TProxyMark        = "1337"
	OutboundMark      = "1338"
	TProxyRouteTable  = nsfacts.TProxyTable
	TProxyMarkValue   = nsfacts.TProxyMark
)

// Family is an IP family.
type Family int

const (
	IPv4 Family = 4
	IPv6 Family = 6
)

func (f Family) String() string {
	if f == IPv6 {
		return "IPv6"
	}
	return "IPv4"
}

// Rule is one rule: appended to Chain when Pos is 0, else inserted at Pos.
type Rule struct {
	Table string
	Chain string
	Pos   int
	Args  []string
	// Origin is the annotation whose list the rule matches one entry of,
	// or all entries of through a set; empty for the fixed rules. It is
	// not part of the rule, only of what messages can say about it.
	Origin string
}

// Command renders the rule as an iptables-restore line.
func (r Rule) Command() string {
	if r.Pos > 0 {
		return fmt.Sprintf("-I %s %d %s", r.Chain, r.Pos, strings.Join(r.Args, " "))
	}
	return "-A " + r.Chain + " " + strings.Join(r.Args, " ")
}

// Target returns the jump target of the rule, or "".
func (r Rule) Target() string {
	for i := 0; i+1 < len(r.Args); i++ {
		if r.Args[i] == "-j" {
			return r.Args[i+1]
		}
	}
	return ""
}

// Set is the ordered rules of one family.
type Set struct {
	Family Family
	Rules  []Rule
	// IPSets are the sets the rules match against, in first-use order.
	IPSets []*IPSet
}

// MatchSet returns the name of the set a rule matches against, or "".
func (r Rule) MatchSet() string {
	for i := 0; i+1 < len(r.Args); i++ {
		if r.Args[i] == "--match-set" {
			return r.Args[i+1]
		}
	}
	return ""
}

// IPSet returns the set of that name the rules use, or nil.
func (s *Set) IPSet(name string) *IPSet {
	for _, x := range s.IPSets {
		if x.Name == name {
			return x
		}
	}
	return nil
}

var builtinChains = map[string]bool{
	"INPUT": true, "OUTPUT": true, "FORWARD": true, "PREROUTING": true, "POSTROUTING": true,
	"ACCEPT": true, "RETURN": true, "DROP": true,
}

// IsBuiltin reports whether a chain or target name is netfilter's own.
func IsBuiltin(chain string) bool { return builtinChains[chain] }

// Tables lists the tables the set touches, sorted.
func (s *Set) Tables() []string {
	seen := map[string]bool{}
	var out []string
	for _, r := range s.Rules {
		if !seen[r.Table] {
			seen[r.Table] = true
			out = append(out, r.Table)
		}
	}
	sort.Strings(out)
	return out
}

// Chains lists, per table, the chains the set creates, in the order Istio
// declares them: chains with rules first (first use), then chains that are
// only jumped to.
func (s *Set) Chains() map[string][]string {
	out := map[string][]string{}
	seen := map[string]bool{}
	add := func(table, chain string) {
		key := table + ":" + chain
		if seen[key] || IsBuiltin(chain) {
			return
		}
		seen[key] = true
		out[table] = append(out[table], chain)
	}
	for _, r := range s.Rules {
		add(r.Table, r.Chain)
	}
	for _, r := range s.Rules {
		if t := r.Target(); t != "" && strings.HasPrefix(t, ChainPrefix) {
			add(r.Table, t)
		}
	}
	return out
}

// Empty reports whether the set has no rules.
func (s *Set) Empty() bool { return len(s.Rules) == 0 }

// Final returns, per table and chain, the rules in the order the kernel
// holds them after the set is applied to empty chains (inserts resolved,
// so every rule's Pos is 0).
func (s *Set) Final() map[string]map[string][]Rule {
	// Rules inserted at the head (a long interface list makes thousands)
	// collect in front, newest last; the rest in back. Only an insert
	// further in, which the plans make a few of, joins the two.
	type chain struct{ front, back []Rule }
	joined := func(c *chain) []Rule {
		out := make([]Rule, 0, len(c.front)+len(c.back))
		for i := len(c.front) - 1; i >= 0; i-- {
			out = append(out, c.front[i])
		}
		return append(out, c.back...)
	}
	chains := map[string]map[string]*chain{}
	for _, r := range s.Rules {
		t := chains[r.Table]
		if t == nil {
			t = map[string]*chain{}
			chains[r.Table] = t
		}
		c := t[r.Chain]
		if c == nil {
			c = &chain{}
			t[r.Chain] = c
		}
		pos := r.Pos
		r.Pos = 0
		n := len(c.front) + len(c.back)
		switch {
		case pos == 1:
			c.front = append(c.front, r)
		case pos > 1 && pos-1 <= n:
			all := joined(c)
			c.front, c.back = nil, slices.Insert(all, pos-1, r)
		default:
			c.back = append(c.back, r)
		}
	}
	out := map[string]map[string][]Rule{}
	for table, t := range chains {
		out[table] = map[string][]Rule{}
		for name, c := range t {
			out[table][name] = joined(c)
		}
	}
	for table, names := range s.Chains() {
		for _, c := range names {
			if out[table] == nil {
				out[table] = map[string][]Rule{}
			}
			if _, ok := out[table][c]; !ok {
				out[table][c] = nil
			}
		}
	}
	return out
}

// Expanded returns the same rules with every set match written out as
// one rule per entry of the set (prefixes of its exact cover, port
// ranges), Istio's shape: what a kernel without ipset gets. Each set-
// matching rule is followed by nothing of another target in its run, so
// the entries' rules can take its place in any order.
func (s *Set) Expanded() *Set {
	out := &Set{Family: s.Family}
	for _, r := range s.Rules {
		name := r.MatchSet()
		if name == "" {
			out.Rules = append(out.Rules, r)
			continue
		}
		ipset := s.IPSet(name)
		var entries [][]string
		for _, p := range ipset.Nets {
			entries = append(entries, []string{"-d", p.String()})
		}
		for _, pr := range ipset.Ports {
			v := strconv.Itoa(int(pr.First))
			if pr.Last != pr.First {
				v += ":" + strconv.Itoa(int(pr.Last))
			}
			entries = append(entries, []string{"--dport", v})
		}
		if r.Pos > 0 {
			// Inserting each at the same position reverses them; keep
			// the set's order in the final chain.
			slices.Reverse(entries)
		}
		for _, e := range entries {
			x := r
			x.Args = replaceSetMatch(r.Args, e)
			out.Rules = append(out.Rules, x)
		}
	}
	return out
}

// replaceSetMatch replaces "-m set --match-set NAME dst" in args.
func replaceSetMatch(args, with []string) []string {
	out := make([]string, 0, len(args)+len(with))
	for i := 0; i < len(args); i++ {
		if args[i] == "-m" && i+4 < len(args) && args[i+1] == "set" && args[i+2] == "--match-set" {
			out = append(out, with...)
			i += 4
			continue
		}
		out = append(out, args[i])
	}
	return out
}
