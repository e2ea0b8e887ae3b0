package ambientnet

import (
	"bufio"
	"bytes"
	"errors"
	"fmt"
	"io/fs"
	"slices"
	"strconv"
	"strings"
)

// kubeletNames are the command names (/proc/<pid>/comm) of the processes
// that run the kubelet, by preference: the kubelet itself, MicroK8s's
// kubelite, and k3s, whose server and agent rename themselves.
var kubeletNames = []string{"kubelet", "kubelite", "k3s-server", "k3s-agent", "k3s"}

// KubeletUID finds the uid the kubelet's sockets belong to, which is what
// the nftables probe SNAT matches, from a /proc tree (os.DirFS("/proc"),
// or the host's /proc mounted in the agent's pod). It takes the
// file-system uid: the kernel gives a socket its creator's.
func KubeletUID(proc fs.FS) (uint32, error) {
	entries, err := fs.ReadDir(proc, ".")
	if err != nil {
		return 0, fmt.Errorf("reading the process list: %w", err)
	}
	found := map[string][]uint32{}
	for _, e := range entries {
		if _, err := strconv.Atoi(e.Name()); err != nil || !e.IsDir() {
			continue
		}
		comm, err := fs.ReadFile(proc, e.Name()+"/comm")
		if err != nil {
			// Gone since the listing, or not ours to read.
			continue
		}
		name := strings.TrimSpace(string(comm))
		if !slices.Contains(kubeletNames, name) {
			continue
		}
		status, err := fs.ReadFile(proc, e.Name()+"/status")
		if err != nil {
			continue
		}
		uid, err := fsUID(status)
		if err != nil {
			return 0, fmt.Errorf("process %s (%s): %w", e.Name(), name, err)
		}
		found[name] = append(found[name], uid)
	}
	for _, name := range kubeletNames {
		uids := found[name]
		if len(uids) == 0 {
			continue
		}
		slices.Sort(uids)
		if uids = slices.Compact(uids); len(uids) > 1 {
			return 0, fmt.Errorf("%d %s processes run as different uids %v: cannot tell which is the kubelet", len(found[name]), name, uids)
		}
		return uids[0], nil
	}
	return 0, fmt.Errorf("no kubelet process (%s) found in the process list", strings.Join(kubeletNames, ", "))
}

// fsUID reads the file-system uid, the fourth of the "Uid:" line of a
// status file.
func fsUID(status []byte) (uint32, error) {
	sc := bufio.NewScanner(bytes.NewReader(status))
	for sc.Scan() {
		rest, ok := strings.CutPrefix(sc.Text(), "Uid:")
		if !ok {
			continue
		}
		f := strings.Fields(rest)
		if len(f) != 4 {
			return 0, fmt.Errorf("status has %d uids, want 4: %q", len(f), sc.Text())
		}
		uid, err := strconv.ParseUint(f[3], 10, 32)
		if err != nil {
			return 0, fmt.Errorf("status uid %q: %w", f[3], err)
		}
		return uint32(uid), nil
	}
	return 0, errors.New("status has no Uid line")
}
