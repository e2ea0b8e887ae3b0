package soak

import (
	"context"
	"encoding/json"
	"fmt"
	"net/http"
	"os"
	"path/filepath"
	"reflect"
	"strconv"
	"strings"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/istio-cni-go/istio-cni/internal/podcache"
	"github.com/istio-cni-go/istio-cni/internal/podinfo"
	"github.com/istio-cni-go/istio-cni/internal/testenv"
)

// The figures: the agent of a node with 250 pods, in a cluster
// of 5,000, stays within 40 MB resident.
const (
	memClusterPods = 5000
	memNodePods    = 250
	memRSSLimitKB  = 40 * 1024
	// memChurnSlackKB is what churn may add: the heap's goal moves with
	// what the last cycle left for the collector, but pods gone must not
	// stay behind.
	memChurnSlackKB = 3 * 1024
	// memNode is the test's node: the soak's pods are on another, and
	// neither agent sees the other's.
	memNode = "node-memory"
)

// TestAgentMemory runs the real agent on a node holding 250 of the
// cluster's 5,000 Istio-injected pods and checks what an operator sees:
// its pod cache holds exactly the node's pods, trimmed, and its resident
// memory stays within the target, also after pods on the node have been
// replaced several times.
func TestAgentMemory(t *testing.T) {
	ctx := context.Background()
	began := time.Now()
	env, err := testenv.NewPodSet(ctx, cluster, "mem", memNode, memClusterPods, memNodePods)
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("%d pods applied (%d on the node) in %s", memClusterPods, memNodePods, time.Since(began).Round(100*time.Millisecond))

	h, err := testenv.NewAgentHost(ctx, t.TempDir(), cluster, relayBin)
	if err != nil {
		t.Fatal(err)
	}
	primary := `{"cniVersion":"1.0.0","name":"k8s-pod-network","plugins":[{"type":"ptp","ipam":{"type":"host-local","subnet":"10.1.0.0/24"}}]}`
	if err := os.WriteFile(filepath.Join(h.NetDir, "10-ptp.conflist"), []byte(primary+"\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	// A pass a second instead of a minute: what each pass leaves for the
	// collector shows within the test.
	if err := h.Start(agentBin, "--kubernetes-node-name", memNode, "--repair-host-proc", "/proc", "--repair-repair-pods",
		"--resync-interval", "1s"); err != nil {
		t.Fatal(err)
	}
	defer func() { _, _ = h.Stop(20 * time.Second) }()
	if err := h.WaitReady(30 * time.Second); err != nil {
		t.Fatal(err)
	}
	sock := testenv.NewSockClient(filepath.Join(h.RunDir, podinfo.AgentSocketName))
	defer sock.Close()
	if err := env.WaitServed(sock, 30*time.Second); err != nil {
		t.Fatal(err)
	}
	// Exactly the node's pods: every pod of the cluster asked for.
	if held, err := env.Held(sock); err != nil {
		t.Fatal(err)
	} else if len(held) != memNodePods {
		t.Fatalf("the agent's cache holds %d of the cluster's pods, want the node's %d", len(held), memNodePods)
	}
	checkTrimmed(t, sock, env.OnNode()[0])

	synced, err := testenv.StableRSS(h.Pid(), 30*time.Second)
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("agent RSS with its cache synced: %.1f MB (target <= %d MB)", float64(synced)/1024, memRSSLimitKB/1024)
	if synced > memRSSLimitKB {
		t.Errorf("agent RSS %.1f MB with %d pods on its node and %d in the cluster, want <= %d MB\n%s",
			float64(synced)/1024, memNodePods, memClusterPods, memRSSLimitKB/1024, testenv.MemoryBreakdown(h))
	}

	// Not only between passes: the peak over three install passes.
	peak, err := peakOverPasses(h, 3)
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("agent RSS peak over 3 install passes: %.1f MB", float64(peak)/1024)
	if peak > memRSSLimitKB {
		t.Errorf("agent RSS peaked at %.1f MB over 3 install passes, want <= %d MB\n%s", float64(peak)/1024, memRSSLimitKB/1024, testenv.MemoryBreakdown(h))
	}

	// Churn: 200 of the node's pods replaced by new ones, three times.
	after := synced
	for cycle := 0; cycle < 3; cycle++ {
		if err := env.Churn(ctx, 200); err != nil {
			t.Fatal(err)
		}
		if err := env.WaitServed(sock, 30*time.Second); err != nil {
			t.Fatal(err)
		}
		if after, err = testenv.StableRSS(h.Pid(), 30*time.Second); err != nil {
			t.Fatal(err)
		}
		t.Logf("agent RSS after churn cycle %d: %.1f MB", cycle+1, float64(after)/1024)
	}
	if held, err := env.Held(sock); err != nil {
		t.Fatal(err)
	} else if len(held) != memNodePods {
		t.Fatalf("after churn the agent's cache holds %d pods, want %d", len(held), memNodePods)
	}
	if after > synced+memChurnSlackKB || after > memRSSLimitKB {
		t.Errorf("agent RSS grew with churn: %.1f MB synced, %.1f MB after 600 pods replaced (limit %d MB, slack %d MB)\n%s",
			float64(synced)/1024, float64(after)/1024, memRSSLimitKB/1024, memChurnSlackKB/1024, testenv.MemoryBreakdown(h))
	}
	t.Logf("total %s", time.Since(began).Round(100*time.Millisecond))
}

// checkTrimmed reads want back through the agent socket: what pod
// selection decodes of it is what it decodes of the full pod, and what
// it does not read is not kept.
func checkTrimmed(t *testing.T, sock *testenv.SockClient, want *corev1.Pod) {
	t.Helper()
	full, err := cluster.Client.CoreV1().Pods(want.Namespace).Get(context.Background(), want.Name, metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	if len(full.ManagedFields) == 0 || len(full.Spec.Volumes) == 0 {
		t.Fatalf("the API server's pod has no managed fields or volumes: not a realistic pod")
	}
	code, body, err := sock.Pod(want.Namespace, want.Name)
	if err != nil || code != http.StatusOK {
		t.Fatalf("reading %s through the agent socket: %d %v", want.Namespace+"/"+want.Name, code, err)
	}
	got, err := podinfo.DecodeJSON(body)
	if err != nil {
		t.Fatal(err)
	}
	if w := podcache.PodFromCore(full); !reflect.DeepEqual(got, w) {
		t.Errorf("the agent serves other facts than the API server's pod gives:\n got %+v\nwant %+v", got, w)
	}
	var raw struct {
		Metadata map[string]json.RawMessage `json:"metadata"`
		Spec     struct {
			Volumes        json.RawMessage `json:"volumes"`
			InitContainers []struct {
				Env []struct {
					ValueFrom json.RawMessage `json:"valueFrom"`
				} `json:"env"`
				VolumeMounts json.RawMessage `json:"volumeMounts"`
				Resources    json.RawMessage `json:"resources"`
			} `json:"initContainers"`
		} `json:"spec"`
		Status struct {
			Conditions            json.RawMessage `json:"conditions"`
			ContainerStatuses     json.RawMessage `json:"containerStatuses"`
			InitContainerStatuses []struct {
				ImageID string `json:"imageID"`
			} `json:"initContainerStatuses"`
		} `json:"status"`
	}
	if err := json.Unmarshal(body, &raw); err != nil {
		t.Fatal(err)
	}
	var kept []string
	for _, k := range []string{"managedFields", "ownerReferences"} {
		if raw.Metadata[k] != nil {
			kept = append(kept, "metadata."+k)
		}
	}
	if raw.Spec.Volumes != nil {
		kept = append(kept, "spec.volumes")
	}
	for _, c := range raw.Spec.InitContainers {
		if c.VolumeMounts != nil || len(c.Resources) > 2 {
			kept = append(kept, "spec.initContainers[].volumeMounts/resources")
			break
		}
		for _, e := range c.Env {
			if e.ValueFrom != nil {
				kept = append(kept, "spec.initContainers[].env[].valueFrom")
			}
		}
	}
	if raw.Status.Conditions != nil || raw.Status.ContainerStatuses != nil {
		kept = append(kept, "status.conditions/containerStatuses")
	}
	for _, st := range raw.Status.InitContainerStatuses {
		// Repair reads how they ended, no more.
		if st.ImageID != "" {
			kept = append(kept, "status.initContainerStatuses[].imageID")
			break
		}
	}
	if len(kept) > 0 {
		t.Errorf("the agent's cache keeps what pod selection does not read: %s (%d bytes served)", strings.Join(kept, ", "), len(body))
	}
}

// peakOverPasses samples the agent's RSS until n more periodic install
// passes have run, and returns the highest reading.
func peakOverPasses(h *testenv.AgentHost, n int) (int, error) {
	passes := func() (int, error) {
		lines, err := h.Metrics(`istio_cni_config_resyncs_total{reason="periodic"}`)
		if err != nil || len(lines) == 0 {
			return 0, err
		}
		v, err := strconv.ParseFloat(lines[0][strings.LastIndex(lines[0], " ")+1:], 64)
		return int(v), err
	}
	start, err := passes()
	if err != nil {
		return 0, err
	}
	peak := 0
	for deadline := time.Now().Add(30 * time.Second); ; {
		kb, err := testenv.RSSKB(h.Pid())
		if err != nil {
			return 0, err
		}
		peak = max(peak, kb)
		if done, err := passes(); err != nil {
			return 0, err
		} else if done >= start+n {
			return peak, nil
		}
		if time.Now().After(deadline) {
			return 0, fmt.Errorf("fewer than %d install passes in 30s", n)
		}
		time.Sleep(20 * time.Millisecond) // sampling between passes
	}
}
