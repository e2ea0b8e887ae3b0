package testutil

import (
	"errors"
	"os"
	"path/filepath"
	"testing"

	"golang.org/x/sys/unix"
)

// WritersLockHeld reports whether the namespace writers' lock in dir (a
// run dir's nslock.WritersDir; this package cannot import nslock, whose
// tests import it) is held, by this process or another: a test's one
// namespace has at most one lock file there, and a lock held on it
// refuses a non-blocking one.
func WritersLockHeld(t testing.TB, dir string) bool {
	t.Helper()
	locks, err := filepath.Glob(filepath.Join(dir, "*.lock"))
	if err != nil || len(locks) > 1 {
		t.Fatalf("lock files %v (%v), want at most the namespace's one", locks, err)
	}
	if len(locks) == 0 {
		return false
	}
	f, err := os.Open(locks[0])
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	err = unix.Flock(int(f.Fd()), unix.LOCK_EX|unix.LOCK_NB)
	if err == nil {
		return false
	}
	if !errors.Is(err, unix.EWOULDBLOCK) {
		t.Fatal(err)
	}
	return true
}
