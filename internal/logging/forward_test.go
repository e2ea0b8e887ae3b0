package logging

import (
	"bufio"
	"bytes"
	"encoding/json"
	"io"
	"log/slog"
	"net"
	"net/http"
	"os"
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

// TestTeeToFile: the file gets every record at info and above in the
// plugin's JSON form, whatever the inner handler's level; the inner one
// gets only what it takes.
func TestTeeToFile(t *testing.T) {
	var inner, file bytes.Buffer
	h := TeeToFile(slog.NewTextHandler(&inner, &slog.HandlerOptions{Level: slog.LevelWarn}), &file)
	log := slog.New(h).With("pod", "ns/p")
	log.Debug("nowhere")
	log.Info("redirect rules programmed")
	log.Warn("both")
	if strings.Contains(inner.String(), "programmed") || !strings.Contains(inner.String(), "both") {
		t.Fatalf("inner got %q", inner.String())
	}
	lines := strings.Split(strings.TrimSpace(file.String()), "\n")
	if len(lines) != 2 || !strings.Contains(lines[0], `"level":"info"`) || !strings.Contains(lines[0], `"pod":"ns/p"`) ||
		!strings.Contains(lines[1], `"level":"warn"`) || strings.Contains(file.String(), "nowhere") {
		t.Fatalf("file got %q", file.String())
	}
}

// TestWriteKeptSkipsDebug: a plugin process's part of the file holds its
// lines at info and above.
func TestWriteKeptSkipsDebug(t *testing.T) {
	l := New(io.Discard)
	l.SetLevel(slog.LevelDebug)
	l.Debug("detail")
	l.Info("redirect rules programmed", "pod", "ns/p")
	var out bytes.Buffer
	if err := l.WriteKept(&out); err != nil {
		t.Fatal(err)
	}
	if got := out.String(); strings.Contains(got, "detail") || !strings.Contains(got, `"msg":"redirect rules programmed"`) || strings.Count(got, "\n") != 1 {
		t.Fatalf("kept %q", got)
	}
}

// TestFileIgnoresPluginLevel: with plugin_log_level above info, a plugin
// process's info lines stay off stderr and out of what it forwards, and
// still go to the run directory's file, as Istio's plugin keeps them; the
// agent serving a command in-process does the same through Over.
func TestFileIgnoresPluginLevel(t *testing.T) {
	var stderr bytes.Buffer
	l := New(&stderr)
	l.SetLevel(slog.LevelWarn)
	l.Debug("detail")
	l.Info("redirect rules programmed", "pod", "ns/p")
	l.Error("a failure")
	var kept bytes.Buffer
	if err := l.WriteKept(&kept); err != nil {
		t.Fatal(err)
	}
	if got := kept.String(); strings.Count(got, "\n") != 2 || !strings.Contains(got, "programmed") || !strings.Contains(got, "a failure") {
		t.Fatalf("file part %q", got)
	}
	if got := stderr.String(); strings.Contains(got, "programmed") || !strings.Contains(got, "a failure") || strings.Contains(got, "detail") {
		t.Fatalf("stderr %q", got)
	}
	l.mu.Lock()
	var forwarded int
	for _, line := range l.lines {
		if line.level >= l.level.Level() {
			forwarded++
		}
	}
	l.mu.Unlock()
	if forwarded != 1 {
		t.Fatalf("%d lines to forward, want the error alone", forwarded)
	}

	var inner, file bytes.Buffer
	over := Over(TeeToFile(slog.NewTextHandler(&inner, &slog.HandlerOptions{Level: slog.LevelDebug}), &file))
	over.SetLevel(slog.LevelError)
	cmd := over.With("cmd", "ADD")
	cmd.Info("redirect rules programmed")
	cmd.Warn("held back")
	cmd.Error("both")
	if got := inner.String(); strings.Contains(got, "programmed") || strings.Contains(got, "held back") || !strings.Contains(got, "both") {
		t.Fatalf("agent output %q", got)
	}
	if got := file.String(); strings.Count(got, "\n") != 3 || !strings.Contains(got, `"cmd":"ADD"`) {
		t.Fatalf("agent's file part %q", got)
	}
}

// TestPluginFileRotation: the file is created 0600; a line that would take
// it past 10 MB moves it to the one backup first; the agent's and a
// fallback's writers, each opening per line, both write into the current
// file after either rotated it (a handle kept open wrote into the backup).
func TestPluginFileRotation(t *testing.T) {
	dir := t.TempDir()
	agent, fallback := NewPluginFile(dir), NewPluginFile(dir)
	if _, err := agent.Write([]byte("first\n")); err != nil {
		t.Fatal(err)
	}
	path := filepath.Join(dir, PluginLogFile)
	if fi, err := os.Stat(path); err != nil || fi.Mode().Perm() != 0o600 {
		t.Fatalf("mode %v (%v), want 0600", fi.Mode().Perm(), err)
	}
	if err := os.Truncate(path, pluginFileMax-3); err != nil {
		t.Fatal(err)
	}
	if _, err := fallback.Write([]byte("fallback\n")); err != nil {
		t.Fatal(err)
	}
	if _, err := agent.Write([]byte("agent\n")); err != nil {
		t.Fatal(err)
	}
	cur, err := os.ReadFile(path)
	if err != nil || string(cur) != "fallback\nagent\n" {
		t.Fatalf("current file %q (%v)", cur, err)
	}
	if fi, err := os.Stat(path + ".1"); err != nil || fi.Size() != pluginFileMax-3 {
		t.Fatalf("backup: %v (%v)", fi, err)
	}
}

// BenchmarkPluginFileWrite: what the agent adds to a served command per
// line it writes to the plugin log file (open, append, close).
func BenchmarkPluginFileWrite(b *testing.B) {
	f := NewPluginFile(b.TempDir())
	line := []byte(`{"time":"2026-11-29T17:00:00Z","level":"info","msg":"redirect rules programmed","cmd":"ADD","pod":"shop/cart-7d9f8b6c5-x2x9z","containerID":"c1","result":"IPv4:applied"}` + "\n")
	for b.Loop() {
		if _, err := f.Write(line); err != nil {
			b.Fatal(err)
		}
	}
}
