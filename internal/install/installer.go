package install

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"io/fs"
	"log/slog"
	"os"
	"path/filepath"
	"reflect"
	"slices"
	"strings"
	"syscall"
	"time"

	"github.com/istio-cni-go/istio-cni/internal/cnirelay"
)

// Config is the installer's part of the agent configuration.
type Config struct {
	// MountedCNINetDir is the host's CNI config dir as mounted in the agent.
	MountedCNINetDir string
	// CNIConfName names the config file to use; empty means discover.
	CNIConfName string
	// IstioOwnedConfName names the conflist Istio's agent writes in
	// ambient mode with ISTIO_OWNED_CNI_CONFIG (a copy of the primary with
	// its entry, sorted first). One it left behind (a regular file holding
	// an istio-cni entry that is not this agent's) is not taken for the
	// primary, and is removed once the plugin is in the primary: it would
	// shadow it, a frozen copy, forever.
	IstioOwnedConfName string
	// IstioOwned (ISTIO_OWNED_CNI_CONFIG, chained ambient mode only, as in
	// Istio) leaves the primary config untouched and writes its copy with
	// our entry under IstioOwnedConfName, which sorts first: a primary
	// plugin that rewrites its own file at boot (AWS VPC CNI, Cilium)
	// cannot drop the plugin from what the runtime runs, so no pod starts
	// unmeshed before the agent is back.
	IstioOwned bool
	// Chained inserts into the primary config; false writes a config of
	// our own (for Multus).
	Chained bool
	RunDir  string
	// BinSourceDir holds the binaries to install; BinTargetDirs get them.
	BinSourceDir   string
	BinTargetDirs  []string
	KubeconfigMode os.FileMode
	// ConfGroupRead makes files we create 0640 instead of 0600.
	ConfGroupRead bool
	Kubeconfig    KubeconfigSettings
	Entry         EntrySettings
}

// FallbackBinary is the complete plugin the relay runs when the agent is
// away.
const FallbackBinary = cnirelay.FallbackBinary

// pluginBinaries must all be in place; they are removed in this order, the
// relay first, so it is never there without its fallback.
var pluginBinaries = []string{PluginType, FallbackBinary}

func cmpBool(a, b bool) int {
	switch {
	case a == b:
		return 0
	case a:
		return 1
	}
	return -1
}

// StandaloneConfName is the default file name in standalone mode.
const StandaloneConfName = "YYY-istio-cni.conf"

// Installer installs, checks and removes the plugin on the node. It keeps
// no state between calls: where our entry went is EnsureConf's answer,
// which the caller hands back to Ready and ConfFile.
type Installer struct {
	cfg   Config
	log   *slog.Logger
	entry []byte
}

// Placed is what one EnsureConf pass did.
type Placed struct {
	// Path is the config file that holds our entry; "" when the pass did
	// not get as far as choosing one (the caller keeps the one it had).
	Path string
	// Wrote: the pass wrote the CNI config.
	Wrote bool
	// Source, in IstioOwned mode, is the primary config the copy at Path
	// was made from (its changes are watched).
	Source string
}

// New returns an installer.
func New(cfg Config, log *slog.Logger) *Installer {
	return &Installer{cfg: cfg, log: log, entry: Entry(cfg.Entry)}
}

// ConfFile is the file conf (a Placed.Path) stands for: itself, or the
// file inside the config dir its symbolic link leads to ("" when conf is
// "" or cannot be resolved).
func (in *Installer) ConfFile(conf string) string {
	if conf == "" {
		return ""
	}
	resolved, err := ResolveInDir(in.cfg.MountedCNINetDir, conf)
	if err != nil {
		return ""
	}
	return resolved
}

// Step names, used in errors and as the installs_total result label.
const (
	ResultSuccess          = "SUCCESS"
	ResultCopyBinaries     = "COPY_BINARIES_FAILURE"
	ResultCreateKubeconfig = "CREATE_KUBECONFIG_FAILURE"
	ResultCreateCNIConfig  = "CREATE_CNI_CONFIG_FAILURE"
)

// StepError says which install step failed.
type StepError struct {
	Result string
	Err    error
}

func (e *StepError) Error() string { return e.Err.Error() }
func (e *StepError) Unwrap() error { return e.Err }

