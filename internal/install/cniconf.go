// Package install is the node agent's installer: it places the plugin
// binary and kubeconfig on the host and keeps the plugin's entry in the
// node's CNI config, without ever losing what other plugins wrote there.
//
// Each call is one pass over the files and keeps no state: when to pass
// again (file events, resync, back-off) is internal/installloop's.
package install

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"slices"
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
	// Partial: the file is empty or not whole JSON, as a file caught
	// while its writer rewrites it in place is.
	Partial bool
}

// confExts are the names runtimes load configs from (containerd's and
// CRI-O's libcni calls): a .conflist is a plugin list, a .conf or .json one
// plugin's config.
var confExts = []string{".conf", ".conflist", ".json"}

// IsList says whether the runtime reads the file named name as a plugin
// list: by its name, as libcni's callers decide.
func IsList(name string) bool { return strings.HasSuffix(name, ".conflist") }

// FindPrimary returns the config a container runtime would use: the
// lexically first valid .conf, .conflist or .json in dir, by libcni's
// rules. With name set, that file is used (X.conf or X.json and
// X.conflist stand for each other).
// A symbolic link counts as the file it leads to when that is inside dir;
// any other link ends the search with a LinkError, since the runtime may
// well be using it and the agent cannot tell.
func FindPrimary(dir, name string, skip ...string) (string, []Skipped, error) {
	if name != "" {
		for _, cand := range append([]string{name}, alternates(name)...) {
			p := filepath.Join(dir, cand)
			if _, err := os.Lstat(p); err == nil {
				if _, err := ResolveInDir(dir, p); err != nil {
					return "", nil, err
				}
				return p, nil, nil
			}
		}
		return "", nil, fmt.Errorf("%w: %s does not exist in %s", ErrNoPrimary, name, dir)
	}
	files, err := libcni.ConfFiles(dir, confExts)
	if err != nil {
		return "", nil, fmt.Errorf("listing %s: %w", dir, err)
	}
	sort.Strings(files)
	var skipped []Skipped
	for _, f := range files {
		if slices.Contains(skip, f) {
			continue
		}
		resolved, err := ResolveInDir(dir, f)
		var le *LinkError
		switch {
		case errors.As(err, &le):
			return "", skipped, err
		case err != nil:
			skipped = append(skipped, Skipped{File: f, Reason: err.Error()})
			continue
		}
		if reason, partial := invalidReason(resolved, f); reason != "" {
			skipped = append(skipped, Skipped{File: f, Reason: reason, Partial: partial})
			continue
		}
		return f, skipped, nil
	}
	return "", skipped, fmt.Errorf("%w in %s", ErrNoPrimary, dir)
}

// alternates are the names that stand for name: a single plugin's config
// and the list it is wrapped into.
func alternates(name string) []string {
	switch {
	case IsList(name):
		base := strings.TrimSuffix(name, ".conflist")
		return []string{base + ".conf", base + ".json"}
	case strings.HasSuffix(name, ".conf"), strings.HasSuffix(name, ".json"):
		return []string{ListName(name)}
	}
	return nil
}

// ListName is the .conflist a single plugin's config (X.conf, X.json) is
// wrapped into: X.conflist, which the runtime picks before X.json and,
// once X.conf is gone, in its place.
func ListName(name string) string {
	return strings.TrimSuffix(name, filepath.Ext(name)) + ".conflist"
}

// OnlyOurs says whether every plugin of the valid config at path (known
// to the runtime as name) is istio-cni: a network of none, which only a
// standalone config an agent in the other mode left is.
func OnlyOurs(path, name string) bool {
	data, err := readFile(path)
	if err != nil {
		return false
	}
	if !IsList(name) {
		return strings.EqualFold(pluginType(data), PluginType)
	}
	obj, err := parseObject(data)
	if err != nil {
		return false
	}
	_, elems, err := obj.plugins()
	if err != nil || len(elems) == 0 {
		return false
	}
	for _, e := range elems {
		if !strings.EqualFold(pluginType(e.raw), PluginType) {
			return false
		}
	}
	return true
}

