package repair

import (
	"context"
	"encoding/json"
	"fmt"
	"log/slog"
	"net/netip"
	"sync"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/labels"
	k8stypes "k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/informers"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/kubernetes/scheme"
	typedcorev1 "k8s.io/client-go/kubernetes/typed/core/v1"
	"k8s.io/client-go/tools/cache"
	"k8s.io/client-go/tools/record"
	"k8s.io/client-go/util/workqueue"

	"github.com/istio-cni-go/istio-cni/internal/plugin"
	"github.com/istio-cni-go/istio-cni/internal/podinfo"
	"github.com/istio-cni-go/istio-cni/internal/redirect"
)

// Event reasons written on pods.
const (
	ReasonRepaired     = "RepairedPod"
	ReasonRepairFailed = "RepairPodFailed"
	ReasonDeleted      = "DeleteBrokenPod"
	ReasonLabeled      = "LabelBrokenPod"
)

// Controller watches the node's pods and acts on broken ones.
type Controller struct {
	cfg      Config
	cs       kubernetes.Interface
	log      *slog.Logger
	rules    plugin.Rules
	procDir  string
	recorder record.EventRecorder
	counter  *prometheus.CounterVec
	queue    workqueue.TypedRateLimitingInterface[k8stypes.NamespacedName]
	lister   func(ns, name string) (*corev1.Pod, error)

	mu       sync.Mutex
	repaired map[k8stypes.NamespacedName]k8stypes.UID
	// BrokenSeen records when a pod was first seen broken, for latency.
	brokenSeen map[k8stypes.UID]time.Time
	// Latency observes time from first seen broken to acted on.
	Latency prometheus.Observer
}

// NewMetric is istio_cni_repair_pods_repaired_total{type,result}.
func NewMetric() *prometheus.CounterVec {
	return prometheus.NewCounterVec(prometheus.CounterOpts{Name: "istio_cni_repair_pods_repaired_total",
		Help: "Pods acted on by the repair controller, by type (repair, delete, label) and result (success, skip, fail)."},
		[]string{"type", "result"})
}

// New returns a controller; rules is the backend repair programs with.
func New(cfg Config, cs kubernetes.Interface, rules plugin.Rules, procDir string, counter *prometheus.CounterVec, log *slog.Logger) *Controller {
	b := record.NewBroadcaster()
	b.StartRecordingToSink(&typedcorev1.EventSinkImpl{Interface: cs.CoreV1().Events("")})
	return &Controller{cfg: cfg, cs: cs, log: log.With("component", "repair"), rules: rules, procDir: procDir,
		recorder: b.NewRecorder(scheme.Scheme, corev1.EventSource{Component: "cni-repair"}),
		counter:  counter,
		queue: workqueue.NewTypedRateLimitingQueue(workqueue.NewTypedItemExponentialFailureRateLimiter[k8stypes.NamespacedName](
			100*time.Millisecond, 10*time.Second)),
		repaired: map[k8stypes.NamespacedName]k8stypes.UID{}, brokenSeen: map[k8stypes.UID]time.Time{}}
}

// Run watches the pods of node until ctx ends.
func (c *Controller) Run(ctx context.Context, node string) error {
	factory := informers.NewSharedInformerFactoryWithOptions(c.cs, 0,
		informers.WithTweakListOptions(func(o *metav1.ListOptions) {
			o.FieldSelector = "spec.nodeName=" + node
			if c.cfg.FieldSelectors != "" {
				o.FieldSelector += "," + c.cfg.FieldSelectors
			}
			o.LabelSelector = c.cfg.LabelSelectors
		}))
	inf := factory.Core().V1().Pods()
	enqueue := func(obj any) {
		if p, ok := obj.(*corev1.Pod); ok {
			c.queue.Add(k8stypes.NamespacedName{Namespace: p.Namespace, Name: p.Name})
		}
	}
	if _, err := inf.Informer().AddEventHandler(cache.ResourceEventHandlerFuncs{
		AddFunc: enqueue, UpdateFunc: func(_, n any) { enqueue(n) }, DeleteFunc: enqueue,
	}); err != nil {
		return err
	}
	c.lister = func(ns, name string) (*corev1.Pod, error) { return inf.Lister().Pods(ns).Get(name) }
	factory.Start(ctx.Done())
	go func() {
		<-ctx.Done()
		c.queue.ShutDown()
	}()
	if !cache.WaitForCacheSync(ctx.Done(), inf.Informer().HasSynced) {
		return nil
	}
	c.log.Info("repair controller watching the node's pods", "node", node, "mode", c.cfg.Mode())
	if pods, err := inf.Lister().List(labels.Everything()); err == nil {
		c.scan(ctx, pods)
	}
	for c.next(ctx) {
	}
	return nil
}

