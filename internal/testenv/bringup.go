package testenv

import (
	"context"
	"fmt"
	"os/exec"
	"path/filepath"
)

// OneNode is a running single-node cluster: control plane, node, and a
// stand-in for the scheduler.
type OneNode struct {
	Cluster *Cluster
	Node    *KubeNode
	stop    []func()
}

// StartOneNode brings up etcd, kube-apiserver (reachable from pods),
// kube-controller-manager, containerd and a kubelet in dir. Call it inside
// the node namespace; Stop tears everything down.
func StartOneNode(ctx context.Context, dir string) (*OneNode, error) {
	o := &OneNode{}
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

// Stop tears down in reverse order.
func (o *OneNode) Stop() {
	for i := len(o.stop) - 1; i >= 0; i-- {
		o.stop[i]()
	}
	o.stop = nil
}

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
		return fmt.Errorf("building the agent image: %v\n%s", err, b)
	}
	return o.Node.Import(tar)
}
