package plugin

import (
	"context"
	"errors"
	"io"
	"log/slog"
	"net"
	"os"
	"path/filepath"
	"testing"

	"golang.org/x/sys/unix"

	"github.com/istio-cni-go/istio-cni/internal/podinfo"
)

// TestSkipAgentCache: the fallback a relay ran because the agent did not
// answer (SkipAgentCache) reads the pod from the API server without
// asking the agent's pod cache, which would keep it waiting; otherwise it
// asks the agent first.
func TestSkipAgentCache(t *testing.T) {
	for _, skip := range []bool{false, true} {
		runDir := t.TempDir()
		// An agent that never answers: its socket listens, nothing
		// accepts.
		l, err := net.ListenUnix("unix", &net.UnixAddr{Name: filepath.Join(runDir, podinfo.AgentSocketName), Net: "unix"})
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { l.Close() })
		conf, err := ParseConfig([]byte(`{"cniVersion":"1.0.0","name":"n","type":"istio-cni","cni_agent_run_dir":"` + runDir + `"}`))
		if err != nil {
			t.Fatal(err)
		}
		p := &Plugin{SkipAgentCache: skip}
		src, err := p.source(slog.New(slog.NewTextHandler(io.Discard, nil)), newRolloutWatch(runDir))(conf, "u1")
		if err != nil {
			t.Fatal(err)
		}
		// No kubeconfig in the run dir: the API server cannot be asked.
		if _, err := src.GetPod(context.Background(), "ns", "p"); err == nil || !errors.Is(err, os.ErrNotExist) {
			t.Fatalf("skip %v: GetPod: %v, want the missing kubeconfig", skip, err)
		}
		// A connection the plugin made is queued on the socket, accepted
		// or not; the listener is non-blocking, so none is EAGAIN.
		rc, err := l.SyscallConn()
		if err != nil {
			t.Fatal(err)
		}
		var aerr error
		if err := rc.Control(func(fd uintptr) {
			var nfd int
			if nfd, _, aerr = unix.Accept(int(fd)); aerr == nil {
				unix.Close(nfd)
			}
		}); err != nil {
			t.Fatal(err)
		}
		if asked := aerr == nil; asked == skip {
			t.Fatalf("skip %v: the agent's pod cache was asked: %v (%v)", skip, asked, aerr)
		}
	}
}
