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
// namespace holds ip.
func FindNetNS(procDir string, ip netip.Addr) (string, error) {
	index, err := IndexNetNS(procDir)
	if err != nil {
		return "", err
	}
	if p, ok := index[ip]; ok {
		return p, nil
	}
	return "", fmt.Errorf("%w (%s)", ErrNoNetNS, ip)
}

// IndexNetNS maps every address of every network namespace on the node
// (but the host's, pid 1's) to /proc/<pid>/ns/net of the oldest process in
// it: the sandbox's pause process rather than a later container. Each
// namespace is entered once, however many processes share it.
func IndexNetNS(procDir string) (map[netip.Addr]string, error) {
	entries, err := os.ReadDir(procDir)
	if err != nil {
		return nil, fmt.Errorf("reading %s: %w", procDir, err)
	}
	type nsKey struct{ dev, ino uint64 }
	hostNS := nsKey{}
	if st, err := statNS(filepath.Join(procDir, "1", "ns", "net")); err == nil {
		hostNS = nsKey{uint64(st.Dev), st.Ino}
	}
	type proc struct {
		pid   string
		start uint64
	}
	oldest := map[nsKey]proc{}
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
			oldest[k] = proc{pid, start}
		}
	}
	index := map[netip.Addr]string{}
	for _, p := range oldest {
		path := filepath.Join(procDir, p.pid, "ns", "net")
		_ = ns.WithNetNSPath(path, func(ns.NetNS) error {
			addrs, err := net.InterfaceAddrs()
			if err != nil {
				return err
			}
			for _, a := range addrs {
				pfx, err := netip.ParsePrefix(a.String())
				if err != nil || pfx.Addr().IsLoopback() || pfx.Addr().IsLinkLocalUnicast() {
					continue
				}
				index[pfx.Addr().Unmap()] = path
			}
			return nil
		})
	}
	return index, nil
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
