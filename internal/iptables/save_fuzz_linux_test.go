package iptables

import (
	"strings"
	"testing"

	"github.com/istio-cni-go/istio-cni/internal/testutil"
)

// FuzzParseSave feeds the iptables-save parser what a namespace may hold:
// anything, since other components (and, in a privileged pod, the pod
// itself) write there. Parsing never panics; what parses can be compared
// with a plan and replaced; and every line of the replacement we would
// hand iptables-restore is one well-formed command (rules copied from the
// namespace, quoted strings included, cannot break into more lines or
// arguments).
func FuzzParseSave(f *testing.F) {
	set := planFor(&testing.T{}, testutil.RedirectCases[0], false).V4
	f.Add("")
	f.Add(set.Restore())
	f.Add("*nat\n:PREROUTING ACCEPT [0:0]\n:ISTIO_OUTPUT - [0:0]\n-A PREROUTING -p tcp -j ISTIO_INBOUND\n-A ISTIO_OUTPUT -m comment --comment \"a \\\"b\\\" c\" -j RETURN\nCOMMIT\n")
	f.Add("*mangle\n-A ISTIO_INBOUND -p tcp -m multiport --dports 15008,15020 -j RETURN\n-A ISTIO_DIVERT -j MARK --set-xmark 0x539/0xffffffff\nCOMMIT\n")
	f.Add("*nat\n-A ISTIO_OUTPUT -d 10.0.0.0/8 -m set --match-set ISTIO_X dst -j RETURN\n-A ISTIO_OUTPUT \"unterminated\n")
	f.Add("*\n:\n-A\n-A ISTIO_\n# comment\nCOMMIT")
	f.Fuzz(func(t *testing.T, out string) {
		st, err := ParseSave(out)
		if err != nil {
			return
		}
		_ = st.Empty()
		_ = Diff(st, set)
		text := ReplaceText(st, set)
		for _, line := range strings.Split(text, "\n") {
			switch {
			case line == "", line == "COMMIT", line[0] == '*', line[0] == ':':
			case strings.HasPrefix(line, "-A "), strings.HasPrefix(line, "-D "), strings.HasPrefix(line, "-I "),
				strings.HasPrefix(line, "-F "), strings.HasPrefix(line, "-X "), strings.HasPrefix(line, "-N "):
				if _, err := tokenize(line); err != nil {
					t.Fatalf("restore line %q does not tokenize: %v", line, err)
				}
			default:
				t.Fatalf("restore text has a line that is no command: %q\n%s", line, text)
			}
		}
	})
}
