package e2e

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/containernetworking/cni/libcni"

	"github.com/istio-cni-go/istio-cni/internal/testenv"
)

// pluginInput is the config a runtime gives istio-cni for pod: the node's
// installed entry, with the primary plugin's result as prevResult.
func (n *agentNode) pluginInput(pod *testenv.Pod) []byte {
	n.t.Helper()
	l := n.list()
	var entry map[string]any
	if err := json.Unmarshal(l.Plugins[len(l.Plugins)-1].Bytes, &entry); err != nil {
		n.t.Fatal(err)
	}
	primary, err := n.cni.AddNetworkList(context.Background(), mustList(n.t, l.Bytes, 1), pod.RT)
	if err != nil {
		n.t.Fatalf("primary ADD: %v", err)
	}
	var prev bytes.Buffer
	if err := primary.PrintTo(&prev); err != nil {
		n.t.Fatal(err)
	}
	entry["cniVersion"], entry["name"] = l.CNIVersion, l.Name
	entry["prevResult"] = json.RawMessage(prev.Bytes())
	b, err := json.Marshal(entry)
	if err != nil {
		n.t.Fatal(err)
	}
	return b
}

// runRelay runs the installed istio-cni as a runtime does and returns its
// CNI error, if any.
func (n *agentNode) runRelay(command string, pod *testenv.Pod, stdin []byte) error {
	cmd := exec.Command(filepath.Join(n.BinDir, "istio-cni"))
	cmd.Env = []string{"CNI_COMMAND=" + command, "CNI_CONTAINERID=" + pod.ContainerID, "CNI_NETNS=" + pod.NetNS.Path(),
		"CNI_IFNAME=eth0", "CNI_PATH=" + n.BinDir,
		"CNI_ARGS=IgnoreUnknown=1;K8S_POD_NAMESPACE=" + pod.Namespace + ";K8S_POD_NAME=" + pod.Name + ";K8S_POD_UID=" + pod.UID}
	cmd.Stdin = bytes.NewReader(stdin)
	var out bytes.Buffer
	cmd.Stdout = &out
	if err := cmd.Run(); err != nil {
		return fmt.Errorf("%s: %w: %s", command, err, out.String())
	}
	return nil
}

// mustList is the list of the first k plugins of a conflist.
func mustList(t *testing.T, conf []byte, k int) *libcni.NetworkConfigList {
	t.Helper()
	var m map[string]any
	if err := json.Unmarshal(conf, &m); err != nil {
		t.Fatal(err)
	}
	m["plugins"] = m["plugins"].([]any)[:k]
	b, _ := json.Marshal(m)
	l, err := libcni.ConfListFromBytes(b)
	if err != nil {
		t.Fatal(err)
	}
	return l
}

// TestHardeningConcurrentADDs: 100 ADDs for one pod at once, all handed to
// the agent: each must succeed (the agent serialises them per network
// namespace), and the rules end as one ADD leaves them.
func TestHardeningConcurrentADDs(t *testing.T) {
	ensureDaemonSet(t, false)
	n := startAgentNode(t, "10.241.6.0/24")
	pod := n.sandbox(testenv.PodSpec{Sidecar: true})
	in := n.pluginInput(pod)
	before := n.served("ADD")
	const count = 100
	errs := make(chan error, count)
	var start, wg sync.WaitGroup
	start.Add(1)
	for i := 0; i < count; i++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			start.Wait()
			errs <- n.runRelay("ADD", pod, in)
		}()
	}
	start.Done()
	wg.Wait()
	close(errs)
	failed := 0
	for err := range errs {
		if err != nil {
			failed++
			if failed <= 3 {
				t.Log(err)
			}
		}
	}
	if failed > 0 {
		t.Fatalf("%d of %d concurrent ADDs for one pod failed", failed, count)
	}
	if got := n.servedReaching("ADD", before+count); got != before+count {
		t.Fatalf("the agent served %d of the ADDs, want %d", got-before, count)
	}
	if err := n.runRelay("CHECK", pod, in); err != nil {
		t.Fatalf("CHECK after the concurrent ADDs: %v", err)
	}
	if rules := rulesIn(t, pod); strings.Count(rules, "-A ISTIO_OUTPUT -j ISTIO_REDIRECT") != 1 {
		t.Fatalf("rules not as one ADD leaves them:\n%s", rules)
	}
}

