package testenv

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"os/exec"
	"os/signal"
	"path/filepath"
	"strings"
	"sync/atomic"
	"syscall"

	"github.com/containernetworking/cni/libcni"
	"github.com/containernetworking/cni/pkg/types"
	"github.com/containernetworking/plugins/pkg/ns"
	"github.com/containernetworking/plugins/pkg/testutils"

	"github.com/istio-cni-go/istio-cni/internal/cnirelay"
	"github.com/istio-cni-go/istio-cni/internal/ruleset"
	"github.com/istio-cni-go/istio-cni/internal/testutil"
)

// NodeNSEnv is set in a process that runs in its node namespace already.
const NodeNSEnv = "ISTIO_CNI_TEST_NODE_NS"

// Addresses of the test topology. The "remote" host is an address on the
// node namespace's lo, and that namespace has no uplink: if a redirect
// rule were missing, traffic would still stay on this machine.
const (
	RemoteV4 = "198.18.0.10"
	RemoteV6 = "fd00:198::10"
)

// nodeSeq gives every node of a process its own pod subnets
// (10.244.N.0/24, fd00:10:244:N::/64): the repair controller looks pod IPs
// up across the whole machine, so two test nodes must never share one.
var nodeSeq atomic.Int32

// EnterNodeNamespace re-executes the running binary in a fresh network and
// mount namespace (the "node"), unless it already runs in one, and exits
// with the child's status. Every CNI end-to-end run goes through here, so
// no veth ever lands in the machine's real network namespace.
func EnterNodeNamespace() {
	if os.Getenv(NodeNSEnv) == "1" {
		if err := setupNode(); err != nil {
			fmt.Fprintln(os.Stderr, "setting up the node namespace:", err)
			os.Exit(2)
		}
		return
	}
	if os.Geteuid() != 0 {
		fmt.Fprintln(os.Stderr, "end-to-end tests need root (network namespaces, netfilter); run them as root, as CI does")
		os.Exit(2)
	}
	args := append([]string{"--net", "--mount", "--propagation", "private", "--", os.Args[0]}, os.Args[1:]...)
	cmd := exec.Command("unshare", args...)
	cmd.Stdin, cmd.Stdout, cmd.Stderr = os.Stdin, os.Stdout, os.Stderr
	// The node has no uplink: whatever a test builds there must come from
	// what `make setup` downloaded. Saying so makes a missing download fail
	// at once with the tools' own "offline" messages instead of DNS errors.
	cmd.Env = append(os.Environ(), NodeNSEnv+"=1", "GOPROXY=off", "GOTOOLCHAIN=local", "ISTIO_CNI_OFFLINE=1")
	// This process only waits: a SIGINT or SIGTERM goes on to the child,
	// whose clean-ups need its namespaces, and the exit follows them.
	sigs := make(chan os.Signal, 1)
	signal.Notify(sigs, syscall.SIGINT, syscall.SIGTERM)
	err := cmd.Start()
	if err == nil {
		go func() {
			for sig := range sigs {
				_ = cmd.Process.Signal(sig)
			}
		}()
		err = cmd.Wait()
	}
	var ee *exec.ExitError
	if errors.As(err, &ee) {
		os.Exit(ee.ExitCode())
	}
	if err != nil {
		fmt.Fprintln(os.Stderr, "re-executing in a node namespace:", err)
		os.Exit(2)
	}
	os.Exit(0)
}

// NoIPv6Env, set to 1, has the node namespace turn IPv6 off before
// anything is set up in it, as on a machine booted with IPv6 disabled.
const NoIPv6Env = "ISTIO_CNI_TEST_NODE_NO_IPV6"

// IPv6Usable says whether this network namespace has IPv6: a kernel booted
// with ipv6.disable=1 has no /proc/sys/net/ipv6, and a machine can turn it
// off with disable_ipv6. Nodes and pods then get IPv4 alone.
func IPv6Usable() bool {
	b, err := os.ReadFile("/proc/sys/net/ipv6/conf/all/disable_ipv6")
	return err == nil && strings.TrimSpace(string(b)) != "1"
}

