package e2e

import (
	"bytes"
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/fsnotify/fsnotify"
)

// generationOf reads the "generation" key a test writer puts at the top
// of the primary config.
func generationOf(path string) int {
	data, err := os.ReadFile(path)
	if err != nil {
		return -1
	}
	var c struct {
		Generation int `json:"generation"`
	}
	if json.Unmarshal(data, &c) != nil {
		return -1
	}
	return c.Generation
}

// TestHardeningConcurrentWriters: the primary plugin rewrites its config
// (by rename and in place) twice in a row, 300 times, while the agent puts
// its entry back after each; its newest write must never be lost.
func TestHardeningConcurrentWriters(t *testing.T) {
	ensureDaemonSet(t, false)
	h := newHost(t)
	calico := filepath.Join(h.NetDir, "10-calico.conflist")
	write := func(gen int, inPlace bool) {
		data := []byte(fmt.Sprintf(`{"generation":%d,"cniVersion":"0.3.1","name":"k8s-pod-network","plugins":[{"type":"calico","mtu":%d}]}`, gen, 1400+gen%100))
		if inPlace {
			if err := os.WriteFile(calico, data, 0o644); err != nil {
				t.Fatal(err)
			}
			return
		}
		tmp := filepath.Join(h.NetDir, ".calico-tmp")
		if err := os.WriteFile(tmp, data, 0o644); err != nil {
			t.Fatal(err)
		}
		if err := os.Rename(tmp, calico); err != nil {
			t.Fatal(err)
		}
	}
	write(0, false)
	h.start("--conflict-limit", "100000")
	h.waitReadyz(200, 20*time.Second)
	lost := 0
	for i := 1; i <= 300; i++ {
		gen := 2 * i
		write(gen-1, i%2 == 0)
		write(gen, i%3 == 0)
		// A lost write never comes back: the wait only has to outlast
		// the agent's slowest pass on a loaded machine.
		ok := waitDirFor(t, h.NetDir, 20*time.Second, func() bool {
			n, last := entryCount(t, calico)
			return n == 1 && last && generationOf(calico) == gen
		})
		if !ok {
			lost++
			t.Logf("trial %d: the primary's write of generation %d was lost (file holds %d)", i, gen, generationOf(calico))
		}
	}
	if lost > 0 {
		t.Fatalf("the primary's newest write was lost in %d of 300 trials", lost)
	}
}

// waitDirFor is waitDir that reports a timeout instead of failing, so a
// trial can count it and go on.
func waitDirFor(t *testing.T, dir string, timeout time.Duration, cond func() bool) bool {
	t.Helper()
	w, err := fsnotify.NewWatcher()
	if err != nil {
		t.Fatal(err)
	}
	defer w.Close()
	if err := w.Add(dir); err != nil {
		t.Fatal(err)
	}
	deadline := time.After(timeout)
	for !cond() {
		select {
		case <-w.Events:
		case err := <-w.Errors:
			t.Fatal(err)
		case <-deadline:
			return false
		}
	}
	return true
}

