package iptables

import (
	"context"
	"errors"
	"fmt"
	"os"
	"strings"
	"sync"

	"github.com/containernetworking/plugins/pkg/ns"
	"golang.org/x/sys/unix"

	"github.com/istio-cni-go/istio-cni/internal/execrun"
	"github.com/istio-cni-go/istio-cni/internal/nslock"
)

// podTarget is the pod namespace the iptables commands of one call act
// on, and how they must be run there.
type podTarget struct {
	// path names the pod's network namespace.
	path string
	// lock is the xtables lock of this pod's commands (xtablesLock).
	lock *os.File
	// userns is set when the network namespace belongs to a user
	// namespace other than ours: a pod with hostUsers: false.
	userns *os.File
	// nsenter runs a command in userns: its argv before the namespace
	// option.
	nsenter []string
	tables  nsTables
	runner  execrun.Runner
}

// inPod runs fn on a thread in the pod's network namespace, with what
// one call needs to know of it.
func (a *Applier) inPod(netnsPath string, fn func(*podTarget) error) error {
	var hide []string
	if foreign, err := foreignUserNS(netnsPath); err != nil {
		return err
	} else if foreign {
		hide = a.Hide
		if hide == nil {
			hide = DefaultHidden
		}
	}
	return inPodNetnsHiding(netnsPath, hide, func(netNS ns.NetNS) error {
		t, err := a.target(netnsPath, netNS)
		if err != nil {
			return err
		}
		defer t.close()
		return fn(t)
	})
}

// target inspects the pod's network namespace, from inside it.
//
// The kernel accepts owner matches (-m owner, Istio's proxy exclusion)
// only from a writer in the network namespace's own user namespace, where
// 1337 then means the pod's uid 1337, which is another uid on the host. So
// for a user-namespaced pod the commands run in its user namespace through
// nsenter, as Istio's plugin does.
func (a *Applier) target(path string, netNS ns.NetNS) (*podTarget, error) {
	t := &podTarget{path: path, tables: &tableSnapshot{}, runner: a.Runner}
	if t.runner == nil {
		t.runner = execrun.OS{}
	}
	var err error
	if t.lock, err = xtablesLock(netNS); err != nil {
		return nil, err
	}
	fd, err := unix.IoctlRetInt(int(netNS.Fd()), unix.NS_GET_USERNS)
	if err != nil {
		// Kernels without the ioctl (before 4.9) have no pods in user
		// namespaces either.
		return t, nil
	}
	owner := os.NewFile(uintptr(fd), "userns")
	same, err := isOwnUserNS(owner)
	if err != nil || same {
		_ = owner.Close()
		if err != nil {
			t.close()
			return nil, err
		}
		return t, nil
	}
	t.userns = owner
	if t.nsenter, err = a.nsenter(); err != nil {
		t.close()
		return nil, err
	}
	return t, nil
}

// nsenter finds the argv that enters a user namespace: util-linux's
// nsenter, else busybox's.
func (a *Applier) nsenter() ([]string, error) {
	if p, err := a.lookPath("nsenter"); err == nil {
		return []string{p}, nil
	}
	if p, err := a.lookPath("busybox"); err == nil {
		return []string{p, "nsenter"}, nil
	}
	return nil, errors.New("the pod's network namespace belongs to a user namespace of its own (hostUsers: false); " +
		"writing its owner rules needs nsenter (util-linux or busybox), found neither in PATH or sbin directories")
}

// ownUserNS identifies this process's user namespace, which never changes.
var ownUserNS = sync.OnceValues(func() (unix.Stat_t, error) {
	var st unix.Stat_t
	err := unix.Stat("/proc/self/ns/user", &st)
	return st, err
})

func isOwnUserNS(f *os.File) (bool, error) {
	own, err := ownUserNS()
	if err != nil {
		return false, err
	}
	var st unix.Stat_t
	if err := unix.Fstat(int(f.Fd()), &st); err != nil {
		return false, err
	}
	return st.Dev == own.Dev && st.Ino == own.Ino, nil
}

func (t *podTarget) close() {
	for _, f := range []*os.File{t.userns, t.lock} {
		if f != nil {
			_ = f.Close()
		}
	}
}

// how says, for messages, how a write ran when not plainly.
func (t *podTarget) how() string {
	if t.userns != nil {
		return " (in the pod's user namespace, through " + strings.Join(t.nsenter, " ") + ")"
	}
	return ""
}

