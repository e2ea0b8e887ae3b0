package repair

import (
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"
)

func TestPodUIDInCgroupPath(t *testing.T) {
	const uid = "c9f6489b-3f23-45b1-b3bb-9328fd1ebf64"
	for line, want := range map[string]string{
		"4:cpu:/kubepods/besteffort/pod" + uid + "/0d0fee649a1d":                                                                                 uid,
		"4:cpu:/istio-cni-node-1/kubepods/burstable/pod" + uid + "/0d0f":                                                                         uid,
		"0::/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-podc9f6489b_3f23_45b1_b3bb_9328fd1ebf64.slice/cri-containerd-0d0f.scope": uid,
		"0::/../../kubepods/pod" + uid + "/abc":                                                                                                  uid,
		"4:cpu:/user.slice/user-1000.slice/session-3.scope":                                                                                      "",
		"4:cpu:/tmp/notapod" + uid:                                                                                                               "",
		"4:cpu:/kubepods/besteffort/pod" + uid[:35]:                                                                                              "",
		"4:cpu:/kubepods/besteffort/pod" + uid + "x":                                                                                             "",
		"4:cpu:/kubepods/besteffort/podC9F6489B-3F23-45B1-B3BB-9328FD1EBF64":                                                                     "",
	} {
		if got := PodUIDInCgroupPath(line); got != want {
			t.Errorf("PodUIDInCgroupPath(%q) = %q, want %q", line, got, want)
		}
	}
}

// TestIndexSkipsNodeNetworkProcesses: a process of a pod's cgroup on the
// node's network (CRI-O's conmon, with conmon_cgroup="pod", started
// before the sandbox) is not taken for the pod's sandbox, though it is
// the oldest there.
func TestIndexSkipsNodeNetworkProcesses(t *testing.T) {
	const uid = "c9f6489b-3f23-45b1-b3bb-9328fd1ebf64"
	// The node's network as the agent sees it: its own namespace when it
	// runs on the host network, else that of the host's init (pid 1 of
	// the host's /proc), the chart's default as Istio's.
	for name, nodeNS := range map[string]func(t *testing.T) string{
		"agent on the host network": func(*testing.T) string { return "/proc/self/ns/net" },
		"agent on a pod network": func(t *testing.T) string {
			host := filepath.Join(t.TempDir(), "host-netns")
			if err := os.WriteFile(host, nil, 0o600); err != nil {
				t.Fatal(err)
			}
			return host
		},
	} {
		t.Run(name, func(t *testing.T) {
			proc := t.TempDir()
			other := filepath.Join(t.TempDir(), "pod-netns")
			if err := os.WriteFile(other, nil, 0o600); err != nil {
				t.Fatal(err)
			}
			node := nodeNS(t)
			for pid, p := range map[string]struct {
				start  uint64
				netns  string
				cgroup string
			}{
				"1":   {1, node, "0::/init.scope\n"},
				"100": {10, node, "0::/kubepods.slice/kubepods-pod" + strings.ReplaceAll(uid, "-", "_") + ".slice/crio-conmon-x.scope\n"},
				"200": {20, other, "0::/kubepods.slice/kubepods-pod" + strings.ReplaceAll(uid, "-", "_") + ".slice/crio-x.scope\n"},
			} {
				dir := filepath.Join(proc, pid)
				if err := os.MkdirAll(filepath.Join(dir, "ns"), 0o755); err != nil {
					t.Fatal(err)
				}
				stat := fmt.Sprintf("%s (p) S 1 1 1 0 -1 0 0 0 0 0 0 0 0 0 20 0 1 0 %d 0 0\n", pid, p.start)
				for name, data := range map[string]string{"cgroup": p.cgroup, "stat": stat} {
					if err := os.WriteFile(filepath.Join(dir, name), []byte(data), 0o600); err != nil {
						t.Fatal(err)
					}
				}
				if err := os.Symlink(p.netns, filepath.Join(dir, "ns", "net")); err != nil {
					t.Fatal(err)
				}
			}
			index, err := IndexPodNetNS(proc)
			if err != nil {
				t.Fatal(err)
			}
			if got, want := index[uid], filepath.Join(proc, "200", "ns", "net"); got != want {
				t.Fatalf("the pod's namespace is %q, want the sandbox's %q (not the older process on the node's network)", got, want)
			}
		})
	}
}
