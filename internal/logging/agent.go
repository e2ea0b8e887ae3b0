package logging

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"os"
	"path/filepath"
	"runtime"
	"runtime/debug"
	"strconv"
	"strings"
	"sync"
	"time"
	"unicode"

	"gopkg.in/natefinch/lumberjack.v2"
)

// Options are the logging flags of Istio's components (install-cni
// among them), with Istio's defaults, so that Istio's DaemonSet runs the
// agent unchanged.
type Options struct {
	OutputLevel      string   // --log_output_level
	StacktraceLevel  string   // --log_stacktrace_level
	Caller           string   // --log_caller: scopes whose lines name their source line
	AsJSON           bool     // --log_as_json
	Targets          []string // --log_target: stdout, stderr or file paths
	RotatePath       string   // --log_rotate: a rotating log file besides the targets
	RotateMaxAgeDays int      // --log_rotate_max_age
	RotateMaxSizeMB  int      // --log_rotate_max_size
	RotateMaxBackups int      // --log_rotate_max_backups
}

// DefaultOptions are Istio's defaults: info, text on stdout, no stack
// traces, no rotation.
func DefaultOptions() Options {
	return Options{
		OutputLevel:      ScopeDefault + ":info",
		StacktraceLevel:  ScopeDefault + ":none",
		Targets:          []string{"stdout"},
		RotateMaxAgeDays: 30,
		RotateMaxSizeMB:  100 * 1024 * 1024,
		RotateMaxBackups: 1000,
	}
}

// Root is the agent's logging: one output, levels per scope.
type Root struct {
	levels  Levels
	stack   Levels
	callers map[string]bool
	json    bool
	mu      sync.Mutex
	out     io.Writer
	closers []io.Closer
	// Problems lists what in the options was not understood (and how it
	// was taken), for the start-up log.
	Problems []string
}

// Open sets up the agent's logging. It does not fail: levels it does not
// understand are taken as info, and target files it cannot open are left
// out (stdout if none is left), each listed in Problems.
func Open(o Options, stdout, stderr io.Writer) (*Root, error) {
	r := &Root{levels: ParseLevels(o.OutputLevel), stack: ParseLevels(o.StacktraceLevel), json: o.AsJSON, callers: map[string]bool{}}
	if !r.stack.Has(ScopeDefault) && !r.stack.Has(scopeAll) {
		r.stack.byScope[ScopeDefault] = LevelNone
	}
	for _, p := range r.levels.Problems {
		r.Problems = append(r.Problems, "--log_output_level: "+p)
	}
	for _, p := range r.stack.Problems {
		r.Problems = append(r.Problems, "--log_stacktrace_level: "+p)
	}
	for _, s := range strings.Split(o.Caller, ",") {
		if s = strings.TrimSpace(s); s != "" {
			r.callers[s] = true
		}
	}
	var outs []io.Writer
	for _, t := range o.Targets {
		switch t {
		case "stdout":
			outs = append(outs, stdout)
		case "stderr":
			outs = append(outs, stderr)
		case "":
		default:
			// Group-readable, as log targets have always been made (a node's
			// log shipper may read them by group); tightening that would
			// change behaviour for existing deployments.
			f, err := os.OpenFile(t, os.O_WRONLY|os.O_APPEND|os.O_CREATE, 0o640) //nolint:gosec // G302: 0640 is deliberate, see above
			if err != nil {
				// As Istio's agent, a log file it cannot open does not
				// stop it: said at start-up, and the other targets kept.
				r.Problems = append(r.Problems, fmt.Sprintf("--log_target %s: %v; not logging there", t, err))
				continue
			}
			outs = append(outs, f)
			r.closers = append(r.closers, f)
		}
	}
	if o.RotatePath != "" {
		// The rotating writer opens its file on the first line: tried
		// here, so a file it could never open is left out and said.
		err := os.MkdirAll(filepath.Dir(o.RotatePath), 0o750)
		if err == nil {
			var f *os.File
			if f, err = os.OpenFile(o.RotatePath, os.O_WRONLY|os.O_APPEND|os.O_CREATE, 0o640); err == nil { //nolint:gosec // G302: as the targets, see above
				err = f.Close()
			}
		}
		if err != nil {
			r.Problems = append(r.Problems, fmt.Sprintf("--log_rotate %s: %v; not logging there", o.RotatePath, err))
		} else {
			lj := &lumberjack.Logger{Filename: o.RotatePath, MaxSize: o.RotateMaxSizeMB, MaxAge: o.RotateMaxAgeDays, MaxBackups: o.RotateMaxBackups}
			outs = append(outs, lj)
			r.closers = append(r.closers, lj)
		}
	}
	if len(outs) == 0 {
		// No target left (each failed, or only empty ones were given):
		// stdout rather than nothing.
		outs = append(outs, stdout)
	}
	r.out = io.MultiWriter(outs...)
	return r, nil
}

// Close closes the log files.
func (r *Root) Close() error {
	var errs []error
	for _, c := range r.closers {
		errs = append(errs, c.Close())
	}
	r.closers = nil
	return errors.Join(errs...)
}

// Level is the level of scope.
func (r *Root) Level(scope string) slog.Level { return r.levels.For(scope) }

// Logger is a logger whose lines carry scope and pass at its level.
func (r *Root) Logger(scope string) *slog.Logger {
	return slog.New(&handler{root: r, scope: scope, level: r.levels.For(scope), stack: r.stack.For(scope), caller: r.callers[scope] || r.callers[scopeAll]})
}

type handler struct {
	root   *Root
	scope  string
	level  slog.Level
	stack  slog.Level
	caller bool
	attrs  []slog.Attr // with their group prefix already in the key
	prefix string
}

