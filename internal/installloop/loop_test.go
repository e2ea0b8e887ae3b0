package installloop

import (
	"context"
	"io"
	"log/slog"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/fsnotify/fsnotify"
	promtest "github.com/prometheus/client_golang/prometheus/testutil"

	"github.com/istio-cni-go/istio-cni/internal/install"
)

var quiet = slog.New(slog.NewTextHandler(io.Discard, nil))

// TestRelevantEvents: which file events in the watched directories call
// for an install pass. Our own temp files and mode changes never do
// (every write of ours makes them); in the config dir only CNI config
// names do; in the service account dir everything does (the token and CA
// rotate through links); in a bin dir only our two binaries do.
func TestRelevantEvents(t *testing.T) {
	l := New(Config{Install: install.Config{MountedCNINetDir: "/host/etc/cni/net.d/",
		Kubeconfig: install.KubeconfigSettings{ServiceAccountDir: "/sa"}, BinTargetDirs: []string{"/host/opt/cni/bin"}}}, quiet, NewMetrics())
	for _, c := range []struct {
		name string
		op   fsnotify.Op
		want bool
	}{
		{"/host/etc/cni/net.d/10-calico.conflist", fsnotify.Write, true},
		{"/host/etc/cni/net.d/10-calico.conflist", fsnotify.Create, true},
		{"/host/etc/cni/net.d/10-calico.conflist", fsnotify.Remove, true},
		{"/host/etc/cni/net.d/10-calico.conflist", fsnotify.Rename, true},
		{"/host/etc/cni/net.d/10-calico.conf", fsnotify.Write, true},
		{"/host/etc/cni/net.d/10-calico.json", fsnotify.Write, true},
		{"/host/etc/cni/net.d/10-calico.conflist", fsnotify.Chmod, false},
		{"/host/etc/cni/net.d/.10-calico.conflist.istio-cni-tmp-0a1b.tmp", fsnotify.Create, false},
		{"/host/etc/cni/net.d/.10-calico.conflist.istio-cni-tmp-0a1b.tmp", fsnotify.Rename, false},
		{"/host/etc/cni/net.d/calico-kubeconfig", fsnotify.Write, false},
		{"/host/etc/cni/net.d/10-calico.conflist.bak", fsnotify.Create, false},
		{"/sa/token", fsnotify.Create, true},
		{"/sa/..2026_01_01_00_00_00.123", fsnotify.Create, true},
		{"/sa/token", fsnotify.Chmod, false},
		{"/host/opt/cni/bin/istio-cni", fsnotify.Remove, true},
		{"/host/opt/cni/bin/istio-cni-fallback", fsnotify.Write, true},
		{"/host/opt/cni/bin/calico", fsnotify.Write, false},
		{"/host/opt/cni/bin/.istio-cni.istio-cni-tmp-ff.tmp", fsnotify.Create, false},
	} {
		if got := l.relevant(fsnotify.Event{Name: c.name, Op: c.op}); got != c.want {
			t.Errorf("%s %s: relevant %t, want %t", c.op, c.name, got, c.want)
		}
	}
}

// TestWakes: besides relevant files, a pass follows an event about one of
// the watched directories itself (deleted, moved, created again, seen
// from its parent) and a config change beside a primary config that is a
// link into another directory.
func TestWakes(t *testing.T) {
	netDir, sa, bin, linked := "/host/etc/cni/net.d", "/sa", "/host/opt/cni/bin", "/var/lib/cni-linked"
	l := New(Config{Install: install.Config{MountedCNINetDir: netDir,
		Kubeconfig: install.KubeconfigSettings{ServiceAccountDir: sa}, BinTargetDirs: []string{bin}}}, quiet, NewMetrics())
	ws := &watchSet{dirs: []string{netDir, sa, bin}, extra: linked}
	for _, c := range []struct {
		name string
		op   fsnotify.Op
		want bool
	}{
		{netDir, fsnotify.Remove, true},
		{netDir, fsnotify.Create, true},
		{netDir + "/", fsnotify.Rename, true},
		{bin, fsnotify.Remove, true},
		{"/host/etc/cni", fsnotify.Create, false},
		{"/host/etc/cni/other.d", fsnotify.Create, false},
		{linked + "/10-ptp.conflist", fsnotify.Write, true},
		{linked + "/.10-ptp.conflist.istio-cni-tmp-00.tmp", fsnotify.Create, false},
		{linked + "/notes.txt", fsnotify.Write, false},
		{"/elsewhere/10-ptp.conflist", fsnotify.Write, false},
		{netDir + "/05-first.conflist", fsnotify.Create, true},
	} {
		if got := l.wakes(ws, fsnotify.Event{Name: c.name, Op: c.op}); got != c.want {
			t.Errorf("%s %s: wakes %t, want %t", c.op, c.name, got, c.want)
		}
	}
}

