package e2e

import (
	"encoding/json"
	"io"
	"net"
	"net/http"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/istio-cni-go/istio-cni/internal/testenv"
)

// TestLogsReachAgentSocket: when the agent's log socket exists, the
// plugin's lines arrive there, one JSON line each, naming the pod.
func TestLogsReachAgentSocket(t *testing.T) {
	e := newEnv(t, nil)
	l, err := net.Listen("unix", filepath.Join(e.node.RunDir, "log.sock"))
	if err != nil {
		t.Fatal(err)
	}
	lines := make(chan []string, 4)
	srv := &http.Server{Handler: http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		body, _ := io.ReadAll(r.Body)
		var got []string
		if r.URL.Path != "/log" || json.Unmarshal(body, &got) != nil {
			w.WriteHeader(http.StatusBadRequest)
			return
		}
		lines <- got
	})}
	go func() { _ = srv.Serve(l) }()
	defer srv.Close()

	sb := e.add(&testenv.PodSpec{Sidecar: true})
	select {
	case got := <-lines:
		found := false
		for _, line := range got {
			var entry map[string]any
			if err := json.Unmarshal([]byte(line), &entry); err != nil {
				t.Fatalf("forwarded line is not JSON: %q", line)
			}
			if entry["pod"] == testNS+"/"+sb.pod.Name && strings.Contains(entry["msg"].(string), "programmed") {
				found = true
			}
		}
		if !found {
			t.Fatalf("no line naming pod %s: %q", sb.pod.Name, got)
		}
	case <-time.After(10 * time.Second):
		t.Fatal("no log lines reached the agent socket")
	}
}
