package e2e

import (
	"context"
	"net"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	rbacv1 "k8s.io/api/rbac/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/istio-cni-go/istio-cni/internal/redirect"
	"github.com/istio-cni-go/istio-cni/internal/testenv"
)

// markValidation records the pod's IP and the validation container's
// state in the pod status, as the kubelet would.
func markValidation(t *testing.T, name, ip string, exitCode int32) {
	t.Helper()
	ctx := context.Background()
	pod, err := cluster.Client.CoreV1().Pods(testNS).Get(ctx, name, metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	pod.Status.Phase = corev1.PodPending
	pod.Status.PodIP = ip
	pod.Status.PodIPs = []corev1.PodIP{{IP: ip}}
	term := &corev1.ContainerStateTerminated{ExitCode: exitCode, Reason: "Error"}
	if exitCode == 0 {
		term.Reason = "Completed"
	}
	pod.Status.InitContainerStatuses = []corev1.ContainerStatus{{Name: "istio-validation", Image: "proxyv2:test",
		State: corev1.ContainerState{Terminated: term}}}
	if _, err := cluster.Client.CoreV1().Pods(testNS).UpdateStatus(ctx, pod, metav1.UpdateOptions{}); err != nil {
		t.Fatal(err)
	}
}

func waitEvent(t *testing.T, podName, reason string) *corev1.Event {
	t.Helper()
	deadline := time.Now().Add(15 * time.Second)
	for {
		evs, err := cluster.Client.CoreV1().Events(testNS).List(context.Background(), metav1.ListOptions{})
		if err != nil {
			t.Fatal(err)
		}
		for i := range evs.Items {
			if ev := &evs.Items[i]; ev.InvolvedObject.Name == podName && ev.Reason == reason {
				return &evs.Items[i]
			}
		}
		if time.Now().After(deadline) {
			t.Fatalf("no %s event for pod %s", reason, podName)
		}
		time.Sleep(50 * time.Millisecond) // polling the API server
	}
}

// racedPod is a pod whose sandbox was set up without istio-cni (it was not
// installed yet), with a process living in its namespace and its cgroup.
func racedPod(t *testing.T, e *env, spec testenv.PodSpec) (*testenv.Pod, string) {
	t.Helper()
	return racedPodIn(t, e, testenv.NewPod, spec)
}

// racedPodIn is racedPod with the sandbox made by mk.
func racedPodIn(t *testing.T, e *env, mk func(namespace, name, uid, containerID string) (*testenv.Pod, error), spec testenv.PodSpec) (*testenv.Pod, string) {
	t.Helper()
	pod := e.newPodIn(mk, &spec)
	res, err := e.node.Add(context.Background(), e.node.Primary, pod)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = e.node.Del(context.Background(), e.node.Primary, pod) })
	stop, err := pod.StartSandboxProcess()
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(stop)
	ip := ""
	for _, r := range resultIPs(t, res) {
		if r.Is4() {
			ip = r.String()
		}
	}
	return pod, ip
}

