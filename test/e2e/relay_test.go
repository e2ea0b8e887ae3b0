package e2e

import (
	"context"
	"net"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/istio-cni-go/istio-cni/internal/cnirelay"
	"github.com/istio-cni-go/istio-cni/internal/testenv"
)

// TestRelay covers the runtime-facing binary's choices: the agent when it
// answers, the fallback plugin when it does not (no socket, a dead agent's
// socket, an agent gone mid-command), and a clear error when neither can
// serve. Each time the pod ends up with the same rules.
func TestRelay(t *testing.T) {
	sock := func(e *env) string { return filepath.Join(e.node.RunDir, cnirelay.SocketName) }
	addAndCheck := func(t *testing.T, e *env) {
		t.Helper()
		sb := e.add(&testenv.PodSpec{Sidecar: true})
		if rules := rulesIn(t, sb.pod); !strings.Contains(rules, "-A ISTIO_OUTPUT") {
			t.Fatalf("no redirect rules after ADD:\n%s", rules)
		}
		if err := e.node.Check(context.Background(), e.node.Chained, sb.pod); err != nil {
			t.Fatalf("CHECK: %v", err)
		}
	}

	t.Run("dead-agent-socket", func(t *testing.T) {
		e := newEnv(t, nil)
		// A socket file nobody listens on, as a killed agent leaves it.
		l, err := net.ListenUnix("unix", &net.UnixAddr{Name: sock(e), Net: "unix"})
		if err != nil {
			t.Fatal(err)
		}
		l.SetUnlinkOnClose(false)
		l.Close()
		if _, err := os.Stat(sock(e)); err != nil {
			t.Fatal(err)
		}
		addAndCheck(t, e)
	})

	t.Run("agent-gone-mid-command", func(t *testing.T) {
		e := newEnv(t, nil)
		l, err := net.ListenUnix("unix", &net.UnixAddr{Name: sock(e), Net: "unix"})
		if err != nil {
			t.Fatal(err)
		}
		defer l.Close()
		go func() {
			for {
				c, err := l.Accept()
				if err != nil {
					return
				}
				c.Close() // takes the command, dies before answering
			}
		}()
		addAndCheck(t, e)
	})

	t.Run("agent-answers", func(t *testing.T) {
		e := newEnv(t, nil)
		e.serveCNI("")
		// The plugin's kubeconfig is useless: only the agent can serve.
		if err := os.Remove(filepath.Join(e.node.RunDir, "istio-cni-kubeconfig")); err != nil {
			t.Fatal(err)
		}
		addAndCheck(t, e)

		// Errors come back as the plugin's own, naming the annotation.
		pod := e.newPod(&testenv.PodSpec{Sidecar: true, Annotations: map[string]string{
			"traffic.sidecar.istio.io/excludeOutboundPorts": "70000"}})
		_, err := e.node.Add(context.Background(), e.node.Chained, pod)
		if err == nil || !strings.Contains(err.Error(), "traffic.sidecar.istio.io/excludeOutboundPorts") || !strings.Contains(err.Error(), "70000") {
			t.Fatalf("ADD with a bad annotation through the agent: %v", err)
		}
		if rules := rulesIn(t, pod); strings.Contains(rules, "ISTIO_") {
			t.Fatalf("rules applied despite the bad annotation:\n%s", rules)
		}
	})

	t.Run("no-agent-no-fallback", func(t *testing.T) {
		e := newEnv(t, nil)
		// A bin dir with the relay alone.
		dir := t.TempDir()
		relay := filepath.Join(dir, "istio-cni")
		copyFile(t, pluginBin, relay)
		if err := os.Chmod(relay, 0o755); err != nil {
			t.Fatal(err)
		}
		pod := e.newPod(&testenv.PodSpec{Sidecar: true})
		if _, err := e.node.Add(context.Background(), e.node.Primary, pod); err != nil {
			t.Fatal(err)
		}
		conf := []byte(`{"cniVersion":"1.0.0","name":"k8s-pod-network","type":"istio-cni","cni_agent_run_dir":"` + e.node.RunDir + `"}`)
		res, _ := execPluginAt(t, relay, "ADD", pod.NetNS.Path(), "K8S_POD_NAMESPACE="+testNS+";K8S_POD_NAME="+pod.Name, conf)
		wantErr(t, res, "no node agent", cnirelay.FallbackBinary)
	})
}