// scan runs once at start-up, beyond Istio: pods that carry the sidecar
// annotation but whose namespace lacks our rules started while no agent
// was there, and their validation may not have failed (yet); they are
// treated as broken now instead of waiting for it.
func (c *Controller) scan(ctx context.Context, pods []*corev1.Pod) {
	index, err := IndexNetNS(c.procDir)
	if err != nil {
		c.log.Warn("start-up scan skipped", "error", err.Error())
		return
	}
	for _, pod := range pods {
		if _, ok := pod.Annotations[c.cfg.SidecarAnnotation]; !ok || pod.Spec.HostNetwork || pod.DeletionTimestamp != nil {
			continue
		}
		ip, err := netip.ParseAddr(pod.Status.PodIP)
		if err != nil {
			continue
		}
		netns, ok := index[ip]
		if !ok {
			continue
		}
		facts, err := toFacts(pod)
		if err != nil {
			continue
		}
		params, _, err := redirect.FromPod(facts)
		if err != nil || params.Mode == redirect.ModeNone {
			continue
		}
		plan, err := plugin.BuildPlan(c.rules, netns, params)
		if err != nil || c.rules.Check(netns, plan) == nil {
			continue
		}
		reason := "running without redirect rules (found at agent start-up)"
		c.log.Warn("pod runs without redirect rules", "pod", pod.Namespace+"/"+pod.Name)
		var actErr error
		switch c.cfg.Mode() {
		case "repair":
			actErr = c.repair(pod, reason)
		case "delete":
			actErr = c.delete(ctx, pod, reason)
		case "label":
			actErr = c.label(ctx, pod, reason)
		}
		if actErr != nil {
			c.log.Error("start-up scan could not act", "pod", pod.Namespace+"/"+pod.Name, "error", actErr.Error())
		}
	}
}

func (c *Controller) next(ctx context.Context) bool {
	key, quit := c.queue.Get()
	if quit {
		return false
	}
	defer c.queue.Done(key)
	if err := c.reconcile(ctx, key); err != nil {
		if c.queue.NumRequeues(key) < 5 {
			c.queue.AddRateLimited(key)
			return true
		}
		c.log.Error("giving up on pod", "pod", key.String(), "error", err.Error())
	}
	c.queue.Forget(key)
	return true
}

func (c *Controller) reconcile(ctx context.Context, key k8stypes.NamespacedName) error {
	pod, err := c.lister(key.Namespace, key.Name)
	if apierrors.IsNotFound(err) {
		c.mu.Lock()
		delete(c.repaired, key)
		c.mu.Unlock()
		c.log.Info("pod gone before it could be acted on; nothing to do", "pod", key.String())
		return nil
	}
	if err != nil {
		return err
	}
	reason, broken := c.cfg.Broken(pod)
	if !broken {
		return nil
	}
	c.mu.Lock()
	if _, ok := c.brokenSeen[pod.UID]; !ok {
		c.brokenSeen[pod.UID] = time.Now()
	}
	c.mu.Unlock()
	switch c.cfg.Mode() {
	case "repair":
		return c.repair(pod, reason)
	case "delete":
		return c.delete(ctx, pod, reason)
	case "label":
		return c.label(ctx, pod, reason)
	}
	return nil
}

func (c *Controller) done(kind, result string, pod *corev1.Pod) {
	c.counter.WithLabelValues(kind, result).Inc()
	if result != "success" {
		return
	}
	c.mu.Lock()
	seen, ok := c.brokenSeen[pod.UID]
	delete(c.brokenSeen, pod.UID)
	c.mu.Unlock()
	if ok && c.Latency != nil {
		c.Latency.Observe(time.Since(seen).Seconds())
	}
}