func (h *handler) Enabled(_ context.Context, lv slog.Level) bool { return lv >= h.level }

func (h *handler) WithAttrs(as []slog.Attr) slog.Handler {
	c := *h
	c.attrs = append(append([]slog.Attr(nil), h.attrs...), flatten(h.prefix, as)...)
	return &c
}

func (h *handler) WithGroup(name string) slog.Handler {
	if name == "" {
		return h
	}
	c := *h
	c.prefix = h.prefix + name + "."
	return &c
}

func flatten(prefix string, as []slog.Attr) []slog.Attr {
	var out []slog.Attr
	for _, a := range as {
		a.Value = a.Value.Resolve()
		if a.Value.Kind() == slog.KindGroup {
			p := prefix
			if a.Key != "" {
				p += a.Key + "."
			}
			out = append(out, flatten(p, a.Value.Group())...)
			continue
		}
		if a.Key == "" {
			continue
		}
		a.Key = prefix + a.Key
		out = append(out, a)
	}
	return out
}

func (h *handler) Handle(_ context.Context, rec slog.Record) error {
	attrs := append([]slog.Attr(nil), h.attrs...)
	var own []slog.Attr
	rec.Attrs(func(a slog.Attr) bool { own = append(own, a); return true })
	attrs = append(attrs, flatten(h.prefix, own)...)
	scope := h.scope
	// A plugin line forwarded by the agent keeps the plugin's scope.
	for i, a := range attrs {
		if a.Key == "scope" {
			scope = a.Value.String()
			attrs = append(attrs[:i:i], attrs[i+1:]...)
			break
		}
	}
	caller := ""
	if h.caller && rec.PC != 0 {
		f, _ := runtime.CallersFrames([]uintptr{rec.PC}).Next()
		caller = filepath.Base(filepath.Dir(f.File)) + "/" + filepath.Base(f.File) + ":" + strconv.Itoa(f.Line)
	}
	stack := ""
	if rec.Level >= h.stack {
		stack = string(debug.Stack())
	}
	t := rec.Time
	if t.IsZero() {
		t = time.Now()
	}
	var b bytes.Buffer
	if h.root.json {
		writeJSON(&b, t, rec.Level, scope, caller, rec.Message, attrs, stack)
	} else {
		writeText(&b, t, rec.Level, scope, caller, rec.Message, attrs, stack)
	}
	h.root.mu.Lock()
	defer h.root.mu.Unlock()
	_, err := h.root.out.Write(b.Bytes())
	return err
}

const timeFormat = "2006-01-02T15:04:05.000000Z"

// writeJSON writes one line shaped like Istio's JSON logs: time, level,
// scope, caller, msg, then the labels.
func writeJSON(b *bytes.Buffer, t time.Time, lv slog.Level, scope, caller, msg string, attrs []slog.Attr, stack string) {
	field := func(k string, v any) {
		if b.Len() > 1 {
			b.WriteByte(',')
		}
		kb, _ := json.Marshal(k)
		vb, err := json.Marshal(v)
		if err != nil {
			vb, _ = json.Marshal(fmt.Sprint(v))
		}
		b.Write(kb)
		b.WriteByte(':')
		b.Write(vb)
	}
	b.WriteByte('{')
	field("time", t.UTC().Format(timeFormat))
	field("level", LevelName(lv))
	field("scope", scope)
	if caller != "" {
		field("caller", caller)
	}
	field("msg", msg)
	for _, a := range attrs {
		field(a.Key, jsonValue(a.Value))
	}
	if stack != "" {
		field("stack", stack)
	}
	b.WriteString("}\n")
}

func jsonValue(v slog.Value) any {
	switch v.Kind() {
	case slog.KindTime:
		return v.Time().UTC().Format(time.RFC3339Nano)
	case slog.KindDuration:
		return v.Duration().String()
	case slog.KindAny:
		if err, ok := v.Any().(error); ok {
			return err.Error()
		}
	}
	return v.Any()
}

// writeText writes Istio's console format: tab-separated time, level,
// scope, caller and message, then the labels as key=value.
func writeText(b *bytes.Buffer, t time.Time, lv slog.Level, scope, caller, msg string, attrs []slog.Attr, stack string) {
	b.WriteString(t.UTC().Format(timeFormat))
	b.WriteByte('\t')
	b.WriteString(LevelName(lv))
	b.WriteByte('\t')
	b.WriteString(scope)
	if caller != "" {
		b.WriteByte('\t')
		b.WriteString(caller)
	}
	b.WriteByte('\t')
	b.WriteString(msg)
	for i, a := range attrs {
		if i == 0 {
			b.WriteByte('\t')
		} else {
			b.WriteByte(' ')
		}
		b.WriteString(a.Key)
		b.WriteByte('=')
		b.WriteString(textValue(a.Value))
	}
	b.WriteByte('\n')
	if stack != "" {
		b.WriteString(stack)
		if !strings.HasSuffix(stack, "\n") {
			b.WriteByte('\n')
		}
	}
}

func textValue(v slog.Value) string {
	var s string
	switch x := jsonValue(v).(type) {
	case string:
		s = x
	case fmt.Stringer:
		s = x.String()
	default:
		if j, err := json.Marshal(x); err == nil && v.Kind() == slog.KindAny {
			s = string(j)
		} else {
			s = fmt.Sprint(x)
		}
	}
	if s == "" || strings.IndexFunc(s, func(r rune) bool { return unicode.IsSpace(r) || r == '"' || r == '=' || !unicode.IsPrint(r) }) >= 0 {
		return strconv.Quote(s)
	}
	return s
}
