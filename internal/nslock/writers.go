package nslock

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"

	"golang.org/x/sys/unix"
)

// PrivateFile opens, creating it, the file name in dir with mode, once dir
// is a directory private to this uid (made 0700 when missing). A directory
// made by anyone else is not ours to trust, so it is refused.
func PrivateFile(dir, name string, mode os.FileMode) (*os.File, error) {
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return nil, err
	}
	var st unix.Stat_t
	if err := unix.Lstat(dir, &st); err != nil {
		return nil, err
	}
	if st.Mode&unix.S_IFMT != unix.S_IFDIR || st.Uid != uint32(os.Geteuid()) || st.Mode&0o077 != 0 {
		return nil, fmt.Errorf("%s is not a directory private to uid %d", dir, os.Geteuid())
	}
	f, err := os.OpenFile(filepath.Join(dir, name), os.O_RDWR|os.O_CREATE, mode) //nolint:gosec // G304: a file of ours in a directory of ours
	if err != nil {
		return nil, err
	}
	// The mode as asked, whatever the umask.
	if err := f.Chmod(mode); err != nil {
		_ = f.Close()
		return nil, err
	}
	return f, nil
}

// WritersDir is the directory of the writers' locks under the agent's run
// dir, which the agent, the plugin processes and the fallback all see.
const WritersDir = "locks"

// writersBuckets bounds the lock files: namespaces share one by their
// inode, so two pods rarely wait on each other, and only for a write.
const writersBuckets = 256

// LockWriters takes, across processes, the lock of the writers of a pod's
// rules in the namespace netns: the agent, the fallback, and a plugin
// process serving the pod from its record. It returns the release.
//
// The lock is a root-only file under runDir chosen by the namespace's
// inode, not the namespace's own file: any process in the pod can open
// that and hold a lock on it, which would stall every write to its pod.
func LockWriters(runDir string, netns *os.File) (unlock func(), err error) {
	var st unix.Stat_t
	if err := unix.Fstat(int(netns.Fd()), &st); err != nil {
		return nil, fmt.Errorf("reading the network namespace descriptor: %w", err)
	}
	f, err := PrivateFile(filepath.Join(runDir, WritersDir), fmt.Sprintf("%03d.lock", st.Ino%writersBuckets), 0o600)
	if err != nil {
		return nil, fmt.Errorf("the namespace writers' lock: %w", err)
	}
	for {
		err = unix.Flock(int(f.Fd()), unix.LOCK_EX)
		if !errors.Is(err, unix.EINTR) {
			break
		}
	}
	if err != nil {
		_ = f.Close()
		return nil, fmt.Errorf("the namespace writers' lock: %w", err)
	}
	// Closing the file releases the lock.
	return func() { _ = f.Close() }, nil
}
