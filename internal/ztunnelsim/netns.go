package ztunnelsim

import (
	"errors"
	"fmt"
	"os"
	"runtime"

	"golang.org/x/sys/unix"
)

// netnsInode checks that fd is a network namespace, as ztunnel does
// before it starts a proxy in it, and returns its inode (the namespace's
// identity: two descriptors of one namespace share it).
func netnsInode(fd int) (uint64, error) {
	var fs unix.Statfs_t
	if err := unix.Fstatfs(fd, &fs); err != nil {
		return 0, fmt.Errorf("fstatfs of the descriptor: %w", err)
	}
	if fs.Type != unix.NSFS_MAGIC {
		return 0, fmt.Errorf("the descriptor is not a namespace (file system magic %#x, not nsfs)", fs.Type)
	}
	// nsfs holds every kind of namespace; the type ioctl tells them apart
	// on kernels that have it (4.11 on), older ones are taken at nsfs's word.
	t, err := unix.IoctlRetInt(fd, unix.NS_GET_NSTYPE)
	switch {
	case err == nil && t != unix.CLONE_NEWNET:
		return 0, fmt.Errorf("the descriptor is a namespace of type %#x, not a network namespace", t)
	case err != nil && !errors.Is(err, unix.ENOTTY):
		return 0, fmt.Errorf("reading the namespace's type: %w", err)
	}
	var st unix.Stat_t
	if err := unix.Fstat(fd, &st); err != nil {
		return 0, fmt.Errorf("fstat of the namespace: %w", err)
	}
	return st.Ino, nil
}

// withNetns runs inNetns in the namespace f, holding f open meanwhile:
// a concurrent Close then waits rather than let the number be reused.
func withNetns(f *os.File, fn func() error) error {
	rc, err := f.SyscallConn()
	if err != nil {
		return fmt.Errorf("the pod's network namespace: %w", err)
	}
	var ferr error
	if err := rc.Control(func(fd uintptr) { ferr = inNetns(int(fd), fn) }); err != nil {
		return fmt.Errorf("the pod's network namespace: %w", err)
	}
	return ferr
}

// inNetns runs fn on an OS thread moved into the network namespace fd,
// then moves the thread back. Sockets made by fn stay in the namespace.
// It runs on a goroutine of its own so the caller's thread is untouched.
func inNetns(fd int, fn func() error) error {
	errc := make(chan error, 1)
	go func() {
		runtime.LockOSThread()
		orig, err := os.Open("/proc/thread-self/ns/net")
		if err != nil {
			runtime.UnlockOSThread()
			errc <- fmt.Errorf("opening this thread's network namespace: %w", err)
			return
		}
		defer orig.Close()
		if err := unix.Setns(fd, unix.CLONE_NEWNET); err != nil {
			runtime.UnlockOSThread()
			errc <- fmt.Errorf("entering the pod's network namespace: %w", err)
			return
		}
		ferr := fn()
		if err := unix.Setns(int(orig.Fd()), unix.CLONE_NEWNET); err != nil {
			// The thread stays locked: the runtime ends it with this
			// goroutine instead of letting other code run in the pod.
			errc <- errors.Join(ferr, fmt.Errorf("leaving the pod's network namespace: %w", err))
			return
		}
		runtime.UnlockOSThread()
		errc <- ferr
	}()
	return <-errc
}
