package agent

import (
	"context"
	"fmt"
	"log/slog"
	"sync"
	"time"

	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/fields"
	"k8s.io/apimachinery/pkg/watch"
	"k8s.io/component-helpers/scheduling/corev1/nodeaffinity"

	"github.com/istio-cni-go/istio-cni/internal/kubeclient"
)

// daemonSetWatch follows the agent's own DaemonSet while the agent runs.
// At termination one read usually tells an upgrade (the DaemonSet is
// there) from an uninstall (it is gone); but helm uninstall deletes the
// DaemonSet first and its RBAC right after, so that read is often refused.
// A refusal alone proves nothing (a rollout with a webhook or RBAC hiccup
// gets one too): it counts as an uninstall only when the watch saw the
// DaemonSet go first.
type daemonSetWatch struct {
	cs       kubeclient.Interface
	ns, name string
	// node is the agent's node, which the DaemonSet must still target
	// for its termination to be an upgrade.
	node string
	log  *slog.Logger

	// done is closed once the watch has stopped, after ctx ended.
	done chan struct{}

	mu   sync.Mutex
	gone bool
	// read: the DaemonSet was read or watched at least once. Istio's
	// chart grants no DaemonSet access in sidecar mode: with its RBAC
	// nothing can be told at termination, ever.
	read bool
	// changed is closed, and replaced, whenever gone changes.
	changed chan struct{}
}

func watchDaemonSet(ctx context.Context, cs kubeclient.Interface, ns, name, node string, log *slog.Logger) *daemonSetWatch {
	d := &daemonSetWatch{cs: cs, ns: ns, name: name, node: node, log: log, done: make(chan struct{}), changed: make(chan struct{})}
	go func() {
		defer close(d.done)
		d.run(ctx)
	}()
	return d
}

func (d *daemonSetWatch) run(ctx context.Context) {
	backoff := time.Second
	announced, complained := false, false
	for ctx.Err() == nil {
		// A watch reports what exists when it starts, not what is gone:
		// a read first says whether it is gone.
		_, err := d.cs.DaemonSets(d.ns).Get(ctx, d.name, metav1.GetOptions{})
		if apierrors.IsNotFound(err) {
			d.set(true)
		}
		if err == nil || apierrors.IsNotFound(err) {
			d.markRead()
		}
		// From the API server's cache as it is ("0"): asking for its
		// newest version can wait on a cache that lags a quiet resource.
		w, err := d.cs.DaemonSets(d.ns).Watch(ctx, metav1.ListOptions{ResourceVersion: "0",
			FieldSelector: fields.OneTermEqualSelector("metadata.name", d.name).String()})
		if err != nil {
			if !complained && ctx.Err() == nil {
				msg := "cannot watch the agent's DaemonSet; at termination a refused read of it will leave the plugin in place"
				if !d.everRead() {
					msg = "cannot read or watch the agent's DaemonSet (no RBAC for it, as in Istio's chart in sidecar mode): termination will remove the plugin, as Istio's agent does, also in a rollout"
				}
				d.log.Info(msg, "daemonset", d.ns+"/"+d.name, "error", err.Error())
				complained = true
			}
			select {
			case <-ctx.Done():
				return
			case <-time.After(backoff): // retrying a refused or failed watch
			}
			backoff = min(2*backoff, time.Minute)
			continue
		}
		if !announced {
			d.log.Info("watching its DaemonSet, to tell an upgrade from an uninstall at termination", "daemonset", d.ns+"/"+d.name)
			announced = true
		}
		backoff = time.Second
		d.follow(ctx, w)
	}
}

// follow reads one watch until it ends or reports an error (then the
// caller starts another, after a pause).
func (d *daemonSetWatch) follow(ctx context.Context, w watch.Interface) {
	defer w.Stop()
	for {
		var ev watch.Event
		select {
		case <-ctx.Done():
			// Not only the stream's end: a watch need not watch ctx.
			return
		case e, ok := <-w.ResultChan():
			if !ok {
				return
			}
			ev = e
		}
		switch ev.Type {
		case watch.Added, watch.Modified:
			if ds, ok := ev.Object.(*appsv1.DaemonSet); ok {
				d.markRead()
				d.set(ds.DeletionTimestamp != nil)
			}
		case watch.Deleted:
			d.set(true)
		case watch.Error:
			select {
			case <-ctx.Done():
			case <-time.After(time.Second): // the API server asks for a pause before a new watch
			}
			return
		}
	}
}

func (d *daemonSetWatch) set(gone bool) {
	d.mu.Lock()
	was := d.gone
	d.gone = gone
	if gone != was {
		close(d.changed)
		d.changed = make(chan struct{})
	}
	d.mu.Unlock()
	switch {
	case gone && !was:
		d.log.Info("the agent's DaemonSet was deleted: the plugin will be removed at termination", "daemonset", d.ns+"/"+d.name)
	case !gone && was:
		d.log.Info("the agent's DaemonSet exists again", "daemonset", d.ns+"/"+d.name)
	}
}

