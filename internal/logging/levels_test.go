package logging

import (
	"bytes"
	"encoding/json"
	"log/slog"
	"os"
	"path/filepath"
	"strings"
	"testing"
)

// Every level spelling Istio's tooling writes, plain or scoped, maps to a
// level; none fails.
func TestPluginLevel(t *testing.T) {
	for in, want := range map[string]slog.Level{
		"": slog.LevelInfo, "debug": slog.LevelDebug, "info": slog.LevelInfo, "warn": slog.LevelWarn, "warning": slog.LevelWarn,
		"error": slog.LevelError, "fatal": slog.LevelError, "panic": slog.LevelError, "none": LevelNone, "DEBUG": slog.LevelDebug,
		"default:info":                  slog.LevelInfo,
		"default:warn":                  slog.LevelWarn,
		"cni:debug,default:warn":        slog.LevelDebug,
		"default:warn,cni-plugin:debug": slog.LevelDebug,
		"cni-plugin:error,cni:debug":    slog.LevelError,
		"all:debug":                     slog.LevelDebug,
		"all:debug,cni-plugin:none":     LevelNone,
		"default:info,ads:debug":        slog.LevelInfo,
	} {
		lv, ok := PluginLevel(in)
		if lv != want || !ok {
			t.Errorf("PluginLevel(%q) = %v, %v; want %v, true", in, lv, ok, want)
		}
	}
	for in, want := range map[string]slog.Level{"verbose": slog.LevelInfo, "default:loud": slog.LevelInfo, "a:b:c,cni-plugin:warn": slog.LevelWarn, ":debug": slog.LevelInfo} {
		lv, ok := PluginLevel(in)
		if lv != want || ok {
			t.Errorf("PluginLevel(%q) = %v, %v; want %v, false", in, lv, ok, want)
		}
	}
}

func TestLevelsByScope(t *testing.T) {
	l := ParseLevels("default:warn,cni-plugin:debug")
	if l.For(ScopeAgent) != slog.LevelWarn || l.For(ScopePlugin) != slog.LevelDebug || l.For("repair") != slog.LevelWarn {
		t.Fatalf("levels: agent %v plugin %v", l.For(ScopeAgent), l.For(ScopePlugin))
	}
	if LevelName(ParseLevels("none").For(ScopeAgent)) != "none" || LevelName(slog.LevelDebug) != "debug" {
		t.Fatal("level names")
	}
}

func TestAgentLogFormats(t *testing.T) {
	var out, errOut bytes.Buffer
	r, err := Open(Options{OutputLevel: "default:warn,cni-plugin:debug", Targets: []string{"stdout"}}, &out, &errOut)
	if err != nil {
		t.Fatal(err)
	}
	r.Logger(ScopeAgent).Info("hidden")
	r.Logger(ScopeAgent).Warn("agent line", "path", "/etc/cni/net.d", "why", "two words")
	r.Logger(ScopePlugin).Debug("plugin line", "pod", "ns/p")
	lines := strings.Split(strings.TrimSpace(out.String()), "\n")
	if len(lines) != 2 || errOut.Len() != 0 {
		t.Fatalf("want 2 lines on stdout, got %q (stderr %q)", out.String(), errOut.String())
	}
	f := strings.Split(lines[0], "\t")
	if len(f) != 5 || f[1] != "warn" || f[2] != ScopeAgent || f[3] != "agent line" || f[4] != `path=/etc/cni/net.d why="two words"` {
		t.Fatalf("text line %q", lines[0])
	}
	if f := strings.Split(lines[1], "\t"); f[1] != "debug" || f[2] != ScopePlugin || f[4] != "pod=ns/p" {
		t.Fatalf("plugin line %q", lines[1])
	}

	out.Reset()
	r, err = Open(Options{OutputLevel: "info", AsJSON: true, Caller: "cni-agent", StacktraceLevel: "default:error", Targets: []string{"stderr"}}, &errOut, &out)
	if err != nil {
		t.Fatal(err)
	}
	r.Logger(ScopeAgent).With("scope", ScopePlugin).Error("boom", "n", 3)
	var m map[string]any
	if err := json.Unmarshal(out.Bytes(), &m); err != nil {
		t.Fatalf("not one JSON line: %q", out.String())
	}
	if m["level"] != "error" || m["scope"] != ScopePlugin || m["msg"] != "boom" || m["n"] != float64(3) ||
		!strings.HasPrefix(m["caller"].(string), "logging/levels_test.go:") || !strings.Contains(m["stack"].(string), "TestAgentLogFormats") {
		t.Fatalf("JSON line %v", m)
	}
}

func TestAgentLogFiles(t *testing.T) {
	dir := t.TempDir()
	target, rot := filepath.Join(dir, "target.log"), filepath.Join(dir, "sub", "rotating.log")
	var out bytes.Buffer
	r, err := Open(Options{Targets: []string{target}, RotatePath: rot, RotateMaxSizeMB: 1}, &out, &out)
	if err != nil {
		t.Fatal(err)
	}
	r.Logger(ScopeAgent).Info("to files")
	if err := r.Close(); err != nil {
		t.Fatal(err)
	}
	for _, p := range []string{target, rot} {
		b, err := os.ReadFile(p)
		if err != nil || !strings.Contains(string(b), "to files") {
			t.Errorf("%s: %q %v", p, b, err)
		}
	}
	if out.Len() != 0 {
		t.Errorf("stdout not a target, yet written: %q", out.String())
	}
	// As Istio's agent, a target it cannot open does not stop it: named
	// in Problems, and with no target left, stdout.
	r, err = Open(Options{Targets: []string{filepath.Join(dir, "missing", "x.log")}}, &out, &out)
	if err != nil || len(r.Problems) != 1 || !strings.Contains(r.Problems[0], "--log_target") {
		t.Fatalf("unwritable target: %v, problems %q", err, r.Problems)
	}
	r.Logger(ScopeAgent).Info("still logged")
	if !strings.Contains(out.String(), "still logged") {
		t.Fatalf("nothing on stdout with the only target unwritable: %q", out.String())
	}
	// A rotating file whose directory exists but which cannot be opened
	// (here: a directory of that name) is found at start, not lost at the
	// first line.
	out.Reset()
	notAFile := filepath.Join(dir, "a-dir.log")
	if err := os.Mkdir(notAFile, 0o750); err != nil {
		t.Fatal(err)
	}
	r, err = Open(Options{Targets: []string{filepath.Join(dir, "missing", "x.log")}, RotatePath: notAFile}, &out, &out)
	if err != nil || len(r.Problems) != 2 || !strings.Contains(strings.Join(r.Problems, "\n"), "--log_rotate") {
		t.Fatalf("unwritable target and rotate file: %v, problems %q", err, r.Problems)
	}
	r.Logger(ScopeAgent).Info("on stdout")
	if !strings.Contains(out.String(), "on stdout") {
		t.Fatalf("nothing on stdout with every file unwritable: %q", out.String())
	}
}
