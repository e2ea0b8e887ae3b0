package repair

import (
	"io"
	"log/slog"
	"net/netip"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes/fake"

	"github.com/istio-cni-go/istio-cni/internal/kubeclient/clientset"
	"github.com/istio-cni-go/istio-cni/internal/podnet"
	"github.com/istio-cni-go/istio-cni/internal/ruleset"
)

// countingRules counts the rules written.
type countingRules struct{ applied int }

func (r *countingRules) Apply(string, *ruleset.Plan) (podnet.Report, error) {
	r.applied++
	return podnet.Report{}, nil
}
func (*countingRules) Check(string, *ruleset.Plan) error     { return nil }
func (*countingRules) PodAddrs(string) ([]netip.Addr, error) { return nil, nil }

// TestRepairSkipsHostNetworkPods: a pod on the node's network, whose
// validation always fails (the plugin never runs for it), is never
// repaired in place: its processes' namespace is the node's, which holds
// its IP, and rules written there would redirect the node's traffic.
func TestRepairSkipsHostNetworkPods(t *testing.T) {
	rules := &countingRules{}
	c := New(DefaultConfig(), clientset.Of(fake.NewClientset()), rules, "/proc", NewMetric(), slog.New(slog.NewTextHandler(io.Discard, nil)))
	pod := &corev1.Pod{ObjectMeta: metav1.ObjectMeta{Namespace: "ns", Name: "h", UID: "u-h",
		Annotations: map[string]string{"sidecar.istio.io/status": "{}"}},
		Spec:   corev1.PodSpec{HostNetwork: true, Containers: []corev1.Container{{Name: "app"}, {Name: "istio-proxy"}}},
		Status: corev1.PodStatus{PodIP: "127.0.0.1", PodIPs: []corev1.PodIP{{IP: "127.0.0.1"}}}}
	if err := c.repair(pod, "validation failed"); err != nil {
		t.Fatalf("repair of a host-network pod: %v, want it skipped", err)
	}
	if rules.applied != 0 {
		t.Fatalf("rules written %d times for a pod on the node's network", rules.applied)
	}
}

// TestRepairSkipsEndedPods: a pod that does not restart (restartPolicy
// Never) and failed its validation has no sandbox left to repair; it is
// skipped, not searched for in /proc at every agent start.
func TestRepairSkipsEndedPods(t *testing.T) {
	rules := &countingRules{}
	c := New(DefaultConfig(), clientset.Of(fake.NewClientset()), rules, "/nonexistent", NewMetric(), slog.New(slog.NewTextHandler(io.Discard, nil)))
	for _, phase := range []corev1.PodPhase{corev1.PodFailed, corev1.PodSucceeded} {
		pod := &corev1.Pod{ObjectMeta: metav1.ObjectMeta{Namespace: "ns", Name: "job", UID: "u-job",
			Annotations: map[string]string{"sidecar.istio.io/status": "{}"}},
			Spec:   corev1.PodSpec{Containers: []corev1.Container{{Name: "app"}, {Name: "istio-proxy"}}},
			Status: corev1.PodStatus{Phase: phase, PodIP: "10.1.2.3", PodIPs: []corev1.PodIP{{IP: "10.1.2.3"}}}}
		if err := c.repair(pod, "validation failed"); err != nil {
			t.Fatalf("repair of a pod %s: %v, want it skipped", phase, err)
		}
	}
	if rules.applied != 0 {
		t.Fatalf("rules written %d times for ended pods", rules.applied)
	}
}

// TestLastFailure: the validation container's latest failed end, from its
// current or its last state; a success or another container does not
// count.
func TestLastFailure(t *testing.T) {
	c := New(DefaultConfig(), clientset.Of(fake.NewClientset()), &countingRules{}, "/proc", NewMetric(), slog.New(slog.NewTextHandler(io.Discard, nil)))
	at := func(minute int) metav1.Time {
		return metav1.NewTime(time.Date(2026, 11, 29, 10, minute, 0, 0, time.UTC))
	}
	pod := &corev1.Pod{Status: corev1.PodStatus{InitContainerStatuses: []corev1.ContainerStatus{
		{Name: "other", State: corev1.ContainerState{Terminated: &corev1.ContainerStateTerminated{ExitCode: 1, FinishedAt: at(50)}}},
		{Name: "istio-validation",
			State:                corev1.ContainerState{Terminated: &corev1.ContainerStateTerminated{ExitCode: 0, FinishedAt: at(40)}},
			LastTerminationState: corev1.ContainerState{Terminated: &corev1.ContainerStateTerminated{ExitCode: 126, FinishedAt: at(30)}}},
	}}}
	if got := c.lastFailure(pod); !got.Equal(at(30).Time) {
		t.Fatalf("last failure %v, want %v", got, at(30))
	}
	if got := c.lastFailure(&corev1.Pod{}); !got.IsZero() {
		t.Fatalf("no statuses: %v", got)
	}
}