// InstallBinaries copies every regular file of the source dir into each
// target dir, after removing temp files a crash may have left.
func (in *Installer) InstallBinaries() error {
	entries, err := os.ReadDir(in.cfg.BinSourceDir)
	if err != nil {
		return &StepError{ResultCopyBinaries, fmt.Errorf("reading %s: %w", in.cfg.BinSourceDir, err)}
	}
	// The relay (istio-cni) goes in last: from then on a runtime may run
	// it, and it needs the fallback beside it when the agent is away.
	slices.SortStableFunc(entries, func(a, b os.DirEntry) int {
		return cmpBool(a.Name() == PluginType, b.Name() == PluginType)
	})
	for _, dir := range in.cfg.BinTargetDirs {
		if removed, err := RemoveStaleTemps(dir); err != nil {
			return &StepError{ResultCopyBinaries, hintReadOnly(fmt.Errorf("cleaning %s: %w", dir, err))}
		} else if len(removed) > 0 {
			in.log.Info("removed stale temp files", "files", removed)
		}
		for _, e := range entries {
			// Follow links: images often link binaries into place.
			if fi, err := os.Stat(filepath.Join(in.cfg.BinSourceDir, e.Name())); err != nil || !fi.Mode().IsRegular() {
				continue
			}
			dst := filepath.Join(dir, e.Name())
			changed, err := CopyFileAtomic(filepath.Join(in.cfg.BinSourceDir, e.Name()), dst, 0o755)
			if err != nil {
				return &StepError{ResultCopyBinaries, hintReadOnly(err)}
			}
			if changed {
				in.log.Info("installed binary", "path", dst)
			}
		}
	}
	return nil
}

func hintReadOnly(err error) error {
	if strings.Contains(err.Error(), "read-only file system") {
		return fmt.Errorf("%w (this platform may need another CNI bin dir: set cniBinDir, or global.platform, in the chart)", err)
	}
	return err
}

// KubeconfigPath is where the plugin's kubeconfig goes.
func (in *Installer) KubeconfigPath() string {
	return filepath.Join(in.cfg.RunDir, KubeconfigName)
}

// WriteKubeconfig (re)writes the plugin's kubeconfig when its content
// changed, e.g. after the projected token rotated.
func (in *Installer) WriteKubeconfig() (bool, error) {
	data, err := BuildKubeconfig(in.cfg.Kubeconfig)
	if err != nil {
		return false, &StepError{ResultCreateKubeconfig, err}
	}
	path := in.KubeconfigPath()
	if cur, err := readFile(path); err == nil && bytes.Equal(cur, data) {
		if fi, err := os.Stat(path); err == nil && fi.Mode().Perm() == in.cfg.KubeconfigMode {
			return false, nil
		}
	}
	if err := os.MkdirAll(in.cfg.RunDir, 0o755); err != nil { //nolint:gosec // G301: Istio's mode for the run dir, which the plugin and host tools read
		return false, &StepError{ResultCreateKubeconfig, err}
	}
	// A crash mid-write left its temp file, credentials and all, where
	// nothing would ever read or remove it.
	if removed, err := RemoveStaleTemps(in.cfg.RunDir); err == nil && len(removed) > 0 {
		in.log.Info("removed stale temp files", "files", removed)
	}
	if err := WriteFileAtomic(path, data, in.cfg.KubeconfigMode, false); err != nil {
		return false, &StepError{ResultCreateKubeconfig, err}
	}
	return true, nil
}

func (in *Installer) createdMode() os.FileMode {
	if in.cfg.ConfGroupRead {
		return 0o640
	}
	return 0o600
}

// unreadableRetry is the pause before a config file that may hold our
// entry but did not read or parse is read again at clean-up: its writer
// may be in the middle of rewriting it in place.
const unreadableRetry = 50 * time.Millisecond

// casAttempts bounds how often a config write is redone because another
// writer changed the file meanwhile; past it the pass fails and is
// retried later, like any failed pass.
const casAttempts = 20

// owner is a file's mode and owner, kept when it is rewritten.
func owner(path string) (os.FileMode, int, int, error) {
	fi, err := os.Stat(path)
	if err != nil {
		return 0, -1, -1, err
	}
	uid, gid := -1, -1
	if st, ok := fi.Sys().(*syscall.Stat_t); ok {
		uid, gid = int(st.Uid), int(st.Gid)
	}
	return fi.Mode().Perm(), uid, gid, nil
}

