// Package install is the node agent's installer: it places the plugin
// binary and kubeconfig on the host and keeps the plugin's entry in the
// node's CNI config, without ever losing what other plugins wrote there.
package install

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"sort"
	"strings"

	"github.com/containernetworking/cni/libcni"
)

// PluginType is the type (and name) of our entry in a CNI config.
const PluginType = "istio-cni"

// ErrNoPrimary means the config dir holds no valid config yet.
var ErrNoPrimary = errors.New("no valid CNI network config found")

// Skipped is a config file passed over during discovery, and why.
type Skipped struct {
	File, Reason string
}

// FindPrimary returns the config a container runtime would use: the
// lexically first valid .conf or .conflist in dir, by libcni's rules. With
// name set, that file is used (X.conf and X.conflist stand for each other).
func FindPrimary(dir, name string) (string, []Skipped, error) {
	if name != "" {
		for _, cand := range []string{name, alternate(name)} {
			if cand == "" {
				continue
			}
			p := filepath.Join(dir, cand)
			if _, err := os.Stat(p); err == nil {
				return p, nil, nil
			}
		}
		return "", nil, fmt.Errorf("%w: %s does not exist in %s", ErrNoPrimary, name, dir)
	}
	files, err := libcni.ConfFiles(dir, []string{".conf", ".conflist"})
	if err != nil {
		return "", nil, fmt.Errorf("listing %s: %w", dir, err)
	}
	sort.Strings(files)
	var skipped []Skipped
	for _, f := range files {
		if reason := invalidReason(f); reason != "" {
			skipped = append(skipped, Skipped{File: f, Reason: reason})
			continue
		}
		return f, skipped, nil
	}
	return "", skipped, fmt.Errorf("%w in %s", ErrNoPrimary, dir)
}

func alternate(name string) string {
	switch {
	case strings.HasSuffix(name, ".conflist"):
		return strings.TrimSuffix(name, "list")
	case strings.HasSuffix(name, ".conf"):
		return name + "list"
	}
	return ""
}

// invalidReason applies the validity rules runtimes use (via libcni).
func invalidReason(path string) string {
	if strings.HasSuffix(path, ".conflist") {
		list, err := libcni.ConfListFromFile(path)
		if err != nil {
			return err.Error()
		}
		if len(list.Plugins) == 0 {
			return "the list has no plugins"
		}
		return ""
	}
	conf, err := libcni.ConfFromFile(path)
	if err != nil {
		return err.Error()
	}
	if conf.Network.Type == "" {
		return "no type (a plugin list saved as .conf?)"
	}
	return ""
}

// field is one key of a JSON object with its value kept verbatim, so
// numbers, unknown fields and nested key order survive a rewrite exactly.
type field struct {
	Key   string
	Value json.RawMessage
}

func parseObject(data []byte) ([]field, error) {
	dec := json.NewDecoder(bytes.NewReader(data))
	dec.UseNumber()
	tok, err := dec.Token()
	if err != nil {
		return nil, err
	}
	if d, ok := tok.(json.Delim); !ok || d != '{' {
		return nil, errors.New("not a JSON object")
	}
	var out []field
	seen := map[string]bool{}
	for dec.More() {
		tok, err := dec.Token()
		if err != nil {
			return nil, err
		}
		key := tok.(string)
		var raw json.RawMessage
		if err := dec.Decode(&raw); err != nil {
			return nil, fmt.Errorf("value of %q: %w", key, err)
		}
		if seen[key] {
			return nil, fmt.Errorf("duplicate key %q", key)
		}
		seen[key] = true
		out = append(out, field{key, raw})
	}
	if _, err := dec.Token(); err != nil {
		return nil, err
	}
	if _, err := dec.Token(); err != io.EOF {
		return nil, errors.New("trailing data after the JSON object")
	}
	return out, nil
}

func get(fields []field, key string) (json.RawMessage, bool) {
	for _, f := range fields {
		if f.Key == key {
			return f.Value, true
		}
	}
	return nil, false
}

func without(fields []field, key string) []field {
	out := make([]field, 0, len(fields))
	for _, f := range fields {
		if f.Key != key {
			out = append(out, f)
		}
	}
	return out
}

func encodeObject(fields []field) ([]byte, error) {
	var b bytes.Buffer
	b.WriteByte('{')
	for i, f := range fields {
		if i > 0 {
			b.WriteByte(',')
		}
		k, _ := json.Marshal(f.Key)
		b.Write(k)
		b.WriteByte(':')
		b.Write(f.Value)
	}
	b.WriteByte('}')
	return b.Bytes(), nil
}

func pluginType(raw json.RawMessage) string {
	var t struct {
		Type string `json:"type"`
	}
	_ = json.Unmarshal(raw, &t)
	return t.Type
}

