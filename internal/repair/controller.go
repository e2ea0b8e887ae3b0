package repair

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io/fs"
	"log/slog"
	"net/netip"
	"runtime/debug"
	"sync"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/labels"
	k8stypes "k8s.io/apimachinery/pkg/types"
	listersv1 "k8s.io/client-go/listers/core/v1"
	"k8s.io/client-go/tools/cache"
	"k8s.io/client-go/tools/record"
	"k8s.io/client-go/util/workqueue"

	"github.com/istio-cni-go/istio-cni/internal/kubeclient"
	"github.com/istio-cni-go/istio-cni/internal/plugin"
	"github.com/istio-cni-go/istio-cni/internal/podcache"
	"github.com/istio-cni-go/istio-cni/internal/podinfo"
	"github.com/istio-cni-go/istio-cni/internal/podrules"
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
	cfg     Config
	cs      kubeclient.Interface
	log     *slog.Logger
	rules   plugin.Rules
	procDir string
	// holdsRules says whether a namespace holds redirect rules of any
	// form (podrules.HoldsRules).
	holdsRules func(netnsPath string) (bool, error)
	recorder   record.EventRecorder
	// events is the recorder's broadcaster: it sends to the API only
	// while Run runs, and Run shuts it down before returning.
	events  record.EventBroadcaster
	counter *prometheus.CounterVec
	queue   workqueue.TypedRateLimitingInterface[k8stypes.NamespacedName]
	lister  func(ns, name string) (*corev1.Pod, error)

	mu       sync.Mutex
	repaired map[k8stypes.NamespacedName]k8stypes.UID
	// brokenSeen records when a pod was first seen broken, for latency;
	// an entry goes when the pod is fixed, fine again, given up on or gone.
	brokenSeen map[k8stypes.NamespacedName]seen
	// Latency observes time from first seen broken to acted on.
	Latency prometheus.Observer
	// Panics counts pods whose handling panicked; nil means not counted.
	Panics prometheus.Counter
	// Informer, when set, is a started informer on the node's pods to
	// share instead of watching them again.
	Informer cache.SharedIndexInformer
	// started is when this controller was made: a validation that failed
	// before may have been repaired by the agent before this one.
	started time.Time
}

type seen struct {
	uid k8stypes.UID
	at  time.Time
}

// NewMetric is istio_cni_repair_pods_repaired_total{type,result}.
func NewMetric() *prometheus.CounterVec {
	return prometheus.NewCounterVec(prometheus.CounterOpts{Name: "istio_cni_repair_pods_repaired_total",
		Help: "Pods acted on by the repair controller, by type (repair, delete, label) and result (success, skip, fail)."},
		[]string{"type", "result"})
}

// New returns a controller; rules is the backend repair programs with.
func New(cfg Config, cs kubeclient.Interface, rules plugin.Rules, procDir string, counter *prometheus.CounterVec, log *slog.Logger) *Controller {
	b := record.NewBroadcaster()
	return &Controller{cfg: cfg, cs: cs, log: log.With("component", "repair"), rules: rules, procDir: procDir, holdsRules: podrules.HoldsRules,
		recorder: b.NewRecorder(kubeclient.Scheme, corev1.EventSource{Component: "cni-repair"}), events: b,
		counter: counter,
		queue: workqueue.NewTypedRateLimitingQueue(workqueue.NewTypedItemExponentialFailureRateLimiter[k8stypes.NamespacedName](
			100*time.Millisecond, 10*time.Second)),
		repaired: map[k8stypes.NamespacedName]k8stypes.UID{}, brokenSeen: map[k8stypes.NamespacedName]seen{},
		started: time.Now()}
}

