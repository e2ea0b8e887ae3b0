package e2e

import (
	"context"
	"net"
	"os/exec"
	"strings"
	"testing"
	"time"

	"github.com/istio-cni-go/istio-cni/internal/testenv"
)

// addLine is the fallback's "redirect rules programmed" line for the
// pod's ADD number n (from 1), waited for: the plugin sends its lines as
// it exits.
func addLine(t *testing.T, lines func() []string, pod string, n int) string {
	t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for {
		var found []string
		for _, l := range lines() {
			if strings.Contains(l, "redirect rules programmed") && strings.Contains(l, `"pod":"`+testNS+"/"+pod+`"`) {
				found = append(found, l)
			}
		}
		if len(found) >= n {
			return found[n-1]
		}
		if time.Now().After(deadline) {
			t.Fatalf("ADD #%d of %s logged no line; lines:\n%s", n, pod, strings.Join(lines(), "\n"))
		}
		time.Sleep(10 * time.Millisecond) // polling a log another process sends, bounded
	}
}

// TestFallbackPreparesNFTables: with native nftables and no agent, the
// fallback prepares the pod's transaction itself and sends it from the
// pod's namespace, as a relay sends a prepared one, where it used to
// apply the rules through the nftables library (an echo awaited per
// message). A namespace that holds our tables already (a runtime's DEL
// and ADD again on it) is served in place, the line saying why; both leave working
// rules.
func TestFallbackPreparesNFTables(t *testing.T) {
	e := backendEnv(t, "fallback", "nftables")
	lines := pluginLines(t, e.node.RunDir)
	pod := e.newPod(&testenv.PodSpec{Sidecar: true})
	t.Cleanup(func() { _ = e.node.Del(context.Background(), e.node.Chained, pod) })
	for n := 1; n <= 2; n++ {
		if n == 2 {
			// DEL leaves the rules to go with the namespace; a runtime
			// that retries the sandbox's network ADDs again on it.
			if err := e.node.Del(context.Background(), e.node.Chained, pod); err != nil {
				t.Fatal(err)
			}
		}
		if _, err := e.node.Add(context.Background(), e.node.Chained, pod); err != nil {
			t.Fatalf("ADD #%d: %v", n, err)
		}
		line := addLine(t, lines, pod.Name, n)
		want := []string{`"fallback":true`, `"prepared_here":true`, `"result":"nftables applied"`}
		if n == 2 {
			want = []string{`"fallback":true`, `"prepared_here":false`, "the namespace has tables of ours already"}
		}
		for _, w := range want {
			if !strings.Contains(line, w) {
				t.Fatalf("ADD #%d's line lacks %s:\n%s", n, w, line)
			}
		}
		if strings.Contains(line, "stored_plan") {
			t.Fatalf("ADD #%d's line speaks of the agent's store, which nftables does not use:\n%s", n, line)
		}
		var tables []byte
		if err := pod.InPod(func() error {
			var err error
			tables, err = exec.Command("/usr/sbin/nft", "list", "tables").CombinedOutput()
			return err
		}); err != nil {
			t.Fatalf("nft list tables: %v: %s", err, tables)
		}
		if got := strings.Count(string(tables), "table inet istio-proxy-"); got == 0 {
			t.Fatalf("after ADD #%d no table of ours:\n%s", n, tables)
		}
		expectRedirect(t, pod, "tcp4", "0.0.0.0:15001", ap(testenv.RemoteV4+":80"), func() (net.Conn, error) {
			return testenv.Dial(pod, "tcp4", testenv.RemoteV4+":80")
		})
		if err := e.node.Check(context.Background(), e.node.Chained, pod); err != nil {
			t.Fatalf("CHECK after ADD #%d: %v", n, err)
		}
	}
}