// repair finds the pod's namespace through /proc and applies the rules
// the plugin would have applied.
func (c *Controller) repair(pod *corev1.Pod, reason string) error {
	key := k8stypes.NamespacedName{Namespace: pod.Namespace, Name: pod.Name}
	c.mu.Lock()
	done := c.repaired[key] == pod.UID
	c.mu.Unlock()
	if done {
		c.done("repair", "skip", pod)
		return nil
	}
	fail := func(err error) error {
		c.done("repair", "fail", pod)
		c.recorder.Eventf(pod, corev1.EventTypeWarning, ReasonRepairFailed, "pod detected as broken (%s) but repair failed: %v", reason, err)
		c.log.Error("repair failed", "pod", key.String(), "error", err.Error())
		return err
	}
	ip, err := netip.ParseAddr(pod.Status.PodIP)
	if err != nil {
		return fail(fmt.Errorf("pod has no IP yet"))
	}
	netns, err := FindNetNS(c.procDir, ip)
	if err != nil {
		return fail(err)
	}
	facts, err := toFacts(pod)
	if err != nil {
		return fail(err)
	}
	// The plugin's own decision: a pod it would not redirect is not ours
	// to repair either, whatever its validation container says.
	if skip := plugin.Exclusion(facts); skip != "" {
		c.done("repair", "skip", pod)
		c.log.Info("not repairing: the plugin does not redirect this pod", "pod", key.String(), "reason", skip)
		return nil
	}
	params, _, err := redirect.FromPod(facts)
	if err != nil {
		return fail(err)
	}
	plan, err := plugin.BuildPlan(c.rules, netns, params)
	if err != nil {
		return fail(err)
	}
	rep, err := c.rules.Apply(netns, plan)
	if err != nil {
		return fail(err)
	}
	c.mu.Lock()
	c.repaired[key] = pod.UID
	c.mu.Unlock()
	c.done("repair", "success", pod)
	c.recorder.Eventf(pod, corev1.EventTypeNormal, ReasonRepaired, "pod detected as broken (%s); redirect rules applied in its network namespace", reason)
	c.log.Info("repaired pod", "pod", key.String(), "netns", netns, "result", rep.String())
	return nil
}

func (c *Controller) delete(ctx context.Context, pod *corev1.Pod, reason string) error {
	uid, rv := pod.UID, pod.ResourceVersion
	err := c.cs.CoreV1().Pods(pod.Namespace).Delete(ctx, pod.Name, metav1.DeleteOptions{
		Preconditions: &metav1.Preconditions{UID: &uid, ResourceVersion: &rv}})
	if apierrors.IsNotFound(err) || apierrors.IsConflict(err) {
		c.done("delete", "skip", pod)
		return nil
	}
	if err != nil {
		c.done("delete", "fail", pod)
		c.recorder.Eventf(pod, corev1.EventTypeWarning, ReasonDeleted, "pod detected as broken (%s) but failed to delete: %v", reason, err)
		return err
	}
	c.done("delete", "success", pod)
	c.recorder.Eventf(pod, corev1.EventTypeWarning, ReasonDeleted, "pod detected as broken (%s), deleted", reason)
	c.log.Info("deleted broken pod", "pod", pod.Namespace+"/"+pod.Name)
	return nil
}

func (c *Controller) label(ctx context.Context, pod *corev1.Pod, reason string) error {
	if _, ok := pod.Labels[c.cfg.LabelKey]; ok {
		c.done("label", "skip", pod)
		return nil
	}
	patch, _ := json.Marshal(map[string]any{"metadata": map[string]any{"labels": map[string]string{c.cfg.LabelKey: c.cfg.LabelValue}}})
	_, err := c.cs.CoreV1().Pods(pod.Namespace).Patch(ctx, pod.Name, k8stypes.MergePatchType, patch, metav1.PatchOptions{}, "status")
	if err != nil {
		c.done("label", "fail", pod)
		c.recorder.Eventf(pod, corev1.EventTypeWarning, ReasonLabeled, "pod detected as broken (%s) but failed to label: %v", reason, err)
		return err
	}
	c.done("label", "success", pod)
	c.recorder.Eventf(pod, corev1.EventTypeWarning, ReasonLabeled, "pod detected as broken (%s), labeled %s=%s", reason, c.cfg.LabelKey, c.cfg.LabelValue)
	return nil
}

func toFacts(pod *corev1.Pod) (*podinfo.Pod, error) {
	b, err := json.Marshal(pod)
	if err != nil {
		return nil, err
	}
	return podinfo.DecodeJSON(b)
}
