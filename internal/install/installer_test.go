package install

import (
	"bytes"
	"encoding/json"
	"errors"
	"io"
	"io/fs"
	"log/slog"
	"os"
	"path/filepath"
	"slices"
	"sort"
	"strings"
	"testing"

	"github.com/containernetworking/cni/libcni"
)

// calico is another plugin's entry with settings of its own, which must
// come through every insertion and removal byte for byte.
const calico = `{"type":"calico","log_level":"info","datastore_type":"kubernetes","mtu":0,"ipam":{"type":"calico-ipam"},"policy":{"type":"k8s"},"kubernetes":{"kubeconfig":"/etc/cni/net.d/calico-kubeconfig"}}`

// node is a temp node: a config dir, binaries to install, a service
// account, and an installer for it.
type node struct {
	netDir, bin, run string
	in               *Installer
}

func newNode(t *testing.T, chained bool, files map[string]string) *node {
	t.Helper()
	dir := t.TempDir()
	mk := func(name string) string {
		p := filepath.Join(dir, name)
		if err := os.MkdirAll(p, 0o755); err != nil {
			t.Fatal(err)
		}
		return p
	}
	n := &node{netDir: mk("net.d"), bin: mk("bin"), run: filepath.Join(dir, "run")}
	src, sa := mk("src"), mk("sa")
	all := map[string]string{filepath.Join(src, PluginType): "relay", filepath.Join(src, FallbackBinary): "fallback",
		filepath.Join(sa, "token"): "token", filepath.Join(sa, "ca.crt"): "ca"}
	for name, c := range files {
		all[filepath.Join(n.netDir, name)] = c
	}
	for p, c := range all {
		if err := os.WriteFile(p, []byte(c), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	n.in = New(Config{MountedCNINetDir: n.netDir, Chained: chained, RunDir: n.run, BinSourceDir: src, BinTargetDirs: []string{n.bin},
		KubeconfigMode: 0o600, Kubeconfig: KubeconfigSettings{Host: "10.0.0.1", Port: "443", ServiceAccountDir: sa},
		Entry: EntrySettings{RunDir: n.run, PodNamespace: "istio-system", ExcludeNamespaces: []string{"kube-system"}}},
		slog.New(slog.NewTextHandler(io.Discard, nil)))
	return n
}

// install installs the binaries, the kubeconfig and the config entry, as
// the agent's first pass does, and says where the entry went.
func (n *node) install(t *testing.T) Placed {
	t.Helper()
	if err := n.in.InstallBinaries(); err != nil {
		t.Fatal(err)
	}
	if _, err := n.in.WriteKubeconfig(); err != nil {
		t.Fatal(err)
	}
	placed, err := n.in.EnsureConf()
	if err != nil {
		t.Fatal(err)
	}
	return placed
}

// plugins are a conflist's entries, compacted.
func plugins(t *testing.T, data []byte) []string {
	t.Helper()
	var l struct {
		Plugins []json.RawMessage `json:"plugins"`
	}
	if err := json.Unmarshal(data, &l); err != nil {
		t.Fatalf("not a conflist: %v\n%s", err, data)
	}
	out := make([]string, 0, len(l.Plugins))
	for _, p := range l.Plugins {
		var b bytes.Buffer
		if err := json.Compact(&b, p); err != nil {
			t.Fatal(err)
		}
		out = append(out, b.String())
	}
	return out
}

func read(t *testing.T, path string) []byte {
	t.Helper()
	data, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	return data
}

func conflist(name string, plugins ...string) string {
	return `{"cniVersion":"1.0.0","name":"` + name + `","plugins":[` + strings.Join(plugins, ",") + `]}`
}

// TestInstallerOnTempDir: one pass of every step on a node's files, the
// readiness it leads to, and the clean-up.
func TestInstallerOnTempDir(t *testing.T) {
	staleEntry := string(Entry(EntrySettings{RunDir: "/old/run", PodNamespace: "istio-system"}))
	for _, c := range []struct {
		name    string
		chained bool
		files   map[string]string
		// wantErr is the pass's error; then nothing else is checked.
		wantErr   error
		wantPath  string
		wantWrote bool
		// others are the other plugins wanted before ours, compacted.
		others []string
		// gone are files the pass must have removed.
		gone []string
	}{
		{name: "fresh dir: wait for the primary", chained: true, wantErr: ErrNoPrimary},
		{name: "existing conflist: our entry appended, the rest kept", chained: true,
			files:    map[string]string{"10-calico.conflist": conflist("k8s-pod-network", calico, `{"type":"bandwidth","capabilities":{"bandwidth":true}}`)},
			wantPath: "10-calico.conflist", wantWrote: true,
			others: []string{calico, `{"type":"bandwidth","capabilities":{"bandwidth":true}}`}},
		{name: "our entry stale: rewritten in place", chained: true,
			files:    map[string]string{"10-calico.conflist": conflist("k8s-pod-network", calico, staleEntry)},
			wantPath: "10-calico.conflist", wantWrote: true, others: []string{calico}},
		{name: "a .conf: wrapped into a .conflist", chained: true,
			files:    map[string]string{"10-ptp.conf": `{"cniVersion":"0.3.1","name":"k8s-pod-network","type":"ptp","mtu":1460}`},
			wantPath: "10-ptp.conflist", wantWrote: true, others: []string{`{"name":"k8s-pod-network","type":"ptp","mtu":1460}`}, gone: []string{"10-ptp.conf"}},
		{name: "the first config by name is the primary", chained: true,
			files: map[string]string{"20-other.conflist": conflist("other", `{"type":"ptp"}`),
				"10-calico.conflist": conflist("k8s-pod-network", calico)},
			wantPath: "10-calico.conflist", wantWrote: true, others: []string{calico}},
		{name: "standalone: a config of our own", chained: false,
			files:    map[string]string{"10-calico.conflist": conflist("k8s-pod-network", calico)},
			wantPath: StandaloneConfName, wantWrote: true},
	} {
		t.Run(c.name, func(t *testing.T) {
			n := newNode(t, c.chained, c.files)
			if err := n.in.InstallBinaries(); err != nil {
				t.Fatal(err)
			}
			if changed, err := n.in.WriteKubeconfig(); err != nil || !changed {
				t.Fatalf("kubeconfig: %v %v", changed, err)
			}
			placed, err := n.in.EnsureConf()
			if c.wantErr != nil {
				if !errors.Is(err, c.wantErr) || placed != (Placed{}) {
					t.Fatalf("pass: %+v %v, want %v", placed, err, c.wantErr)
				}
				if n.in.Ready(placed.Path) == nil {
					t.Fatal("ready without a config")
				}
				return
			}
			if err != nil {
				t.Fatal(err)
			}
			want := Placed{Path: filepath.Join(n.netDir, c.wantPath), Wrote: c.wantWrote}
			if placed != want {
				t.Fatalf("placed %+v, want %+v", placed, want)
			}
			if err := n.in.Ready(placed.Path); err != nil {
				t.Fatalf("not ready after the pass: %v", err)
			}
			for _, g := range c.gone {
				if _, err := os.Lstat(filepath.Join(n.netDir, g)); !errors.Is(err, os.ErrNotExist) {
					t.Errorf("%s still there: %v", g, err)
				}
			}
			data := read(t, placed.Path)
			if c.chained {
				got := plugins(t, data)
				if len(got) != len(c.others)+1 || got[len(got)-1] != string(compact(n.in.entry)) {
					t.Fatalf("plugins:\n%s", strings.Join(got, "\n"))
				}
				for i, o := range c.others {
					if got[i] != o {
						t.Errorf("plugin %d changed:\n got %s\nwant %s", i, got[i], o)
					}
				}
			} else if !SameJSON(data, StandaloneConf(n.in.cfg.Entry)) {
				t.Fatalf("standalone config:\n%s", data)
			}
			if fi, err := os.Stat(filepath.Join(n.run, KubeconfigName)); err != nil || fi.Mode().Perm() != 0o600 {
				t.Fatalf("kubeconfig mode: %v %v", fi, err)
			}

			// A second pass finds everything in place and writes nothing.
			again, err := n.in.EnsureConf()
			if err != nil || again != (Placed{Path: placed.Path}) {
				t.Fatalf("second pass: %+v %v", again, err)
			}
			if !bytes.Equal(read(t, placed.Path), data) {
				t.Fatal("a pass with nothing to do changed the file")
			}

			// Removal: our entry, the kubeconfig and the binaries go;
			// everything else stays as it was.
			if err := n.in.Cleanup(); err != nil {
				t.Fatal(err)
			}
			if c.chained {
				got := plugins(t, read(t, placed.Path))
				if strings.Join(got, "\n") != strings.Join(c.others, "\n") {
					t.Fatalf("after removal:\n%s", strings.Join(got, "\n"))
				}
			} else if _, err := os.Lstat(placed.Path); !errors.Is(err, os.ErrNotExist) {
				t.Fatalf("standalone config left: %v", err)
			}
			for name, content := range c.files {
				if filepath.Join(n.netDir, name) == placed.Path || slicesContain(c.gone, name) {
					continue
				}
				if got := string(read(t, filepath.Join(n.netDir, name))); got != content {
					t.Errorf("%s changed:\n%s", name, got)
				}
			}
			for _, p := range []string{filepath.Join(n.run, KubeconfigName), filepath.Join(n.bin, PluginType), filepath.Join(n.bin, FallbackBinary)} {
				if _, err := os.Lstat(p); !errors.Is(err, os.ErrNotExist) {
					t.Errorf("%s left after clean-up: %v", p, err)
				}
			}
			if n.in.Ready(placed.Path) == nil {
				t.Fatal("ready after clean-up")
			}
		})
	}
}

func slicesContain(s []string, v string) bool {
	for _, x := range s {
		if x == v {
			return true
		}
	}
	return false
}

// TestReadyFollowsThePrimary: Ready judges the file it is given, so a
// config that is no longer the primary, or lost our entry, is not ready.
func TestReadyFollowsThePrimary(t *testing.T) {
	n := newNode(t, true, map[string]string{"10-calico.conflist": conflist("k8s-pod-network", calico)})
	placed := n.install(t)
	if err := n.in.Ready(""); err == nil || !strings.Contains(err.Error(), "not written yet") {
		t.Fatalf("ready with no config: %v", err)
	}
	if err := os.WriteFile(filepath.Join(n.netDir, "05-first.conflist"), []byte(conflist("first", `{"type":"ptp"}`)), 0o644); err != nil {
		t.Fatal(err)
	}
	if err := n.in.Ready(placed.Path); err == nil || !strings.Contains(err.Error(), "no longer the node's primary") {
		t.Fatalf("ready with another primary: %v", err)
	}
	if err := os.WriteFile(placed.Path, []byte(conflist("k8s-pod-network", calico)), 0o644); err != nil {
		t.Fatal(err)
	}
	if err := n.in.Ready(placed.Path); err == nil || !strings.Contains(err.Error(), "missing or stale") {
		t.Fatalf("ready without our entry: %v", err)
	}
}

// TestCleanupKeepsBinariesForUnreadableEntry: a config file that holds
// our entry but does not parse for us (here a duplicate top-level key,
// which a runtime takes; or one caught mid-rewrite) fails the clean-up,
// naming the file, and the binaries its entry names stay: removing them
// would fail every pod's ADD on the node. A file without our entry that
// does not parse is none of ours.
func TestCleanupKeepsBinariesForUnreadableEntry(t *testing.T) {
	n := newNode(t, true, map[string]string{
		"10-calico.conflist": `{"cniVersion":"0.3.1","name":"k8s","plugins":[` + calico + `]}`,
		"05-broken.conflist": `{"cniVersion":"0.3.1","name":"x","plugins":[{"type":"ptp"}`,
	})
	placed := n.install(t)
	data := read(t, placed.Path)
	dup := append([]byte(`{"name":"dup",`), data[1:]...)
	if err := os.WriteFile(placed.Path, dup, 0o644); err != nil {
		t.Fatal(err)
	}
	err := n.in.Cleanup()
	var ce *CleanupError
	if !errors.As(err, &ce) || !strings.Contains(err.Error(), placed.Path) {
		t.Fatalf("clean-up: %v, want it to fail naming %s", err, placed.Path)
	}
	for _, p := range []string{filepath.Join(n.bin, PluginType), filepath.Join(n.bin, FallbackBinary), filepath.Join(n.run, KubeconfigName)} {
		if _, err := os.Lstat(p); err != nil {
			t.Errorf("%s removed while an entry naming it is left: %v", p, err)
		}
	}
	if !bytes.Equal(read(t, placed.Path), dup) {
		t.Fatal("the file changed")
	}
}

// TestIstioOwnedLeftoverRetired: the conflist Istio's agent writes in
// ambient mode with ISTIO_OWNED_CNI_CONFIG (a copy of the primary with its
// entry, sorted first), left at an upgrade-style shutdown, is not taken
// for the primary: the plugin goes into the real primary, and then the
// leftover is removed, as it would shadow the primary, frozen, forever.
// A file of that name without an istio-cni entry is none of Istio's.
func TestIstioOwnedLeftoverRetired(t *testing.T) {
	istios := `{"type":"istio-cni","cni_agent_run_dir":"/var/run/istio-cni","plugin_log_level":"info"}`
	n := newNode(t, true, map[string]string{
		"10-calico.conflist":      conflist("k8s-pod-network", calico),
		DefaultIstioOwnedConfName: `{"cniVersion":"0.3.1","name":"k8s-pod-network","plugins":[` + calico + `,` + istios + `]}`,
	})
	n.in.cfg.IstioOwnedConfName = DefaultIstioOwnedConfName
	placed := n.install(t)
	if want := filepath.Join(n.netDir, "10-calico.conflist"); placed.Path != want {
		t.Fatalf("the entry went into %s, want the primary %s", placed.Path, want)
	}
	if _, err := os.Stat(filepath.Join(n.netDir, DefaultIstioOwnedConfName)); !errors.Is(err, fs.ErrNotExist) {
		t.Fatalf("Istio's leftover conflist is still there: %v", err)
	}
	if err := n.in.Ready(placed.Path); err != nil {
		t.Fatalf("not ready: %v", err)
	}

	other := newNode(t, true, map[string]string{
		"10-calico.conflist":      conflist("k8s-pod-network", calico),
		DefaultIstioOwnedConfName: conflist("other", `{"type":"ptp"}`),
	})
	other.in.cfg.IstioOwnedConfName = DefaultIstioOwnedConfName
	// Twice: once the entry is in it, the file holds our entry, which
	// makes it no leftover of Istio's (a second pass deleted it and moved
	// the node to calico's network).
	for pass := 1; pass <= 2; pass++ {
		placed := other.install(t)
		if placed.Path != filepath.Join(other.netDir, DefaultIstioOwnedConfName) {
			t.Fatalf("pass %d: a file of that name without Istio's entry: the entry went into %s, want it (the runtime's primary)", pass, placed.Path)
		}
		if err := other.in.Ready(placed.Path); err != nil {
			t.Fatalf("pass %d: not ready: %v", pass, err)
		}
	}

	// A link of that name is the operator's: never skipped nor removed.
	linked := newNode(t, true, map[string]string{
		"10-calico.conflist": conflist("k8s-pod-network", calico),
		"20-foo.conflist":    `{"cniVersion":"0.3.1","name":"foo","plugins":[{"type":"ptp"},` + istios + `]}`,
	})
	linked.in.cfg.IstioOwnedConfName = DefaultIstioOwnedConfName
	if err := os.Symlink("20-foo.conflist", filepath.Join(linked.netDir, DefaultIstioOwnedConfName)); err != nil {
		t.Fatal(err)
	}
	for pass := 1; pass <= 2; pass++ {
		if placed := linked.install(t); placed.Path != filepath.Join(linked.netDir, DefaultIstioOwnedConfName) {
			t.Fatalf("pass %d: a link of that name: the entry went into %s", pass, placed.Path)
		}
	}
	if _, err := os.Lstat(filepath.Join(linked.netDir, DefaultIstioOwnedConfName)); err != nil {
		t.Fatalf("the operator's link was removed: %v", err)
	}
}

// TestIstioOwnedLeftoverWithOurEntry: Istio's conflist copy holding an
// entry the same as this agent's (the same chart values make the same
// entry) beside the config it copied is still Istio's leftover: the entry
// goes into the real primary and the copy is removed; and a clean-up
// before any pass removes the copy whole, not only its entry (a frozen
// copy of the primary, sorted first, would be the node's config).
func TestIstioOwnedLeftoverWithOurEntry(t *testing.T) {
	files := func(n *node) {
		t.Helper()
		copyOf := `{"cniVersion":"1.0.0","name":"k8s-pod-network","plugins":[` + calico + `,` + string(n.in.entry) + `]}`
		if err := os.WriteFile(filepath.Join(n.netDir, DefaultIstioOwnedConfName), []byte(copyOf), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	primary := conflist("k8s-pod-network", calico)
	n := newNode(t, true, map[string]string{"10-calico.conflist": primary})
	n.in.cfg.IstioOwnedConfName = DefaultIstioOwnedConfName
	files(n)
	placed := n.install(t)
	if want := filepath.Join(n.netDir, "10-calico.conflist"); placed.Path != want {
		t.Fatalf("the entry went into %s, want the primary %s", placed.Path, want)
	}
	if _, err := os.Stat(filepath.Join(n.netDir, DefaultIstioOwnedConfName)); !errors.Is(err, fs.ErrNotExist) {
		t.Fatalf("Istio's copy is still there: %v", err)
	}

	early := newNode(t, true, map[string]string{"10-calico.conflist": primary})
	early.in.cfg.IstioOwnedConfName = DefaultIstioOwnedConfName
	files(early)
	if err := early.in.Cleanup(); err != nil {
		t.Fatal(err)
	}
	entries, _ := os.ReadDir(early.netDir)
	if len(entries) != 1 || entries[0].Name() != "10-calico.conflist" || string(read(t, filepath.Join(early.netDir, "10-calico.conflist"))) != primary {
		t.Fatalf("after clean-up: %v", entries)
	}
}

// TestCleanupAfterModeSwitch: a rollout that switches CHAINED_CNI_PLUGIN
// keeps the plugin, so the old mode's config stays (an entry in the
// primary, or a standalone file); the clean-up at uninstall removes it in
// either mode, leaving no config that names the binaries it removes.
func TestCleanupAfterModeSwitch(t *testing.T) {
	primary := conflist("k8s-pod-network", calico)
	for _, chained := range []bool{false, true} {
		n := newNode(t, chained, map[string]string{"10-calico.conflist": primary})
		other := newNode(t, !chained, nil)
		other.netDir = n.netDir
		other.in.cfg.MountedCNINetDir = n.netDir
		// The old mode's pass, then this mode's.
		if _, err := other.in.EnsureConf(); err != nil {
			t.Fatal(err)
		}
		n.install(t)
		if err := n.in.Cleanup(); err != nil {
			t.Fatalf("chained=%v: %v", chained, err)
		}
		entries, _ := os.ReadDir(n.netDir)
		if len(entries) != 1 || string(read(t, filepath.Join(n.netDir, "10-calico.conflist"))) != primary {
			var names []string
			for _, e := range entries {
				names = append(names, e.Name())
			}
			t.Fatalf("chained=%v: after clean-up %v, primary:\n%s", chained, names, read(t, filepath.Join(n.netDir, "10-calico.conflist")))
		}
	}
}

// TestCleanupRemovesLinkedStandalone: a standalone config that is a link
// within the dir (the agent writes through it) goes at clean-up, with its
// target: neither may name the binaries about to go.
func TestCleanupRemovesLinkedStandalone(t *testing.T) {
	n := newNode(t, false, nil)
	n.install(t)
	p := n.in.standalonePath(n.netDir)
	target := filepath.Join(n.netDir, "real-istio-cni.conf.d")
	if err := os.Rename(p, target); err != nil {
		t.Fatal(err)
	}
	if err := os.Symlink(filepath.Base(target), p); err != nil {
		t.Fatal(err)
	}
	if err := n.in.Cleanup(); err != nil {
		t.Fatal(err)
	}
	if _, err := os.Lstat(p); !errors.Is(err, fs.ErrNotExist) {
		t.Fatalf("the link to the standalone config is left: %v", err)
	}
}

// TestKubeconfigWriteSweepsStaleTemps: the temp file of a kubeconfig
// write a crash interrupted (it holds the token) goes with the next write.
func TestKubeconfigWriteSweepsStaleTemps(t *testing.T) {
	n := newNode(t, true, nil)
	if err := os.MkdirAll(n.run, 0o755); err != nil {
		t.Fatal(err)
	}
	stale := tempName(n.in.KubeconfigPath())
	if err := os.WriteFile(stale, []byte("token: old"), 0o600); err != nil {
		t.Fatal(err)
	}
	if changed, err := n.in.WriteKubeconfig(); err != nil || !changed {
		t.Fatalf("kubeconfig: %v %v", changed, err)
	}
	if _, err := os.Stat(stale); !os.IsNotExist(err) {
		t.Fatalf("the interrupted write's temp file %s is still there: %v", stale, err)
	}
	if _, err := os.Stat(n.in.KubeconfigPath()); err != nil {
		t.Fatal(err)
	}
}

// runtimeTypes are the plugin types the runtime would run from the config
// it picks in dir, read with libcni as containerd's and CRI-O's calls
// read them (a .conflist as a list, any other name as one plugin).
func runtimeTypes(t *testing.T, dir string) (string, []string) {
	t.Helper()
	files, err := libcni.ConfFiles(dir, []string{".conf", ".conflist", ".json"})
	if err != nil {
		t.Fatal(err)
	}
	sort.Strings(files)
	for _, f := range files {
		var types []string
		if strings.HasSuffix(f, ".conflist") {
			list, err := libcni.ConfListFromFile(f)
			if err != nil {
				continue
			}
			for _, p := range list.Plugins {
				types = append(types, p.Network.Type)
			}
		} else {
			data, err := os.ReadFile(f)
			if err != nil {
				continue
			}
			conf, err := libcni.NetworkPluginConfFromBytes(data)
			if err != nil || conf.Network.Type == "" {
				continue
			}
			types = []string{conf.Network.Type}
		}
		if len(types) > 0 {
			return filepath.Base(f), types
		}
	}
	return "", nil
}

// TestJSONPrimary: a .json config is one plugin's to the runtime, which
// picks it before a later .conflist. The entry goes with it: wrapped into
// the .conflist of its name (the .json then goes), ready, and removed
// again at clean-up, leaving the plugin as it was. Istio's agent reads
// only .conf and .conflist and writes the later file, so the runtime
// started pods without redirection while the agent said ready.
func TestJSONPrimary(t *testing.T) {
	n := newNode(t, true, map[string]string{
		"05-bridge.json":     `{"cniVersion":"0.4.0","name":"br","type":"bridge","bridge":"cni0"}`,
		"10-calico.conflist": conflist("k8s-pod-network", calico),
	})
	placed := n.install(t)
	if filepath.Base(placed.Path) != "05-bridge.conflist" {
		t.Fatalf("entry placed in %s", placed.Path)
	}
	if name, types := runtimeTypes(t, n.netDir); name != "05-bridge.conflist" || !slices.Equal(types, []string{"bridge", PluginType}) {
		t.Fatalf("the runtime runs %v from %s", types, name)
	}
	if _, err := os.Stat(filepath.Join(n.netDir, "05-bridge.json")); !os.IsNotExist(err) {
		t.Fatalf("the wrapped .json is still there: %v", err)
	}
	if err := n.in.Ready(placed.Path); err != nil {
		t.Fatal(err)
	}
	if strings.Contains(string(read(t, filepath.Join(n.netDir, "10-calico.conflist"))), PluginType) {
		t.Fatal("the entry went into the later file too")
	}
	if err := n.in.Cleanup(); err != nil {
		t.Fatal(err)
	}
	if name, types := runtimeTypes(t, n.netDir); name != "05-bridge.conflist" || !slices.Equal(types, []string{"bridge"}) {
		t.Fatalf("after clean-up the runtime runs %v from %s", types, name)
	}
}

// TestListWithTopLevelType: a .conflist with a stray top-level "type" is
// a list to the runtime (libcni passes over the key); the entry is
// appended to its plugins. It was taken for one plugin's config and the
// whole list nested as the first plugin: the runtime then ran calico
// without its settings and lost portmap, even after clean-up.
func TestListWithTopLevelType(t *testing.T) {
	list := `{"cniVersion":"0.3.1","name":"k8s","type":"calico","plugins":[` + calico + `,{"type":"portmap","capabilities":{"portMappings":true}}]}`
	n := newNode(t, true, map[string]string{"10-calico.conflist": list})
	placed := n.install(t)
	if name, types := runtimeTypes(t, n.netDir); name != "10-calico.conflist" || !slices.Equal(types, []string{"calico", "portmap", PluginType}) {
		t.Fatalf("the runtime runs %v from %s", types, name)
	}
	if err := n.in.Ready(placed.Path); err != nil {
		t.Fatal(err)
	}
	if err := n.in.Cleanup(); err != nil {
		t.Fatal(err)
	}
	if got := string(read(t, placed.Path)); got != list {
		t.Fatalf("after clean-up:\n%s\nwant\n%s", got, list)
	}
}

// TestPrimaryCaughtMidWrite: the primary's writer rewrites it in place
// (truncate, write) just as a pass reads the dir; the pass waits for it
// instead of wrapping the next valid file, a .conf another package owns,
// which it would have renamed and rewritten for good.
func TestPrimaryCaughtMidWrite(t *testing.T) {
	flannel := conflist("cbr0", `{"type":"flannel","delegate":{"isDefaultGateway":true}}`, `{"type":"portmap","capabilities":{"portMappings":true}}`)
	loopback := `{"cniVersion":"0.3.1","name":"lo","type":"loopback"}`
	n := newNode(t, true, map[string]string{"10-flannel.conflist": "", "99-loopback.conf": loopback})
	waits := 0
	defer func(w func()) { waitForWriter = w }(waitForWriter)
	waitForWriter = func() {
		waits++
		if waits == 2 {
			if err := os.WriteFile(filepath.Join(n.netDir, "10-flannel.conflist"), []byte(flannel), 0o644); err != nil {
				t.Error(err)
			}
		}
	}
	placed := n.install(t)
	if filepath.Base(placed.Path) != "10-flannel.conflist" || waits != 2 {
		t.Fatalf("entry placed in %s after %d waits", placed.Path, waits)
	}
	if got := string(read(t, filepath.Join(n.netDir, "99-loopback.conf"))); got != loopback {
		t.Fatalf("99-loopback.conf changed: %q", got)
	}
	if _, err := os.Stat(filepath.Join(n.netDir, "99-loopback.conflist")); !os.IsNotExist(err) {
		t.Fatalf("99-loopback.conf was wrapped: %v", err)
	}

	// A file that stays partial is passed over after the bounded waits,
	// as the runtime passes over it.
	m := newNode(t, true, map[string]string{"00-empty.conflist": "", "10-calico.conflist": conflist("k8s-pod-network", calico)})
	waits = 0
	waitForWriter = func() { waits++ }
	if placed := m.install(t); filepath.Base(placed.Path) != "10-calico.conflist" || waits != partialRetries {
		t.Fatalf("with a file that stays empty: entry in %s after %d waits", placed.Path, waits)
	}
}

// TestStandaloneLeftoverIsNoPrimary: chained, a standalone config an
// agent in the other mode left (a rollout that switched
// CHAINED_CNI_PLUGIN) that sorts first is istio-cni alone, no network: the
// runtime would use it and pods would get none. The agent removes it and
// waits for the primary, instead of wrapping it into a list of istio-cni
// alone (which clean-up then left as an invalid empty list), or puts the
// entry into a primary sorting after it, which the runtime now uses.
func TestStandaloneLeftoverIsNoPrimary(t *testing.T) {
	n := newNode(t, true, nil)
	other := newNode(t, false, nil)
	other.in.cfg.MountedCNINetDir = n.netDir
	if _, err := other.in.EnsureConf(); err != nil {
		t.Fatal(err)
	}
	leftover := filepath.Join(n.netDir, StandaloneConfName)
	if _, err := n.in.EnsureConf(); !errors.Is(err, ErrNoPrimary) {
		t.Fatalf("with the standalone leftover alone: %v, want no primary", err)
	}
	if _, err := os.Stat(leftover); !os.IsNotExist(err) {
		t.Fatalf("the leftover is still there: %v", err)
	}
	if err := os.WriteFile(filepath.Join(n.netDir, "10-calico.conflist"), []byte(conflist("k8s-pod-network", calico)), 0o644); err != nil {
		t.Fatal(err)
	}
	if placed := n.install(t); filepath.Base(placed.Path) != "10-calico.conflist" {
		t.Fatalf("entry placed in %s", placed.Path)
	}

	// A primary whose name sorts after the leftover's.
	m := newNode(t, true, map[string]string{"k8s-pod-network.conflist": conflist("k8s-pod-network", calico)})
	other.in.cfg.MountedCNINetDir = m.netDir
	if _, err := other.in.EnsureConf(); err != nil {
		t.Fatal(err)
	}
	if name, types := runtimeTypes(t, m.netDir); name != StandaloneConfName || !slices.Equal(types, []string{PluginType}) {
		t.Fatalf("set-up: the runtime runs %v from %s", types, name)
	}
	placed := m.install(t)
	if name, types := runtimeTypes(t, m.netDir); name != "k8s-pod-network.conflist" || !slices.Equal(types, []string{"calico", PluginType}) {
		t.Fatalf("the runtime runs %v from %s", types, name)
	}
	if err := m.in.Ready(placed.Path); err != nil {
		t.Fatal(err)
	}
}

// TestIstioOwnedConfig: with ISTIO_OWNED_CNI_CONFIG (chained ambient
// mode) the primary is never written; the agent's copy of it with our
// entry, sorted first, is what the runtime runs, follows the primary's
// changes, reports not ready while stale or shadowed, and goes at
// clean-up. The copy survives a primary that rewrites its own file at
// boot, so no pod starts without the plugin.
func TestIstioOwnedConfig(t *testing.T) {
	primary := conflist("k8s-pod-network", calico)
	n := newNode(t, true, map[string]string{"10-calico.conflist": primary})
	n.in.cfg.IstioOwned, n.in.cfg.IstioOwnedConfName = true, DefaultIstioOwnedConfName
	owned := filepath.Join(n.netDir, DefaultIstioOwnedConfName)
	calicoPath := filepath.Join(n.netDir, "10-calico.conflist")
	placed := n.install(t)
	if placed.Path != owned || !placed.Wrote {
		t.Fatalf("placed %+v, want %s written", placed, owned)
	}
	if got := string(read(t, calicoPath)); got != primary {
		t.Fatalf("the primary was written:\n%s", got)
	}
	if name, types := runtimeTypes(t, n.netDir); name != DefaultIstioOwnedConfName || !slices.Equal(types, []string{"calico", PluginType}) {
		t.Fatalf("the runtime runs %v from %s", types, name)
	}
	if fi, err := os.Stat(owned); err != nil || fi.Mode().Perm() != 0o600 {
		t.Fatalf("the owned file: %v %v", fi, err)
	}
	if err := n.in.Ready(owned); err != nil {
		t.Fatal(err)
	}
	if again, err := n.in.EnsureConf(); err != nil || again.Wrote {
		t.Fatalf("a second pass: %+v %v", again, err)
	}

	// The primary's plugin rewrites its file, as at boot, with a change.
	changed := conflist("k8s-pod-network", calico, `{"type":"portmap","capabilities":{"portMappings":true}}`)
	if err := os.WriteFile(calicoPath, []byte(changed), 0o644); err != nil {
		t.Fatal(err)
	}
	if name, types := runtimeTypes(t, n.netDir); name != DefaultIstioOwnedConfName || !slices.Contains(types, PluginType) {
		t.Fatalf("after the primary's rewrite the runtime runs %v from %s", types, name)
	}
	if err := n.in.Ready(owned); err == nil || !strings.Contains(err.Error(), "does not hold") {
		t.Fatalf("ready with a stale copy: %v", err)
	}
	if p, err := n.in.EnsureConf(); err != nil || !p.Wrote {
		t.Fatalf("the pass after the primary changed: %+v %v", p, err)
	}
	if _, types := runtimeTypes(t, n.netDir); !slices.Equal(types, []string{"calico", "portmap", PluginType}) {
		t.Fatalf("the copy after the primary changed: %v", types)
	}
	if err := n.in.Ready(owned); err != nil {
		t.Fatal(err)
	}

	// Another config sorting before the copy shadows it.
	first := filepath.Join(n.netDir, "01-first.conflist")
	if err := os.WriteFile(first, []byte(conflist("first", `{"type":"ptp"}`)), 0o644); err != nil {
		t.Fatal(err)
	}
	if err := n.in.Ready(owned); err == nil || !strings.Contains(err.Error(), "sorts before") {
		t.Fatalf("ready while shadowed: %v", err)
	}
	if err := os.Remove(first); err != nil {
		t.Fatal(err)
	}

	if err := n.in.Cleanup(); err != nil {
		t.Fatal(err)
	}
	if _, err := os.Stat(owned); !os.IsNotExist(err) {
		t.Fatalf("the owned copy is left: %v", err)
	}
	if got := string(read(t, calicoPath)); got != changed {
		t.Fatalf("clean-up wrote the primary:\n%s", got)
	}
}

// TestIstioOwnedConfigOfASingleConf: a single plugin's primary is
// wrapped in the copy and stays as it is.
func TestIstioOwnedConfigOfASingleConf(t *testing.T) {
	bridge := `{"cniVersion":"0.4.0","name":"br","type":"bridge","bridge":"cni0"}`
	n := newNode(t, true, map[string]string{"10-bridge.conf": bridge})
	n.in.cfg.IstioOwned, n.in.cfg.IstioOwnedConfName = true, DefaultIstioOwnedConfName
	n.install(t)
	if got := string(read(t, filepath.Join(n.netDir, "10-bridge.conf"))); got != bridge {
		t.Fatalf("the primary was written:\n%s", got)
	}
	if name, types := runtimeTypes(t, n.netDir); name != DefaultIstioOwnedConfName || !slices.Equal(types, []string{"bridge", PluginType}) {
		t.Fatalf("the runtime runs %v from %s", types, name)
	}
}

// TestIstioOwnedConfigSwitchedOff: an agent without the setting finds
// the copy an owned-mode agent left (ours, or Istio's), puts the entry
// into the primary and removes the copy, which would shadow it frozen;
// a single plugin's primary (a .conf, a .json) is recognised in the copy
// too.
func TestIstioOwnedConfigSwitchedOff(t *testing.T) {
	for name, c := range map[string]struct {
		file, content, list string
		types               []string
	}{
		"conflist": {"10-calico.conflist", conflist("k8s-pod-network", calico), "10-calico.conflist", []string{"calico", PluginType}},
		"conf":     {"10-bridge.conf", `{"cniVersion":"0.4.0","name":"br","type":"bridge","bridge":"cni0"}`, "10-bridge.conflist", []string{"bridge", PluginType}},
		"json":     {"10-bridge.json", `{"cniVersion":"0.4.0","name":"br","type":"bridge","bridge":"cni0"}`, "10-bridge.conflist", []string{"bridge", PluginType}},
	} {
		n := newNode(t, true, map[string]string{c.file: c.content})
		n.in.cfg.IstioOwned, n.in.cfg.IstioOwnedConfName = true, DefaultIstioOwnedConfName
		n.install(t)
		n.in.cfg.IstioOwned = false
		placed := n.install(t)
		if filepath.Base(placed.Path) != c.list {
			t.Fatalf("%s: entry placed in %s", name, placed.Path)
		}
		if _, err := os.Stat(filepath.Join(n.netDir, DefaultIstioOwnedConfName)); !os.IsNotExist(err) {
			t.Fatalf("%s: the owned copy is left: %v", name, err)
		}
		if got, types := runtimeTypes(t, n.netDir); got != c.list || !slices.Equal(types, c.types) {
			t.Fatalf("%s: the runtime runs %v from %s", name, types, got)
		}
	}
}

// TestIstioOwnedConfigBesideIstiosCopy: Istio's agent always wrote its
// copy under 02-istio-cni.conflist (it never read its chart's name for
// it); ours goes under the name set. Istio's frozen copy, sorting first,
// is neither copied nor left: once ours is in place it goes.
func TestIstioOwnedConfigBesideIstiosCopy(t *testing.T) {
	istios := conflist("k8s-pod-network", calico, `{"type":"istio-cni","cni_agent_run_dir":"/var/run/istio-cni","plugin_log_level":"info"}`)
	n := newNode(t, true, map[string]string{"10-calico.conflist": conflist("k8s-pod-network", calico, `{"type":"portmap"}`), DefaultIstioOwnedConfName: istios})
	n.in.cfg.IstioOwned, n.in.cfg.IstioOwnedConfName = true, "01-mesh.conflist"
	placed := n.install(t)
	if filepath.Base(placed.Path) != "01-mesh.conflist" {
		t.Fatalf("placed in %s", placed.Path)
	}
	if name, types := runtimeTypes(t, n.netDir); name != "01-mesh.conflist" || !slices.Equal(types, []string{"calico", "portmap", PluginType}) {
		t.Fatalf("the runtime runs %v from %s", types, name)
	}
	if _, err := os.Stat(filepath.Join(n.netDir, DefaultIstioOwnedConfName)); !os.IsNotExist(err) {
		t.Fatalf("Istio's copy is left: %v", err)
	}
	if err := n.in.Ready(placed.Path); err != nil {
		t.Fatal(err)
	}
}

// TestOperatorPairOfJSONAndList: an operator's X.conflist beside an X.json
// of the same network: the runtime runs the list, and so does the agent,
// pass after pass; the .json is left alone. (A .json its owner writes
// again after the agent wrapped it looks the same, and is not followed:
// telling the two apart would take a mark of ours in the wrap.)
func TestOperatorPairOfJSONAndList(t *testing.T) {
	list := conflist("net", `{"type":"bridge","ipam":{"subnet":"10.1.0.0/16"}}`)
	js := `{"cniVersion":"1.0.0","name":"net","type":"bridge","ipam":{"subnet":"10.99.0.0/16"}}`
	n := newNode(t, true, map[string]string{"10-net.conflist": list, "10-net.json": js})
	n.install(t)
	placed := n.install(t)
	if filepath.Base(placed.Path) != "10-net.conflist" || !strings.Contains(string(read(t, placed.Path)), "10.1.0.0/16") {
		t.Fatalf("placed in %s:\n%s", placed.Path, read(t, placed.Path))
	}
	if got := string(read(t, filepath.Join(n.netDir, "10-net.json"))); got != js {
		t.Fatalf("the .json was touched: %s", got)
	}
}
