package cluster

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	"helm.sh/helm/v3/pkg/action"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/istio-cni-go/istio-cni/internal/cniserver"
	"github.com/istio-cni-go/istio-cni/internal/install"
	"github.com/istio-cni-go/istio-cni/internal/prepared"
	"github.com/istio-cni-go/istio-cni/internal/testenv"
)

const agentImage = testenv.AgentImage

// podLogDir is where the kubelet writes containers' logs.
const podLogDir = "/var/log/pods"

func waitFor(t *testing.T, what string, limit time.Duration, cond func() (bool, string)) {
	t.Helper()
	deadline := time.Now().Add(limit)
	last := ""
	for {
		ok, state := cond()
		if ok {
			return
		}
		last = state
		if time.Now().After(deadline) {
			evs, _ := cluster.Client.CoreV1().Events("").List(context.Background(), metav1.ListOptions{})
			var lines []string
			for i := range evs.Items {
				e := &evs.Items[i]
				lines = append(lines, e.InvolvedObject.Namespace+"/"+e.InvolvedObject.Name+" "+e.Reason+": "+e.Message)
			}
			log, _ := os.ReadFile(filepath.Join(workDir, "node", "node.log"))
			if len(log) > 6000 {
				log = log[len(log)-6000:]
			}
			t.Fatalf("%s not reached within %s; last: %s\nevents:\n%s\nnode log tail:\n%s", what, limit, last, strings.Join(lines, "\n"), log)
		}
		time.Sleep(250 * time.Millisecond) // polling the API server, bounded
	}
}

// TestChartOnNode installs the chart with the project's image: the agent
// runs as a DaemonSet pod, inserts the plugin into containerd's CNI config,
// and a sidecar pod started by the kubelet passes its validation init
// container (run as the proxy uid), so its rules were in place at start.
func TestChartOnNode(t *testing.T) {
	if err := oneNode.LoadAgentImage(workDir); err != nil {
		t.Fatal(err)
	}
	ctx := context.Background()
	for _, ns := range []string{"istio-system", "mesh"} {
		if err := testenv.EnsureNamespace(ctx, cluster.Client, ns); err != nil {
			t.Fatal(err)
		}
	}
	for _, backend := range []string{"iptables", "nftables"} {
		t.Run(backend, func(t *testing.T) { chartOnNode(t, backend) })
	}
}

// sidecarPod is shaped as Istio's injector shapes a pod with CNI on: the
// validation init container (here the project's command, as the proxy
// uid), the app, and a stand-in istio-proxy reporting original
// destinations.
func sidecarPod(name, dialTo string) *corev1.Pod {
	uid := int64(1337)
	never := corev1.PullNever
	f := false
	return &corev1.Pod{
		ObjectMeta: metav1.ObjectMeta{Namespace: "mesh", Name: name,
			Annotations: map[string]string{"sidecar.istio.io/status": testenv.InjectedStatus}},
		Spec: corev1.PodSpec{NodeName: testenv.NodeName, AutomountServiceAccountToken: &f,
			InitContainers: []corev1.Container{{Name: "istio-validation", Image: agentImage, ImagePullPolicy: never,
				Command:         []string{"istio-cni-validate", "-p", "15001", "-z", "15006", "-u", "1337", "--run-validation", "--skip-rule-apply", "--probe-timeout", "3s"},
				SecurityContext: &corev1.SecurityContext{RunAsUser: &uid, RunAsGroup: &uid}}},
			Containers: []corev1.Container{
				{Name: "app", Image: testenv.AppImage, ImagePullPolicy: never, Args: []string{"dial-loop", dialTo}},
				{Name: "istio-proxy", Image: testenv.AppImage, ImagePullPolicy: never, Args: []string{"proxy", "sidecar", ":15001", ":15006"},
					SecurityContext: &corev1.SecurityContext{RunAsUser: &uid, RunAsGroup: &uid}},
			}},
	}
}