// EnsureConf puts our entry into the node's CNI config if it is missing
// or stale, and reports where it is and whether it wrote. ErrNoPrimary means there is no
// primary config yet (chained mode) and the caller should wait. Every
// write is a compare-and-swap: when the file changes between our read and
// our write (its owner rewrote it), the pass starts over from the new
// content instead of writing over it.
func (in *Installer) EnsureConf() (Placed, error) {
	dir := in.cfg.MountedCNINetDir
	if removed, err := RemoveStaleTemps(dir); err == nil && len(removed) > 0 {
		in.log.Info("removed stale temp files", "files", removed)
	}
	var placed Placed
	for attempt := 0; attempt < casAttempts; attempt++ {
		var p Placed
		var err error
		if in.cfg.Chained {
			p, err = in.ensureChained(dir)
		} else {
			p, err = in.ensureStandalone(dir)
		}
		if p.Path != "" {
			placed.Path, placed.Source = p.Path, p.Source
		}
		placed.Wrote = p.Wrote
		if !errors.Is(err, ErrChanged) {
			return placed, err
		}
		in.log.Debug("the CNI config changed while being rewritten; reading it again", "attempt", attempt+1)
	}
	return Placed{Path: placed.Path, Source: placed.Source}, &StepError{ResultCreateCNIConfig, fmt.Errorf("the CNI config in %s kept changing while being rewritten (%d attempts)", dir, casAttempts)}
}

func (in *Installer) standalonePath(dir string) string {
	name := in.cfg.CNIConfName
	if name == "" {
		name = StandaloneConfName
	}
	return filepath.Join(dir, name)
}

func (in *Installer) ensureStandalone(dir string) (Placed, error) {
	path := in.standalonePath(dir)
	want := StandaloneConf(in.cfg.Entry)
	// The path is ours whatever this pass manages.
	at := func(wrote bool) Placed { return Placed{Path: path, Wrote: wrote} }
	resolved, err := ResolveInDir(dir, path)
	if errors.Is(err, fs.ErrNotExist) {
		if err := CreateExclusive(path, want, in.createdMode(), -1, -1); err != nil {
			return at(false), stepErr(err)
		}
		return at(true), nil
	}
	if err != nil {
		return at(false), stepErr(err)
	}
	cur, err := readFile(resolved)
	if err != nil {
		return at(false), stepErr(err)
	}
	if SameJSON(cur, want) {
		return at(false), nil
	}
	if t := pluginType(cur); t != PluginType {
		return at(false), stepErr(fmt.Errorf("%s holds another network's config (type %q): not overwriting it; set CNI_CONF_NAME to a name of its own", path, t))
	}
	if err := ReplaceIfUnchanged(resolved, cur, want, in.createdMode(), -1, -1); err != nil {
		return at(false), stepErr(err)
	}
	return at(true), nil
}

// stepErr marks a config step's failure for the installs metric; a
// compare-and-swap conflict passes through for the caller to retry.
func stepErr(err error) error {
	if err == nil || errors.Is(err, ErrChanged) {
		return err
	}
	return &StepError{ResultCreateCNIConfig, err}
}

// DefaultIstioOwnedConfName is Istio's ISTIO_OWNED_CNI_CONFIG_FILENAME.
const DefaultIstioOwnedConfName = "02-istio-cni.conflist"

