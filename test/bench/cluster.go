package main

import (
	"cmp"
	"context"
	"fmt"
	"os"
	"sort"
	"time"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/istio-cni-go/istio-cni/internal/testenv"
)

// runCluster measures pod start-up at the cluster level on a real
// kubelet+containerd node: 30 sidecar-shaped pods created at once, time
// from creation to Ready, without and then with the plugin in the chain
// (installed by the chart with the project's image).
func runCluster(n int) error {
	ctx := context.Background()
	dir, err := os.MkdirTemp("", "istio-cni-bench-cluster-")
	if err != nil {
		return err
	}
	defer os.RemoveAll(dir)
	one, err := testenv.StartOneNode(ctx, dir)
	if err != nil {
		return err
	}
	defer one.Stop()
	cluster, node := one.Cluster, one.Node
	if err := one.LoadAgentImage(dir); err != nil {
		return err
	}
	for _, ns := range []string{"istio-system", "bench"} {
		if err := testenv.EnsureNamespace(ctx, cluster.Client, ns); err != nil {
			return err
		}
	}
	pods := func(round string) []*corev1.Pod {
		never := corev1.PullNever
		f := false
		uid := int64(1337)
		var out []*corev1.Pod
		for i := 0; i < n; i++ {
			out = append(out, &corev1.Pod{
				ObjectMeta: metav1.ObjectMeta{Name: fmt.Sprintf("%s-%d", round, i),
					Annotations: map[string]string{"sidecar.istio.io/status": testenv.InjectedStatus}},
				Spec: corev1.PodSpec{NodeName: testenv.NodeName, AutomountServiceAccountToken: &f,
					Containers: []corev1.Container{
						{Name: "app", Image: testenv.AppImage, ImagePullPolicy: never, Args: []string{"serve", ":8080"}},
						{Name: "istio-proxy", Image: testenv.AppImage, ImagePullPolicy: never, Args: []string{"proxy", "sidecar", ":15001", ":15006"},
							SecurityContext: &corev1.SecurityContext{RunAsUser: &uid, RunAsGroup: &uid}},
					}},
			})
		}
		return out
	}
	// Each round's pods are deleted before the next round, so every round
	// starts on the same node state.
	measure := func(round string) ([]time.Duration, error) {
		ps := pods(round)
		d, err := testenv.PodStartTimes(ctx, cluster, "bench", ps, 3*time.Minute)
		if err != nil {
			return nil, err
		}
		return d, testenv.DeletePods(ctx, cluster, "bench", ps, 3*time.Minute)
	}
	// A warm-up round: images unpacked, caches filled.
	if _, err := measure("warm"); err != nil {
		return err
	}
	// Rounds alternate, without and with the plugin, so that effects of
	// order (caches, state the node accumulates) fall on both sides.
	var without, with []time.Duration
	for round := 0; round < *clusterRounds; round++ {
		d, err := measure(fmt.Sprintf("without%d", round))
		if err != nil {
			return err
		}
		without = append(without, d...)
		values := testenv.NodeChartValues(cluster, node, false)
		if *agentCPU != "" {
			values["resources"] = map[string]any{"requests": map[string]any{"cpu": *agentCPU, "memory": "100Mi"}}
		}
		rel, err := testenv.InstallChart(cluster, values)
		if err != nil {
			return err
		}
		if err := waitAgentPodReady(ctx, cluster); err != nil {
			return err
		}
		d, err = measure(fmt.Sprintf("with%d", round))
		if err != nil {
			return err
		}
		with = append(with, d...)
		if err := rel.Uninstall(); err != nil {
			return err
		}
		if err := waitAgentPodGone(ctx, cluster); err != nil {
			return err
		}
	}
	sort.Slice(without, func(i, j int) bool { return without[i] < without[j] })
	sort.Slice(with, func(i, j int) bool { return with[i] < with[j] })
	fmt.Printf("%d sidecar pods created at once on one kubelet+containerd node, creation to Ready (%d alternating rounds each, agent CPU request %s):\n", n, *clusterRounds, cmp.Or(*agentCPU, "100m (chart default)"))
	fmt.Printf("  without istio-cni: p50 %s  p99 %s  last %s\n", ms(pct(without, .5)), ms(pct(without, .99)), ms(without[len(without)-1]))
	fmt.Printf("  with istio-cni:    p50 %s  p99 %s  last %s\n", ms(pct(with, .5)), ms(pct(with, .99)), ms(with[len(with)-1]))
	fmt.Printf("  added by the plugin: p50 %+.1f%%, last pod %+.1f%% (goal < 5%%)\n",
		100*(float64(pct(with, .5))/float64(pct(without, .5))-1), 100*(float64(with[len(with)-1])/float64(without[len(without)-1])-1))
	return nil
}

func waitAgentPodGone(ctx context.Context, c *testenv.Cluster) error {
	deadline := time.Now().Add(2 * time.Minute)
	for time.Now().Before(deadline) {
		pods, err := c.Client.CoreV1().Pods("istio-system").List(ctx, metav1.ListOptions{LabelSelector: "k8s-app=istio-cni-node"})
		if err == nil && len(pods.Items) == 0 {
			return nil
		}
		time.Sleep(200 * time.Millisecond) // polling the API server, untimed
	}
	return fmt.Errorf("agent pod still there 2m after uninstall")
}

func waitAgentPodReady(ctx context.Context, c *testenv.Cluster) error {
	deadline := time.Now().Add(2 * time.Minute)
	for time.Now().Before(deadline) {
		pods, err := c.Client.CoreV1().Pods("istio-system").List(ctx, metav1.ListOptions{LabelSelector: "k8s-app=istio-cni-node"})
		if err == nil && len(pods.Items) == 1 {
			for _, cond := range pods.Items[0].Status.Conditions {
				if cond.Type == corev1.PodReady && cond.Status == corev1.ConditionTrue {
					return nil
				}
			}
		}
		time.Sleep(200 * time.Millisecond) // polling the API server, untimed
	}
	return fmt.Errorf("agent pod not Ready within 2m")
}