// chartRunDir is the chart's cniAgentRunDir, on the host.
const chartRunDir = "/var/run/istio-cni"

func chartOnNode(t *testing.T, backend string) {
	ctx := context.Background()
	// The race: a sidecar pod scheduled before the agent runs.
	raced := sidecarPod("raced-"+backend, testenv.RemoteV4+":80")
	if _, err := cluster.Client.CoreV1().Pods("mesh").Create(ctx, raced, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	waitFor(t, "raced pod's validation to fail with 126", 60*time.Second, func() (bool, string) {
		p, err := cluster.Client.CoreV1().Pods("mesh").Get(ctx, raced.Name, metav1.GetOptions{})
		if err != nil || len(p.Status.InitContainerStatuses) == 0 {
			return false, "no status"
		}
		st := p.Status.InitContainerStatuses[0]
		failed := func(tm *corev1.ContainerStateTerminated) bool { return tm != nil && tm.ExitCode == 126 }
		return failed(st.State.Terminated) || failed(st.LastTerminationState.Terminated), podProblems(p)
	})

	confPath := filepath.Join(node.ConfDir, "10-ptp.conflist")
	before, err := os.ReadFile(confPath)
	if err != nil {
		t.Fatal(err)
	}
	ns := "istio-system"
	values := testenv.NodeChartValues(cluster, node, backend == "nftables")
	// This test is about the agent's path: a relay with no record waits
	// for the agent however loaded the machine running the tests is. A
	// relay leaving a slow agent (the default wait) is
	// TestAgentBehindRelayLeaves's, in test/e2e.
	values["env"].(map[string]any)["CNI_AGENT_WAIT"] = "0"
	// Configs an earlier agent on this node learnt would tell the new
	// one what the file does (below).
	if err := os.RemoveAll(filepath.Join(chartRunDir, prepared.DirName)); err != nil {
		t.Fatal(err)
	}
	rel, err := testenv.InstallChart(cluster, values)
	if err != nil {
		t.Fatal(err)
	}
	uninstalled := false
	t.Cleanup(func() {
		if uninstalled {
			return
		}
		// A failure on the way leaves no chart behind for the next
		// backend's run, which starts with a pod racing an absent agent.
		_ = rel.Uninstall()
		waitFor(t, "the chart gone after a failure", 90*time.Second, func() (bool, string) {
			pods, err := cluster.Client.CoreV1().Pods(ns).List(ctx, metav1.ListOptions{LabelSelector: "k8s-app=istio-cni-node"})
			_, binErr := os.Stat(filepath.Join(node.BinDir, "istio-cni"))
			return err == nil && len(pods.Items) == 0 && os.IsNotExist(binErr), "agent pod or plugin binary still there"
		})
	})

	waitFor(t, "agent pod Ready", 120*time.Second, func() (bool, string) {
		pods, err := cluster.Client.CoreV1().Pods(ns).List(ctx, metav1.ListOptions{LabelSelector: "k8s-app=istio-cni-node"})
		if err != nil || len(pods.Items) == 0 {
			return false, "no agent pod yet"
		}
		p := pods.Items[0]
		for _, c := range p.Status.Conditions {
			if c.Type == corev1.PodReady && c.Status == corev1.ConditionTrue {
				return true, ""
			}
		}
		return false, string(p.Status.Phase) + " " + podProblems(&p)
	})
	conf, err := os.ReadFile(confPath)
	if err != nil || !strings.Contains(string(conf), `"istio-cni"`) {
		t.Fatalf("the agent did not insert the plugin into containerd's config: %v\n%s", err, conf)
	}
	// The entry follows the file's own layout (compact here), so it is
	// read as JSON.
	var list struct {
		Plugins []map[string]any `json:"plugins"`
	}
	if err := json.Unmarshal(conf, &list); err != nil || len(list.Plugins) == 0 {
		t.Fatalf("the config does not parse: %v\n%s", err, conf)
	}
	if got := list.Plugins[len(list.Plugins)-1]["native_nftables"]; got != (backend == "nftables") {
		t.Fatalf("the plugin entry has native_nftables %v, want %v:\n%s", got, backend == "nftables", conf)
	}

	// The first pod after the agent's start: the agent read the config
	// the runtime will hand the plugin from the file it wrote, so the
	// pod's ADD is prepared before any ADD taught it. The saved configs
	// of earlier agents were removed before the install, so that only
	// the file can have told it. The pod's sandbox waits for a ConfigMap
	// that is not there yet (the kubelet mounts volumes first), so the
	// record is there, deterministically, before the ADD.
	if ags := agentPods(t); len(ags) != 1 {
		t.Fatalf("%d agent pods", len(ags))
	} else {
		waitLog(t, &ags[0], "install-cni", "the runtime will read from the CNI config file")
	}
	name := "sidecar-" + backend
	first := sidecarPod(name, testenv.RemoteV4+":80")
	hold := "hold-" + name
	first.Spec.Volumes = []corev1.Volume{{Name: "hold", VolumeSource: corev1.VolumeSource{
		ConfigMap: &corev1.ConfigMapVolumeSource{LocalObjectReference: corev1.LocalObjectReference{Name: hold}}}}}
	created0, err := cluster.Client.CoreV1().Pods("mesh").Create(ctx, first, metav1.CreateOptions{})
	if err != nil {
		t.Fatal(err)
	}
	expected, err := cniserver.ExpectedConfig(conf, install.PluginType)
	if err != nil {
		t.Fatal(err)
	}
	waitFor(t, "the held pod's prepared record under the config from the file", 30*time.Second, func() (bool, string) {
		rec, err := prepared.Read(filepath.Join(chartRunDir, prepared.DirName), string(created0.UID))
		if err != nil {
			return false, err.Error()
		}
		if len(rec.Entries) != 1 || !bytes.Equal(rec.Entries[0].Config, expected) {
			return false, fmt.Sprintf("record %+v", rec)
		}
		return true, ""
	})
	if _, err := cluster.Client.CoreV1().ConfigMaps("mesh").Create(ctx, &corev1.ConfigMap{ObjectMeta: metav1.ObjectMeta{Name: hold}}, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	waitFor(t, "sidecar pod Running after its validation", 90*time.Second, func() (bool, string) {
		p, err := cluster.Client.CoreV1().Pods("mesh").Get(ctx, name, metav1.GetOptions{})
		if err != nil {
			return false, err.Error()
		}
		return p.Status.Phase == corev1.PodRunning, string(p.Status.Phase) + " " + podProblems(p)
	})
	sidecar, err := cluster.Client.CoreV1().Pods("mesh").Get(ctx, name, metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	// The app's outbound connection reaches the stand-in proxy, which sees
	// where it was going.
	waitLog(t, sidecar, "app", "original destination "+testenv.RemoteV4+":80")
	if reason := repairEvent(t, name); reason != "" {
		t.Fatalf("the sidecar pod created after the agent needed repair (%s): it did not start with its rules", reason)
	}
	// The runtime's istio-cni handed the ADD to the agent, which
	// programmed the pod in-process; the fallback plugin did not run.
	agents, err := cluster.Client.CoreV1().Pods(ns).List(ctx, metav1.ListOptions{LabelSelector: "k8s-app=istio-cni-node"})
	if err != nil || len(agents.Items) != 1 {
		t.Fatalf("agent pods: %v %v", agents, err)
	}
	agentPod := &agents.Items[0]
	// The agent's container runs with the chart's CPU request as a real
	// node gives it: a Burstable pod whose cgroup weighs 100m.
	checkAgentCgroup(t, agentPod)
	// The chart's default, as Istio's: the console format, labels as key=value.
	podLabel := "pod=mesh/" + name + " "
	waitLog(t, agentPod, "install-cni", podLabel)
	agentLog := readLog(t, agentPod, "install-cni")
	served := false
	for _, line := range strings.Split(agentLog, "\n") {
		if !strings.Contains(line+" ", podLabel) {
			continue
		}
		if strings.Contains(line, "served without the node agent") {
			t.Fatalf("the pod's ADD went to the fallback plugin, not the agent: %s", line)
		}
		if strings.Contains(line, "redirect rules programmed") {
			// The agent in its container prepared the rules (its scratch
			// namespace, its iptables) and the relay, in the runtime's
			// cgroup, sent them.
			if !strings.Contains(line, "committed_by=plugin") {
				t.Fatalf("the pod's rules were not sent by the relay: %s", line)
			}
			if !strings.Contains(line, "prepared=true") {
				t.Fatalf("the pod's ADD was not served from its record: %s", line)
			}
			if cpu, err := testenv.LogDuration(line, "plugin_cpu"); err != nil || cpu <= 0 {
				t.Fatalf("plugin_cpu %v (%v) in the agent's line, want the relay's positive CPU time: %s", cpu, err, line)
			}
			served = true
		}
	}
	if !served {
		t.Fatalf("no line of the agent programming mesh/%s:\n%s", name, agentLog)
	}

	// A pod without a sidecar is untouched: its connection to the same
	// place is not redirected (nothing listens there), and its connection
	// to the sidecar pod's app port lands on that pod's proxy inbound.
	target := sidecar.Status.PodIP + ":8080"
	never := corev1.PullNever
	f := false
	client := &corev1.Pod{
		ObjectMeta: metav1.ObjectMeta{Namespace: "mesh", Name: "plain-client-" + backend},
		Spec: corev1.PodSpec{NodeName: testenv.NodeName, AutomountServiceAccountToken: &f,
			Containers: []corev1.Container{
				{Name: "to-sidecar", Image: testenv.AppImage, ImagePullPolicy: never, Args: []string{"dial-loop", target}},
				{Name: "to-remote", Image: testenv.AppImage, ImagePullPolicy: never, Args: []string{"dial-loop", testenv.RemoteV4 + ":80"}},
			}},
	}
	created, err := cluster.Client.CoreV1().Pods("mesh").Create(ctx, client, metav1.CreateOptions{})
	if err != nil {
		t.Fatal(err)
	}
	waitLog(t, created, "to-sidecar", "original destination "+target)
	waitLog(t, created, "to-remote", "connection refused")
	if backend == "iptables" {
		plainRuntimeUntouched(t, agentPod)
	}

	// The raced pod was repaired when the agent came up, and now runs
	// with its traffic through the proxy.
	waitFor(t, "RepairedPod event on the raced pod", 60*time.Second, func() (bool, string) {
		evs, err := cluster.Client.CoreV1().Events("mesh").List(ctx, metav1.ListOptions{})
		if err != nil {
			return false, err.Error()
		}
		for i := range evs.Items {
			if e := &evs.Items[i]; e.InvolvedObject.Name == raced.Name && e.Reason == "RepairedPod" {
				return true, ""
			}
		}
		return false, "no event yet"
	})
	waitFor(t, "raced pod Running after repair", 120*time.Second, func() (bool, string) {
		p, err := cluster.Client.CoreV1().Pods("mesh").Get(ctx, raced.Name, metav1.GetOptions{})
		if err != nil {
			return false, err.Error()
		}
		return p.Status.Phase == corev1.PodRunning, string(p.Status.Phase) + " " + podProblems(p)
	})
	repaired, err := cluster.Client.CoreV1().Pods("mesh").Get(ctx, raced.Name, metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	waitLog(t, repaired, "app", "original destination "+testenv.RemoteV4+":80")

	if backend == "iptables" {
		upgradeUnderChurn(t, rel)
	}

	// helm uninstall: the DaemonSet goes, its pod gets SIGTERM, sees no
	// DaemonSet and removes the plugin: containerd's config is as before.
	uninstalled = true
	if err := rel.Uninstall(); err != nil {
		t.Fatalf("helm uninstall: %v", err)
	}
	waitFor(t, "CNI config restored after uninstall", 90*time.Second, func() (bool, string) {
		now, err := os.ReadFile(confPath)
		if err != nil {
			return false, err.Error()
		}
		return install.SameJSON(now, before), string(now)
	})
	// The binary goes last, after the entry and the kubeconfig.
	waitFor(t, "plugin binary removed after uninstall", 30*time.Second, func() (bool, string) {
		_, err := os.Stat(filepath.Join(node.BinDir, "istio-cni"))
		return os.IsNotExist(err), fmt.Sprint(err)
	})
	zero := int64(0)
	for _, p := range []string{raced.Name, name, client.Name} {
		_ = cluster.Client.CoreV1().Pods("mesh").Delete(ctx, p, metav1.DeleteOptions{GracePeriodSeconds: &zero})
	}
	waitFor(t, "agent pod gone", 60*time.Second, func() (bool, string) {
		pods, err := cluster.Client.CoreV1().Pods("istio-system").List(ctx, metav1.ListOptions{LabelSelector: "k8s-app=istio-cni-node"})
		return err == nil && len(pods.Items) == 0, "agent pod still there"
	})
}

// plainRuntimeUntouched: a sidecar pod run through the node's plain
// runtime handler (the primary's config alone, as the cluster bench's
// mixed bursts use it for their pods without the plugin) starts without
// istio-cni: once its app runs, the agent has still not heard of it (a
// pod of the default handler is logged by its ADD, long before).
func plainRuntimeUntouched(t *testing.T, agentPod *corev1.Pod) {
	ctx := context.Background()
	if err := testenv.EnsureRuntimeClasses(ctx, cluster.Client); err != nil {
		t.Fatal(err)
	}
	p := sidecarPod("plain-runtime-sidecar", testenv.RemoteV4+":80")
	// Its validation would fail: nothing redirects its traffic.
	p.Spec.InitContainers = nil
	class := testenv.PlainRuntimeClass
	p.Spec.RuntimeClassName = &class
	created, err := cluster.Client.CoreV1().Pods("mesh").Create(ctx, p, metav1.CreateOptions{})
	if err != nil {
		t.Fatal(err)
	}
	defer func() {
		zero := int64(0)
		_ = cluster.Client.CoreV1().Pods("mesh").Delete(ctx, p.Name, metav1.DeleteOptions{GracePeriodSeconds: &zero})
	}()
	waitLog(t, created, "app", "connection refused")
	for _, line := range strings.Split(readLog(t, agentPod, "install-cni"), "\n") {
		if strings.Contains(line+" ", "pod=mesh/"+p.Name+" ") && strings.Contains(line, "cmd=") {
			t.Fatalf("the plugin served a pod of the plain runtime handler: %s", line)
		}
	}
}

// waitLog waits until the container's log (the kubelet's files) has want.
func waitLog(t *testing.T, pod *corev1.Pod, container, want string) {
	t.Helper()
	path := logPath(pod, container)
	waitFor(t, container+" log containing "+want, 60*time.Second, func() (bool, string) {
		b, err := os.ReadFile(path)
		if err != nil {
			return false, err.Error()
		}
		s := string(b)
		if len(s) > 400 {
			s = s[len(s)-400:]
		}
		return strings.Contains(string(b), want), s
	})
}

func podProblems(p *corev1.Pod) string {
	var out []string
	statuses := append(append([]corev1.ContainerStatus{}, p.Status.InitContainerStatuses...), p.Status.ContainerStatuses...)
	for i := range statuses {
		st := &statuses[i]
		if w := st.State.Waiting; w != nil {
			out = append(out, st.Name+": "+w.Reason+" "+w.Message)
		}
		if tm := st.State.Terminated; tm != nil && tm.ExitCode != 0 {
			out = append(out, st.Name+": exit "+strconv.Itoa(int(tm.ExitCode))+" "+tm.Message)
		}
	}
	return strings.Join(out, "; ")
}

// upgradeUnderChurn rolls the DaemonSet to a new image tag while sidecar
// pods keep being created and deleted: every pod passes its validation
// (so it started with its rules) and none is stuck terminating for lack of
// the plugin binary (the old agent leaves the plugin in place while its
// DaemonSet exists).
func upgradeUnderChurn(t *testing.T, rel *testenv.Release) {
	t.Helper()
	ctx := context.Background()
	if b, err := node.Ctr("images", "tag", "--force", "docker.io/"+agentImage, "docker.io/istio-cni-go/install-cni:test2"); err != nil {
		t.Fatalf("tagging the upgrade image: %v %s", err, b)
	}
	old, err := cluster.Client.CoreV1().Pods("istio-system").List(ctx, metav1.ListOptions{LabelSelector: "k8s-app=istio-cni-node"})
	if err != nil || len(old.Items) != 1 {
		t.Fatalf("agent pods before the upgrade: %v", err)
	}
	up := action.NewUpgrade(rel.Config)
	up.Namespace = "istio-system"
	newValues := map[string]any{}
	for k, v := range rel.Values {
		newValues[k] = v
	}
	newValues["tag"] = "test2"
	zero := int64(0)
	var names []string
	for i := 0; i < 6; i++ {
		name := fmt.Sprintf("churn-%d", i)
		names = append(names, name)
		if _, err := cluster.Client.CoreV1().Pods("mesh").Create(ctx, sidecarPod(name, testenv.RemoteV4+":80"), metav1.CreateOptions{}); err != nil {
			t.Fatal(err)
		}
		if i == 1 {
			if _, err := up.Run("istio-cni", rel.Chart, newValues); err != nil {
				t.Fatalf("helm upgrade: %v", err)
			}
		}
		if i >= 2 {
			// Pods also go away during the rollout: their DEL needs the plugin.
			if err := cluster.Client.CoreV1().Pods("mesh").Delete(ctx, names[i-2], metav1.DeleteOptions{}); err != nil {
				t.Fatal(err)
			}
		}
	}
	waitFor(t, "the rollout to the new tag", 120*time.Second, func() (bool, string) {
		pods, err := cluster.Client.CoreV1().Pods("istio-system").List(ctx, metav1.ListOptions{LabelSelector: "k8s-app=istio-cni-node"})
		if err != nil || len(pods.Items) != 1 || pods.Items[0].UID == old.Items[0].UID {
			return false, "old agent pod still there"
		}
		p := pods.Items[0]
		ready := false
		for _, c := range p.Status.Conditions {
			ready = ready || (c.Type == corev1.PodReady && c.Status == corev1.ConditionTrue)
		}
		return ready && strings.HasSuffix(p.Spec.Containers[0].Image, ":test2"), string(p.Status.Phase)
	})
	for _, name := range names[len(names)-2:] {
		waitFor(t, name+" Running after its validation", 120*time.Second, func() (bool, string) {
			p, err := cluster.Client.CoreV1().Pods("mesh").Get(ctx, name, metav1.GetOptions{})
			if err != nil {
				return false, err.Error()
			}
			return p.Status.Phase == corev1.PodRunning, string(p.Status.Phase) + " " + podProblems(p)
		})
	}
	for _, name := range names[:len(names)-2] {
		waitFor(t, name+" gone", 90*time.Second, func() (bool, string) {
			p, err := cluster.Client.CoreV1().Pods("mesh").Get(ctx, name, metav1.GetOptions{})
			if err != nil {
				return true, ""
			}
			return false, "still " + string(p.Status.Phase) + " " + podProblems(p)
		})
	}
	// No pod ever needed repair: all of them started with their rules,
	// and each sandbox was made and torn down, CNI ADD and DEL through
	// the plugin, the first time. A container's stop that the runtime's
	// shim failed ("KillContainer": no CNI call in it, and the kubelet
	// stops it again; the pods are gone, above) is not the plugin's.
	evs, err := cluster.Client.CoreV1().Events("mesh").List(ctx, metav1.ListOptions{})
	if err != nil {
		t.Fatal(err)
	}
	for i := range evs.Items {
		e := &evs.Items[i]
		if e.Reason == "FailedKillPod" && strings.Contains(e.Message, `failed to "KillContainer"`) && !strings.Contains(e.Message, "KillPodSandbox") {
			t.Logf("%s: %s %s (a container's stop, retried by the kubelet)", e.InvolvedObject.Name, e.Reason, e.Message)
			continue
		}
		if strings.HasPrefix(e.InvolvedObject.Name, "churn-") && (e.Reason == "RepairedPod" || e.Reason == "FailedKillPod" || e.Reason == "FailedCreatePodSandBox") {
			log, _ := os.ReadFile(filepath.Join(workDir, "node", "node.log"))
			var lines []string
			for _, l := range strings.Split(string(log), "\n") {
				if strings.Contains(l, e.InvolvedObject.Name) {
					lines = append(lines, l)
				}
			}
			t.Fatalf("%s: %s %s\nnode log lines about it:\n%s", e.InvolvedObject.Name, e.Reason, e.Message, strings.Join(lines, "\n"))
		}
	}
	for _, name := range names[len(names)-2:] {
		_ = cluster.Client.CoreV1().Pods("mesh").Delete(ctx, name, metav1.DeleteOptions{GracePeriodSeconds: &zero})
	}
}

// repairEvent returns the repair controller's event reason for a pod, or "".
func repairEvent(t *testing.T, pod string) string {
	t.Helper()
	evs, err := cluster.Client.CoreV1().Events("mesh").List(context.Background(), metav1.ListOptions{})
	if err != nil {
		t.Fatal(err)
	}
	for i := range evs.Items {
		if e := &evs.Items[i]; e.InvolvedObject.Name == pod && strings.HasPrefix(e.Reason, "Repair") {
			return e.Reason
		}
	}
	return ""
}

// checkAgentCgroup asserts the agent runs as the chart's resources make a
// real node run it: a Burstable pod weighing its 100m CPU request (102
// shares), with no CPU limit (no quota), and its process in that cgroup.
func checkAgentCgroup(t *testing.T, agentPod *corev1.Pod) {
	t.Helper()
	cg, err := node.Cgroups.PodCgroup(string(agentPod.UID))
	if err != nil || filepath.Base(filepath.Dir(cg)) != "burstable" {
		t.Fatalf("agent pod cgroup %q (%v); want it under kubepods/burstable", cg, err)
	}
	for file, want := range map[string]string{"cpu.shares": "102", "cpu.cfs_quota_us": "-1"} {
		if b, err := os.ReadFile(filepath.Join(cg, file)); err != nil || strings.TrimSpace(string(b)) != want {
			t.Errorf("agent pod %s %q (%v); want %s for the chart's 100m request and no limit", file, b, err, want)
		}
	}
	found := false
	_ = filepath.WalkDir(cg, func(path string, d os.DirEntry, err error) error {
		if err != nil || d.Name() != "cgroup.procs" {
			return nil
		}
		b, _ := os.ReadFile(path)
		for _, f := range strings.Fields(string(b)) {
			if comm, _ := os.ReadFile("/proc/" + f + "/comm"); strings.TrimSpace(string(comm)) == "install-cni" {
				found = true
			}
		}
		return nil
	})
	if !found {
		t.Errorf("no install-cni process in the agent pod's cgroup %s", cg)
	}
}
