package testenv

import (
	"context"
	"fmt"
	"sort"
	"sync"
	"time"

	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/watch"
)

// PodStartTimes creates the pods at once and returns, for each, the time
// from its creation request to the moment a watch saw it Ready. The pods
// are deleted afterwards.
func PodStartTimes(ctx context.Context, c *Cluster, ns string, pods []*corev1.Pod, limit time.Duration) ([]time.Duration, error) {
	out, err := StartPods(ctx, c, ns, pods, limit)
	if err != nil {
		return nil, err
	}
	// A graceful delete: the API object stays until the kubelet has torn the
	// pod down, so the next round does not share the node with this one's
	// teardown.
	for _, p := range pods {
		_ = c.Client.CoreV1().Pods(ns).Delete(ctx, p.Name, metav1.DeleteOptions{})
	}
	gone := time.Now().Add(limit)
	for {
		list, err := c.Client.CoreV1().Pods(ns).List(ctx, metav1.ListOptions{})
		if err != nil {
			return nil, err
		}
		if len(list.Items) == 0 {
			break
		}
		if time.Now().After(gone) {
			return nil, fmt.Errorf("%d pods still there after deletion", len(list.Items))
		}
		time.Sleep(200 * time.Millisecond) // polling the API server, untimed
	}
	return out, nil
}

// StartPods creates the pods at once and returns, sorted, each one's time
// from its creation request to the moment a watch saw it Ready; the pods
// stay.
func StartPods(ctx context.Context, c *Cluster, ns string, pods []*corev1.Pod, limit time.Duration) ([]time.Duration, error) {
	ready, err := StartPodsByName(ctx, c, ns, pods, limit)
	if err != nil {
		return nil, err
	}
	out := make([]time.Duration, 0, len(ready))
	for _, d := range ready {
		out = append(out, d)
	}
	sort.Slice(out, func(i, j int) bool { return out[i] < out[j] })
	return out, nil
}

// StartPodsByName is StartPods with each time under its pod's name.
func StartPodsByName(ctx context.Context, c *Cluster, ns string, pods []*corev1.Pod, limit time.Duration) (map[string]time.Duration, error) {
	_, ready, err := StartPodsAt(ctx, c, ns, pods, limit)
	return ready, err
}

// StartPodsAt is StartPodsByName that also gives, by pod name, when its
// creation request was sent: on the host's clock, to set beside the times
// its runtime stamps.
func StartPodsAt(ctx context.Context, c *Cluster, ns string, pods []*corev1.Pod, limit time.Duration) (map[string]time.Time, map[string]time.Duration, error) {
	w, err := c.Client.CoreV1().Pods(ns).Watch(ctx, metav1.ListOptions{})
	if err != nil {
		return nil, nil, err
	}
	defer func() { w.Stop() }()
	var mu sync.Mutex
	created := map[string]time.Time{}
	var wg sync.WaitGroup
	errs := make(chan error, len(pods))
	for _, p := range pods {
		wg.Add(1)
		go func(p *corev1.Pod) {
			defer wg.Done()
			mu.Lock()
			created[p.Name] = time.Now()
			mu.Unlock()
			if _, err := c.Client.CoreV1().Pods(ns).Create(ctx, p, metav1.CreateOptions{}); err != nil {
				errs <- err
			}
		}(p)
	}
	wg.Wait()
	close(errs)
	if err := <-errs; err != nil {
		return nil, nil, err
	}
	ready := map[string]time.Duration{}
	note := func(p *corev1.Pod) {
		if _, done := ready[p.Name]; done {
			return
		}
		for _, cond := range p.Status.Conditions {
			if cond.Type == corev1.PodReady && cond.Status == corev1.ConditionTrue {
				mu.Lock()
				if t, ok := created[p.Name]; ok {
					ready[p.Name] = time.Since(t)
				}
				mu.Unlock()
			}
		}
	}
	deadline := time.After(limit)
	for len(ready) < len(pods) {
		select {
		case ev, ok := <-w.ResultChan():
			if !ok {
				// The server may end a watch; catch up with a list and
				// watch again.
				list, err := c.Client.CoreV1().Pods(ns).List(ctx, metav1.ListOptions{})
				if err != nil {
					return nil, nil, err
				}
				for i := range list.Items {
					note(&list.Items[i])
				}
				if w, err = c.Client.CoreV1().Pods(ns).Watch(ctx, metav1.ListOptions{ResourceVersion: list.ResourceVersion}); err != nil {
					return nil, nil, err
				}
				continue
			}
			if p, isPod := ev.Object.(*corev1.Pod); isPod && ev.Type != watch.Deleted {
				note(p)
			}
		case <-deadline:
			return nil, nil, fmt.Errorf("%d of %d pods Ready within %s", len(ready), len(pods), limit)
		}
	}
	return created, ready, nil
}

// DeletePods deletes the pods with a one-second grace period and waits
// until the kubelet has torn them down and the API server no longer lists
// them, so that the next measurement starts from the same node state.
func DeletePods(ctx context.Context, c *Cluster, ns string, pods []*corev1.Pod, limit time.Duration) error {
	grace := int64(1)
	names := map[string]bool{}
	for _, p := range pods {
		names[p.Name] = true
		err := c.Client.CoreV1().Pods(ns).Delete(ctx, p.Name, metav1.DeleteOptions{GracePeriodSeconds: &grace})
		if err != nil && !apierrors.IsNotFound(err) {
			return err
		}
	}
	deadline := time.Now().Add(limit)
	for {
		list, err := c.Client.CoreV1().Pods(ns).List(ctx, metav1.ListOptions{})
		if err != nil {
			return err
		}
		left := 0
		for i := range list.Items {
			if names[list.Items[i].Name] {
				left++
			}
		}
		if left == 0 {
			return nil
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("%d pods still there %s after deletion", left, limit)
		}
		time.Sleep(200 * time.Millisecond) // polling the API server, untimed
	}
}
