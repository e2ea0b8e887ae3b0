package e2e

import (
	"bufio"
	"context"
	"fmt"
	"net/netip"
	"os"
	"os/exec"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/containernetworking/cni/libcni"
	current "github.com/containernetworking/cni/pkg/types/100"
	"golang.org/x/sys/unix"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/util/retry"

	"github.com/istio-cni-go/istio-cni/internal/ambient"
	"github.com/istio-cni-go/istio-cni/internal/ambientnet"
	"github.com/istio-cni-go/istio-cni/internal/install"
	"github.com/istio-cni-go/istio-cni/internal/iptables"
	"github.com/istio-cni-go/istio-cni/internal/nftables"
	"github.com/istio-cni-go/istio-cni/internal/ruleset"
	"github.com/istio-cni-go/istio-cni/internal/testenv"
	"github.com/istio-cni-go/istio-cni/internal/zds"
	"github.com/istio-cni-go/istio-cni/internal/ztunnelsim"
)

// ambientNode is a node whose agent runs in ambient mode, with a
// stand-in ztunnel connected to it.
type ambientNode struct {
	*host
	nft  bool
	args []string
	sim  *ztunnelsim.Sim
	cni  *libcni.CNIConfig
	list *libcni.NetworkConfigList
}

func newAmbientNode(t *testing.T, subnet string, nft bool) *ambientNode {
	t.Helper()
	ensureDaemonSet(t, false)
	h := ptpHost(t, subnet)
	sock := h.RunDir + "-ztunnel.sock"
	args := []string{"--kubernetes-node-name", testenv.NodeName, "--ambient-enabled", "--ambient-dns-capture=true",
		"--ztunnel-uds-address", sock, "--repair-host-proc", "/proc", fmt.Sprintf("--native-nftables=%v", nft)}
	h.start(args...)
	h.waitReadyz(200, 20*time.Second)
	sim, err := ztunnelsim.Start(ztunnelsim.Config{Path: sock, Listeners: true, Reconnect: true})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(sim.Close)
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	if _, err := sim.Wait(ctx, func(s ztunnelsim.State) bool { return s.Connected && s.Snapshots == 1 }); err != nil {
		t.Fatalf("the stand-in ztunnel never got its snapshot: %v", err)
	}
	primary, _, err := install.FindPrimary(h.NetDir, "")
	if err != nil {
		t.Fatal(err)
	}
	list, err := libcni.ConfListFromFile(primary)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		// The node's probe SNAT is the agent's; a test's node must not
		// leave it to the next one.
		_ = node(nft).RemoveHost("/proc/self/ns/net")
	})
	return &ambientNode{host: h, nft: nft, args: args, sim: sim, cni: libcni.NewCNIConfigWithCacheDir([]string{h.BinDir}, t.TempDir(), nil), list: list}
}

// add creates the pod object and runs the node's chain for it as a
// runtime does; it returns the pod and the ADD's error.
func (n *ambientNode) add(t *testing.T, spec testenv.PodSpec, containerID string) (*testenv.Pod, *corev1.Pod, netip.Addr, error) {
	t.Helper()
	k8sPod, err := createPod(t, spec)
	if err != nil {
		t.Fatal(err)
	}
	pod, err := testenv.NewPod(spec.Namespace, spec.Name, string(k8sPod.UID), containerID)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(pod.Close)
	res, err := n.cni.AddNetworkList(context.Background(), n.list, pod.RT)
	if err != nil {
		return pod, k8sPod, netip.Addr{}, err
	}
	t.Cleanup(func() { _ = n.cni.DelNetworkList(context.Background(), n.list, pod.RT) })
	r, err := current.NewResultFromResult(res)
	if err != nil || len(r.IPs) == 0 {
		t.Fatalf("ADD result %v: %v", res, err)
	}
	ip, _ := netip.AddrFromSlice(r.IPs[0].Address.IP.To4())
	// The kubelet reports the sandbox's address once the chain is done.
	pods := cluster.Client.CoreV1().Pods(spec.Namespace)
	if err := retry.RetryOnConflict(retry.DefaultRetry, func() error {
		p, err := pods.Get(context.Background(), spec.Name, metav1.GetOptions{})
		if err != nil {
			return err
		}
		p.Status.Phase, p.Status.PodIP, p.Status.PodIPs = corev1.PodRunning, ip.String(), []corev1.PodIP{{IP: ip.String()}}
		_, err = pods.UpdateStatus(context.Background(), p, metav1.UpdateOptions{})
		return err
	}); err != nil {
		t.Fatal(err)
	}
	return pod, k8sPod, ip, nil
}

