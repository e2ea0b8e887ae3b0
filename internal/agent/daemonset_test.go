package agent

import (
	"context"
	"io"
	"log/slog"
	"testing"
	"time"

	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/runtime/schema"
	"k8s.io/apimachinery/pkg/watch"
	"k8s.io/client-go/kubernetes/fake"
	k8stesting "k8s.io/client-go/testing"

	"github.com/istio-cni-go/istio-cni/internal/kubeclient/clientset"
)

// TestDaemonSetRefusedReadWaitsForTheWatch: at termination a refused read
// of the DaemonSet (helm uninstall took the agent's RBAC and service
// account with it) counts as an uninstall when the watch reports the
// DaemonSet deleted shortly after, and as "cannot tell" when it does not.
func TestDaemonSetRefusedReadWaitsForTheWatch(t *testing.T) {
	for _, deleted := range []bool{true, false} {
		ds := &appsv1.DaemonSet{ObjectMeta: metav1.ObjectMeta{Namespace: "istio-system", Name: "istio-cni-node"}}
		cs := fake.NewClientset(ds)
		fw := watch.NewFake()
		cs.PrependWatchReactor("daemonsets", k8stesting.DefaultWatchReactor(fw, nil))
		ctx, cancel := context.WithCancel(context.Background())
		d := watchDaemonSet(ctx, clientset.Of(cs), "istio-system", "istio-cni-node", "node-a", slog.New(slog.NewTextHandler(io.Discard, nil)))
		// The watch is up once it has sent its first event through.
		fw.Add(ds)
		// From now on every read is refused, as after the uninstall.
		cs.PrependReactor("get", "daemonsets", func(k8stesting.Action) (bool, runtime.Object, error) {
			return true, nil, apierrors.NewUnauthorized("the token's service account is gone")
		})
		if deleted {
			// The event comes after the refused read, while it waits.
			go func() { time.Sleep(100 * time.Millisecond); fw.Delete(ds) }() // the event's lateness, not a synchronisation
		}
		qctx, qcancel := context.WithTimeout(context.Background(), 10*time.Second)
		if !deleted {
			qcancel()
			qctx, qcancel = context.WithTimeout(context.Background(), 500*time.Millisecond)
		}
		present, err := d.present(qctx)
		qcancel()
		switch {
		case deleted && (present || err != nil):
			t.Errorf("deleted after the refused read: present %v, error %v; want an uninstall", present, err)
		case !deleted && err == nil:
			t.Errorf("never seen deleted: present %v with no error; want cannot tell", present)
		}
		cancel()
		<-d.done
	}
}

// TestDaemonSetNeverReadableRemovesPlugin: with Istio's RBAC in sidecar
// mode the DaemonSet can never be read nor watched; termination then
// removes the plugin, as Istio's agent does. Kept (as "cannot tell"), it
// stayed after helm uninstall and failed every later pod with the deleted
// service account's credentials.
func TestDaemonSetNeverReadableRemovesPlugin(t *testing.T) {
	cs := fake.NewClientset()
	forbid := apierrors.NewForbidden(schema.GroupResource{Group: "apps", Resource: "daemonsets"}, "istio-cni-node", nil)
	cs.PrependReactor("get", "daemonsets", func(k8stesting.Action) (bool, runtime.Object, error) { return true, nil, forbid })
	cs.PrependWatchReactor("daemonsets", func(k8stesting.Action) (bool, watch.Interface, error) { return true, nil, forbid })
	ctx, cancel := context.WithCancel(context.Background())
	log := slog.New(slog.NewTextHandler(io.Discard, nil))
	d := watchDaemonSet(ctx, clientset.Of(cs), "istio-system", "istio-cni-node", "node-a", log)
	defer func() { cancel(); <-d.done }()
	cfg, err := ParseOptions(nil, envOf(map[string]string{"POD_NAMESPACE": "istio-system"}))
	if err != nil {
		t.Fatal(err)
	}
	if New(cfg, log).keepPlugin(cfg, d.present) {
		t.Fatal("the DaemonSet was never readable, and termination kept the plugin")
	}
}