// invalidReason applies the validity rules runtimes use (via libcni) to
// the file at path, known to the runtime as name; partial says the file
// is empty or not whole JSON.
func invalidReason(path, name string) (reason string, partial bool) {
	data, err := readFile(path)
	if err != nil {
		return fmt.Sprintf("error reading %s: %v", path, err), false
	}
	partial = !json.Valid(data)
	if IsList(name) {
		list, err := libcni.ConfListFromBytes(data)
		if err != nil {
			return err.Error(), partial
		}
		if len(list.Plugins) == 0 {
			return "the list has no plugins", partial
		}
		return "", false
	}
	// As libcni's deprecated ConfFromFile reads a single-plugin .conf,
	// with the same messages.
	conf, err := libcni.NetworkPluginConfFromBytes(data)
	if err != nil {
		return err.Error(), partial
	}
	if conf.Network.Type == "" {
		return "no type (a plugin list saved as " + filepath.Ext(name) + "?)", partial
	}
	return "", false
}

// jfield is one key of a JSON object with the exact bytes of its value
// and where they sit in the document, so a rewrite can change one value
// and leave every other byte (spacing, escapes, number spellings, key
// order) as it was written.
type jfield struct {
	Key   string
	Value json.RawMessage
	// keyStart is the key's opening quote; start and end bound the value.
	keyStart, start, end int
}

// jobject is a document holding one JSON object.
type jobject struct {
	data        []byte
	fields      []jfield
	open, close int // offsets of the braces
}

func isSpace(c byte) bool { return c == ' ' || c == '\t' || c == '\n' || c == '\r' }

// parseObject reads a document holding one JSON object and where each of
// its fields sits. A duplicate key or trailing data is refused: which one
// a runtime would read cannot be known, so the file is not rewritten.
func parseObject(data []byte) (*jobject, error) {
	dec := json.NewDecoder(bytes.NewReader(data))
	dec.UseNumber()
	tok, err := dec.Token()
	if err != nil {
		return nil, err
	}
	if d, ok := tok.(json.Delim); !ok || d != '{' {
		return nil, errors.New("not a JSON object")
	}
	obj := &jobject{data: data, open: int(dec.InputOffset()) - 1}
	prevEnd := obj.open + 1
	seen := map[string]bool{}
	for dec.More() {
		tok, err := dec.Token()
		if err != nil {
			return nil, err
		}
		key := tok.(string)
		keyStart := prevEnd
		for keyStart < len(data) && (isSpace(data[keyStart]) || data[keyStart] == ',') {
			keyStart++
		}
		var raw json.RawMessage
		if err := dec.Decode(&raw); err != nil {
			return nil, fmt.Errorf("value of %q: %w", key, err)
		}
		end := int(dec.InputOffset())
		start := end - len(raw)
		if start < keyStart || !bytes.Equal(data[start:end], raw) || data[keyStart] != '"' {
			return nil, fmt.Errorf("value of %q: cannot locate it in the document", key)
		}
		if seen[key] {
			return nil, fmt.Errorf("duplicate key %q", key)
		}
		seen[key] = true
		obj.fields = append(obj.fields, jfield{Key: key, Value: raw, keyStart: keyStart, start: start, end: end})
		prevEnd = end
	}
	if _, err := dec.Token(); err != nil {
		return nil, err
	}
	obj.close = int(dec.InputOffset()) - 1
	if _, err := dec.Token(); err != io.EOF {
		return nil, errors.New("trailing data after the JSON object")
	}
	return obj, nil
}

func (o *jobject) field(key string) (jfield, bool) {
	for _, f := range o.fields {
		if f.Key == key {
			return f, true
		}
	}
	return jfield{}, false
}

// jelem is one element of a JSON array, located in its document.
type jelem struct {
	raw        json.RawMessage
	start, end int
}

// parseArray reads the array at data[start:end].
func parseArray(data []byte, start, end int) ([]jelem, error) {
	dec := json.NewDecoder(bytes.NewReader(data[start:end]))
	tok, err := dec.Token()
	if err != nil {
		return nil, err
	}
	if d, ok := tok.(json.Delim); !ok || d != '[' {
		return nil, errors.New("not a JSON array")
	}
	var out []jelem
	for dec.More() {
		var raw json.RawMessage
		if err := dec.Decode(&raw); err != nil {
			return nil, err
		}
		e := start + int(dec.InputOffset())
		out = append(out, jelem{raw: raw, start: e - len(raw), end: e})
	}
	if _, err := dec.Token(); err != nil {
		return nil, err
	}
	return out, nil
}

