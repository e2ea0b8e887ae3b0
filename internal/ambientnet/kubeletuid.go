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
	procs, err := kubeletProcs(proc)
	if err != nil {
		return 0, err
	}
	for _, name := range kubeletNames {
		var uids []uint32
		for _, pid := range procs[name] {
			status, err := fs.ReadFile(proc, pid+"/status")
			if err != nil {
				continue
			}
			uid, err := fsUID(status)
			if err != nil {
				return 0, fmt.Errorf("process %s (%s): %w", pid, name, err)
			}
			uids = append(uids, uid)
		}
		if len(uids) == 0 {
			continue
		}
		n := len(uids)
		slices.Sort(uids)
		if uids = slices.Compact(uids); len(uids) > 1 {
			return 0, fmt.Errorf("%d %s processes run as different uids %v: cannot tell which is the kubelet", n, name, uids)
		}
		return uids[0], nil
	}
	return 0, errNoKubelet
}

// kubeletProcs lists the pids of the processes named as the kubelet
// runs (kubeletNames), by name.
func kubeletProcs(proc fs.FS) (map[string][]string, error) {
	entries, err := fs.ReadDir(proc, ".")
	if err != nil {
		return nil, fmt.Errorf("reading the process list: %w", err)
	}
	out := map[string][]string{}
	for _, e := range entries {
		if _, err := strconv.Atoi(e.Name()); err != nil || !e.IsDir() {
			continue
		}
		comm, err := fs.ReadFile(proc, e.Name()+"/comm")
		if err != nil {
			// Gone since the listing, or not ours to read.
			continue
		}
		if name := strings.TrimSpace(string(comm)); slices.Contains(kubeletNames, name) {
			out[name] = append(out[name], e.Name())
		}
	}
	return out, nil
}

var errNoKubelet = fmt.Errorf("no kubelet process (%s) found in the process list", strings.Join(kubeletNames, ", "))

// KubeletNetns finds the kubelet's network namespace, the node's, in a
// /proc tree: "<pid>/ns/net" of a kubelet process (the names of
// KubeletUID, by preference). Every process of that name must be in one
// namespace. The caller opens it at once and holds it: the path names
// another process, or none, after a kubelet restart.
func KubeletNetns(proc fs.FS) (string, error) {
	procs, err := kubeletProcs(proc)
	if err != nil {
		return "", err
	}
	for _, name := range kubeletNames {
		first, firstNS := "", ""
		for _, pid := range procs[name] {
			link, err := fs.ReadLink(proc, pid+"/ns/net")
			if err != nil {
				continue
			}
			switch {
			case first == "":
				first, firstNS = pid, link
			case link != firstNS:
				return "", fmt.Errorf("%s processes %s and %s are in different network namespaces (%s, %s)", name, first, pid, firstNS, link)
			}
		}
		if first != "" {
			return first + "/ns/net", nil
		}
	}
	return "", errNoKubelet
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
