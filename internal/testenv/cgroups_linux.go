package testenv

import (
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"sort"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"

	corev1 "k8s.io/api/core/v1"
)

// cgroupMount is where the machine's cgroup hierarchies are.
const cgroupMount = "/sys/fs/cgroup"

// NodeCgroups is the cgroup layout of a real node, made under a root of
// its own in every cgroup v1 hierarchy (or the unified one, on a machine
// with no v1): the kubelet's QoS tree
// (<root>/kubepods/{burstable,besteffort}/pod<uid>) and the runtime and
// kubelet in <root>/runtime, as a node runs them in a slice of their own.
type NodeCgroups struct {
	// Root is the kubelet's cgroupRoot, relative to each hierarchy.
	Root string
	dirs []string // one per v1 hierarchy (<mount>/<hierarchy>), or the v2 mount
	// all are every hierarchy, the unified one too, where the kubelet
	// also makes cgroups in hybrid mode: removal looks in each.
	all []string
}

// NewNodeCgroups creates root and root/runtime in every v1 hierarchy, or
// in the unified one if there is no v1 hierarchy.
func NewNodeCgroups(root string) (*NodeCgroups, error) {
	entries, err := os.ReadDir(cgroupMount)
	if err != nil {
		return nil, err
	}
	g := &NodeCgroups{Root: root}
	for _, e := range entries {
		h := filepath.Join(cgroupMount, e.Name())
		if e.IsDir() {
			g.all = append(g.all, h)
		}
		// Only v1 hierarchies: the kubelet's cgroupfs driver uses them
		// when the machine runs in hybrid mode.
		if _, err := os.Stat(filepath.Join(h, "cgroup.clone_children")); err != nil {
			continue
		}
		if fi, err := os.Lstat(h); err != nil || !fi.IsDir() {
			continue
		}
		g.dirs = append(g.dirs, h)
		if err := mkCgroup(h, filepath.Join(root, "runtime")); err != nil {
			g.Remove()
			return nil, err
		}
	}
	if len(g.dirs) == 0 {
		return g.unified()
	}
	return g, nil
}

// unified lays the tree out in the one hierarchy of a cgroup v2 only
// machine, where the kubelet puts it too. A process's line there
// ("0::/<root>/kubepods/besteffort/pod<uid>") names the pod as the v1
// lines do, and the agent's repair reads every line. The cpu and cpuacct
// accessors still need v1.
func (g *NodeCgroups) unified() (*NodeCgroups, error) {
	if _, err := os.Stat(filepath.Join(cgroupMount, "cgroup.controllers")); err != nil {
		return nil, errors.New("no cgroup v1 hierarchy under " + cgroupMount + ", and it is no cgroup v2 mount either")
	}
	g.dirs, g.all = []string{cgroupMount}, []string{cgroupMount}
	if err := mkCgroup(cgroupMount, filepath.Join(g.Root, "runtime")); err != nil {
		g.Remove()
		return nil, err
	}
	return g, nil
}

// MoveToRuntime moves pid into root/runtime in every hierarchy.
func (g *NodeCgroups) MoveToRuntime(pid int) error {
	for _, h := range g.dirs {
		if err := os.WriteFile(filepath.Join(h, g.Root, "runtime", "cgroup.procs"), []byte(strconv.Itoa(pid)), 0o644); err != nil {
			return fmt.Errorf("moving %d to %s: %w", pid, filepath.Join(h, g.Root, "runtime"), err)
		}
	}
	return nil
}

// Remove kills what is left in the tree (every process there is the
// node's), waits for it to exit, and removes the tree, deepest first.
func (g *NodeCgroups) Remove() {
	deadline := time.Now().Add(10 * time.Second)
	for {
		pids := g.procs()
		for _, pid := range pids {
			_ = syscall.Kill(pid, syscall.SIGKILL)
		}
		if len(pids) == 0 || time.Now().After(deadline) {
			break
		}
		time.Sleep(20 * time.Millisecond) // waiting for killed processes to exit, bounded
	}
	for _, h := range g.all {
		dirs := g.tree(h)
		sort.Slice(dirs, func(i, j int) bool { return len(dirs[i]) > len(dirs[j]) })
		for _, d := range dirs {
			_ = os.Remove(d)
		}
	}
}

func (g *NodeCgroups) tree(h string) []string {
	var dirs []string
	_ = filepath.WalkDir(filepath.Join(h, g.Root), func(p string, d os.DirEntry, err error) error {
		if err == nil && d.IsDir() {
			dirs = append(dirs, p)
		}
		return nil
	})
	return dirs
}

func (g *NodeCgroups) procs() []int {
	var pids []int
	for _, h := range g.all {
		for _, d := range g.tree(h) {
			b, _ := os.ReadFile(filepath.Join(d, "cgroup.procs"))
			for _, f := range strings.Fields(string(b)) {
				if pid, err := strconv.Atoi(f); err == nil {
					pids = append(pids, pid)
				}
			}
		}
	}
	return pids
}

// PodCgroup returns the kubelet's cgroup of a pod in the cpu hierarchy,
// and the QoS class directory it is under.
func (g *NodeCgroups) PodCgroup(uid string) (string, error) {
	for _, h := range g.dirs {
		if filepath.Base(h) != "cpu,cpuacct" && filepath.Base(h) != "cpu" {
			continue
		}
		for _, qos := range []string{"", "burstable", "besteffort"} {
			p := filepath.Join(h, g.Root, "kubepods", qos, "pod"+uid)
			if _, err := os.Stat(p); err == nil {
				return p, nil
			}
		}
		return "", fmt.Errorf("no cgroup for pod %s under %s", uid, filepath.Join(h, g.Root, "kubepods"))
	}
	return "", errors.New("no cpu hierarchy")
}

