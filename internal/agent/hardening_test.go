package agent

import (
	"context"
	"io"
	"log/slog"
	"os"
	"path/filepath"
	"testing"
	"time"

	"github.com/istio-cni-go/istio-cni/internal/cnirelay"
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

// TestRunRemovesSocketsBeforeReturning: when Run returns, none of the
// agent's sockets is left for a runtime's STATUS or a relay to find.
func TestRunRemovesSocketsBeforeReturning(t *testing.T) {
	opts := testNode(t)
	for i := 0; i < 20; i++ {
		a := New(opts, quiet)
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
		for _, name := range []string{cnirelay.SocketName, podinfo.AgentSocketName, pluginlog.SocketName} {
			if _, err := os.Lstat(filepath.Join(opts.Loop.Install.RunDir, name)); err == nil {
				t.Fatalf("run %d: %s left behind after Run returned", i, name)
			}
		}
	}
}
