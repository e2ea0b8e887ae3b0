package ambient

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"net/netip"
	"os"
	"slices"
	"sort"
	"sync"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"golang.org/x/sys/unix"
	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	k8stypes "k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/tools/cache"
	"k8s.io/client-go/tools/record"
	"k8s.io/client-go/util/workqueue"

	"github.com/istio-cni-go/istio-cni/internal/ambientnet"
	"github.com/istio-cni-go/istio-cni/internal/kubeclient"
	"github.com/istio-cni-go/istio-cni/internal/nslock"
	"github.com/istio-cni-go/istio-cni/internal/podnet"
	"github.com/istio-cni-go/istio-cni/internal/ruleset"
	"github.com/istio-cni-go/istio-cni/internal/zds"
)

// Defaults of Config's durations.
const (
	// DefaultZtunnelWait is how long an ADD waits for ztunnel to be
	// connected: long enough for a ztunnel restart's reconnect, short
	// against the runtime's own timeout of the ADD.
	DefaultZtunnelWait = 5 * time.Second
	// DefaultHostInterval re-asserts the node's probe SNAT and set.
	DefaultHostInterval = 30 * time.Second
	// DefaultVerifyInterval checks every enrolled pod's rules.
	DefaultVerifyInterval = time.Minute
	// DefaultRetryFirst and DefaultRetryLimit bound the back-off of a pod
	// that could not be enrolled or un-enrolled: retried for as long as
	// it needs it, since ztunnel may connect at any time.
	DefaultRetryFirst = 20 * time.Millisecond
	DefaultRetryLimit = 10 * time.Second
	// DefaultWorkers reconcile pods in parallel: one pod waiting on a
	// stalled ztunnel must not hold up the others' un-enrolment.
	DefaultWorkers = 4
)

// Config of a Controller.
type Config struct {
	// Node is this node's name: only its pods are watched.
	Node string
	Kube kubeclient.Interface
	// Namespaces are watched for their labels.
	Namespaces Namespaces
	Policy     Policy
	Defaults   Defaults
	InPod      ambientnet.InPod
	Host       ambientnet.Host
	// StaleHost, when set, is the other backend's probe SNAT (iptables'
	// ISTIO_POSTRT and ipsets when Host is nftables, and the reverse):
	// an earlier agent's, Istio's among them, before a switch of backend.
	// It is removed once Host's is in place; left, it SNATed the probes
	// of every later pod given one of its frozen set's addresses.
	StaleHost ambientnet.Host
	// HostNetns is the node's network namespace, where the probe SNAT
	// goes; empty means the agent's own (/proc/self/ns/net).
	HostNetns  string
	HostParams ruleset.HostParams
	// ZDS configures the ztunnel socket; its Snapshotter is the
	// controller, and Registerer and Log default to the controller's.
	// The socket is opened only once the controller knows the node's
	// enrolled pods: a ztunnel served an empty snapshot would drop them.
	ZDS zds.Config
	// ProcDir is the host's /proc (a pod's sandbox is found there by its
	// UID); empty means /proc.
	ProcDir string
	// Locker serialises work on one network namespace with the CNI
	// server's; nil gives the controller a locker of its own.
	Locker *nslock.Locker

	ZtunnelWait, HostInterval, VerifyInterval time.Duration
	RetryFirst, RetryLimit                    time.Duration
	Workers                                   int

	Registerer prometheus.Registerer
	Log        *slog.Logger
}

// podState is what the controller holds of a pod it has enrolled (or is
// enrolling). Fields are read and written under Controller.mu; a pod's
// steps are serialised by its UID's lock.
type podState struct {
	uid  string
	info zds.WorkloadInfo
	// netns is the pod's namespace, held open: from the ADD (a dup of the
	// relay's descriptor) or from /proc. nil when not found (yet).
	netns *os.File
	ips   []netip.Addr
	// staleStatus is the pod's status addresses when its ADD found other
	// ones in its namespace (a new sandbox of the pod, as after a node's
	// reboot): until the kubelet reports the new ones, the status is the
	// old sandbox's, and ips (the ADD's) are the pod's.
	staleStatus []netip.Addr
	params      ruleset.AmbientParams
	// applied: the rules are in the namespace (or were, before a
	// restart), so the pod's addresses belong in the probe set and the
	// pod in ztunnel's snapshot.
	applied bool
	// acked: ztunnel acknowledged the current namespace.
	acked bool
	// paramsUnknown: taken over from a previous agent with an annotation
	// this one cannot read; its rules are kept as they are (params is
	// not what they were made from, so verify leaves them) until the
	// annotation reads again.
	paramsUnknown bool
	// claim orders pods claiming one address: the latest enrolled wins
	// (the address was reused, and the older pod's deletion is late).
	claim uint64
	// lastEvent suppresses repeating the same Event for the same cause.
	lastEvent string
	// adopted: taken over at start from the previous agent, which
	// enrolled the pod but had not annotated it (adoptUnannotated).
	adopted bool
}

// Controller enrols the node's pods in the ambient mesh. Build it with
// New, run it with Run; AddPod is for the CNI server.
type Controller struct {
	cfg       Config
	log       *slog.Logger
	m         metrics
	hostNetns string
	procDir   string
	locker    *nslock.Locker
	uids      *nslock.Keyed[string]

	recorder record.EventRecorder
	events   record.EventBroadcaster
	queue    workqueue.TypedRateLimitingInterface[string]
	podInf   cache.SharedIndexInformer
	nsInf    cache.SharedIndexInformer
	// handled reports whether both handlers have been called for every
	// object of their informer's first list.
	handled []cache.InformerSynced

	// serving is closed once the ZDS server is up (srv set); stopped once
	// Run is returning.
	serving, stopped chan struct{}
	srvMu            sync.Mutex
	srv              *zds.Server

	mu   sync.Mutex
	pods map[string]*podState
	seq  uint64
	// ready: the state holds every enrolled pod of the node, so the probe
	// set may be synced to it (a partial state would prune the others).
	ready bool

	// hostMu serialises writes of the node's probe sets; probesHave,
	// under it, is what the sets held after the last write that
	// succeeded (nil when not known: before the first, after a failure).
	hostMu     sync.Mutex
	probesHave map[netip.Addr]string
	// staleGone: StaleHost's rules were removed; staleFailed: the checks
	// that failed to (both syncHost's alone, which runs in one goroutine
	// at a time).
	staleGone   bool
	staleFailed int
	runOnce     sync.Once
}

