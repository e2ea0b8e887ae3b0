package logging

import (
	"fmt"
	"log/slog"
	"strings"
)

// LevelNone silences a logger: no record is that severe.
const LevelNone = slog.LevelError + 100

// Scope names, as Istio's install-cni registers them. "cni" is accepted as
// a short name for both in --log_output_level (Istio's docs and values
// files have used it), and "all" sets every scope.
const (
	ScopeDefault = "default"
	ScopeAgent   = "cni-agent"
	ScopePlugin  = "cni-plugin"
	scopeCNI     = "cni"
	scopeAll     = "all"
)

// level maps one level name. Istio's flags know debug, info, warn, error
// and none; its older docs and charts also wrote fatal and panic, which
// mean "errors only" here.
func level(name string) (slog.Level, bool) {
	switch strings.ToLower(strings.TrimSpace(name)) {
	case "debug":
		return slog.LevelDebug, true
	case "info", "":
		return slog.LevelInfo, true
	case "warn", "warning":
		return slog.LevelWarn, true
	case "error", "fatal", "panic", "dpanic":
		return slog.LevelError, true
	case "none", "off":
		return LevelNone, true
	}
	return slog.LevelInfo, false
}

// LevelName is the Istio name of lv, as written into plugin_log_level.
func LevelName(lv slog.Level) string {
	switch {
	case lv >= LevelNone:
		return "none"
	case lv >= slog.LevelError:
		return "error"
	case lv >= slog.LevelWarn:
		return "warn"
	case lv >= slog.LevelInfo:
		return "info"
	}
	return "debug"
}

// Levels are the per-scope levels of Istio's --log_output_level:
// "<scope>:<level>,..." where an entry without a scope is the default
// scope's.
type Levels struct {
	byScope map[string]slog.Level
	// Problems names each entry that was not understood; such an entry
	// leaves its scope at info, it never stops a pod or the agent.
	Problems []string
}

// ParseLevels reads a --log_output_level value (or a plugin_log_level,
// which older charts filled with the same scoped text). It never fails.
func ParseLevels(s string) Levels {
	l := Levels{byScope: map[string]slog.Level{}}
	for _, entry := range strings.Split(s, ",") {
		entry = strings.TrimSpace(entry)
		if entry == "" {
			continue
		}
		scope, name := ScopeDefault, entry
		if i := strings.IndexByte(entry, ':'); i >= 0 {
			scope, name = strings.TrimSpace(entry[:i]), entry[i+1:]
			if scope == "" || strings.Contains(name, ":") {
				l.Problems = append(l.Problems, fmt.Sprintf("%q is not <scope>:<level>", entry))
				continue
			}
		}
		lv, ok := level(name)
		if !ok {
			l.Problems = append(l.Problems, fmt.Sprintf("unknown level %q in %q (want debug, info, warn, error or none); using info", name, entry))
		}
		l.byScope[strings.ToLower(scope)] = lv
	}
	return l
}

// For is the level of scope: its own entry, else the "cni" short name for
// the agent's and the plugin's scopes, else "all", else the default
// scope's, else info. Unlike Istio, where a bare "debug" leaves cni-plugin
// at info, the plugin follows the level asked for unless told otherwise:
// Istio's values files set one level and expect to see the plugin at it.
func (l Levels) For(scope string) slog.Level {
	order := []string{scope}
	if scope == ScopeAgent || scope == ScopePlugin {
		order = append(order, scopeCNI)
	}
	order = append(order, scopeAll, ScopeDefault)
	for _, s := range order {
		if lv, ok := l.byScope[s]; ok {
			return lv
		}
	}
	return slog.LevelInfo
}

// Has reports whether scope has an entry of its own.
func (l Levels) Has(scope string) bool {
	_, ok := l.byScope[scope]
	return ok
}

// PluginLevel is the plugin's level for a plugin_log_level value: a plain
// level, or a scoped list as Istio's tooling writes for
// --log_output_level. ok is false when the value was not fully understood
// (the plugin then logs that once and uses what it could read, else info).
func PluginLevel(s string) (lv slog.Level, ok bool) {
	l := ParseLevels(s)
	return l.For(ScopePlugin), len(l.Problems) == 0
}
