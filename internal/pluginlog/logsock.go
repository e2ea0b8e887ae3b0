// Package pluginlog receives the plugin's log lines on the agent's log
// socket (log.sock) and re-emits them in the agent's cni-plugin scope, so
// plugin activity shows in `kubectl logs` of the agent. A line comes from
// another process and is never trusted to shape the agent's output.
//
// It does not decide the plugin's level (the agent writes that into the
// plugin's config) and does not own the socket mechanics (sockserve).
package pluginlog

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"path/filepath"
	"sort"
	"strings"
	"time"
	"unicode/utf8"

	"github.com/istio-cni-go/istio-cni/internal/sockserve"
)

// SocketName is the socket plugin processes send their log lines to.
const SocketName = "log.sock"

// Limits of the log socket: the fallback plugin posts its lines once, at
// exit, in one request of a few kilobytes.
var socketLimits = sockserve.Limits{MaxConns: 32, ReadTimeout: 5 * time.Second}

// Bounds on what one request may make the agent log.
const (
	maxLogBody     = 1 << 20
	maxPluginLines = 1000
	maxLineBytes   = 16 << 10
	maxLineLabels  = 32
	maxLabelKey    = 64
)

// Serve receives plugin log lines on runDir's log socket (POST /log, a
// JSON array of JSON lines) and re-emits each through log until ctx ends.
// The returned channel is closed once the socket is gone and the server
// has stopped.
func Serve(ctx context.Context, runDir string, log *slog.Logger, m *sockserve.Metrics) (<-chan struct{}, error) {
	srv, err := sockserve.Listen(filepath.Join(runDir, SocketName), socketLimits, log, m)
	if err != nil {
		return nil, err
	}
	mux := http.NewServeMux()
	mux.HandleFunc("/log", func(w http.ResponseWriter, r *http.Request) {
		if r.Method != http.MethodPost {
			w.WriteHeader(http.StatusMethodNotAllowed)
			return
		}
		body, err := io.ReadAll(io.LimitReader(r.Body, maxLogBody))
		if err != nil {
			w.WriteHeader(http.StatusBadRequest)
			return
		}
		var lines []string
		if err := json.Unmarshal(body, &lines); err != nil {
			w.WriteHeader(http.StatusBadRequest)
			return
		}
		if len(lines) > maxPluginLines {
			log.Warn("plugin log lines dropped", "dropped", len(lines)-maxPluginLines)
			lines = lines[:maxPluginLines]
		}
		for _, line := range lines {
			emitPluginLine(log, line)
		}
	})
	return sockserve.ServeSocket(ctx, srv, mux), nil
}

// emitPluginLine re-emits one plugin line. It comes from another process,
// so it is never trusted to shape the agent's output: a message becomes
// one line whatever characters it holds, labels cannot take the agent's
// own keys (scope, time, level, msg, caller, stack), and size and label
// count are bounded.
//
// The line is parsed whole (the request is bounded) and its strings are
// cut after: the longest lines are the failures, whose error carries the
// rules that failed, and a line cut before parsing lost its level and
// came out at info, unseen at warn.
func emitPluginLine(log *slog.Logger, line string) {
	var entry map[string]any
	dec := json.NewDecoder(strings.NewReader(line))
	dec.UseNumber()
	if err := dec.Decode(&entry); err != nil || entry == nil || dec.More() {
		log.Info(oneLine(strings.TrimSpace(bounded(line))))
		return
	}
	msg, _ := entry["msg"].(string)
	msg = bounded(msg)
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
		if k != "msg" && k != "level" {
			keys = append(keys, k)
		}
	}
	sort.Slice(keys, func(i, j int) bool {
		if (keys[i] == "pod") != (keys[j] == "pod") {
			return keys[i] == "pod"
		}
		return keys[i] < keys[j]
	})
	attrs := make([]any, 0, 2*min(len(keys), maxLineLabels)+2)
	// The whole line is bounded too: a label past it is dropped, counted.
	size := len(msg)
	for i, k := range keys {
		v := labelValue(entry[k])
		size += len(k) + len(fmt.Sprint(v))
		if i == maxLineLabels || size > 2*maxLineBytes {
			attrs = append(attrs, "droppedLabels", len(keys)-i)
			break
		}
		attrs = append(attrs, labelKey(k), v)
	}
	log.Log(context.Background(), level, oneLine(strings.TrimSpace(msg)), attrs...)
}

// labelKey makes a plugin's key safe as the agent's label: only letters,
// digits and _.- (so `key=value` output cannot be forged), bounded, and
// never one of the agent's own keys.
func labelKey(k string) string {
	switch k {
	case "time", "scope", "caller", "stack":
		return "plugin" + strings.ToUpper(k[:1]) + k[1:]
	}
	var b strings.Builder
	for _, r := range k {
		if b.Len() >= maxLabelKey {
			break
		}
		if r == '_' || r == '.' || r == '-' || (r >= 'a' && r <= 'z') || (r >= 'A' && r <= 'Z') || (r >= '0' && r <= '9') {
			b.WriteRune(r)
		} else {
			b.WriteByte('_')
		}
	}
	switch b.String() {
	case "", "msg", "level", "time", "scope", "caller", "stack":
		return "plugin_" + b.String()
	}
	return b.String()
}

// labelValue keeps strings on one line; numbers stay as written, and
// other values are re-encoded as JSON, which escapes what needs escaping.
func labelValue(v any) any {
	switch x := v.(type) {
	case string:
		return oneLine(bounded(x))
	case json.Number:
		if len(x) > maxLineBytes {
			return bounded(string(x))
		}
		return x
	}
	if b, err := json.Marshal(v); err == nil && len(b) > maxLineBytes {
		return oneLine(bounded(string(b)))
	}
	return v
}

// bounded cuts s to maxLineBytes, at a character's start, saying how
// much was cut.
func bounded(s string) string {
	if len(s) <= maxLineBytes {
		return s
	}
	cut := maxLineBytes
	for cut > 0 && !utf8.RuneStart(s[cut]) {
		cut--
	}
	return s[:cut] + fmt.Sprintf("... (%d bytes cut)", len(s)-cut)
}

// oneLine escapes what would end or break a log line: control
// characters, Unicode line separators, invalid UTF-8.
func oneLine(s string) string {
	if !utf8.ValidString(s) {
		s = strings.ToValidUTF8(s, "\uFFFD")
	}
	clean := true
	for _, r := range s {
		if r < 0x20 || r == 0x7f || r == 0x2028 || r == 0x2029 || (r >= 0x80 && r < 0xa0) {
			clean = false
			break
		}
	}
	if clean {
		return s
	}
	var b bytes.Buffer
	for _, r := range s {
		switch {
		case r == '\n':
			b.WriteString(`\n`)
		case r == '\r':
			b.WriteString(`\r`)
		case r == '\t':
			b.WriteString(`\t`)
		case r < 0x20 || r == 0x7f || r == 0x2028 || r == 0x2029 || (r >= 0x80 && r < 0xa0):
			fmt.Fprintf(&b, `\u%04x`, r)
		default:
			b.WriteRune(r)
		}
	}
	return b.String()
}