// New checks cfg and builds the controller's informers; nothing runs
// until Run.
func New(cfg Config) (*Controller, error) {
	switch {
	case cfg.Node == "":
		return nil, errors.New("ambient: no node name")
	case cfg.Kube == nil || cfg.Namespaces == nil:
		return nil, errors.New("ambient: no Kubernetes client for pods and namespaces")
	case cfg.InPod == nil || cfg.Host == nil:
		return nil, errors.New("ambient: no rule backend")
	case cfg.ZDS.Path == "":
		return nil, errors.New("ambient: no ztunnel socket path")
	}
	if cfg.Policy.Selectors == nil {
		cfg.Policy.Selectors = DefaultSelectors()
	}
	setDefault(&cfg.ZtunnelWait, DefaultZtunnelWait)
	setDefault(&cfg.HostInterval, DefaultHostInterval)
	setDefault(&cfg.VerifyInterval, DefaultVerifyInterval)
	setDefault(&cfg.RetryFirst, DefaultRetryFirst)
	setDefault(&cfg.RetryLimit, DefaultRetryLimit)
	if cfg.Workers <= 0 {
		cfg.Workers = DefaultWorkers
	}
	log := cfg.Log
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	log = log.With("component", "ambient")
	c := &Controller{cfg: cfg, log: log, hostNetns: cfg.HostNetns, procDir: cfg.ProcDir, locker: cfg.Locker,
		uids: nslock.NewKeyed[string](), serving: make(chan struct{}), stopped: make(chan struct{}), pods: map[string]*podState{}}
	if c.hostNetns == "" {
		c.hostNetns = "/proc/self/ns/net"
	}
	if c.procDir == "" {
		c.procDir = "/proc"
	}
	if c.locker == nil {
		c.locker = nslock.New()
	}
	var err error
	if c.m, err = newMetrics(cfg.Registerer, c); err != nil {
		return nil, fmt.Errorf("ambient: registering metrics: %w", err)
	}
	b := record.NewBroadcaster()
	c.events = b
	c.recorder = b.NewRecorder(kubeclient.Scheme, corev1.EventSource{Component: "istio-cni-ambient", Host: cfg.Node})
	c.queue = workqueue.NewTypedRateLimitingQueue(workqueue.NewTypedItemExponentialFailureRateLimiter[string](cfg.RetryFirst, cfg.RetryLimit))
	c.podInf = newPodInformer(cfg.Kube, cfg.Node)
	c.nsInf = newNamespaceInformer(cfg.Namespaces)
	return c, nil
}

func setDefault(d *time.Duration, v time.Duration) {
	if *d <= 0 {
		*d = v
	}
}

// Run serves until ctx ends: it syncs the informers, rebuilds the state
// of pods enrolled before it started (their namespaces found by /proc),
// re-asserts the node's rules and probe set, opens the ZDS socket, and
// then reconciles pods, re-asserts the node's rules and verifies enrolled
// pods periodically. It returns only once every goroutine it started has
// ended, the socket is closed and the held namespaces are released. It
// runs once.
func (c *Controller) Run(ctx context.Context) error {
	err := errors.New("ambient: the controller runs once")
	c.runOnce.Do(func() { err = c.run(ctx) })
	return err
}

func (c *Controller) run(ctx context.Context) error {
	defer close(c.stopped)
	defer c.releaseAll()
	var infWG sync.WaitGroup
	defer infWG.Wait()
	sink := c.events.StartRecordingToSink(c.cfg.Kube.Events())
	defer func() {
		sink.Stop()
		c.events.Shutdown()
	}()
	// Bound now, served once the snapshot is whole: ztunnel, redialling
	// with a back-off that grows to 15 s since the old agent went, gets
	// in at its next try, and its hello waits in the backlog meanwhile.
	zl, err := zds.Listen(c.cfg.ZDS.Path, c.log)
	if err != nil {
		return fmt.Errorf("ambient: %w", err)
	}
	served := false
	defer func() {
		if !served {
			_ = zl.Close()
		}
	}()
	infCtx, stopInformers := context.WithCancel(ctx)
	defer stopInformers()
	if err := c.addHandlers(); err != nil {
		return err
	}
	for _, inf := range []cache.SharedIndexInformer{c.podInf, c.nsInf} {
		infWG.Add(1)
		go func() {
			defer infWG.Done()
			inf.RunWithContext(infCtx)
		}()
	}
	defer c.queue.ShutDown()
	// The handlers' sync, not only the stores': an informer's store is
	// synced before its handlers have been called for the first list, and
	// such a late call would queue a pod again after the workers took it
	// over, sending ztunnel a second add of it beside the snapshot's.
	if !cache.WaitForCacheSync(ctx.Done(), c.handled...) {
		if ctx.Err() != nil {
			return nil
		}
		return errors.New("ambient: the pod and namespace informers did not sync")
	}
	c.rebuild()
	c.syncHost(true)

	zcfg := c.cfg.ZDS
	zcfg.Snapshotter = c
	if zcfg.Registerer == nil {
		zcfg.Registerer = c.cfg.Registerer
	}
	if zcfg.Log == nil {
		zcfg.Log = c.log
	}
	zcfg.Listener = zl
	srv, err := zds.New(zcfg)
	if err != nil {
		return fmt.Errorf("ambient: %w", err)
	}
	served = true
	c.srvMu.Lock()
	c.srv = srv
	c.srvMu.Unlock()
	close(c.serving)

	var wg sync.WaitGroup
	for range c.cfg.Workers {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for c.processNext(ctx) {
			}
		}()
	}
	wg.Add(2)
	go func() { defer wg.Done(); c.every(ctx, c.cfg.HostInterval, func() { c.syncHost(false) }) }()
	go func() { defer wg.Done(); c.every(ctx, c.cfg.VerifyInterval, func() { c.verifyAll(ctx) }) }()
	<-ctx.Done()
	c.queue.ShutDown()
	wg.Wait()
	// After the workers: an add in flight must not find the server gone.
	if err := srv.Close(); err != nil {
		c.log.Warn("closing the ztunnel socket", "error", err.Error())
	}
	return nil
}

func (c *Controller) every(ctx context.Context, d time.Duration, fn func()) {
	t := time.NewTicker(d)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
			fn()
		}
	}
}

// releaseAll closes the held namespaces once nothing can use them.
func (c *Controller) releaseAll() {
	c.mu.Lock()
	defer c.mu.Unlock()
	for _, st := range c.pods {
		if st.netns != nil {
			_ = st.netns.Close()
			st.netns = nil
		}
	}
}

func (c *Controller) server() *zds.Server {
	c.srvMu.Lock()
	defer c.srvMu.Unlock()
	return c.srv
}

// SocketHealth is nil while ztunnel can reach the ZDS socket by its
// path (or before it is served), else why not and since when.
func (c *Controller) SocketHealth() (time.Time, error) {
	if srv := c.server(); srv != nil {
		return srv.Health()
	}
	return time.Time{}, nil
}

// Ready reports whether the controller serves ztunnel: the informers
// synced and the pods enrolled before the agent started taken over.
func (c *Controller) Ready() bool {
	select {
	case <-c.serving:
		return true
	default:
		return false
	}
}

