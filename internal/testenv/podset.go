package testenv

import (
	"context"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/url"
	"os"
	"strconv"
	"strings"
	"time"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/rest"
)

// PodSet is the cluster's pods for the memory tests, by namespace and
// name, and which are on the agent's node.
type PodSet struct {
	// Node is the agent's node.
	Node   string
	cs     kubernetes.Interface
	prefix string
	nss    []string
	pods   []*corev1.Pod
	// gone are the pods the last churn deleted.
	gone []*corev1.Pod
	// ours are the pods on Node, by namespace/name.
	ours map[string]bool
	seq  int
}

func podKey(p *corev1.Pod) string { return p.Namespace + "/" + p.Name }

// NewPodSet applies total Istio-injected pods over ten namespaces, one in
// total/onNode of them on node (the agent's), the rest spread over other
// nodes, each with the status its kubelet would report.
func NewPodSet(ctx context.Context, c *Cluster, prefix, node string, total, onNode int) (*PodSet, error) {
	// Protobuf, as controllers talk: thousands of creates cost the API
	// server less to decode.
	rc := rest.CopyConfig(c.Config)
	rc.ContentType = "application/vnd.kubernetes.protobuf"
	cs, err := kubernetes.NewForConfig(rc)
	if err != nil {
		return nil, err
	}
	e := &PodSet{Node: node, cs: cs, prefix: prefix, ours: map[string]bool{}}
	for i := 0; i < 10; i++ {
		ns := fmt.Sprintf("%s-%d", prefix, i)
		if err := EnsureNamespace(ctx, c.Client, ns); err != nil {
			return nil, err
		}
		e.nss = append(e.nss, ns)
	}
	every := total / onNode
	for i := 0; i < total; i++ {
		on := fmt.Sprintf("node-%d", i%97)
		if i%every == 0 {
			on = node
		}
		e.add(on)
	}
	if err := e.apply(ctx, e.pods); err != nil {
		return nil, err
	}
	return e, nil
}

// add makes (but does not apply) one more pod on node.
func (e *PodSet) add(node string) *corev1.Pod {
	i := e.seq
	e.seq++
	p := InjectedPod(e.nss[i%len(e.nss)], fmt.Sprintf("%s-%d", e.prefix, i), node, i)
	e.pods = append(e.pods, p)
	if node == e.Node {
		e.ours[podKey(p)] = true
	}
	return p
}

// apply applies the node's pods with their status, as their kubelet
// would report it; the other nodes' pods are only created, which is
// quicker and all a node-scoped agent could see of them anyway: nothing.
func (e *PodSet) apply(ctx context.Context, pods []*corev1.Pod) error {
	return ApplyPods(ctx, e.cs, pods, func(i int) *corev1.PodStatus {
		if pods[i].Spec.NodeName != e.Node {
			return nil
		}
		s := InjectedPodStatus(i)
		return &s
	}, 8)
}

func (e *PodSet) OnNode() []*corev1.Pod {
	var out []*corev1.Pod
	for _, p := range e.pods {
		if e.ours[podKey(p)] {
			out = append(out, p)
		}
	}
	return out
}

// Churn deletes n of the node's pods and applies n new ones there.
func (e *PodSet) Churn(ctx context.Context, n int) error {
	gone := e.OnNode()[:n]
	var fresh []*corev1.Pod
	for range n {
		fresh = append(fresh, e.add(e.Node))
	}
	zero := int64(0)
	for _, p := range gone {
		// No kubelet here to finish a graceful deletion.
		if err := e.cs.CoreV1().Pods(p.Namespace).Delete(ctx, p.Name, metav1.DeleteOptions{GracePeriodSeconds: &zero}); err != nil {
			return err
		}
		delete(e.ours, podKey(p))
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

// WaitServed polls the agent socket until every pod on the node is
// served and none of those the last churn deleted is.
func (e *PodSet) WaitServed(sock *SockClient, timeout time.Duration) error {
	deadline := time.Now().Add(timeout)
	for {
		wrong := ""
		for _, p := range e.OnNode() {
			if code, _, err := sock.Pod(p.Namespace, p.Name); err != nil {
				return err
			} else if code != http.StatusOK {
				wrong = podKey(p) + " is not served"
				break
			}
		}
		for _, p := range e.gone {
			if code, _, err := sock.Pod(p.Namespace, p.Name); err != nil {
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

// Held asks the agent for every pod in the cluster and returns those it
// serves; it fails if it serves one that is not on the node.
func (e *PodSet) Held(sock *SockClient) ([]string, error) {
	var out []string
	for _, p := range e.pods {
		code, _, err := sock.Pod(p.Namespace, p.Name)
		if err != nil {
			return nil, err
		}
		if code == http.StatusOK {
			if !e.ours[podKey(p)] {
				return nil, fmt.Errorf("the agent serves %s, which is on %s", podKey(p), p.Spec.NodeName)
			}
			out = append(out, podKey(p))
		}
	}
	return out, nil
}

// SockClient asks the agent socket for pods, keeping the raw answer.
type SockClient struct{ c *http.Client }

// NewSockClient talks to the agent socket at path.
func NewSockClient(path string) *SockClient {
	return &SockClient{c: &http.Client{Timeout: 5 * time.Second, Transport: &http.Transport{
		DialContext: func(ctx context.Context, _, _ string) (net.Conn, error) {
			var d net.Dialer
			return d.DialContext(ctx, "unix", path)
		}}}}
}

// Pod is the agent's answer for ns/name: status code and body.
func (s *SockClient) Pod(ns, name string) (int, []byte, error) {
	resp, err := s.c.Get("http://agent/pod?" + url.Values{"namespace": {ns}, "name": {name}}.Encode())
	if err != nil {
		return 0, nil, err
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	return resp.StatusCode, b, err
}

// Close drops the client's connections.
func (s *SockClient) Close() { s.c.CloseIdleConnections() }

// RSSKB is the process's resident set (VmRSS), in KiB.
func RSSKB(pid int) (int, error) {
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

// StableRSS polls the process's resident set until it has moved by less
// than 1% over the last two seconds (the collector has run and its
// scavenger has returned what it returns), and returns the last reading.
func StableRSS(pid int, timeout time.Duration) (int, error) {
	const window = 10 // readings, 200 ms apart
	var last []int
	deadline := time.Now().Add(timeout)
	for {
		kb, err := RSSKB(pid)
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

// MemoryBreakdown is where an agent's memory is: the binary's
// pages against anonymous memory, and the Go heap's share of the latter.
func MemoryBreakdown(h *AgentHost) string {
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
