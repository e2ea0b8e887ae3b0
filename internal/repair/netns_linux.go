package repair

import (
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
)

// ErrNoNetNS means no process on the node lives in a namespace with the IP.
var ErrNoNetNS = errors.New("no network namespace on this node holds the pod's IP")

// FindNetNS returns /proc/<pid>/ns/net of the oldest process whose network
// namespace holds ip. Each namespace is entered once, however many
// processes share it. The host's own namespace (pid 1's) is skipped.
func FindNetNS(procDir string, ip netip.Addr) (string, error) {
	entries, err := os.ReadDir(procDir)
	if err != nil {
		return "", fmt.Errorf("reading %s: %w", procDir, err)
	}
	type nsKey struct{ dev, ino uint64 }
	hostNS := nsKey{}
	if st, err := statNS(filepath.Join(procDir, "1", "ns", "net")); err == nil {
		hostNS = nsKey{uint64(st.Dev), st.Ino}
	}
	oldest := map[nsKey]struct {
		pid   string
		start uint64
	}{}
	for _, e := range entries {
		pid := e.Name()
		if _, err := strconv.Atoi(pid); err != nil {
			continue
		}
		st, err := statNS(filepath.Join(procDir, pid, "ns", "net"))
		if err != nil {
			continue
		}
		k := nsKey{uint64(st.Dev), st.Ino}
		if k == hostNS {
			continue
		}
		start := startTime(filepath.Join(procDir, pid, "stat"))
		if cur, ok := oldest[k]; !ok || start < cur.start {
			oldest[k] = struct {
				pid   string
				start uint64
			}{pid, start}
		}
	}
	for _, p := range oldest {
		path := filepath.Join(procDir, p.pid, "ns", "net")
		found := false
		err := ns.WithNetNSPath(path, func(ns.NetNS) error {
			addrs, err := net.InterfaceAddrs()
			if err != nil {
				return err
			}
			for _, a := range addrs {
				if pfx, err := netip.ParsePrefix(a.String()); err == nil && pfx.Addr().Unmap() == ip {
					found = true
				}
			}
			return nil
		})
		if err == nil && found {
			return path, nil
		}
	}
	return "", fmt.Errorf("%w (%s)", ErrNoNetNS, ip)
}

func statNS(path string) (*syscall.Stat_t, error) {
	var st syscall.Stat_t
	if err := syscall.Stat(path, &st); err != nil {
		return nil, err
	}
	return &st, nil
}

// startTime reads a process's start time (field 22 of /proc/<pid>/stat),
// so the sandbox's pause process wins over later ones in its namespace.
func startTime(statPath string) uint64 {
	data, err := os.ReadFile(statPath)
	if err != nil {
		return ^uint64(0)
	}
	s := string(data)
	i := strings.LastIndexByte(s, ')')
	if i < 0 {
		return ^uint64(0)
	}
	fields := strings.Fields(s[i+1:])
	if len(fields) < 20 {
		return ^uint64(0)
	}
	v, err := strconv.ParseUint(fields[19], 10, 64)
	if err != nil {
		return ^uint64(0)
	}
	return v
}