func setupNode() error {
	// Pod namespaces are bind-mounted under /run/netns; a private tmpfs
	// there keeps them out of the machine's view and cleans up by itself.
	// The same for the agent's run dir, which the chart mounts from the
	// host's /var/run/istio-cni, and the kubelet's pod logs.
	for _, d := range []string{"/run/netns", "/run/istio-cni", "/var/log/pods"} {
		if err := os.MkdirAll(d, 0o755); err != nil {
			return err
		}
		if err := syscall.Mount("tmpfs", d, "tmpfs", 0, "mode=0755"); err != nil {
			return fmt.Errorf("mounting tmpfs on %s: %w", d, err)
		}
	}
	if os.Getenv(NoIPv6Env) == "1" {
		// A machine booted with IPv6 off, as far as the node can tell.
		for _, conf := range []string{"all", "default"} {
			if err := os.WriteFile("/proc/sys/net/ipv6/conf/"+conf+"/disable_ipv6", []byte("1"), 0o644); err != nil {
				return err
			}
		}
	}
	cmds := [][]string{{"link", "set", "lo", "up"}, {"addr", "add", RemoteV4 + "/32", "dev", "lo"}}
	if IPv6Usable() {
		// No duplicate address detection on the node's side of the pods'
		// links either: a gateway address still tentative answers no
		// neighbour solicitation, so a pod's first IPv6 connection could
		// wait out its SYN retries (seen once under CI load as a 3 s dial
		// timeout).
		for _, conf := range []string{"all", "default"} {
			if err := os.WriteFile("/proc/sys/net/ipv6/conf/"+conf+"/accept_dad", []byte("0"), 0o644); err != nil {
				return err
			}
		}
		cmds = append(cmds, []string{"addr", "add", RemoteV6 + "/128", "dev", "lo"})
	}
	for _, c := range cmds {
		if out, err := exec.Command("ip", c...).CombinedOutput(); err != nil {
			return fmt.Errorf("ip %v: %w: %s", c, err, out)
		}
	}
	return nil
}

// Node is a simulated node: a CNI bin dir, a run dir and network configs.
type Node struct {
	Dir     string
	BinDir  string
	RunDir  string
	CNI     *libcni.CNIConfig
	Chained *libcni.NetworkConfigList
	Primary *libcni.NetworkConfigList
}

// BuildPlugin compiles the plugin (the relay and, next to it, the fallback
// it runs without an agent) into dir and returns the relay's path.
func BuildPlugin(dir string) (string, error) {
	if _, err := BuildCommand(dir, FallbackBinary); err != nil {
		return "", err
	}
	return BuildCommand(dir, "istio-cni")
}

// FallbackBinary is the complete plugin next to the relay.
const FallbackBinary = cnirelay.FallbackBinary

// linkPlugin links the relay built by BuildPlugin, and the fallback beside
// it, into dir under the names a runtime looks for.
func linkPlugin(relay, dir string) error {
	if err := os.Symlink(filepath.Join(filepath.Dir(relay), FallbackBinary), filepath.Join(dir, FallbackBinary)); err != nil {
		return err
	}
	return os.Symlink(relay, filepath.Join(dir, "istio-cni"))
}

// BuildCommand compiles ./cmd/<name> into dir and returns its path.
func BuildCommand(dir, name string) (string, error) {
	root, err := RepoRoot()
	if err != nil {
		return "", err
	}
	out := filepath.Join(dir, name)
	cmd := exec.Command("go", "build", "-trimpath", "-ldflags=-s -w", "-o", out, "./cmd/"+name)
	// Static, as the image ships them: a dynamically linked Go binary
	// spends about a millisecond in the loader on every start.
	cmd.Dir, cmd.Env = root, append(os.Environ(), "CGO_ENABLED=0")
	if b, err := cmd.CombinedOutput(); err != nil {
		return "", fmt.Errorf("building %s: %w: %s", name, err, b)
	}
	return out, nil
}

// ReferencePluginDir is where Debian installs the CNI reference plugins.
const ReferencePluginDir = "/usr/lib/cni"

