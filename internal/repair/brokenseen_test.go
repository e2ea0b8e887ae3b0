package repair

import (
	"context"
	"errors"
	"io"
	"log/slog"
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