// istioOwnedLeftover is the path of a conflist Istio's agent left under
// IstioOwnedConfName in dir, or "": a regular file holding an istio-cni
// entry other than this agent's, or holding this agent's (the same chart
// values make the same entry) beside another config in dir with the same
// plugins but for the entry, of which it is Istio's copy.
func (in *Installer) istioOwnedLeftover(dir string) string {
	name := in.cfg.IstioOwnedConfName
	if in.cfg.IstioOwned {
		// Our copy goes under our name; one under Istio's default (Istio's
		// agent never read its chart's name for it) or a name set before
		// is a frozen copy.
		name = DefaultIstioOwnedConfName
		if name == in.cfg.IstioOwnedConfName {
			return ""
		}
	}
	if name == "" || name == in.cfg.CNIConfName || filepath.Base(name) != name {
		return ""
	}
	p := filepath.Join(dir, name)
	// A regular file only: a link is the operator's, to a config of theirs.
	if fi, err := os.Lstat(p); err != nil || !fi.Mode().IsRegular() {
		return ""
	}
	data, err := readFile(p)
	if err != nil {
		return ""
	}
	// Istio's entry, not ours: a file this agent put its entry into (it
	// was the runtime's primary, with no other config it is a copy of) is
	// the primary.
	st, err := Inspect(data, in.entry)
	switch {
	case err != nil || st == EntryMissing:
		return ""
	case st == EntryStale || copyOfAnother(dir, p, data):
		return p
	}
	return ""
}

// copyOfAnother reports whether another config file in dir holds the
// plugins of data but for its istio-cni entries.
func copyOfAnother(dir, path string, data []byte) bool {
	want, ok := pluginsBut(data)
	if !ok {
		return false
	}
	var files []string
	for _, ext := range confExts {
		m, err := filepath.Glob(filepath.Join(dir, "*"+ext))
		if err != nil {
			return false
		}
		files = append(files, m...)
	}
	for _, f := range files {
		if f == path {
			continue
		}
		other, err := readFile(f)
		if err != nil {
			continue
		}
		got, ok := pluginsBut(other)
		if !IsList(f) {
			got, ok = singlePlugin(other)
		}
		if ok && reflect.DeepEqual(got, want) {
			return true
		}
	}
	return false
}

// singlePlugin is a single plugin's config as a wrap of it holds it in a
// list: without its cniVersion, which the list carries.
func singlePlugin(data []byte) ([]any, bool) {
	var m map[string]any
	if json.Unmarshal(data, &m) != nil || m["type"] == nil || m["type"] == PluginType {
		return nil, false
	}
	delete(m, "cniVersion")
	return []any{m}, true
}

// pluginsBut is a list's plugins other than istio-cni, decoded.
func pluginsBut(data []byte) ([]any, bool) {
	var list struct {
		Plugins []map[string]any `json:"plugins"`
	}
	if json.Unmarshal(data, &list) != nil || len(list.Plugins) == 0 {
		return nil, false
	}
	var out []any
	for _, p := range list.Plugins {
		if p["type"] != PluginType {
			out = append(out, p)
		}
	}
	return out, len(out) > 0
}

// retireIstioOwned removes the conflist Istio's agent left, once the
// plugin is in the primary config.
func (in *Installer) retireIstioOwned(dir, primary string) {
	p := in.istioOwnedLeftover(dir)
	if p == "" || p == primary {
		return
	}
	if err := os.Remove(p); err != nil && !errors.Is(err, fs.ErrNotExist) {
		in.log.Warn("cannot remove the conflist Istio's agent left; it shadows the primary config", "file", p, "error", err.Error())
		return
	}
	in.log.Info("removed the conflist Istio's agent left (ISTIO_OWNED_CNI_CONFIG); the plugin is in the primary config", "file", p, "primary", primary)
}

// ownedPath is the file the agent owns in IstioOwned mode ("" otherwise).
func (in *Installer) ownedPath(dir string) string {
	if !in.cfg.IstioOwned {
		return ""
	}
	return filepath.Join(dir, in.cfg.IstioOwnedConfName)
}

// ownedContent is what the owned file must hold: the primary's plugins
// with our entry last, as a list (a single plugin's config wrapped), and
// the primary it was made from.
func (in *Installer) ownedContent(dir, primary string) ([]byte, string, error) {
	resolved, err := ResolveInDir(dir, primary)
	if err != nil {
		return nil, "", err
	}
	data, err := readFile(resolved)
	if err != nil {
		return nil, "", err
	}
	insert := Insert
	if IsList(primary) {
		insert = InsertInList
	}
	merged, err := insert(data, in.entry)
	if err != nil {
		return nil, "", fmt.Errorf("%s: %w", primary, err)
	}
	return merged, resolved, nil
}

// ownedSkips are the files FindPrimary passes over in IstioOwned mode:
// our copy, and a frozen copy under Istio's default name.
func (in *Installer) ownedSkips(dir string) []string {
	skip := []string{in.ownedPath(dir)}
	if p := in.istioOwnedLeftover(dir); p != "" {
		skip = append(skip, p)
	}
	return skip
}

