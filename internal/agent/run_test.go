package agent

import (
	"bytes"
	"context"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"runtime"
	"strconv"
	"strings"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes/fake"

	"github.com/istio-cni-go/istio-cni/internal/kubeclient/clientset"
	"github.com/istio-cni-go/istio-cni/internal/podinfo"
	"github.com/istio-cni-go/istio-cni/internal/prepared"
)

// goroutine is one entry of a full stack dump.
type goroutine struct {
	id, state, stack string
}

// goroutines lists every goroutine but the caller's.
func goroutines() map[string]goroutine {
	buf := make([]byte, 1<<20)
	for {
		n := runtime.Stack(buf, true)
		if n < len(buf) {
			buf = buf[:n]
			break
		}
		buf = make([]byte, 2*len(buf))
	}
	out := map[string]goroutine{}
	for i, g := range strings.Split(string(buf), "\n\n") {
		if i == 0 {
			continue // the caller's own
		}
		// "goroutine 7 [chan receive, 2 minutes]:"
		head, _, _ := strings.Cut(g, "\n")
		var id string
		var rest string
		if _, err := fmt.Sscanf(head, "goroutine %s [", &id); err != nil {
			continue
		}
		_, rest, _ = strings.Cut(head, "[")
		state, _, _ := strings.Cut(rest, ",")
		state = strings.TrimSuffix(strings.TrimSuffix(state, ":"), "]")
		out[id] = goroutine{id: id, state: state, stack: g}
	}
	return out
}

// partOfTheAgent: a goroutine of the agent's parts or of what they start
// (informers, the event broadcaster, HTTP servers, the file watcher), as
// opposed to the test's own and its HTTP client's.
func partOfTheAgent(stack string) bool {
	if strings.Contains(stack, ".Test") || strings.Contains(stack, "net/http.(*persistConn)") {
		return false
	}
	for _, s := range []string{"istio-cni-go/istio-cni/internal/", "k8s.io/client-go/", "k8s.io/apimachinery/",
		"net/http.(*Server)", "net/http.(*conn)", "fsnotify"} {
		if strings.Contains(stack, s) {
			return true
		}
	}
	return false
}

// TestRunWaitsForEveryPart: when the clean-up begins (and so when Run
// returns), no goroutine Run started is still waiting on anything: the HTTP servers, the sockets' servers, the
// pod cache's informer, the repair controller with its own informer,
// queue and event broadcaster, the DaemonSet watch and the file watcher
// have all ended. A goroutine that is still runnable may be on its way
// out after closing its done channel; one blocked (on a channel, a timer,
// I/O, a lock) was not waited for.
func TestRunWaitsForEveryPart(t *testing.T) {
	cfg := testNode(t)
	cfg.ReadinessPort, cfg.MonitoringPort = 1, 2 // bound to the loopback's port 0 below
	cfg.RepairEnabled = true
	cfg.Repair.RepairPods, cfg.Repair.LabelPods = false, true
	// Selectors of its own: repair runs an informer of its own too.
	cfg.Repair.LabelSelectors = "app=broken"
	cfg.NodeName = "n"
	cfg.DaemonSetName = "istio-cni-node"
	cfg.Loop.Install.Entry.PodNamespace = "istio-system"
	// Said in the run dir for the fallback.
	cfg.ForceIPTablesBinary = "legacy"
	if err := os.WriteFile(filepath.Join(cfg.Loop.Install.RunDir, prepared.VariantName), []byte("nft\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	broken := &corev1.Pod{ObjectMeta: metav1.ObjectMeta{Namespace: "ns", Name: "p", UID: "u1", Labels: map[string]string{"app": "broken"},
		Annotations: map[string]string{"sidecar.istio.io/status": "{}"}},
		Spec: corev1.PodSpec{NodeName: "n"},
		Status: corev1.PodStatus{InitContainerStatuses: []corev1.ContainerStatus{{Name: "istio-validation",
			State: corev1.ContainerState{Terminated: &corev1.ContainerStateTerminated{ExitCode: 126}}}}}}
	cs := fake.NewClientset(broken)

	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	before := goroutines()
	a := New(cfg, quiet)
	a.Clientset = clientset.Of(cs)
	var atCleanup map[string]goroutine
	a.stopped = func() { atCleanup = goroutines() }
	ports := make(chan string, 2)
	a.listen = func(network, _ string) (net.Listener, error) {
		l, err := net.Listen(network, "127.0.0.1:0")
		if err == nil {
			ports <- l.Addr().String()
		}
		return l, err
	}
	errs := make(chan error, 1)
	go func() {
		// Drive every part once, then stop the agent.
		defer cancel()
		errs <- exercise(ctx, a, cs, cfg, ports)
	}()
	runErr := a.Run(ctx)
	if err := <-errs; err != nil {
		t.Fatal(err)
	}
	if runErr != nil {
		t.Fatalf("Run: %v", runErr)
	}
	if got := prepared.ReadForcedVariant(cfg.Loop.Install.RunDir); got != "legacy" {
		t.Fatalf("the forced variant said in the run dir: %q, want legacy (an earlier agent said nft)", got)
	}
	if atCleanup == nil {
		t.Fatal("Run did not get to the clean-up")
	}
	if _, err := os.Lstat(filepath.Join(cfg.Loop.Install.RunDir, "istio-cni-kubeconfig")); !os.IsNotExist(err) {
		t.Fatalf("not cleaned up: %v", err)
	}
	var leaked []string
	for id, g := range atCleanup {
		if _, old := before[id]; old || !partOfTheAgent(g.stack) {
			continue
		}
		if g.state == "runnable" || g.state == "running" {
			continue
		}
		leaked = append(leaked, g.stack)
	}
	if len(leaked) > 0 {
		t.Fatalf("%d goroutines of the agent still blocked when the clean-up began:\n\n%s", len(leaked), strings.Join(leaked, "\n\n"))
	}
}

