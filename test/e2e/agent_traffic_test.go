package e2e

import (
	"context"
	"encoding/json"
	"net"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/containernetworking/cni/libcni"

	"github.com/istio-cni-go/istio-cni/internal/install"
	"github.com/istio-cni-go/istio-cni/internal/podinfo"
	"github.com/istio-cni-go/istio-cni/internal/testenv"
)

// TestAgentInstalledNodeRedirects: once the agent has installed itself, a
// runtime loading the node's config from the conf dir gets redirection,
// and the plugin's log lines show up in the agent's output.
func TestAgentInstalledNodeRedirects(t *testing.T) {
	ensureDaemonSet(t, false)
	h := newHost(t)
	ptp := `{"cniVersion":"1.0.0","name":"k8s-pod-network","plugins":[{"type":"ptp","ipMasq":false,` +
		`"ipam":{"type":"host-local","dataDir":"` + filepath.Join(h.RunDir, "..", "ipam") + `","ranges":[[{"subnet":"10.245.0.0/24"}]],"routes":[{"dst":"0.0.0.0/0"}]}}]}`
	if err := os.WriteFile(filepath.Join(h.NetDir, "10-ptp.conflist"), []byte(ptp), 0o644); err != nil {
		t.Fatal(err)
	}
	for _, p := range []string{"ptp", "host-local"} {
		if err := os.Symlink(filepath.Join(testenv.ReferencePluginDir, p), filepath.Join(h.BinDir, p)); err != nil {
			t.Fatal(err)
		}
	}
	h.start("--kubernetes-node-name", testenv.NodeName)
	h.waitReadyz(200, 20*time.Second)

	primary, _, err := install.FindPrimary(h.NetDir, "")
	if err != nil {
		t.Fatal(err)
	}
	list, err := libcni.ConfListFromFile(primary)
	if err != nil {
		t.Fatal(err)
	}
	cni := libcni.NewCNIConfigWithCacheDir([]string{h.BinDir}, t.TempDir(), nil)
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
	logs := h.LogText()
	if !strings.Contains(logs, `"scope":"cni-plugin"`) || !strings.Contains(logs, testNS+"/"+name) || !strings.Contains(logs, "redirect rules programmed") {
		t.Fatalf("plugin lines missing from the agent's output:\n%s", logs)
	}

	t.Run("pod-from-agent-cache-without-api", func(t *testing.T) {
		// With the plugin's own API access broken, only the agent's cache
		// can tell it about the pod.
		kc := filepath.Join(h.RunDir, "istio-cni-kubeconfig")
		if err := testenv.WriteKubeconfig(kc, "https://127.0.0.1:1", cluster.CAFile, "x"); err != nil {
			t.Fatal(err)
		}
		name := "from-cache"
		k8sPod, err := testenv.CreatePod(context.Background(), cluster.Client, testenv.PodSpec{Namespace: testNS, Name: name, Sidecar: true})
		if err != nil {
			t.Fatal(err)
		}
		agent := podinfo.NewAgentClient(filepath.Join(h.RunDir, podinfo.AgentSocketName), time.Second)
		deadline := time.Now().Add(10 * time.Second)
		for { // the informer sees the pod shortly after it is created
			if _, err := agent.GetPod(context.Background(), testNS, name); err == nil {
				break
			} else if time.Now().After(deadline) {
				t.Fatalf("agent cache never served the pod: %v", err)
			}
			time.Sleep(20 * time.Millisecond) // polling an outside process
		}
		p, err := testenv.NewPod(testNS, name, string(k8sPod.UID), "cfromcache")
		if err != nil {
			t.Fatal(err)
		}
		defer p.Close()
		if _, err := cni.AddNetworkList(context.Background(), list, p.RT); err != nil {
			t.Fatalf("ADD with the API unreachable but the agent up: %v", err)
		}
		defer func() { _ = cni.DelNetworkList(context.Background(), list, p.RT) }()
		expectRedirect(t, p, "tcp4", "0.0.0.0:15001", ap(testenv.RemoteV4+":80"), func() (net.Conn, error) {
			return testenv.Dial(p, "tcp4", testenv.RemoteV4+":80")
		})

		// A sandbox for another pod of the same name (another UID) is not
		// answered from the cache: the plugin goes to the API, which fails.
		q, err := testenv.NewPod(testNS, name, "00000000-0000-0000-0000-000000000000", "cfromcache2")
		if err != nil {
			t.Fatal(err)
		}
		defer q.Close()
		var raw map[string]any
		if err := json.Unmarshal(list.Bytes, &raw); err != nil {
			t.Fatal(err)
		}
		plugins := raw["plugins"].([]any)
		plugins[len(plugins)-1].(map[string]any)["k8s_retry_budget"] = "1s"
		b, _ := json.Marshal(raw)
		list2, err := libcni.ConfListFromBytes(b)
		if err != nil {
			t.Fatal(err)
		}
		_, err = cni.AddNetworkList(context.Background(), list2, q.RT)
		if err == nil || !strings.Contains(err.Error(), "127.0.0.1:1") {
			t.Fatalf("a UID mismatch must not be served from the cache: %v", err)
		}
	})

	t.Run("status-follows-agent-readiness", func(t *testing.T) {
		status := func() map[string]any {
			res, _ := execPlugin(t, "STATUS", "", "", []byte(`{"cniVersion":"1.1.0","name":"k8s-pod-network","type":"istio-cni","cni_agent_run_dir":"`+h.RunDir+`"}`))
			return res
		}
		if res := status(); res != nil {
			t.Fatalf("STATUS with a ready agent: %v", res)
		}
		// The primary config disappears: the agent is not ready, STATUS says so.
		if err := os.Rename(filepath.Join(h.NetDir, "10-ptp.conflist"), filepath.Join(h.NetDir, "10-ptp.bak")); err != nil {
			t.Fatal(err)
		}
		h.waitReadyz(503, 10*time.Second)
		res := status()
		if res == nil || res["code"] != float64(50) {
			t.Fatalf("STATUS with an unready agent: %v, want code 50", res)
		}
		// A dead agent (its socket left behind) is not ready either.
		h.Kill()
		if res := status(); res == nil || res["code"] != float64(50) {
			t.Fatalf("STATUS with a dead agent: %v, want code 50", res)
		}
	})
}

func calicoBytes(t *testing.T) []byte {
	t.Helper()
	b, err := os.ReadFile(filepath.Join(primaryDir, "10-calico.conflist"))
	if err != nil {
		t.Fatal(err)
	}
	return b
}