// Connected reports whether a ztunnel is connected, for readiness and
// the CNI server's messages.
func (c *Controller) Connected() bool {
	srv := c.server()
	return srv != nil && srv.Connected()
}

func (c *Controller) addHandlers() error {
	count := func(t string) { c.m.events.WithLabelValues(t).Inc() }
	podReg, err := c.podInf.AddEventHandler(cache.ResourceEventHandlerFuncs{
		AddFunc:    func(obj any) { count("add"); c.enqueuePod(obj) },
		UpdateFunc: func(_, obj any) { count("update"); c.enqueuePod(obj) },
		DeleteFunc: func(obj any) { count("delete"); c.enqueuePod(obj) },
	})
	if err != nil {
		return fmt.Errorf("ambient: pod handlers: %w", err)
	}
	nsReg, err := c.nsInf.AddEventHandler(cache.ResourceEventHandlerFuncs{
		AddFunc: func(obj any) { count("add"); c.enqueueNamespace(obj) },
		UpdateFunc: func(old, obj any) {
			count("update")
			o, ok1 := old.(*corev1.Namespace)
			n, ok2 := obj.(*corev1.Namespace)
			// Only labels decide; a resync or an annotation changes nothing.
			if ok1 && ok2 && !mapsEqual(o.Labels, n.Labels) {
				c.enqueueNamespace(obj)
			}
		},
	})
	if err != nil {
		return fmt.Errorf("ambient: namespace handlers: %w", err)
	}
	c.handled = []cache.InformerSynced{podReg.HasSynced, nsReg.HasSynced}
	return nil
}

func mapsEqual(a, b map[string]string) bool {
	if len(a) != len(b) {
		return false
	}
	for k, v := range a {
		if w, ok := b[k]; !ok || w != v {
			return false
		}
	}
	return true
}

func (c *Controller) enqueuePod(obj any) {
	if d, ok := obj.(cache.DeletedFinalStateUnknown); ok {
		obj = d.Obj
	}
	if p, ok := obj.(*corev1.Pod); ok {
		c.queue.Add(string(p.UID))
	}
}

// enqueueNamespace re-evaluates every pod of the namespace.
func (c *Controller) enqueueNamespace(obj any) {
	n, ok := obj.(*corev1.Namespace)
	if !ok {
		return
	}
	objs, _ := c.podInf.GetIndexer().ByIndex(cache.NamespaceIndex, n.Name)
	for _, o := range objs {
		c.enqueuePod(o)
	}
}

func (c *Controller) podByUID(uid string) *corev1.Pod {
	objs, _ := c.podInf.GetIndexer().ByIndex(uidIndex, uid)
	for _, o := range objs {
		if p, ok := o.(*corev1.Pod); ok {
			return p
		}
	}
	return nil
}

func (c *Controller) namespaceLabels(name string) (map[string]string, bool) {
	obj, ok, _ := c.nsInf.GetStore().GetByKey(name)
	if !ok {
		return nil, false
	}
	n, ok := obj.(*corev1.Namespace)
	if !ok {
		return nil, false
	}
	return n.Labels, true
}

// ShouldEnrol decides a pod against the namespace cache, for the CNI
// server's ADD. An unknown namespace is an error, never a "no": the pod
// would start unmeshed.
func (c *Controller) ShouldEnrol(pod *corev1.Pod) (Decision, error) {
	nsLabels, ok := c.namespaceLabels(pod.Namespace)
	if !ok {
		if !c.nsInf.HasSynced() {
			return Decision{}, fmt.Errorf("namespace %s of pod %s/%s: the namespace cache has not synced yet", pod.Namespace, pod.Namespace, pod.Name)
		}
		return Decision{}, fmt.Errorf("namespace %s of pod %s/%s is not in the namespace cache", pod.Namespace, pod.Namespace, pod.Name)
	}
	return decide(c.cfg.Policy, pod, nsLabels), nil
}

func (c *Controller) processNext(ctx context.Context) bool {
	uid, shutdown := c.queue.Get()
	if shutdown {
		return false
	}
	defer c.queue.Done(uid)
	err := c.reconcile(ctx, uid)
	var perm *permanentError
	switch {
	case errors.Is(err, errAwaitSnapshot):
		c.log.Debug("pod taken over; ztunnel's next snapshot carries it", "uid", uid)
		c.queue.Forget(uid)
	case err == nil, errors.As(err, &perm), ctx.Err() != nil:
		c.queue.Forget(uid)
	default:
		c.log.Info("pod not reconciled; retrying", "uid", uid, "error", err.Error(), "attempts", c.queue.NumRequeues(uid)+1)
		c.queue.AddRateLimited(uid)
	}
	return true
}

// permanentError is a failure no retry can mend until the pod changes
// (which queues it again).
type permanentError struct{ err error }

func (e *permanentError) Error() string { return e.err.Error() }
func (e *permanentError) Unwrap() error { return e.err }

func terminal(p *corev1.Pod) bool {
	return p.Status.Phase == corev1.PodSucceeded || p.Status.Phase == corev1.PodFailed
}

// reconcile brings one pod to what its labels, its namespace's labels
// and its life say.
func (c *Controller) reconcile(ctx context.Context, uid string) error {
	pod := c.podByUID(uid)
	if pod == nil {
		if c.notSeenYet(ctx, uid) {
			// Enrolled by its ADD, which read it from the API server,
			// before the informer's add: not gone, only not here yet.
			return fmt.Errorf("pod %s is not in the pod cache yet", uid)
		}
		return c.teardown(ctx, uid, nil, true)
	}
	if terminal(pod) {
		// A finished Job's pod: its sandbox is gone, nothing to undo in it.
		return c.teardown(ctx, uid, pod, true)
	}
	nsLabels, ok := c.namespaceLabels(pod.Namespace)
	if !ok {
		return fmt.Errorf("namespace %s of pod %s/%s is not in the namespace cache (yet)", pod.Namespace, pod.Namespace, pod.Name)
	}
	d := decide(c.cfg.Policy, pod, nsLabels)
	if !d.Enrol {
		return c.teardown(ctx, uid, pod, false)
	}
	ips := c.currentIPs(uid, podIPs(pod))
	if c.upToDate(pod, ips) {
		return nil
	}
	if c.enrolledAsAsked(pod, ips) {
		// Enrolled on its ADD, annotated here.
		return c.annotate(ctx, pod, RedirectionEnabled)
	}
	if len(ips) == 0 && !c.holds(uid) {
		// Not started yet: its ADD enrols it, or an update with its IPs.
		return nil
	}
	return c.enrol(ctx, pod, nil, ips, 0, "controller")
}

