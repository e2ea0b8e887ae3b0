// Package iptables applies rule sets inside a pod's network namespace with
// one iptables-restore transaction per IP family, and reads back what is
// there to make re-application a no-op, to replace old rules, and to check.
package iptables

import (
	"fmt"
	"net/netip"
	"sort"
	"strconv"
	"strings"

	"github.com/istio-cni-go/istio-cni/internal/ruleset"
)

// State is what iptables-save reports for the chains this plugin owns.
type State struct {
	// Chains holds every ISTIO_* chain per table, with its rules as
	// iptables-save prints them (without "-A CHAIN").
	Chains map[string]map[string][][]string
	// Builtin holds, per table and built-in chain, the rules that belong to
	// us (jumps into ISTIO_* chains and the shapes we generate there).
	Builtin map[string]map[string][][]string
	// IPSets holds the namespace's sets of ours by name, when they were
	// read (ipsets belong to the namespace, not to one family).
	IPSets map[string]*ruleset.IPSet
}

// Empty reports whether none of our rules or chains are present.
func (s *State) Empty() bool {
	for _, c := range s.Chains {
		if len(c) > 0 {
			return false
		}
	}
	for _, c := range s.Builtin {
		for _, r := range c {
			if len(r) > 0 {
				return false
			}
		}
	}
	return true
}

// ParseSave reads iptables-save output. Rules in built-in chains that are
// not ours are ignored: another component may own them.
func ParseSave(out string) (*State, error) {
	st := &State{Chains: map[string]map[string][][]string{}, Builtin: map[string]map[string][][]string{}}
	table := ""
	for n, line := range strings.Split(out, "\n") {
		line = strings.TrimSpace(line)
		switch {
		case line == "" || line[0] == '#' || line == "COMMIT":
		case line[0] == '*':
			table = strings.TrimSpace(line[1:])
		case line[0] == ':':
			name := strings.Fields(line[1:])
			if len(name) > 0 && ownChain(name[0]) {
				if st.Chains[table] == nil {
					st.Chains[table] = map[string][][]string{}
				}
				if _, ok := st.Chains[table][name[0]]; !ok {
					st.Chains[table][name[0]] = nil
				}
			}
		case strings.HasPrefix(line, "-A "):
			toks, err := tokenize(line)
			if err != nil {
				return nil, fmt.Errorf("iptables-save line %d: %w", n+1, err)
			}
			if len(toks) < 2 {
				return nil, fmt.Errorf("iptables-save line %d: no chain in %q", n+1, line)
			}
			chain, args := toks[1], toks[2:]
			if ownChain(chain) {
				if st.Chains[table] == nil {
					st.Chains[table] = map[string][][]string{}
				}
				st.Chains[table][chain] = append(st.Chains[table][chain], args)
			} else if IsOwnBuiltinRule(args) {
				if st.Builtin[table] == nil {
					st.Builtin[table] = map[string][][]string{}
				}
				st.Builtin[table][chain] = append(st.Builtin[table][chain], args)
			}
		default:
			return nil, fmt.Errorf("iptables-save line %d: unexpected %q", n+1, line)
		}
	}
	return st, nil
}

// ownChain tells our chains: Istio's prefix and only the letters, digits,
// '_' and '-' we name chains with. A chain someone else named ISTIO_ with
// other characters (a quote would break the restore text we write to
// replace it) is not ours, and is left alone.
func ownChain(name string) bool {
	if !strings.HasPrefix(name, ruleset.ChainPrefix) {
		return false
	}
	for _, c := range name {
		if !chainNameChar(c) {
			return false
		}
	}
	return true
}

func chainNameChar(c rune) bool {
	return c >= 'A' && c <= 'Z' || c >= 'a' && c <= 'z' || c >= '0' && c <= '9' || c == '_' || c == '-'
}

// tokenize splits a save line into words, honouring double quotes.
func tokenize(line string) ([]string, error) {
	var out []string
	var cur strings.Builder
	inQuote, have := false, false
	for i := 0; i < len(line); i++ {
		c := line[i]
		switch {
		case c == '\\' && inQuote && i+1 < len(line):
			i++
			cur.WriteByte(line[i])
		case c == '"':
			inQuote, have = !inQuote, true
		case c == ' ' && !inQuote:
			if have {
				out = append(out, cur.String())
				cur.Reset()
				have = false
			}
		default:
			cur.WriteByte(c)
			have = true
		}
	}
	if inQuote {
		return nil, fmt.Errorf("unterminated quote in %q", line)
	}
	if have {
		out = append(out, cur.String())
	}
	return out, nil
}