// ensureOwned writes the owned file when it does not hold the primary's
// plugins and our entry, and leaves the primary as it is.
func (in *Installer) ensureOwned(dir string) (Placed, error) {
	owned := in.ownedPath(dir)
	primary, skipped, err := in.findPrimary(dir)
	for _, s := range skipped {
		in.log.Warn("skipping invalid CNI config, as the runtime does", "file", s.File, "reason", s.Reason)
	}
	if errors.Is(err, ErrNoPrimary) {
		return Placed{}, err
	}
	var merged []byte
	var source string
	if err == nil {
		merged, source, err = in.ownedContent(dir, primary)
	}
	if errors.Is(err, fs.ErrNotExist) {
		return Placed{}, ErrChanged
	}
	if err != nil {
		return Placed{}, stepErr(err)
	}
	if first, _, ferr := FindPrimary(dir, ""); ferr == nil && first != owned {
		in.log.Warn("the Istio-owned CNI config does not sort first; the runtime uses another file", "owned", owned, "first", first)
	}
	if cur, err := readFile(owned); err == nil && bytes.Equal(cur, merged) {
		// Only once ours is in place: the runtime reads the frozen copy
		// until then.
		in.retireIstioOwned(dir, owned)
		return Placed{Path: owned, Source: source}, nil
	}
	if fi, err := os.Lstat(owned); err == nil && !fi.Mode().IsRegular() {
		return Placed{}, stepErr(fmt.Errorf("%s is not a regular file; the Istio-owned config is written there (ISTIO_OWNED_CNI_CONFIG)", owned))
	}
	if err := WriteFileAtomic(owned, merged, in.createdMode(), false); err != nil {
		return Placed{}, stepErr(err)
	}
	in.log.Info("wrote the Istio-owned CNI config: the primary's plugins and istio-cni", "file", owned, "primary", primary)
	in.retireIstioOwned(dir, owned)
	return Placed{Path: owned, Wrote: true, Source: source}, nil
}

func (in *Installer) ensureChained(dir string) (Placed, error) {
	if in.cfg.IstioOwned {
		return in.ensureOwned(dir)
	}
	primary, skipped, err := in.findPrimary(dir)
	for _, s := range skipped {
		in.log.Warn("skipping invalid CNI config, as the runtime does", "file", s.File, "reason", s.Reason)
	}
	if errors.Is(err, ErrNoPrimary) {
		return Placed{}, err
	}
	if err != nil {
		return Placed{}, stepErr(err)
	}
	resolved, err := ResolveInDir(dir, primary)
	if errors.Is(err, fs.ErrNotExist) {
		return Placed{}, ErrChanged
	}
	if err != nil {
		return Placed{}, stepErr(err)
	}
	data, err := readFile(resolved)
	if errors.Is(err, fs.ErrNotExist) {
		return Placed{}, ErrChanged
	}
	if err != nil {
		return Placed{}, stepErr(err)
	}
	state, err := Inspect(data, in.entry)
	if err != nil {
		return Placed{}, stepErr(fmt.Errorf("%s: %w", primary, err))
	}
	if state == EntryOK {
		in.retireIstioOwned(dir, primary)
		return Placed{Path: primary}, nil
	}
	insert := Insert
	if IsList(primary) {
		insert = InsertInList
	}
	merged, err := insert(data, in.entry)
	if err != nil {
		return Placed{}, stepErr(fmt.Errorf("%s: %w", primary, err))
	}
	mode, uid, gid, err := owner(resolved)
	if err != nil {
		return Placed{}, ErrChanged
	}
	target := primary
	if !IsList(primary) {
		if resolved != primary {
			return Placed{}, stepErr(fmt.Errorf("%s is a symbolic link: a %s is wrapped into a new .conflist, which the link cannot follow; make the primary config a .conflist",
				primary, filepath.Ext(primary)))
		}
		target = ListName(primary)
		if err := in.wrap(primary, target, data, merged, mode, uid, gid); err != nil {
			return Placed{}, stepErr(err)
		}
	} else if err := ReplaceIfUnchanged(resolved, data, merged, mode, uid, gid); err != nil {
		return Placed{}, stepErr(err)
	}
	in.log.Info("inserted istio-cni into the CNI config", "file", target, "was", map[EntryState]string{EntryMissing: "missing", EntryStale: "stale"}[state])
	in.retireIstioOwned(dir, target)
	return Placed{Path: target, Wrote: true}, nil
}

