package install

import (
	"bytes"
	"errors"
	"io"
	"io/fs"
	"log/slog"
	"os"
	"path/filepath"
	"runtime"
	"strings"
	"syscall"
	"testing"

	"golang.org/x/sys/unix"

	"github.com/istio-cni-go/istio-cni/internal/testutil"
)

// TestInsertKeepsEveryOtherByte: tabs, escapes, number spellings and
// one-line plugins survive an insertion byte for byte, the entry takes the
// file's indentation, and removal gives the original bytes back.
func TestInsertKeepsEveryOtherByte(t *testing.T) {
	orig := "{\n\t\"cniVersion\": \"0.3.1\",\n\t\"name\": \"k8s\",\n\t\"x\": \"caf\\u00e9 \\/ \\\"q\\\"\",\n" +
		"\t\"plugins\": [\n\t\t{\n\t\t\t\"type\": \"calico\",\n\t\t\t\"mtu\": 1.50e3\n\t\t},\n" +
		"\t\t{\"type\":\"portmap\",\"capabilities\":{\"portMappings\":true}}\n\t]\n}\n"
	merged, err := Insert([]byte(orig), testEntry)
	if err != nil {
		t.Fatal(err)
	}
	cut := strings.LastIndex(orig, "\n\t]")
	if !bytes.HasPrefix(merged, []byte(orig[:cut])) || !bytes.HasSuffix(merged, []byte(orig[cut:])) {
		t.Fatalf("bytes outside the entry changed:\n%s", merged)
	}
	if !bytes.Contains(merged, []byte(",\n\t\t{\n\t\t\t\"ambient_enabled\": false,")) {
		t.Fatalf("the entry does not follow the file's tabs:\n%s", merged)
	}
	back, had, err := Remove(merged)
	if err != nil || !had || string(back) != orig {
		t.Fatalf("removal: had %v, %v:\n%q", had, err, back)
	}
	// Every list of the real configs without an entry of ours comes back
	// byte for byte; every insertion is stable.
	files, _ := filepath.Glob("testdata/primary/*.conflist")
	for _, f := range files {
		data, _ := os.ReadFile(f)
		m, err := Insert(data, testEntry)
		if err != nil {
			t.Fatal(err)
		}
		if again, _ := Insert(m, testEntry); !bytes.Equal(again, m) {
			t.Errorf("%s: a second insertion changed the file", f)
		}
		if bytes.Contains(data, []byte(`"istio-cni"`)) {
			continue
		}
		if back, _, _ := Remove(m); !bytes.Equal(back, data) {
			t.Errorf("%s: insert then remove is not the original:\n%s", f, back)
		}
	}
	// A compact file stays compact.
	compactIn := `{"cniVersion":"0.3.1","name":"k","plugins":[{"type":"ptp"}]}`
	m, err := Insert([]byte(compactIn), testEntry)
	if err != nil || bytes.Contains(m, []byte("\n")) || !bytes.HasPrefix(m, []byte(`{"cniVersion":"0.3.1","name":"k","plugins":[{"type":"ptp"},{`)) {
		t.Fatalf("compact file: %v\n%s", err, m)
	}
}

// ownedConf is a config file holding "v1", mode 0640, of another owner
// (1234:5678) than the agent.
func ownedConf(t *testing.T) string {
	t.Helper()
	p := filepath.Join(t.TempDir(), "10-x.conflist")
	if err := os.WriteFile(p, []byte("v1"), 0o640); err != nil {
		t.Fatal(err)
	}
	if err := os.Chown(p, 1234, 5678); err != nil {
		t.Fatal(err)
	}
	return p
}

