package install

import (
	"errors"
	"fmt"
	"log/slog"
	"os"
	"path/filepath"
	"slices"
	"strings"

	"github.com/istio-cni-go/istio-cni/internal/cnirelay"
)

// Config is the installer's part of the agent configuration.
type Config struct {
	// MountedCNINetDir is the host's CNI config dir as mounted in the agent.
	MountedCNINetDir string
	// CNIConfName names the config file to use; empty means discover.
	CNIConfName string
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

// Installer installs, checks and removes the plugin on the node.
type Installer struct {
	cfg Config
	log *slog.Logger
	// confPath is the config file holding our entry, once written.
	confPath string
	entry    []byte
}

// New returns an installer.
func New(cfg Config, log *slog.Logger) *Installer {
	return &Installer{cfg: cfg, log: log, entry: Entry(cfg.Entry)}
}

// ConfPath is the config file that holds our entry ("" before install).
func (in *Installer) ConfPath() string { return in.confPath }

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
	if cur, err := os.ReadFile(path); err == nil && string(cur) == string(data) {
		if fi, err := os.Stat(path); err == nil && fi.Mode().Perm() == in.cfg.KubeconfigMode {
			return false, nil
		}
	}
	if err := os.MkdirAll(in.cfg.RunDir, 0o755); err != nil {
		return false, &StepError{ResultCreateKubeconfig, err}
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

// EnsureConf puts our entry into the node's CNI config if it is missing
// or stale, and reports whether it wrote. ErrNoPrimary means there is no
// primary config yet (chained mode) and the caller should wait.
func (in *Installer) EnsureConf() (bool, error) {
	dir := in.cfg.MountedCNINetDir
	if removed, err := RemoveStaleTemps(dir); err == nil && len(removed) > 0 {
		in.log.Info("removed stale temp files", "files", removed)
	}
	if !in.cfg.Chained {
		name := in.cfg.CNIConfName
		if name == "" {
			name = StandaloneConfName
		}
		path := filepath.Join(dir, name)
		want := StandaloneConf(in.cfg.Entry)
		in.confPath = path
		if cur, err := os.ReadFile(path); err == nil && SameJSON(cur, want) {
			return false, nil
		}
		if err := WriteFileAtomic(path, want, in.createdMode(), false); err != nil {
			return false, &StepError{ResultCreateCNIConfig, err}
		}
		return true, nil
	}
	primary, skipped, err := FindPrimary(dir, in.cfg.CNIConfName)
	for _, s := range skipped {
		in.log.Warn("skipping invalid CNI config, as the runtime does", "file", s.File, "reason", s.Reason)
	}
	if err != nil {
		return false, err
	}
	data, err := os.ReadFile(primary)
	if err != nil {
		return false, &StepError{ResultCreateCNIConfig, err}
	}
	state, err := Inspect(data, in.entry)
	if err != nil {
		return false, &StepError{ResultCreateCNIConfig, fmt.Errorf("%s: %w", primary, err)}
	}
	if state == EntryOK {
		in.confPath = primary
		return false, nil
	}
	merged, err := Insert(data, in.entry)
	if err != nil {
		return false, &StepError{ResultCreateCNIConfig, fmt.Errorf("%s: %w", primary, err)}
	}
	target := primary
	if strings.HasSuffix(primary, ".conf") {
		target = primary + "list"
	}
	// A wrapped .conf keeps its mode; the list is written in full before
	// the .conf goes, so the runtime always has a valid config.
	if target != primary {
		if fi, err := os.Stat(primary); err == nil {
			if err := WriteFileAtomic(target, merged, fi.Mode().Perm(), false); err != nil {
				return false, &StepError{ResultCreateCNIConfig, err}
			}
		}
		if err := os.Remove(primary); err != nil && !errors.Is(err, os.ErrNotExist) {
			return false, &StepError{ResultCreateCNIConfig, err}
		}
		if err := syncDir(dir); err != nil {
			return false, &StepError{ResultCreateCNIConfig, err}
		}
	} else if err := WriteFileAtomic(target, merged, 0o644, true); err != nil {
		return false, &StepError{ResultCreateCNIConfig, err}
	}
	in.confPath = target
	in.log.Info("inserted istio-cni into the CNI config", "file", target, "was", map[EntryState]string{EntryMissing: "missing", EntryStale: "stale"}[state])
	return true, nil
}

// Ready says whether the binary, the kubeconfig and our entry are all in
// place, and if not, what is missing.
func (in *Installer) Ready() error {
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
	if in.confPath == "" {
		return errors.New("CNI config not written yet")
	}
	data, err := os.ReadFile(in.confPath)
	if err != nil {
		return fmt.Errorf("CNI config: %w", err)
	}
	if !in.cfg.Chained {
		return nil
	}
	if st, err := Inspect(data, in.entry); err != nil || st != EntryOK {
		return fmt.Errorf("istio-cni entry missing or stale in %s", in.confPath)
	}
	if primary, _, err := FindPrimary(in.cfg.MountedCNINetDir, in.cfg.CNIConfName); err != nil || primary != in.confPath {
		return fmt.Errorf("%s is no longer the node's primary CNI config", in.confPath)
	}
	return nil
}

// Cleanup removes, in this order, our entry (so no runtime runs a config
// that names a missing binary), the kubeconfig and the binaries. It goes
// on after a failure and reports every one.
func (in *Installer) Cleanup() error {
	var errs []error
	if err := in.removeEntry(); err != nil {
		errs = append(errs, err)
	}
	if err := os.Remove(in.KubeconfigPath()); err != nil && !errors.Is(err, os.ErrNotExist) {
		errs = append(errs, fmt.Errorf("removing %s: %w", in.KubeconfigPath(), err))
	}
	for _, dir := range in.cfg.BinTargetDirs {
		for _, name := range pluginBinaries {
			p := filepath.Join(dir, name)
			if err := os.Remove(p); err != nil && !errors.Is(err, os.ErrNotExist) {
				errs = append(errs, fmt.Errorf("removing %s: %w", p, err))
			}
		}
	}
	return errors.Join(errs...)
}

func (in *Installer) removeEntry() error {
	dir := in.cfg.MountedCNINetDir
	if !in.cfg.Chained {
		name := in.cfg.CNIConfName
		if name == "" {
			name = StandaloneConfName
		}
		p := filepath.Join(dir, name)
		if err := os.Remove(p); err != nil && !errors.Is(err, os.ErrNotExist) {
			return fmt.Errorf("removing %s: %w", p, err)
		}
		return nil
	}
	// Remove the entry from wherever it is now, not only from the file we
	// wrote: the primary may have changed since.
	files, err := filepath.Glob(filepath.Join(dir, "*.conf*"))
	if err != nil {
		return err
	}
	var errs []error
	for _, f := range files {
		if !strings.HasSuffix(f, ".conf") && !strings.HasSuffix(f, ".conflist") {
			continue
		}
		data, err := os.ReadFile(f)
		if err != nil {
			continue
		}
		out, had, err := Remove(data)
		if err != nil || !had {
			continue
		}
		if err := WriteFileAtomic(f, out, 0o644, true); err != nil {
			errs = append(errs, err)
			continue
		}
		in.log.Info("removed istio-cni from the CNI config", "file", f)
	}
	return errors.Join(errs...)
}
