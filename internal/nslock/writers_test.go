package nslock

import (
	"errors"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"golang.org/x/sys/unix"
)

// TestLockWriters: two opens of one namespace file get one lock, which the
// first holds until released; the lock file sits in a 0700 directory of
// ours and is 0600, and a directory anyone else may enter is refused.
func TestLockWriters(t *testing.T) {
	runDir := t.TempDir()
	// Any file stands for the namespace's: the lock is chosen by its inode.
	ns := filepath.Join(t.TempDir(), "netns")
	if err := os.WriteFile(ns, nil, 0o600); err != nil {
		t.Fatal(err)
	}
	open := func() *os.File {
		f, err := os.Open(ns)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { _ = f.Close() })
		return f
	}
	unlock, err := LockWriters(runDir, open())
	if err != nil {
		t.Fatal(err)
	}
	locks, _ := filepath.Glob(filepath.Join(runDir, WritersDir, "*.lock"))
	if len(locks) != 1 {
		t.Fatalf("lock files %v, want one", locks)
	}
	tryLock := func() error {
		f, err := os.Open(locks[0])
		if err != nil {
			t.Fatal(err)
		}
		defer f.Close()
		return unix.Flock(int(f.Fd()), unix.LOCK_EX|unix.LOCK_NB)
	}
	if err := tryLock(); !errors.Is(err, unix.EWOULDBLOCK) {
		t.Fatalf("the lock was free while held: %v", err)
	}
	for path, want := range map[string]os.FileMode{filepath.Join(runDir, WritersDir): os.ModeDir | 0o700, locks[0]: 0o600} {
		if fi, err := os.Stat(path); err != nil || fi.Mode() != want {
			t.Fatalf("%s: mode %v (%v), want %v", path, fi.Mode(), err, want)
		}
	}
	unlock()
	if err := tryLock(); err != nil {
		t.Fatalf("the lock was held once released: %v", err)
	}
	// A second open of the same namespace takes the same lock.
	unlock, err = LockWriters(runDir, open())
	if err != nil {
		t.Fatal(err)
	}
	if err := tryLock(); !errors.Is(err, unix.EWOULDBLOCK) {
		t.Fatalf("a second open's lock is another: %v", err)
	}
	unlock()

	shared := t.TempDir()
	if err := os.Chmod(shared, 0o777); err != nil {
		t.Fatal(err)
	}
	if err := os.Mkdir(filepath.Join(shared, WritersDir), 0o777); err != nil {
		t.Fatal(err)
	}
	if err := os.Chmod(filepath.Join(shared, WritersDir), 0o777); err != nil {
		t.Fatal(err)
	}
	if _, err := LockWriters(shared, open()); err == nil || !strings.Contains(err.Error(), "not a directory private") {
		t.Fatalf("a lock dir anyone may enter: %v", err)
	}
}