// partialRetries and partialWait bound the wait for a config file that
// sorts before the one found and is empty or not whole JSON: its writer
// (flannel's copy, Calico's os.WriteFile) is rewriting it in place, and
// writing to the next valid file meanwhile would put the entry, or wrap a
// .conf, into a file that is not the node's primary config.
const (
	partialRetries = 3
	partialWait    = 100 * time.Millisecond
)

// findPrimary is FindPrimary with the installer's settings, read again
// while a file before the one found is caught mid-write; a file still
// partial after that is passed over, as the runtime passes over it.
func (in *Installer) findPrimary(dir string) (string, []Skipped, error) {
	for attempt, removed := 0, 0; ; attempt++ {
		skip := []string{in.istioOwnedLeftover(dir)}
		if in.cfg.IstioOwned {
			skip = in.ownedSkips(dir)
		}
		primary, skipped, err := FindPrimary(dir, in.cfg.CNIConfName, skip...)
		partial := slices.ContainsFunc(skipped, func(s Skipped) bool { return s.Partial })
		if partial && attempt < partialRetries {
			waitForWriter()
			continue
		}
		if err != nil || !OnlyOurs(primary, primary) {
			return primary, skipped, err
		}
		// The runtime would run istio-cni alone, with no network, from a
		// standalone config an agent in the other CHAINED_CNI_PLUGIN mode
		// left (clean-up removes it too). A link there is the operator's.
		fi, lerr := os.Lstat(primary)
		if lerr != nil || !fi.Mode().IsRegular() || removed == casAttempts {
			return "", skipped, fmt.Errorf("%s holds istio-cni alone, no network, and sorts first: the runtime would use it; remove it (a standalone config left by an agent in the other chained-cni-plugin mode)", primary)
		}
		if err := os.Remove(primary); err != nil && !errors.Is(err, fs.ErrNotExist) {
			return "", skipped, err
		}
		removed++
		in.log.Info("removed a standalone istio-cni config an agent in the other mode left: the runtime would have used it, with no network", "file", primary)
	}
}

// waitForWriter waits partialWait; tests finish the writer's file instead.
var waitForWriter = func() { time.Sleep(partialWait) } // bounded wait for an in-place writer to finish

// wrap writes the list made of conf (the single plugin's bytes) at list,
// and only then removes conf, so the runtime always has a valid config. An
// existing list is overwritten only when it holds the same network (an
// earlier wrap of this .conf): another network's file is never replaced.
func (in *Installer) wrap(conf, list string, data, merged []byte, mode os.FileMode, uid, gid int) error {
	cur, err := readFile(list)
	switch {
	case errors.Is(err, fs.ErrNotExist):
		err = CreateExclusive(list, merged, mode, uid, gid)
	case err != nil:
		return err
	default:
		if why := otherNetwork(cur, data); why != "" {
			return fmt.Errorf("cannot wrap %s into %s: %s already exists and holds another network (%s); remove one of the two",
				filepath.Base(conf), filepath.Base(list), filepath.Base(list), why)
		}
		resolved, rerr := ResolveInDir(filepath.Dir(list), list)
		if rerr != nil {
			return rerr
		}
		err = ReplaceIfUnchanged(resolved, cur, merged, mode, uid, gid)
	}
	if err != nil {
		return err
	}
	return RemoveIfUnchanged(conf, data)
}

// istioWrapName is the network name Istio's agent gives a .conf it wraps.
const istioWrapName = "k8s-pod-network"

