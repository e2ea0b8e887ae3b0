package repair

import (
	"bufio"
	"errors"
	"fmt"
	"net"
	"net/netip"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"

	"github.com/containernetworking/plugins/pkg/ns"
	"golang.org/x/sys/unix"
)

// Errors of FindPodNetNS; each refusal says why, for the pod's Event.
var (
	ErrNotPodIP      = errors.New("the pod's sandbox namespace does not hold the pod's IP")
	ErrForeignUserNS = errors.New("the namespace belongs to a user namespace the pod does not run in")
)

// PodNetNS is what the agent knows of a pod to find its network namespace.
type PodNetNS struct {
	UID string
	IPs []netip.Addr
	// HostUsers is the pod's spec.hostUsers: false means its namespace
	// belongs to a user namespace of its own; nil means not known.
	HostUsers *bool
}

// IndexPodNetNS maps the UID of every pod with a process on the node to
// /proc/<pid>/ns/net of its oldest process outside the node's network
// namespace: the sandbox's. A pod's
// processes are known by the kubelet's cgroup of the pod, whose path names
// the pod's UID (kubepods/<qos>/pod<uid> with the cgroupfs driver,
// kubepods-<qos>-pod<uid_with_underscores>.slice with systemd's). No other
// user of the node can put a process there, unlike an IP, which anyone
// with a user namespace can give to a namespace of their own.
func IndexPodNetNS(procDir string) (map[string]string, error) {
	entries, err := os.ReadDir(procDir)
	if err != nil {
		return nil, fmt.Errorf("reading %s: %w", procDir, err)
	}
	type proc struct {
		pid   string
		start uint64
	}
	oldest := map[string]proc{}
	// A process of a pod's cgroup on the node's network is not the
	// sandbox, though it may be the oldest there (CRI-O's conmon with
	// conmon_cgroup="pod"). The node's network is the one of procDir's
	// first process (the host's init, procDir being the host's /proc),
	// and the agent's own when it runs on the host network; the chart,
	// as Istio's, gives it a pod network of its own unless ambient mode
	// shares the host's.
	var nodeNS []unix.Stat_t
	for _, p := range []string{filepath.Join(procDir, "1", "ns", "net"), "/proc/self/ns/net"} {
		var st unix.Stat_t
		if unix.Stat(p, &st) == nil {
			nodeNS = append(nodeNS, st)
		}
	}
	onNode := func(pid string) bool {
		var st unix.Stat_t
		if unix.Stat(filepath.Join(procDir, pid, "ns", "net"), &st) != nil {
			return false
		}
		for i := range nodeNS {
			if st.Dev == nodeNS[i].Dev && st.Ino == nodeNS[i].Ino {
				return true
			}
		}
		return false
	}
	for _, e := range entries {
		pid := e.Name()
		if _, err := strconv.Atoi(pid); err != nil {
			continue
		}
		uid := podUIDOfCgroup(filepath.Join(procDir, pid, "cgroup"))
		if uid == "" {
			continue
		}
		if onNode(pid) {
			continue
		}
		start := startTime(filepath.Join(procDir, pid, "stat"))
		if cur, ok := oldest[uid]; !ok || start < cur.start {
			oldest[uid] = proc{pid, start}
		}
	}
	index := make(map[string]string, len(oldest))
	for uid, p := range oldest {
		index[uid] = filepath.Join(procDir, p.pid, "ns", "net")
	}
	return index, nil
}

// OpenPodNetNS opens the network namespace of pod, found by its UID and
// verified (verifyOpen) through the open file, so what was verified
// is what is held: a path under /proc names whatever process comes to
// have that PID once the sandbox's has ended. Rules go in through FDPath
// of the file, which the caller closes.
func OpenPodNetNS(procDir string, pod PodNetNS) (*os.File, error) {
	index, err := IndexPodNetNS(procDir)
	if err != nil {
		return nil, err
	}
	path, ok := index[pod.UID]
	if !ok {
		return nil, fmt.Errorf("%w: no process on this node runs in the cgroup of pod %s", ErrNoNetNS, pod.UID)
	}
	return OpenVerifiedNetNS(path, pod)
}

// OpenVerifiedNetNS opens the namespace at path and verifies it as the
// pod's through the open file; the error names path.
func OpenVerifiedNetNS(path string, pod PodNetNS) (*os.File, error) {
	f, err := os.Open(path) //nolint:gosec // G304: a namespace under the host's /proc, found by the pod's cgroup
	if err != nil {
		return nil, err
	}
	if err := verifyOpen(f, path, pod); err != nil {
		_ = f.Close()
		return nil, err
	}
	return f, nil
}

