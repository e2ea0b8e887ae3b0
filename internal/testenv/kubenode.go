package testenv

import (
	"context"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"time"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
)

// Images the cluster tests load into containerd.
const (
	PauseImage = "istio-cni-go/pause:test"
	AppImage   = "istio-cni-go/app:test"
)

// PlainHandler is a second runtime handler of the node: runc as the
// default one, whose pods' network is set up from PlainConfDir, which holds
// the same primary config and nothing else: so no istio-cni, whatever the
// agent inserts into ConfDir. A RuntimeClass naming it lets one burst
// hold pods started with the plugin and pods started without it, side by
// side under the same load.
const PlainHandler = "no-istio-cni"

// KubeNode is a real node: containerd with runc and a kubelet registered
// with the cluster, its CNI config a ptp primary.
type KubeNode struct {
	Dir, ConfDir, BinDir, Socket string
	// PlainConfDir is PlainHandler's CNI config dir.
	PlainConfDir string
	// Cgroups is the node's cgroup layout: the kubelet's QoS tree, and
	// the runtime and kubelet in a cgroup of their own.
	Cgroups *NodeCgroups
	cluster *Cluster
	procs   []*exec.Cmd
}

// KubeletBinary returns the kubelet built by hack/build-kube.sh.
func KubeletBinary() (string, error) {
	p, err := APIServerBinary()
	if err != nil {
		return "", err
	}
	k := filepath.Join(filepath.Dir(p), "kubelet")
	if _, err := os.Stat(k); err != nil {
		return "", fmt.Errorf("kubelet not built (hack/build-kube.sh kubelet): %w", err)
	}
	return k, nil
}

// BuildImage compiles a static Go command into a one-file image whose
// entry point it is, and returns the docker-archive path.
func BuildImage(dir, pkg, name, tag string) (string, error) {
	root, err := RepoRoot()
	if err != nil {
		return "", err
	}
	rootfs := filepath.Join(dir, name+"-rootfs")
	if err := os.MkdirAll(rootfs, 0o755); err != nil {
		return "", err
	}
	build := exec.Command("go", "build", "-trimpath", "-ldflags=-s -w", "-o", filepath.Join(rootfs, name), pkg)
	build.Dir, build.Env = root, append(os.Environ(), "CGO_ENABLED=0")
	if b, err := build.CombinedOutput(); err != nil {
		return "", fmt.Errorf("building %s: %w %s", pkg, err, b)
	}
	out := filepath.Join(dir, name+".tar")
	pack := exec.Command("go", "run", "./hack/imagepack", "-rootfs", rootfs, "-tag", tag, "-entrypoint", "/"+name, "-out", out)
	pack.Dir = root
	if b, err := pack.CombinedOutput(); err != nil {
		return "", fmt.Errorf("packing %s: %w %s", tag, err, b)
	}
	return out, nil
}