// TestReplaceIfUnchanged: a write that lands between our read and our
// swap is detected and kept, never overwritten; an undisturbed file is
// replaced with its mode and owner.
func TestReplaceIfUnchanged(t *testing.T) {
	testutil.RequireRoot(t) // the file is given to another owner, whom the write must keep
	p := ownedConf(t)
	dir := filepath.Dir(p)
	// The owner rewrote the file after we read v1.
	if err := os.WriteFile(p, []byte("v2 from the owner"), 0o640); err != nil {
		t.Fatal(err)
	}
	if err := ReplaceIfUnchanged(p, []byte("v1"), []byte("ours, from v1"), 0o640, 1234, 5678); !errors.Is(err, ErrChanged) {
		t.Fatalf("stale base: %v, want ErrChanged", err)
	}
	if got, _ := os.ReadFile(p); string(got) != "v2 from the owner" {
		t.Fatalf("the owner's write was lost: %q", got)
	}
	// The same when the owner replaced the file by rename.
	tmp := filepath.Join(dir, ".owner-tmp")
	if err := os.WriteFile(tmp, []byte("v3 renamed in"), 0o640); err != nil {
		t.Fatal(err)
	}
	if err := os.Rename(tmp, p); err != nil {
		t.Fatal(err)
	}
	if err := ReplaceIfUnchanged(p, []byte("v2 from the owner"), []byte("ours"), 0o640, 1234, 5678); !errors.Is(err, ErrChanged) {
		t.Fatalf("stale base after a rename: %v", err)
	}
	if got, _ := os.ReadFile(p); string(got) != "v3 renamed in" {
		t.Fatalf("the renamed-in write was lost: %q", got)
	}
	if err := ReplaceIfUnchanged(p, []byte("v3 renamed in"), []byte("ours"), 0o640, 1234, 5678); err != nil {
		t.Fatal(err)
	}
	fi, _ := os.Stat(p)
	if got, _ := os.ReadFile(p); string(got) != "ours" || fi.Mode().Perm() != 0o640 || owned(fi) != [2]int{1234, 5678} {
		t.Fatalf("after the swap: %q %v %v", got, fi.Mode(), owned(fi))
	}
	if left := temps(t, dir); len(left) > 0 {
		t.Fatalf("temp files left: %v", left)
	}
	if err := ReplaceIfUnchanged(filepath.Join(dir, "gone"), []byte("x"), []byte("y"), 0o644, -1, -1); !errors.Is(err, ErrChanged) {
		t.Fatalf("a file deleted meanwhile: %v", err)
	}
	if _, err := os.Stat(filepath.Join(dir, "gone")); !errors.Is(err, fs.ErrNotExist) {
		t.Fatal("a deleted file was brought back")
	}
}

func owned(fi os.FileInfo) [2]int {
	st := fi.Sys().(*syscall.Stat_t)
	return [2]int{int(st.Uid), int(st.Gid)}
}

func temps(t *testing.T, dir string) []string {
	t.Helper()
	entries, err := os.ReadDir(dir)
	if err != nil {
		t.Fatal(err)
	}
	var out []string
	for _, e := range entries {
		if strings.Contains(e.Name(), tempMarker) {
			out = append(out, e.Name())
		}
	}
	return out
}

// TestCreateAndRemoveIfUnchanged: creating never replaces a file someone
// else created first, and removing never deletes content someone else
// wrote after we read it.
func TestCreateAndRemoveIfUnchanged(t *testing.T) {
	dir := t.TempDir()
	p := filepath.Join(dir, "10-x.conflist")
	if err := CreateExclusive(p, []byte("ours"), 0o600, -1, -1); err != nil {
		t.Fatal(err)
	}
	if err := CreateExclusive(p, []byte("again"), 0o600, -1, -1); !errors.Is(err, ErrChanged) {
		t.Fatalf("create over an existing file: %v", err)
	}
	if err := RemoveIfUnchanged(p, []byte("stale")); !errors.Is(err, ErrChanged) {
		t.Fatalf("remove with a stale base: %v", err)
	}
	if got, _ := os.ReadFile(p); string(got) != "ours" {
		t.Fatalf("content after a refused removal: %q", got)
	}
	if err := RemoveIfUnchanged(p, []byte("ours")); err != nil {
		t.Fatal(err)
	}
	if _, err := os.Stat(p); !errors.Is(err, fs.ErrNotExist) {
		t.Fatal("not removed")
	}
	if left := temps(t, dir); len(left) > 0 {
		t.Fatalf("temp files left: %v", left)
	}
}