var (
	simCgroupsMu sync.Mutex
	simCgroups   *NodeCgroups
)

// StartSandboxProcess starts a long-lived process in the pod's network
// namespace and puts it in the pod's cgroup as the kubelet lays it out
// (kubepods/besteffort/pod<uid>, under a root of this test process's), so
// the pod can be found on the node by its identity, as a runtime's sandbox
// can. stop kills it.
func (p *Pod) StartSandboxProcess() (stop func(), err error) {
	simCgroupsMu.Lock()
	if simCgroups == nil {
		simCgroups, err = NewNodeCgroups("/istio-cni-sim-" + strconv.Itoa(os.Getpid()))
	}
	g := simCgroups
	simCgroupsMu.Unlock()
	if err != nil {
		return nil, err
	}
	var cmd *exec.Cmd
	if err := p.InPod(func() error {
		// By absolute path: some tests run with a PATH that holds no tools.
		cmd = exec.Command("/bin/sleep", "infinity")
		return cmd.Start()
	}); err != nil {
		return nil, err
	}
	stop = func() { _ = cmd.Process.Kill(); _ = cmd.Wait() }
	if err := g.JoinPod(p.UID, cmd.Process.Pid); err != nil {
		stop()
		return nil, err
	}
	return stop, nil
}

// JoinPod puts pid into the cgroup of the pod with uid, in every hierarchy.
func (g *NodeCgroups) JoinPod(uid string, pid int) error {
	rel := filepath.Join(g.Root, "kubepods", "besteffort", "pod"+uid)
	for _, h := range g.dirs {
		if err := mkCgroup(h, rel); err != nil {
			return err
		}
		if err := os.WriteFile(filepath.Join(h, rel, "cgroup.procs"), []byte(strconv.Itoa(pid)), 0o644); err != nil {
			return fmt.Errorf("moving %d into %s: %w", pid, filepath.Join(h, rel), err)
		}
	}
	return nil
}

// RemoveSandboxCgroups removes what StartSandboxProcess made; test mains
// call it on their way out.
func RemoveSandboxCgroups() {
	simCgroupsMu.Lock()
	defer simCgroupsMu.Unlock()
	if simCgroups != nil {
		simCgroups.Remove()
		simCgroups = nil
	}
}

// mkCgroup makes each missing level of rel under the hierarchy h. A new
// cpuset cgroup starts with no CPUs and no memory nodes; each level takes
// its parent's.
func mkCgroup(h, rel string) error {
	d := h
	for _, part := range strings.Split(strings.Trim(rel, "/"), "/") {
		d = filepath.Join(d, part)
		if err := os.Mkdir(d, 0o755); err != nil {
			if os.IsExist(err) {
				continue
			}
			return err
		}
		if !strings.HasSuffix(h, "cpuset") {
			continue
		}
		for _, f := range []string{"cpuset.cpus", "cpuset.mems"} {
			b, err := os.ReadFile(filepath.Join(filepath.Dir(d), f))
			if err == nil {
				err = os.WriteFile(filepath.Join(d, f), b, 0o644)
			}
			if err != nil {
				return fmt.Errorf("%s: %w", filepath.Join(d, f), err)
			}
		}
	}
	return nil
}

// CPUUsage returns the CPU time used so far by everything under rel (a
// path below the node's root, "" for the whole node), from the cpuacct
// hierarchy: what the bench splits a burst's CPU by.
func (g *NodeCgroups) CPUUsage(rel string) (time.Duration, error) {
	for _, h := range g.dirs {
		if !slices.Contains(strings.Split(filepath.Base(h), ","), "cpuacct") {
			continue
		}
		b, err := os.ReadFile(filepath.Join(h, g.Root, rel, "cpuacct.usage"))
		if err != nil {
			return 0, err
		}
		ns, err := strconv.ParseInt(strings.TrimSpace(string(b)), 10, 64)
		if err != nil {
			return 0, fmt.Errorf("cpuacct.usage of %s: %w", rel, err)
		}
		return time.Duration(ns), nil
	}
	return 0, errors.New("no cpuacct hierarchy")
}

// PodCgroupRel is a pod's cgroup below the node's root, by its QoS class,
// as the kubelet lays it out.
func PodCgroupRel(uid string, qos corev1.PodQOSClass) string {
	switch qos {
	case corev1.PodQOSGuaranteed:
		return filepath.Join("kubepods", "pod"+uid)
	case corev1.PodQOSBurstable:
		return filepath.Join("kubepods", "burstable", "pod"+uid)
	}
	return filepath.Join("kubepods", "besteffort", "pod"+uid)
}

// CPUDir is rel's directory in the cpu hierarchy (rel below the node's
// root; "" is the root).
func (g *NodeCgroups) CPUDir(rel string) (string, error) {
	for _, h := range g.dirs {
		if slices.Contains(strings.Split(filepath.Base(h), ","), "cpu") {
			return filepath.Join(h, g.Root, rel), nil
		}
	}
	return "", errors.New("no cpu hierarchy")
}

// CPUCgroupOf is the cgroup a process is in, in the cpu hierarchy, as
// /proc/<pid>/cgroup names it.
func CPUCgroupOf(pid int) (string, error) {
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/cgroup", pid))
	if err != nil {
		return "", err
	}
	for _, line := range strings.Split(string(b), "\n") {
		parts := strings.SplitN(line, ":", 3)
		if len(parts) == 3 && slices.Contains(strings.Split(parts[1], ","), "cpu") {
			return parts[2], nil
		}
	}
	return "", fmt.Errorf("process %d has no cpu cgroup", pid)
}
