package ruleset

import (
	"fmt"
	"sort"
	"strings"
)

// Present is what a namespace holds of ours before a restore, as read
// back from it.
type Present struct {
	// Chains are our chains, per table.
	Chains map[string][]string
	// Builtin are our rules in built-in chains, per table and chain, as
	// iptables-save prints their arguments.
	Builtin map[string]map[string][][]string
}

// Restore renders the set as iptables-restore input for --noflush on a
// namespace that holds none of our chains. The text is the same as Istio's.
func (s *Set) Restore() string { return s.RestoreOver(nil) }

// RestoreOver renders one iptables-restore --noflush transaction that
// turns what the namespace holds (have; nil when it holds nothing of ours)
// into the set: our rules in built-in chains are deleted, our chains
// flushed (a chain line flushes under --noflush), chains no longer wanted
// deleted, and the new rules added. Both the first apply and every
// replacement render here, so the rules read the same in either.
func (s *Set) RestoreOver(have *Present) string {
	var b strings.Builder
	chains := s.Chains()
	for _, table := range s.restoreTables(have) {
		if have == nil {
			// Istio's text, which its troubleshooting guides and our
			// validation probe know.
			fmt.Fprintf(&b, "* %s\n", table)
			for _, c := range chains[table] {
				fmt.Fprintf(&b, "-N %s\n", c)
			}
		} else {
			fmt.Fprintf(&b, "*%s\n", table)
			have.clear(&b, table, chains[table])
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

// restoreTables lists, sorted, the tables the transaction touches: the
// set's, and those holding something of ours that must go.
func (s *Set) restoreTables(have *Present) []string {
	if have == nil {
		return s.Tables()
	}
	seen := map[string]bool{}
	for t := range have.Chains {
		seen[t] = true
	}
	for t := range have.Builtin {
		seen[t] = true
	}
	for _, t := range s.Tables() {
		seen[t] = true
	}
	return sortedNames(seen)
}

// clear writes what a table's transaction does before adding the rules:
// every chain of ours declared (which flushes the old ones and makes the
// new ones), our rules in built-in chains deleted, and the chains the set
// no longer has deleted.
func (p *Present) clear(b *strings.Builder, table string, want []string) {
	keep := map[string]bool{}
	for _, c := range want {
		keep[c] = true
	}
	old := append([]string(nil), p.Chains[table]...)
	sort.Strings(old)
	had := map[string]bool{}
	for _, c := range old {
		had[c] = true
		fmt.Fprintf(b, ":%s - [0:0]\n", c)
	}
	for _, c := range want {
		if !had[c] {
			fmt.Fprintf(b, ":%s - [0:0]\n", c)
		}
	}
	builtin := map[string]bool{}
	for c := range p.Builtin[table] {
		builtin[c] = true
	}
	for _, chain := range sortedNames(builtin) {
		for _, r := range p.Builtin[table][chain] {
			fmt.Fprintf(b, "-D %s %s\n", chain, quoteArgs(r))
		}
	}
	for _, c := range old {
		if !keep[c] {
			fmt.Fprintf(b, "-X %s\n", c)
		}
	}
}

// quoteArgs renders arguments read back from iptables-save so that
// iptables-restore reads the same ones: a comment with spaces or quotes
// stays one argument.
func quoteArgs(args []string) string {
	out := make([]string, len(args))
	for i, a := range args {
		if a == "" || strings.ContainsAny(a, " \"\\") {
			a = `"` + strings.NewReplacer(`\`, `\\`, `"`, `\"`).Replace(a) + `"`
		}
		out[i] = a
	}
	return strings.Join(out, " ")
}

func sortedNames(set map[string]bool) []string {
	out := make([]string, 0, len(set))
	for k := range set {
		out = append(out, k)
	}
	sort.Strings(out)
	return out
}
