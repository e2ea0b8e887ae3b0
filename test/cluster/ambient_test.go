package cluster

import (
	"context"
	"errors"
	"fmt"
	"net/netip"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/vishvananda/netlink"
	"golang.org/x/sys/unix"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/apimachinery/pkg/util/intstr"
	"sigs.k8s.io/yaml"

	"github.com/istio-cni-go/istio-cni/internal/ambient"
	"github.com/istio-cni-go/istio-cni/internal/ambientnet"
	"github.com/istio-cni-go/istio-cni/internal/install"
	"github.com/istio-cni-go/istio-cni/internal/nftables"
	"github.com/istio-cni-go/istio-cni/internal/ruleset"
	"github.com/istio-cni-go/istio-cni/internal/testenv"
	"github.com/istio-cni-go/istio-cni/internal/zds"
	"github.com/istio-cni-go/istio-cni/internal/ztunnelsim"
)

// The enrolled pods' app answers HTTP here; their readiness probe asks it.
const ambientAppPort = 8080

// TestAmbientChartOnNode installs the chart with ambient mode on a real
// node, with the stand-in ztunnel as a process of the node connected to
// the agent's socket: an enrolled pod's HTTP readiness probe passes
// (through the node's probe SNAT; unSNATed it would land on ztunnel's
// inbound port, which does not speak HTTP), labelling a namespace enrols
// its running pods (one started before the chart, found through /proc,
// one after), a rolling update of the agent keeps their traffic on
// ztunnel and hands them to ztunnel again, and the uninstall removes the
// node's probe SNAT.
//
// The iptables case runs the chart's default layout (the agent in a pod
// network, switching to the node's namespace, found as the kubelet's);
// the nftables case runs the agent in the node's network namespace
// (ambient.shareHostNetworkNamespace). See ambientValues.
func TestAmbientChartOnNode(t *testing.T) {
	ensureAgentImage(t)
	ctx := context.Background()
	if err := testenv.EnsureNamespace(ctx, cluster.Client, "istio-system"); err != nil {
		t.Fatal(err)
	}
	standin, err := testenv.BuildZtunnelStandin(workDir)
	if err != nil {
		t.Fatal(err)
	}
	for _, backend := range []string{"iptables", "nftables"} {
		t.Run(backend, func(t *testing.T) { ambientChartOnNode(t, backend, standin, false) })
	}
	// Someone lists the node's legacy nat table (iptables-legacy-save,
	// which creates it empty) while the agent runs with the nft variant.
	// The next agent must keep the probe SNAT where it is (it once took
	// the node for a legacy one, could not write there without the node's
	// xtables lock, and at uninstall left the nft variant's rules and
	// sets behind). Last: it leaves the node a legacy nat table.
	t.Run("iptables-legacy-listed", func(t *testing.T) {
		ambientChartOnNode(t, "iptables", standin, true)
	})
}

// ensureAgentImage imports the agent image unless the node has it (the
// chart test may have loaded it already).
func ensureAgentImage(t *testing.T) {
	t.Helper()
	if out, err := node.Ctr("images", "ls", "-q"); err == nil && strings.Contains(string(out), "docker.io/"+agentImage+"\n") {
		return
	}
	if err := oneNode.LoadAgentImage(workDir); err != nil {
		t.Fatal(err)
	}
}

// privateZtunnelDir gives the node its own /var/run/ztunnel: an empty
// tmpfs in the test's mount namespace, which the kubelet shares, so the
// chart's hostPath neither lands in nor meets the machine's.
func privateZtunnelDir(t *testing.T) {
	t.Helper()
	dir := testenv.ZtunnelSocketDir
	if parent, err := filepath.EvalSymlinks(filepath.Dir(dir)); err == nil {
		dir = filepath.Join(parent, filepath.Base(dir))
	}
	created := false
	if _, err := os.Stat(dir); errors.Is(err, os.ErrNotExist) {
		if err := os.MkdirAll(dir, 0o755); err != nil {
			t.Fatal(err)
		}
		created = true
	}
	if err := unix.Mount("tmpfs", dir, "tmpfs", 0, "mode=0755"); err != nil {
		t.Fatalf("mounting a tmpfs on %s: %v", dir, err)
	}
	t.Cleanup(func() {
		_ = unix.Unmount(dir, unix.MNT_DETACH)
		if created {
			_ = os.Remove(dir)
		}
	})
}

// ambientValues are the chart values of the node, with ambient mode on.
// With hostNetwork the agent runs in the node's network namespace
// (ambient.shareHostNetworkNamespace); else in a pod network of its own
// as the chart's default, switching to the node's for the probe SNAT,
// which it must find as the kubelet's (AMBIENT_NODE_NETNS=kubelet): this
// test's node is a network namespace of a shared machine, whose PID 1,
// Istio's choice, is the machine's own init.
func ambientValues(nft, hostNetwork bool) map[string]any {
	values := testenv.NodeChartValues(cluster, node, nft)
	env := values["env"].(map[string]any)
	if hostNetwork {
		env["ALLOW_SWITCH_TO_HOST_NS"] = "false"
		values["ambient"] = map[string]any{"enabled": true, "shareHostNetworkNamespace": true}
	} else {
		env["AMBIENT_NODE_NETNS"] = "kubelet"
		values["ambient"] = map[string]any{"enabled": true}
	}
	return values
}