// TestResolveInDir: a relative link to a file in the dir is followed;
// absolute links, links out of the dir and links to non-files are refused
// with the reason; a dangling one does not exist.
func TestResolveInDir(t *testing.T) {
	dir := t.TempDir()
	if err := os.Mkdir(filepath.Join(dir, "sub"), 0o755); err != nil {
		t.Fatal(err)
	}
	target := filepath.Join(dir, "sub", "real.conflist")
	if err := os.WriteFile(target, []byte("{}"), 0o644); err != nil {
		t.Fatal(err)
	}
	outside := filepath.Join(t.TempDir(), "out.conflist")
	if err := os.WriteFile(outside, []byte("{}"), 0o644); err != nil {
		t.Fatal(err)
	}
	links := map[string]string{"in": "sub/real.conflist", "abs": target, "out": "../" + filepath.Base(filepath.Dir(outside)) + "/out.conflist",
		"dir": "sub", "dangling": "sub/missing.conflist"}
	for name, to := range links {
		if err := os.Symlink(to, filepath.Join(dir, name)); err != nil {
			t.Fatal(err)
		}
	}
	if got, err := ResolveInDir(dir, filepath.Join(dir, "in")); err != nil || got != target {
		t.Fatalf("relative link inside: %q %v", got, err)
	}
	for _, name := range []string{"abs", "out", "dir"} {
		var le *LinkError
		if _, err := ResolveInDir(dir, filepath.Join(dir, name)); !errors.As(err, &le) || !strings.Contains(err.Error(), "symbolic link") {
			t.Errorf("%s: %v, want a LinkError", name, err)
		}
	}
	if _, err := ResolveInDir(dir, filepath.Join(dir, "dangling")); !errors.Is(err, fs.ErrNotExist) {
		t.Errorf("dangling: %v", err)
	}
	if got, err := ResolveInDir(dir, target); err != nil || got != target {
		t.Fatalf("a plain file: %q %v", got, err)
	}
}

func newTestInstaller(t *testing.T, dir string) *Installer {
	t.Helper()
	return New(Config{MountedCNINetDir: dir, Chained: true, RunDir: t.TempDir(),
		Entry: EntrySettings{RunDir: "/var/run/istio-cni"}}, slog.New(slog.NewTextHandler(io.Discard, nil)))
}

// TestWrapNeverOverwritesAnotherNetwork: X.conflist holding another
// network stops the wrap of X.conf with a reason; one holding an earlier
// wrap of the same network is completed.
func TestWrapNeverOverwritesAnotherNetwork(t *testing.T) {
	dir := t.TempDir()
	conf := []byte(`{"cniVersion":"1.0.0","name":"bridge","type":"bridge"}`)
	other := []byte(`{"cniVersion":"1.0.0","name":"storage","plugins":[{"type":"macvlan"}]}`)
	if err := os.WriteFile(filepath.Join(dir, "10-b.conf"), conf, 0o644); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(dir, "10-b.conflist"), other, 0o644); err != nil {
		t.Fatal(err)
	}
	in := newTestInstaller(t, dir)
	if _, err := in.EnsureConf(); err == nil || !strings.Contains(err.Error(), "another network") {
		t.Fatalf("wrap over another network: %v", err)
	}
	if got, _ := os.ReadFile(filepath.Join(dir, "10-b.conflist")); !bytes.Equal(got, other) {
		t.Fatalf("another network's file changed: %s", got)
	}
	// An earlier wrap of this very .conf (a crash before the .conf went).
	earlier, err := Insert(conf, Entry(EntrySettings{RunDir: "/old"}))
	if err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(dir, "10-b.conflist"), earlier, 0o644); err != nil {
		t.Fatal(err)
	}
	if placed, err := in.EnsureConf(); err != nil || !placed.Wrote {
		t.Fatalf("completing an earlier wrap: %v %v", placed, err)
	}
	if _, err := os.Stat(filepath.Join(dir, "10-b.conf")); !errors.Is(err, fs.ErrNotExist) {
		t.Fatal("the .conf is still there")
	}
	got, _ := os.ReadFile(filepath.Join(dir, "10-b.conflist"))
	if st, _ := Inspect(got, in.entry); st != EntryOK {
		t.Fatalf("the list after the wrap: %s", got)
	}
}

