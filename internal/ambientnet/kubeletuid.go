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

// KubeletNetns finds the kubelet's network namespace, the node's, in a
// /proc tree: "<pid>/ns/net" of a kubelet process (the names of
// KubeletUID, by preference). Every process of that name must be in one
// namespace. The caller opens it at once and holds it: the path names
// another process, or none, after a kubelet restart.
func KubeletNetns(proc fs.FS) (string, error) {
	entries, err := fs.ReadDir(proc, ".")
	if err != nil {
		return "", fmt.Errorf("reading the process list: %w", err)
	}
	type found struct{ pid, ns string }
	byName := map[string][]found{}
	for _, e := range entries {
		if _, err := strconv.Atoi(e.Name()); err != nil || !e.IsDir() {
			continue
		}
		comm, err := fs.ReadFile(proc, e.Name()+"/comm")
		if err != nil {
			continue
		}
		name := strings.TrimSpace(string(comm))
		if !slices.Contains(kubeletNames, name) {
			continue
		}
		link, err := fs.ReadLink(proc, e.Name()+"/ns/net")
		if err != nil {
			continue
		}
		byName[name] = append(byName[name], found{e.Name(), link})
	}
	for _, name := range kubeletNames {
		procs := byName[name]
		if len(procs) == 0 {
			continue
		}
		for _, f := range procs[1:] {
			if f.ns != procs[0].ns {
				return "", fmt.Errorf("%s processes %s and %s are in different network namespaces (%s, %s)", name, procs[0].pid, f.pid, procs[0].ns, f.ns)
			}
		}
		return procs[0].pid + "/ns/net", nil
	}
	return "", fmt.Errorf("no kubelet process (%s) found in the process list", strings.Join(kubeletNames, ", "))
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