// StartKubeNode starts containerd and a kubelet for NodeName in dir and
// waits for the node to be Ready. Call it inside the node namespace.
func StartKubeNode(ctx context.Context, c *Cluster, dir string) (_ *KubeNode, err error) {
	n := &KubeNode{Dir: dir, ConfDir: filepath.Join(dir, "cni-conf"), BinDir: filepath.Join(dir, "cni-bin"),
		PlainConfDir: filepath.Join(dir, "cni-conf-plain"), Socket: filepath.Join(dir, "containerd.sock"), cluster: c}
	for _, d := range []string{n.ConfDir, n.PlainConfDir, n.BinDir, filepath.Join(dir, "ipam")} {
		if err := os.MkdirAll(d, 0o755); err != nil {
			return nil, err
		}
	}
	for _, p := range []string{"ptp", "host-local", "loopback"} {
		if err := os.Symlink(filepath.Join(ReferencePluginDir, p), filepath.Join(n.BinDir, p)); err != nil {
			return nil, err
		}
	}
	ptp := `{"cniVersion":"1.0.0","name":"k8s-pod-network","plugins":[{"type":"ptp","ipMasq":false,"ipam":{"type":"host-local","dataDir":"` +
		filepath.Join(dir, "ipam") + `","ranges":[[{"subnet":"10.249.0.0/24"}]],"routes":[{"dst":"0.0.0.0/0"}]}}]}`
	// The same network name and IPAM store in both dirs: the two handlers'
	// pods draw addresses from one pool.
	for _, d := range []string{n.ConfDir, n.PlainConfDir} {
		if err := os.WriteFile(filepath.Join(d, "10-ptp.conflist"), []byte(ptp), 0o644); err != nil {
			return nil, err
		}
	}
	logf, err := os.Create(filepath.Join(dir, "node.log"))
	if err != nil {
		return nil, err
	}
	cfg := fmt.Sprintf(`version = 2
root = %q
state = %q
[grpc]
  address = %q
[plugins."io.containerd.grpc.v1.cri"]
  sandbox_image = %q
  restrict_oom_score_adj = true
  [plugins."io.containerd.grpc.v1.cri".cni]
    bin_dir = %q
    conf_dir = %q
  [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc]
    runtime_type = "io.containerd.runc.v2"
  [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.%s]
    runtime_type = "io.containerd.runc.v2"
    cni_conf_dir = %q
    cni_max_conf_num = 1
`, filepath.Join(dir, "containerd-root"), filepath.Join(dir, "containerd-state"), n.Socket, PauseImage, n.BinDir, n.ConfDir,
		PlainHandler, n.PlainConfDir)
	cfgPath := filepath.Join(dir, "containerd.toml")
	if err := os.WriteFile(cfgPath, []byte(cfg), 0o644); err != nil {
		return nil, err
	}
	if n.Cgroups, err = NewNodeCgroups("/istio-cni-node-" + strconv.Itoa(os.Getpid())); err != nil {
		return nil, err
	}
	// From here on a failure takes down what was started.
	defer func() {
		if err != nil {
			n.Stop()
		}
	}()
	if err := n.start(logf, "containerd", "--config", cfgPath); err != nil {
		return nil, err
	}
	if err := n.waitContainerd(30 * time.Second); err != nil {
		return nil, err
	}
	for _, img := range []struct{ pkg, name, tag string }{{"./test/images/pause", "pause", PauseImage}, {"./test/images/app", "app", AppImage}} {
		tar, err := BuildImage(dir, img.pkg, img.name, img.tag)
		if err != nil {
			return nil, err
		}
		if err := n.Import(tar); err != nil {
			return nil, err
		}
	}
	kubelet, err := KubeletBinary()
	if err != nil {
		return nil, err
	}
	kc := filepath.Join(dir, "kubelet.kubeconfig")
	if err := c.AdminKubeconfig(kc); err != nil {
		return nil, err
	}
	port, err := freePort()
	if err != nil {
		return nil, err
	}
	kcfg := `apiVersion: kubelet.config.k8s.io/v1beta1
kind: KubeletConfiguration
cgroupDriver: cgroupfs
cgroupsPerQOS: true
cgroupRoot: ` + n.Cgroups.Root + `
enforceNodeAllocatable: []
failSwapOn: false
resolvConf: ""
evictionHard: {}
localStorageCapacityIsolation: false
address: 127.0.0.1
port: ` + strconv.Itoa(port) + `
readOnlyPort: 0
healthzPort: 0
authentication:
  anonymous:
    enabled: true
  webhook:
    enabled: false
authorization:
  mode: AlwaysAllow
containerRuntimeEndpoint: unix://` + n.Socket + `
imageServiceEndpoint: unix://` + n.Socket + `
`
	kcfgPath := filepath.Join(dir, "kubelet.yaml")
	if err := os.WriteFile(kcfgPath, []byte(kcfg), 0o644); err != nil {
		return nil, err
	}
	if err := n.start(logf, kubelet, "--config", kcfgPath, "--kubeconfig", kc, "--hostname-override", NodeName,
		"--root-dir", filepath.Join(dir, "kubelet"), "--cert-dir", filepath.Join(dir, "kubelet-pki"), "--node-ip", RemoteV4, "--v", "1"); err != nil {
		return nil, err
	}
	if err := n.waitNodeReady(ctx, 120*time.Second); err != nil {
		return nil, err
	}
	return n, nil
}

func (n *KubeNode) start(logf *os.File, bin string, args ...string) error {
	cmd := exec.Command(bin, args...)
	cmd.Stdout, cmd.Stderr = logf, logf
	if err := startOnLongLivedThread(cmd); err != nil {
		return fmt.Errorf("starting %s: %w", bin, err)
	}
	n.procs = append(n.procs, cmd)
	return n.Cgroups.MoveToRuntime(cmd.Process.Pid)
}

// RuntimePIDs are the node's own processes: containerd and the kubelet.
func (n *KubeNode) RuntimePIDs() []int {
	var out []int
	for _, c := range n.procs {
		out = append(out, c.Process.Pid)
	}
	return out
}

// Ctr runs ctr against this node's containerd, in the kubelet's namespace.
func (n *KubeNode) Ctr(args ...string) ([]byte, error) {
	return exec.Command("ctr", append([]string{"--address", n.Socket, "-n", "k8s.io"}, args...)...).CombinedOutput()
}

