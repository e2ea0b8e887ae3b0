// Package logging gives the plugin structured JSON logs on stderr (stdout
// belongs to the CNI result) and forwards them to the node agent's log
// socket, so plugin lines show up in the agent's output.
package logging

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"io"
	"log/slog"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"time"
)

// SocketName is the agent's log socket in the run directory.
const SocketName = "log.sock"

// Logger is a slog logger that also keeps its lines for forwarding.
type Logger struct {
	*slog.Logger
	level *slog.LevelVar
	// kept is the level lines are formatted and kept at: the plugin's,
	// or info when that is above it, because the run directory's log file
	// takes info and above whatever plugin_log_level says, as Istio's.
	kept  *slog.LevelVar
	mu    sync.Mutex
	lines []keptLine
}

type keptLine struct {
	text  string
	level slog.Level
}

type teeWriter struct {
	out io.Writer
	l   *Logger
}

func (w *teeWriter) Write(p []byte) (int, error) {
	line := keptLine{text: strings.TrimRight(string(p), "\n")}
	line.level = lineLevel(line.text)
	w.l.mu.Lock()
	w.l.lines = append(w.l.lines, line)
	w.l.mu.Unlock()
	if line.level < w.l.level.Level() {
		return len(p), nil
	}
	return w.out.Write(p)
}

// lineLevel is the level of one of the logger's own JSON lines.
func lineLevel(line string) slog.Level {
	var head struct{ Level string }
	var lv slog.Level
	if json.Unmarshal([]byte(line), &head) != nil || lv.UnmarshalText([]byte(head.Level)) != nil {
		return slog.LevelError
	}
	return lv
}

// New returns a logger writing JSON lines to out at info level.
func New(out io.Writer) *Logger {
	l := &Logger{level: new(slog.LevelVar), kept: new(slog.LevelVar)}
	// Lower-case levels, as Istio's agent expects from its plugin.
	h := slog.NewJSONHandler(&teeWriter{out: out, l: l}, jsonOptions(l.kept))
	l.Logger = slog.New(h)
	return l
}

// SetLevel changes the level of an existing logger.
func (l *Logger) SetLevel(lv slog.Level) {
	l.level.Set(lv)
	if l.kept != nil {
		l.kept.Set(min(lv, slog.LevelInfo))
	}
}

// Forward sends the lines logged so far to the agent socket, if there is
// one, as one POST of a JSON array of lines, and does not wait for the
// agent to read it: the fallback that forwards them often runs because
// the agent is slow to answer, and the pod's ADD waits for the fallback
// to exit. The kernel keeps the request for the agent (a few kilobytes,
// well within a socket's buffer). It never fails the plugin: the lines
// are already on stderr.
func (l *Logger) Forward(socketPath string, timeout time.Duration) error {
	l.mu.Lock()
	var lines []string
	for _, line := range l.lines {
		if line.level >= l.level.Level() {
			lines = append(lines, line.text)
		}
	}
	l.lines = nil
	l.mu.Unlock()
	if len(lines) == 0 {
		return nil
	}
	if _, err := os.Stat(socketPath); err != nil {
		return nil
	}
	body, err := json.Marshal(lines)
	if err != nil {
		return err
	}
	req, err := http.NewRequest(http.MethodPost, "http://unix/log", bytes.NewReader(body))
	if err != nil {
		return err
	}
	req.Header.Set("Content-Type", "application/json")
	req.Close = true
	conn, err := net.DialTimeout("unix", socketPath, timeout)
	if err != nil {
		return err
	}
	defer conn.Close()
	if timeout > 0 {
		_ = conn.SetWriteDeadline(time.Now().Add(timeout))
	}
	return req.Write(conn)
}

// Over returns a logger that writes through h (the node agent's own
// logger, when it serves a plugin command in-process) and whose level the
// plugin's config sets, like a plugin process's. Nothing is kept for
// forwarding. The level does not hold back h's part for the plugin's log
// file (TeeToFile), which takes info and above whatever the level, as a
// plugin process's file does.
func Over(h slog.Handler) *Logger {
	l := &Logger{level: new(slog.LevelVar)}
	if t, ok := h.(*fileTee); ok {
		l.Logger = slog.New(&fileTee{inner: &levelHandler{level: l.level, h: t.inner}, file: t.file})
		return l
	}
	l.Logger = slog.New(&levelHandler{level: l.level, h: h})
	return l
}

type levelHandler struct {
	level *slog.LevelVar
	h     slog.Handler
}