// NewNode lays out a node in dir, with the plugin binary and the
// reference plugins in its bin dir. pluginConf is merged into the
// istio-cni entry of the chained config.
func NewNode(dir, pluginBinary string, pluginConf map[string]any) (*Node, error) {
	n := &Node{Dir: dir, BinDir: filepath.Join(dir, "bin"), RunDir: filepath.Join(dir, "run")}
	for _, d := range []string{n.BinDir, n.RunDir, filepath.Join(dir, "cache"), filepath.Join(dir, "ipam")} {
		if err := os.MkdirAll(d, 0o755); err != nil {
			return nil, err
		}
	}
	for _, p := range []string{"ptp", "host-local", "loopback"} {
		src := filepath.Join(ReferencePluginDir, p)
		if _, err := os.Stat(src); err != nil {
			return nil, fmt.Errorf("CNI reference plugin %s missing (Debian package containernetworking-plugins): %w", p, err)
		}
		if err := os.Symlink(src, filepath.Join(n.BinDir, p)); err != nil {
			return nil, err
		}
	}
	if err := linkPlugin(pluginBinary, n.BinDir); err != nil {
		return nil, err
	}
	seq := nodeSeq.Add(1) % 250
	ranges := [][]map[string]string{{{"subnet": fmt.Sprintf("10.244.%d.0/24", seq)}}}
	routes := []map[string]string{{"dst": "0.0.0.0/0"}}
	if IPv6Usable() {
		ranges = append(ranges, []map[string]string{{"subnet": fmt.Sprintf("fd00:10:244:%x::/64", seq)}})
		routes = append(routes, map[string]string{"dst": "::/0"})
	}
	ptp := map[string]any{
		"type":   "ptp",
		"ipMasq": false,
		"ipam": map[string]any{
			"type":    "host-local",
			"dataDir": filepath.Join(dir, "ipam"),
			"ranges":  ranges,
			"routes":  routes,
		},
	}
	istio := map[string]any{
		"type":               "istio-cni",
		"name":               "istio-cni",
		"cni_agent_run_dir":  n.RunDir,
		"plugin_log_level":   "debug",
		"exclude_namespaces": []string{"kube-system"},
		"pod_namespace":      "istio-system",
	}
	for k, v := range pluginConf {
		istio[k] = v
	}
	var err error
	if n.Chained, err = confList("k8s-pod-network", ptp, istio); err != nil {
		return nil, err
	}
	if n.Primary, err = confList("k8s-pod-network", ptp); err != nil {
		return nil, err
	}
	n.CNI = libcni.NewCNIConfigWithCacheDir([]string{n.BinDir}, filepath.Join(dir, "cache"), nil)
	return n, nil
}

func confList(name string, plugins ...map[string]any) (*libcni.NetworkConfigList, error) {
	b, err := json.Marshal(map[string]any{"cniVersion": "1.0.0", "name": name, "plugins": plugins})
	if err != nil {
		return nil, err
	}
	return libcni.ConfListFromBytes(b)
}

// Pod is a pod sandbox: its network namespace and the runtime's CNI view.
type Pod struct {
	Namespace, Name, UID, ContainerID string
	NetNS                             ns.NetNS
	RT                                *libcni.RuntimeConf
	// holder keeps a user-namespaced pod's namespaces alive.
	holder *exec.Cmd
}

// NewPod creates the pod's network namespace with lo up, as a runtime does.
func NewPod(namespace, name, uid, containerID string) (*Pod, error) {
	netns, err := testutils.NewNS()
	if err != nil {
		return nil, err
	}
	p := &Pod{Namespace: namespace, Name: name, UID: uid, ContainerID: containerID, NetNS: netns}
	if err := p.setUp(); err != nil {
		p.Close()
		return nil, err
	}
	return p, nil
}

// UserNSBase is the host id that id 0 of a user-namespaced test pod maps
// to; the kubelet likewise gives each such pod 65536 ids of its own.
const UserNSBase = 4 * 65536