// TestNoteRewrite: re-insertions up to the limit within the window cost
// nothing; past it the back-off starts at a second and doubles to 30 s;
// once rewrites slow down below the limit it is forgotten.
func TestNoteRewrite(t *testing.T) {
	l := New(Config{ConflictWindow: 10 * time.Second, ConflictLimit: 3}, quiet, NewMetrics())
	t0 := time.Unix(1_000_000, 0)
	steps := []struct {
		after time.Duration
		want  time.Duration
	}{
		{0, 0}, {time.Second, 0}, {2 * time.Second, 0},
		{3 * time.Second, time.Second},     // a fourth within 10 s
		{4 * time.Second, 2 * time.Second}, // doubling
		{5 * time.Second, 4 * time.Second},
		{6 * time.Second, 8 * time.Second},
		{7 * time.Second, 16 * time.Second},
		{8 * time.Second, 30 * time.Second}, // capped
		{9 * time.Second, 30 * time.Second},
		// Long after: the window holds one rewrite again.
		{60 * time.Second, 0},
		{61 * time.Second, 0}, {62 * time.Second, 0},
		{63 * time.Second, time.Second}, // a new conflict starts at a second again
	}
	for i, s := range steps {
		// Reverted right before each re-insertion.
		if got := l.noteRewrite(t0.Add(s.after), t0.Add(s.after-time.Millisecond)); got != s.want {
			t.Fatalf("step %d (+%s): back-off %s, want %s", i, s.after, got, s.want)
		}
	}
}

// TestBackoffHoldsAgainstAQuickReverter: a component that reverts the
// config moments after each write (Cilium's exclusive mode) meets a
// back-off that grows to 30 s and stays there, with the defaults; it
// started over with bursts of immediate rewrites once the growing
// back-off spaced the rewrites out beyond the window.
func TestBackoffHoldsAgainstAQuickReverter(t *testing.T) {
	// Each write is reverted after revertAfter; the next one comes when
	// the back-off (if any) has ended and the revert has been seen.
	run := func(writes int, revertAfter func(i int) time.Duration) []time.Duration {
		l := New(Config{ConflictWindow: 10 * time.Second, ConflictLimit: 5}, quiet, NewMetrics())
		now := time.Unix(1_000_000, 0)
		var got []time.Duration
		var changed time.Time
		for i := range writes {
			d := l.noteRewrite(now, changed)
			got = append(got, d)
			changed = now.Add(revertAfter(i))
			now = now.Add(max(d, revertAfter(i)) + time.Millisecond)
		}
		return got
	}
	got := run(30, func(int) time.Duration { return 10 * time.Millisecond })
	want := []time.Duration{0, 0, 0, 0, 0, time.Second, 2 * time.Second, 4 * time.Second, 8 * time.Second, 16 * time.Second}
	for len(want) < len(got) {
		want = append(want, 30*time.Second)
	}
	if !slices.Equal(got, want) {
		t.Fatalf("a quick reverter: back-offs %v, want %v", got, want)
	}
	// A burst, then a component that rewrites the config 8 s after each
	// write (under the limit): no conflict, whatever the burst started.
	got = run(14, func(i int) time.Duration {
		if i < 7 {
			return 10 * time.Millisecond
		}
		return 8 * time.Second
	})
	if last := got[len(got)-1]; last != 0 {
		t.Fatalf("a revert 8 s after each write, after a burst: back-offs %v, want none at the end", got)
	}
}

