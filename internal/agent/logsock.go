package agent

import (
	"context"
	"encoding/json"
	"errors"
	"io"
	"log/slog"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"sort"
	"strings"
	"time"
)

// LogSocketName is the socket plugin processes send their log lines to.
const LogSocketName = "log.sock"

// serveLogSocket receives plugin log lines (POST /log, a JSON array of
// JSON lines) and re-emits each through log (the agent's cni-plugin
// scope), so plugin activity shows in `kubectl logs` of the agent.
func serveLogSocket(ctx context.Context, runDir string, log *slog.Logger) error {
	path := filepath.Join(runDir, LogSocketName)
	// Plugins run as root too, but keep the socket usable whatever the
	// runtime's umask was.
	l, err := listenSocket(path, 0o666)
	if err != nil {
		return err
	}
	mux := http.NewServeMux()
	mux.HandleFunc("/log", func(w http.ResponseWriter, r *http.Request) {
		if r.Method != http.MethodPost {
			w.WriteHeader(http.StatusMethodNotAllowed)
			return
		}
		body, err := io.ReadAll(io.LimitReader(r.Body, 1<<20))
		if err != nil {
			w.WriteHeader(http.StatusBadRequest)
			return
		}
		var lines []string
		if err := json.Unmarshal(body, &lines); err != nil {
			w.WriteHeader(http.StatusBadRequest)
			return
		}
		for _, line := range lines {
			emitPluginLine(log, line)
		}
	})
	srv := &http.Server{Handler: mux, ReadHeaderTimeout: 5 * time.Second}
	go func() { _ = srv.Serve(l) }()
	go func() {
		<-ctx.Done()
		_ = srv.Close()
		_ = os.Remove(path)
	}()
	return nil
}

func emitPluginLine(log *slog.Logger, line string) {
	var entry map[string]any
	if err := json.Unmarshal([]byte(line), &entry); err != nil {
		log.Info(strings.TrimSpace(line))
		return
	}
	msg, _ := entry["msg"].(string)
	level := slog.LevelInfo
	switch entry["level"] {
	case "debug":
		level = slog.LevelDebug
	case "warn", "warning":
		level = slog.LevelWarn
	case "error", "fatal":
		level = slog.LevelError
	}
	// In the plugin's own order where it can be known: JSON objects have
	// none, so sorted, with the pod first.
	keys := make([]string, 0, len(entry))
	for k := range entry {
		keys = append(keys, k)
	}
	sort.Slice(keys, func(i, j int) bool {
		if (keys[i] == "pod") != (keys[j] == "pod") {
			return keys[i] == "pod"
		}
		return keys[i] < keys[j]
	})
	attrs := make([]any, 0, 2*len(entry))
	for _, k := range keys {
		v := entry[k]
		switch k {
		case "msg", "level":
			continue
		case "time":
			k = "pluginTime"
		}
		attrs = append(attrs, k, v)
	}
	log.Log(context.Background(), level, strings.TrimSpace(msg), attrs...)
}

// listenSocket listens on path, replacing a socket a previous agent left
// there, with mode set explicitly so the umask does not decide who may
// connect.
func listenSocket(path string, mode os.FileMode) (*net.UnixListener, error) {
	if err := os.Remove(path); err != nil && !errors.Is(err, os.ErrNotExist) {
		return nil, err
	}
	l, err := net.ListenUnix("unix", &net.UnixAddr{Name: path, Net: "unix"})
	if err != nil {
		return nil, err
	}
	if err := os.Chmod(path, mode); err != nil {
		_ = l.Close()
		return nil, err
	}
	return l, nil
}