// NewUserNSPod is NewPod for a pod with hostUsers: false: its network
// namespace belongs to a user namespace of its own, whose ids 0-65535 are
// UserNSBase onwards on the host, as the runtime sets it up.
func NewUserNSPod(namespace, name, uid, containerID string) (*Pod, error) {
	// By absolute path: some tests run with a PATH that holds no tools.
	holder := exec.Command("/bin/sleep", "infinity")
	holder.SysProcAttr = &syscall.SysProcAttr{Cloneflags: syscall.CLONE_NEWUSER | syscall.CLONE_NEWNET,
		UidMappings:                []syscall.SysProcIDMap{{ContainerID: 0, HostID: UserNSBase, Size: 65536}},
		GidMappings:                []syscall.SysProcIDMap{{ContainerID: 0, HostID: UserNSBase, Size: 65536}},
		GidMappingsEnableSetgroups: true}
	if err := holder.Start(); err != nil {
		return nil, fmt.Errorf("starting a user-namespaced sandbox: %w", err)
	}
	netns, err := ns.GetNS(fmt.Sprintf("/proc/%d/ns/net", holder.Process.Pid))
	if err != nil {
		_ = holder.Process.Kill()
		_ = holder.Wait()
		return nil, err
	}
	p := &Pod{Namespace: namespace, Name: name, UID: uid, ContainerID: containerID, NetNS: netns, holder: holder}
	if err := p.setUp(); err != nil {
		p.Close()
		return nil, err
	}
	return p, nil
}

func (p *Pod) setUp() error {
	// Duplicate address detection would hold every ADD for a second or two
	// while ptp waits for the IPv6 address to settle; the addresses here are
	// unique by construction.
	if err := p.NetNS.Do(func(ns.NetNS) error {
		// Absent on a kernel booted without IPv6.
		if err := os.WriteFile("/proc/sys/net/ipv6/conf/default/accept_dad", []byte("0"), 0o644); err != nil && !errors.Is(err, fs.ErrNotExist) {
			return err
		}
		return exec.Command("ip", "link", "set", "lo", "up").Run()
	}); err != nil {
		return err
	}
	p.RT = &libcni.RuntimeConf{
		ContainerID: p.ContainerID,
		NetNS:       p.NetNS.Path(),
		IfName:      "eth0",
		Args: [][2]string{
			{"IgnoreUnknown", "1"},
			{"K8S_POD_NAMESPACE", p.Namespace},
			{"K8S_POD_NAME", p.Name},
			{"K8S_POD_INFRA_CONTAINER_ID", p.ContainerID},
			{"K8S_POD_UID", p.UID},
		},
	}
	return nil
}

// Close removes the pod's namespace.
func (p *Pod) Close() {
	_ = p.NetNS.Close()
	if p.holder != nil {
		_ = p.holder.Process.Kill()
		_ = p.holder.Wait()
		return
	}
	_ = testutil.RemoveNS(p.NetNS)
}

// Add runs ADD of a network list for the pod.
func (n *Node) Add(ctx context.Context, list *libcni.NetworkConfigList, p *Pod) (types.Result, error) {
	return n.CNI.AddNetworkList(ctx, list, p.RT)
}

// Del runs DEL.
func (n *Node) Del(ctx context.Context, list *libcni.NetworkConfigList, p *Pod) error {
	return n.CNI.DelNetworkList(ctx, list, p.RT)
}

// Check runs CHECK.
func (n *Node) Check(ctx context.Context, list *libcni.NetworkConfigList, p *Pod) error {
	return n.CNI.CheckNetworkList(ctx, list, p.RT)
}

// InPod runs f on a thread inside the pod's network namespace; sockets
// made there stay in that namespace after f returns.
func (p *Pod) InPod(f func() error) error {
	return p.NetNS.Do(func(ns.NetNS) error { return f() })
}

// RulesPresent reports whether the pod's namespace holds any rule of
// ours: checking it against an empty plan fails exactly then.
func (p *Pod) RulesPresent(a interface {
	Check(string, *ruleset.Plan) error
}) bool {
	return a.Check(p.NetNS.Path(), &ruleset.Plan{V4: &ruleset.Set{Family: ruleset.IPv4}}) != nil
}