func (h *levelHandler) Enabled(ctx context.Context, lv slog.Level) bool {
	return lv >= h.level.Level() && h.h.Enabled(ctx, lv)
}

func (h *levelHandler) Handle(ctx context.Context, r slog.Record) error { return h.h.Handle(ctx, r) }

func (h *levelHandler) WithAttrs(as []slog.Attr) slog.Handler {
	return &levelHandler{level: h.level, h: h.h.WithAttrs(as)}
}

func (h *levelHandler) WithGroup(name string) slog.Handler {
	return &levelHandler{level: h.level, h: h.h.WithGroup(name)}
}

// PluginLogFile is the plugin's log file in the run directory, as Istio's
// plugin keeps it: JSON lines at info and above, rotated at 10 MB with one
// backup (PluginLogFile + ".1").
const PluginLogFile = "istio-cni.log"

// pluginFileMax is the size at which the plugin's log file is rotated.
const pluginFileMax = 10 << 20

// PluginFile appends to the run directory's plugin log file. Every Write
// opens, appends and closes, as each plugin process does: the agent and
// the fallback processes write the one file, and a handle kept open
// would go on writing into a file another process had rotated away (and
// then removed). Each Write is one line.
type PluginFile struct{ path string }

// NewPluginFile is the plugin log file of runDir.
func NewPluginFile(runDir string) *PluginFile {
	return &PluginFile{path: filepath.Join(runDir, PluginLogFile)}
}

// Write appends p (created 0600), first moving a file that p would take
// past 10 MB to the backup, replacing the one before.
func (f *PluginFile) Write(p []byte) (int, error) {
	if fi, err := os.Stat(f.path); err == nil && fi.Size()+int64(len(p)) > pluginFileMax {
		_ = os.Rename(f.path, f.path+".1")
	}
	out, err := os.OpenFile(f.path, os.O_WRONLY|os.O_APPEND|os.O_CREATE, 0o600)
	if err != nil {
		return 0, err
	}
	n, err := out.Write(p)
	return n, errors.Join(err, out.Close())
}

// jsonOptions are the plugin's JSON lines': Istio's lower-case levels.
func jsonOptions(level slog.Leveler) *slog.HandlerOptions {
	return &slog.HandlerOptions{
		Level: level,
		ReplaceAttr: func(_ []string, a slog.Attr) slog.Attr {
			if a.Key == slog.LevelKey {
				return slog.String(slog.LevelKey, strings.ToLower(a.Value.String()))
			}
			return a
		},
	}
}

// TeeToFile returns a handler that passes what inner takes to inner, and
// every record at info and above, in the plugin's JSON form, to file:
// the agent's lines of the commands it serves go to the plugin's log file
// whatever the agent's own level.
func TeeToFile(inner slog.Handler, file io.Writer) slog.Handler {
	return &fileTee{inner: inner, file: slog.NewJSONHandler(file, jsonOptions(slog.LevelInfo))}
}

type fileTee struct{ inner, file slog.Handler }

func (t *fileTee) Enabled(ctx context.Context, lv slog.Level) bool {
	return t.inner.Enabled(ctx, lv) || t.file.Enabled(ctx, lv)
}

// Handle writes the file first: a line seen in the agent's output is in
// the file already.
func (t *fileTee) Handle(ctx context.Context, r slog.Record) error {
	var errs []error
	if t.file.Enabled(ctx, r.Level) {
		errs = append(errs, t.file.Handle(ctx, r.Clone()))
	}
	if t.inner.Enabled(ctx, r.Level) {
		errs = append(errs, t.inner.Handle(ctx, r))
	}
	return errors.Join(errs...)
}

func (t *fileTee) WithAttrs(as []slog.Attr) slog.Handler {
	return &fileTee{inner: t.inner.WithAttrs(as), file: t.file.WithAttrs(as)}
}

func (t *fileTee) WithGroup(name string) slog.Handler {
	return &fileTee{inner: t.inner.WithGroup(name), file: t.file.WithGroup(name)}
}

// WriteKept appends the lines logged so far at info and above to w, as
// the plugin process's part of the run directory's log file.
func (l *Logger) WriteKept(w io.Writer) error {
	l.mu.Lock()
	lines := append([]keptLine(nil), l.lines...)
	l.mu.Unlock()
	var b bytes.Buffer
	for _, line := range lines {
		if line.level < slog.LevelInfo {
			continue
		}
		b.WriteString(line.text)
		b.WriteByte('\n')
	}
	if b.Len() == 0 {
		return nil
	}
	_, err := w.Write(b.Bytes())
	return err
}
