package e2e

import (
	"encoding/json"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/istio-cni-go/istio-cni/internal/logging"
	"github.com/istio-cni-go/istio-cni/internal/testenv"
)

// TestLogsReachAgentSocket: when the agent's log socket exists, the
// plugin's lines arrive there, one JSON line each, naming the pod.
func TestLogsReachAgentSocket(t *testing.T) {
	e := newEnv(t, nil)
	lines := pluginLines(t, e.node.RunDir)
	sb := e.add(&testenv.PodSpec{Sidecar: true})
	deadline := time.Now().Add(10 * time.Second)
	for {
		got := lines()
		found := false
		for _, line := range got {
			var entry map[string]any
			if err := json.Unmarshal([]byte(line), &entry); err != nil {
				t.Fatalf("forwarded line is not JSON: %q", line)
			}
			if entry["pod"] == testNS+"/"+sb.pod.Name && strings.Contains(fmt.Sprint(entry["msg"]), "programmed") {
				found = true
			}
		}
		if found {
			// The fallback's own lines are in the run directory's log
			// file too, as Istio's plugin keeps it.
			requirePluginFileLine(t, e.node.RunDir, testNS+"/"+sb.pod.Name)
			return
		}
		if time.Now().After(deadline) {
			if len(got) == 0 {
				t.Fatal("no log lines reached the agent socket")
			}
			t.Fatalf("no line naming pod %s: %q", sb.pod.Name, got)
		}
		time.Sleep(10 * time.Millisecond) // polling a log another process sends, bounded
	}
}

// pluginLines serves the agent's log socket in runDir, as the agent does,
// and returns what has arrived so far, one JSON line each.
func pluginLines(t *testing.T, runDir string) func() []string {
	t.Helper()
	l, err := net.Listen("unix", filepath.Join(runDir, "log.sock"))
	if err != nil {
		t.Fatal(err)
	}
	var mu sync.Mutex
	var lines []string
	srv := &http.Server{ReadHeaderTimeout: 5 * time.Second, Handler: http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		body, _ := io.ReadAll(r.Body)
		var got []string
		if r.URL.Path != "/log" || json.Unmarshal(body, &got) != nil {
			w.WriteHeader(http.StatusBadRequest)
			return
		}
		mu.Lock()
		lines = append(lines, got...)
		mu.Unlock()
	})}
	go func() { _ = srv.Serve(l) }()
	t.Cleanup(func() { srv.Close() })
	return func() []string {
		mu.Lock()
		defer mu.Unlock()
		return append([]string(nil), lines...)
	}
}

// requirePluginFileLine: the run directory's istio-cni.log holds a JSON
// line at info saying pod's rules were programmed, and nothing at debug.
func requirePluginFileLine(t *testing.T, runDir, pod string) {
	t.Helper()
	path := filepath.Join(runDir, logging.PluginLogFile)
	data, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	if fi, err := os.Stat(path); err != nil || fi.Mode().Perm() != 0o600 {
		t.Fatalf("%s: mode %v (%v), want 0600", path, fi.Mode().Perm(), err)
	}
	found := false
	for _, line := range strings.Split(strings.TrimSpace(string(data)), "\n") {
		var entry map[string]any
		if err := json.Unmarshal([]byte(line), &entry); err != nil {
			t.Fatalf("%s: a line that is not JSON: %q", path, line)
		}
		if entry["level"] == "debug" {
			t.Fatalf("%s: a debug line: %q", path, line)
		}
		if entry["pod"] == pod && entry["level"] == "info" && strings.Contains(fmt.Sprint(entry["msg"]), "programmed") {
			found = true
		}
	}
	if !found {
		t.Fatalf("%s has no line programming %s:\n%s", path, pod, data)
	}
}
