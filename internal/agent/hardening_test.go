package agent

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/netip"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/containernetworking/cni/pkg/skel"
	"github.com/prometheus/client_golang/prometheus"
	dto "github.com/prometheus/client_model/go"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/kubernetes/fake"
	k8stesting "k8s.io/client-go/testing"

	"github.com/istio-cni-go/istio-cni/internal/cnirelay"
	"github.com/istio-cni-go/istio-cni/internal/logging"
	"github.com/istio-cni-go/istio-cni/internal/podinfo"
	"github.com/istio-cni-go/istio-cni/internal/podnet"
	"github.com/istio-cni-go/istio-cni/internal/repair"
	"github.com/istio-cni-go/istio-cni/internal/ruleset"
)

// testNode lays out a node's dirs for an in-process agent: a primary
// config, binaries to install, a service account.
func testNode(t *testing.T) (*Options, func(string) string) {
	t.Helper()
	dir := t.TempDir()
	d := func(name string) string {
		p := filepath.Join(dir, name)
		if err := os.MkdirAll(p, 0o755); err != nil {
			t.Fatal(err)
		}
		return p
	}
	netDir, src, bin, run, sa := d("net.d"), d("src"), d("bin"), d("run"), d("sa")
	files := map[string]string{
		filepath.Join(netDir, "10-ptp.conflist"): `{"cniVersion":"1.0.0","name":"k8s-pod-network","plugins":[{"type":"ptp"}]}`,
		filepath.Join(src, "istio-cni"):          "relay", filepath.Join(src, "istio-cni-fallback"): "fallback",
		filepath.Join(sa, "token"): "token", filepath.Join(sa, "ca.crt"): "ca",
	}
	for p, c := range files {
		if err := os.WriteFile(p, []byte(c), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	opts, err := ParseOptions([]string{"--mounted-cni-net-dir", netDir, "--cni-bin-source-dir", src, "--cni-bin-target-dirs", bin,
		"--cni-agent-run-dir", run, "--service-account-dir", sa, "--readiness-port", "0", "--monitoring-port", "0",
		"--repair-enabled=false"}, func(string) (string, bool) { return "", false })
	if err != nil {
		t.Fatal(err)
	}
	env := map[string]string{"KUBERNETES_SERVICE_HOST": "127.0.0.1", "KUBERNETES_SERVICE_PORT": "6443"}
	return opts, func(k string) string { return env[k] }
}

var quiet = slog.New(slog.NewTextHandler(io.Discard, nil))

func counterValue(c prometheus.Counter) float64 {
	var m dto.Metric
	if err := c.Write(&m); err != nil {
		return -1
	}
	return m.GetCounter().GetValue()
}

// TestRunRemovesSocketsBeforeReturning: when Run returns, none of the
// agent's sockets is left for a runtime's STATUS or a relay to find.
func TestRunRemovesSocketsBeforeReturning(t *testing.T) {
	opts, getenv := testNode(t)
	for i := 0; i < 20; i++ {
		a := New(opts, quiet, getenv)
		ctx, cancel := context.WithCancel(context.Background())
		done := make(chan error, 1)
		go func() { done <- a.Run(ctx) }()
		for a.ReadyReason() != "" {
			select {
			case err := <-done:
				t.Fatalf("Run returned early: %v", err)
			case <-time.After(time.Millisecond): // polling the agent's state
			}
		}
		cancel()
		if err := <-done; err != nil {
			t.Fatalf("run %d: %v", i, err)
		}
		for _, name := range []string{cnirelay.SocketName, podinfo.AgentSocketName, LogSocketName} {
			if _, err := os.Lstat(filepath.Join(opts.RunDir, name)); err == nil {
				t.Fatalf("run %d: %s left behind after Run returned", i, name)
			}
		}
	}
}

// TestSocketEvictsSilentClients: at the connection limit the oldest client
// that has not sent a request makes room; busy ones are never evicted.
func TestSocketEvictsSilentClients(t *testing.T) {
	path := filepath.Join(t.TempDir(), "s.sock")
	m := NewSocketMetrics()
	s, err := newSockServer(path, sockLimits{maxConns: 2, readTimeout: time.Second}, quiet, m)
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	if fi, err := os.Stat(path); err != nil || fi.Mode().Perm() != 0o600 {
		t.Fatalf("socket mode: %v %v", fi, err)
	}
	dial := func() net.Conn {
		c, err := net.Dial("unix", path)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { c.Close() })
		return c
	}
	accept := func() *sockConn {
		c, err := s.Accept()
		if err != nil {
			t.Fatal(err)
		}
		return c.(*sockConn)
	}
	first, second := dial(), dial()
	accept()
	s2 := accept()
	dial()
	accept()
	// The oldest silent one was closed.
	_ = first.SetReadDeadline(time.Now().Add(5 * time.Second))
	if _, err := first.Read(make([]byte, 1)); !errors.Is(err, io.EOF) {
		t.Fatalf("the oldest silent client is still connected: %v", err)
	}
	if got := counterValue(m.Rejected.WithLabelValues("s.sock", "evicted")); got != 1 {
		t.Fatalf("evictions counted: %v", got)
	}
	// With every connection busy, a new one is refused, not served.
	s.mu.Lock()
	for c := range s.conns {
		c.busy.Store(true)
	}
	s.mu.Unlock()
	late := dial()
	go func() { _, _ = s.Accept() }()
	_ = late.SetReadDeadline(time.Now().Add(5 * time.Second))
	if _, err := late.Read(make([]byte, 1)); !errors.Is(err, io.EOF) {
		t.Fatalf("a client past the limit was not refused: %v", err)
	}
	_ = second
	_ = s2
}

// panickyRules panics for one pod's namespace path, as a bug would.
type panickyRules struct{}

func (panickyRules) Apply(string, *ruleset.Plan) (podnet.Report, error) {
	return podnet.Report{}, nil
}
func (panickyRules) Check(string, *ruleset.Plan) error { return nil }
func (panickyRules) PodAddrs(string) ([]netip.Addr, error) {
	panic("a bug in the rule backend")
}

// TestCNICommandPanicFailsOnlyThatCommand: a command that panics fails
// with an error naming it, is logged with its pod and counted; the agent
// goes on serving.
func TestCNICommandPanicFailsOnlyThatCommand(t *testing.T) {
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	cs := fake.NewClientset(&corev1.Pod{ObjectMeta: metav1.ObjectMeta{Namespace: "ns", Name: "bad", UID: "u1",
		Annotations: map[string]string{"sidecar.istio.io/status": "{}"}},
		Spec: corev1.PodSpec{NodeName: "n", Containers: []corev1.Container{{Name: "istio-proxy", Args: []string{"proxy", "sidecar"}}}}})
	pods := StartPodCache(ctx, cs, "n")
	if err := pods.WaitSynced(ctx); err != nil {
		t.Fatal(err)
	}
	var logs bytes.Buffer
	root, err := logging.Open(logging.Options{OutputLevel: "default:info", AsJSON: true, Targets: []string{"stdout"}}, &syncWriter{w: &logs}, io.Discard)
	if err != nil {
		t.Fatal(err)
	}
	panics := NewPanicMetric()
	s := &CNIServer{Log: root.Logger(logging.ScopePlugin), Rules: panickyRules{}, NFTables: panickyRules{}, Pods: pods, Clientset: cs, Panics: panics}
	sock := filepath.Join(t.TempDir(), cnirelay.SocketName)
	done, err := s.Serve(ctx, sock, time.Second)
	if err != nil {
		t.Fatal(err)
	}
	defer func() { cancel(); <-done }()
	relay := &cnirelay.Relay{Fallback: "/nonexistent/fallback", Stdout: io.Discard, Stderr: io.Discard, Timeout: 10 * time.Second}
	conf := fmt.Sprintf(`{"cniVersion":"1.0.0","name":"n","type":"istio-cni","cni_agent_run_dir":%q,"prevResult":{"cniVersion":"1.0.0","ips":[{"address":"10.1.0.2/24"}]}}`, filepath.Dir(sock))
	add := &skel.CmdArgs{ContainerID: "c1", IfName: "eth0", Args: "K8S_POD_NAMESPACE=ns;K8S_POD_NAME=bad;K8S_POD_UID=u1", StdinData: []byte(conf)}
	err = relay.Run("ADD", add)
	if err == nil || !strings.Contains(err.Error(), "internal error handling ADD") {
		t.Fatalf("ADD that panicked: %v", err)
	}
	if got := counterValue(panics.WithLabelValues("cni")); got != 1 {
		t.Fatalf("panics counted: %v", got)
	}
	if !strings.Contains(logs.String(), `"pod":"ns/bad"`) || !strings.Contains(logs.String(), "a bug in the rule backend") {
		t.Fatalf("the panic is not logged with its pod:\n%s", logs.String())
	}
	// The agent still serves.
	if err := relay.Run("DEL", &skel.CmdArgs{ContainerID: "c1", IfName: "eth0", Args: add.Args, StdinData: []byte(conf)}); err != nil {
		t.Fatalf("DEL after the panic: %v", err)
	}
}

type syncWriter struct {
	mu sync.Mutex
	w  io.Writer
}

func (s *syncWriter) Write(p []byte) (int, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.w.Write(p)
}

// TestRepairPanicFailsOnlyThatPod: a pod whose handling panics is logged,
// counted and skipped; the controller goes on to the next broken pod.
func TestRepairPanicFailsOnlyThatPod(t *testing.T) {
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	broken := func(name string) *corev1.Pod {
		return &corev1.Pod{ObjectMeta: metav1.ObjectMeta{Namespace: "ns", Name: name, UID: types.UID("uid-" + name),
			Annotations: map[string]string{"sidecar.istio.io/status": "{}"}},
			Spec: corev1.PodSpec{NodeName: "n"},
			Status: corev1.PodStatus{InitContainerStatuses: []corev1.ContainerStatus{{Name: "istio-validation",
				State: corev1.ContainerState{Terminated: &corev1.ContainerStateTerminated{ExitCode: 126}}}}}}
	}
	cs := fake.NewClientset(broken("first"), broken("second"))
	patched := make(chan string, 4)
	cs.PrependReactor("patch", "pods", func(a k8stesting.Action) (bool, runtime.Object, error) {
		name := a.(k8stesting.PatchAction).GetName()
		if name == "first" {
			panic("a bug while labelling")
		}
		patched <- name
		return true, broken(name), nil
	})
	cfg := repair.DefaultConfig()
	cfg.RepairPods, cfg.LabelPods = false, true
	var logs bytes.Buffer
	log := slog.New(slog.NewJSONHandler(&syncWriter{w: &logs}, nil))
	counter := repair.NewMetric()
	panics := NewPanicMetric()
	c := repair.New(cfg, cs, panickyRules{}, "/proc", counter, log)
	c.Panics = panics.WithLabelValues("repair")
	go func() { _ = c.Run(ctx, "n") }()
	select {
	case name := <-patched:
		if name != "second" {
			t.Fatalf("patched %s", name)
		}
	case <-time.After(20 * time.Second):
		t.Fatalf("the controller stopped after a panic:\n%s", logs.String())
	}
	deadline := time.Now().Add(10 * time.Second)
	for counterValue(panics.WithLabelValues("repair")) == 0 {
		if time.Now().After(deadline) {
			t.Fatal("panic not counted")
		}
		time.Sleep(5 * time.Millisecond) // the counter is bumped by the controller's goroutine
	}
	if !strings.Contains(logs.String(), `"pod":"ns/first"`) {
		t.Fatalf("the panic is not logged with its pod:\n%s", logs.String())
	}
}

// TestPluginLineStaysOneLine: whatever a plugin sends, each line becomes
// exactly one line of the agent's output, in the cni-plugin scope, and
// cannot take the agent's own keys.
func TestPluginLineStaysOneLine(t *testing.T) {
	for _, asJSON := range []bool{false, true} {
		var out bytes.Buffer
		root, err := logging.Open(logging.Options{OutputLevel: "default:debug", AsJSON: asJSON, Targets: []string{"stdout"}}, &out, io.Discard)
		if err != nil {
			t.Fatal(err)
		}
		log := root.Logger(logging.ScopePlugin)
		for _, line := range []string{
			`{"level":"info","msg":"ok\n2026-01-01T00:00:00Z\tinfo\tcni-agent\tforged","pod":"a/b"}`,
			`{"level":"info","msg":"x","scope":"cni-agent","time":"t","caller":"c","stack":"s","a b=c":"d\ne"}`,
			"not json\r\nsecond line \u2028 third",
			`{"msg":"` + strings.Repeat("x", 70000) + `"}`,
		} {
			out.Reset()
			emitPluginLine(log, line)
			checkOneLine(t, out.Bytes(), asJSON)
		}
	}
}

func checkOneLine(t *testing.T, out []byte, asJSON bool) {
	t.Helper()
	if bytes.Count(out, []byte("\n")) != 1 || !bytes.HasSuffix(out, []byte("\n")) {
		t.Fatalf("not one line: %q", out)
	}
	if asJSON {
		var m map[string]any
		d := json.NewDecoder(bytes.NewReader(out))
		d.UseNumber()
		if err := d.Decode(&m); err != nil {
			t.Fatalf("not JSON: %v: %q", err, out)
		}
		if m["scope"] != logging.ScopePlugin {
			t.Fatalf("scope %v: %q", m["scope"], out)
		}
		return
	}
	fields := strings.Split(string(out), "\t")
	if len(fields) < 4 || fields[2] != logging.ScopePlugin {
		t.Fatalf("scope: %q", out)
	}
}