// Run watches the pods of node until ctx ends. It returns only once every
// goroutine it started has ended: its own informer (a shared one is its
// owner's to stop), the work queue's and the event broadcaster's, whose
// pending events are sent first.
func (c *Controller) Run(ctx context.Context, node string) error {
	var wg sync.WaitGroup
	defer wg.Wait()
	sink := c.events.StartRecordingToSink(c.cs.Events())
	defer func() {
		sink.Stop()
		c.events.Shutdown()
	}()
	informer := c.Informer
	if informer == nil {
		// The node's pods still, narrowed by the selectors, and trimmed
		// as the pod cache trims them.
		fieldSelector := "spec.nodeName=" + node
		if c.cfg.FieldSelectors != "" {
			fieldSelector += "," + c.cfg.FieldSelectors
		}
		informer = podcache.NewPodInformer(c.cs, fieldSelector, c.cfg.LabelSelectors)
		_ = informer.SetTransform(podcache.Trim)
		informerCtx, stopInformer := context.WithCancel(ctx)
		wg.Add(1)
		go func() {
			defer wg.Done()
			informer.RunWithContext(informerCtx)
		}()
		// The informer is stopped, whatever way Run returns, before the
		// wait for it.
		defer stopInformer()
	}
	lister := listersv1.NewPodLister(informer.GetIndexer())
	enqueue := func(obj any) {
		if p, ok := obj.(*corev1.Pod); ok {
			c.queue.Add(k8stypes.NamespacedName{Namespace: p.Namespace, Name: p.Name})
		}
	}
	if _, err := informer.AddEventHandler(cache.ResourceEventHandlerFuncs{
		AddFunc: enqueue, UpdateFunc: func(_, n any) { enqueue(n) },
		DeleteFunc: func(obj any) {
			if d, ok := obj.(cache.DeletedFinalStateUnknown); ok {
				obj = d.Obj
			}
			enqueue(obj)
		},
	}); err != nil {
		return err
	}
	c.lister = func(ns, name string) (*corev1.Pod, error) { return lister.Pods(ns).Get(name) }
	queueCtx, stopQueue := context.WithCancel(ctx)
	defer stopQueue()
	wg.Add(1)
	go func() {
		defer wg.Done()
		<-queueCtx.Done()
		c.queue.ShutDown()
	}()
	if !cache.WaitForCacheSync(ctx.Done(), informer.HasSynced) {
		return nil
	}
	c.log.Info("repair controller watching the node's pods", "node", node, "mode", c.cfg.Mode())
	if pods, err := lister.List(labels.Everything()); err == nil {
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
	index, err := IndexPodNetNS(c.procDir)
	if errors.Is(err, fs.ErrNotExist) {
		// The chart mounts the host's /proc in repair mode only (and for
		// ambient mode or nativeNftables=auto): least privilege for the
		// delete and label modes, which then wait for validation to fail.
		c.log.Info("start-up scan off: the host's /proc is not mounted", "procDir", c.procDir)
		return
	}
	if err != nil {
		c.log.Warn("start-up scan skipped", "error", err.Error())
		return
	}
	for _, pod := range pods {
		_ = c.safely(pod.Namespace+"/"+pod.Name, func() error { c.scanPod(ctx, pod, index); return nil })
	}
}

// safely runs f for one pod: a panic is logged with the pod, counted, and
// fails that pod only, so one bad pod neither stops the controller nor
// (met again by the start-up scan) the agent at every restart.
func (c *Controller) safely(pod string, f func() error) (err error) {
	defer func() {
		if r := recover(); r != nil {
			if c.Panics != nil {
				c.Panics.Inc()
			}
			c.log.Error("panic while handling a pod; skipping it", "pod", pod, "panic", fmt.Sprint(r), "stack", string(debug.Stack()))
			err = fmt.Errorf("panic: %v", r)
		}
	}()
	return f()
}

func (c *Controller) scanPod(ctx context.Context, pod *corev1.Pod, index map[string]string) {
	if _, ok := pod.Annotations[c.cfg.SidecarAnnotation]; !ok || pod.Spec.HostNetwork || pod.DeletionTimestamp != nil {
		return
	}
	path, ok := index[string(pod.UID)]
	if !ok {
		return
	}
	held, err := OpenVerifiedNetNS(path, podNetNS(pod))
	if err != nil {
		// Most often a pod mid-creation (no IP reported yet) or a new
		// sandbox the status does not name yet: no Event on a healthy pod.
		c.log.Info("start-up scan: not (yet) the pod's network namespace; leaving it alone", "pod", pod.Namespace+"/"+pod.Name, "error", err.Error())
		return
	}
	defer held.Close()
	netns := FDPath(held)
	facts, err := toFacts(pod)
	if err != nil {
		return
	}
	// A pod the plugin leaves alone (a gateway, a proxyless gRPC pod,
	// injection turned off) has no rules by design: deleting or labelling
	// it at every agent start would be a storm.
	if skip := plugin.Exclusion(facts); skip != "" {
		c.log.Info("start-up scan: the plugin does not redirect this pod; left alone", "pod", pod.Namespace+"/"+pod.Name, "reason", skip)
		return
	}
	params, _, err := redirect.FromPod(facts)
	if err != nil || params.Mode == redirect.ModeNone {
		return
	}
	plan, err := podrules.BuildPlan(c.rules, netns, params)
	if err != nil {
		return
	}
	differs := c.rules.Check(netns, plan)
	if differs == nil {
		return
	}
	// Rules other than this agent's plan still redirect: an earlier
	// agent's form of them, or the plan of annotations since changed.
	// Istio never rewrites a running pod's rules; neither does the scan.
	holds, err := c.holdsRules(netns)
	switch {
	case err != nil:
		c.log.Warn("start-up scan: cannot tell whether the pod holds redirect rules; leaving it to its validation",
			"pod", pod.Namespace+"/"+pod.Name, "error", err.Error(), "check", differs.Error())
		return
	case holds:
		c.log.Info("start-up scan: the pod's redirect rules differ from this agent's plan; left as they are",
			"pod", pod.Namespace+"/"+pod.Name, "differences", differs.Error())
		return
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

func (c *Controller) next(ctx context.Context) bool {
	key, quit := c.queue.Get()
	if quit {
		return false
	}
	defer c.queue.Done(key)
	if err := c.safely(key.String(), func() error { return c.reconcile(ctx, key) }); err != nil {
		if c.queue.NumRequeues(key) < 5 {
			c.queue.AddRateLimited(key)
			return true
		}
		c.log.Error("giving up on pod", "pod", key.String(), "error", err.Error())
		c.forgetBroken(key)
	}
	c.queue.Forget(key)
	return true
}

func (c *Controller) forgetBroken(key k8stypes.NamespacedName) {
	c.mu.Lock()
	delete(c.brokenSeen, key)
	c.mu.Unlock()
}

func (c *Controller) reconcile(ctx context.Context, key k8stypes.NamespacedName) error {
	pod, err := c.lister(key.Namespace, key.Name)
	if apierrors.IsNotFound(err) {
		c.mu.Lock()
		_, broken := c.brokenSeen[key]
		delete(c.repaired, key)
		delete(c.brokenSeen, key)
		c.mu.Unlock()
		if broken {
			c.log.Info("pod gone before it could be acted on; nothing to do", "pod", key.String())
		}
		return nil
	}
	if err != nil {
		return err
	}
	reason, broken := c.cfg.Broken(pod)
	if !broken {
		c.forgetBroken(key)
		// Fine again: a later sandbox of the pod that races the plugin
		// (its pause container restarted) is repaired anew.
		c.mu.Lock()
		delete(c.repaired, key)
		c.mu.Unlock()
		return nil
	}
	c.mu.Lock()
	if s, ok := c.brokenSeen[key]; !ok || s.uid != pod.UID {
		c.brokenSeen[key] = seen{uid: pod.UID, at: time.Now()}
	}
	c.mu.Unlock()
	if mode := c.cfg.Mode(); mode != "" && (pod.Status.Phase == corev1.PodFailed || pod.Status.Phase == corev1.PodSucceeded) {
		// A pod that does not restart (restartPolicy Never) ended with its
		// failed validation: its sandbox is gone, so there is nothing to
		// repair, and deleting it would only lose its status and logs
		// (its Job, if any, replaces it on its own; Istio's predicate,
		// which waits for a restart, never acts on it either).
		c.done(mode, "skip", pod)
		c.log.Info("not acting on the broken pod: it has ended", "pod", key.String(), "phase", string(pod.Status.Phase), "mode", mode)
		return nil
	}
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
	key := k8stypes.NamespacedName{Namespace: pod.Namespace, Name: pod.Name}
	c.mu.Lock()
	s, ok := c.brokenSeen[key]
	if ok && s.uid == pod.UID {
		delete(c.brokenSeen, key)
	}
	c.mu.Unlock()
	if ok && s.uid == pod.UID && c.Latency != nil {
		c.Latency.Observe(time.Since(s.at).Seconds())
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
		// Its validation goes on failing until its next restart; Istio
		// counts nothing for it either.
		c.log.Debug("pod repaired already", "pod", key.String())
		return nil
	}
	fail := func(err error) error {
		c.done("repair", "fail", pod)
		c.recorder.Eventf(pod, corev1.EventTypeWarning, ReasonRepairFailed, "pod detected as broken (%s) but repair failed: %v", reason, err)
		c.log.Error("repair failed", "pod", key.String(), "error", err.Error())
		return err
	}
	if pod.Status.Phase == corev1.PodFailed || pod.Status.Phase == corev1.PodSucceeded {
		// A pod that does not restart (restartPolicy Never): its sandbox
		// is gone with its failed validation, and there is nothing left
		// to repair.
		c.done("repair", "skip", pod)
		c.log.Info("not repairing: the pod has ended", "pod", key.String(), "phase", string(pod.Status.Phase))
		return nil
	}
	if pod.Spec.HostNetwork {
		// Its processes are in the node's namespace, which holds its IP
		// (the node's): rules written there would redirect the node.
		c.done("repair", "skip", pod)
		c.log.Warn("not repairing a pod on the node's network; the plugin never runs for it", "pod", key.String())
		return nil
	}
	id := podNetNS(pod)
	if len(id.IPs) == 0 {
		return fail(fmt.Errorf("pod has no IP yet"))
	}
	held, err := OpenPodNetNS(c.procDir, id)
	if err != nil {
		return fail(err)
	}
	defer held.Close()
	netns := FDPath(held)
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
	plan, err := podrules.BuildPlan(c.rules, netns, params)
	if err != nil {
		return fail(fmt.Errorf("%s: %w", held.Name(), err))
	}
	inPlace := c.rules.Check(netns, plan) == nil
	if !inPlace {
		// Rules other than this agent's plan (an earlier agent's form of
		// them, another backend's, or the plan of annotations changed
		// since) still redirect: the pod did not race the plugin, and
		// Istio never rewrites a running pod's rules.
		holds, herr := c.holdsRules(netns)
		if herr != nil {
			// As the start-up scan: rules it cannot read may well be
			// there, and a second set beside them would not help.
			return fail(fmt.Errorf("cannot tell whether the pod's namespace holds redirect rules of another form: %w", herr))
		}
		inPlace = holds
	}
	if inPlace {
		if failed := c.lastFailure(pod); !failed.IsZero() && failed.Before(c.started) {
			// Failed before this agent started: the one before may have
			// repaired it since, and its next run will tell.
			c.log.Debug("the pod's rules are in place and its validation last failed before this agent started; waiting for its next run", "pod", key.String())
			return nil
		}
		// Not a pod that raced the plugin: its validation fails with the
		// rules in place (the validation's uid, its ports, or a policy
		// dropping its probe). Saying "repaired" would hide that.
		c.mu.Lock()
		c.repaired[key] = pod.UID
		c.mu.Unlock()
		c.done("repair", "skip", pod)
		c.recorder.Eventf(pod, corev1.EventTypeWarning, ReasonRepairFailed,
			"pod detected as broken (%s), but its redirect rules are in place: its validation fails for another reason (check the istio-validation container's uid and ports)", reason)
		c.log.Warn("not repairing: the pod's redirect rules are in place, so its validation fails for another reason", "pod", key.String())
		return nil
	}
	rep, err := c.rules.Apply(netns, plan)
	if err != nil {
		return fail(fmt.Errorf("%s: %w", held.Name(), err))
	}
	c.mu.Lock()
	c.repaired[key] = pod.UID
	c.mu.Unlock()
	c.done("repair", "success", pod)
	c.recorder.Eventf(pod, corev1.EventTypeNormal, ReasonRepaired, "pod detected as broken (%s); redirect rules applied in its network namespace", reason)
	c.log.Info("repaired pod", "pod", key.String(), "netns", held.Name(), "result", rep.String())
	return nil
}

// lastFailure is when the pod's validation container last ended with a
// failure, as its status says (zero when it does not).
func (c *Controller) lastFailure(pod *corev1.Pod) time.Time {
	var last time.Time
	for i := range pod.Status.InitContainerStatuses {
		st := &pod.Status.InitContainerStatuses[i]
		if c.cfg.InitContainerName != "" && st.Name != c.cfg.InitContainerName {
			continue
		}
		for _, t := range []*corev1.ContainerStateTerminated{st.State.Terminated, st.LastTerminationState.Terminated} {
			if t != nil && t.ExitCode != 0 && t.FinishedAt.After(last) {
				last = t.FinishedAt.Time
			}
		}
	}
	return last
}

func (c *Controller) delete(ctx context.Context, pod *corev1.Pod, reason string) error {
	uid, rv := pod.UID, pod.ResourceVersion
	err := c.cs.Pods(pod.Namespace).Delete(ctx, pod.Name, metav1.DeleteOptions{
		Preconditions: &metav1.Preconditions{UID: &uid, ResourceVersion: &rv}})
	if apierrors.IsNotFound(err) || apierrors.IsConflict(err) {
		c.done("delete", "skip", pod)
		return nil
	}
	// Istio's Events, word for word: alerts match them.
	if err != nil {
		c.done("delete", "fail", pod)
		c.recorder.Eventf(pod, corev1.EventTypeWarning, ReasonDeleted, "pod detected as broken, but failed to delete: %v", err)
		c.log.Error("deleting broken pod failed", "pod", pod.Namespace+"/"+pod.Name, "reason", reason, "error", err.Error())
		return err
	}
	c.done("delete", "success", pod)
	c.recorder.Eventf(pod, corev1.EventTypeWarning, ReasonDeleted, "pod detected as broken, deleted")
	c.log.Info("deleted broken pod", "pod", pod.Namespace+"/"+pod.Name, "reason", reason)
	return nil
}

func (c *Controller) label(ctx context.Context, pod *corev1.Pod, reason string) error {
	if _, ok := pod.Labels[c.cfg.LabelKey]; ok {
		c.done("label", "skip", pod)
		return nil
	}
	patch, _ := json.Marshal(map[string]any{"metadata": map[string]any{"labels": map[string]string{c.cfg.LabelKey: c.cfg.LabelValue}}})
	_, err := c.cs.Pods(pod.Namespace).Patch(ctx, pod.Name, k8stypes.MergePatchType, patch, metav1.PatchOptions{}, "status")
	if err != nil {
		c.done("label", "fail", pod)
		c.recorder.Eventf(pod, corev1.EventTypeWarning, ReasonLabeled, "pod detected as broken, but failed to label: %v", err)
		c.log.Error("labelling broken pod failed", "pod", pod.Namespace+"/"+pod.Name, "reason", reason, "error", err.Error())
		return err
	}
	c.done("label", "success", pod)
	c.recorder.Eventf(pod, corev1.EventTypeWarning, ReasonLabeled, "pod detected as broken, labeled")
	c.log.Info("labelled broken pod", "pod", pod.Namespace+"/"+pod.Name, "label", c.cfg.LabelKey+"="+c.cfg.LabelValue, "reason", reason)
	return nil
}

func toFacts(pod *corev1.Pod) (*podinfo.Pod, error) {
	b, err := json.Marshal(pod)
	if err != nil {
		return nil, err
	}
	return podinfo.DecodeJSON(b)
}

// podNetNS is what identifies pod's network namespace on the node.
func podNetNS(pod *corev1.Pod) PodNetNS {
	id := PodNetNS{UID: string(pod.UID), HostUsers: pod.Spec.HostUsers}
	if id.HostUsers == nil {
		t := true
		id.HostUsers = &t
	}
	for _, ip := range pod.Status.PodIPs {
		if a, err := netip.ParseAddr(ip.IP); err == nil {
			id.IPs = append(id.IPs, a)
		}
	}
	if a, err := netip.ParseAddr(pod.Status.PodIP); err == nil && len(id.IPs) == 0 {
		id.IPs = append(id.IPs, a)
	}
	return id
}