func pluginType(raw json.RawMessage) string {
	var t struct {
		Type string `json:"type"`
	}
	_ = json.Unmarshal(raw, &t)
	return t.Type
}

// plugins finds a list's plugins array and its elements.
func (o *jobject) plugins() (jfield, []jelem, error) {
	f, ok := o.field("plugins")
	if !ok {
		return f, nil, errNoPlugins
	}
	elems, err := parseArray(o.data, f.start, f.end)
	if err != nil {
		return f, nil, fmt.Errorf("plugins: %w", err)
	}
	return f, elems, nil
}

var errNoPlugins = errors.New("existing CNI config has neither type nor plugins")

// Insert returns the config with our entry as the last plugin: a list
// gets every old istio-cni entry removed and ours appended; a single
// .conf is wrapped into a list. Every byte outside the plugins array is
// kept, and inside it every other plugin's bytes; the entry takes the
// file's indentation.
func Insert(existing []byte, entry []byte) ([]byte, error) {
	return insert(existing, entry, false)
}

// InsertInList is Insert for a file the runtime reads as a plugin list
// (.conflist): a top-level "type" there is not a single plugin's, and
// libcni passes over it, so the list is kept a list.
func InsertInList(existing []byte, entry []byte) ([]byte, error) {
	return insert(existing, entry, true)
}

func insert(existing []byte, entry []byte, list bool) ([]byte, error) {
	obj, err := parseObject(existing)
	if err != nil {
		return nil, fmt.Errorf("parsing existing CNI config: %w", err)
	}
	if _, single := obj.field("type"); single && !list {
		return wrapConf(obj, entry)
	}
	f, elems, err := obj.plugins()
	if err != nil {
		return nil, err
	}
	keep := make([]int, 0, len(elems))
	for i, e := range elems {
		if pluginType(e.raw) != PluginType {
			keep = append(keep, i)
		}
	}
	return splice(existing, f, spliceArray(existing, f, elems, keep, entry)), nil
}

// Remove returns the config without any istio-cni entry, and whether one
// was there. Only the entries' bytes (and the separators before them) go.
func Remove(existing []byte) ([]byte, bool, error) {
	obj, err := parseObject(existing)
	if err != nil {
		return nil, false, fmt.Errorf("parsing CNI config: %w", err)
	}
	f, elems, err := obj.plugins()
	if errors.Is(err, errNoPlugins) {
		return existing, false, nil
	}
	if err != nil {
		return nil, false, err
	}
	keep := make([]int, 0, len(elems))
	for i, e := range elems {
		if pluginType(e.raw) != PluginType {
			keep = append(keep, i)
		}
	}
	if len(keep) == len(elems) {
		return existing, false, nil
	}
	return splice(existing, f, spliceArray(existing, f, elems, keep, nil)), true, nil
}

func splice(data []byte, f jfield, value []byte) []byte {
	out := make([]byte, 0, len(data)+len(value))
	out = append(out, data[:f.start]...)
	out = append(out, value...)
	return append(out, data[f.end:]...)
}

// spliceArray rebuilds the array of f from its own bytes: the elements in
// keep with the separators that were before them, then entry (if any)
// after a separator like the array's last one.
func spliceArray(data []byte, f jfield, elems []jelem, keep []int, entry []byte) []byte {
	if len(elems) == 0 {
		if entry == nil {
			return data[f.start:f.end]
		}
		return append(append([]byte{'['}, compact(entry)...), ']')
	}
	// gap(k) is what precedes element k (k == len: what follows the last).
	gap := func(k int) []byte {
		from, to := f.start+1, f.end-1
		if k > 0 {
			from = elems[k-1].end
		}
		if k < len(elems) {
			to = elems[k].start
		}
		return data[from:to]
	}
	if len(keep) == 0 && entry == nil {
		return []byte("[]")
	}
	var b bytes.Buffer
	b.WriteByte('[')
	b.Write(gap(0))
	for i, k := range keep {
		if i > 0 {
			b.Write(gap(k))
		}
		b.Write(data[elems[k].start:elems[k].end])
	}
	if entry != nil {
		sep := append([]byte{','}, gap(0)...)
		if len(elems) > 1 {
			sep = gap(len(elems) - 1)
		}
		if len(keep) > 0 {
			b.Write(sep)
		}
		b.Write(formatEntry(entry, sep, indentUnit(data, elems)))
	}
	b.Write(gap(len(elems)))
	b.WriteByte(']')
	return b.Bytes()
}