// IsOwnBuiltinRule recognises the rules this plugin puts into built-in
// chains: jumps into ISTIO_* chains, interface short-circuits, and the
// TPROXY mark bookkeeping. Only these are removed when rules are replaced.
func IsOwnBuiltinRule(args []string) bool {
	n := normalize(args)
	target := ""
	for i := 0; i+1 < len(args); i++ {
		if args[i] == "-j" {
			target = args[i+1]
		}
	}
	switch {
	case ownChain(target):
		return true
	case target == "RETURN" && (isSingle(n, "-i") || isSingle(n, "-o")):
		return true
	case target == "CONNMARK" || target == "MARK":
		return strings.Contains(n, "--mark "+strconv.Itoa(ruleset.TProxyMarkValue)) ||
			strings.Contains(n, "--set-xmark "+ruleset.OutboundMark+"/")
	case target == "RETURN" && strings.Contains(n, "-o lo") && strings.Contains(n, "--mark "+ruleset.TProxyMark):
		return true
	}
	return false
}

// isSingle reports whether the normalized rule is "<opt> X -j RETURN".
func isSingle(n, opt string) bool {
	f := strings.Fields(n)
	return len(f) == 4 && f[0] == opt && f[2] == "-j"
}

// normalize turns a rule, as we write it or as iptables-save prints it,
// into a canonical string: implicit protocol modules dropped, defaults
// that iptables-save adds removed, numbers and prefixes canonical, and
// match options sorted (their order does not change what a rule matches).
func normalize(args []string) string {
	var toks []string
	for i := 0; i < len(args); i++ {
		if args[i] == "-m" && i+1 < len(args) && (args[i+1] == "tcp" || args[i+1] == "udp") {
			i++
			continue
		}
		toks = append(toks, args[i])
	}
	jump := len(toks)
	for i, t := range toks {
		if t == "-j" {
			jump = i
			break
		}
	}
	var matches []string
	for _, m := range segments(toks[:jump]) {
		// An address match of a whole family matches everything, and
		// iptables-save leaves it out.
		switch m {
		case "-d 0.0.0.0/0", "-s 0.0.0.0/0", "-d ::/0", "-s ::/0":
			continue
		}
		matches = append(matches, m)
	}
	target := segments(toks[jump:])
	sort.Strings(matches)
	var kept []string
	for _, s := range target {
		switch s {
		case "--on-ip 0.0.0.0", "--on-ip ::", "--nfmask 4294967295", "--ctmask 4294967295":
			continue
		}
		kept = append(kept, s)
	}
	if len(kept) > 1 {
		sort.Strings(kept[1:])
	}
	return strings.Join(append(matches, kept...), " ")
}

// segments groups tokens into options with their values, canonicalising
// each value.
func segments(toks []string) []string {
	var out []string
	var cur []string
	flush := func() {
		if len(cur) > 0 {
			out = append(out, strings.Join(canonical(cur), " "))
			cur = nil
		}
	}
	for i, t := range toks {
		// In "! --opt value" the option stays in the segment of its "!".
		afterNot := i > 0 && toks[i-1] == "!"
		pendingNot := len(cur) == 1 && cur[0] == "!"
		isOpt := strings.HasPrefix(t, "-") && !afterNot
		if t == "!" || (isOpt && !pendingNot) {
			flush()
		}
		cur = append(cur, t)
	}
	flush()
	return out
}

func canonical(seg []string) []string {
	out := make([]string, len(seg))
	copy(out, seg)
	opt := 0
	if out[0] == "!" && len(out) > 1 {
		opt = 1
	}
	switch out[opt] {
	case "--to-port":
		out[opt] = "--to-ports"
	case "--set-mark":
		out[opt] = "--set-xmark"
		if len(out) > opt+1 && !strings.Contains(out[opt+1], "/") {
			out[opt+1] += "/0xffffffff"
		}
	}
	for i := opt + 1; i < len(out); i++ {
		out[i] = canonicalValue(out[i])
	}
	return out
}

func canonicalValue(v string) string {
	if p, err := netip.ParsePrefix(v); err == nil {
		return p.Masked().String()
	}
	parts := strings.Split(v, "/")
	for i, p := range parts {
		if n, err := strconv.ParseUint(p, 0, 64); err == nil {
			parts[i] = strconv.FormatUint(n, 10)
		}
	}
	return strings.Join(parts, "/")
}