// setPodIP records the pod's IP in its status, as the kubelet would.
func setPodIP(t *testing.T, name, ip string) {
	t.Helper()
	ctx := context.Background()
	p, err := cluster.Client.CoreV1().Pods(testNS).Get(ctx, name, metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	p.Status.PodIP, p.Status.PodIPs = ip, []corev1.PodIP{{IP: ip}}
	if _, err := cluster.Client.CoreV1().Pods(testNS).UpdateStatus(ctx, p, metav1.UpdateOptions{}); err != nil {
		t.Fatal(err)
	}
}

// repairHost starts an agent for the test node, with a primary config in
// place and the given flags.
func repairHost(t *testing.T, flags ...string) *host {
	t.Helper()
	h := newHost(t)
	if err := os.WriteFile(filepath.Join(h.NetDir, "10-calico.conflist"), calicoBytes(t), 0o644); err != nil {
		t.Fatal(err)
	}
	// The chart sets repair-repair-pods; the binary defaults to false, as Istio's.
	h.start(append([]string{"--kubernetes-node-name", testenv.NodeName, "--repair-repair-pods"}, flags...)...)
	return h
}

func TestRepairInPlace(t *testing.T) {
	ensureDaemonSet(t, false)
	h := repairHost(t, "--repair-host-proc", "/proc")
	h.waitReadyz(200, 20*time.Second)
	e := newEnv(t, nil)

	pod, ip := racedPod(t, e, testenv.PodSpec{Sidecar: true, InitNames: []string{"istio-validation"}})
	if code, out, _ := runValidation(t, pod); code != 126 {
		t.Fatalf("validation before repair: exit %d, want 126:\n%s", code, out)
	}
	markValidation(t, pod.Name, ip, 126)
	waitEvent(t, pod.Name, "RepairedPod")

	if code, out, _ := runValidation(t, pod); code != 0 {
		t.Fatalf("validation after repair: exit %d, want 0:\n%s", code, out)
	}
	expectRedirect(t, pod, "tcp4", "0.0.0.0:15001", ap(testenv.RemoteV4+":80"), func() (net.Conn, error) {
		return testenv.Dial(pod, "tcp4", testenv.RemoteV4+":80")
	})
	// Repair writes exactly what the plugin writes for the same pod.
	ref := e.add(&testenv.PodSpec{Sidecar: true, InitNames: []string{"istio-validation"}})
	got, want := sameRulesIn(t, pod), sameRulesIn(t, ref.pod)
	if got != want {
		t.Fatalf("repaired rules differ from the plugin's:\n--- repair\n%s\n--- plugin\n%s", got, want)
	}
	h.waitMetric(`istio_cni_repair_pods_repaired_total{result="success",type="repair"}`, "1", 5*time.Second)

	// running starts a pod with the plugin's rules and its sandbox's
	// process, and returns it with its rules as they are.
	running := func(t *testing.T) (*sandbox, string) {
		t.Helper()
		sb := e.add(&testenv.PodSpec{Sidecar: true, InitNames: []string{"istio-validation"}})
		stop, err := sb.pod.StartSandboxProcess()
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(stop)
		return sb, sameRulesIn(t, sb.pod)
	}
	// leftAlone marks the pod's validation failed and expects repair to
	// say its rules are in place and to leave them as they were.
	leftAlone := func(t *testing.T, sb *sandbox, before string, skips string) {
		t.Helper()
		markValidation(t, sb.pod.Name, sb.v4.String(), 126)
		ev := waitEvent(t, sb.pod.Name, "RepairPodFailed")
		if !strings.Contains(ev.Message, "redirect rules are in place") {
			t.Fatalf("event does not say why: %q", ev.Message)
		}
		h.waitMetric(`istio_cni_repair_pods_repaired_total{result="skip",type="repair"}`, skips, 5*time.Second)
		h.waitMetric(`istio_cni_repair_pods_repaired_total{result="success",type="repair"}`, "1", 5*time.Second)
		if after := sameRulesIn(t, sb.pod); after != before {
			t.Fatalf("the pod's rules changed:\n--- before\n%s\n--- after\n%s", before, after)
		}
	}
	t.Run("rules-in-place", func(t *testing.T) {
		// Validation failing with the rules in place is not the race:
		// nothing is rewritten, and no "repaired" is claimed.
		sb, before := running(t)
		leftAlone(t, sb, before, "1")
	})
	t.Run("rules-of-changed-annotations", func(t *testing.T) {
		// Rules of the pod's annotations as they were at its start are
		// rules in place too: not rewritten to the new ones.
		sb, before := running(t)
		ctx := context.Background()
		p, err := cluster.Client.CoreV1().Pods(testNS).Get(ctx, sb.pod.Name, metav1.GetOptions{})
		if err != nil {
			t.Fatal(err)
		}
		p.Annotations[redirect.AnnotationExcludeOutboundPorts] = "5000"
		if _, err := cluster.Client.CoreV1().Pods(testNS).Update(ctx, p, metav1.UpdateOptions{}); err != nil {
			t.Fatal(err)
		}
		leftAlone(t, sb, before, "2")
	})
	t.Run("namespace-not-found", func(t *testing.T) {
		_, err := createPod(t, testenv.PodSpec{Namespace: testNS, Name: "ghost", Sidecar: true})
		if err != nil {
			t.Fatal(err)
		}
		markValidation(t, "ghost", "10.99.99.99", 126)
		ev := waitEvent(t, "ghost", "RepairPodFailed")
		if !strings.Contains(ev.Message, "no network namespace") {
			t.Fatalf("event does not say why: %q", ev.Message)
		}
	})
}

func TestRepairDeleteAndLabel(t *testing.T) {
	ensureDaemonSet(t, false)
	for _, mode := range []string{"delete", "label"} {
		t.Run(mode, func(t *testing.T) {
			h := repairHost(t, "--repair-repair-pods=false", "--repair-"+mode+"-pods")
			h.waitReadyz(200, 20*time.Second)
			ctx := context.Background()
			mk := func(name string, spec testenv.PodSpec, exit int32) {
				spec.Namespace, spec.Name = testNS, mode+"-"+name
				if _, err := createPod(t, spec); err != nil {
					t.Fatal(err)
				}
				markValidation(t, spec.Name, "10.250.0.1", exit)
			}
			mk("broken", testenv.PodSpec{Sidecar: true}, 126)
			mk("healthy", testenv.PodSpec{Sidecar: true}, 0)
			mk("plain", testenv.PodSpec{}, 126)
			mk("elsewhere", testenv.PodSpec{Sidecar: true, Node: "other-node"}, 126)
			reason := map[string]string{"delete": "DeleteBrokenPod", "label": "LabelBrokenPod"}[mode]
			// Istio's words, which operators' alerts match.
			if ev, want := waitEvent(t, mode+"-broken", reason), map[string]string{"delete": "pod detected as broken, deleted",
				"label": "pod detected as broken, labeled"}[mode]; ev.Message != want {
				t.Fatalf("event %q, want Istio's %q", ev.Message, want)
			}
			broken, err := cluster.Client.CoreV1().Pods(testNS).Get(ctx, mode+"-broken", metav1.GetOptions{})
			switch mode {
			case "delete":
				// Without a kubelet the pod stays, marked for deletion.
				if !apierrors.IsNotFound(err) && (err != nil || broken.DeletionTimestamp == nil) {
					t.Fatalf("broken pod not deleted: %v", err)
				}
			case "label":
				if err != nil || broken.Labels["cni.istio.io/uninitialized"] != "true" {
					t.Fatalf("broken pod not labeled: %v %v", err, broken.Labels)
				}
			}
			for _, other := range []string{"healthy", "plain", "elsewhere"} {
				p, err := cluster.Client.CoreV1().Pods(testNS).Get(ctx, mode+"-"+other, metav1.GetOptions{})
				if err != nil || p.DeletionTimestamp != nil {
					t.Fatalf("%s pod deleted: %v", other, err)
				}
				if _, ok := p.Labels["cni.istio.io/uninitialized"]; ok {
					t.Fatalf("%s pod labeled", other)
				}
			}
		})
	}
}

// TestRepairStartupScan: a pod that started while no agent ran, whose
// validation has not failed (yet), is found and repaired at start-up.
func TestRepairStartupScan(t *testing.T) {
	ensureDaemonSet(t, false)
	e := newEnv(t, nil)
	pod, ip := racedPod(t, e, testenv.PodSpec{Sidecar: true, InitNames: []string{"istio-validation"}})
	setPodIP(t, pod.Name, ip)
	repairHost(t, "--repair-host-proc", "/proc")
	ev := waitEvent(t, pod.Name, "RepairedPod")
	if !strings.Contains(ev.Message, "start-up") {
		t.Fatalf("event: %q", ev.Message)
	}
	if code, out, _ := runValidation(t, pod); code != 0 {
		t.Fatalf("validation after the start-up repair: exit %d:\n%s", code, out)
	}
}

// TestRepairStartupScanLeavesOtherRules: the start-up scan acts only on
// pods whose namespace holds none of our rules. A pod whose rules differ
// from this agent's plan (here its annotations changed after it started;
// after an upgrade, an earlier agent's form of the same rules) keeps them
// untouched, even with --repair-delete-pods, while a pod without rules
// beside it is deleted. An injected gateway (istio-proxy running "proxy
// router"), which the plugin never redirects, is left alone too.
func TestRepairStartupScanLeavesOtherRules(t *testing.T) {
	ensureDaemonSet(t, false)
	ctx := context.Background()
	e := newEnv(t, nil)
	kept := e.add(&testenv.PodSpec{Sidecar: true})
	stop, err := kept.pod.StartSandboxProcess()
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(stop)
	setPodIP(t, kept.pod.Name, kept.v4.String())
	before := sameRulesIn(t, kept.pod)
	p, err := cluster.Client.CoreV1().Pods(testNS).Get(ctx, kept.pod.Name, metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	p.Annotations[redirect.AnnotationExcludeOutboundPorts] = "5000"
	if _, err := cluster.Client.CoreV1().Pods(testNS).Update(ctx, p, metav1.UpdateOptions{}); err != nil {
		t.Fatal(err)
	}
	raced, ip := racedPod(t, e, testenv.PodSpec{Sidecar: true})
	setPodIP(t, raced.Name, ip)
	gw, gwIP := racedPod(t, e, testenv.PodSpec{Sidecar: true, ProxyArgs: []string{"proxy", "router"}})
	setPodIP(t, gw.Name, gwIP)

	h := repairHost(t, "--repair-host-proc", "/proc", "--repair-repair-pods=false", "--repair-delete-pods")
	waitEvent(t, raced.Name, "DeleteBrokenPod")
	h.waitLog("left as they are", 20*time.Second)
	if !strings.Contains(h.LogText(), kept.pod.Name) {
		t.Fatalf("the scan's log does not name %s:\n%s", kept.pod.Name, h.LogText())
	}
	for deadline := time.Now().Add(20 * time.Second); ; {
		if slices.ContainsFunc(strings.Split(h.LogText(), "\n"), func(l string) bool {
			return strings.Contains(l, "the plugin does not redirect this pod") && strings.Contains(l, gw.Name)
		}) {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("the scan's log does not say it left the gateway %s alone:\n%s", gw.Name, h.LogText())
		}
		time.Sleep(10 * time.Millisecond) // polling the agent's log
	}
	if got, err := cluster.Client.CoreV1().Pods(testNS).Get(ctx, gw.Name, metav1.GetOptions{}); err != nil || got.DeletionTimestamp != nil {
		t.Fatalf("the gateway was deleted: %v", err)
	}
	got, err := cluster.Client.CoreV1().Pods(testNS).Get(ctx, kept.pod.Name, metav1.GetOptions{})
	if err != nil || got.DeletionTimestamp != nil {
		t.Fatalf("the pod with rules was deleted: %v", err)
	}
	if after := sameRulesIn(t, kept.pod); after != before {
		t.Fatalf("the pod's rules changed:\n--- before\n%s\n--- after\n%s", before, after)
	}
}

// TestRepairGoesOn: a pod that vanishes before it is repaired, and an API
// server that refuses a delete, each leave an Event or a log line, and the
// controller still acts on the next broken pod.
func TestRepairGoesOn(t *testing.T) {
	ensureDaemonSet(t, false)
	ctx := context.Background()
	t.Run("vanished-pod", func(t *testing.T) {
		h := repairHost(t, "--repair-host-proc", "/proc")
		h.waitReadyz(200, 20*time.Second)
		e := newEnv(t, nil)
		gone, goneIP := racedPod(t, e, testenv.PodSpec{Sidecar: true})
		markValidation(t, gone.Name, goneIP, 126)
		zero := int64(0)
		if err := cluster.Client.CoreV1().Pods(testNS).Delete(ctx, gone.Name, metav1.DeleteOptions{GracePeriodSeconds: &zero}); err != nil {
			t.Fatal(err)
		}
		next, nextIP := racedPod(t, e, testenv.PodSpec{Sidecar: true})
		markValidation(t, next.Name, nextIP, 126)
		waitEvent(t, next.Name, "RepairedPod")
	})
	t.Run("delete-refused", func(t *testing.T) {
		tok, err := cluster.TokenFor(ctx, "repair-without-delete", []rbacv1.PolicyRule{
			{APIGroups: []string{""}, Resources: []string{"pods"}, Verbs: []string{"get", "list", "watch"}},
			{APIGroups: []string{""}, Resources: []string{"events"}, Verbs: []string{"create", "patch"}},
			{APIGroups: []string{"apps"}, Resources: []string{"daemonsets"}, Verbs: []string{"get"}},
		})
		if err != nil {
			t.Fatal(err)
		}
		kc := filepath.Join(t.TempDir(), "restricted.kubeconfig")
		if err := testenv.WriteKubeconfig(kc, cluster.URL, cluster.CAFile, tok); err != nil {
			t.Fatal(err)
		}
		h := repairHost(t, "--repair-repair-pods=false", "--repair-delete-pods", "--kubeconfig", kc)
		h.waitReadyz(200, 20*time.Second)
		for _, name := range []string{"refused-1", "refused-2"} {
			if _, err := createPod(t, testenv.PodSpec{Namespace: testNS, Name: name, Sidecar: true}); err != nil {
				t.Fatal(err)
			}
			markValidation(t, name, "10.250.0.2", 126)
			ev := waitEvent(t, name, "DeleteBrokenPod")
			if !strings.Contains(ev.Message, "failed to delete") || !strings.Contains(ev.Message, "forbidden") {
				t.Fatalf("event does not say why: %q", ev.Message)
			}
		}
	})
}
