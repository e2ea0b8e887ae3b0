// Package ruleset turns redirect parameters into netfilter rules as data,
// one set per IP family, and renders them. Building is pure; applying is
// the job of package iptables.
package ruleset

import (
	"fmt"
	"sort"
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
	TProxyRouteTable  = 133
	TProxyMarkValue   = 1337
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

// Restore renders the set as iptables-restore input for --noflush on a
// namespace that holds none of our chains. The text is the same as Istio's.
func (s *Set) Restore() string {
	var b strings.Builder
	chains := s.Chains()
	for _, table := range s.Tables() {
		fmt.Fprintf(&b, "* %s\n", table)
		for _, c := range chains[table] {
			fmt.Fprintf(&b, "-N %s\n", c)
		}
		for _, r := range s.Rules {
			if r.Table == table {
				b.WriteString(r.Command())
				b.WriteByte('\n')
			}
		}
		b.WriteString("COMMIT\n")
	}
	return b.String()
}

// Empty reports whether the set has no rules.
func (s *Set) Empty() bool { return len(s.Rules) == 0 }

// Final returns, per table and chain, the rules in the order the kernel
// holds them after the set is applied to empty chains (inserts resolved).
func (s *Set) Final() map[string]map[string][][]string {
	out := map[string]map[string][][]string{}
	for _, r := range s.Rules {
		t := out[r.Table]
		if t == nil {
			t = map[string][][]string{}
			out[r.Table] = t
		}
		rules := t[r.Chain]
		if r.Pos > 0 && r.Pos-1 <= len(rules) {
			rules = append(rules[:r.Pos-1], append([][]string{r.Args}, rules[r.Pos-1:]...)...)
		} else {
			rules = append(rules, r.Args)
		}
		t[r.Chain] = rules
	}
	for table, chains := range s.Chains() {
		for _, c := range chains {
			if out[table] == nil {
				out[table] = map[string][][]string{}
			}
			if _, ok := out[table][c]; !ok {
				out[table][c] = nil
			}
		}
	}
	return out
}