// Insert returns the config with our entry as the last plugin: a list
// gets every old istio-cni entry removed and ours appended; a single
// .conf is wrapped into a list. Everything else is kept as it was.
func Insert(existing []byte, entry []byte) ([]byte, error) {
	top, err := parseObject(existing)
	if err != nil {
		return nil, fmt.Errorf("parsing existing CNI config: %w", err)
	}
	if _, single := get(top, "type"); single {
		version, ok := get(top, "cniVersion")
		if !ok {
			version = json.RawMessage(`"0.3.1"`)
		}
		name, ok := get(top, "name")
		if !ok {
			name = json.RawMessage(`"k8s-pod-network"`)
		}
		inner, err := encodeObject(without(top, "cniVersion"))
		if err != nil {
			return nil, err
		}
		top = []field{{"cniVersion", version}, {"name", name}, {"plugins", json.RawMessage("[]")}}
		return setPlugins(top, []json.RawMessage{inner, entry})
	}
	rawPlugins, ok := get(top, "plugins")
	if !ok {
		return nil, errors.New("existing CNI config has neither type nor plugins")
	}
	var plugins []json.RawMessage
	if err := json.Unmarshal(rawPlugins, &plugins); err != nil {
		return nil, fmt.Errorf("plugins of existing CNI config: %w", err)
	}
	kept := plugins[:0:0]
	for _, p := range plugins {
		if pluginType(p) != PluginType {
			kept = append(kept, p)
		}
	}
	return setPlugins(top, append(kept, entry))
}

// Remove returns the config without any istio-cni entry, and whether one
// was there.
func Remove(existing []byte) ([]byte, bool, error) {
	top, err := parseObject(existing)
	if err != nil {
		return nil, false, fmt.Errorf("parsing CNI config: %w", err)
	}
	rawPlugins, ok := get(top, "plugins")
	if !ok {
		return existing, false, nil
	}
	var plugins []json.RawMessage
	if err := json.Unmarshal(rawPlugins, &plugins); err != nil {
		return nil, false, fmt.Errorf("plugins of CNI config: %w", err)
	}
	kept := plugins[:0:0]
	for _, p := range plugins {
		if pluginType(p) != PluginType {
			kept = append(kept, p)
		}
	}
	if len(kept) == len(plugins) {
		return existing, false, nil
	}
	out, err := setPlugins(top, kept)
	return out, true, err
}

func setPlugins(top []field, plugins []json.RawMessage) ([]byte, error) {
	var list bytes.Buffer
	list.WriteByte('[')
	for i, p := range plugins {
		if i > 0 {
			list.WriteByte(',')
		}
		list.Write(p)
	}
	list.WriteByte(']')
	out := make([]field, len(top))
	copy(out, top)
	for i := range out {
		if out[i].Key == "plugins" {
			out[i].Value = list.Bytes()
		}
	}
	compact, err := encodeObject(out)
	if err != nil {
		return nil, err
	}
	var pretty bytes.Buffer
	if err := json.Indent(&pretty, compact, "", "  "); err != nil {
		return nil, fmt.Errorf("formatting CNI config: %w", err)
	}
	pretty.WriteByte('\n')
	return pretty.Bytes(), nil
}

// EntryState says whether a config holds our entry as it should be.
type EntryState int

const (
	EntryMissing EntryState = iota
	// EntryStale: present but not last, duplicated, or with other settings.
	EntryStale
	EntryOK
)

// Inspect compares a config's istio-cni entries with the wanted entry.
// Istio only checks presence; position and content matter too, since an
// entry that is not last sees another plugin's result, and one with old
// settings misbehaves silently.
func Inspect(existing []byte, entry []byte) (EntryState, error) {
	top, err := parseObject(existing)
	if err != nil {
		return EntryMissing, err
	}
	rawPlugins, ok := get(top, "plugins")
	if !ok {
		return EntryMissing, nil
	}
	var plugins []json.RawMessage
	if err := json.Unmarshal(rawPlugins, &plugins); err != nil {
		return EntryMissing, err
	}
	count, last := 0, false
	for i, p := range plugins {
		if pluginType(p) == PluginType {
			count++
			last = i == len(plugins)-1 && SameJSON(p, entry)
		}
	}
	switch {
	case count == 0:
		return EntryMissing, nil
	case count == 1 && last:
		return EntryOK, nil
	}
	return EntryStale, nil
}

// SameJSON says whether two documents hold the same JSON value, whatever
// their spacing and key order.
func SameJSON(a, b []byte) bool {
	var x, y any
	if json.Unmarshal(a, &x) != nil || json.Unmarshal(b, &y) != nil {
		return false
	}
	xa, _ := json.Marshal(x)
	ya, _ := json.Marshal(y)
	return bytes.Equal(xa, ya)
}
