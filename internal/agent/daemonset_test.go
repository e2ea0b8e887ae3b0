package agent

import (
	"context"
	"io"
	"log/slog"
	"testing"
	"time"

	appsv1 "k8s.io/api/apps/v1"
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
		d := watchDaemonSet(ctx, clientset.Of(cs), "istio-system", "istio-cni-node", slog.New(slog.NewTextHandler(io.Discard, nil)))
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
	d := watchDaemonSet(ctx, clientset.Of(cs), "istio-system", "istio-cni-node", log)
	defer func() { cancel(); <-d.done }()
	cfg, err := ParseOptions(nil, envOf(map[string]string{"POD_NAMESPACE": "istio-system"}))
	if err != nil {
		t.Fatal(err)
	}
	if New(cfg, log).keepPlugin(cfg, d.present) {
		t.Fatal("the DaemonSet was never readable, and termination kept the plugin")
	}
}