// checkNodeNamespaceOnly renders the chart with values and fails unless
// the agent can only write into the node's network namespace: its own
// (hostNetwork, no switching), or the kubelet's and never PID 1's.
func checkNodeNamespaceOnly(t *testing.T, values map[string]any, hostNetwork bool) {
	t.Helper()
	b, err := yaml.Marshal(values)
	if err != nil {
		t.Fatal(err)
	}
	rendered, err := testenv.RenderChart(string(b), "")
	if err != nil {
		t.Fatal(err)
	}
	objs, err := testenv.RenderedObjects(rendered)
	if err != nil {
		t.Fatal(err)
	}
	ds := objs["DaemonSet/istio-cni-node"]
	_, env, err := testenv.AgentInvocation(rendered)
	if err != nil {
		t.Fatal(err)
	}
	switch {
	case hostNetwork && strings.Contains(ds, "hostNetwork: true") && env["ALLOW_SWITCH_TO_HOST_NS"] == "false":
	case !hostNetwork && !strings.Contains(ds, "hostNetwork: true") && env["ALLOW_SWITCH_TO_HOST_NS"] == "true" && env["AMBIENT_NODE_NETNS"] == "kubelet":
	default:
		t.Fatalf("refusing to install: the agent could write into a network namespace other than the node's (ALLOW_SWITCH_TO_HOST_NS=%q, AMBIENT_NODE_NETNS=%q):\n%s",
			env["ALLOW_SWITCH_TO_HOST_NS"], env["AMBIENT_NODE_NETNS"], ds)
	}
}

// ambientPod serves HTTP on the app port with an HTTP readiness probe
// there, and dials the "remote" address twice a second from a second
// container.
func ambientPod(ns, name string, labels map[string]string) *corev1.Pod {
	never := corev1.PullNever
	f := false
	return &corev1.Pod{
		ObjectMeta: metav1.ObjectMeta{Namespace: ns, Name: name, Labels: labels},
		Spec: corev1.PodSpec{NodeName: testenv.NodeName, AutomountServiceAccountToken: &f,
			Containers: []corev1.Container{
				{Name: "app", Image: testenv.AppImage, ImagePullPolicy: never, Args: []string{"http", fmt.Sprintf(":%d", ambientAppPort)},
					ReadinessProbe: &corev1.Probe{
						ProbeHandler: corev1.ProbeHandler{HTTPGet: &corev1.HTTPGetAction{Path: "/ready", Port: intstr.FromInt32(ambientAppPort)}},
						// A probe that is answered at all is answered in
						// milliseconds; the timeout only has to outlast a
						// loaded 2-core node, so that "went unready" below
						// means probes were refused, not slow.
						PeriodSeconds: 1, TimeoutSeconds: 5, FailureThreshold: 3,
					}},
				{Name: "client", Image: testenv.AppImage, ImagePullPolicy: never, Args: []string{"dial-loop", testenv.RemoteV4 + ":80"}},
			}},
	}
}

func podReady(p *corev1.Pod) (bool, time.Time) {
	for _, c := range p.Status.Conditions {
		if c.Type == corev1.PodReady {
			return c.Status == corev1.ConditionTrue, c.LastTransitionTime.Time
		}
	}
	return false, time.Time{}
}

