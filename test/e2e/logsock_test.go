package e2e

import (
	"encoding/json"
	"fmt"
	"io"
	"net"
	"net/http"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

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
