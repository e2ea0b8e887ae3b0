package agent

import (
	"bytes"
	"context"
	"io"
	"log/slog"
	"net"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/istio-cni-go/istio-cni/internal/cnirelay"
	"github.com/istio-cni-go/istio-cni/internal/install"
	"github.com/istio-cni-go/istio-cni/internal/pluginlog"
	"github.com/istio-cni-go/istio-cni/internal/podinfo"
)

// testNode lays out a node's dirs for an in-process agent: a primary
// config, binaries to install, a service account.
func testNode(t *testing.T) *Config {
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
		"--repair-enabled=false"}, envOf(map[string]string{"KUBERNETES_SERVICE_HOST": "127.0.0.1", "KUBERNETES_SERVICE_PORT": "6443"}))
	if err != nil {
		t.Fatal(err)
	}
	return opts
}

var quiet = slog.New(slog.NewTextHandler(io.Discard, nil))

// runReady runs an agent on opts and returns once it is ready; stop ends
// its run and returns Run's error, once however often it is called.
func runReady(t *testing.T, opts *Config) (a *Agent, stop func() error) {
	t.Helper()
	a = New(opts, quiet)
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- a.Run(ctx) }()
	var once sync.Once
	var runErr error
	stop = func() error {
		once.Do(func() {
			cancel()
			runErr = <-done
		})
		return runErr
	}
	for a.ReadyReason() != "" {
		select {
		case err := <-done:
			cancel()
			t.Fatalf("Run returned early: %v", err)
		case <-time.After(time.Millisecond): // polling the agent's state
		}
	}
	return a, stop
}

// takeOver puts a newer agent's socket at path as an agent does (bound
// under another name, renamed into place); it closes with the test.
func takeOver(t *testing.T, path string) *net.UnixListener {
	t.Helper()
	l, err := net.ListenUnix("unix", &net.UnixAddr{Name: path + ".newer", Net: "unix"})
	if err != nil {
		t.Fatal(err)
	}
	l.SetUnlinkOnClose(false)
	t.Cleanup(func() { _ = l.Close() })
	if err := os.Rename(path+".newer", path); err != nil {
		t.Fatal(err)
	}
	return l
}

// TestRunRemovesSocketsBeforeReturning: when Run returns, none of the
// agent's sockets is left for a runtime's STATUS or a relay to find.
func TestRunRemovesSocketsBeforeReturning(t *testing.T) {
	opts := testNode(t)
	for i := 0; i < 20; i++ {
		_, stop := runReady(t, opts)
		if err := stop(); err != nil {
			t.Fatalf("run %d: %v", i, err)
		}
		for _, name := range []string{cnirelay.SocketName, podinfo.AgentSocketName, pluginlog.SocketName} {
			if _, err := os.Lstat(filepath.Join(opts.Loop.Install.RunDir, name)); err == nil {
				t.Fatalf("run %d: %s left behind after Run returned", i, name)
			}
		}
	}
}

// TestNewerAgentKeepsTheNode: two agents overlap on a node in an update
// with maxSurge; the newer one binds the CNI socket over the older's.
// The older one, stopping, must leave everything the newer one serves
// with, even where it would remove the plugin alone (no API client here:
// as Istio's RBAC that cannot read the DaemonSet), and must not write the
// node's files any more meanwhile.
func TestNewerAgentKeepsTheNode(t *testing.T) {
	opts := testNode(t)
	run := opts.Loop.Install.RunDir
	_, stop := runReady(t, opts)
	defer func() { _ = stop() }()
	sock := filepath.Join(run, cnirelay.SocketName)
	takeOver(t, sock)
	conf := filepath.Join(opts.Loop.Install.MountedCNINetDir, "10-ptp.conflist")
	kc := filepath.Join(run, install.KubeconfigName)
	before := map[string][]byte{}
	for _, p := range []string{conf, kc, filepath.Join(opts.Loop.Install.BinTargetDirs[0], "istio-cni")} {
		b, err := os.ReadFile(p)
		if err != nil {
			t.Fatal(err)
		}
		before[p] = b
	}
	// The newer agent's kubeconfig (its own pod's token): the older one
	// must not write its own back.
	if err := os.WriteFile(kc, []byte("the newer agent's"), 0o600); err != nil {
		t.Fatal(err)
	}
	before[kc] = []byte("the newer agent's")
	if err := stop(); err != nil {
		t.Fatal(err)
	}
	for p, want := range before {
		if got, err := os.ReadFile(p); err != nil || !bytes.Equal(got, want) {
			t.Errorf("%s changed by the agent that stopped: %q %v", p, got, err)
		}
	}
	if !bytes.Contains(before[conf], []byte(`"istio-cni"`)) {
		t.Fatalf("the config never had our entry: %s", before[conf])
	}
	c, err := net.Dial("unix", sock)
	if err != nil {
		t.Fatalf("the newer agent's socket is gone: %v", err)
	}
	c.Close()
}

// TestLivenessWhenTheNewerAgentWent: a newer agent took the CNI socket's
// path and then went with it (a rollback, a surge pod that failed): no
// relay reaches this agent, which no longer writes the node's files, and
// nothing would bind the socket again; the liveness probe then fails, so
// the kubelet restarts the agent. While the newer agent is there, it does
// not (a restart would take the node back from it).
func TestLivenessWhenTheNewerAgentWent(t *testing.T) {
	opts := testNode(t)
	opts.Loop.ResyncInterval = 50 * time.Millisecond
	run := opts.Loop.Install.RunDir
	a, stop := runReady(t, opts)
	defer func() {
		if err := stop(); err != nil {
			t.Error(err)
		}
	}()
	sock := filepath.Join(run, cnirelay.SocketName)
	l := takeOver(t, sock)
	// Several liveness graces (twice the resync interval) with the newer
	// agent there.
	for deadline := time.Now().Add(500 * time.Millisecond); time.Now().Before(deadline); time.Sleep(20 * time.Millisecond) { // probing over a span, as the kubelet does
		if r := a.LiveReason(); r != "" {
			t.Fatalf("not live while the newer agent serves: %s", r)
		}
	}
	l.Close()
	if err := os.Remove(sock); err != nil {
		t.Fatal(err)
	}
	deadline := time.Now().Add(10 * time.Second)
	for !strings.Contains(a.LiveReason(), "that agent has gone") {
		if time.Now().After(deadline) {
			t.Fatalf("still live with no socket a relay can reach: %q", a.LiveReason())
		}
		time.Sleep(10 * time.Millisecond) // polling the agent's state
	}
}
