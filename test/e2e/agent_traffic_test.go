package e2e

import (
	"context"
	"net"
	"os"
	"path/filepath"
	"regexp"
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
	h := ptpHost(t, "10.245.0.0/24")
	// The agent's path is asserted: the relay waits for it, however
	// loaded the machine.
	h.start("--kubernetes-node-name", testenv.NodeName, "--cni-agent-wait=0")
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
	k8sPod, err := createPod(t, testenv.PodSpec{Namespace: testNS, Name: name, Sidecar: true})
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
	logs := h.WaitLog(10*time.Second, testenv.LogLine("redirect rules programmed", testNS+"/"+name))
	if !strings.Contains(logs, `"scope":"cni-plugin"`) || !strings.Contains(logs, testNS+"/"+name) || !strings.Contains(logs, "redirect rules programmed") {
		t.Fatalf("plugin lines missing from the agent's output:\n%s", logs)
	}
	// And in the run directory's log file, as Istio's plugin keeps it.
	requirePluginFileLine(t, h.RunDir, testNS+"/"+name)
	// By default the relay committed the rules the agent prepared.
	if !strings.Contains(logs, `"committed_by":"plugin"`) {
		t.Fatalf("the rules were not committed by the plugin process:\n%s", logs)
	}
	// With what the plugin process spent, as it measured itself.
	if m := regexp.MustCompile(`"plugin_cpu":"([^"]+)"`).FindStringSubmatch(logs); m == nil {
		t.Fatalf("no plugin_cpu in the agent's line:\n%s", logs)
	} else if d, err := time.ParseDuration(m[1]); err != nil || d <= 0 {
		t.Fatalf("plugin_cpu %q (%v), want a positive duration", m[1], err)
	}

	t.Run("pod-from-agent-cache", func(t *testing.T) {
		// The pod comes from the agent's informer, with no API request:
		// its ADD served from the record the agent prepared (it has since
		// its start, from the CNI config file it wrote), or, if the ADD
		// came first, looked up in its cache. A UID mismatch goes to the
		// API.
		count := func(source string) int {
			return h.metricCount(t, `istio_cni_plugin_pod_lookups_total{source="`+source+`"}`)
		}
		name := "from-cache"
		k8sPod, err := createPod(t, testenv.PodSpec{Namespace: testNS, Name: name, Sidecar: true})
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
		served := func() int { return h.metricCount(t, `istio_cni_plugin_prepared_adds_total{result="ok"}`) }
		cache0, api0, served0 := count("cache"), count("api"), served()
		p, err := testenv.NewPod(testNS, name, string(k8sPod.UID), "cfromcache")
		if err != nil {
			t.Fatal(err)
		}
		defer p.Close()
		if _, err := cni.AddNetworkList(context.Background(), list, p.RT); err != nil {
			t.Fatalf("ADD through the agent: %v", err)
		}
		defer func() { _ = cni.DelNetworkList(context.Background(), list, p.RT) }()
		expectRedirect(t, p, "tcp4", "0.0.0.0:15001", ap(testenv.RemoteV4+":80"), func() (net.Conn, error) {
			return testenv.Dial(p, "tcp4", testenv.RemoteV4+":80")
		})
		// The relay tells the agent of an ADD it served from a record
		// without waiting for it.
		deadline = time.Now().Add(10 * time.Second)
		for count("cache")+served() == cache0+served0 && time.Now().Before(deadline) {
			time.Sleep(20 * time.Millisecond) // polling an outside process
		}
		cache1 := count("cache")
		if a, s := count("api"), served(); cache1+s != cache0+served0+1 || a != api0 {
			t.Fatalf("pod lookups cache %d->%d, api %d->%d, ADDs from records %d->%d; want one from the cache or a record and none from the API",
				cache0, cache1, api0, a, served0, s)
		}

		// A sandbox for another pod of the same name (another UID) is not
		// answered from the cache.
		q, err := testenv.NewPod(testNS, name, "00000000-0000-0000-0000-000000000000", "cfromcache2")
		if err != nil {
			t.Fatal(err)
		}
		defer q.Close()
		if _, err := cni.AddNetworkList(context.Background(), list, q.RT); err != nil {
			t.Fatalf("ADD for a stale UID: %v", err)
		}
		defer func() { _ = cni.DelNetworkList(context.Background(), list, q.RT) }()
		if c, a := count("cache"), count("api"); c != cache1 || a != api0+1 {
			t.Fatalf("pod lookups cache %d->%d, api %d->%d; a UID mismatch must be read from the API", cache1, c, api0, a)
		}
	})

	t.Run("status-fails-only-when-add-would", func(t *testing.T) {
		status := func() map[string]any {
			res, _ := execPlugin(t, "STATUS", "", "", []byte(`{"cniVersion":"1.1.0","name":"k8s-pod-network","type":"istio-cni","cni_agent_run_dir":"`+h.RunDir+`"}`))
			return res
		}
		if res := status(); res != nil {
			t.Fatalf("STATUS with a ready agent: %v", res)
		}
		// The primary config disappears: the agent is not ready, but it
		// still serves an ADD, so STATUS succeeds.
		if err := os.Rename(filepath.Join(h.NetDir, "10-ptp.conflist"), filepath.Join(h.NetDir, "10-ptp.bak")); err != nil {
			t.Fatal(err)
		}
		h.waitReadyz(503, 10*time.Second)
		if res := status(); res != nil {
			t.Fatalf("STATUS with an unready agent that serves ADD: %v", res)
		}
		// A dead agent (its sockets left behind): the fallback serves ADD.
		h.Kill()
		if res := status(); res != nil {
			t.Fatalf("STATUS with a dead agent and the fallback in place: %v", res)
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
