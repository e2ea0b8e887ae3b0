package e2e

import (
	"context"
	"net"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/containernetworking/cni/libcni"

	"github.com/istio-cni-go/istio-cni/internal/install"
	"github.com/istio-cni-go/istio-cni/internal/testenv"
)

// TestAgentInstalledNodeRedirects: once the agent has installed itself, a
// runtime loading the node's config from the conf dir gets redirection,
// and the plugin's log lines show up in the agent's output.
func TestAgentInstalledNodeRedirects(t *testing.T) {
	ensureDaemonSet(t, false)
	h := newHost(t)
	ptp := `{"cniVersion":"1.0.0","name":"k8s-pod-network","plugins":[{"type":"ptp","ipMasq":false,` +
		`"ipam":{"type":"host-local","dataDir":"` + filepath.Join(h.runDir, "..", "ipam") + `","ranges":[[{"subnet":"10.245.0.0/24"}]],"routes":[{"dst":"0.0.0.0/0"}]}}]}`
	if err := os.WriteFile(filepath.Join(h.netDir, "10-ptp.conflist"), []byte(ptp), 0o644); err != nil {
		t.Fatal(err)
	}
	for _, p := range []string{"ptp", "host-local"} {
		if err := os.Symlink(filepath.Join(testenv.ReferencePluginDir, p), filepath.Join(h.binDir, p)); err != nil {
			t.Fatal(err)
		}
	}
	h.start()
	h.waitReadyz(200, 20*time.Second)

	primary, _, err := install.FindPrimary(h.netDir, "")
	if err != nil {
		t.Fatal(err)
	}
	list, err := libcni.ConfListFromFile(primary)
	if err != nil {
		t.Fatal(err)
	}
	cni := libcni.NewCNIConfigWithCacheDir([]string{h.binDir}, t.TempDir(), nil)
	name := "agent-installed"
	k8sPod, err := testenv.CreatePod(context.Background(), cluster.Client, testenv.PodSpec{Namespace: testNS, Name: name, Sidecar: true})
	if err != nil {
		t.Fatal(err)
	}
	pod, err := testenv.NewPod(testNS, name, string(k8sPod.UID), "cagentinstalled")
	if err != nil {
		t.Fatal(err)
	}
	defer pod.Close()
	if _, err := cni.AddNetworkList(context.Background(), list, pod.RT); err != nil {
		t.Fatalf("ADD with the node's installed config: %v", err)
	}
	defer func() { _ = cni.DelNetworkList(context.Background(), list, pod.RT) }()
	expectRedirect(t, pod, "tcp4", "0.0.0.0:15001", ap(testenv.RemoteV4+":80"), func() (net.Conn, error) {
		return testenv.Dial(pod, "tcp4", testenv.RemoteV4+":80")
	})
	// The plugin posts its lines when it exits, before ADD returns.
	logs := h.logs.String()
	if !strings.Contains(logs, `"scope":"cni-plugin"`) || !strings.Contains(logs, testNS+"/"+name) || !strings.Contains(logs, "redirect rules programmed") {
		t.Fatalf("plugin lines missing from the agent's output:\n%s", logs)
	}
}