// otherNetwork says why list is not an earlier wrap of conf ("" when it
// is): the same network name (or Istio's wrap's), and one plugin of the
// same type besides ours.
func otherNetwork(list, conf []byte) string {
	var l struct {
		Name    string            `json:"name"`
		Plugins []json.RawMessage `json:"plugins"`
	}
	var c struct {
		Name string `json:"name"`
		Type string `json:"type"`
	}
	if json.Unmarshal(list, &l) != nil || json.Unmarshal(conf, &c) != nil {
		return "it does not parse as a plugin list"
	}
	// Istio's own wrap of the .conf names the list k8s-pod-network; the
	// .conf back again (its writer restarted) replaces that wrap too.
	if l.Name != c.Name && l.Name != istioWrapName {
		return fmt.Sprintf("network %q, not %q", l.Name, c.Name)
	}
	var types []string
	for _, p := range l.Plugins {
		if t := pluginType(p); t != PluginType {
			types = append(types, t)
		}
	}
	if len(types) != 1 || types[0] != c.Type {
		return fmt.Sprintf("plugins %q, not %q", types, c.Type)
	}
	return ""
}

// Ready says whether the binary, the kubeconfig and our entry in conf
// (the last Placed.Path) are all in place, and if not, what is missing.
func (in *Installer) Ready(conf string) error {
	for _, dir := range in.cfg.BinTargetDirs {
		for _, name := range pluginBinaries {
			if _, err := os.Stat(filepath.Join(dir, name)); err != nil {
				return fmt.Errorf("plugin binary: %w", err)
			}
		}
	}
	if _, err := os.Stat(in.KubeconfigPath()); err != nil {
		return fmt.Errorf("kubeconfig: %w", err)
	}
	if conf == "" {
		return errors.New("CNI config not written yet")
	}
	data, err := readFile(conf)
	if err != nil {
		return fmt.Errorf("CNI config: %w", err)
	}
	if !in.cfg.Chained {
		return nil
	}
	if in.cfg.IstioOwned {
		dir := in.cfg.MountedCNINetDir
		if first, _, err := FindPrimary(dir, ""); err != nil || first != conf {
			return fmt.Errorf("%s sorts before %s: the runtime uses it, without istio-cni (ISTIO_OWNED_CNI_CONFIG_FILENAME must sort first)", first, conf)
		}
		// Without the pass's waits and removals: a look only.
		primary, _, err := FindPrimary(dir, in.cfg.CNIConfName, in.ownedSkips(dir)...)
		var want []byte
		if err == nil {
			want, _, err = in.ownedContent(dir, primary)
		}
		if err != nil {
			return fmt.Errorf("the primary CNI config the Istio-owned one copies: %w", err)
		}
		if !bytes.Equal(data, want) {
			return fmt.Errorf("%s does not hold %s's plugins with istio-cni last", conf, primary)
		}
		return nil
	}
	if st, err := Inspect(data, in.entry); err != nil || st != EntryOK {
		return fmt.Errorf("istio-cni entry missing or stale in %s", conf)
	}
	if primary, _, err := FindPrimary(in.cfg.MountedCNINetDir, in.cfg.CNIConfName, in.istioOwnedLeftover(in.cfg.MountedCNINetDir)); err != nil || primary != conf {
		return fmt.Errorf("%s is no longer the node's primary CNI config", conf)
	}
	return nil
}

// CleanupError says which removal step failed and what is left on the
// node because of it.
type CleanupError struct {
	Err  error
	Left []string
}

func (e *CleanupError) Error() string {
	return fmt.Sprintf("%v; left in place so pods can still start: %s", e.Err, strings.Join(e.Left, ", "))
}

func (e *CleanupError) Unwrap() error { return e.Err }

// Cleanup removes, in this order, our entry (so no runtime runs a config
// that names a missing binary), the kubeconfig and the binaries, the relay
// before its fallback. It stops at the first step that fails, so the node
// never holds an entry without the binaries and kubeconfig it needs; the
// error lists what is left.
func (in *Installer) Cleanup() error {
	var bins []string
	for _, dir := range in.cfg.BinTargetDirs {
		for _, name := range pluginBinaries {
			bins = append(bins, filepath.Join(dir, name))
		}
	}
	// left lists the entry's file (if any) and what still exists of the
	// kubeconfig and binaries.
	left := func(entry string) []string {
		var l []string
		if entry != "" {
			l = append(l, "the istio-cni entry in "+entry)
		}
		for _, p := range append([]string{in.KubeconfigPath()}, bins...) {
			if _, err := os.Lstat(p); err == nil {
				l = append(l, p)
			}
		}
		return l
	}
	if file, err := in.removeEntry(); err != nil {
		return &CleanupError{Err: err, Left: left(file)}
	}
	if err := os.Remove(in.KubeconfigPath()); err != nil && !errors.Is(err, os.ErrNotExist) {
		return &CleanupError{Err: fmt.Errorf("removing %s: %w", in.KubeconfigPath(), err), Left: left("")}
	}
	for _, p := range bins {
		if err := os.Remove(p); err != nil && !errors.Is(err, os.ErrNotExist) {
			return &CleanupError{Err: fmt.Errorf("removing %s: %w", p, err), Left: left("")}
		}
	}
	return nil
}