// notSeenYet reports whether a pod the controller holds but its informer
// does not still exists: asked of the API server by the name its state
// keeps, and the same UID. A read that fails counts as existing: tearing
// down a running pod's redirection on a failed read would be worse than a
// retry.
func (c *Controller) notSeenYet(ctx context.Context, uid string) bool {
	c.mu.Lock()
	st := c.pods[uid]
	var ns, name string
	if st != nil {
		ns, name = st.info.Namespace, st.info.Name
	}
	c.mu.Unlock()
	if name == "" {
		return false
	}
	ctx, cancel := context.WithTimeout(ctx, lookupTimeout)
	defer cancel()
	p, err := c.cfg.Kube.Pods(ns).Get(ctx, name, metav1.GetOptions{})
	switch {
	case apierrors.IsNotFound(err):
		return false
	case err != nil:
		return true
	}
	return string(p.UID) == uid
}

func podIPs(p *corev1.Pod) []netip.Addr {
	var out []netip.Addr
	for _, ip := range p.Status.PodIPs {
		if a, err := netip.ParseAddr(ip.IP); err == nil {
			out = append(out, a.Unmap())
		}
	}
	if len(out) == 0 && p.Status.PodIP != "" {
		if a, err := netip.ParseAddr(p.Status.PodIP); err == nil {
			out = append(out, a.Unmap())
		}
	}
	return out
}

// overlap reports whether a and b share an address (both unmapped, as
// podIPs, probeIPs and the namespace's addresses are).
func overlap(a, b []netip.Addr) bool {
	return slices.ContainsFunc(a, func(x netip.Addr) bool { return slices.Contains(b, x) })
}

// currentIPs is the pod's addresses: its status's, unless they are still
// those its last ADD found stale (staleStatus).
func (c *Controller) currentIPs(uid string, status []netip.Addr) []netip.Addr {
	c.mu.Lock()
	defer c.mu.Unlock()
	if st := c.pods[uid]; st != nil && st.staleStatus != nil && slices.Equal(c.probeIPs(status), st.staleStatus) {
		return slices.Clone(st.ips)
	}
	return status
}

// upToDate: enrolled as the pod now asks, acknowledged and annotated.
func (c *Controller) upToDate(pod *corev1.Pod, ips []netip.Addr) bool {
	return pod.Annotations[AnnotationRedirection] == RedirectionEnabled && c.enrolledAsAsked(pod, ips)
}

