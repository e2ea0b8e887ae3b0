package iptables

import (
	"fmt"
	"sort"
	"strconv"

	"github.com/istio-cni-go/istio-cni/internal/ruleset"
)

// Diff compares what is in the kernel with a set. It returns nil when they
// hold the same rules and the sets those rules match hold the same
// entries, else a list of differences for people to read.
func Diff(st *State, set *ruleset.Set) []string {
	return append(diffRules(st, set), diffSets(st, set)...)
}

// diffRules compares the rules only.
func diffRules(st *State, set *ruleset.Set) []string {
	var diffs []string
	want := set.Final()
	for _, table := range unionTables(st, want) {
		for _, chain := range sortedKeys(want[table]) {
			wantRules := normalizeAll(argsOf(want[table][chain]))
			if ruleset.IsBuiltin(chain) {
				got := normalizeAll(st.Builtin[table][chain])
				if !equal(got, wantRules) {
					diffs = append(diffs, fmt.Sprintf("%s/%s: our rules differ: %s", table, chain, firstMismatch(wantRules, got)))
				}
				continue
			}
			got, ok := st.Chains[table][chain]
			if !ok {
				diffs = append(diffs, fmt.Sprintf("%s/%s: chain missing", table, chain))
				continue
			}
			if g := normalizeAll(got); !equal(g, wantRules) {
				diffs = append(diffs, fmt.Sprintf("%s/%s: %s", table, chain, firstMismatch(wantRules, g)))
			}
		}
		for _, chain := range sortedKeys(st.Chains[table]) {
			if _, ok := want[table][chain]; !ok {
				diffs = append(diffs, fmt.Sprintf("%s/%s: unexpected chain", table, chain))
			}
		}
		for _, chain := range sortedKeys(st.Builtin[table]) {
			if _, ok := want[table][chain]; !ok && len(st.Builtin[table][chain]) > 0 {
				diffs = append(diffs, fmt.Sprintf("%s/%s: unexpected rules %q", table, chain, normalizeAll(st.Builtin[table][chain])))
			}
		}
	}
	return diffs
}

// ReplaceText renders one iptables-restore --noflush transaction that
// turns the current state into the set.
func ReplaceText(st *State, set *ruleset.Set) string {
	return set.RestoreOver(st.present())
}

// present is the state as the restore renderer takes it.
func (st *State) present() *ruleset.Present {
	p := &ruleset.Present{Chains: map[string][]string{}, Builtin: st.Builtin}
	for table, chains := range st.Chains {
		p.Chains[table] = sortedKeys(chains)
	}
	return p
}

func argsOf(rules []ruleset.Rule) [][]string {
	out := make([][]string, len(rules))
	for i, r := range rules {
		out[i] = r.Args
	}
	return out
}

func normalizeAll(rules [][]string) []string {
	out := make([]string, len(rules))
	for i, r := range rules {
		out[i] = normalize(r)
	}
	return out
}

// firstMismatch says where two rule lists part: short lists whole, long
// ones (a chain can hold thousands of rules) by their first difference.
func firstMismatch(want, have []string) string {
	if len(want)+len(have) <= 16 {
		return fmt.Sprintf("want %q, have %q", want, have)
	}
	i := 0
	for i < len(want) && i < len(have) && want[i] == have[i] {
		i++
	}
	at := func(l []string) string {
		if i < len(l) {
			return strconv.Quote(l[i])
		}
		return "nothing"
	}
	return fmt.Sprintf("%d rules, want %d; rule %d is %s, want %s", len(have), len(want), i+1, at(have), at(want))
}

func equal(a, b []string) bool {
	if len(a) != len(b) {
		return false
	}
	for i := range a {
		if a[i] != b[i] {
			return false
		}
	}
	return true
}

func unionTables(st *State, want map[string]map[string][]ruleset.Rule) []string {
	seen := map[string]bool{}
	for t := range st.Chains {
		seen[t] = true
	}
	for t := range st.Builtin {
		seen[t] = true
	}
	for t := range want {
		seen[t] = true
	}
	out := make([]string, 0, len(seen))
	for t := range seen {
		out = append(out, t)
	}
	sort.Strings(out)
	return out
}

func sortedKeys[V any](m map[string]V) []string {
	out := make([]string, 0, len(m))
	for k := range m {
		out = append(out, k)
	}
	sort.Strings(out)
	return out
}