// TestHardeningSymlinkedConflist: a primary config that is a symbolic
// link into the config dir is written through (the link stays, the file
// it names gets the entry and loses it again on removal); a link that
// leaves the dir is refused with the reason.
func TestHardeningSymlinkedConflist(t *testing.T) {
	ensureDaemonSet(t, false)
	orig := calicoBytes(t)
	t.Run("inside", func(t *testing.T) {
		h := newHost(t)
		if err := os.Mkdir(filepath.Join(h.NetDir, "calico"), 0o755); err != nil {
			t.Fatal(err)
		}
		target := filepath.Join(h.NetDir, "calico", "calico.conflist")
		if err := os.WriteFile(target, orig, 0o644); err != nil {
			t.Fatal(err)
		}
		link := filepath.Join(h.NetDir, "10-calico.conflist")
		if err := os.Symlink("calico/calico.conflist", link); err != nil {
			t.Fatal(err)
		}
		h.start("--resync-interval", "1h")
		h.waitReadyz(200, 20*time.Second)
		if fi, err := os.Lstat(link); err != nil || fi.Mode()&os.ModeSymlink == 0 {
			t.Fatalf("the link was replaced: %v %v", fi.Mode(), err)
		}
		if n, last := entryCount(t, target); n != 1 || !last {
			t.Fatalf("the link's target has %d entries (last %v)", n, last)
		}
		// The owner rewrites the file the link leads to: its directory is
		// watched too.
		if err := os.WriteFile(target, orig, 0o644); err != nil {
			t.Fatal(err)
		}
		waitDir(t, filepath.Dir(target), 10*time.Second, func() bool {
			n, last := entryCount(t, target)
			return n == 1 && last
		})
		if code := h.stop(syscall.SIGTERM); code != 0 {
			t.Fatalf("exit %d", code)
		}
		if fi, err := os.Lstat(link); err != nil || fi.Mode()&os.ModeSymlink == 0 {
			t.Fatalf("the link was replaced on removal: %v %v", fi.Mode(), err)
		}
		if now, _ := os.ReadFile(target); !bytes.Equal(now, orig) {
			t.Fatalf("the target is not restored:\n%s", now)
		}
	})
	t.Run("outside", func(t *testing.T) {
		h := newHost(t)
		target := filepath.Join(t.TempDir(), "calico.conflist")
		if err := os.WriteFile(target, orig, 0o644); err != nil {
			t.Fatal(err)
		}
		link := filepath.Join(h.NetDir, "10-calico.conflist")
		if err := os.Symlink(target, link); err != nil {
			t.Fatal(err)
		}
		h.start()
		body := h.waitReadyz(503, 10*time.Second)
		for !strings.Contains(body, "symbolic link") {
			body = h.waitReadyz(503, 10*time.Second)
		}
		if fi, err := os.Lstat(link); err != nil || fi.Mode()&os.ModeSymlink == 0 {
			t.Fatalf("the link was replaced: %v %v", fi.Mode(), err)
		}
		if now, _ := os.ReadFile(target); !bytes.Equal(now, orig) {
			t.Fatalf("the target outside the dir changed:\n%s", now)
		}
	})
}

// TestHardeningWrapKeepsOtherNetwork: wrapping X.conf must not overwrite
// an X.conflist that holds another network.
func TestHardeningWrapKeepsOtherNetwork(t *testing.T) {
	ensureDaemonSet(t, false)
	h := newHost(t)
	conf := filepath.Join(h.NetDir, "10-bridge.conf")
	copyFile(t, filepath.Join(primaryDir, "10-bridge.conf"), conf)
	other := []byte(`{"cniVersion":"0.4.0","name":"storage-net","plugins":[{"type":"macvlan","master":"eth1"}]}` + "\n")
	list := filepath.Join(h.NetDir, "10-bridge.conflist")
	if err := os.WriteFile(list, other, 0o644); err != nil {
		t.Fatal(err)
	}
	origConf, _ := os.ReadFile(conf)
	h.start()
	body := h.waitReadyz(503, 10*time.Second)
	for !strings.Contains(body, "10-bridge.conflist") {
		body = h.waitReadyz(503, 10*time.Second)
	}
	if now, _ := os.ReadFile(list); !bytes.Equal(now, other) {
		t.Fatalf("another network's file was overwritten:\n%s", now)
	}
	if now, _ := os.ReadFile(conf); !bytes.Equal(now, origConf) {
		t.Fatalf("the .conf changed:\n%s", now)
	}
}