// TestDaemonSetNoLongerTargetingTheNode: at termination the DaemonSet must
// still send its pods to this node (nodeSelector and required node
// affinity, as Istio's agent checks) for the plugin to stay. An upgrade
// that narrowed them takes the agent off the node for good, and the
// plugin left behind would fail every later pod with the credentials of
// the agent's deleted pod. What cannot be told keeps the plugin.
func TestDaemonSetNoLongerTargetingTheNode(t *testing.T) {
	affinity := func(op corev1.NodeSelectorOperator, values ...string) *corev1.Affinity {
		return &corev1.Affinity{NodeAffinity: &corev1.NodeAffinity{RequiredDuringSchedulingIgnoredDuringExecution: &corev1.NodeSelector{
			NodeSelectorTerms: []corev1.NodeSelectorTerm{{MatchExpressions: []corev1.NodeSelectorRequirement{{Key: "pool", Operator: op, Values: values}}}}}}}
	}
	for _, c := range []struct {
		name         string
		selector     map[string]string
		affinity     *corev1.Affinity
		nodeLabels   map[string]string
		nodeReadable bool
		want         bool
		readsNode    bool
	}{
		{name: "no selector: every node", want: true},
		{name: "selector matches", selector: map[string]string{"pool": "a"}, nodeLabels: map[string]string{"pool": "a"}, nodeReadable: true, want: true, readsNode: true},
		{name: "selector no longer matches", selector: map[string]string{"pool": "a"}, nodeLabels: map[string]string{"pool": "b"}, nodeReadable: true, want: false, readsNode: true},
		{name: "affinity no longer matches", affinity: affinity(corev1.NodeSelectorOpNotIn, "b"), nodeLabels: map[string]string{"pool": "b"}, nodeReadable: true, want: false, readsNode: true},
		{name: "affinity matches", affinity: affinity(corev1.NodeSelectorOpIn, "a", "b"), nodeLabels: map[string]string{"pool": "b"}, nodeReadable: true, want: true, readsNode: true},
		{name: "a term that does not parse matches nothing", affinity: affinity(corev1.NodeSelectorOpGt, "abc"), nodeLabels: map[string]string{"pool": "5"}, nodeReadable: true, want: false, readsNode: true},
		{name: "node unreadable: cannot tell", selector: map[string]string{"pool": "a"}, nodeLabels: map[string]string{"pool": "b"}, want: true, readsNode: true},
	} {
		t.Run(c.name, func(t *testing.T) {
			ds := &appsv1.DaemonSet{ObjectMeta: metav1.ObjectMeta{Namespace: "istio-system", Name: "istio-cni-node"},
				Spec: appsv1.DaemonSetSpec{Template: corev1.PodTemplateSpec{Spec: corev1.PodSpec{NodeSelector: c.selector, Affinity: c.affinity}}}}
			node := &corev1.Node{ObjectMeta: metav1.ObjectMeta{Name: "node-a", Labels: c.nodeLabels}}
			cs := fake.NewClientset(ds, node)
			if !c.nodeReadable {
				cs.PrependReactor("get", "nodes", func(k8stesting.Action) (bool, runtime.Object, error) {
					return true, nil, apierrors.NewForbidden(schema.GroupResource{Resource: "nodes"}, "node-a", nil)
				})
			}
			ctx, cancel := context.WithCancel(context.Background())
			d := watchDaemonSet(ctx, clientset.Of(cs), "istio-system", "istio-cni-node", "node-a", slog.New(slog.NewTextHandler(io.Discard, nil)))
			defer func() { cancel(); <-d.done }()
			present, err := d.present(context.Background())
			if err != nil || present != c.want {
				t.Fatalf("present %v, error %v; want %v", present, err, c.want)
			}
			read := false
			for _, a := range cs.Actions() {
				read = read || (a.GetVerb() == "get" && a.GetResource().Resource == "nodes")
			}
			if read != c.readsNode {
				t.Fatalf("node read: %v, want %v (a DaemonSet for every node needs no node read, nor its RBAC)", read, c.readsNode)
			}
		})
	}
}
