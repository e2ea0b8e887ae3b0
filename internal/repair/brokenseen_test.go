package repair

import (
	"context"
	"errors"
	"io"
	"log/slog"
	"strings"
	"testing"

	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/runtime/schema"
	k8stypes "k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/kubernetes/fake"

	"github.com/istio-cni-go/istio-cni/internal/kubeclient/clientset"
	k8stesting "k8s.io/client-go/testing"
)

// TestBrokenSeenForgetsPodsNeverRepaired: the first-seen-broken times of
// pods that are never fixed (gone, fine again, given up on) do not stay.
func TestBrokenSeenForgetsPodsNeverRepaired(t *testing.T) {
	cs := fake.NewClientset()
	cs.PrependReactor("patch", "pods", func(k8stesting.Action) (bool, runtime.Object, error) {
		return true, nil, errors.New("refused")
	})
	cfg := DefaultConfig()
	cfg.RepairPods, cfg.LabelPods = false, true
	c := New(cfg, clientset.Of(cs), nil, "/proc", NewMetric(), slog.New(slog.NewTextHandler(io.Discard, nil)))
	pods := map[string]*corev1.Pod{}
	c.lister = func(ns, name string) (*corev1.Pod, error) {
		if p, ok := pods[name]; ok {
			return p, nil
		}
		return nil, apierrors.NewNotFound(schema.GroupResource{Resource: "pods"}, name)
	}
	broken := func(name string, exit int32) *corev1.Pod {
		return &corev1.Pod{ObjectMeta: metav1.ObjectMeta{Namespace: "ns", Name: name, UID: k8stypes.UID("u-" + name),
			Annotations: map[string]string{"sidecar.istio.io/status": "{}"}},
			Status: corev1.PodStatus{InitContainerStatuses: []corev1.ContainerStatus{{Name: "istio-validation",
				State: corev1.ContainerState{Terminated: &corev1.ContainerStateTerminated{ExitCode: exit}}}}}}
	}
	ctx := context.Background()
	for _, name := range []string{"gone", "healed"} {
		pods[name] = broken(name, 126)
		if err := c.reconcile(ctx, k8stypes.NamespacedName{Namespace: "ns", Name: name}); err == nil {
			t.Fatalf("%s: the label was refused, reconcile should fail", name)
		}
	}
	if n := len(c.brokenSeen); n != 2 {
		t.Fatalf("%d pods recorded as broken, want 2", n)
	}
	delete(pods, "gone")
	pods["healed"] = broken("healed", 0)
	for _, name := range []string{"gone", "healed"} {
		if err := c.reconcile(ctx, k8stypes.NamespacedName{Namespace: "ns", Name: name}); err != nil {
			t.Fatal(err)
		}
	}
	if n := len(c.brokenSeen); n != 0 {
		t.Fatalf("%d pods still recorded as broken after they went away or healed: %v", n, c.brokenSeen)
	}
}

// TestEndedPodsAreLeftInEveryMode: a pod that ended with its failed
// validation (restartPolicy Never) is neither repaired, deleted nor
// labelled: it has no sandbox left, and deleting it would only lose its
// status and logs. A pod still waiting to restart is acted on.
func TestEndedPodsAreLeftInEveryMode(t *testing.T) {
	for _, mode := range []string{"repair", "delete", "label"} {
		t.Run(mode, func(t *testing.T) {
			cs := fake.NewClientset()
			var acted []string
			cs.PrependReactor("*", "pods", func(a k8stesting.Action) (bool, runtime.Object, error) {
				if a.GetVerb() == "delete" || a.GetVerb() == "patch" {
					acted = append(acted, a.GetVerb())
					return true, nil, nil
				}
				return false, nil, nil
			})
			cfg := DefaultConfig()
			cfg.RepairPods, cfg.DeletePods, cfg.LabelPods = mode == "repair", mode == "delete", mode == "label"
			rules := &countingRules{}
			c := New(cfg, clientset.Of(cs), rules, "/nonexistent", NewMetric(), slog.New(slog.NewTextHandler(io.Discard, nil)))
			var pod *corev1.Pod
			c.lister = func(string, string) (*corev1.Pod, error) { return pod, nil }
			for _, phase := range []corev1.PodPhase{corev1.PodFailed, corev1.PodSucceeded, corev1.PodPending} {
				pod = &corev1.Pod{ObjectMeta: metav1.ObjectMeta{Namespace: "ns", Name: "job", UID: "u-job", ResourceVersion: "1",
					Annotations: map[string]string{"sidecar.istio.io/status": "{}"}},
					Spec: corev1.PodSpec{Containers: []corev1.Container{{Name: "app"}, {Name: "istio-proxy"}}},
					Status: corev1.PodStatus{Phase: phase, InitContainerStatuses: []corev1.ContainerStatus{{Name: "istio-validation",
						State: corev1.ContainerState{Terminated: &corev1.ContainerStateTerminated{ExitCode: 126}}}}}}
				err := c.reconcile(context.Background(), k8stypes.NamespacedName{Namespace: "ns", Name: "job"})
				ended := phase != corev1.PodPending
				switch {
				case ended && (err != nil || len(acted) != 0 || rules.applied != 0):
					t.Fatalf("%s pod: %v, acted %v, rules written %d; want it left alone", phase, err, acted, rules.applied)
				case !ended && mode != "repair" && len(acted) != 1:
					t.Fatalf("pending pod: %v, acted %v; want it %sd", err, acted, mode)
				case !ended && mode == "repair" && (err == nil || !strings.Contains(err.Error(), "no IP")):
					// Repair got as far as looking for its namespace.
					t.Fatalf("pending pod: %v; want repair to look for it", err)
				}
			}
		})
	}
}

// TestRepairedForgottenOnceFine: a pod repaired once and fine again is
// repaired anew when a later sandbox of it races the plugin (its pause
// container restarted); the controller's memory of the repair goes once
// its validation passes.
func TestRepairedForgottenOnceFine(t *testing.T) {
	c := New(DefaultConfig(), clientset.Of(fake.NewClientset()), &countingRules{}, "/nonexistent", NewMetric(), slog.New(slog.NewTextHandler(io.Discard, nil)))
	key := k8stypes.NamespacedName{Namespace: "ns", Name: "web"}
	pod := &corev1.Pod{ObjectMeta: metav1.ObjectMeta{Namespace: "ns", Name: "web", UID: "u-web",
		Annotations: map[string]string{"sidecar.istio.io/status": "{}"}},
		Status: corev1.PodStatus{InitContainerStatuses: []corev1.ContainerStatus{{Name: "istio-validation",
			State: corev1.ContainerState{Terminated: &corev1.ContainerStateTerminated{ExitCode: 0}}}}}}
	c.lister = func(string, string) (*corev1.Pod, error) { return pod, nil }
	c.repaired[key] = pod.UID
	if err := c.reconcile(context.Background(), key); err != nil {
		t.Fatal(err)
	}
	if _, ok := c.repaired[key]; ok {
		t.Fatal("a pod fine again is still remembered as repaired: a later race of it would be ignored")
	}
}