// eventually polls cond until it holds or 20 s pass.
func eventually(t *testing.T, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(20 * time.Second)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("timed out waiting for %s", what)
		}
		time.Sleep(2 * time.Millisecond) // polling files the loop writes
	}
}

// tempNode is a node in a temporary directory: a primary's conflist
// (bare, at primary), the binaries to install, a service account; inst
// installs there.
func tempNode(t *testing.T) (inst install.Config, primary, bare string) {
	t.Helper()
	dir := t.TempDir()
	mk := func(name string) string {
		p := filepath.Join(dir, name)
		if err := os.MkdirAll(p, 0o755); err != nil {
			t.Fatal(err)
		}
		return p
	}
	netDir, src, bin, run, sa := mk("net.d"), mk("src"), mk("bin"), mk("run"), mk("sa")
	primary = filepath.Join(netDir, "10-ptp.conflist")
	bare = `{"cniVersion":"1.0.0","name":"k8s-pod-network","plugins":[{"type":"ptp"}]}`
	for p, c := range map[string]string{primary: bare, filepath.Join(src, "istio-cni"): "relay", filepath.Join(src, "istio-cni-fallback"): "fallback",
		filepath.Join(sa, "token"): "token", filepath.Join(sa, "ca.crt"): "ca"} {
		if err := os.WriteFile(p, []byte(c), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	return install.Config{MountedCNINetDir: netDir, Chained: true, RunDir: run, BinSourceDir: src, BinTargetDirs: []string{bin},
		KubeconfigMode: 0o600, Kubeconfig: install.KubeconfigSettings{Host: "127.0.0.1", Port: "6443", ServiceAccountDir: sa},
		Entry: install.EntrySettings{RunDir: run}}, primary, bare
}

// runLoop runs l until stop, which ends its context, waits for Run and
// returns its error; stop may be called again (a deferred one after an
// explicit one).
func runLoop(l *Loop) (stop func() error) {
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- l.Run(ctx) }()
	var once sync.Once
	var err error
	return func() error {
		once.Do(func() {
			cancel()
			err = <-done
		})
		return err
	}
}

// TestLoopPutsEntryBack: on a temp node, the loop installs, becomes
// ready, and puts its entry back after another component rewrites the
// config without it, counting one re-insertion; Run closes its watcher
// and reports shutting down when its context ends.
func TestLoopPutsEntryBack(t *testing.T) {
	inst, primary, bare := tempNode(t)
	run := inst.RunDir
	m := NewMetrics()
	l := New(Config{Install: inst, ConflictWindow: 10 * time.Second, ConflictLimit: 5, ResyncInterval: time.Hour}, quiet, m)
	if r := l.NotReady(); r != "starting" {
		t.Fatalf("before Run: %q", r)
	}
	// Each placing of the entry is told, with the file as placed.
	var mu sync.Mutex
	var told []string
	l.OnPlaced(func(conf []byte) {
		mu.Lock()
		told = append(told, string(conf))
		mu.Unlock()
	})
	toldTimes := func(n int) bool {
		mu.Lock()
		defer mu.Unlock()
		if len(told) != n {
			return false
		}
		last := told[n-1]
		return strings.Contains(last, `"ptp"`) && strings.Contains(last, `"istio-cni"`)
	}
	stop := runLoop(l)
	defer func() { _ = stop() }()
	eventually(t, "ready", func() bool { return l.NotReady() == "" })
	eventually(t, "the placed file told", func() bool { return toldTimes(1) })
	if got := promtest.ToFloat64(m.Installs.WithLabelValues(install.ResultSuccess)); got != 1 {
		t.Fatalf("installs after the first pass: %v", got)
	}
	if fi, err := os.Stat(filepath.Join(run, install.KubeconfigName)); err != nil || fi.Mode().Perm() != 0o600 {
		t.Fatalf("kubeconfig: %v %v", fi, err)
	}
	if err := os.WriteFile(primary, []byte(bare), 0o644); err != nil {
		t.Fatal(err)
	}
	eventually(t, "the entry back", func() bool {
		data, err := os.ReadFile(primary)
		return err == nil && strings.Contains(string(data), `"istio-cni"`)
	})
	eventually(t, "the re-insertion counted", func() bool { return promtest.ToFloat64(m.Reinsertions) == 1 })
	eventually(t, "ready again", func() bool { return l.NotReady() == "" })
	eventually(t, "the file placed again told", func() bool { return toldTimes(2) })
	if err := stop(); err != nil {
		t.Fatal(err)
	}
	if r := l.NotReady(); r != "shutting down" {
		t.Fatalf("after Run: %q", r)
	}
	if promtest.ToFloat64(m.Conflicts) != 0 {
		t.Fatal("one rewrite counted as a conflict")
	}
}

// TestWatchAfterDirRemadeWithSameInode: a watched directory deleted and
// made again can get the inode number of the one deleted (ext4 hands it
// out again at once), so a sync that runs before the deletion's event is
// read sees the same identity and keeps the dead watch. The sync after
// the deletion's event (which wakes the loop: concerns) must still watch
// the new directory; without it no later change in the directory wakes
// the loop (seen in CI, where the config dir's recreation test missed a
// rewrite).
func TestWatchAfterDirRemadeWithSameInode(t *testing.T) {
	d := filepath.Join(t.TempDir(), "net.d")
	if err := os.Mkdir(d, 0o755); err != nil {
		t.Fatal(err)
	}
	ws, err := newWatchSet([]string{d}, quiet)
	if err != nil {
		t.Fatal(err)
	}
	defer ws.close()
	ws.sync()
	if err := os.Remove(d); err != nil {
		t.Fatal(err)
	}
	if err := os.Mkdir(d, 0o755); err != nil {
		t.Fatal(err)
	}
	// Whatever this file system does with inode numbers, the case under
	// test is the one where the new directory looks like the old.
	id, ok := dirID(d)
	if !ok {
		t.Fatal("the directory made again is not there")
	}
	ws.ids[d] = id
	ws.sync()

	// As the loop does: an event about the directory itself (its
	// deletion) is followed by a sync, and the file is written again. A
	// file written in the new directory must then be seen, whether the
	// sync above already watched it or only the one after the deletion's
	// event does.
	conf := filepath.Join(d, "10-calico.conflist")
	deadline := time.After(10 * time.Second)
	for {
		if err := os.WriteFile(conf, []byte("{}"), 0o644); err != nil {
			t.Fatal(err)
		}
	read:
		for {
			select {
			case ev, ok := <-ws.events():
				if !ok {
					t.Fatal("the watcher closed")
				}
				if ev.Name == conf {
					return
				}
				if ws.concerns(ev) {
					ws.sync()
					break read
				}
			case <-deadline:
				t.Fatal("no event for a file written in the new directory within 10s")
			}
		}
	}
}

// TestNotReadyWhileBackingOff: while the loop backs off from a component
// that keeps reverting the config, a revert turns readiness and
// istio_cni_install_ready off at once, although the entry is put back
// only when the back-off ends (they stayed on, and new pods started
// without the plugin while the agent said it was ready).
func TestNotReadyWhileBackingOff(t *testing.T) {
	inst, primary, bare := tempNode(t)
	m := NewMetrics()
	// Limit 0: the first revert already starts a back-off (1 s).
	l := New(Config{Install: inst, ConflictWindow: time.Minute, ConflictLimit: 0, ResyncInterval: time.Hour}, quiet, m)
	stop := runLoop(l)
	defer func() { _ = stop() }()
	eventually(t, "ready", func() bool { return l.NotReady() == "" })
	// As a CNI plugin's installer writes: whole, by rename (a truncating
	// write shows the loop an empty file first).
	revert := func() {
		t.Helper()
		tmp := primary + ".tmp"
		if err := os.WriteFile(tmp, []byte(bare), 0o644); err != nil {
			t.Fatal(err)
		}
		if err := os.Rename(tmp, primary); err != nil {
			t.Fatal(err)
		}
	}
	revert()
	eventually(t, "the back-off, with the entry put back", func() bool {
		return promtest.ToFloat64(m.Conflicts) == 1 && l.NotReady() == ""
	})
	// Reverted again, within the back-off.
	revert()
	eventually(t, "not ready during the back-off", func() bool {
		data, err := os.ReadFile(primary)
		if err != nil || strings.Contains(string(data), `"istio-cni"`) {
			t.Fatalf("the entry was put back before the back-off ended (%v), so the test proves nothing", err)
		}
		return strings.Contains(l.NotReady(), "backing off") && promtest.ToFloat64(m.InstallReady) == 0
	})
	// After the back-off, the entry is back and so is readiness.
	eventually(t, "ready after the back-off", func() bool { return l.NotReady() == "" && promtest.ToFloat64(m.InstallReady) == 1 })
}

// settledLoop runs a loop on a node another loop installed first and
// then stopped, and returns its stop once it is ready: it finds everything in place
// and writes nothing, so no event of its own wakes it again, and what
// wakes it next is the test's doing.
func settledLoop(t *testing.T, inst install.Config) (stop func() error) {
	t.Helper()
	cfg := Config{Install: inst, ConflictWindow: 10 * time.Second, ConflictLimit: 5, ResyncInterval: time.Hour}
	first := New(cfg, quiet, NewMetrics())
	stopFirst := runLoop(first)
	eventually(t, "the first agent ready", func() bool { return first.NotReady() == "" })
	if err := stopFirst(); err != nil {
		t.Fatal(err)
	}
	l := New(cfg, quiet, NewMetrics())
	stop = runLoop(l)
	eventually(t, "ready", func() bool { return l.NotReady() == "" })
	return stop
}

// TestLoopPutsKubeconfigBack: the kubeconfig removed (by an Istio agent
// stopping on the node: its file has our name) or loosened is written
// again at once, not at the next resync (an hour here).
func TestLoopPutsKubeconfigBack(t *testing.T) {
	inst, _, _ := tempNode(t)
	kc := filepath.Join(inst.RunDir, install.KubeconfigName)
	stop := settledLoop(t, inst)
	defer func() { _ = stop() }()
	if err := os.Remove(kc); err != nil {
		t.Fatal(err)
	}
	eventually(t, "the kubeconfig back", func() bool {
		fi, err := os.Stat(kc)
		return err == nil && fi.Mode().Perm() == 0o600
	})
	if err := os.Chmod(kc, 0o644); err != nil {
		t.Fatal(err)
	}
	eventually(t, "the kubeconfig's mode back", func() bool {
		fi, err := os.Stat(kc)
		return err == nil && fi.Mode().Perm() == 0o600
	})
}

// TestLoopLeavesTheFilesToANewerAgent: once another agent keeps the
// node's files, the loop writes none of them again, and still beats.
func TestLoopLeavesTheFilesToANewerAgent(t *testing.T) {
	inst, primary, bare := tempNode(t)
	var displaced atomic.Bool
	var logs lockedBuffer
	log := slog.New(slog.NewTextHandler(&logs, nil))
	l := New(Config{Install: inst, ConflictWindow: 10 * time.Second, ConflictLimit: 5, ResyncInterval: 20 * time.Millisecond}, log, NewMetrics())
	l.LeaveWhen(displaced.Load)
	stop := runLoop(l)
	defer func() { _ = stop() }()
	eventually(t, "ready", func() bool { return l.NotReady() == "" })
	displaced.Store(true)
	eventually(t, "the loop leaving", func() bool { return strings.Contains(logs.String(), "no longer writes them") })
	// The newer agent's config, without our entry as this one placed it:
	// a pass would put it back.
	if err := os.WriteFile(primary, []byte(bare), 0o644); err != nil {
		t.Fatal(err)
	}
	kc := filepath.Join(inst.RunDir, install.KubeconfigName)
	if err := os.WriteFile(kc, []byte("the newer agent's"), 0o600); err != nil {
		t.Fatal(err)
	}
	before := l.beat.Load()
	eventually(t, "a beat after leaving", func() bool { return l.beat.Load() != before })
	eventually(t, "another beat", func() bool { return l.beat.Load() != before })
	for p, want := range map[string]string{primary: bare, kc: "the newer agent's"} {
		if data, err := os.ReadFile(p); err != nil || string(data) != want {
			t.Fatalf("%s rewritten by the agent that left: %q %v", p, data, err)
		}
	}
	if r := l.Stuck(time.Second); r != "" {
		t.Fatalf("stuck after leaving: %s", r)
	}
}

type lockedBuffer struct {
	mu  sync.Mutex
	buf strings.Builder
}

func (b *lockedBuffer) Write(p []byte) (int, error) {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.buf.Write(p)
}

func (b *lockedBuffer) String() string {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.buf.String()
}

// TestLoopKeepsTheIstioOwnedCopy: with ISTIO_OWNED_CNI_CONFIG the loop
// keeps its copy of the primary in step with every rewrite of the
// primary (its plugin's at boot among them) and never writes the primary.
func TestLoopKeepsTheIstioOwnedCopy(t *testing.T) {
	inst, primary, bare := tempNode(t)
	inst.IstioOwned, inst.IstioOwnedConfName = true, install.DefaultIstioOwnedConfName
	owned := filepath.Join(inst.MountedCNINetDir, install.DefaultIstioOwnedConfName)
	l := New(Config{Install: inst, ConflictWindow: 10 * time.Second, ConflictLimit: 5, ResyncInterval: time.Hour}, quiet, NewMetrics())
	stop := runLoop(l)
	defer func() { _ = stop() }()
	eventually(t, "ready", func() bool { return l.NotReady() == "" })
	if got, _ := os.ReadFile(primary); string(got) != bare {
		t.Fatalf("the primary was written: %s", got)
	}
	changed := `{"cniVersion":"1.0.0","name":"k8s-pod-network","plugins":[{"type":"ptp","mtu":1400}]}`
	if err := os.WriteFile(primary, []byte(changed), 0o644); err != nil {
		t.Fatal(err)
	}
	eventually(t, "the copy following the primary", func() bool {
		data, err := os.ReadFile(owned)
		return err == nil && strings.Contains(string(data), `"mtu":1400`) && strings.Contains(string(data), `"istio-cni"`)
	})
	eventually(t, "ready again", func() bool { return l.NotReady() == "" })
	if got, _ := os.ReadFile(primary); string(got) != changed {
		t.Fatalf("the primary was written: %s", got)
	}
}

// TestLoopOwnedCopyOfALinkedPrimary: a primary that is a link into a
// directory of the config dir (a ConfigMap's ..data layout, read-only, the
// kind Istio-owned mode suits) is watched where it leads, so the copy
// follows its changes at once, not at the resync.
func TestLoopOwnedCopyOfALinkedPrimary(t *testing.T) {
	inst, primary, bare := tempNode(t)
	inst.IstioOwned, inst.IstioOwnedConfName = true, install.DefaultIstioOwnedConfName
	data := filepath.Join(inst.MountedCNINetDir, "data")
	if err := os.MkdirAll(data, 0o755); err != nil {
		t.Fatal(err)
	}
	target := filepath.Join(data, filepath.Base(primary))
	if err := os.WriteFile(target, []byte(bare), 0o644); err != nil {
		t.Fatal(err)
	}
	if err := os.Remove(primary); err != nil {
		t.Fatal(err)
	}
	if err := os.Symlink(filepath.Join("data", filepath.Base(primary)), primary); err != nil {
		t.Fatal(err)
	}
	owned := filepath.Join(inst.MountedCNINetDir, install.DefaultIstioOwnedConfName)
	stop := settledLoop(t, inst)
	defer func() { _ = stop() }()
	if err := os.WriteFile(target, []byte(`{"cniVersion":"1.0.0","name":"k8s-pod-network","plugins":[{"type":"ptp","mtu":1300}]}`), 0o644); err != nil {
		t.Fatal(err)
	}
	eventually(t, "the copy following the linked primary", func() bool {
		b, err := os.ReadFile(owned)
		return err == nil && strings.Contains(string(b), `"mtu":1300`)
	})
}