func (d *daemonSetWatch) markRead() {
	d.mu.Lock()
	d.read = true
	d.mu.Unlock()
}

func (d *daemonSetWatch) everRead() bool {
	d.mu.Lock()
	defer d.mu.Unlock()
	return d.read
}

func (d *daemonSetWatch) seenGone() bool {
	d.mu.Lock()
	defer d.mu.Unlock()
	return d.gone
}

// watchGrace is how long a refused read at termination waits for the
// watch to report the DaemonSet gone. The kubelet's SIGTERM can come
// before the watch's event on a loaded node: helm uninstall deletes the
// DaemonSet, then its RBAC and service account at once, and a plugin
// left behind by a missed event fails every later pod on the node with
// its dead credentials.
const watchGrace = 3 * time.Second

// goneWithin reports whether the watch sees the DaemonSet gone within
// grace (or ctx).
func (d *daemonSetWatch) goneWithin(ctx context.Context, grace time.Duration) bool {
	timer := time.NewTimer(grace)
	defer timer.Stop()
	for {
		d.mu.Lock()
		gone, changed := d.gone, d.changed
		d.mu.Unlock()
		if gone {
			return true
		}
		select {
		case <-changed:
		case <-timer.C:
			return false
		case <-ctx.Done():
			return false
		}
	}
}

// present says, at termination, whether the DaemonSet still exists (and
// is not being deleted) and still targets this node.
func (d *daemonSetWatch) present(ctx context.Context) (bool, error) {
	ds, err := d.cs.DaemonSets(d.ns).Get(ctx, d.name, metav1.GetOptions{})
	switch {
	case apierrors.IsNotFound(err):
		return false, nil
	case err == nil:
		return ds.DeletionTimestamp == nil && d.targetsNode(ctx, ds), nil
	case d.seenGone():
		return false, nil
	case apierrors.IsForbidden(err) || apierrors.IsUnauthorized(err):
		if !d.everRead() {
			// Never readable (Istio's RBAC in sidecar mode): as Istio's
			// agent, termination removes the plugin. Kept, it would fail
			// every later pod with the uninstalled service account's
			// credentials; removed during a rollout, pods that start
			// meanwhile race the next agent, which repair handles.
			d.log.Warn("the agent's DaemonSet could never be read (no RBAC for it, as in Istio's chart in sidecar mode): removing the plugin at termination, as Istio's agent does",
				"daemonset", d.ns+"/"+d.name, "error", err.Error())
			return false, nil
		}
		if d.goneWithin(ctx, watchGrace) {
			return false, nil
		}
		return false, fmt.Errorf("the API server refused to read the DaemonSet and it was not seen deleted: %w", err)
	}
	return false, err
}

// targetsNode says whether the DaemonSet's pods still go to the agent's
// node: its template's nodeSelector and required node affinity match the
// node, as Istio's agent checks. An upgrade that narrows them takes the
// agent off this node for good; the plugin kept would use the agent's
// credentials, which the API server invalidates with the agent's pod,
// and fail every later pod here. Whatever cannot be told (no node name,
// the node unreadable) counts as targeted: the rollout case, as before.
// Taints are not weighed: the DaemonSet controller adds tolerations of
// its own (a rebooting or cordoned node keeps its agent), and the chart
// tolerates every taint.
func (d *daemonSetWatch) targetsNode(ctx context.Context, ds *appsv1.DaemonSet) bool {
	spec := &ds.Spec.Template.Spec
	if len(spec.NodeSelector) == 0 && (spec.Affinity == nil || spec.Affinity.NodeAffinity == nil ||
		spec.Affinity.NodeAffinity.RequiredDuringSchedulingIgnoredDuringExecution == nil) {
		return true
	}
	if d.node == "" {
		return true
	}
	node, err := d.cs.Nodes().Get(ctx, d.node, metav1.GetOptions{})
	if err != nil {
		msg := "cannot read the agent's node to tell whether its DaemonSet still targets it; taking the termination for an upgrade"
		if apierrors.IsNotFound(err) {
			msg += " (is the node name right? set KUBERNETES_NODE_NAME from spec.nodeName)"
		}
		d.log.Warn(msg, "node", d.node, "error", err.Error())
		return true
	}
	// A term that does not parse matches nothing, and the others still
	// count, as the DaemonSet controller places its pods.
	match, err := nodeaffinity.GetRequiredNodeAffinity(&corev1.Pod{Spec: *spec}).Match(node)
	if err != nil {
		d.log.Info("the DaemonSet's node affinity has a term that does not parse; it matches nothing, as for the DaemonSet controller",
			"node", d.node, "error", err.Error())
	}
	if !match {
		d.log.Info("the agent's DaemonSet no longer targets this node (its nodeSelector or node affinity): no agent will come back here",
			"daemonset", d.ns+"/"+d.name, "node", d.node)
	}
	return match
}