// FDPath names an open namespace by this process's descriptor, for the
// rule backends, which take paths: the name cannot come to mean another
// namespace while the file is open.
func FDPath(f *os.File) string {
	return fmt.Sprintf("/proc/self/fd/%d", f.Fd())
}

// verifyOpen checks that the open namespace f (called name in errors) is
// the pod's: it holds one of the pod's IPs, and it belongs to the node's
// user namespace (or, for a pod with hostUsers: false, to another one). A
// namespace that fails either is refused, never programmed.
func verifyOpen(f *os.File, name string, pod PodNetNS) error {
	if err := checkUserNS(f, pod.HostUsers); err != nil {
		return fmt.Errorf("%s: %w", name, err)
	}
	var held []netip.Addr
	err := ns.WithNetNSPath(FDPath(f), func(ns.NetNS) error {
		addrs, err := net.InterfaceAddrs()
		if err != nil {
			return err
		}
		for _, a := range addrs {
			if pfx, err := netip.ParsePrefix(a.String()); err == nil {
				held = append(held, pfx.Addr().Unmap())
			}
		}
		return nil
	})
	if err != nil {
		return fmt.Errorf("entering %s: %w", name, err)
	}
	for _, want := range pod.IPs {
		for _, h := range held {
			if h == want.Unmap() {
				return nil
			}
		}
	}
	return fmt.Errorf("%w (%s holds %v, the pod has %v)", ErrNotPodIP, name, held, pod.IPs)
}

func checkUserNS(netns *os.File, hostUsers *bool) error {
	fd, err := unix.IoctlRetInt(int(netns.Fd()), unix.NS_GET_USERNS)
	if err != nil {
		// Kernels without the ioctl (before 4.9) have no user-namespaced
		// pods either: nothing to tell apart.
		return nil
	}
	owner := os.NewFile(uintptr(fd), "userns")
	defer owner.Close()
	var ost, nodeSt syscall.Stat_t
	if err := syscall.Fstat(int(owner.Fd()), &ost); err != nil {
		return err
	}
	// The agent runs in the node's user namespace (pid 1's may not be
	// readable, even with SYS_PTRACE, under some security modules).
	if err := syscall.Stat("/proc/self/ns/user", &nodeSt); err != nil {
		return fmt.Errorf("reading the node's user namespace: %w", err)
	}
	nodeOwned := ost.Ino == nodeSt.Ino && ost.Dev == nodeSt.Dev
	switch {
	case hostUsers == nil:
		return nil
	case *hostUsers && !nodeOwned:
		return fmt.Errorf("%w: it is owned by a user namespace other than the node's, and the pod does not set hostUsers: false", ErrForeignUserNS)
	case !*hostUsers && nodeOwned:
		return fmt.Errorf("%w: the pod sets hostUsers: false, yet the namespace is owned by the node's user namespace", ErrForeignUserNS)
	}
	return nil
}

// podUIDOfCgroup returns the pod UID named in a process's cgroup file, or
// "" for a process outside any pod's cgroup.
func podUIDOfCgroup(path string) string {
	f, err := os.Open(path) //nolint:gosec // G304: a cgroup file under the host's /proc, found by scanning it
	if err != nil {
		return ""
	}
	defer f.Close()
	s := bufio.NewScanner(f)
	for s.Scan() {
		if uid := PodUIDInCgroupPath(s.Text()); uid != "" {
			return uid
		}
	}
	return ""
}

// PodUIDInCgroupPath finds the kubelet's pod cgroup in one line of
// /proc/<pid>/cgroup (or a cgroup path) and returns the pod's UID in its
// canonical form, or "".
func PodUIDInCgroupPath(line string) string {
	for _, part := range strings.Split(line, "/") {
		part = strings.TrimSuffix(part, ".slice")
		i := strings.LastIndex(part, "pod")
		if i < 0 || (i > 0 && part[i-1] != '-' && part[i-1] != ':') {
			continue
		}
		uid := strings.ReplaceAll(part[i+3:], "_", "-")
		if isUID(uid) {
			return uid
		}
	}
	return ""
}

// isUID matches the 8-4-4-4-12 hex form the API server gives pod UIDs.
func isUID(s string) bool {
	if len(s) != 36 {
		return false
	}
	for i, c := range s {
		switch i {
		case 8, 13, 18, 23:
			if c != '-' {
				return false
			}
		default:
			if (c < '0' || c > '9') && (c < 'a' || c > 'f') {
				return false
			}
		}
	}
	return true
}
