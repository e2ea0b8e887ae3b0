package logging

import (
	"bufio"
	"encoding/json"
	"io"
	"net"
	"net/http"
	"path/filepath"
	"strings"
	"testing"
	"time"
)

// TestForwardDoesNotWait: the fallback's lines reach the agent's log
// socket as one POST of a JSON array, and Forward returns before the
// agent has read any of it (a busy agent must not hold up the pod's
// ADD); the request is whole for the agent when it gets to it.
func TestForwardDoesNotWait(t *testing.T) {
	sock := filepath.Join(t.TempDir(), "log.sock")
	l, err := net.Listen("unix", sock)
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	log := New(io.Discard)
	log.Info("redirect rules programmed", "pod", "ns/p")
	log.Warn("second line")
	// Nothing accepts or reads until Forward has returned.
	if err := log.Forward(sock, time.Second); err != nil {
		t.Fatalf("Forward: %v", err)
	}
	c, err := l.Accept()
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	req, err := http.ReadRequest(bufio.NewReader(c))
	if err != nil {
		t.Fatalf("the forwarded request: %v", err)
	}
	var lines []string
	if err := json.NewDecoder(req.Body).Decode(&lines); err != nil {
		t.Fatal(err)
	}
	if req.Method != http.MethodPost || req.URL.Path != "/log" || len(lines) != 2 ||
		!strings.Contains(lines[0], "redirect rules programmed") || !strings.Contains(lines[1], "second line") {
		t.Fatalf("%s %s, lines %q", req.Method, req.URL.Path, lines)
	}
	// Nothing is left to forward, and no socket is no error.
	if err := log.Forward(filepath.Join(t.TempDir(), "none.sock"), time.Second); err != nil {
		t.Fatalf("Forward without a socket: %v", err)
	}
}
