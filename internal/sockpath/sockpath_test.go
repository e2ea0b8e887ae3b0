package sockpath

import (
	"net"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"
)

type rig struct {
	*Keeper
	l *net.UnixListener
}

// newRig binds a socket as the agent does (its path kept on close) and
// keeps its path, checked only when the test says.
func newRig(t *testing.T, interval time.Duration) rig {
	t.Helper()
	path := filepath.Join(t.TempDir(), "cni.sock")
	l := bind(t, path)
	id, err := Identity(path)
	if err != nil {
		t.Fatal(err)
	}
	k, err := Keep(path, id, interval, nil)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { k.Close() })
	return rig{k, l}
}

func bind(t *testing.T, path string) *net.UnixListener {
	t.Helper()
	l, err := net.ListenUnix("unix", &net.UnixAddr{Name: path, Net: "unix"})
	if err != nil {
		t.Fatal(err)
	}
	l.SetUnlinkOnClose(false)
	t.Cleanup(func() { _ = l.Close() })
	return l
}

// reaches says a client connecting by path is accepted by l.
func reaches(t *testing.T, path string, l *net.UnixListener) bool {
	t.Helper()
	c, err := net.Dial("unix", path)
	if err != nil {
		return false
	}
	defer c.Close()
	_ = l.SetDeadline(time.Now().Add(time.Second))
	a, err := l.Accept()
	if err != nil {
		return false
	}
	a.Close()
	return true
}

func gone(t *testing.T, path string) {
	t.Helper()
	if _, err := os.Lstat(path); !os.IsNotExist(err) {
		t.Fatalf("%s is still there: %v", path, err)
	}
}

// TestPathRemovedIsPutBack: a path another process unlinked (an Istio
// agent's listener closing on the same path) leads to our socket again at
// the second check that finds it gone, and clients reach the listener
// that never stopped; Close removes both names.
func TestPathRemovedIsPutBack(t *testing.T) {
	r := newRig(t, -1)
	if s := r.Check(); s != Ours {
		t.Fatalf("a fresh path: %v", s)
	}
	if err := os.Remove(r.path); err != nil {
		t.Fatal(err)
	}
	if reaches(t, r.path, r.l) {
		t.Fatal("a removed path still reaches the socket")
	}
	if s := r.Check(); s != Missing {
		t.Fatalf("first check of a removed path: %v, want Missing", s)
	}
	if s := r.Check(); s != Restored {
		t.Fatalf("second check of a removed path: %v, want Restored", s)
	}
	if !reaches(t, r.path, r.l) {
		t.Fatal("the path put back does not reach the listener")
	}
	if s := r.Check(); s != Ours || r.Displaced() {
		t.Fatalf("after the path was put back: %v, displaced %t", s, r.Displaced())
	}
	if r.Close() {
		t.Fatal("Close says displaced")
	}
	gone(t, r.path)
	gone(t, KeepName(r.path))
}

// TestPathReplacedIsLeftAlone: a newer agent's socket renamed over ours,
// or bound where ours was removed (Istio's agent removes, then binds), is
// never replaced: the keeper says it was displaced, and Close leaves the
// other socket's path.
func TestPathReplacedIsLeftAlone(t *testing.T) {
	for _, removeFirst := range []bool{false, true} {
		r := newRig(t, -1)
		var other *net.UnixListener
		if removeFirst {
			if err := os.Remove(r.path); err != nil {
				t.Fatal(err)
			}
			if s := r.Check(); s != Missing {
				t.Fatalf("a removed path: %v", s)
			}
			other = bind(t, r.path)
		} else {
			other = bind(t, r.path+".new")
			if err := os.Rename(r.path+".new", r.path); err != nil {
				t.Fatal(err)
			}
		}
		if s := r.Check(); s != Displaced || !r.Displaced() {
			t.Fatalf("remove first %t: a path holding another socket: %v", removeFirst, s)
		}
		if !r.Close() {
			t.Fatal("Close does not say displaced")
		}
		if !reaches(t, r.path, other) {
			t.Fatalf("remove first %t: the other socket's path was touched", removeFirst)
		}
		gone(t, KeepName(r.path))
	}
}

// TestSecondNameGone: with both names gone nothing can be put back, and
// the keeper says so instead of making up a path.
func TestSecondNameGone(t *testing.T) {
	r := newRig(t, -1)
	for _, p := range []string{r.path, KeepName(r.path)} {
		if err := os.Remove(p); err != nil {
			t.Fatal(err)
		}
	}
	if s := r.Check(); s != Missing {
		t.Fatalf("first check: %v", s)
	}
	if s := r.Check(); s != Lost {
		t.Fatalf("second check: %v, want Lost", s)
	}
	gone(t, r.path)
}

