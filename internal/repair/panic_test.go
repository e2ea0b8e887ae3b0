package repair_test

import (
	"context"
	"log/slog"
	"net/netip"
	"strings"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	promtest "github.com/prometheus/client_golang/prometheus/testutil"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/kubernetes/fake"
	k8stesting "k8s.io/client-go/testing"

	"github.com/istio-cni-go/istio-cni/internal/kubeclient/clientset"
	"github.com/istio-cni-go/istio-cni/internal/podnet"
	"github.com/istio-cni-go/istio-cni/internal/repair"
	"github.com/istio-cni-go/istio-cni/internal/ruleset"
	"github.com/istio-cni-go/istio-cni/internal/sockserve/sockservetest"
)

// panickyRules panics for one pod's namespace path, as a bug would.
type panickyRules struct{}

func (panickyRules) Apply(string, *ruleset.Plan) (podnet.Report, error) {
	return podnet.Report{}, nil
}
func (panickyRules) Check(string, *ruleset.Plan) error { return nil }
func (panickyRules) PodAddrs(string) ([]netip.Addr, error) {
	panic("a bug in the rule backend")
}

// TestRepairPanicFailsOnlyThatPod: a pod whose handling panics is logged,
// counted and skipped; the controller goes on to the next broken pod.
func TestRepairPanicFailsOnlyThatPod(t *testing.T) {
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	broken := func(name string) *corev1.Pod {
		return &corev1.Pod{ObjectMeta: metav1.ObjectMeta{Namespace: "ns", Name: name, UID: types.UID("uid-" + name),
			Annotations: map[string]string{"sidecar.istio.io/status": "{}"}},
			Spec: corev1.PodSpec{NodeName: "n"},
			Status: corev1.PodStatus{InitContainerStatuses: []corev1.ContainerStatus{{Name: "istio-validation",
				State: corev1.ContainerState{Terminated: &corev1.ContainerStateTerminated{ExitCode: 126}}}}}}
	}
	cs := fake.NewClientset(broken("first"), broken("second"))
	patched := make(chan string, 4)
	cs.PrependReactor("patch", "pods", func(a k8stesting.Action) (bool, runtime.Object, error) {
		name := a.(k8stesting.PatchAction).GetName()
		if name == "first" {
			panic("a bug while labelling")
		}
		patched <- name
		return true, broken(name), nil
	})
	cfg := repair.DefaultConfig()
	cfg.RepairPods, cfg.LabelPods = false, true
	var logs sockservetest.Buffer
	log := slog.New(slog.NewJSONHandler(&logs, nil))
	counter := repair.NewMetric()
	panics := prometheus.NewCounterVec(prometheus.CounterOpts{Name: "panics_total"}, []string{"component"})
	c := repair.New(cfg, clientset.Of(cs), panickyRules{}, "/proc", counter, log)
	c.Panics = panics.WithLabelValues("repair")
	stopped := make(chan struct{})
	go func() {
		defer close(stopped)
		_ = c.Run(ctx, "n")
	}()
	defer func() { cancel(); <-stopped }()
	select {
	case name := <-patched:
		if name != "second" {
			t.Fatalf("patched %s", name)
		}
	case <-time.After(20 * time.Second):
		t.Fatalf("the controller stopped after a panic:\n%s", logs.String())
	}
	// The pods are listed in no set order: "first" may be the later, its
	// panic counted and then logged while "second" is already patched.
	deadline := time.Now().Add(10 * time.Second)
	for !strings.Contains(logs.String(), `"pod":"ns/first"`) {
		if time.Now().After(deadline) {
			t.Fatalf("the panic is not logged with its pod:\n%s", logs.String())
		}
		time.Sleep(5 * time.Millisecond) // the line is written by the controller's goroutine
	}
	// Counted before it is logged.
	if got := promtest.ToFloat64(panics.WithLabelValues("repair")); got < 1 {
		t.Fatalf("panics counted %v, want the one logged", got)
	}
}
