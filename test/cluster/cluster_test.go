// Package cluster runs the product on a real single-node cluster: etcd,
// kube-apiserver, containerd with runc and a kubelet, in a private network
// and mount namespace.
package cluster

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/istio-cni-go/istio-cni/internal/testenv"
)

var (
	cluster *testenv.Cluster
	node    *testenv.KubeNode
	workDir string
	oneNode *testenv.OneNode
)

func TestMain(m *testing.M) {
	testenv.EnterNodeNamespace()
	os.Exit(run(m))
}

func run(m *testing.M) int {
	ctx := context.Background()
	start := time.Now()
	one, err := testenv.StartOneNodeIn(ctx, "istio-cni-cluster-", testenv.NodeSetup{})
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 2
	}
	defer one.Stop()
	cluster, node, workDir = one.Cluster, one.Node, one.Dir
	oneNode = one
	fmt.Fprintf(os.Stderr, "node Ready after %s\n", time.Since(start).Round(time.Millisecond))
	return m.Run()
}

// TestPodRuns: the kubelet starts a pod through containerd and the CNI
// chain, and it gets the chain's IP.
func TestPodRuns(t *testing.T) {
	ctx := context.Background()
	if err := testenv.EnsureNamespace(ctx, cluster.Client, "plain"); err != nil {
		t.Fatal(err)
	}
	pod := servingPod("plain", "server")
	if _, err := cluster.Client.CoreV1().Pods("plain").Create(ctx, pod, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	deadline := time.Now().Add(60 * time.Second)
	for {
		p, err := cluster.Client.CoreV1().Pods("plain").Get(ctx, "server", metav1.GetOptions{})
		if err == nil && p.Status.Phase == corev1.PodRunning && p.Status.PodIP != "" {
			t.Logf("pod running with IP %s", p.Status.PodIP)
			checkPodCgroups(t, p)
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("pod not running: %+v", p.Status)
		}
		time.Sleep(200 * time.Millisecond) // polling the API server, bounded
	}
}

// servingPod is a plain pod on the test node whose one container
// serves TCP on :8080, from the image already on the node.
func servingPod(ns, name string) *corev1.Pod {
	f := false
	return &corev1.Pod{
		ObjectMeta: metav1.ObjectMeta{Namespace: ns, Name: name},
		Spec: corev1.PodSpec{NodeName: testenv.NodeName, AutomountServiceAccountToken: &f,
			Containers: []corev1.Container{{Name: "app", Image: testenv.AppImage, ImagePullPolicy: corev1.PullNever, Args: []string{"serve", ":8080"}}}},
	}
}

// checkPodCgroups asserts the node's cgroup layout is a real node's: the
// pod (no requests: BestEffort) in the kubelet's QoS tree with its UID in
// the path, its processes there, and the runtime in a cgroup of its own.
func checkPodCgroups(t *testing.T, p *corev1.Pod) {
	t.Helper()
	checkNodeCgroups(t)
	cg, err := node.Cgroups.PodCgroup(string(p.UID))
	if err != nil {
		t.Fatal(err)
	}
	if filepath.Base(filepath.Dir(cg)) != "besteffort" {
		t.Errorf("a pod without requests is BestEffort; its cgroup is %s", cg)
	}
	var procs []string
	_ = filepath.WalkDir(cg, func(path string, d os.DirEntry, err error) error {
		if err == nil && d.Name() == "cgroup.procs" {
			b, _ := os.ReadFile(path)
			procs = append(procs, strings.Fields(string(b))...)
		}
		return nil
	})
	if len(procs) < 2 {
		t.Fatalf("pod cgroup %s holds processes %v; want the sandbox's and the app's", cg, procs)
	}
	self, _ := os.ReadFile("/proc/" + procs[0] + "/cgroup")
	if !strings.Contains(string(self), "/kubepods/besteffort/pod"+string(p.UID)+"/") {
		t.Errorf("process %s of the pod is not in its pod cgroup:\n%s", procs[0], self)
	}
}

// checkNodeCgroups asserts the node's own layout, as a node's systemd
// slices are: the runtime and the kubelet in a cgroup of their own beside
// the pods', at the weight a system slice has (1024); the pods' cgroup
// weighted by the node's CPU capacity (1024 a core), as the kubelet sets
// it, so that under contention the pods together get what their CPUs
// weigh against the runtime; BestEffort at the least weight (2).
func checkNodeCgroups(t *testing.T) {
	t.Helper()
	runtime, err := node.Cgroups.CPUDir("runtime")
	if err != nil {
		t.Fatal(err)
	}
	for _, pid := range node.RuntimePIDs() {
		cg, err := testenv.CPUCgroupOf(pid)
		if err != nil {
			t.Fatal(err)
		}
		if !strings.HasSuffix(runtime, cg) {
			t.Errorf("node process %d is in %s, not in the runtime's cgroup %s", pid, cg, runtime)
		}
	}
	n, err := cluster.Client.CoreV1().Nodes().Get(context.Background(), testenv.NodeName, metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	capacity := n.Status.Capacity.Cpu().MilliValue() * 1024 / 1000
	for rel, want := range map[string]int64{"runtime": 1024, "kubepods": capacity, "kubepods/besteffort": 2} {
		dir, err := node.Cgroups.CPUDir(rel)
		if err != nil {
			t.Fatal(err)
		}
		b, err := os.ReadFile(filepath.Join(dir, "cpu.shares"))
		if err != nil || strings.TrimSpace(string(b)) != fmt.Sprint(want) {
			t.Errorf("%s cpu.shares %q (%v), want %d", rel, b, err, want)
		}
	}
}

// TestRuntimeTimes checks the runtime's stamps the bench reads beside
// Ready: each step after the one before, all between the creation request
// and the watch seeing the pod Ready, for each of two pods (one of two
// containers).
func TestRuntimeTimes(t *testing.T) {
	ctx := context.Background()
	if err := testenv.EnsureNamespace(ctx, cluster.Client, "stamps"); err != nil {
		t.Fatal(err)
	}
	two := servingPod("stamps", "two")
	two.Spec.Containers = append(two.Spec.Containers, corev1.Container{Name: "second", Image: testenv.AppImage,
		ImagePullPolicy: corev1.PullNever, Args: []string{"serve", ":8081"}})
	ps := []*corev1.Pod{servingPod("stamps", "one"), two}
	created, ready, err := testenv.StartPodsAt(ctx, cluster, "stamps", ps, time.Minute)
	if err != nil {
		t.Fatal(err)
	}
	seen := time.Now()
	defer func() {
		if err := testenv.DeletePods(ctx, cluster, "stamps", ps, time.Minute); err != nil {
			t.Error(err)
		}
	}()
	times, err := node.RuntimeTimes(ctx, "stamps")
	if err != nil {
		t.Fatal(err)
	}
	if len(times) != 2 {
		t.Fatalf("runtime times for %d pods, want 2: %v", len(times), times)
	}
	for _, p := range ps {
		rt, ok := times[p.Name]
		if !ok {
			t.Fatalf("no runtime times for %s: %v", p.Name, times)
		}
		c := created[p.Name]
		readyAt := c.Add(ready[p.Name])
		steps := []struct {
			name string
			at   time.Time
		}{{"created", c}, {"sandbox begun", rt.SandboxCreated}, {"containers created", rt.ContainersCreated},
			{"started", rt.Started}, {"seen Ready", readyAt}, {"listed", seen}}
		for i := 1; i < len(steps); i++ {
			if steps[i].at.Before(steps[i-1].at) {
				t.Errorf("%s: %s at %s, before %s at %s", p.Name, steps[i].name, steps[i].at.Format(time.RFC3339Nano),
					steps[i-1].name, steps[i-1].at.Format(time.RFC3339Nano))
			}
		}
		t.Logf("%s: sandbox set-up %s, created to started %s, to Ready %s", p.Name,
			rt.ContainersCreated.Sub(rt.SandboxCreated), rt.Started.Sub(c), ready[p.Name])
	}
}

// TestRemoveStoppedSandboxes: a deleted pod's sandbox stays, stopped,
// until the kubelet's minute-periodic GC removes it (with one more CNI DEL
// down the chain); RemoveStoppedSandboxes, which the bench runs between
// bursts so that no burst pays for that GC, removes it at once.
func TestRemoveStoppedSandboxes(t *testing.T) {
	ctx := context.Background()
	if err := testenv.EnsureNamespace(ctx, cluster.Client, "plain"); err != nil {
		t.Fatal(err)
	}
	// The kubelet's own GC may get there between the deletion and the
	// look, once a minute: then again with another pod.
	for attempt := range 3 {
		pod := servingPod("plain", fmt.Sprintf("gc-%d", attempt))
		ps := []*corev1.Pod{pod}
		if _, err := testenv.StartPods(ctx, cluster, "plain", ps, time.Minute); err != nil {
			t.Fatal(err)
		}
		if err := testenv.DeletePods(ctx, cluster, "plain", ps, time.Minute); err != nil {
			t.Fatal(err)
		}
		stopped, err := node.StoppedSandboxes(ctx)
		if err != nil {
			t.Fatal(err)
		}
		if !slices.Contains(stopped, "plain/"+pod.Name) {
			t.Logf("the sandbox of %s is not among the stopped ones %v: the kubelet's GC came first", pod.Name, stopped)
			continue
		}
		n, err := node.RemoveStoppedSandboxes(ctx)
		if err != nil {
			t.Fatal(err)
		}
		if n < 1 {
			t.Fatalf("removed %d sandboxes, want at least %s's", n, pod.Name)
		}
		if left, err := node.StoppedSandboxes(ctx); err != nil || len(left) != 0 {
			t.Fatalf("stopped sandboxes after the removal: %v (%v)", left, err)
		}
		return
	}
	t.Fatal("the kubelet's GC removed the sandbox before the test looked, three times")
}