// exercise waits for the agent to be ready and the broken pod to be
// labelled (an event recorded), and makes one request to each server.
func exercise(ctx context.Context, a *Agent, cs *fake.Clientset, cfg *Config, ports chan string) error {
	for a.ReadyReason() != "" {
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-time.After(time.Millisecond): // polling the agent's state
		}
	}
	deadline := time.Now().Add(20 * time.Second)
	for {
		p, err := cs.CoreV1().Pods("ns").Get(ctx, "p", metav1.GetOptions{})
		if err == nil && p.Labels[cfg.Repair.LabelKey] == cfg.Repair.LabelValue {
			break
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("the repair controller did not label the broken pod")
		}
		time.Sleep(5 * time.Millisecond) // polling the fake API server
	}
	client := &http.Client{Transport: &http.Transport{DisableKeepAlives: true}, Timeout: 10 * time.Second}
	for i := 0; i < 2; i++ {
		addr := <-ports
		resp, err := client.Get("http://" + addr + "/readyz")
		if err != nil {
			return err
		}
		_, _ = io.Copy(io.Discard, resp.Body)
		_ = resp.Body.Close()
	}
	run := cfg.Loop.Install.RunDir
	if _, err := podinfo.NewAgentClient(filepath.Join(run, podinfo.AgentSocketName), 10*time.Second).GetPod(ctx, "ns", "p"); err != nil {
		return fmt.Errorf("agent socket: %w", err)
	}
	logClient := &http.Client{Timeout: 10 * time.Second, Transport: &http.Transport{DisableKeepAlives: true,
		DialContext: func(ctx context.Context, _, _ string) (net.Conn, error) {
			return (&net.Dialer{}).DialContext(ctx, "unix", filepath.Join(run, "log.sock"))
		}}}
	resp, err := logClient.Post("http://unix/log", "application/json", bytes.NewReader([]byte(`["{\"msg\":\"hello\"}"]`)))
	if err != nil {
		return fmt.Errorf("log socket: %w", err)
	}
	_ = resp.Body.Close()
	return nil
}

// TestOnePortForReadinessAndMetrics: an operator who sets the readiness
// and monitoring ports to one number gets one listener serving both,
// not an agent that fails on its own second bind.
func TestOnePortForReadinessAndMetrics(t *testing.T) {
	cfg := testNode(t)
	cfg.ReadinessPort, cfg.MonitoringPort = 9, 9 // bound to the loopback's port 0 below
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	a := New(cfg, quiet)
	var binds []int
	addrs := make(chan string, 2)
	a.listen = func(network, addr string) (net.Listener, error) {
		_, port, _ := net.SplitHostPort(addr)
		n, _ := strconv.Atoi(port)
		binds = append(binds, n)
		l, err := net.Listen(network, "127.0.0.1:0")
		if err == nil {
			addrs <- l.Addr().String()
		}
		return l, err
	}
	runErr := make(chan error, 1)
	go func() { runErr <- a.Run(ctx) }()
	var addr string
	select {
	case addr = <-addrs:
	case err := <-runErr:
		t.Fatalf("Run ended before it listened: %v", err)
	}
	client := &http.Client{Transport: &http.Transport{DisableKeepAlives: true}, Timeout: 10 * time.Second}
	get := func(path string) (int, string) {
		resp, err := client.Get("http://" + addr + path)
		if err != nil {
			t.Fatal(err)
		}
		defer resp.Body.Close()
		body, _ := io.ReadAll(resp.Body)
		return resp.StatusCode, string(body)
	}
	for a.ReadyReason() != "" {
		select {
		case err := <-runErr:
			t.Fatalf("Run ended before ready: %v", err)
		case <-time.After(time.Millisecond): // polling the agent's state
		}
	}
	if code, body := get("/readyz"); code != http.StatusOK || body != "ready\n" {
		t.Fatalf("/readyz: %d %q", code, body)
	}
	if code, body := get("/metrics"); code != http.StatusOK || !strings.Contains(body, "istio_cni_install_ready") {
		t.Fatalf("/metrics: %d, no istio_cni_install_ready in:\n%s", code, body)
	}
	cancel()
	if err := <-runErr; err != nil {
		t.Fatalf("Run: %v", err)
	}
	if len(binds) != 1 || binds[0] != 9 {
		t.Fatalf("listened on %v, want once on port 9", binds)
	}
}
