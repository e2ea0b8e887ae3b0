package testenv

import (
	"bufio"
	"context"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"sort"
	"strings"

	"golang.org/x/sys/unix"
)

// OneNode is a running single-node cluster: control plane, node, and a
// stand-in for the scheduler.
type OneNode struct {
	Cluster *Cluster
	Node    *KubeNode
	// Dir holds the cluster's state; free for callers' files too.
	Dir  string
	stop []func()
	// ownDir is set when Stop must remove Dir: StartOneNodeIn made it.
	ownDir bool
}

// NodeSetup is what StartOneNodeIn prepares beyond the bare node.
type NodeSetup struct {
	// AgentImage builds the project's agent image and imports it into
	// the node, as installing the chart needs.
	AgentImage bool
	// Namespaces are created once the API server is up.
	Namespaces []string
}

// StartOneNodeIn is the start-up the bench's cluster series and clusterup
// share: a fresh temporary directory (named after prefix, removed by
// Stop), a single-node cluster in it, then what setup asks for. Call it
// inside the node namespace.
func StartOneNodeIn(ctx context.Context, prefix string, setup NodeSetup) (*OneNode, error) {
	dir, err := os.MkdirTemp("", prefix)
	if err != nil {
		return nil, err
	}
	o, err := StartOneNode(ctx, dir)
	if err != nil {
		_ = os.RemoveAll(dir)
		return nil, err
	}
	o.ownDir = true
	if setup.AgentImage {
		if err := o.LoadAgentImage(dir); err != nil {
			o.Stop()
			return nil, err
		}
	}
	for _, ns := range setup.Namespaces {
		if err := EnsureNamespace(ctx, o.Cluster.Client, ns); err != nil {
			o.Stop()
			return nil, err
		}
	}
	return o, nil
}

// StartOneNode brings up etcd, kube-apiserver (reachable from pods),
// kube-controller-manager, containerd and a kubelet in dir. Call it inside
// the node namespace; Stop tears everything down.
func StartOneNode(ctx context.Context, dir string) (*OneNode, error) {
	o := &OneNode{Dir: dir}
	var err error
	if o.Cluster, err = StartPodReachableCluster(filepath.Join(dir, "cp")); err != nil {
		return nil, err
	}
	o.stop = append(o.stop, o.Cluster.Stop)
	if err := o.Cluster.StartControllerManager(); err != nil {
		o.Stop()
		return nil, err
	}
	if o.Node, err = StartKubeNode(ctx, o.Cluster, filepath.Join(dir, "node")); err != nil {
		o.Stop()
		return nil, err
	}
	o.stop = append(o.stop, o.Node.Stop)
	bindCtx, cancel := context.WithCancel(ctx)
	o.stop = append(o.stop, cancel)
	BindPendingPods(bindCtx, o.Cluster)
	return o, nil
}

// Stop tears down in reverse order, and removes Dir if StartOneNodeIn
// made it.
func (o *OneNode) Stop() {
	for i := len(o.stop) - 1; i >= 0; i-- {
		o.stop[i]()
	}
	o.stop = nil
	if o.ownDir {
		// The kubelet leaves its pods' volumes mounted under Dir, and
		// RemoveAll cannot remove a mount point.
		unmountUnder(o.Dir)
		_ = os.RemoveAll(o.Dir)
		o.ownDir = false
	}
}

// unmountUnder detaches every mount below dir in this mount namespace,
// deepest first.
func unmountUnder(dir string) {
	f, err := os.Open("/proc/self/mountinfo")
	if err != nil {
		return
	}
	defer f.Close()
	var below []string
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		// Fields: id parent major:minor root mountpoint ...; the mount
		// point has space, tab, newline and backslash octal-escaped.
		fields := strings.Fields(sc.Text())
		if len(fields) < 5 {
			continue
		}
		mp := mountinfoUnescape.Replace(fields[4])
		if strings.HasPrefix(mp, dir+"/") {
			below = append(below, mp)
		}
	}
	sort.Slice(below, func(i, j int) bool { return len(below[i]) > len(below[j]) })
	for _, mp := range below {
		_ = unix.Unmount(mp, unix.MNT_DETACH)
	}
}

var mountinfoUnescape = strings.NewReplacer(`\040`, " ", `\011`, "\t", `\012`, "\n", `\134`, `\`)

// LoadAgentImage builds the project's agent image (hack/build-image.sh)
// into dir and imports it into the node's containerd as AgentImage.
func (o *OneNode) LoadAgentImage(dir string) error {
	root, err := RepoRoot()
	if err != nil {
		return err
	}
	tar := filepath.Join(dir, "install-cni.tar")
	build := exec.Command(filepath.Join(root, "hack", "build-image.sh"), tar, AgentImage)
	build.Dir = root
	if b, err := build.CombinedOutput(); err != nil {
		return fmt.Errorf("building the agent image: %w\n%s", err, b)
	}
	return o.Node.Import(tar)
}
