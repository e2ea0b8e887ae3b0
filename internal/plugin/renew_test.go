package plugin

import (
	"context"
	"encoding/base64"
	"encoding/pem"
	"errors"
	"io"
	"log/slog"
	"net"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/istio-cni-go/istio-cni/internal/cnirelay"
	"github.com/istio-cni-go/istio-cni/internal/podinfo"
)

// tokenServer is an HTTPS API server stand-in that serves one pod to the
// token "next" and refuses every other token with HTTP 401, as the API
// server refuses a bound token whose pod is gone.
type tokenServer struct {
	srv *httptest.Server
	mu  sync.Mutex
	// tokens are the bearer tokens of the requests, in order.
	tokens []string
	// onRefused runs, once, after the first refusal is written.
	onRefused func()
}

func newTokenServer(t *testing.T) *tokenServer {
	t.Helper()
	ts := &tokenServer{}
	ts.srv = httptest.NewTLSServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		tok := strings.TrimPrefix(r.Header.Get("Authorization"), "Bearer ")
		ts.mu.Lock()
		ts.tokens = append(ts.tokens, tok)
		hook := ts.onRefused
		if tok != "next" {
			ts.onRefused = nil
		}
		ts.mu.Unlock()
		if tok != "next" {
			http.Error(w, `{"kind":"Status","code":401,"message":"Unauthorized"}`, http.StatusUnauthorized)
			if hook != nil {
				// Flushed first, so the plugin is reading the refusal
				// (or past it) when the next kubeconfig lands.
				w.(http.Flusher).Flush()
				hook()
			}
			return
		}
		_, _ = w.Write([]byte(`{"metadata":{"namespace":"default","name":"web","uid":"u1"},"spec":{"containers":[{"name":"app"}]}}`))
	}))
	t.Cleanup(ts.srv.Close)
	return ts
}

func (ts *tokenServer) seen() []string {
	ts.mu.Lock()
	defer ts.mu.Unlock()
	return append([]string(nil), ts.tokens...)
}

// writeKubeconfig writes a kubeconfig for ts with token as the agent
// does: a temp file renamed over the old one.
func (ts *tokenServer) writeKubeconfig(t *testing.T, path, token string) {
	t.Helper()
	ca := pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: ts.srv.Certificate().Raw})
	kc := "apiVersion: v1\nkind: Config\nclusters:\n- name: local\n  cluster:\n    server: " + ts.srv.URL +
		"\n    certificate-authority-data: " + base64.StdEncoding.EncodeToString(ca) +
		"\nusers:\n- name: istio-cni\n  user:\n    token: " + token +
		"\ncontexts:\n- name: c\n  context:\n    cluster: local\n    user: istio-cni\ncurrent-context: c\n"
	tmp := path + ".tmp"
	if err := os.WriteFile(tmp, []byte(kc), 0o600); err != nil {
		t.Error(err)
		return
	}
	if err := os.Rename(tmp, path); err != nil {
		t.Error(err)
	}
}

