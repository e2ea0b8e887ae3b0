package main

import (
	"context"
	"fmt"
	"sort"
	"time"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/istio-cni-go/istio-cni/internal/testenv"
)

// clusterResult is the cluster series' creation-to-Ready times, each side
// sorted.
type clusterResult struct {
	without, with []time.Duration
}

// clusterStartup measures pod start-up at the cluster level on a real
// kubelet+containerd node: cfg.clusterPods sidecar pods created at once,
// time from creation to Ready, without and then with the plugin in the
// chain (installed by the chart with the project's image).
func clusterStartup(ctx context.Context, cfg config) (clusterResult, error) {
	one, err := testenv.StartOneNodeIn(ctx, "istio-cni-bench-cluster-",
		testenv.NodeSetup{AgentImage: true, Namespaces: []string{"istio-system", "bench"}})
	if err != nil {
		return clusterResult{}, err
	}
	defer one.Stop()
	cluster, node := one.Cluster, one.Node
	// Each round's pods are deleted before the next round, so every round
	// starts on the same node state.
	measure := func(round string) ([]time.Duration, error) {
		ps := sidecarPods(round, cfg.clusterPods)
		d, err := testenv.PodStartTimes(ctx, cluster, "bench", ps, 3*time.Minute)
		if err != nil {
			return nil, err
		}
		return d, testenv.DeletePods(ctx, cluster, "bench", ps, 3*time.Minute)
	}
	// A warm-up round: images unpacked, caches filled.
	if _, err := measure("warm"); err != nil {
		return clusterResult{}, err
	}
	// Rounds alternate, without and with the plugin, so that effects of
	// order (caches, state the node accumulates) fall on both sides.
	var res clusterResult
	for round := 0; round < cfg.clusterRounds; round++ {
		d, err := measure(fmt.Sprintf("without%d", round))
		if err != nil {
			return clusterResult{}, err
		}
		res.without = append(res.without, d...)
		values := testenv.NodeChartValues(cluster, node, false)
		if cfg.clusterAgentCPU != "" {
			values["resources"] = map[string]any{"requests": map[string]any{"cpu": cfg.clusterAgentCPU, "memory": "100Mi"}}
		}
		rel, err := testenv.InstallChart(cluster, values)
		if err != nil {
			return clusterResult{}, err
		}
		if err := waitAgentPodReady(ctx, cluster); err != nil {
			return clusterResult{}, err
		}
		d, err = measure(fmt.Sprintf("with%d", round))
		if err != nil {
			return clusterResult{}, err
		}
		res.with = append(res.with, d...)
		if err := rel.Uninstall(); err != nil {
			return clusterResult{}, err
		}
		if err := waitAgentPodGone(ctx, cluster); err != nil {
			return clusterResult{}, err
		}
	}
	sort.Slice(res.without, func(i, j int) bool { return res.without[i] < res.without[j] })
	sort.Slice(res.with, func(i, j int) bool { return res.with[i] < res.with[j] })
	return res, nil
}

// sidecarPods are n pods shaped as Istio's injector shapes a sidecar pod,
// named after the round.
func sidecarPods(round string, n int) []*corev1.Pod {
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