// TestHardeningAgentServesPastConnectionLimit: more commands in a row than
// the CNI socket takes connections at once (128) all reach the agent:
// each connection gives its slot back. Nothing else would notice if they
// did not, since the relay then runs the fallback, which does the same
// work only slower (the agent's split once lost the slot's release, and
// only the bench saw it).
func TestHardeningAgentServesPastConnectionLimit(t *testing.T) {
	ensureDaemonSet(t, false)
	n := startAgentNode(t, "10.241.12.0/24")
	pod := n.sandbox(testenv.PodSpec{Sidecar: true})
	in := n.pluginInput(pod)
	before := n.served("ADD")
	const count = 200
	for i := 0; i < count; i++ {
		if err := n.runRelay("ADD", pod, in); err != nil {
			t.Fatalf("ADD %d: %v", i+1, err)
		}
	}
	if got := n.servedReaching("ADD", before+count); got != before+count {
		t.Fatalf("the agent served %d of %d ADDs in a row; the rest went through the fallback", got-before, count)
	}
}

// TestHardeningStartupScanRacesADD: at start-up the repair scan finds a
// pod without rules while ADDs for that pod arrive: neither fails.
func TestHardeningStartupScanRacesADD(t *testing.T) {
	ensureDaemonSet(t, false)
	h := ptpHost(t, "10.241.7.0/24")
	n := &agentNode{host: h}
	e := newEnv(t, nil)
	pod, ip := racedPod(t, e, testenv.PodSpec{Sidecar: true, InitNames: []string{"istio-validation"}})
	setPodIP(t, pod.Name, ip)
	raw, err := json.Marshal(map[string]any{"cniVersion": "1.0.0", "name": "k8s-pod-network", "type": "istio-cni",
		"cni_agent_run_dir": h.RunDir, "exclude_namespaces": []string{"kube-system"}, "pod_namespace": "istio-system",
		"prevResult": map[string]any{"cniVersion": "1.0.0", "ips": []map[string]any{{"address": ip + "/32"}}}})
	if err != nil {
		t.Fatal(err)
	}
	h.start("--kubernetes-node-name", testenv.NodeName, "--repair-repair-pods", "--repair-host-proc", "/proc")
	sock, relay := filepath.Join(h.RunDir, "cni.sock"), filepath.Join(h.BinDir, "istio-cni")
	deadline := time.Now().Add(20 * time.Second)
	// ADDs go to the agent once it listens and has installed the relay;
	// a relay it leaves runs the fallback, which needs the kubeconfig the
	// agent writes after the binaries (a runtime sees the plugin only once
	// the config entry, written last, is in place).
	kubeconfig := filepath.Join(h.RunDir, "istio-cni-kubeconfig")
	for {
		_, err1 := os.Stat(sock)
		_, err2 := os.Stat(relay)
		_, err3 := os.Stat(kubeconfig)
		if err1 == nil && err2 == nil && err3 == nil {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("after 20s: cni.sock %v, relay %v, kubeconfig %v", err1, err2, err3)
		}
		time.Sleep(5 * time.Millisecond) // polling an outside process
	}
	var failures []string
	for round := 0; round < 40 && !strings.Contains(h.LogText(), "repaired pod"); round++ {
		var wg sync.WaitGroup
		var mu sync.Mutex
		for i := 0; i < 10; i++ {
			wg.Add(1)
			go func() {
				defer wg.Done()
				if err := n.runRelay("ADD", pod, raw); err != nil {
					mu.Lock()
					failures = append(failures, err.Error())
					mu.Unlock()
				}
			}()
		}
		wg.Wait()
	}
	if len(failures) > 0 {
		t.Fatalf("%d ADDs failed while the start-up scan ran, e.g. %s", len(failures), failures[0])
	}
	if strings.Contains(h.LogText(), "repair failed") {
		t.Fatalf("repair failed:\n%s", h.LogText())
	}
}