// run executes an iptables binary in the pod's network namespace (the
// calling thread is in it), with a lock of our own (xtablesLock), so pods
// never wait on the host's xtables lock, nor on a lock a pod could hold. Writes to a
// user-namespaced pod run in its user namespace; reads need not (and
// legacy iptables-save cannot list the tables from there).
func (t *podTarget) run(write bool, bin, stdin string, args ...string) (string, error) {
	c := &execrun.Cmd{
		Path: bin,
		Args: args,
		// The lock goes as a descriptor: from inside the pod's user
		// namespace the agent's files cannot be opened by path.
		ExtraFiles: []*os.File{t.lock},
		Env:        []string{"PATH=/usr/local/sbin:/usr/sbin:/sbin:/usr/local/bin:/usr/bin:/bin", "XTABLES_LOCKFILE=/proc/self/fd/3"},
	}
	if write && t.userns != nil {
		c.Path = t.nsenter[0]
		c.Args = append(append(append([]string{}, t.nsenter[1:]...), "--user=/proc/self/fd/4", bin), args...)
		c.ExtraFiles = []*os.File{t.lock, t.userns}
	}
	if stdin != "" {
		c.Stdin = []byte(stdin)
	}
	res, err := t.runner.Run(context.Background(), c)
	if err != nil {
		msg := strings.TrimSpace(string(res.Stderr))
		if stdin != "" {
			msg += "\ninput was:\n" + abridge(stdin)
		}
		return "", &restoreError{err: err, stderr: string(res.Stderr), msg: msg}
	}
	return string(res.Stdout), nil
}

// restoreError is a failed iptables command with what it printed.
type restoreError struct {
	err    error
	stderr string
	msg    string
}

// Error says how the command ended, what it printed and what it was fed;
// the caller names the command.
func (e *restoreError) Error() string {
	var exit *execrun.ExitError
	if errors.As(e.err, &exit) {
		return exit.State() + ": " + e.msg
	}
	return e.err.Error() + ": " + e.msg
}
func (e *restoreError) Unwrap() error { return e.err }

// abridge keeps an error's copy of the input readable: a long list's
// rules run to thousands of lines, and the line iptables names is in
// its own message.
func abridge(text string) string {
	const keep = 40
	lines := strings.Split(text, "\n")
	if len(lines) <= 2*keep {
		return text
	}
	return strings.Join(lines[:keep], "\n") + fmt.Sprintf("\n... (%d lines) ...\n", len(lines)-2*keep) + strings.Join(lines[len(lines)-keep:], "\n")
}

// lockDir holds the xtables locks of the pods' iptables commands: root's
// alone, in the mount namespace of the agent (or of the node, for the
// fallback plugin), where no pod can reach it. The lock was once the
// pod's network namespace file itself, which a process in the pod can
// open and hold, stalling every legacy write to its pod for 30 s.
const lockDir = "/run/istio-cni-xtables"

// lockBuckets bounds the lock files: pods share one by their namespace's
// inode, so two pods rarely wait on each other, and only for a write.
const lockBuckets = 64

func xtablesLock(netNS ns.NetNS) (*os.File, error) {
	var st unix.Stat_t
	if err := unix.Fstat(int(netNS.Fd()), &st); err != nil {
		return nil, err
	}
	// Readable by all: iptables in a user-namespaced pod's user namespace
	// reopens it through /proc/self/fd, as a uid that is not root's. No
	// path reaches it but through the root-only directory.
	f, err := nslock.PrivateFile(lockDir, fmt.Sprintf("%02d.lock", st.Ino%lockBuckets), 0o644)
	if err != nil {
		return nil, fmt.Errorf("xtables lock: %w", err)
	}
	return f, nil
}

// foreignUserNS tells whether the namespace at path belongs to a user
// namespace other than ours (a pod with hostUsers: false).
func foreignUserNS(path string) (bool, error) {
	f, err := os.Open(path) //nolint:gosec // G304: the runtime names the pod's namespace; opening it is the point.
	if err != nil {
		return false, err
	}
	defer f.Close()
	fd, err := unix.IoctlRetInt(int(f.Fd()), unix.NS_GET_USERNS)
	if err != nil {
		return false, nil
	}
	owner := os.NewFile(uintptr(fd), "userns")
	defer owner.Close()
	same, err := isOwnUserNS(owner)
	return !same, err
}