// TestRefusedTokenWaitsForTheNextKubeconfig: an ADD's look-up whose token
// the API server refuses (HTTP 401: the node agent's pod, which the token
// is bound to, is gone in a rollout) waits within k8s_retry_budget for
// the next agent's kubeconfig and reads the pod with it, where it failed
// at once and the pod waited for the kubelet's next try of its sandbox.
// With no new kubeconfig it fails when the budget is spent, naming the
// refusal; a CHECK (renew off) does not wait.
func TestRefusedTokenWaitsForTheNextKubeconfig(t *testing.T) {
	log := slog.New(slog.NewTextHandler(io.Discard, nil))
	setup := func(t *testing.T, budget string) (*tokenServer, *Config, string) {
		ts := newTokenServer(t)
		runDir := t.TempDir()
		conf, err := ParseConfig([]byte(`{"cniVersion":"1.0.0","name":"n","type":"istio-cni","cni_agent_run_dir":"` + runDir +
			`","k8s_retry_budget":"` + budget + `"}`))
		if err != nil {
			t.Fatal(err)
		}
		path := conf.KubeconfigPath()
		ts.writeKubeconfig(t, path, "gone")
		// The old agent stopped leaving the plugin: a rollout.
		if err := os.WriteFile(filepath.Join(runDir, cnirelay.StoppedName), nil, 0o644); err != nil {
			t.Fatal(err)
		}
		return ts, conf, path
	}
	// open is the fallback's API source for an ADD (rollout) or a CHECK.
	open := func(t *testing.T, conf *Config, rollout bool) podinfo.Source {
		t.Helper()
		var rw *rolloutWatch
		if rollout {
			rw = newRolloutWatch(conf.CNIAgentRunDir)
		}
		src, err := apiSource(conf, log, rw)
		if err != nil {
			t.Fatal(err)
		}
		return src
	}

	t.Run("next kubeconfig", func(t *testing.T) {
		ts, conf, path := setup(t, "30s")
		ts.onRefused = func() { ts.writeKubeconfig(t, path, "next") }
		src := open(t, conf, true)
		pod, err := src.GetPod(context.Background(), "default", "web")
		if err != nil {
			t.Fatalf("GetPod after the next kubeconfig came: %v", err)
		}
		if pod.UID != "u1" {
			t.Fatalf("pod %+v", pod)
		}
		if got := ts.seen(); len(got) != 2 || got[0] != "gone" || got[1] != "next" {
			t.Fatalf("tokens sent %q, want the refused one, then the next agent's", got)
		}
	})

	t.Run("none within the budget", func(t *testing.T) {
		ts, conf, _ := setup(t, "2s")
		src := open(t, conf, true)
		_, err := src.GetPod(context.Background(), "default", "web")
		var perm *podinfo.PermanentError
		if !errors.As(err, &perm) || !strings.Contains(err.Error(), "HTTP 401") || !strings.Contains(err.Error(), "no other credentials came within 2s") {
			t.Fatalf("GetPod with no next kubeconfig: %v", err)
		}
		if got := ts.seen(); len(got) != 1 {
			t.Fatalf("tokens sent %q, want the refused one once", got)
		}
	})

	t.Run("a rewrite of the refused token", func(t *testing.T) {
		// The same refused token written again (an agent's resync) is
		// asked with once more, then waited on again.
		ts, conf, path := setup(t, "3s")
		ts.onRefused = func() { ts.writeKubeconfig(t, path, "gone") }
		src := open(t, conf, true)
		_, err := src.GetPod(context.Background(), "default", "web")
		if err == nil || !strings.Contains(err.Error(), "HTTP 401") {
			t.Fatalf("GetPod: %v", err)
		}
		if got := ts.seen(); len(got) != 2 || got[1] != "gone" {
			t.Fatalf("tokens sent %q, want the refused one twice", got)
		}
		if !strings.Contains(err.Error(), "the other credentials that came within 3s (1) were refused as well") {
			t.Fatalf("GetPod: %v, want it to say the next kubeconfig was refused too", err)
		}
	})

	t.Run("an agent starts", func(t *testing.T) {
		// A new agent that serves but wrote no kubeconfig: the wait ends,
		// and the relay asks that agent.
		ts, conf, _ := setup(t, "30s")
		ts.onRefused = func() {
			l, err := net.ListenUnix("unix", &net.UnixAddr{Name: filepath.Join(conf.CNIAgentRunDir, cnirelay.SocketName), Net: "unix"})
			if err != nil {
				t.Error(err)
				return
			}
			t.Cleanup(func() { l.Close() })
		}
		src := open(t, conf, true)
		if _, err := src.GetPod(context.Background(), "default", "web"); !errors.Is(err, errAgentStarted) || !strings.Contains(err.Error(), "HTTP 401") {
			t.Fatalf("GetPod: %v, want the refusal and the agent's start", err)
		}
	})

	t.Run("no rollout", func(t *testing.T) {
		// No agent stopped leaving the plugin lately (none did, or long
		// ago): no new token is coming, and the ADD fails at once.
		for _, age := range []time.Duration{-1, renewWithin + time.Minute} {
			ts, conf, path := setup(t, "30s")
			ts.onRefused = func() { ts.writeKubeconfig(t, path, "next") }
			marker := filepath.Join(conf.CNIAgentRunDir, cnirelay.StoppedName)
			if age < 0 {
				if err := os.Remove(marker); err != nil {
					t.Fatal(err)
				}
			} else if err := os.Chtimes(marker, time.Now().Add(-age), time.Now().Add(-age)); err != nil {
				t.Fatal(err)
			}
			src := open(t, conf, true)
			if _, err := src.GetPod(context.Background(), "default", "web"); err == nil || !strings.Contains(err.Error(), "no new token is coming") {
				t.Fatalf("GetPod, stop %v ago: %v", age, err)
			}
			if got := ts.seen(); len(got) != 1 {
				t.Fatalf("tokens sent %q, want one", got)
			}
		}
	})

	t.Run("check does not wait", func(t *testing.T) {
		ts, conf, path := setup(t, "30s")
		ts.onRefused = func() { ts.writeKubeconfig(t, path, "next") }
		src := open(t, conf, false)
		if _, err := src.GetPod(context.Background(), "default", "web"); err == nil || !strings.Contains(err.Error(), "HTTP 401") {
			t.Fatalf("GetPod: %v", err)
		}
		if got := ts.seen(); len(got) != 1 {
			t.Fatalf("tokens sent %q, want one", got)
		}
	})
}