func compact(entry []byte) []byte {
	var b bytes.Buffer
	if json.Compact(&b, entry) != nil {
		return entry
	}
	return b.Bytes()
}

// formatEntry lays the entry out as the element after sep would be: on
// one line when the array is on one line, else indented like its
// neighbours.
func formatEntry(entry, sep []byte, unit string) []byte {
	nl := bytes.LastIndexByte(sep, '\n')
	if nl < 0 || unit == "" {
		return compact(entry)
	}
	var b bytes.Buffer
	if json.Indent(&b, entry, string(sep[nl+1:]), unit) != nil {
		return compact(entry)
	}
	return b.Bytes()
}

// indentUnit is the file's indentation step: how much deeper the second
// line of a multi-line plugin is than its first, else the top level's.
func indentUnit(data []byte, elems []jelem) string {
	for _, e := range elems {
		text := data[e.start:e.end]
		i := bytes.IndexByte(text, '\n')
		if i < 0 {
			continue
		}
		inner := leadingSpace(text[i+1:])
		line := bytes.LastIndexByte(data[:e.start], '\n')
		outer := leadingSpace(data[line+1 : e.start])
		if strings.HasPrefix(inner, outer) && len(inner) > len(outer) {
			return inner[len(outer):]
		}
	}
	if i := bytes.IndexByte(data, '\n'); i >= 0 {
		if u := leadingSpace(data[i+1:]); u != "" {
			return u
		}
	}
	return ""
}

func leadingSpace(b []byte) string {
	n := 0
	for n < len(b) && (b[n] == ' ' || b[n] == '\t') {
		n++
	}
	return string(b[:n])
}

// wrapConf turns a single plugin's config into a list of it and our
// entry: the list takes the plugin's network name and cniVersion, and the
// plugin keeps its bytes (re-indented one level deeper).
func wrapConf(obj *jobject, entry []byte) ([]byte, error) {
	data := obj.data
	version := json.RawMessage(`"0.3.1"`)
	name := json.RawMessage(`"k8s-pod-network"`)
	cut := -1
	for i, f := range obj.fields {
		switch f.Key {
		case "cniVersion":
			version, cut = f.Value, i
		case "name":
			name = f.Value
		}
	}
	inner := data[obj.open : obj.close+1]
	if cut >= 0 {
		f := obj.fields[cut]
		from, to := f.keyStart, f.end
		switch {
		case cut > 0:
			from = obj.fields[cut-1].end
		case len(obj.fields) > 1:
			to = obj.fields[1].keyStart
		}
		inner = append(append(append([]byte{}, data[obj.open:from]...), data[to:obj.close]...), '}')
	}
	unit := ""
	if i := bytes.IndexByte(data[obj.open:], '\n'); i >= 0 {
		unit = leadingSpace(data[obj.open+i+1:])
	}
	var b bytes.Buffer
	b.Write(data[:obj.open])
	if unit == "" {
		fmt.Fprintf(&b, `{"cniVersion":%s,"name":%s,"plugins":[%s,%s]}`, version, name, inner, compact(entry))
	} else {
		deep := unit + unit
		fmt.Fprintf(&b, "{\n%s\"cniVersion\": %s,\n%s\"name\": %s,\n%s\"plugins\": [\n%s%s,\n%s%s\n%s]\n}",
			unit, version, unit, name, unit, deep, bytes.ReplaceAll(inner, []byte("\n"), []byte("\n"+deep)),
			deep, formatEntry(entry, []byte(",\n"+deep), unit), unit)
	}
	b.Write(data[obj.close+1:])
	return b.Bytes(), nil
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
	obj, err := parseObject(existing)
	if err != nil {
		return EntryMissing, err
	}
	_, elems, err := obj.plugins()
	if errors.Is(err, errNoPlugins) {
		return EntryMissing, nil
	}
	if err != nil {
		return EntryMissing, err
	}
	count, last := 0, false
	for i, p := range elems {
		if pluginType(p.raw) == PluginType {
			count++
			last = i == len(elems)-1 && SameJSON(p.raw, entry)
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