func getPod(t *testing.T, ns, name string) *corev1.Pod {
	t.Helper()
	p, err := cluster.Client.CoreV1().Pods(ns).Get(context.Background(), name, metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	return p
}

func waitPodReady(t *testing.T, ns, name string, limit time.Duration) *corev1.Pod {
	t.Helper()
	waitFor(t, ns+"/"+name+" Ready", limit, func() (bool, string) {
		p, err := cluster.Client.CoreV1().Pods(ns).Get(context.Background(), name, metav1.GetOptions{})
		if err != nil {
			return false, err.Error()
		}
		ready, _ := podReady(p)
		return ready, string(p.Status.Phase) + " " + podProblems(p)
	})
	return getPod(t, ns, name)
}

// logPath is a container's log file as the kubelet writes it.
func logPath(p *corev1.Pod, container string) string {
	return filepath.Join(podLogDir, p.Namespace+"_"+p.Name+"_"+string(p.UID), container, "0.log")
}

// containerLog is a container's log as the kubelet wrote it ("" while
// there is none).
func containerLog(p *corev1.Pod, container string) string {
	b, _ := os.ReadFile(logPath(p, container))
	return string(b)
}

// readLog is a container's log that must be there: a failure to read it
// fails the test rather than read as an empty log.
func readLog(t *testing.T, p *corev1.Pod, container string) string {
	t.Helper()
	b, err := os.ReadFile(logPath(p, container))
	if err != nil {
		t.Fatal(err)
	}
	return string(b)
}

// waitLogAfter waits until the container's log, from offset on, has n
// lines containing want, and returns that part of the log.
func waitLogAfter(t *testing.T, p *corev1.Pod, container string, offset, n int, want string) string {
	t.Helper()
	var part string
	waitFor(t, fmt.Sprintf("%d lines %q in %s/%s %s's log", n, want, p.Namespace, p.Name, container), 60*time.Second, func() (bool, string) {
		log := containerLog(p, container)
		if len(log) < offset {
			return false, "log shorter than before"
		}
		part = log[offset:]
		tail := part
		if len(tail) > 400 {
			tail = tail[len(tail)-400:]
		}
		return strings.Count(part, want) >= n, tail
	})
	return part
}

// podNetnsInode is the pod's network namespace as the node sees it: that
// of a process in the pod's cgroup, found without the agent's help.
func podNetnsInode(t *testing.T, uid types.UID) uint64 {
	t.Helper()
	pid := podPid(t, uid)
	var st unix.Stat_t
	if err := unix.Stat(fmt.Sprintf("/proc/%d/ns/net", pid), &st); err != nil {
		t.Fatal(err)
	}
	return st.Ino
}

func podPid(t *testing.T, uid types.UID) int {
	t.Helper()
	cg, err := node.Cgroups.PodCgroup(string(uid))
	if err != nil {
		t.Fatal(err)
	}
	pid := 0
	_ = filepath.WalkDir(cg, func(path string, d os.DirEntry, err error) error {
		if err != nil || pid != 0 || d.Name() != "cgroup.procs" {
			return nil
		}
		b, _ := os.ReadFile(path)
		if f := strings.Fields(string(b)); len(f) > 0 {
			_, _ = fmt.Sscan(f[0], &pid)
		}
		return nil
	})
	if pid == 0 {
		t.Fatalf("no process in pod %s's cgroup %s", uid, cg)
	}
	return pid
}

// inPodProbeCounters reads, for the iptables backend, how many
// connections the pod's nat rules took: accepted from the probe source,
// and redirected to ztunnel's inbound port. Both iptables variants are
// read; the agent uses one of them.
func inPodProbeCounters(t *testing.T, uid types.UID) (accepted, toInbound int, rules string) {
	t.Helper()
	pid := podPid(t, uid)
	var all []string
	for _, save := range iptablesSaves(pid, false) {
		out, err := exec.Command("nsenter", fmt.Sprintf("--net=/proc/%d/ns/net", pid), save, "-c", "-t", "nat").CombinedOutput()
		if err != nil {
			t.Fatalf("%s in pod %s: %v %s", save, uid, err, out)
		}
		for _, line := range strings.Split(string(out), "\n") {
			if !strings.Contains(line, "-A ISTIO_PRERT") {
				continue
			}
			all = append(all, line)
			var pkts, bytes int
			if _, err := fmt.Sscanf(line, "[%d:%d]", &pkts, &bytes); err != nil {
				continue
			}
			switch {
			case strings.Contains(line, "-s "+ruleset.ProbeSourceV4.String()+"/32") && strings.HasSuffix(line, "-j ACCEPT"):
				accepted += pkts
			case strings.Contains(line, "--to-ports 15006"):
				toInbound += pkts
			}
		}
	}
	return accepted, toInbound, strings.Join(all, "\n")
}

// iptablesSaves are the iptables-save commands that read the network
// namespace of pid for a family: the nft variant, and the legacy one only
// where legacy tables exist. Reading with iptables-legacy-save would
// create the legacy nat table, and the agent, finding legacy tables,
// would switch to the legacy variant.
func iptablesSaves(pid int, v6 bool) []string {
	names, prefix := "ip_tables_names", "iptables"
	if v6 {
		names, prefix = "ip6_tables_names", "ip6tables"
	}
	saves := []string{prefix + "-nft-save"}
	if b, err := os.ReadFile(fmt.Sprintf("/proc/%d/net/%s", pid, names)); err == nil && strings.TrimSpace(string(b)) != "" {
		saves = append(saves, prefix+"-legacy-save")
	}
	return saves
}

// nodeProbeConns counts the node's tracked connections to the pod's app
// port (the kubelet's probes; a closed one stays tracked for minutes):
// those SNATed to the probe source, and those that left the node with its
// own address, which the pod's rules hand to ztunnel's inbound port.
func nodeProbeConns(t *testing.T, podIP string) (snated, plain int) {
	t.Helper()
	var flows []*netlink.ConntrackFlow
	var err error
	for range 5 { // a dump interrupted by a concurrent change is asked again
		//nolint:forbidigo // netlinksafe has no conntrack listing; retried here instead
		if flows, err = netlink.ConntrackTableList(netlink.ConntrackTable, unix.AF_INET); !errors.Is(err, netlink.ErrDumpInterrupted) {
			break
		}
	}
	if err != nil {
		t.Fatalf("listing the node's conntrack table: %v", err)
	}
	for _, f := range flows {
		if f.Forward.Protocol != unix.IPPROTO_TCP || f.Forward.DstIP.String() != podIP || f.Forward.DstPort != ambientAppPort {
			continue
		}
		if f.Reverse.DstIP.String() == ruleset.ProbeSourceV4.String() {
			snated++
		} else {
			plain++
		}
	}
	return snated, plain
}

// checkProbesSNATed asserts every probe of the pod the node still tracks
// went out SNATed.
func checkProbesSNATed(t *testing.T, p *corev1.Pod) {
	t.Helper()
	if snated, plain := nodeProbeConns(t, p.Status.PodIP); snated == 0 || plain != 0 {
		t.Fatalf("the node's connections to %s/%s's app port: %d SNATed to %s, %d not; want some and none",
			p.Namespace, p.Name, snated, ruleset.ProbeSourceV4, plain)
	}
}

// nodeProbeRules is the node's probe SNAT as the backend shows it ("" if
// none): the ISTIO_POSTRT lines of both iptables variants, or the
// nftables table.
func nodeProbeRules(t *testing.T, backend string) string {
	t.Helper()
	if backend == "nftables" {
		out, err := exec.Command("nft", "list", "table", "inet", nftables.AmbientNATTable).CombinedOutput()
		if err != nil {
			return "" // no such table
		}
		return string(out)
	}
	var lines []string
	for _, save := range append(iptablesSaves(os.Getpid(), false), iptablesSaves(os.Getpid(), true)...) {
		out, err := exec.Command(save, "-t", "nat").CombinedOutput()
		if err != nil {
			t.Fatalf("%s: %v %s", save, err, out)
		}
		for _, line := range strings.Split(string(out), "\n") {
			if strings.Contains(line, "ISTIO_POSTRT") {
				lines = append(lines, save+": "+line)
			}
		}
	}
	return strings.Join(lines, "\n")
}

func probeEntries(t *testing.T, nft bool) map[netip.Addr]string {
	t.Helper()
	_, host := ambientnet.Backends(nft, "")
	entries, err := host.ProbeEntries("/proc/self/ns/net")
	if err != nil {
		t.Fatalf("reading the node's probe sets: %v", err)
	}
	return entries
}

func agentPods(t *testing.T) []corev1.Pod {
	t.Helper()
	pods, err := cluster.Client.CoreV1().Pods("istio-system").List(context.Background(), metav1.ListOptions{LabelSelector: "k8s-app=istio-cni-node"})
	if err != nil {
		t.Fatal(err)
	}
	return pods.Items
}

// keepAgentLogs copies the agent containers' logs as the kubelet writes
// them (it removes a pod's logs with the pod, and an uninstalled agent's
// last words matter), polling until the test ends; the returned function
// gives them all, oldest pod first.
func keepAgentLogs(t *testing.T) func() string {
	var mu sync.Mutex
	kept := map[string][]byte{}
	var order []string
	copyLogs := func() {
		files, _ := filepath.Glob(filepath.Join(podLogDir, "istio-system_istio-cni-node-*", "install-cni", "*.log"))
		mu.Lock()
		defer mu.Unlock()
		for _, f := range files {
			b, err := os.ReadFile(f)
			if err != nil || len(b) < len(kept[f]) {
				continue
			}
			if _, ok := kept[f]; !ok {
				order = append(order, f)
			}
			kept[f] = b
		}
	}
	stop := make(chan struct{})
	done := make(chan struct{})
	go func() {
		defer close(done)
		for {
			copyLogs()
			select {
			case <-stop:
				return
			case <-time.After(100 * time.Millisecond): // polling the kubelet's files, until the test ends
			}
		}
	}()
	t.Cleanup(func() { close(stop); <-done })
	return func() string {
		copyLogs()
		mu.Lock()
		defer mu.Unlock()
		var b strings.Builder
		for _, f := range order {
			fmt.Fprintf(&b, "==> %s\n%s", f, kept[f])
		}
		return b.String()
	}
}

func waitAgentReady(t *testing.T, not types.UID) *corev1.Pod {
	t.Helper()
	var agent *corev1.Pod
	waitFor(t, "agent pod Ready", 120*time.Second, func() (bool, string) {
		pods := agentPods(t)
		if len(pods) != 1 || pods[0].UID == not {
			return false, fmt.Sprintf("%d agent pods, none new", len(pods))
		}
		p := pods[0]
		ready, _ := podReady(&p)
		agent = &p
		return ready, string(p.Status.Phase) + " " + podProblems(&p)
	})
	return agent
}

// standinWait polls the stand-in's state (a process of its own) until
// cond holds.
func standinWait(t *testing.T, z *testenv.ZtunnelStandin, what string, limit time.Duration, cond func(ztunnelsim.State) bool) ztunnelsim.State {
	t.Helper()
	var st ztunnelsim.State
	waitFor(t, "stand-in ztunnel: "+what, limit, func() (bool, string) {
		if z.Exited() {
			return false, "the stand-in exited:\n" + z.Log()
		}
		var err error
		if st, err = z.State(); err != nil {
			return false, err.Error()
		}
		return cond(st), fmt.Sprintf("connected %v, conns %d, snapshots %d, workloads %d, protocol errors %v",
			st.Connected, st.Conns, st.Snapshots, len(st.Workloads), st.ProtocolErrors)
	})
	return st
}

// enrolledPod is what the test checks of a pod it expects enrolled.
type enrolledPod struct {
	pod   *corev1.Pod
	inode uint64
}

// checkEnrolled asserts the pod is in the mesh: annotated enabled, held
// by the stand-in in its own network namespace with listeners bound,
// its address in the node's probe set under its UID, its outbound
// connections arriving at ztunnel's 15001 with their destination (from
// clientOffset in its client's log), and its readiness probe reaching
// the app from the probe source (from appOffset in the app's log).
func checkEnrolled(t *testing.T, z *testenv.ZtunnelStandin, nft bool, p *corev1.Pod, appOffset, clientOffset int) enrolledPod {
	t.Helper()
	uid := string(p.UID)
	waitFor(t, p.Namespace+"/"+p.Name+" annotated "+ambient.RedirectionEnabled, 60*time.Second, func() (bool, string) {
		cur, err := cluster.Client.CoreV1().Pods(p.Namespace).Get(context.Background(), p.Name, metav1.GetOptions{})
		if err != nil {
			return false, err.Error()
		}
		return cur.Annotations[ambient.AnnotationRedirection] == ambient.RedirectionEnabled, fmt.Sprint(cur.Annotations)
	})
	inode := podNetnsInode(t, p.UID)
	st := standinWait(t, z, "holds "+p.Namespace+"/"+p.Name, 30*time.Second, func(s ztunnelsim.State) bool {
		_, ok := s.Workloads[uid]
		return ok
	})
	w := st.Workloads[uid]
	if w.Inode != inode || w.Info.Name != p.Name || w.Info.Namespace != p.Namespace || len(w.Listening) == 0 {
		t.Fatalf("the stand-in's workload for %s/%s: %+v; want the pod's network namespace (inode %d), its identity and listeners",
			p.Namespace, p.Name, w, inode)
	}
	ip := netip.MustParseAddr(p.Status.PodIP)
	if got := probeEntries(t, nft)[ip]; got != uid {
		t.Fatalf("the node's probe set holds %s for %s; want the pod's UID %s", got, ip, uid)
	}
	want := fmt.Sprintf("dial %s:80: %d %s:80", testenv.RemoteV4, ztunnelsim.PortOutbound, testenv.RemoteV4)
	waitLogAfter(t, p, "client", clientOffset, 2, want)
	waitLogAfter(t, p, "app", appOffset, 3, "http GET /ready from "+ruleset.ProbeSourceV4.String()+":")
	return enrolledPod{pod: p, inode: inode}
}

func ambientChartOnNode(t *testing.T, backend, standinBin string, listLegacy bool) {
	ctx := context.Background()
	nft := backend == "nftables"
	privateZtunnelDir(t)
	agentLogs := keepAgentLogs(t)
	t.Cleanup(func() {
		if t.Failed() {
			t.Logf("agent logs:\n%s", agentLogs())
		}
	})

	// A namespace whose pods join the mesh when it is labelled, and one
	// of them already running before the chart is installed.
	suffix := backend
	if listLegacy {
		suffix += "-legacy"
	}
	later, fresh := "amb-later-"+suffix, "amb-"+suffix
	for _, ns := range []string{later, fresh} {
		if err := testenv.EnsureNamespace(ctx, cluster.Client, ns); err != nil {
			t.Fatal(err)
		}
	}
	t.Cleanup(func() {
		deleteAllPods(t, later, fresh)
		// Unlabelled again, so that a rerun starts from the same place.
		patch := fmt.Sprintf(`{"metadata":{"labels":{%q:null}}}`, ambient.LabelDataplaneMode)
		_, _ = cluster.Client.CoreV1().Namespaces().Patch(context.Background(), later, types.MergePatchType, []byte(patch), metav1.PatchOptions{})
	})
	pods := cluster.Client.CoreV1().Pods(later)
	if _, err := pods.Create(ctx, ambientPod(later, "before", nil), metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	before := waitPodReady(t, later, "before", 90*time.Second)
	// Not in the mesh: the app sees the node's own probes, and nothing
	// listens where the client dials.
	waitLogAfter(t, before, "client", 0, 1, "connection refused")
	waitLogAfter(t, before, "app", 0, 1, "http GET /ready from ")
	if strings.Contains(containerLog(before, "app"), "from "+ruleset.ProbeSourceV4.String()) {
		t.Fatal("a probe SNATed before ambient mode was installed")
	}

	// iptables in the chart's default layout, nftables in the node's
	// network namespace: both layouts proven.
	hostNetwork := nft
	values := ambientValues(nft, hostNetwork)
	checkNodeNamespaceOnly(t, values, hostNetwork)
	z, err := testenv.StartZtunnelStandin(standinBin, t.TempDir(), filepath.Join(testenv.ZtunnelSocketDir, "ztunnel.sock"))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		z.Stop(10 * time.Second)
		if t.Failed() {
			t.Logf("stand-in ztunnel log:\n%s", z.Log())
		}
	})
	confPath := filepath.Join(node.ConfDir, "10-ptp.conflist")
	confBefore, err := os.ReadFile(confPath)
	if err != nil {
		t.Fatal(err)
	}
	rel, err := testenv.InstallChart(cluster, values)
	if err != nil {
		t.Fatal(err)
	}
	uninstalled := false
	t.Cleanup(func() {
		if !uninstalled {
			_ = rel.Uninstall()
		}
	})
	agent := waitAgentReady(t, "")
	if agent.Spec.HostNetwork != hostNetwork {
		t.Fatalf("the agent pod's hostNetwork is %v, want %v", agent.Spec.HostNetwork, hostNetwork)
	}
	standinWait(t, z, "connected with the agent's snapshot", 60*time.Second, func(s ztunnelsim.State) bool {
		return s.Connected && s.Snapshots >= 1
	})
	if rules := nodeProbeRules(t, backend); !strings.Contains(rules, ruleset.ProbeSourceV4.String()) {
		t.Fatalf("no probe SNAT on the node once the agent is Ready:\n%s", rules)
	}
	if listLegacy {
		for _, save := range []string{"iptables-legacy-save", "ip6tables-legacy-save"} {
			if out, err := exec.Command(save, "-t", "nat").CombinedOutput(); err != nil {
				t.Fatalf("%s: %v %s", save, err, out)
			}
		}
	}

	// A pod started after the agent in the unlabelled namespace goes
	// through the plugin and is left alone.
	if _, err := pods.Create(ctx, ambientPod(later, "after", nil), metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	after := waitPodReady(t, later, "after", 90*time.Second)
	waitLogAfter(t, after, "client", 0, 1, "connection refused")
	if a := after.Annotations[ambient.AnnotationRedirection]; a != "" {
		t.Fatalf("a pod no selector enrols is annotated %s=%s", ambient.AnnotationRedirection, a)
	}

	// 2. A pod labelled ambient starts in the mesh, and its HTTP
	// readiness probe passes: unSNATed, the kubelet's connection would be
	// redirected to ztunnel's 15006, whose answer is no HTTP.
	labelled := map[string]string{ambient.LabelDataplaneMode: ambient.ModeAmbient}
	if _, err := cluster.Client.CoreV1().Pods(fresh).Create(ctx, ambientPod(fresh, "probed", labelled), metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	probed := waitPodReady(t, fresh, "probed", 90*time.Second)
	enrolled := []enrolledPod{checkEnrolled(t, z, nft, probed, 0, 0)}
	if bad := linesWithout(containerLog(probed, "app"), "http GET /ready from "+ruleset.ProbeSourceV4.String()+":"); bad != "" {
		t.Fatalf("the enrolled pod's app saw probes not SNATed:\n%s", bad)
	}
	checkProbesSNATed(t, probed)
	// Enrolled by its ADD, before its containers ran: not one of its
	// connections went anywhere but to ztunnel.
	outbound := fmt.Sprintf("dial %s:80: %d %s:80", testenv.RemoteV4, ztunnelsim.PortOutbound, testenv.RemoteV4)
	if bad := linesWithout(containerLog(probed, "client"), outbound); bad != "" {
		t.Fatalf("the enrolled pod's outbound connections before they reached ztunnel:\n%s", bad)
	}
	if log := agentLogs(); !strings.Contains(log, "enrolled in the ambient mesh\tcmd=ADD pod="+fresh+"/probed ") {
		t.Fatalf("no line of the agent enrolling %s/probed at its ADD:\n%s", fresh, log)
	}
	if !nft {
		// The pod's own rules: probes were accepted from the probe
		// source, and ztunnel's inbound port took no connection at all.
		acc, in, rules := inPodProbeCounters(t, probed.UID)
		if acc == 0 || in != 0 {
			t.Fatalf("in-pod nat counters: %d accepted from the probe source, %d redirected to 15006; want some and none:\n%s", acc, in, rules)
		}
	}
	for _, p := range []*corev1.Pod{before, after} {
		if _, ok := mustState(t, z).Workloads[string(p.UID)]; ok {
			t.Fatalf("the stand-in holds %s/%s, which no selector enrols", p.Namespace, p.Name)
		}
	}

	// 3. Labelling the namespace enrols its running pods: the one
	// started before the chart (its network namespace found through
	// /proc) and the one the plugin saw.
	offsets := map[string][2]int{}
	for _, p := range []*corev1.Pod{before, after} {
		offsets[p.Name] = [2]int{len(containerLog(p, "app")), len(containerLog(p, "client"))}
	}
	patch := fmt.Sprintf(`{"metadata":{"labels":{%q:%q}}}`, ambient.LabelDataplaneMode, ambient.ModeAmbient)
	if _, err := cluster.Client.CoreV1().Namespaces().Patch(ctx, later, types.MergePatchType, []byte(patch), metav1.PatchOptions{}); err != nil {
		t.Fatal(err)
	}
	for _, p := range []*corev1.Pod{before, after} {
		enrolled = append(enrolled, checkEnrolled(t, z, nft, p, offsets[p.Name][0], offsets[p.Name][1]))
	}
	for _, e := range enrolled {
		if ready, _ := podReady(getPod(t, e.pod.Namespace, e.pod.Name)); !ready {
			t.Fatalf("%s/%s is not Ready once enrolled", e.pod.Namespace, e.pod.Name)
		}
	}

	// 4. A rolling update of the agent: traffic stays on ztunnel
	// throughout, no pod goes unready, and the new agent hands every pod
	// to ztunnel again in its snapshot, in the namespace it had.
	rollingUpdate(t, z, nft, agent, enrolled)

	// 5. Uninstall: the agent removes the node's probe SNAT and its sets,
	// and the plugin.
	if err := rel.Uninstall(); err != nil {
		t.Fatalf("helm uninstall: %v", err)
	}
	uninstalled = true
	waitFor(t, "agent pod gone", 90*time.Second, func() (bool, string) {
		return len(agentPods(t)) == 0, "agent pod still there"
	})
	if rules := nodeProbeRules(t, backend); rules != "" {
		t.Fatalf("the node's probe SNAT outlived the uninstall:\n%s", rules)
	}
	if entries := probeEntries(t, nft); len(entries) != 0 {
		t.Fatalf("the node's probe sets outlived the uninstall: %v", entries)
	}
	if !nft {
		for _, set := range []string{ruleset.ProbeSetV4, ruleset.ProbeSetV6} {
			if _, err := netlink.IpsetList(set); err == nil {
				t.Fatalf("ipset %s outlived the uninstall", set)
			}
		}
	}
	waitFor(t, "CNI config restored after uninstall", 90*time.Second, func() (bool, string) {
		now, err := os.ReadFile(confPath)
		if err != nil {
			return false, err.Error()
		}
		return install.SameJSON(now, confBefore), string(now)
	})

}

// deleteAllPods deletes the namespaces' pods at once and waits for them
// to be gone.
func deleteAllPods(t *testing.T, namespaces ...string) {
	ctx := context.Background()
	zero := int64(0)
	for _, ns := range namespaces {
		_ = cluster.Client.CoreV1().Pods(ns).DeleteCollection(ctx, metav1.DeleteOptions{GracePeriodSeconds: &zero}, metav1.ListOptions{})
	}
	waitFor(t, "test pods gone", 90*time.Second, func() (bool, string) {
		for _, ns := range namespaces {
			if l, err := cluster.Client.CoreV1().Pods(ns).List(ctx, metav1.ListOptions{}); err != nil || len(l.Items) != 0 {
				return false, fmt.Sprintf("pods left in %s: %v", ns, err)
			}
		}
		return true, ""
	})
}

// watchRedirection records every change of the enrolled pods'
// redirection annotation away from enabled, until the returned function
// is called, which returns them.
func watchRedirection(t *testing.T, enrolled []enrolledPod) func() []string {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	uids := map[types.UID]bool{}
	nss := map[string]bool{}
	for _, e := range enrolled {
		uids[e.pod.UID] = true
		nss[e.pod.Namespace] = true
	}
	var mu sync.Mutex
	var seen []string
	var wg sync.WaitGroup
	for ns := range nss {
		list, err := cluster.Client.CoreV1().Pods(ns).List(ctx, metav1.ListOptions{})
		if err != nil {
			t.Fatal(err)
		}
		w, err := cluster.Client.CoreV1().Pods(ns).Watch(ctx, metav1.ListOptions{ResourceVersion: list.ResourceVersion})
		if err != nil {
			t.Fatal(err)
		}
		wg.Add(1)
		go func() {
			defer wg.Done()
			defer w.Stop()
			for {
				select {
				case <-ctx.Done():
					return
				case ev, ok := <-w.ResultChan():
					if !ok {
						return
					}
					p, isPod := ev.Object.(*corev1.Pod)
					if !isPod || !uids[p.UID] {
						continue
					}
					if a := p.Annotations[ambient.AnnotationRedirection]; a != ambient.RedirectionEnabled {
						mu.Lock()
						seen = append(seen, fmt.Sprintf("%s %s/%s %s=%q", time.Now().Format("15:04:05.000"), p.Namespace, p.Name, ambient.AnnotationRedirection, a))
						mu.Unlock()
					}
				}
			}
		}()
	}
	return func() []string {
		cancel()
		wg.Wait()
		mu.Lock()
		defer mu.Unlock()
		return seen
	}
}

// linesWithout returns the complete lines of log that lack want.
func linesWithout(log, want string) string {
	lines := strings.Split(log, "\n")
	var bad []string
	for _, l := range lines[:len(lines)-1] {
		if !strings.Contains(l, want) {
			bad = append(bad, l)
		}
	}
	return strings.Join(bad, "\n")
}

func mustState(t *testing.T, z *testenv.ZtunnelStandin) ztunnelsim.State {
	t.Helper()
	st, err := z.State()
	if err != nil {
		t.Fatal(err)
	}
	return st
}

// rollingUpdate restarts the agent as `kubectl rollout restart` does and
// checks the enrolled pods through it.
func rollingUpdate(t *testing.T, z *testenv.ZtunnelStandin, nft bool, old *corev1.Pod, enrolled []enrolledPod) {
	t.Helper()
	ctx := context.Background()
	st0 := mustState(t, z)
	type mark struct {
		app, client int
		readySince  time.Time
	}
	marks := map[string]mark{}
	for _, e := range enrolled {
		p := getPod(t, e.pod.Namespace, e.pod.Name)
		_, since := podReady(p)
		marks[string(p.UID)] = mark{len(containerLog(p, "app")), len(containerLog(p, "client")), since}
	}
	flaps := watchRedirection(t, enrolled)
	patch := fmt.Sprintf(`{"spec":{"template":{"metadata":{"annotations":{"kubectl.kubernetes.io/restartedAt":%q}}}}}`, time.Now().Format(time.RFC3339Nano))
	if _, err := cluster.Client.AppsV1().DaemonSets("istio-system").Patch(ctx, "istio-cni-node", types.StrategicMergePatchType, []byte(patch), metav1.PatchOptions{}); err != nil {
		t.Fatal(err)
	}
	waitAgentReady(t, old.UID)
	st := standinWait(t, z, "a new connection with its snapshot", 60*time.Second, func(s ztunnelsim.State) bool {
		return s.Connected && s.Conns > st0.Conns && s.Snapshots > st0.Snapshots
	})
	// The snapshot on the newest connection: an add for each pod, with
	// its namespace (the same one: a no-op for ztunnel), then
	// snapshot_sent.
	added := map[string]ztunnelsim.Event{}
	snapshotAt := 0
	for _, ev := range st.Events {
		if ev.Conn != st.Conns {
			continue
		}
		switch ev.Req.Kind {
		case zds.KindAdd:
			if _, seen := added[ev.Req.UID]; !seen {
				added[ev.Req.UID] = ev
			}
		case zds.KindSnapshotSent:
			snapshotAt = ev.Seq
		}
	}
	for _, e := range enrolled {
		uid := string(e.pod.UID)
		ev, ok := added[uid]
		if !ok || ev.Inode != e.inode || ev.Nack != "" || ev.Seq > snapshotAt {
			t.Fatalf("the new agent's snapshot for %s/%s: %+v (snapshot_sent at %d); want an add with its namespace (inode %d) before snapshot_sent\nevents: %+v",
				e.pod.Namespace, e.pod.Name, ev, snapshotAt, e.inode, st.Events)
		}
		if w := st.Workloads[uid]; w.Inode != e.inode {
			t.Fatalf("the stand-in's workload for %s/%s after the rollout: %+v; want inode %d", e.pod.Namespace, e.pod.Name, w, e.inode)
		}
	}
	for _, ev := range st.Events {
		if ev.Req.Kind == zds.KindDel || ev.ProtocolError != "" {
			t.Fatalf("the stand-in got %+v during the rollout", ev)
		}
	}
	for _, e := range enrolled {
		p := getPod(t, e.pod.Namespace, e.pod.Name)
		m := marks[string(p.UID)]
		// Two more answers from ztunnel after the new agent's snapshot,
		// and nothing but answers from ztunnel since the rollout began.
		want := fmt.Sprintf("dial %s:80: %d %s:80", testenv.RemoteV4, ztunnelsim.PortOutbound, testenv.RemoteV4)
		waitLogAfter(t, p, "client", len(containerLog(p, "client")), 2, want)
		if bad := linesWithout(containerLog(p, "client")[m.client:], want); bad != "" {
			t.Fatalf("%s/%s's outbound did not reach ztunnel during the rollout:\n%s", p.Namespace, p.Name, bad)
		}
		waitLogAfter(t, p, "app", m.app, 3, "http GET /ready from "+ruleset.ProbeSourceV4.String()+":")
		ready, since := podReady(p)
		if !ready || !since.Equal(m.readySince) {
			t.Fatalf("%s/%s went unready during the rollout (Ready %v since %s, was since %s)", p.Namespace, p.Name, ready, since, m.readySince)
		}
		if got := probeEntries(t, nft)[netip.MustParseAddr(p.Status.PodIP)]; got != string(p.UID) {
			t.Fatalf("the node's probe set holds %q for %s/%s after the rollout", got, p.Namespace, p.Name)
		}
	}
	if seen := flaps(); len(seen) != 0 {
		// The pods stayed with ztunnel throughout (checked above): the new
		// agent must not mark them otherwise while ztunnel reconnects.
		t.Fatalf("enrolled pods' %s changed during the rollout although ztunnel kept them:\n%s",
			ambient.AnnotationRedirection, strings.Join(seen, "\n"))
	}
	probed := enrolled[0].pod
	if bad := linesWithout(containerLog(probed, "app"), "http GET /ready from "+ruleset.ProbeSourceV4.String()+":"); bad != "" {
		t.Fatalf("%s/%s's app saw probes not SNATed:\n%s", probed.Namespace, probed.Name, bad)
	}
	checkProbesSNATed(t, probed)
	if !nft {
		// Not one probe of the pod enrolled from its start reached
		// ztunnel's inbound port, through the rollout too.
		if acc, in, rules := inPodProbeCounters(t, enrolled[0].pod.UID); in != 0 {
			t.Fatalf("in-pod nat counters after the rollout: %d accepted from the probe source, %d redirected to 15006:\n%s", acc, in, rules)
		}
	}
}