// TestHardeningKeepsOtherBytes: a primary written with tabs, escapes and
// unusual number spellings keeps every byte outside our entry, and gets
// exactly its original bytes back on removal.
func TestHardeningKeepsOtherBytes(t *testing.T) {
	ensureDaemonSet(t, false)
	h := newHost(t)
	orig := "{\n\t\"cniVersion\": \"0.3.1\",\n\t\"name\": \"k8s-pod-network\",\n\t\"x-note\": \"caf\\u00e9 \\/ \\\"q\\\"\",\n" +
		"\t\"plugins\": [\n\t\t{\n\t\t\t\"type\": \"calico\",\n\t\t\t\"mtu\": 1.50e3,\n\t\t\t\"ipam\": {\"type\": \"host-local\", \"subnet\": \"usePodCidr\"}\n\t\t},\n" +
		"\t\t{\"type\":\"portmap\",\"capabilities\":{\"portMappings\":true}}\n\t]\n}\n"
	calico := filepath.Join(h.NetDir, "10-calico.conflist")
	if err := os.WriteFile(calico, []byte(orig), 0o644); err != nil {
		t.Fatal(err)
	}
	h.start()
	h.waitReadyz(200, 20*time.Second)
	got, _ := os.ReadFile(calico)
	cut := strings.LastIndex(orig, "\n\t]")
	if !strings.HasPrefix(string(got), orig[:cut]) || !strings.HasSuffix(string(got), orig[cut:]) {
		t.Fatalf("bytes outside the entry changed:\n%s", got)
	}
	if !strings.Contains(string(got), ",\n\t\t{\n\t\t\t\"ambient_enabled\"") {
		t.Fatalf("the entry does not follow the file's indentation:\n%s", got)
	}
	if code := h.stop(syscall.SIGTERM); code != 0 {
		t.Fatalf("exit %d", code)
	}
	if now, _ := os.ReadFile(calico); string(now) != orig {
		t.Fatalf("removal did not restore the exact bytes:\n%q\nwant\n%q", now, orig)
	}
}

// TestHardeningRemovalStops: with the config dir read-only the entry
// cannot go, so the binaries and kubeconfig it needs stay, the agent says
// what is left, and exits non-zero.
func TestHardeningRemovalStops(t *testing.T) {
	ensureDaemonSet(t, false)
	h := newHost(t)
	calico := filepath.Join(h.NetDir, "10-calico.conflist")
	copyFile(t, filepath.Join(primaryDir, "10-calico.conflist"), calico)
	h.start()
	h.waitReadyz(200, 20*time.Second)
	if err := syscall.Mount(h.NetDir, h.NetDir, "", syscall.MS_BIND, ""); err != nil {
		t.Fatal(err)
	}
	defer func() {
		if err := syscall.Unmount(h.NetDir, syscall.MNT_DETACH); err != nil {
			t.Errorf("unmounting the read-only bind of %s: %v", h.NetDir, err)
		}
	}()
	if err := syscall.Mount("", h.NetDir, "", syscall.MS_BIND|syscall.MS_REMOUNT|syscall.MS_RDONLY, ""); err != nil {
		t.Fatal(err)
	}
	if code := h.stop(syscall.SIGTERM); code == 0 {
		t.Fatal("exit 0 although the entry could not be removed")
	}
	if n, _ := entryCount(t, calico); n != 1 {
		t.Fatalf("%d entries", n)
	}
	for _, p := range []string{filepath.Join(h.BinDir, "istio-cni"), filepath.Join(h.BinDir, "istio-cni-fallback"), filepath.Join(h.RunDir, "istio-cni-kubeconfig")} {
		if _, err := os.Stat(p); err != nil {
			t.Errorf("%s removed while the entry that needs it stays: %v", p, err)
		}
	}
	logs := h.LogText()
	for _, want := range []string{"left in place", "10-calico.conflist", "istio-cni-fallback"} {
		if !strings.Contains(logs, want) {
			t.Errorf("the agent's output does not say %q:\n%s", want, logs)
		}
	}
}

// TestHardeningRecreatedConfigDir: the config dir deleted and created
// again is watched again, with no help from the periodic resync.
func TestHardeningRecreatedConfigDir(t *testing.T) {
	ensureDaemonSet(t, false)
	h := newHost(t)
	calico := filepath.Join(h.NetDir, "10-calico.conflist")
	copyFile(t, filepath.Join(primaryDir, "10-calico.conflist"), calico)
	h.start("--resync-interval", "1h", "--log_output_level=default:debug")
	h.waitReadyz(200, 20*time.Second)
	if err := os.RemoveAll(h.NetDir); err != nil {
		t.Fatal(err)
	}
	h.waitReadyz(503, 10*time.Second)
	if err := os.Mkdir(h.NetDir, 0o755); err != nil {
		t.Fatal(err)
	}
	copyFile(t, filepath.Join(primaryDir, "10-calico.conflist"), calico)
	// Each rewrite is seen: passes the agent had queued before cannot
	// explain more than the first.
	for i := 0; i < 4; i++ {
		if i > 0 {
			copyFile(t, filepath.Join(primaryDir, "10-calico.conflist"), calico)
		}
		if !waitDirFor(t, h.NetDir, 10*time.Second, func() bool {
			n, last := entryCount(t, calico)
			return n == 1 && last
		}) {
			// The agent's own log (at debug, with every file event and
			// pass) and its goroutines say whether it missed the event or
			// was stuck. It missed them under CI load when the new dir got
			// the old one's inode number (TestWatchAfterDirRemadeWithSameInode).
			code, body := h.ReadyZ()
			h.Signal(syscall.SIGQUIT)
			select {
			case <-h.Done():
			case <-time.After(5 * time.Second):
			}
			t.Fatalf("rewrite %d: the entry was not put back within 10s (readyz %d %q)", i, code, body)
		}
	}
	h.waitReadyz(200, 10*time.Second)
}