// Import loads a docker-archive image into containerd.
func (n *KubeNode) Import(tar string) error {
	if b, err := n.Ctr("images", "import", tar); err != nil {
		return fmt.Errorf("ctr images import %s: %w %s", tar, err, b)
	}
	return nil
}

func (n *KubeNode) waitContainerd(limit time.Duration) error {
	deadline := time.Now().Add(limit)
	for { // containerd has no readiness signal but its socket answering
		if _, err := n.Ctr("version"); err == nil {
			return nil
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("containerd not up after %s; see %s", limit, filepath.Join(n.Dir, "node.log"))
		}
		time.Sleep(50 * time.Millisecond)
	}
}

func (n *KubeNode) waitNodeReady(ctx context.Context, limit time.Duration) error {
	deadline := time.Now().Add(limit)
	for {
		node, err := n.cluster.Client.CoreV1().Nodes().Get(ctx, NodeName, metav1.GetOptions{})
		if err == nil {
			for _, c := range node.Status.Conditions {
				if c.Type == corev1.NodeReady && c.Status == corev1.ConditionTrue {
					return nil
				}
			}
		}
		if time.Now().After(deadline) {
			tail, _ := os.ReadFile(filepath.Join(n.Dir, "node.log"))
			if len(tail) > 4000 {
				tail = tail[len(tail)-4000:]
			}
			return fmt.Errorf("node %s not Ready after %s; log tail:\n%s", NodeName, limit, tail)
		}
		time.Sleep(200 * time.Millisecond) // polling the API server, bounded
	}
}

// Stop kills the kubelet and containerd, and every container process:
// containerd's shims outlive containerd by design, so they and their
// children are found through /proc by this node's socket path.
func (n *KubeNode) Stop() {
	for i := len(n.procs) - 1; i >= 0; i-- {
		if p := n.procs[i]; p.Process != nil {
			_ = p.Process.Kill()
			_ = p.Wait()
		}
	}
	n.procs = nil
	killShims(n.Socket)
	if n.Cgroups != nil {
		n.Cgroups.Remove()
	}
}

func killShims(socket string) {
	entries, err := os.ReadDir("/proc")
	if err != nil {
		return
	}
	parent := map[int]int{}
	var shims []int
	for _, e := range entries {
		pid, err := strconv.Atoi(e.Name())
		if err != nil {
			continue
		}
		if cmd, err := os.ReadFile("/proc/" + e.Name() + "/cmdline"); err == nil &&
			strings.Contains(string(cmd), "containerd-shim") && strings.Contains(string(cmd), socket) {
			shims = append(shims, pid)
		}
		if stat, err := os.ReadFile("/proc/" + e.Name() + "/stat"); err == nil {
			if i := strings.LastIndexByte(string(stat), ')'); i > 0 {
				if f := strings.Fields(string(stat)[i+1:]); len(f) > 1 {
					parent[pid], _ = strconv.Atoi(f[1])
				}
			}
		}
	}
	isUnder := func(pid, root int) bool {
		for p, hops := pid, 0; p > 1 && hops < 64; p, hops = parent[p], hops+1 {
			if p == root {
				return true
			}
		}
		return false
	}
	for _, shim := range shims {
		for pid := range parent {
			if pid != shim && isUnder(pid, shim) {
				_ = syscall.Kill(pid, syscall.SIGKILL)
			}
		}
		_ = syscall.Kill(shim, syscall.SIGKILL)
	}
}

// BindPendingPods stands in for kube-scheduler on this one-node cluster:
// until ctx ends it binds every pod that has no node (DaemonSet pods are
// created that way) to NodeName.
func BindPendingPods(ctx context.Context, c *Cluster) {
	go func() {
		for ctx.Err() == nil {
			pods, err := c.Client.CoreV1().Pods("").List(ctx, metav1.ListOptions{FieldSelector: "spec.nodeName="})
			if err == nil {
				for i := range pods.Items {
					p := &pods.Items[i]
					b := &corev1.Binding{ObjectMeta: metav1.ObjectMeta{Namespace: p.Namespace, Name: p.Name, UID: p.UID},
						Target: corev1.ObjectReference{Kind: "Node", Name: NodeName}}
					_ = c.Client.CoreV1().Pods(p.Namespace).Bind(ctx, b, metav1.CreateOptions{})
				}
			}
			select {
			case <-ctx.Done():
			case <-time.After(200 * time.Millisecond): // a scheduler's resync, bounded by ctx
			}
		}
	}()
}