// removeEntry removes our entry from every config file that holds it, in
// either mode: a switch of CHAINED_CNI_PLUGIN during a rollout (which
// keeps the plugin) leaves the other mode's behind, an entry in the
// primary or a standalone file, both naming the binaries about to go.
// Istio's conflist copy goes whole. On failure it names the file whose
// entry is left.
func (in *Installer) removeEntry() (string, error) {
	dir := in.cfg.MountedCNINetDir
	if p := in.ownedPath(dir); p != "" {
		// Ours, whole; a link there is the operator's.
		if fi, err := os.Lstat(p); err == nil && fi.Mode().IsRegular() {
			if err := os.Remove(p); err != nil && !errors.Is(err, os.ErrNotExist) {
				return p, fmt.Errorf("removing %s: %w", p, err)
			}
			in.log.Info("removed the Istio-owned CNI config", "file", p)
		}
	}
	if p := in.istioOwnedLeftover(dir); p != "" {
		if err := os.Remove(p); err != nil && !errors.Is(err, os.ErrNotExist) {
			return p, fmt.Errorf("removing %s: %w", p, err)
		}
		in.log.Info("removed the conflist Istio's agent left (ISTIO_OWNED_CNI_CONFIG)", "file", p)
	}
	// Remove the entry from wherever it is now, not only from the file we
	// wrote: the primary may have changed since.
	files, err := filepath.Glob(filepath.Join(dir, "*.conf*"))
	if err != nil {
		return dir, err
	}
	for _, f := range files {
		if !strings.HasSuffix(f, ".conf") && !strings.HasSuffix(f, ".conflist") {
			continue
		}
		if strings.HasSuffix(f, ".conf") {
			// A standalone config of ours (a .conf of our type) goes whole;
			// a link to one goes (the agent writes through a link within
			// the dir), and so does its target when it is in the dir.
			if fi, err := os.Stat(f); err == nil && fi.Mode().IsRegular() {
				if cur, err := readFile(f); err == nil && pluginType(cur) == PluginType {
					if err := os.Remove(f); err != nil && !errors.Is(err, os.ErrNotExist) {
						return f, fmt.Errorf("removing %s: %w", f, err)
					}
					in.log.Info("removed the standalone istio-cni config", "file", f)
					continue
				}
			}
		}
		resolved, err := ResolveInDir(dir, f)
		if err != nil {
			// Not ours to write: the agent never writes through such a link.
			continue
		}
		removed := false
		for attempt := 0; ; attempt++ {
			data, err := readFile(resolved)
			if errors.Is(err, os.ErrNotExist) {
				break
			}
			var out []byte
			had := false
			if err == nil {
				out, had, err = Remove(data)
			}
			if err != nil {
				// A file caught as its writer rewrites it in place, or
				// one we cannot parse: if it may hold our entry, the
				// binaries it names must stay, so it is read again and
				// then reported, never passed over.
				if data != nil && !bytes.Contains(data, []byte(`"`+PluginType+`"`)) {
					break
				}
				if attempt == casAttempts {
					return f, fmt.Errorf("removing the istio-cni entry from %s: %w", f, err)
				}
				time.Sleep(unreadableRetry)
				continue
			}
			if !had {
				break
			}
			mode, uid, gid, err := owner(resolved)
			if err == nil {
				err = ReplaceIfUnchanged(resolved, data, out, mode, uid, gid)
			}
			if err == nil {
				removed = true
				break
			}
			if !errors.Is(err, ErrChanged) || attempt == casAttempts {
				return f, err
			}
		}
		if removed {
			in.log.Info("removed istio-cni from the CNI config", "file", f)
		}
	}
	return "", nil
}