// enrolledAsAsked: upToDate but for the annotation.
func (c *Controller) enrolledAsAsked(pod *corev1.Pod, ips []netip.Addr) bool {
	params, err := PodParams(pod, c.cfg.Defaults)
	if err != nil {
		return false
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	st := c.pods[string(pod.UID)]
	return st != nil && st.netns != nil && st.applied && st.acked &&
		equalParams(st.params, params) && (len(ips) == 0 || slices.Equal(st.ips, c.probeIPs(ips)))
}

func equalParams(a, b ruleset.AmbientParams) bool {
	return a.DNSCapture == b.DNSCapture && a.IPv6 == b.IPv6 && a.BypassInbound == b.BypassInbound &&
		slices.Equal(a.RerouteInterfaces, b.RerouteInterfaces)
}

func (c *Controller) holds(uid string) bool {
	c.mu.Lock()
	defer c.mu.Unlock()
	st := c.pods[uid]
	return st != nil && st.netns != nil
}

// probeIPs are the addresses of ips the probe sets can hold: IPv6 only
// with the IPv6 set.
func (c *Controller) probeIPs(ips []netip.Addr) []netip.Addr {
	var out []netip.Addr
	for _, ip := range ips {
		if ip.Unmap().Is4() || c.cfg.HostParams.IPv6 {
			out = append(out, ip.Unmap())
		}
	}
	// Sorted, so the status's order (IPv6 first on an IPv6-primary
	// cluster) and the namespace's (IPv4 first) compare equal, and the
	// pod is not enrolled again when its status comes.
	slices.SortFunc(out, netip.Addr.Compare)
	return out
}

// AddPod enrols a pod on its CNI ADD, with its network namespace (the
// relay's descriptor; AddPod keeps a duplicate, the caller keeps and
// closes its own). It programs the pod's rules and routing, adds its
// addresses to the node's probe set, hands the namespace to ztunnel and
// waits for the acknowledgement (for up to ZtunnelWait for a ztunnel to
// be connected), and annotates the pod enabled. The pod's IPs are its
// status's, else the namespace's own addresses (an ADD runs before the
// kubelet reports them, and for a new sandbox of a pod the status holds
// the old one's until then). An error names the pod and what failed; the pod
// is then annotated pending if ztunnel was the cause, and the controller
// keeps retrying the ztunnel step.
//
// AddPod does not decide: call it for a pod ShouldEnrol enrols.
func (c *Controller) AddPod(ctx context.Context, pod *corev1.Pod, netns *os.File) error {
	if pod == nil || netns == nil {
		return errors.New("ambient: AddPod needs the pod and its network namespace")
	}
	select {
	case <-c.stopped:
		return fmt.Errorf("ambient enrolment of pod %s/%s: the agent's ambient controller is stopping", pod.Namespace, pod.Name)
	default:
	}
	if cached := c.podByUID(string(pod.UID)); cached != nil {
		// The cache's copy has what the caller's may lack (service account).
		pod = cached
	}
	f, err := dupFile(netns)
	if err != nil {
		return fmt.Errorf("ambient enrolment of pod %s/%s: keeping its network namespace: %w", pod.Namespace, pod.Name, err)
	}
	// The status's addresses, when the namespace holds one of them (it
	// may hold more: a secondary network's); else the namespace's own,
	// this sandbox's, while the status is still an earlier sandbox's.
	ips, err := netnsAddrs(f)
	if err != nil {
		_ = f.Close()
		return fmt.Errorf("ambient enrolment of pod %s/%s: reading its addresses: %w", pod.Namespace, pod.Name, err)
	}
	if status := podIPs(pod); len(ips) == 0 || overlap(status, ips) {
		ips = status
	}
	if err := c.enrol(ctx, pod, f, ips, c.cfg.ZtunnelWait, "cni"); err != nil {
		return fmt.Errorf("ambient enrolment of pod %s/%s (uid %s): %w", pod.Namespace, pod.Name, pod.UID, err)
	}
	return nil
}

func dupFile(f *os.File) (*os.File, error) {
	rc, err := f.SyscallConn()
	if err != nil {
		return nil, err
	}
	var nfd int
	var derr error
	if err := rc.Control(func(fd uintptr) { nfd, derr = unix.FcntlInt(fd, unix.F_DUPFD_CLOEXEC, 0) }); err != nil {
		return nil, err
	}
	if derr != nil {
		return nil, derr
	}
	return os.NewFile(uintptr(nfd), "netns"), nil
}

// errAwaitSnapshot: the pod waits for the next ztunnel's snapshot, which
// requeues it (SnapshotDone); no back-off retry is needed before.
var errAwaitSnapshot = errors.New("waiting for ztunnel's snapshot")

// errZtunnel wraps a failure of the ztunnel step: the pod is pending.
type errZtunnel struct{ err error }

func (e *errZtunnel) Error() string { return e.err.Error() }
func (e *errZtunnel) Unwrap() error { return e.err }

// enrol does the enrolment's steps in order; netns, when given, is the
// pod's namespace and becomes the controller's to close.
func (c *Controller) enrol(ctx context.Context, pod *corev1.Pod, netns *os.File, ips []netip.Addr, wait time.Duration, source string) error {
	start := time.Now()
	uid := string(pod.UID)
	unlock := c.uids.Lock(uid)
	defer unlock()
	err := c.enrolLocked(ctx, pod, netns, ips, wait, source == "cni")
	var zerr *errZtunnel
	switch {
	case errors.Is(err, errAwaitSnapshot):
	case err == nil:
		c.m.enrols.WithLabelValues(source, "enabled").Inc()
		c.m.duration.WithLabelValues(source).Observe(time.Since(start).Seconds())
	case errors.As(err, &zerr):
		c.m.enrols.WithLabelValues(source, "pending").Inc()
	default:
		c.m.enrols.WithLabelValues(source, "failed").Inc()
	}
	return err
}

func (c *Controller) enrolLocked(ctx context.Context, pod *corev1.Pod, netns *os.File, ips []netip.Addr, wait time.Duration, onADD bool) error {
	uid := string(pod.UID)
	if !onADD {
		// An ADD may have enrolled a new sandbox since the caller read
		// the status (it waited for the pod's lock).
		ips = c.currentIPs(uid, ips)
	}
	params, err := PodParams(pod, c.cfg.Defaults)
	if err != nil {
		if netns != nil {
			_ = netns.Close()
		}
		c.event(pod, nil, corev1.EventTypeWarning, "AmbientInvalidAnnotation", "not enrolled in the ambient mesh: %v", err)
		return &permanentError{err}
	}
	c.mu.Lock()
	st := c.pods[uid]
	if st == nil {
		st = &podState{uid: uid}
		c.pods[uid] = st
	}
	st.info = zds.WorkloadInfo{Name: pod.Name, Namespace: pod.Namespace, ServiceAccount: pod.Spec.ServiceAccountName}
	switch old := st.netns; {
	case netns == nil:
	case sameNetns(old, netns):
		// The namespace already held (a repeated ADD): the held file
		// stays, as a snapshot being sent may be using it.
		_ = netns.Close()
	default:
		if old != nil {
			// A new sandbox of the pod: ztunnel must get the new one.
			st.acked = false
			_ = old.Close()
		}
		st.netns = netns
	}
	held := st.netns
	c.mu.Unlock()

	if held == nil {
		f, err := (&netnsIndex{procDir: c.procDir}).find(uid, ips, pod.Spec.HostUsers)
		if err != nil {
			c.event(pod, st, corev1.EventTypeWarning, "AmbientNetnsNotFound", "cannot enrol in the ambient mesh yet: %v", err)
			return err
		}
		c.mu.Lock()
		st.netns, st.acked = f, false
		c.mu.Unlock()
		held = f
	}

	if len(ips) == 0 {
		// Before the kubelet reports them: the addresses the ADD found, or
		// the namespace's own.
		c.mu.Lock()
		ips = slices.Clone(st.ips)
		c.mu.Unlock()
		if len(ips) == 0 {
			if ips, err = netnsAddrs(held); err != nil {
				return fmt.Errorf("reading the pod's addresses: %w", err)
			}
		}
	}
	unlockNS, err := c.lockNetns(held)
	if err != nil {
		return err
	}
	_, err = c.cfg.InPod.ApplyAmbient(fdPath(held), params)
	unlockNS()
	if err != nil {
		c.event(pod, st, corev1.EventTypeWarning, "AmbientRulesFailed", "programming the pod's ambient redirection failed: %v", err)
		return fmt.Errorf("programming the pod's network namespace: %w", err)
	}
	c.mu.Lock()
	st.params, st.paramsUnknown, st.applied, st.ips = params, false, true, c.probeIPs(ips)
	switch status := c.probeIPs(podIPs(pod)); {
	case onADD && len(status) > 0 && !overlap(status, st.ips):
		st.staleStatus = status
	case !onADD && slices.Equal(status, st.staleStatus):
		// Still the old sandbox's: the kubelet has not reported yet.
	default:
		st.staleStatus = nil
	}
	c.seq++
	st.claim = c.seq
	info, adopted := st.info, st.adopted
	c.mu.Unlock()

	if _, err := c.syncProbes(false); err != nil {
		return err
	}

	if err := c.sendAdd(ctx, uid, info, held, wait); err != nil {
		c.mu.Lock()
		st.acked = false
		c.mu.Unlock()
		if !onADD && errors.Is(err, zds.ErrNotConnected) && (pod.Annotations[AnnotationRedirection] == RedirectionEnabled || adopted) {
			// Taken over from a previous agent before any ztunnel
			// connected: ztunnel still runs the pod (it did not restart,
			// the agent did), and its next snapshot carries it. Marking it
			// pending would be untrue, and a rollout would flip every pod.
			return errAwaitSnapshot
		}
		if aerr := c.annotate(ctx, pod, RedirectionPending); aerr != nil {
			err = errors.Join(err, aerr)
		}
		c.event(pod, st, corev1.EventTypeWarning, "AmbientPending",
			"rules are in place but ztunnel has not taken the pod (its traffic is held until it does): %v", err)
		return &errZtunnel{err}
	}
	c.mu.Lock()
	st.acked = true
	st.lastEvent = ""
	c.mu.Unlock()
	if onADD && pod.Annotations[AnnotationRedirection] != RedirectionEnabled {
		// The pod's traffic is ztunnel's now; its annotation is news for
		// others, which an API round trip (or an API server away) must
		// not hold the sandbox's start for: the work queue writes it.
		c.queue.Add(uid)
		return nil
	}
	return c.annotate(ctx, pod, RedirectionEnabled)
}

// sendAdd hands the pod to the newest ztunnel, waiting up to wait for one
// to be connected.
func (c *Controller) sendAdd(ctx context.Context, uid string, info zds.WorkloadInfo, netns *os.File, wait time.Duration) error {
	deadline := time.Now().Add(wait)
	for {
		if srv := c.server(); srv != nil {
			err := srv.AddWorkload(ctx, zds.Pod{UID: uid, Info: info, Netns: netns})
			if !errors.Is(err, zds.ErrNotConnected) {
				return err
			}
		}
		left := time.Until(deadline)
		if left <= 0 {
			if wait > 0 {
				return fmt.Errorf("%w within %s", zds.ErrNotConnected, wait)
			}
			return zds.ErrNotConnected
		}
		wctx, cancel := context.WithTimeout(ctx, left)
		err := c.waitConnected(wctx)
		cancel()
		if err != nil && ctx.Err() != nil {
			return fmt.Errorf("waiting for ztunnel: %w", ctx.Err())
		}
	}
}

func (c *Controller) waitConnected(ctx context.Context) error {
	select {
	case <-c.serving:
	case <-ctx.Done():
		return ctx.Err()
	}
	return c.server().WaitConnected(ctx)
}

// SnapshotAcked records ztunnel's acknowledgement of a pod's namespace
// in a new connection's snapshot (zds.SnapshotObserver).
func (c *Controller) SnapshotAcked(uid string, netns *os.File) { c.snapshotAnswer(uid, netns, true) }

// SnapshotRefused records ztunnel's refusal of a pod's namespace in a
// new connection's snapshot (zds.SnapshotObserver): the pod is no longer
// acknowledged, even if an earlier ztunnel had taken it, so SnapshotDone
// retries it (and a refusal again marks it pending). Left acknowledged,
// it would stay captured with no proxy in the new ztunnel, and verify
// would count it fine.
func (c *Controller) SnapshotRefused(uid string, netns *os.File) { c.snapshotAnswer(uid, netns, false) }

// snapshotAnswer records ztunnel's answer to a snapshot's add of the pod
// with netns, if that is still the pod's namespace (a keep has none).
func (c *Controller) snapshotAnswer(uid string, netns *os.File, acked bool) {
	if netns == nil {
		return
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	if st := c.pods[uid]; st != nil && st.netns == netns {
		st.acked = acked
	}
}

// SnapshotDone retries, once a new ztunnel has its snapshot, the pods it
// has not acknowledged (not in the snapshot, refused there, or waiting
// since before it connected), and those a previous agent left pending.
// Retrying on the connection alone, before the snapshot's end, would
// send every enrolled pod twice.
func (c *Controller) SnapshotDone() {
	c.mu.Lock()
	var retry []string
	for uid, st := range c.pods {
		if !st.acked {
			retry = append(retry, uid)
		}
	}
	c.mu.Unlock()
	for _, uid := range retry {
		c.queue.Add(uid)
	}
	for _, o := range c.podInf.GetStore().List() {
		if p, ok := o.(*corev1.Pod); ok && p.Annotations[AnnotationRedirection] == RedirectionPending {
			c.queue.Add(string(p.UID))
		}
	}
}

// teardown undoes a pod's enrolment, in the reference's order: its
// addresses out of the probe set, its rules and routing out of its
// namespace (unless gone: deleted or finished, its namespace with it),
// ztunnel told (every connection), the namespace released, and the
// annotation removed (unless gone).
func (c *Controller) teardown(ctx context.Context, uid string, pod *corev1.Pod, gone bool) error {
	unlock := c.uids.Lock(uid)
	defer unlock()
	c.mu.Lock()
	st := c.pods[uid]
	c.mu.Unlock()
	annotated := pod != nil && pod.Annotations[AnnotationRedirection] != ""
	if st == nil && (!annotated || gone) {
		return nil
	}
	if st == nil {
		// Enrolled by a previous agent, its namespace never found: what
		// can be undone is the annotation, and ztunnel's proxy (the
		// snapshot's keep).
		st = &podState{uid: uid}
	}
	c.mu.Lock()
	wasApplied := st.applied
	st.applied, st.ips = false, nil
	held := st.netns
	c.mu.Unlock()
	if _, err := c.syncProbes(false); err != nil {
		return err
	}
	// A held namespace may hold rules though none was recorded applied:
	// an apply that failed after writing some (one family, or its
	// routing), or a removal that failed before. Removal is idempotent.
	if !gone && (wasApplied || annotated || held != nil) {
		if held == nil {
			f, err := (&netnsIndex{procDir: c.procDir}).find(uid, podIPs(pod), pod.Spec.HostUsers)
			if err != nil {
				return fmt.Errorf("removing the ambient redirection of pod %s/%s: %w", pod.Namespace, pod.Name, err)
			}
			c.mu.Lock()
			st.netns = f
			if c.pods[uid] == nil {
				c.pods[uid] = st
			}
			c.mu.Unlock()
			held = f
		}
		unlockNS, err := c.lockNetns(held)
		if err != nil {
			return err
		}
		_, err = c.cfg.InPod.RemoveAmbient(fdPath(held))
		unlockNS()
		if err != nil {
			return fmt.Errorf("removing the ambient redirection of pod %s/%s: %w", pod.Namespace, pod.Name, err)
		}
	}
	if srv := c.server(); srv != nil {
		if err := srv.DelWorkload(ctx, uid); err != nil {
			return fmt.Errorf("telling ztunnel pod %s is gone: %w", uid, err)
		}
	}
	c.mu.Lock()
	delete(c.pods, uid)
	if st.netns != nil {
		// Only now: a snapshot being sent may still be using it, and the
		// del above queued behind that snapshot.
		_ = st.netns.Close()
		st.netns = nil
	}
	c.mu.Unlock()
	if !gone && annotated {
		return c.annotate(ctx, pod, "")
	}
	return nil
}

// syncProbes brings the node's probe sets to the enrolled pods'
// addresses, by difference. Until the state holds every enrolled pod
// (before the start-up rebuild) it does nothing: the set would lose
// entries of pods not yet known.
//
// A pod's start or end changes the sets by what changed in the state
// since the last write, without reading them: on a node of hundreds of
// enrolled pods, reading both sets on every enrolled pod's ADD cost more
// than the write. A full sync, reading the sets, runs when full is set
// (the periodic check for drift), when the last write is not known to
// have succeeded, and when the kernel refuses the changes.
func (c *Controller) syncProbes(full bool) (podnet.ProbeChanges, error) {
	c.hostMu.Lock()
	defer c.hostMu.Unlock()
	c.mu.Lock()
	if !c.ready {
		c.mu.Unlock()
		return podnet.ProbeChanges{}, nil
	}
	want := map[netip.Addr]string{}
	claims := map[netip.Addr]uint64{}
	for uid, st := range c.pods {
		if !st.applied {
			continue
		}
		for _, ip := range st.ips {
			if cl, ok := claims[ip]; ok && cl > st.claim {
				continue
			}
			want[ip], claims[ip] = uid, st.claim
		}
	}
	c.mu.Unlock()
	if !full && c.probesHave != nil {
		ch := podnet.DiffProbes(c.probesHave, want)
		err := c.cfg.Host.ChangeProbes(c.hostNetns, ch, want)
		if err == nil {
			c.probesHave = want
			if !ch.Empty() {
				c.log.Debug("probe set changed", "added", ch.Added, "updated", ch.Updated, "removed", ch.Removed)
			}
			return ch, nil
		}
		c.log.Info("changing the node's probe set failed; syncing it whole", "error", err.Error())
	}
	c.probesHave = nil
	ch, err := c.cfg.Host.SyncProbes(c.hostNetns, want)
	if err != nil {
		// The node's table or sets may be gone (a firewall manager's
		// flush of the whole ruleset): put them back now, not at the next
		// periodic check, or every enrolling pod fails until then.
		if wrote, eerr := c.cfg.Host.EnsureHost(c.hostNetns, c.cfg.HostParams); eerr == nil && wrote {
			c.m.host.WithLabelValues("rules").Inc()
			c.log.Warn("the node's probe SNAT rules were missing or changed; put back", "found", "syncing the probe set", "error", err.Error())
			ch, err = c.cfg.Host.SyncProbes(c.hostNetns, want)
		}
	}
	if err != nil {
		return ch, fmt.Errorf("syncing the node's probe set: %w", err)
	}
	c.probesHave = want
	if !ch.Empty() {
		c.log.Debug("probe set synced", "added", ch.Added, "updated", ch.Updated, "removed", ch.Removed)
	}
	return ch, nil
}

// staleTries is how many checks try to remove StaleHost's rules.
const staleTries = 3

// syncHost re-asserts the node's probe SNAT and then the probe set: a
// firewall manager may have flushed either. Every change of the state
// syncs the set at once, so a difference found here is drift.
func (c *Controller) syncHost(first bool) {
	// Under the sets' lock: EnsureHost may make them anew, empty, and a
	// pod's change meanwhile would be made against what they held.
	c.hostMu.Lock()
	wrote, err := c.cfg.Host.EnsureHost(c.hostNetns, c.cfg.HostParams)
	if wrote || err != nil {
		c.probesHave = nil
	}
	c.hostMu.Unlock()
	switch {
	case err != nil:
		c.log.Error("re-asserting the node's probe SNAT failed", "error", err.Error())
	case wrote && !first:
		c.m.host.WithLabelValues("rules").Inc()
		c.log.Warn("the node's probe SNAT rules were missing or changed; put back")
	}
	if err == nil && c.cfg.StaleHost != nil && !c.staleGone && c.staleFailed < staleTries {
		// Once ours is in place, so probes are never left without one.
		if serr := c.cfg.StaleHost.RemoveHost(c.hostNetns); serr != nil {
			// Said once: a node without the other backend's kernel parts
			// fails the same way at every check.
			lv := slog.LevelDebug
			if c.staleFailed == 0 {
				lv = slog.LevelWarn
			}
			c.staleFailed++
			c.log.Log(context.Background(), lv, "removing the other rule backend's probe SNAT (an earlier agent's) failed; retried at the next checks",
				"error", serr.Error(), "failures", c.staleFailed)
			if c.staleFailed == staleTries {
				// A node without the other backend's kernel parts (no
				// ipset) fails the same way every time, at the cost of
				// iptables-save runs: uninstall tries once more.
				c.log.Info("no longer trying to remove the other rule backend's probe SNAT", "failures", c.staleFailed)
			}
		} else {
			c.staleGone = true
		}
	}
	ch, err := c.syncProbes(true)
	switch {
	case err != nil:
		c.log.Error("re-asserting the node's probe set failed", "error", err.Error())
	case !ch.Empty() && !first:
		c.m.host.WithLabelValues("probes").Inc()
		c.log.Warn("the node's probe set was missing entries or held wrong ones; put back",
			"added", ch.Added, "updated", ch.Updated, "removed", ch.Removed)
	}
}

// rebuild takes over the pods a previous agent enrolled (annotated
// enabled or pending): their namespaces are found by /proc, and they go
// into ztunnel's snapshot (an add with the namespace, else a keep). Then
// every pod is queued, so each is reconciled: rules re-applied, ztunnel
// re-acknowledging, un-enrolment of those no longer selected.
func (c *Controller) rebuild() {
	idx := &netnsIndex{procDir: c.procDir}
	var all []string
	for _, o := range c.podInf.GetStore().List() {
		pod, ok := o.(*corev1.Pod)
		if !ok {
			continue
		}
		uid := string(pod.UID)
		all = append(all, uid)
		ann := pod.Annotations[AnnotationRedirection]
		if terminal(pod) {
			continue
		}
		if ann != RedirectionEnabled && ann != RedirectionPending {
			c.adoptUnannotated(idx, pod)
			continue
		}
		// Left out of the snapshot, an enrolled pod whose annotation no
		// longer reads would lose its proxy while its rules still send
		// its traffic there: it is kept as it is, and its Event says why
		// it is not enrolled anew.
		params, perr := PodParams(pod, c.cfg.Defaults)
		if perr != nil {
			c.log.Warn("a pod enrolled before the agent started has an annotation this agent cannot read; its rules and ztunnel's proxy are kept as they are",
				"pod", pod.Namespace+"/"+pod.Name, "error", perr.Error())
		}
		ips := podIPs(pod)
		f, err := idx.find(uid, ips, pod.Spec.HostUsers)
		if err != nil {
			c.log.Warn("no network namespace found for a pod enrolled before the agent started; ztunnel keeps it as it is",
				"pod", pod.Namespace+"/"+pod.Name, "error", err.Error())
			f = nil
		}
		c.mu.Lock()
		if c.pods[uid] == nil {
			c.seq++
			c.pods[uid] = &podState{uid: uid, netns: f, ips: c.probeIPs(ips), params: params, paramsUnknown: perr != nil, applied: true, claim: c.seq,
				info: zds.WorkloadInfo{Name: pod.Name, Namespace: pod.Namespace, ServiceAccount: pod.Spec.ServiceAccountName}}
		} else if f != nil {
			_ = f.Close()
		}
		c.mu.Unlock()
	}
	c.mu.Lock()
	c.ready = true
	c.mu.Unlock()
	for _, uid := range all {
		c.queue.Add(uid)
	}
}

// adoptUnannotated takes into the first snapshot a pod the agent before
// this one enrolled on its ADD but had not annotated yet (the annotation
// is written after the ADD returns, and it stopped meanwhile, or the API
// server kept refusing it): selected, running, and its namespace holding
// exactly its rules. Left out, ztunnel would drop the pod's proxy while
// its rules still send its traffic there, until the pod was enrolled
// anew.
func (c *Controller) adoptUnannotated(idx *netnsIndex, pod *corev1.Pod) {
	ips := podIPs(pod)
	if len(ips) == 0 {
		return
	}
	nsLabels, ok := c.namespaceLabels(pod.Namespace)
	if !ok || !decide(c.cfg.Policy, pod, nsLabels).Enrol {
		return
	}
	params, err := PodParams(pod, c.cfg.Defaults)
	if err != nil {
		return
	}
	uid := string(pod.UID)
	f, err := idx.find(uid, ips, pod.Spec.HostUsers)
	if err != nil {
		return
	}
	if err := c.cfg.InPod.CheckAmbient(fdPath(f), params); err != nil {
		_ = f.Close()
		return
	}
	c.log.Info("a pod enrolled before the agent started, not yet annotated, has its rules in place; ztunnel keeps it",
		"pod", pod.Namespace+"/"+pod.Name)
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.pods[uid] != nil {
		_ = f.Close()
		return
	}
	c.seq++
	c.pods[uid] = &podState{uid: uid, netns: f, ips: c.probeIPs(ips), params: params, applied: true, claim: c.seq, adopted: true,
		info: zds.WorkloadInfo{Name: pod.Name, Namespace: pod.Namespace, ServiceAccount: pod.Spec.ServiceAccountName}}
}

// Snapshot is what a newly connected ztunnel is told: every pod whose
// rules are in place, with its namespace when held (an add), else a
// keep.
func (c *Controller) Snapshot() []zds.Pod {
	c.mu.Lock()
	defer c.mu.Unlock()
	out := make([]zds.Pod, 0, len(c.pods))
	for uid, st := range c.pods {
		if st.applied {
			out = append(out, zds.Pod{UID: uid, Info: st.info, Netns: st.netns})
		}
	}
	sort.Slice(out, func(i, j int) bool { return out[i].UID < out[j].UID })
	return out
}

func (c *Controller) counts() map[string]int {
	c.mu.Lock()
	defer c.mu.Unlock()
	out := map[string]int{}
	for _, st := range c.pods {
		switch {
		case !st.applied:
		case st.netns == nil:
			out["unreachable"]++
		case st.acked:
			out["enabled"]++
		default:
			out["pending"]++
		}
	}
	return out
}

// verifyAll checks every enrolled pod: its rules and routing are what
// they should be (else put back, with an Event), ztunnel acknowledged it
// and it is annotated so (else it is queued).
func (c *Controller) verifyAll(ctx context.Context) {
	c.mu.Lock()
	uids := make([]string, 0, len(c.pods))
	for uid := range c.pods {
		uids = append(uids, uid)
	}
	c.mu.Unlock()
	for _, uid := range uids {
		if ctx.Err() != nil {
			return
		}
		c.verify(uid)
	}
}

func (c *Controller) verify(uid string) {
	unlock := c.uids.Lock(uid)
	defer unlock()
	c.mu.Lock()
	st := c.pods[uid]
	var held *os.File
	var params ruleset.AmbientParams
	applied, acked, unknown := false, false, false
	if st != nil {
		held, params, applied, acked, unknown = st.netns, st.params, st.applied, st.acked, st.paramsUnknown
	}
	c.mu.Unlock()
	if !applied || unknown {
		return
	}
	pod := c.podByUID(uid)
	if held == nil {
		c.m.verify.WithLabelValues("unreachable").Inc()
		if pod != nil {
			c.event(pod, st, corev1.EventTypeWarning, "AmbientNetnsNotFound",
				"enrolled in the ambient mesh, but its network namespace was not found on the node; retrying")
		}
		c.queue.Add(uid)
		return
	}
	unlockNS, err := c.lockNetns(held)
	if err != nil {
		c.m.verify.WithLabelValues("failed").Inc()
		return
	}
	checkErr := c.cfg.InPod.CheckAmbient(fdPath(held), params)
	var applyErr error
	if checkErr != nil {
		_, applyErr = c.cfg.InPod.ApplyAmbient(fdPath(held), params)
	}
	unlockNS()
	switch {
	case checkErr != nil && applyErr != nil:
		c.m.verify.WithLabelValues("failed").Inc()
		c.log.Error("an enrolled pod's rules are wrong and could not be put back", "uid", uid, "check", checkErr.Error(), "error", applyErr.Error())
		if pod != nil {
			c.event(pod, st, corev1.EventTypeWarning, "AmbientRulesBroken", "ambient redirection is not as it should be (%v) and could not be put back: %v", checkErr, applyErr)
		}
		return
	case checkErr != nil:
		c.m.verify.WithLabelValues("repaired").Inc()
		c.log.Warn("an enrolled pod's rules were wrong; put back", "uid", uid, "found", checkErr.Error())
		if pod != nil {
			// Always reported: each repair is news.
			c.recorder.Eventf(pod, corev1.EventTypeWarning, "AmbientRulesRepaired", "ambient redirection was not as it should be and was put back: %v", checkErr)
		}
	}
	if !acked || (pod != nil && pod.Annotations[AnnotationRedirection] != RedirectionEnabled) {
		c.m.verify.WithLabelValues("pending").Inc()
		c.queue.Add(uid)
		return
	}
	if checkErr == nil {
		c.m.verify.WithLabelValues("ok").Inc()
	}
}

// annotate sets (or, with "", removes) the redirection annotation
// through pods/status, as the reference does (the lesser permission),
// unless the pod already says so.
func (c *Controller) annotate(ctx context.Context, pod *corev1.Pod, value string) error {
	latest := c.podByUID(string(pod.UID))
	if latest == nil {
		latest = pod
	}
	// The cache may lag behind a patch of ours: patching twice is harmless.
	if cur, ok := latest.Annotations[AnnotationRedirection]; ok == (value != "") && cur == value {
		return nil
	}
	var v any
	if value != "" {
		v = value
	}
	patch, err := json.Marshal(map[string]any{"metadata": map[string]any{"annotations": map[string]any{AnnotationRedirection: v}}})
	if err != nil {
		return err
	}
	_, err = c.cfg.Kube.Pods(pod.Namespace).Patch(ctx, pod.Name, k8stypes.MergePatchType, patch, metav1.PatchOptions{}, "status")
	if err != nil && !apierrors.IsNotFound(err) {
		what := "setting " + AnnotationRedirection + "=" + value
		if value == "" {
			what = "removing " + AnnotationRedirection
		}
		return fmt.Errorf("%s on pod %s/%s: %w", what, pod.Namespace, pod.Name, err)
	}
	return nil
}

// event records an Event for the pod, once per distinct message while
// the pod stays in that condition (st may be nil).
func (c *Controller) event(pod *corev1.Pod, st *podState, kind, reason, format string, args ...any) {
	msg := fmt.Sprintf(format, args...)
	if st != nil {
		c.mu.Lock()
		same := st.lastEvent == reason+msg
		st.lastEvent = reason + msg
		c.mu.Unlock()
		if same {
			return
		}
	}
	c.log.Info("pod event", "pod", pod.Namespace+"/"+pod.Name, "reason", reason, "message", msg)
	c.recorder.Event(pod, kind, reason, msg)
}

func (c *Controller) lockNetns(f *os.File) (func(), error) {
	k, err := keyOf(f)
	if err != nil {
		return nil, err
	}
	return c.locker.Lock(k), nil
}

func keyOf(f *os.File) (nslock.Key, error) { return nslock.KeyOfFile(f) }
