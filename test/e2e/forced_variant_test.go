package e2e

import (
	"context"
	"net"
	"os/exec"
	"strings"
	"testing"

	"github.com/istio-cni-go/istio-cni/internal/prepared"
	"github.com/istio-cni-go/istio-cni/internal/testenv"
)

// TestFallbackFollowsAgentsVariant: with the agent's FORCE_IPTABLES_BINARY
// said in the run directory (as the agent says it at start), the
// fallback, which runs in the runtime's environment, puts a pod's rules
// in that variant, as the agent would have, and its CHECK looks there;
// with nothing said it detects the variant (nft in a fresh namespace).
func TestFallbackFollowsAgentsVariant(t *testing.T) {
	e := newEnv(t, nil) // no agent answers: the relay runs the fallback
	saved := func(pod *testenv.Pod, bin string) string {
		t.Helper()
		var out []byte
		if err := pod.InPod(func() error {
			var err error
			out, err = exec.Command(bin).CombinedOutput()
			return err
		}); err != nil {
			t.Fatalf("%s: %v: %s", bin, err, out)
		}
		return string(out)
	}
	for _, c := range []struct{ said, want, notWant string }{
		{said: "legacy", want: "iptables-legacy-save", notWant: "iptables-nft-save"},
		{said: "", want: "iptables-nft-save", notWant: "iptables-legacy-save"},
	} {
		if err := prepared.WriteForcedVariant(e.node.RunDir, c.said); err != nil {
			t.Fatal(err)
		}
		pod := e.newPod(&testenv.PodSpec{Sidecar: true})
		if _, err := e.node.Add(context.Background(), e.node.Chained, pod); err != nil {
			t.Fatalf("ADD (agent says %q): %v", c.said, err)
		}
		if got := saved(pod, c.want); !strings.Contains(got, "-A ISTIO_OUTPUT") {
			t.Fatalf("agent says %q: no rules in %s:\n%s", c.said, c.want, got)
		}
		if got := saved(pod, c.notWant); strings.Contains(got, "ISTIO_") {
			t.Fatalf("agent says %q: rules in %s too:\n%s", c.said, c.notWant, got)
		}
		expectRedirect(t, pod, "tcp4", "0.0.0.0:15001", ap(testenv.RemoteV4+":80"), func() (net.Conn, error) {
			return testenv.Dial(pod, "tcp4", testenv.RemoteV4+":80")
		})
		if err := e.node.Check(context.Background(), e.node.Chained, pod); err != nil {
			t.Fatalf("CHECK (agent says %q): %v", c.said, err)
		}
	}
}
