package soak

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/url"
	"os"
	"path/filepath"
	"reflect"
	"strconv"
	"strings"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/rest"

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
)

// TestAgentMemory runs the real agent on a node holding 250 of the
// cluster's 5,000 Istio-injected pods and checks what an operator sees:
// its pod cache holds exactly the node's pods, trimmed, and its resident
// memory stays within the target, also after pods on the node have been
// replaced several times.
func TestAgentMemory(t *testing.T) {
	ctx := context.Background()
	began := time.Now()
	env, err := newMemEnv(ctx, "mem", memClusterPods, memNodePods)
	if err != nil {
		t.Fatal(err)
	}
	defer env.cleanup()
	t.Logf("%d pods applied (%d on the node) in %s", memClusterPods, memNodePods, time.Since(began).Round(100*time.Millisecond))

	h, err := testenv.NewAgentHost(ctx, t.TempDir(), cluster, relayBin)
	if err != nil {
		t.Fatal(err)
	}
	primary := `{"cniVersion":"1.0.0","name":"k8s-pod-network","plugins":[{"type":"ptp","ipam":{"type":"host-local","subnet":"10.1.0.0/24"}}]}`
	if err := os.WriteFile(filepath.Join(h.NetDir, "10-ptp.conflist"), []byte(primary+"\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	if err := h.Start(agentBin, "--kubernetes-node-name", testenv.NodeName, "--repair-host-proc", "/proc", "--repair-repair-pods"); err != nil {
		t.Fatal(err)
	}
	defer func() { _, _ = h.Stop(20 * time.Second) }()
	if err := h.WaitReady(30 * time.Second); err != nil {
		t.Fatal(err)
	}
	sock := newSockClient(filepath.Join(h.RunDir, podinfo.AgentSocketName))
	defer sock.close()
	if err := env.waitCacheIs(sock, 30*time.Second); err != nil {
		t.Fatal(err)
	}
	// Exactly the node's pods: every pod of the cluster asked for.
	if held, err := env.held(sock); err != nil {
		t.Fatal(err)
	} else if len(held) != memNodePods {
		t.Fatalf("the agent's cache holds %d of the cluster's pods, want the node's %d", len(held), memNodePods)
	}
	checkTrimmed(t, sock, env.onNode()[0])

	synced, err := stableRSS(h.Pid(), 30*time.Second)
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("agent RSS with its cache synced: %.1f MB (target <= %d MB)", float64(synced)/1024, memRSSLimitKB/1024)
	if synced > memRSSLimitKB {
		t.Errorf("agent RSS %.1f MB with %d pods on its node and %d in the cluster, want <= %d MB\n%s",
			float64(synced)/1024, memNodePods, memClusterPods, memRSSLimitKB/1024, memoryBreakdown(h))
	}

	// Churn: 200 of the node's pods replaced by new ones, three times.
	after := synced
	for cycle := 0; cycle < 3; cycle++ {
		if err := env.churn(ctx, 200); err != nil {
			t.Fatal(err)
		}
		if err := env.waitCacheIs(sock, 30*time.Second); err != nil {
			t.Fatal(err)
		}
		if after, err = stableRSS(h.Pid(), 30*time.Second); err != nil {
			t.Fatal(err)
		}
		t.Logf("agent RSS after churn cycle %d: %.1f MB", cycle+1, float64(after)/1024)
	}
	if held, err := env.held(sock); err != nil {
		t.Fatal(err)
	} else if len(held) != memNodePods {
		t.Fatalf("after churn the agent's cache holds %d pods, want %d", len(held), memNodePods)
	}
	if after > synced+memChurnSlackKB || after > memRSSLimitKB {
		t.Errorf("agent RSS grew with churn: %.1f MB synced, %.1f MB after 600 pods replaced (limit %d MB, slack %d MB)\n%s",
			float64(synced)/1024, float64(after)/1024, memRSSLimitKB/1024, memChurnSlackKB/1024, memoryBreakdown(h))
	}
	t.Logf("total %s", time.Since(began).Round(100*time.Millisecond))
}

// memEnv is the cluster's pods for the memory test, by namespace and
// name, and which are on the agent's node.
type memEnv struct {
	cs     kubernetes.Interface
	prefix string
	nss    []string
	pods   []*corev1.Pod
	// gone are the pods the last churn deleted.
	gone []*corev1.Pod
	node map[string]bool
	seq  int
}

func podKey(p *corev1.Pod) string { return p.Namespace + "/" + p.Name }

// newMemEnv applies total Istio-injected pods over ten namespaces, one in
// total/onNode of them on the agent's node, the rest spread over other
// nodes, each with the status its kubelet would report.
func newMemEnv(ctx context.Context, prefix string, total, onNode int) (*memEnv, error) {
	// Protobuf, as controllers talk: thousands of creates cost the API
	// server less to decode.
	rc := rest.CopyConfig(cluster.Config)
	rc.ContentType = "application/vnd.kubernetes.protobuf"
	cs, err := kubernetes.NewForConfig(rc)
	if err != nil {
		return nil, err
	}
	e := &memEnv{cs: cs, prefix: prefix, node: map[string]bool{}}
	for i := 0; i < 10; i++ {
		ns := fmt.Sprintf("%s-%d", prefix, i)
		if err := testenv.EnsureNamespace(ctx, cluster.Client, ns); err != nil {
			return nil, err
		}
		e.nss = append(e.nss, ns)
	}
	every := total / onNode
	for i := 0; i < total; i++ {
		node := fmt.Sprintf("node-%d", i%97)
		if i%every == 0 {
			node = testenv.NodeName
		}
		e.add(node)
	}
	return e, e.apply(ctx, e.pods)
}

// add makes (but does not apply) one more pod on node.
func (e *memEnv) add(node string) *corev1.Pod {
	i := e.seq
	e.seq++
	p := testenv.InjectedPod(e.nss[i%len(e.nss)], fmt.Sprintf("%s-%d", e.prefix, i), node, i)
	e.pods = append(e.pods, p)
	if node == testenv.NodeName {
		e.node[podKey(p)] = true
	}
	return p
}

// apply applies the node's pods with their status, as their kubelet
// would report it; the other nodes' pods are only created, which is
// quicker and all a node-scoped agent could see of them anyway: nothing.
func (e *memEnv) apply(ctx context.Context, pods []*corev1.Pod) error {
	return testenv.ApplyPods(ctx, e.cs, pods, func(i int) *corev1.PodStatus {
		if pods[i].Spec.NodeName != testenv.NodeName {
			return nil
		}
		s := testenv.InjectedPodStatus(i)
		return &s
	}, 8)
}

func (e *memEnv) onNode() []*corev1.Pod {
	var out []*corev1.Pod
	for _, p := range e.pods {
		if e.node[podKey(p)] {
			out = append(out, p)
		}
	}
	return out
}

// churn deletes n of the node's pods and applies n new ones there.
func (e *memEnv) churn(ctx context.Context, n int) error {
	gone := e.onNode()[:n]
	var fresh []*corev1.Pod
	for range n {
		fresh = append(fresh, e.add(testenv.NodeName))
	}
	zero := int64(0)
	for _, p := range gone {
		// No kubelet here to finish a graceful deletion.
		if err := e.cs.CoreV1().Pods(p.Namespace).Delete(ctx, p.Name, metav1.DeleteOptions{GracePeriodSeconds: &zero}); err != nil {
			return err
		}
		delete(e.node, podKey(p))
	}
	kept := e.pods[:0]
	for _, p := range e.pods {
		if !slicesContain(gone, p) {
			kept = append(kept, p)
		}
	}
	e.pods, e.gone = kept, gone
	return e.apply(ctx, fresh)
}

func slicesContain(ps []*corev1.Pod, p *corev1.Pod) bool {
	for _, q := range ps {
		if q == p {
			return true
		}
	}
	return false
}

// cleanup deletes the node's pods, so that a soak run after the test in
// this cluster has its agent cache none of them.
func (e *memEnv) cleanup() {
	zero := int64(0)
	for _, ns := range e.nss {
		_ = e.cs.CoreV1().Pods(ns).DeleteCollection(context.Background(), metav1.DeleteOptions{GracePeriodSeconds: &zero}, metav1.ListOptions{})
	}
}

// waitCacheIs polls the agent socket until every pod on the node is
// served and none of those the last churn deleted is.
func (e *memEnv) waitCacheIs(sock *sockClient, timeout time.Duration) error {
	deadline := time.Now().Add(timeout)
	for {
		wrong := ""
		for _, p := range e.onNode() {
			if code, _, err := sock.pod(p.Namespace, p.Name); err != nil {
				return err
			} else if code != http.StatusOK {
				wrong = podKey(p) + " is not served"
				break
			}
		}
		for _, p := range e.gone {
			if code, _, err := sock.pod(p.Namespace, p.Name); err != nil {
				return err
			} else if code != http.StatusNotFound {
				wrong = podKey(p) + ", deleted, is still served"
				break
			}
		}
		if wrong == "" {
			return nil
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("after %s, the agent's cache is not the node's pods: %s", timeout, wrong)
		}
		time.Sleep(50 * time.Millisecond) // the informer's watch delivers shortly
	}
}

// held asks the agent for every pod in the cluster and returns those it
// serves; it fails if it serves one that is not on the node.
func (e *memEnv) held(sock *sockClient) ([]string, error) {
	var out []string
	for _, p := range e.pods {
		code, _, err := sock.pod(p.Namespace, p.Name)
		if err != nil {
			return nil, err
		}
		if code == http.StatusOK {
			if !e.node[podKey(p)] {
				return nil, fmt.Errorf("the agent serves %s, which is on %s", podKey(p), p.Spec.NodeName)
			}
			out = append(out, podKey(p))
		}
	}
	return out, nil
}

// checkTrimmed reads want back through the agent socket: what pod
// selection decodes of it is what it decodes of the full pod, and what
// it does not read is not kept.
func checkTrimmed(t *testing.T, sock *sockClient, want *corev1.Pod) {
	t.Helper()
	full, err := cluster.Client.CoreV1().Pods(want.Namespace).Get(context.Background(), want.Name, metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	if len(full.ManagedFields) == 0 || len(full.Spec.Volumes) == 0 {
		t.Fatalf("the API server's pod has no managed fields or volumes: not a realistic pod")
	}
	code, body, err := sock.pod(want.Namespace, want.Name)
	if err != nil || code != http.StatusOK {
		t.Fatalf("reading %s through the agent socket: %d %v", podKey(want), code, err)
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

// sockClient asks the agent socket for pods, keeping the raw answer.
type sockClient struct{ c *http.Client }

func newSockClient(path string) *sockClient {
	return &sockClient{c: &http.Client{Timeout: 5 * time.Second, Transport: &http.Transport{
		DialContext: func(ctx context.Context, _, _ string) (net.Conn, error) {
			var d net.Dialer
			return d.DialContext(ctx, "unix", path)
		}}}}
}

func (s *sockClient) pod(ns, name string) (int, []byte, error) {
	resp, err := s.c.Get("http://agent/pod?" + url.Values{"namespace": {ns}, "name": {name}}.Encode())
	if err != nil {
		return 0, nil, err
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	return resp.StatusCode, b, err
}

func (s *sockClient) close() { s.c.CloseIdleConnections() }

// rssKB is the process's resident set (VmRSS), in KiB.
func rssKB(pid int) (int, error) {
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/status", pid))
	if err != nil {
		return 0, err
	}
	for _, l := range strings.Split(string(b), "\n") {
		if f := strings.Fields(l); len(f) >= 2 && f[0] == "VmRSS:" {
			return strconv.Atoi(f[1])
		}
	}
	return 0, fmt.Errorf("no VmRSS in /proc/%d/status", pid)
}

// stableRSS polls the process's resident set until it has moved by less
// than 1% over the last two seconds (the collector has run and its
// scavenger has returned what it returns), and returns the last reading.
func stableRSS(pid int, timeout time.Duration) (int, error) {
	const window = 10 // readings, 200 ms apart
	var last []int
	deadline := time.Now().Add(timeout)
	for {
		kb, err := rssKB(pid)
		if err != nil {
			return 0, err
		}
		last = append(last, kb)
		if len(last) > window {
			last = last[1:]
			lo, hi := last[0], last[0]
			for _, v := range last {
				lo, hi = min(lo, v), max(hi, v)
			}
			if hi-lo <= hi/100 {
				return kb, nil
			}
		}
		if time.Now().After(deadline) {
			return kb, fmt.Errorf("RSS not stable after %s: last readings %v KiB", timeout, last)
		}
		time.Sleep(200 * time.Millisecond) // sampling the process's memory
	}
}

// memoryBreakdown is where a failing agent's memory is: the binary's
// pages against anonymous memory, and the Go heap's share of the latter.
func memoryBreakdown(h *testenv.AgentHost) string {
	var out []string
	if b, err := os.ReadFile(fmt.Sprintf("/proc/%d/smaps_rollup", h.Pid())); err == nil {
		for _, l := range strings.Split(string(b), "\n") {
			if strings.HasPrefix(l, "Rss:") || strings.HasPrefix(l, "Pss_Anon:") || strings.HasPrefix(l, "Pss_File:") {
				out = append(out, strings.Join(strings.Fields(l), " "))
			}
		}
	}
	for _, m := range []string{"go_memstats_heap_inuse_bytes ", "go_memstats_heap_alloc_bytes ", "go_memstats_stack_inuse_bytes ",
		"go_memstats_gc_sys_bytes ", "go_memstats_heap_idle_bytes ", "go_memstats_heap_released_bytes "} {
		if l, err := h.Metrics(m); err == nil && len(l) > 0 {
			out = append(out, l[0])
		}
	}
	return strings.Join(out, "\n")
}