// readLine dials addr from inside the pod and returns the stand-in's
// answer ("<port> <original destination>").
func readLine(t *testing.T, pod *testenv.Pod, addr string) string {
	t.Helper()
	c, err := testenv.Dial(pod, "tcp4", addr)
	if err != nil {
		t.Fatalf("dial %s from pod %s: %v", addr, pod.Name, err)
	}
	defer c.Close()
	_ = c.SetDeadline(time.Now().Add(5 * time.Second))
	line, err := bufio.NewReader(c).ReadString('\n')
	if err != nil {
		t.Fatalf("dial %s from pod %s: no answer: %v", addr, pod.Name, err)
	}
	return strings.TrimSpace(line)
}

func netnsInode(t *testing.T, pod *testenv.Pod) uint64 {
	t.Helper()
	var st unix.Stat_t
	if err := unix.Stat(pod.NetNS.Path(), &st); err != nil {
		t.Fatal(err)
	}
	return st.Ino
}

func waitAnnotation(t *testing.T, ns, name, want string) {
	t.Helper()
	deadline := time.Now().Add(15 * time.Second)
	for {
		p, err := cluster.Client.CoreV1().Pods(ns).Get(context.Background(), name, metav1.GetOptions{})
		if err == nil && p.Annotations[ambient.AnnotationRedirection] == want {
			return
		}
		if time.Now().After(deadline) {
			got := "<none>"
			if err == nil {
				got = p.Annotations[ambient.AnnotationRedirection]
			}
			t.Fatalf("pod %s/%s: %s=%s, want %s (err %v)", ns, name, ambient.AnnotationRedirection, got, want, err)
		}
		time.Sleep(20 * time.Millisecond) // polling the API server, an outside process
	}
}

// node is the backend of the node's ambient rules and probe set.
func node(nft bool) ambientnet.Host {
	_, h := ambientnet.Backends(nft, "")
	return h
}

// inPod is the backend of the pods' rules, as a sidecar-path checker.
func inPod(nft bool) interface {
	Check(string, *ruleset.Plan) error
} {
	if nft {
		return &nftables.Applier{}
	}
	return &iptables.Applier{}
}

// TestAmbientAgentEnrolsOnAdd: with the real agent binary in ambient mode,
// a stand-in ztunnel connected to it and the node's chain run through
// libcni, an enrolled pod's ADD hands its namespace to ztunnel (the same
// inode), its outbound traffic arrives at ztunnel's 15001 with the
// original destination, its address enters the node's probe set, and it
// is annotated enabled; a pod no selector enrols is left alone; and with
// the agent gone, the fallback fails the enrolled pod's ADD, naming why,
// while it starts the other.
func TestAmbientAgentEnrolsOnAdd(t *testing.T) {
	for _, nft := range []bool{false, true} {
		t.Run(map[bool]string{false: "iptables", true: "nftables"}[nft], func(t *testing.T) { ambientEnrolsOnAdd(t, nft) })
	}
}

