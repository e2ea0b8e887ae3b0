package ruleset

import "testing"

// TestRestoreOverReplaces pins the replacement transaction: old chains
// flushed before new ones are declared, our rules in built-in chains
// deleted with their arguments quoted as iptables-save would need, chains
// the set dropped deleted, and a table holding only old rules still
// visited.
func TestRestoreOverReplaces(t *testing.T) {
	set := &Set{Family: IPv4, Rules: []Rule{
		{Table: "nat", Chain: "OUTPUT", Args: []string{"-j", ChainOutput}},
		{Table: "nat", Chain: ChainOutput, Args: []string{"-j", ChainRedirect}},
		{Table: "nat", Chain: ChainRedirect, Args: []string{"-p", "tcp", "-j", "REDIRECT", "--to-ports", "15001"}},
	}}
	have := &Present{
		Chains: map[string][]string{"nat": {ChainRedirect, ChainInbound}, "mangle": {ChainDivert}},
		Builtin: map[string]map[string][][]string{
			"nat": {"PREROUTING": {{"-m", "comment", "--comment", `a "b" c`, "-j", ChainInbound}}},
		},
	}
	want := `*mangle
:ISTIO_DIVERT - [0:0]
-X ISTIO_DIVERT
COMMIT
*nat
:ISTIO_INBOUND - [0:0]
:ISTIO_REDIRECT - [0:0]
:ISTIO_OUTPUT - [0:0]
-D PREROUTING -m comment --comment "a \"b\" c" -j ISTIO_INBOUND
-X ISTIO_INBOUND
-A OUTPUT -j ISTIO_OUTPUT
-A ISTIO_OUTPUT -j ISTIO_REDIRECT
-A ISTIO_REDIRECT -p tcp -j REDIRECT --to-ports 15001
COMMIT
`
	if got := set.RestoreOver(have); got != want {
		t.Errorf("RestoreOver:\n%s\nwant:\n%s", got, want)
	}
	fresh := "* nat\n-N ISTIO_OUTPUT\n-N ISTIO_REDIRECT\n-A OUTPUT -j ISTIO_OUTPUT\n-A ISTIO_OUTPUT -j ISTIO_REDIRECT\n" +
		"-A ISTIO_REDIRECT -p tcp -j REDIRECT --to-ports 15001\nCOMMIT\n"
	if got := set.Restore(); got != fresh {
		t.Errorf("Restore:\n%s\nwant:\n%s", got, fresh)
	}
}