// TestKeeperChecksOnItsOwn: the keeper's own checks put a removed path
// back.
func TestKeeperChecksOnItsOwn(t *testing.T) {
	r := newRig(t, 10*time.Millisecond)
	if err := os.Remove(r.path); err != nil {
		t.Fatal(err)
	}
	deadline := time.Now().Add(10 * time.Second)
	for !reaches(t, r.path, r.l) {
		if time.Now().After(deadline) {
			t.Fatal("the path was not put back within 10 s")
		}
		time.Sleep(5 * time.Millisecond) // polling the condition, not synchronising
	}
}

// TestKeepReplacesAStaleSecondName: a second name an earlier agent left
// (killed before its Close) is replaced by one leading to our socket.
func TestKeepReplacesAStaleSecondName(t *testing.T) {
	dir := t.TempDir()
	path := filepath.Join(dir, "cni.sock")
	bind(t, path)
	old, _ := Identity(path)
	if err := os.Link(path, KeepName(path)); err != nil {
		t.Fatal(err)
	}
	if err := os.Remove(path); err != nil {
		t.Fatal(err)
	}
	l := bind(t, path)
	id, _ := Identity(path)
	k, err := Keep(path, id, -1, nil)
	if err != nil {
		t.Fatal(err)
	}
	defer k.Close()
	if kid, _ := Identity(KeepName(path)); kid != id || kid == old {
		t.Fatalf("the second name leads to %v, want ours %v", kid, id)
	}
	if err := os.Remove(path); err != nil {
		t.Fatal(err)
	}
	k.Check()
	if k.Check() != Restored || !reaches(t, path, l) {
		t.Fatal("not put back to our socket")
	}
}

// TestOrphaned: a socket displaced by a live newer agent is not
// orphaned (a restart would take the node back from it); once that agent
// has gone with its path, or both names of ours are gone, it is, from
// the first look on, so the liveness probe has the agent restarted.
func TestOrphaned(t *testing.T) {
	r := newRig(t, -1)
	if why, _ := r.Orphaned(); why != "" {
		t.Fatalf("a fresh socket: %s", why)
	}
	newer := bind(t, r.path+".new")
	if err := os.Rename(r.path+".new", r.path); err != nil {
		t.Fatal(err)
	}
	if r.Check() != Displaced {
		t.Fatal("not displaced")
	}
	if why, _ := r.Orphaned(); why != "" {
		t.Fatalf("displaced by a live agent: %s", why)
	}
	// The newer agent stops and removes its path.
	newer.Close()
	if err := os.Remove(r.path); err != nil {
		t.Fatal(err)
	}
	why, since := r.Orphaned()
	if !strings.Contains(why, "that agent has gone") || since.IsZero() {
		t.Fatalf("after the newer agent went: %q %v", why, since)
	}
	if _, again := r.Orphaned(); !again.Equal(since) {
		t.Fatalf("first seen %v, then %v", since, again)
	}

	lost := newRig(t, -1)
	for _, p := range []string{lost.path, KeepName(lost.path)} {
		if err := os.Remove(p); err != nil {
			t.Fatal(err)
		}
	}
	lost.Check()
	lost.Check()
	if why, _ := lost.Orphaned(); !strings.Contains(why, "cannot be put back") {
		t.Fatalf("both names gone: %q", why)
	}
}

// TestNoSecondName: where the second name cannot be made (a file system
// or policy without hard links; here a directory in its way), the socket
// serves all the same; a path then removed is reported orphaned.
func TestNoSecondName(t *testing.T) {
	path := filepath.Join(t.TempDir(), "cni.sock")
	l := bind(t, path)
	if err := os.MkdirAll(filepath.Join(KeepName(path), "x"), 0o755); err != nil {
		t.Fatal(err)
	}
	id, _ := Identity(path)
	k, err := Keep(path, id, -1, nil)
	if err != nil {
		t.Fatalf("no second name failed the socket: %v", err)
	}
	defer k.Close()
	if !reaches(t, path, l) || k.Check() != Ours {
		t.Fatal("the socket does not serve")
	}
	if err := os.Remove(path); err != nil {
		t.Fatal(err)
	}
	k.Check()
	if s := k.Check(); s != Lost {
		t.Fatalf("a removed path without a second name: %v", s)
	}
	if why, _ := k.Orphaned(); why == "" {
		t.Fatal("not orphaned")
	}
	if fi, err := os.Stat(KeepName(path)); err != nil || !fi.IsDir() {
		t.Fatalf("the directory in the way was touched: %v", err)
	}
}