// TestHardeningInotifyOverflow: events the kernel dropped (its queue
// overflowed while the agent was stopped) lead to a full resync, which
// finds the entry gone; the agent does not exit.
func TestHardeningInotifyOverflow(t *testing.T) {
	ensureDaemonSet(t, false)
	h := newHost(t)
	calico := filepath.Join(h.NetDir, "10-calico.conflist")
	copyFile(t, filepath.Join(primaryDir, "10-calico.conflist"), calico)
	h.start("--resync-interval", "1h")
	h.waitReadyz(200, 20*time.Second)
	maxQueued, err := os.ReadFile("/proc/sys/fs/inotify/max_queued_events")
	if err != nil {
		t.Fatal(err)
	}
	var queue int
	if _, err := fmt.Sscan(string(maxQueued), &queue); err != nil {
		t.Fatal(err)
	}
	h.Signal(syscall.SIGSTOP)
	defer h.Signal(syscall.SIGCONT)
	noise := filepath.Join(h.NetDir, "noise.txt")
	for i := 0; i < queue; i++ {
		if err := os.WriteFile(noise, nil, 0o644); err != nil {
			t.Fatal(err)
		}
		if err := os.Remove(noise); err != nil {
			t.Fatal(err)
		}
	}
	// Past the overflow: the kernel drops this change's events.
	copyFile(t, filepath.Join(primaryDir, "10-calico.conflist"), calico)
	h.Signal(syscall.SIGCONT)
	h.waitLog("overflowed", 20*time.Second)
	// The agent is still there and still answers changes.
	for i := 0; i < 4; i++ {
		if i > 0 {
			copyFile(t, filepath.Join(primaryDir, "10-calico.conflist"), calico)
		}
		waitDir(t, h.NetDir, 20*time.Second, func() bool {
			n, last := entryCount(t, calico)
			return n == 1 && last
		})
	}
	h.waitReadyz(200, 10*time.Second)
	if m := h.metric(`istio_cni_config_resyncs_total{reason="overflow"}`); metricValue(t, m) == 0 {
		t.Errorf("overflow resync not counted: %q", m)
	}
}

// TestHardeningPeriodicResync: what no watch covers (the kubeconfig in the
// run dir) is put back by the periodic resync.
func TestHardeningPeriodicResync(t *testing.T) {
	ensureDaemonSet(t, false)
	h := newHost(t)
	copyFile(t, filepath.Join(primaryDir, "10-calico.conflist"), filepath.Join(h.NetDir, "10-calico.conflist"))
	h.start("--resync-interval", "300ms")
	h.waitReadyz(200, 20*time.Second)
	kc := filepath.Join(h.RunDir, "istio-cni-kubeconfig")
	// Each removal is undone: passes the agent had queued before cannot
	// explain more than the first.
	for i := 0; i < 4; i++ {
		if err := os.Remove(kc); err != nil {
			t.Fatal(err)
		}
		deadline := time.Now().Add(10 * time.Second)
		for {
			if _, err := os.Stat(kc); err == nil {
				break
			}
			if time.Now().After(deadline) {
				t.Fatalf("removal %d: the kubeconfig was not written again", i)
			}
			time.Sleep(20 * time.Millisecond) // polling files another process writes
		}
	}
	h.waitReadyz(200, 10*time.Second)
}