func ambientEnrolsOnAdd(t *testing.T, nft bool) {
	n := newAmbientNode(t, "10.246.0.0/24", nft)
	enrolled := testenv.PodSpec{Namespace: testNS, Name: "ambient-app", Labels: map[string]string{ambient.LabelDataplaneMode: ambient.ModeAmbient}}
	pod, k8sPod, ip, err := n.add(t, enrolled, "cambientapp")
	if err != nil {
		t.Fatalf("ADD of an enrolled pod: %v", err)
	}
	uid := string(k8sPod.UID)
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	st, err := n.sim.Wait(ctx, func(s ztunnelsim.State) bool { _, ok := s.Workloads[uid]; return ok })
	if err != nil {
		t.Fatalf("ztunnel was never handed the pod: %v", err)
	}
	if w := st.Workloads[uid]; w.Inode != netnsInode(t, pod) || w.Info.Name != "ambient-app" || w.Info.Namespace != testNS {
		t.Fatalf("ztunnel's workload %+v; want the pod's namespace (inode %d) and identity", w, netnsInode(t, pod))
	}
	if got, want := readLine(t, pod, testenv.RemoteV4+":80"), fmt.Sprintf("%d %s:80", ztunnelsim.PortOutbound, testenv.RemoteV4); got != want {
		t.Fatalf("the app's outbound connection: %q, want %q", got, want)
	}
	probes, err := node(nft).ProbeEntries("/proc/self/ns/net")
	if err != nil {
		t.Fatal(err)
	}
	if probes[ip] != uid {
		t.Fatalf("probe set %v; want %s for pod uid %s", probes, ip, uid)
	}
	waitAnnotation(t, testNS, "ambient-app", ambient.RedirectionEnabled)
	n.WaitLog(10*time.Second, testenv.LogLine("enrolled in the ambient mesh", testNS+"/ambient-app"))

	// CHECK verifies the pod's ambient redirection: as it should be, then
	// with the connmark rules gone (the restart below puts them back).
	if err := n.cni.CheckNetworkList(context.Background(), n.list, pod.RT); err != nil {
		t.Fatalf("CHECK of the enrolled pod: %v", err)
	}
	// The diagnostics command reads the pod as ambient mode's, not as a
	// sidecar pod that should have no rules.
	diagArgs := []string{"--pod", testNS + "/ambient-app", "--netns", pod.NetNS.Path()}
	if code, out := runDiagIn(t, n.RunDir, diagArgs...); code != 0 || !strings.Contains(out, "ambient rules are exactly") {
		t.Fatalf("diag of the enrolled pod: exit %d:\n%s", code, out)
	}
	if err := pod.InPod(func() error {
		if nft {
			return exec.Command("nft", "flush", "chain", "inet", "istio-ambient-mangle", "istio-prerouting").Run()
		}
		return exec.Command("iptables", "-t", "mangle", "-F", "ISTIO_PRERT").Run()
	}); err != nil {
		t.Fatal(err)
	}
	if err := n.cni.CheckNetworkList(context.Background(), n.list, pod.RT); err == nil || !strings.Contains(err.Error(), "ambient redirection") {
		t.Fatalf("CHECK of the enrolled pod with its connmark rules flushed: %v; want the difference named", err)
	}
	if code, out := runDiagIn(t, n.RunDir, diagArgs...); code != 1 || !strings.Contains(out, "MISMATCH") || !strings.Contains(out, "ambient mode") {
		t.Fatalf("diag of the enrolled pod with its connmark rules flushed: exit %d:\n%s", code, out)
	}

	// A pod no selector enrols takes the sidecar path, where it gets
	// nothing (it has no sidecar).
	plain, plainPod, _, err := n.add(t, testenv.PodSpec{Namespace: testNS, Name: "ambient-plain"}, "cambientplain")
	if err != nil {
		t.Fatalf("ADD of a pod not enrolled: %v", err)
	}
	if _, ok := n.sim.State().Workloads[string(plainPod.UID)]; ok {
		t.Fatal("ztunnel was handed a pod no selector enrols")
	}
	if plain.RulesPresent(inPod(nft)) {
		t.Fatal("a pod not enrolled has rules")
	}

	t.Run("agent-restart", func(t *testing.T) {
		// A rolling update: the DaemonSet stays, the agent is replaced.
		// The new agent finds the pod's namespace by its UID (the
		// sandbox's cgroup) and hands it to ztunnel again; the pod keeps
		// its rules, probe entry and annotation throughout.
		stop, err := pod.StartSandboxProcess()
		if err != nil {
			t.Fatal(err)
		}
		defer stop()
		ensureDaemonSet(t, true)
		if code := n.stop(syscall.SIGTERM); code != 0 {
			t.Fatalf("agent exit code %d", code)
		}
		if got := readLine(t, pod, testenv.RemoteV4+":80"); !strings.HasPrefix(got, fmt.Sprint(ztunnelsim.PortOutbound)) {
			t.Fatalf("the app's outbound with the agent away: %q", got)
		}
		n.start(n.args...)
		n.waitReadyz(200, 20*time.Second)
		ctx, cancel := context.WithTimeout(context.Background(), 15*time.Second)
		defer cancel()
		st, err := n.sim.Wait(ctx, func(s ztunnelsim.State) bool { return s.Snapshots == 2 })
		if err != nil {
			t.Fatalf("the restarted agent never sent ztunnel its snapshot: %v", err)
		}
		var resent bool
		for _, ev := range st.Events {
			// Not necessarily the second connection: the stand-in may
			// redial into the old agent's closing listener first.
			if ev.Conn >= 2 && ev.Req.Kind == zds.KindAdd && ev.Req.UID == uid && ev.Inode == netnsInode(t, pod) {
				resent = true
			}
		}
		if !resent {
			t.Fatalf("the restarted agent's snapshot did not hand over the pod's namespace: %+v", st.Events)
		}
		if got := readLine(t, pod, testenv.RemoteV4+":80"); !strings.HasPrefix(got, fmt.Sprint(ztunnelsim.PortOutbound)) {
			t.Fatalf("the app's outbound after the restart: %q", got)
		}
		if probes, err := node(nft).ProbeEntries("/proc/self/ns/net"); err != nil || probes[ip] != uid {
			t.Fatalf("probe set after the restart %v (%v); want %s for %s", probes, err, ip, uid)
		}
		waitAnnotation(t, testNS, "ambient-app", ambient.RedirectionEnabled)
		// The new agent re-applies the pod's rules as it takes it over
		// (its work queue, after the snapshot).
		for deadline := time.Now().Add(15 * time.Second); ; {
			err := n.cni.CheckNetworkList(context.Background(), n.list, pod.RT)
			if err == nil {
				break
			}
			if time.Now().After(deadline) {
				t.Fatalf("CHECK after the restart: %v", err)
			}
			time.Sleep(50 * time.Millisecond) // polling the agent, an outside process
		}
		ensureDaemonSet(t, false)
	})

	t.Run("fallback-refuses-enrolled-pods", func(t *testing.T) {
		// The agent dies; the plugin stays in the node's config and the
		// relay runs the fallback, which cannot reach ztunnel.
		n.Kill()
		_, _, _, err := n.add(t, testenv.PodSpec{Namespace: testNS, Name: "ambient-late", Labels: enrolled.Labels}, "cambientlate")
		if err == nil || !strings.Contains(err.Error(), "enrolled in the ambient mesh") || !strings.Contains(err.Error(), "ambient-late") {
			t.Fatalf("ADD of an enrolled pod without the agent: %v; want it refused, naming the pod and why", err)
		}
		if _, _, _, err := n.add(t, testenv.PodSpec{Namespace: testNS, Name: "ambient-late-plain"}, "cambientlateplain"); err != nil {
			t.Fatalf("ADD of a pod not enrolled without the agent: %v", err)
		}
	})
	_ = os.Remove(n.RunDir + "-ztunnel.sock")
}