// staticNamespaces serves one namespace's labels.
type staticNamespaces map[string]string

func (s staticNamespaces) NamespaceLabels(context.Context, string) (map[string]string, error) {
	return s, nil
}

// TestAmbientPodWaitsForTheNextAgent: the fallback, which must refuse an
// ambient pod (only an agent enrols it), waits in a rollout of the agent
// for the next agent's socket and hands the ADD back to the relay, which
// asks that agent; with no rollout under way it refuses at once.
func TestAmbientPodWaitsForTheNextAgent(t *testing.T) {
	pod := &podinfo.Pod{Namespace: "apps", Name: "web", UID: "u1"}
	for _, c := range []struct {
		name            string
		renewed, marker bool
		agentStarts     bool
		wantStarted     bool
	}{
		{name: "token renewed, agent starts", renewed: true, agentStarts: true, wantStarted: true},
		{name: "agent stopped lately, agent starts", marker: true, agentStarts: true, wantStarted: true},
		{name: "no rollout", agentStarts: true},
		{name: "rollout, no agent within the budget", marker: true},
	} {
		t.Run(c.name, func(t *testing.T) {
			runDir := t.TempDir()
			conf, err := ParseConfig([]byte(`{"cniVersion":"1.0.0","name":"n","type":"istio-cni","ambient_enabled":true,"cni_agent_run_dir":"` + runDir +
				`","k8s_retry_budget":"2s"}`))
			if err != nil {
				t.Fatal(err)
			}
			if c.marker {
				if err := os.WriteFile(filepath.Join(runDir, cnirelay.StoppedName), nil, 0o644); err != nil {
					t.Fatal(err)
				}
			}
			rw := newRolloutWatch(runDir)
			rw.renewed = c.renewed
			if c.agentStarts {
				// Bound once the wait is under way or not at all: either
				// way the socket is new to the watch.
				l, err := net.ListenUnix("unix", &net.UnixAddr{Name: filepath.Join(runDir, cnirelay.SocketName), Net: "unix"})
				if err != nil {
					t.Fatal(err)
				}
				t.Cleanup(func() { l.Close() })
			}
			p := &Plugin{Namespaces: staticNamespaces{"istio.io/dataplane-mode": "ambient"}}
			err = p.refuseAmbient(context.Background(), conf, pod, rw)
			switch {
			case err == nil:
				t.Fatal("an ambient pod was not refused")
			case c.wantStarted != errors.Is(err, errAgentStarted):
				t.Fatalf("refusal %v; want the agent's start %v", err, c.wantStarted)
			case !c.wantStarted && !strings.Contains(err.Error(), "only the istio-cni node agent can enrol it"):
				t.Fatalf("refusal %v", err)
			}
		})
	}
}