// TestWrapReplacesIstiosWrap: Istio's agent wrapped a .conf into a list
// named k8s-pod-network (Multus's 00-multus.conf); the .conf back again
// (its writer restarted) is wrapped over Istio's list, which is that
// .conf's network, not another's.
func TestWrapReplacesIstiosWrap(t *testing.T) {
	dir := t.TempDir()
	conf := []byte(`{"cniVersion":"0.3.1","name":"multus-cni-network","type":"multus","kubeconfig":"/etc/cni/net.d/multus.d/multus.kubeconfig","delegates":[{"cniVersion":"0.3.1","name":"k8s-pod-network","plugins":[{"type":"calico"}]}]}`)
	istios := []byte(`{"cniVersion":"0.3.1","name":"k8s-pod-network","plugins":[{"cniVersion":"0.3.1","name":"multus-cni-network","type":"multus","kubeconfig":"/etc/cni/net.d/multus.d/multus.kubeconfig","delegates":[]},{"type":"istio-cni","cni_agent_run_dir":"/var/run/istio-cni"}]}`)
	if err := os.WriteFile(filepath.Join(dir, "00-multus.conf"), conf, 0o644); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(dir, "00-multus.conflist"), istios, 0o644); err != nil {
		t.Fatal(err)
	}
	in := newTestInstaller(t, dir)
	placed, err := in.EnsureConf()
	if err != nil || placed.Path != filepath.Join(dir, "00-multus.conflist") {
		t.Fatalf("wrap over Istio's wrap: %v %v", placed, err)
	}
	if _, err := os.Stat(filepath.Join(dir, "00-multus.conf")); !errors.Is(err, fs.ErrNotExist) {
		t.Fatal("the .conf is still there")
	}
	got, _ := os.ReadFile(filepath.Join(dir, "00-multus.conflist"))
	if st, _ := Inspect(got, in.entry); st != EntryOK || !bytes.Contains(got, []byte(`"multus-cni-network"`)) || !bytes.Contains(got, []byte(`"delegates":[{`)) {
		t.Fatalf("the list after the wrap: %s", got)
	}
}

// TestStandaloneNeverOverwritesAnotherNetwork: a standalone config name
// that is another network's file is refused.
func TestStandaloneNeverOverwritesAnotherNetwork(t *testing.T) {
	dir := t.TempDir()
	calico, _ := os.ReadFile("testdata/primary/10-calico.conflist")
	if err := os.WriteFile(filepath.Join(dir, "10-calico.conflist"), calico, 0o644); err != nil {
		t.Fatal(err)
	}
	in := newTestInstaller(t, dir)
	in.cfg.Chained, in.cfg.CNIConfName = false, "10-calico.conflist"
	if _, err := in.EnsureConf(); err == nil || !strings.Contains(err.Error(), "another network") {
		t.Fatalf("standalone over another network: %v", err)
	}
	if got, _ := os.ReadFile(filepath.Join(dir, "10-calico.conflist")); !bytes.Equal(got, calico) {
		t.Fatal("another network's file changed")
	}
}

// TestReplaceWithoutCapChown: in a container without CAP_CHOWN (the
// chart's), a file of another owner is still rewritten, and is then
// ours, as Istio's installer leaves it; before, every insertion into
// such a primary failed.
func TestReplaceWithoutCapChown(t *testing.T) {
	testutil.RequireRoot(t)
	p := ownedConf(t)
	done := make(chan error, 1)
	go func() {
		// Capabilities are a thread's: this one drops CAP_CHOWN, and
		// ends with the goroutine (never unlocked).
		runtime.LockOSThread()
		hdr := unix.CapUserHeader{Version: unix.LINUX_CAPABILITY_VERSION_3}
		var data [2]unix.CapUserData
		if err := unix.Capget(&hdr, &data[0]); err != nil {
			done <- err
			return
		}
		data[0].Effective &^= 1 << unix.CAP_CHOWN
		if err := unix.Capset(&hdr, &data[0]); err != nil {
			done <- err
			return
		}
		if err := os.Chown(p, 1234, 0); err == nil {
			done <- errors.New("chown still allowed: the test does not drop CAP_CHOWN")
			return
		}
		done <- ReplaceIfUnchanged(p, []byte("v1"), []byte("ours"), 0o640, 1234, 5678)
	}()
	if err := <-done; err != nil {
		t.Fatal(err)
	}
	fi, _ := os.Stat(p)
	if got, _ := os.ReadFile(p); string(got) != "ours" || fi.Mode().Perm() != 0o640 {
		t.Fatalf("after the swap: %q %v", got, fi.Mode())
	}
}
