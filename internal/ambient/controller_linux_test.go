package ambient

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net/netip"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/containernetworking/plugins/pkg/ns"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"
	"golang.org/x/sys/unix"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	k8stypes "k8s.io/apimachinery/pkg/types"
	"k8s.io/apimachinery/pkg/watch"
	"k8s.io/client-go/kubernetes/fake"
	k8stesting "k8s.io/client-go/testing"

	"github.com/istio-cni-go/istio-cni/internal/ambientnet"
	"github.com/istio-cni-go/istio-cni/internal/iptables"
	"github.com/istio-cni-go/istio-cni/internal/kubeclient"
	"github.com/istio-cni-go/istio-cni/internal/kubeclient/clientset"
	"github.com/istio-cni-go/istio-cni/internal/nftables"
	"github.com/istio-cni-go/istio-cni/internal/podnet"
	"github.com/istio-cni-go/istio-cni/internal/ruleset"
	tu "github.com/istio-cni-go/istio-cni/internal/testutil"
	"github.com/istio-cni-go/istio-cni/internal/zds"
	"github.com/istio-cni-go/istio-cni/internal/ztunnelsim"
)

// These tests run the controller against a fake API server (client-go's
// fake clientset), with everything else real: network namespaces for the
// node and each pod (joined by veth pairs), the rule backends writing
// into them, the ZDS server and the stand-in ztunnel. Pods that were
// running before their enrolment are found through a /proc tree of the
// test's making whose cgroup files name the pod UIDs and whose ns/net
// links lead to the pods' namespaces.

const (
	node      = "node1"
	nsPlain   = "plain"
	nsAmbient = "meshed"
	waitLimit = 20 * time.Second
)

type backend struct {
	name string
	pod  ambientnet.InPod
	host ambientnet.Host
	uid  *uint32
	// dump lists what a namespace holds of ours, for assertions.
	dump []string
	ours string
	// flush is a firewall manager's flush of the node's nat rules.
	flush []string
}

func backends() []backend {
	root := uint32(0)
	ipt := &iptables.Applier{Force: iptables.VariantNFT}
	legacy := &iptables.Applier{Force: iptables.VariantLegacy}
	nft := &nftables.Applier{}
	return []backend{
		{name: "iptables-nft", pod: ipt, host: ipt, dump: []string{"iptables-nft-save"}, ours: "ISTIO_",
			flush: []string{"iptables-nft", "-t", "nat", "-F"}},
		{name: "iptables-legacy", pod: legacy, host: legacy, dump: []string{"iptables-legacy-save"}, ours: "ISTIO_",
			flush: []string{"iptables-legacy", "-w", "30", "-t", "nat", "-F"}},
		// The test process stands in for the kubelet.
		{name: "nftables", pod: nft, host: nft, uid: &root, dump: []string{"nft", "list", "ruleset"}, ours: "istio-ambient-",
			flush: []string{"nft", "flush", "ruleset"}},
	}
}

// forEachBackend runs a scenario on each backend, each with its own
// node, API server, controller and ztunnel.
func forEachBackend(t *testing.T, fn func(t *testing.T, e *env)) {
	for _, b := range backends() {
		t.Run(b.name, func(t *testing.T) {
			fn(t, newEnv(t, b, nil))
		})
	}
}

type env struct {
	t     *testing.T
	b     backend
	cs    *fake.Clientset
	c     *Controller
	node  ns.NetNS
	sock  string
	proc  string
	cfg   Config
	stop  func()
	links int
	pids  int
	logs  *logBuffer
}

// watchSignal tells when the informers' watches are in place: the fake
// API server does not replay what happened between a list and a watch.
type watchSignal struct {
	kubeclient.Interface
	pods chan struct{}
	once *sync.Once
}

func (w watchSignal) Pods(namespace string) kubeclient.Pods {
	return signalPods{w.Interface.Pods(namespace), w.pods, w.once}
}

type signalPods struct {
	kubeclient.Pods
	ch   chan struct{}
	once *sync.Once
}

func (p signalPods) Watch(ctx context.Context, o metav1.ListOptions) (watch.Interface, error) {
	w, err := p.Pods.Watch(ctx, o)
	p.once.Do(func() { close(p.ch) })
	return w, err
}

type signalNamespaces struct {
	Namespaces
	ch   chan struct{}
	once *sync.Once
}

func (n signalNamespaces) Watch(ctx context.Context, o metav1.ListOptions) (watch.Interface, error) {
	w, err := n.Namespaces.Watch(ctx, o)
	n.once.Do(func() { close(n.ch) })
	return w, err
}

// logBuffer keeps the controller's log for a failing test's report.
type logBuffer struct {
	mu  sync.Mutex
	buf bytes.Buffer
}

func (l *logBuffer) Write(b []byte) (int, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.buf.Write(b)
}

func newEnv(t *testing.T, b backend, mod func(*Config)) *env {
	t.Helper()
	tu.RequireRoot(t)
	tu.RequireTools(t, "ip", "iptables-nft-save", "nft")
	e := &env{t: t, b: b}
	e.node = tu.NewNS(t)
	dir, err := os.MkdirTemp("", "ambient")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = os.RemoveAll(dir) })
	e.sock = filepath.Join(dir, "ztunnel", "ztunnel.sock")
	e.proc = filepath.Join(dir, "proc")
	if err := os.MkdirAll(e.proc, 0o755); err != nil {
		t.Fatal(err)
	}
	e.cs = fake.NewClientset(
		&corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: nsPlain}},
		&corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: nsAmbient, Labels: ambientLabel}},
		&corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: "istio-system"}},
	)
	logs := &logBuffer{}
	e.logs = logs
	t.Cleanup(func() {
		if t.Failed() {
			logs.mu.Lock()
			t.Logf("controller log:\n%s", logs.buf.String())
			logs.mu.Unlock()
		}
	})
	e.cfg = Config{
		Node:     node,
		Policy:   Policy{SystemNamespace: "istio-system"},
		Defaults: Defaults{DNSCapture: true},
		InPod:    b.pod, Host: b.host, HostNetns: e.node.Path(),
		HostParams: ruleset.HostParams{KubeletUID: b.uid},
		ZDS:        zds.Config{Path: e.sock, AcceptInterval: time.Millisecond},
		ProcDir:    e.proc,
		// Long enough to never fire unless a test asks for it.
		HostInterval: time.Hour, VerifyInterval: time.Hour,
		RetryFirst: 5 * time.Millisecond, RetryLimit: 200 * time.Millisecond,
		ZtunnelWait: 5 * time.Second,
		Log:         slog.New(slog.NewTextHandler(logs, &slog.HandlerOptions{Level: slog.LevelDebug})),
	}
	if mod != nil {
		mod(&e.cfg)
	}
	t.Cleanup(func() {
		if e.stop != nil {
			e.stop()
		}
	})
	e.start()
	return e
}

// start runs a controller (a new agent) on the env's API server and node.
func (e *env) start() {
	t := e.t
	t.Helper()
	podsWatching, nsWatching := make(chan struct{}), make(chan struct{})
	cfg := e.cfg
	cfg.Kube = watchSignal{clientset.Of(e.cs), podsWatching, &sync.Once{}}
	cfg.Namespaces = signalNamespaces{e.cs.CoreV1().Namespaces(), nsWatching, &sync.Once{}}
	// A registry per agent: each would be a process of its own.
	cfg.Registerer = prometheus.NewRegistry()
	var err error
	e.c, err = New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	c := e.c
	go func() { done <- c.Run(ctx) }()
	e.stop = func() {
		e.stop = nil
		cancel()
		select {
		case err := <-done:
			if err != nil {
				t.Errorf("Run: %v", err)
			}
		case <-time.After(waitLimit):
			t.Error("Run did not return after its context ended")
		}
	}
	for what, ch := range map[string]<-chan struct{}{"the ZDS socket": c.serving, "the pod watch": podsWatching, "the namespace watch": nsWatching} {
		select {
		case <-ch:
		case <-time.After(waitLimit):
			t.Fatalf("the controller did not open %s", what)
		}
	}
}

func (e *env) startSim(nacks map[string]string) *ztunnelsim.Sim {
	e.t.Helper()
	sim, err := ztunnelsim.Start(ztunnelsim.Config{Path: e.sock, Listeners: true, Reconnect: true, Nacks: nacks})
	if err != nil {
		e.t.Fatal(err)
	}
	e.t.Cleanup(sim.Close)
	e.waitSim(sim, "ztunnel connected", func(st ztunnelsim.State) bool { return st.Connected && st.Snapshots > 0 })
	return sim
}

func (e *env) waitSim(sim *ztunnelsim.Sim, what string, cond func(ztunnelsim.State) bool) ztunnelsim.State {
	e.t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), waitLimit)
	defer cancel()
	st, err := sim.Wait(ctx, cond)
	if err != nil {
		e.t.Fatalf("stand-in ztunnel: %s: %v; state %+v", what, err, st)
	}
	if len(st.ProtocolErrors) > 0 {
		e.t.Fatalf("protocol errors: %v", st.ProtocolErrors)
	}
	return st
}

// podNS makes a pod's network namespace holding ip, joined to the node.
func (e *env) podNS(ip string) ns.NetNS {
	e.t.Helper()
	p := tu.NewNS(e.t)
	e.links++
	peer := fmt.Sprintf("vp%d", e.links)
	e.sh(e.node, "ip", "link", "add", peer, "type", "veth", "peer", "name", "eth0", "netns", filepath.Base(p.Path()))
	e.sh(p, "ip", "addr", "add", ip+"/32", "dev", "eth0")
	e.sh(p, "ip", "link", "set", "eth0", "up")
	e.sh(e.node, "ip", "link", "set", peer, "up")
	return p
}

// openNS opens a pod's namespace as the relay hands it to the agent,
// closed when the test ends.
func (e *env) openNS(n ns.NetNS) *os.File {
	e.t.Helper()
	f, err := os.Open(n.Path())
	if err != nil {
		e.t.Fatal(err)
	}
	e.t.Cleanup(func() { _ = f.Close() })
	return f
}

func (e *env) sh(n ns.NetNS, args ...string) string {
	e.t.Helper()
	out, err := run(n, args...)
	if err != nil {
		e.t.Fatal(err)
	}
	return out
}

func run(n ns.NetNS, args ...string) (string, error) { return tu.TryRunIn(n, args...) }

// running makes the pod's sandbox visible in the test's /proc: a process
// in the kubelet's cgroup of the pod, in the pod's namespace.
func (e *env) running(uid string, p ns.NetNS) {
	e.t.Helper()
	e.pids++
	dir := filepath.Join(e.proc, fmt.Sprint(1000+e.pids))
	if err := os.MkdirAll(filepath.Join(dir, "ns"), 0o755); err != nil {
		e.t.Fatal(err)
	}
	cg := "0::/kubepods.slice/kubepods-besteffort.slice/kubepods-besteffort-pod" + strings.ReplaceAll(uid, "-", "_") + ".slice/cri-containerd-1.scope\n"
	if err := os.WriteFile(filepath.Join(dir, "cgroup"), []byte(cg), 0o644); err != nil {
		e.t.Fatal(err)
	}
	if err := os.Symlink(p.Path(), filepath.Join(dir, "ns", "net")); err != nil {
		e.t.Fatal(err)
	}
}

var uidSeq int

func newUID() string {
	uidSeq++
	return fmt.Sprintf("0000%04d-aaaa-4bbb-8ccc-%012d", uidSeq, uidSeq)
}

func (e *env) createPod(namespace, name, uid string, lbls map[string]string, ip string) *corev1.Pod {
	e.t.Helper()
	p := &corev1.Pod{
		ObjectMeta: metav1.ObjectMeta{Namespace: namespace, Name: name, UID: k8stypes.UID(uid), Labels: lbls},
		Spec:       corev1.PodSpec{NodeName: node, ServiceAccountName: "sa-" + name},
		Status:     corev1.PodStatus{Phase: corev1.PodRunning},
	}
	if ip != "" {
		p.Status.PodIP, p.Status.PodIPs = ip, []corev1.PodIP{{IP: ip}}
	}
	out, err := e.cs.CoreV1().Pods(namespace).Create(context.Background(), p, metav1.CreateOptions{})
	if err != nil {
		e.t.Fatal(err)
	}
	return out
}

func (e *env) updatePod(namespace, name string, fn func(*corev1.Pod)) {
	e.t.Helper()
	p, err := e.cs.CoreV1().Pods(namespace).Get(context.Background(), name, metav1.GetOptions{})
	if err != nil {
		e.t.Fatal(err)
	}
	fn(p)
	if _, err := e.cs.CoreV1().Pods(namespace).Update(context.Background(), p, metav1.UpdateOptions{}); err != nil {
		e.t.Fatal(err)
	}
}

func (e *env) deletePod(namespace, name string) {
	e.t.Helper()
	if err := e.cs.CoreV1().Pods(namespace).Delete(context.Background(), name, metav1.DeleteOptions{}); err != nil {
		e.t.Fatal(err)
	}
}

// waitPod waits, on the fake API server's watch, for the pod to satisfy
// cond.
func (e *env) waitPod(namespace, name, what string, cond func(*corev1.Pod) bool) *corev1.Pod {
	e.t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), waitLimit)
	defer cancel()
	w, err := e.cs.CoreV1().Pods(namespace).Watch(ctx, metav1.ListOptions{})
	if err != nil {
		e.t.Fatal(err)
	}
	defer w.Stop()
	p, err := e.cs.CoreV1().Pods(namespace).Get(ctx, name, metav1.GetOptions{})
	if err == nil && cond(p) {
		return p
	}
	for {
		select {
		case ev, ok := <-w.ResultChan():
			if !ok {
				e.t.Fatalf("pod %s/%s: watch ended waiting for %s", namespace, name, what)
			}
			if q, ok := ev.Object.(*corev1.Pod); ok && q.Name == name {
				p = q
				if cond(q) {
					return q
				}
			}
		case <-ctx.Done():
			e.t.Fatalf("pod %s/%s: %s did not happen; pod annotations %v", namespace, name, what, annotationsOf(p))
		}
	}
}

func annotationsOf(p *corev1.Pod) map[string]string {
	if p == nil {
		return nil
	}
	return p.Annotations
}

func redirection(want string) func(*corev1.Pod) bool {
	return func(p *corev1.Pod) bool {
		v, ok := p.Annotations[AnnotationRedirection]
		return ok == (want != "") && v == want
	}
}

// waitEvent waits for a Kubernetes Event with reason about the pod.
func (e *env) waitEvent(namespace, podName, reason string) *corev1.Event {
	e.t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), waitLimit)
	defer cancel()
	w, err := e.cs.CoreV1().Events(namespace).Watch(ctx, metav1.ListOptions{})
	if err != nil {
		e.t.Fatal(err)
	}
	defer w.Stop()
	match := func(ev *corev1.Event) bool { return ev.Reason == reason && ev.InvolvedObject.Name == podName }
	list, err := e.cs.CoreV1().Events(namespace).List(ctx, metav1.ListOptions{})
	if err != nil {
		e.t.Fatal(err)
	}
	for i := range list.Items {
		if match(&list.Items[i]) {
			return &list.Items[i]
		}
	}
	for {
		select {
		case ev := <-w.ResultChan():
			if k, ok := ev.Object.(*corev1.Event); ok && match(k) {
				return k
			}
		case <-ctx.Done():
			e.t.Fatalf("no %s event for pod %s/%s", reason, namespace, podName)
		}
	}
}

// ours is what the namespace holds of the backend's ambient rules.
func (e *env) ours(n ns.NetNS) []string {
	e.t.Helper()
	out, err := e.tryOurs(n)
	if err != nil {
		e.t.Fatal(err)
	}
	return out
}

func (e *env) tryOurs(n ns.NetNS) ([]string, error) {
	dump, err := run(n, e.b.dump...)
	if err != nil {
		return nil, err
	}
	var out []string
	for _, l := range strings.Split(dump, "\n") {
		if strings.Contains(l, e.b.ours) {
			out = append(out, l)
		}
	}
	return out, nil
}

func (e *env) requireRules(n ns.NetNS, p ruleset.AmbientParams) {
	e.t.Helper()
	if err := e.b.pod.CheckAmbient(n.Path(), p); err != nil {
		e.t.Fatalf("the pod's namespace lacks its ambient rules: %v", err)
	}
}

func (e *env) requireNoRules(n ns.NetNS) {
	e.t.Helper()
	if got := e.ours(n); len(got) > 0 {
		e.t.Fatalf("the pod's namespace still holds ambient rules:\n%s", strings.Join(got, "\n"))
	}
	out := e.sh(n, "ip", "rule", "show")
	if strings.Contains(out, "lookup 100") {
		e.t.Fatalf("the pod's namespace still holds the policy rule:\n%s", out)
	}
}

func (e *env) probes() map[string]string {
	e.t.Helper()
	got, err := e.b.host.ProbeEntries(e.node.Path())
	if err != nil {
		e.t.Fatal(err)
	}
	out := map[string]string{}
	for ip, uid := range got {
		out[ip.String()] = uid
	}
	return out
}

func (e *env) requireProbes(want map[string]string) {
	e.t.Helper()
	got := e.probes()
	if fmt.Sprint(got) != fmt.Sprint(want) {
		e.t.Fatalf("probe set = %v, want %v", got, want)
	}
}

func inode(t *testing.T, n ns.NetNS) uint64 {
	t.Helper()
	var st unix.Stat_t
	if err := unix.Stat(n.Path(), &st); err != nil {
		t.Fatal(err)
	}
	return st.Ino
}

func hasWorkload(uid string, ino uint64) func(ztunnelsim.State) bool {
	return func(st ztunnelsim.State) bool {
		w, ok := st.Workloads[uid]
		return ok && w.Inode == ino && len(w.Listening) > 0
	}
}

func deleted(uid string) func(ztunnelsim.State) bool {
	return func(st ztunnelsim.State) bool {
		_, running := st.Workloads[uid]
		for _, ev := range st.Events {
			if ev.Req.Kind == zds.KindDel && ev.Req.UID == uid {
				return !running
			}
		}
		return false
	}
}

var defaultParams = ruleset.AmbientParams{DNSCapture: true}

// Enrolment of running pods by their label and by their namespace's,
// un-enrolment by the pod's "none", and deletion.
func TestEnrolRunningPods(t *testing.T) {
	forEachBackend(t, func(t *testing.T, e *env) {
		sim := e.startSim(nil)

		uidA, nsA := newUID(), e.podNS("10.7.0.1")
		e.running(uidA, nsA)
		e.createPod(nsPlain, "a", uidA, ambientLabel, "10.7.0.1")
		p := e.waitPod(nsPlain, "a", "enabled", redirection(RedirectionEnabled))
		e.requireRules(nsA, defaultParams)
		st := e.waitSim(sim, "pod a added", hasWorkload(uidA, inode(t, nsA)))
		if w := st.Workloads[uidA]; w.Info != (zds.WorkloadInfo{Name: "a", Namespace: nsPlain, ServiceAccount: "sa-a"}) {
			t.Errorf("workload info %+v", w.Info)
		}
		e.requireProbes(map[string]string{"10.7.0.1": uidA})
		if p.Annotations[AnnotationRedirection] != RedirectionEnabled {
			t.Fatal(p.Annotations)
		}

		// Not selected until its namespace is labelled.
		uidB, nsB := newUID(), e.podNS("10.7.0.2")
		e.running(uidB, nsB)
		e.createPod(nsPlain, "b", uidB, nil, "10.7.0.2")
		uidC, nsC := newUID(), e.podNS("10.7.0.3")
		e.running(uidC, nsC)
		e.createPod(nsPlain, "c", uidC, noneLabel, "10.7.0.3")
		nsObj, err := e.cs.CoreV1().Namespaces().Get(context.Background(), nsPlain, metav1.GetOptions{})
		if err != nil {
			t.Fatal(err)
		}
		// The watch sees b before the label: proof that b's add was
		// decided (not enrolled) before the namespace changed is that it
		// holds no rules now.
		e.waitSim(sim, "nothing but a", func(s ztunnelsim.State) bool { return len(s.Workloads) == 1 })
		nsObj.Labels = ambientLabel
		if _, err := e.cs.CoreV1().Namespaces().Update(context.Background(), nsObj, metav1.UpdateOptions{}); err != nil {
			t.Fatal(err)
		}
		e.waitPod(nsPlain, "b", "enabled by the namespace label", redirection(RedirectionEnabled))
		e.requireRules(nsB, defaultParams)
		e.waitSim(sim, "pod b added", hasWorkload(uidB, inode(t, nsB)))
		e.requireProbes(map[string]string{"10.7.0.1": uidA, "10.7.0.2": uidB})
		// c opted out with its label.
		if _, ok := sim.State().Workloads[uidC]; ok {
			t.Error("pod c, labelled none, was enrolled")
		}
		e.requireNoRules(nsC)

		// b opts out: every step undone.
		e.updatePod(nsPlain, "b", func(p *corev1.Pod) { p.Labels = noneLabel })
		e.waitPod(nsPlain, "b", "annotation removed", redirection(""))
		e.requireNoRules(nsB)
		e.waitSim(sim, "pod b deleted", deleted(uidB))
		e.requireProbes(map[string]string{"10.7.0.1": uidA})

		// A Job's pod completes: out of the probe set and of ztunnel (its
		// sandbox is gone; nothing to undo in it).
		uidJ, nsJ := newUID(), e.podNS("10.7.0.4")
		e.running(uidJ, nsJ)
		e.createPod(nsAmbient, "job", uidJ, nil, "10.7.0.4")
		e.waitPod(nsAmbient, "job", "enabled", redirection(RedirectionEnabled))
		e.requireProbes(map[string]string{"10.7.0.1": uidA, "10.7.0.4": uidJ})
		e.updatePod(nsAmbient, "job", func(p *corev1.Pod) { p.Status.Phase = corev1.PodSucceeded })
		e.waitSim(sim, "completed pod deleted", deleted(uidJ))
		e.requireProbes(map[string]string{"10.7.0.1": uidA})

		// a is deleted: out of the probe set and of ztunnel.
		e.deletePod(nsPlain, "a")
		e.waitSim(sim, "pod a deleted", deleted(uidA))
		e.requireProbes(map[string]string{})
		if n := len(e.c.Snapshot()); n != 0 {
			t.Errorf("snapshot still names %d pods", n)
		}
		if got := testutil.ToFloat64(e.c.m.enrols.WithLabelValues("controller", "enabled")); got != 3 {
			t.Errorf("enrolments enabled = %v, want 3", got)
		}
	})
}

// An ADD while no ztunnel is connected: the ADD fails after the bounded
// wait, naming the pod and why; the pod is pending, its rules in place;
// when ztunnel connects it is enrolled at once.
func TestPendingUntilZtunnelConnects(t *testing.T) {
	for _, b := range backends() {
		t.Run(b.name, func(t *testing.T) {
			e := newEnv(t, b, func(c *Config) {
				c.ZtunnelWait = 100 * time.Millisecond
				c.RetryFirst, c.RetryLimit = time.Hour, time.Hour
			})
			uid, pns := newUID(), e.podNS("10.7.1.1")
			pod := e.createPod(nsAmbient, "p", uid, nil, "")
			f := e.openNS(pns)
			err := e.c.AddPod(context.Background(), pod, f)
			if err == nil || !errors.Is(err, zds.ErrNotConnected) || !strings.Contains(err.Error(), nsAmbient+"/p") {
				t.Fatalf("AddPod = %v, want a ztunnel-not-connected error naming the pod", err)
			}
			e.waitPod(nsAmbient, "p", "pending", redirection(RedirectionPending))
			e.requireRules(pns, defaultParams)
			// The ADD found the pod's address in its namespace.
			e.requireProbes(map[string]string{"10.7.1.1": uid})
			e.waitEvent(nsAmbient, "p", "AmbientPending")

			// Back-off is an hour: only the connection can retry it now.
			sim := e.startSim(nil)
			e.waitPod(nsAmbient, "p", "enabled", redirection(RedirectionEnabled))
			e.waitSim(sim, "pod added", hasWorkload(uid, inode(t, pns)))
		})
	}
}

// ztunnel refuses a pod: pending, then enabled once it accepts; a
// restarted ztunnel gets the snapshot with the pod's namespace.
func TestNackAndZtunnelRestart(t *testing.T) {
	forEachBackend(t, func(t *testing.T, e *env) {
		uid, pns := newUID(), e.podNS("10.7.2.1")
		sim := e.startSim(map[string]string{uid: "no certificate yet"})
		pod := e.createPod(nsAmbient, "p", uid, nil, "10.7.2.1")
		f := e.openNS(pns)
		err := e.c.AddPod(context.Background(), pod, f)
		var nack *zds.NackError
		if !errors.As(err, &nack) || !strings.Contains(err.Error(), "no certificate yet") || !strings.Contains(err.Error(), nsAmbient+"/p") {
			t.Fatalf("AddPod = %v, want ztunnel's refusal naming the pod", err)
		}
		e.waitPod(nsAmbient, "p", "pending", redirection(RedirectionPending))
		e.requireRules(pns, defaultParams)

		sim.Nack(uid, "")
		e.waitPod(nsAmbient, "p", "enabled after the retry", redirection(RedirectionEnabled))
		ino := inode(t, pns)
		e.waitSim(sim, "pod added", hasWorkload(uid, ino))

		sim.Disconnect()
		st := e.waitSim(sim, "reconnected with the snapshot", func(s ztunnelsim.State) bool {
			return s.Conns == 2 && s.Snapshots == 2 && hasWorkload(uid, ino)(s)
		})
		var snap []zds.Kind
		for _, ev := range st.Events {
			if ev.Conn == 2 {
				snap = append(snap, ev.Req.Kind)
				if ev.Req.Kind == zds.KindAdd && (ev.Req.UID != uid || ev.FDs != 1 || ev.Inode != ino) {
					t.Errorf("snapshot add %+v, want pod %s with its namespace", ev, uid)
				}
			}
		}
		if fmt.Sprint(snap) != fmt.Sprint([]zds.Kind{zds.KindAdd, zds.KindSnapshotSent}) {
			t.Errorf("second connection got %v, want add, snapshot_sent", snap)
		}
	})
}

// A rollout finds an enrolled pod whose annotation it cannot read (set
// while no agent ran, or read differently by the agent it replaces): the
// pod stays in ztunnel's snapshot with its rules as they were, rather
// than lose its proxy while its rules still send traffic there, and an
// Event says why it is not enrolled anew.
func TestRolloutKeepsUnreadablePod(t *testing.T) {
	forEachBackend(t, func(t *testing.T, e *env) {
		sim := e.startSim(nil)
		uid, pns := e.enrolRunning(sim, "u", "10.7.9.6")
		sim.Close()

		e.stop()
		e.updatePod(nsAmbient, "u", func(p *corev1.Pod) { p.Annotations[AnnotationDNSCapture] = "yes" })
		e.start()
		sim2 := e.startSim(nil)
		e.waitSim(sim2, "the pod in the new agent's snapshot", hasWorkload(uid, inode(t, pns)))
		e.waitEvent(nsAmbient, "u", "AmbientInvalidAnnotation")
		e.c.verify(uid)
		e.requireRules(pns, defaultParams)
		if p := e.waitPod(nsAmbient, "u", "still enabled", redirection(RedirectionEnabled)); p == nil {
			t.Fatal("pod u")
		}
	})
}

// halfApply is a pod backend whose apply writes the rules and then fails
// (as one whose second family or routing is refused does).
type halfApply struct{ ambientnet.InPod }

func (h halfApply) ApplyAmbient(path string, p ruleset.AmbientParams) (podnet.Report, error) {
	rep, err := h.InPod.ApplyAmbient(path, p)
	if err == nil {
		err = errors.New("the IPv6 policy rule was refused")
	}
	return rep, err
}

// A pod whose enrolment keeps failing after its rules were written, then
// opted out, has them removed: not recorded as applied, they were still
// there, and the pod would have stayed captured with nothing tracking it.
func TestFailedApplyRemovedOnOptOut(t *testing.T) {
	forEachBackend(t, func(t *testing.T, e *env) {
		e.stop()
		e.cfg.InPod = halfApply{e.b.pod}
		e.start()
		uid, pns := newUID(), e.podNS("10.7.2.7")
		e.running(uid, pns)
		e.createPod(nsPlain, "h", uid, ambientLabel, "10.7.2.7")
		e.waitLog("not reconciled", uid, "IPv6 policy rule was refused")
		if len(e.ours(pns)) == 0 {
			t.Fatal("the failing apply wrote no rules: the test needs them written")
		}
		e.updatePod(nsPlain, "h", func(p *corev1.Pod) { p.Labels = nil })
		deadline := time.Now().Add(waitLimit)
		for {
			got, err := e.tryOurs(pns)
			if err == nil && len(got) == 0 {
				break
			}
			if time.Now().After(deadline) {
				t.Fatalf("the opted-out pod's namespace still holds ambient rules:\n%s", strings.Join(got, "\n"))
			}
			time.Sleep(5 * time.Millisecond) // polling the controller's work
		}
		e.requireNoRules(pns)
	})
}

// enrolRunning starts a pod of the ambient namespace with ip and waits
// until it is enabled and ztunnel (sim) has its namespace.
func (e *env) enrolRunning(sim *ztunnelsim.Sim, name, ip string) (string, ns.NetNS) {
	e.t.Helper()
	uid, pns := newUID(), e.podNS(ip)
	e.running(uid, pns)
	e.createPod(nsAmbient, name, uid, nil, ip)
	e.waitPod(nsAmbient, name, "enabled", redirection(RedirectionEnabled))
	e.waitSim(sim, "pod added", hasWorkload(uid, inode(e.t, pns)))
	return uid, pns
}

// A restarted ztunnel refuses, in its snapshot, a pod the previous one
// had taken: the pod is no longer acknowledged, so it is sent again and,
// refused again, marked pending, rather than left captured with no proxy
// while everything said enabled; once ztunnel takes it, it is enabled.
func TestSnapshotRefusalRetried(t *testing.T) {
	forEachBackend(t, func(t *testing.T, e *env) {
		sim := e.startSim(nil)
		uid, pns := e.enrolRunning(sim, "s", "10.7.2.9")

		sim.Nack(uid, "failure to start proxy: address in use")
		sim.Disconnect()
		e.waitPod(nsAmbient, "s", "pending after the new ztunnel refused it", redirection(RedirectionPending))
		st := sim.State()
		refused := 0
		for _, ev := range st.Events {
			if ev.Conn == 2 && ev.Req.Kind == zds.KindAdd && ev.Req.UID == uid && ev.Nack != "" {
				refused++
			}
		}
		if refused < 2 {
			t.Fatalf("the new connection refused %d adds of the pod, want its snapshot's and the retry's: %+v", refused, st.Events)
		}

		sim.Nack(uid, "")
		sim.Disconnect()
		e.waitPod(nsAmbient, "s", "enabled once taken", redirection(RedirectionEnabled))
		e.waitSim(sim, "pod added again", hasWorkload(uid, inode(t, pns)))
	})
}

// A pod's address reused by a new pod before the old one's deletion is
// seen: the probe entry is the new pod's, and stays so when the old pod
// goes.
func TestIPReuse(t *testing.T) {
	forEachBackend(t, func(t *testing.T, e *env) {
		sim := e.startSim(nil)
		const ip = "10.7.3.1"
		uidOld, nsOld := newUID(), e.podNS(ip)
		e.running(uidOld, nsOld)
		e.createPod(nsAmbient, "old", uidOld, nil, ip)
		e.waitPod(nsAmbient, "old", "enabled", redirection(RedirectionEnabled))
		e.requireProbes(map[string]string{ip: uidOld})

		uidNew, nsNew := newUID(), e.podNS(ip)
		pod := e.createPod(nsAmbient, "new", uidNew, nil, "")
		f := e.openNS(nsNew)
		if err := e.c.AddPod(context.Background(), pod, f); err != nil {
			t.Fatal(err)
		}
		e.requireProbes(map[string]string{ip: uidNew})

		e.deletePod(nsAmbient, "old")
		e.waitSim(sim, "old pod deleted", deleted(uidOld))
		e.requireProbes(map[string]string{ip: uidNew})
		e.waitSim(sim, "new pod kept", hasWorkload(uidNew, inode(t, nsNew)))
	})
}

// countingHost counts the node's probe-set reads-and-syncs and blind
// changes, on a real backend.
type countingHost struct {
	ambientnet.Host
	syncs, changes atomic.Int32
}

func (h *countingHost) SyncProbes(p string, want map[netip.Addr]string) (podnet.ProbeChanges, error) {
	h.syncs.Add(1)
	return h.Host.SyncProbes(p, want)
}

func (h *countingHost) ChangeProbes(p string, ch podnet.ProbeChanges, want map[netip.Addr]string) error {
	h.changes.Add(1)
	return h.Host.ChangeProbes(p, ch, want)
}

// An enrolled pod's start and end change the node's probe set by their
// own addresses, without reading it, once one sync has read it; a set
// that no longer holds what the controller wrote is synced whole when a
// change meets the difference (nftables refuses the deletion of an
// element that is gone; ipset deletes nothing, without error).
func TestProbeSetChangedBlind(t *testing.T) {
	for _, b := range backends() {
		t.Run(b.name, func(t *testing.T) {
			h := &countingHost{Host: b.host}
			e := newEnv(t, b, func(c *Config) { c.Host = h })
			sim := e.startSim(nil)
			pods := map[string]string{}
			for i, ip := range []string{"10.7.5.1", "10.7.5.2", "10.7.5.3"} {
				uid, pns := newUID(), e.podNS(ip)
				e.running(uid, pns)
				name := fmt.Sprintf("p%d", i)
				e.createPod(nsAmbient, name, uid, nil, ip)
				e.waitPod(nsAmbient, name, "enabled", redirection(RedirectionEnabled))
				pods[ip] = uid
				e.requireProbes(pods)
			}
			syncs := h.syncs.Load()
			if syncs != 1 || h.changes.Load() != 3 {
				t.Fatalf("three pods enrolled with %d syncs and %d blind changes: want the start-up's sync, then a change a pod", syncs, h.changes.Load())
			}

			// Someone deletes the first pod's element behind our back;
			// the pod's end then changes the set.
			gone := netip.MustParseAddr("10.7.5.1")
			if del, err := b.host.ForgetProbe(e.node.Path(), gone, pods[gone.String()]); err != nil || !del {
				t.Fatalf("deleting the element behind the controller's back: %v, %v", del, err)
			}
			e.deletePod(nsAmbient, "p0")
			e.waitSim(sim, "p0 deleted", deleted(pods[gone.String()]))
			delete(pods, gone.String())
			e.requireProbes(pods)
			wantSyncs := syncs
			if b.name == "nftables" {
				wantSyncs++
			}
			if got := h.syncs.Load(); got != wantSyncs {
				t.Errorf("syncs after a change met a missing element: %d, want %d", got, wantSyncs)
			}

			// And a later pod goes by change again.
			uid, pns := newUID(), e.podNS("10.7.5.4")
			e.running(uid, pns)
			e.createPod(nsAmbient, "p4", uid, nil, "10.7.5.4")
			e.waitPod(nsAmbient, "p4", "enabled", redirection(RedirectionEnabled))
			pods["10.7.5.4"] = uid
			e.requireProbes(pods)
			if got := h.syncs.Load(); got != wantSyncs {
				t.Errorf("syncs after the next pod: %d, want %d", got, wantSyncs)
			}
		})
	}
}

// A firewall manager flushing the node's probe SNAT and set, and someone
// flushing a pod's rules: the periodic passes put both back, the pod's
// with an Event.
func TestReassertAndVerify(t *testing.T) {
	for _, b := range backends() {
		t.Run(b.name, func(t *testing.T) {
			e := newEnv(t, b, func(c *Config) { c.HostInterval, c.VerifyInterval = 50*time.Millisecond, 50*time.Millisecond })
			e.startSim(nil)
			const ip = "10.7.4.1"
			uid, pns := newUID(), e.podNS(ip)
			e.running(uid, pns)
			e.createPod(nsAmbient, "p", uid, nil, ip)
			e.waitPod(nsAmbient, "p", "enabled", redirection(RedirectionEnabled))
			e.requireProbes(map[string]string{ip: uid})
			hostRules := e.ours(e.node)
			if len(hostRules) == 0 {
				t.Fatal("no probe SNAT on the node")
			}

			// As a firewall manager does: every rule of the table flushed
			// (nftables: the whole ruleset, sets and all), and the set
			// emptied.
			// The controller's periodic pass runs meanwhile: a write of
			// ours that meets one of its own may be refused, and is
			// simply done again.
			for attempt := 1; ; attempt++ {
				_, err := run(e.node, b.flush...)
				if err == nil {
					break
				}
				if attempt == 5 {
					t.Fatal(err)
				}
			}
			if _, err := b.host.SyncProbes(e.node.Path(), map[netip.Addr]string{}); err != nil {
				t.Logf("emptying the probe set (the controller may have been at it too): %v", err)
			}
			// Nothing signals a rule's return but the kernel: poll it, and
			// the counter, which the controller moves only once its write
			// has returned (after the kernel holds the rules).
			deadline := time.Now().Add(waitLimit)
			for {
				got, err := b.host.ProbeEntries(e.node.Path())
				rules, rerr := e.tryOurs(e.node)
				counted := testutil.ToFloat64(e.c.m.host.WithLabelValues("rules"))
				if err == nil && rerr == nil && len(got) == 1 && got[netip.MustParseAddr(ip)] == uid && len(rules) == len(hostRules) && counted >= 1 {
					break
				}
				if time.Now().After(deadline) {
					t.Fatalf("node rules not put back and counted: probes %v (%v), host rules re-asserted %v, rules (%v):\n%s",
						got, err, counted, rerr, strings.Join(rules, "\n"))
				}
				time.Sleep(20 * time.Millisecond)
			}

			for attempt := 1; ; attempt++ {
				_, err := b.pod.RemoveAmbient(pns.Path())
				if err == nil {
					break
				}
				if attempt == 5 {
					t.Fatal(err)
				}
			}
			ev := e.waitEvent(nsAmbient, "p", "AmbientRulesRepaired")
			if ev.Type != corev1.EventTypeWarning {
				t.Errorf("event %+v", ev)
			}
			e.requireRules(pns, defaultParams)
			if got := testutil.ToFloat64(e.c.m.verify.WithLabelValues("repaired")); got < 1 {
				t.Errorf("verify repaired = %v", got)
			}
		})
	}
}

// snapshotConn is the stand-in's connection that got the nth snapshot.
// After an agent restart that is not always connection 2: the stand-in
// may first redial into the old agent's closing listener.
func snapshotConn(t *testing.T, st ztunnelsim.State, n int) int {
	t.Helper()
	seen := 0
	for _, ev := range st.Events {
		if ev.Req.Kind != zds.KindSnapshotSent {
			continue
		}
		seen++
		if seen == n {
			return ev.Conn
		}
	}
	t.Fatalf("no snapshot %d among the stand-in's events: %+v", n, st.Events)
	return 0
}

// An agent restart: the new agent takes over the pods the old one
// enrolled, finding their namespaces by /proc, and a reconnecting ztunnel
// gets them in its snapshot (a keep for a pod whose namespace is not
// found, which is reported, not dropped).
func TestAgentRestart(t *testing.T) {
	forEachBackend(t, func(t *testing.T, e *env) {
		sim := e.startSim(nil)
		uidA, nsA := newUID(), e.podNS("10.7.5.1")
		e.running(uidA, nsA)
		e.createPod(nsAmbient, "a", uidA, nil, "10.7.5.1")
		e.waitPod(nsAmbient, "a", "enabled", redirection(RedirectionEnabled))
		inoA := inode(t, nsA)
		e.waitSim(sim, "pod a added", hasWorkload(uidA, inoA))

		// b was enrolled by an agent before, and its sandbox cannot be
		// found now.
		uidB := newUID()
		b := e.createPod(nsAmbient, "b", uidB, nil, "10.7.5.2")
		b.Annotations = map[string]string{AnnotationRedirection: RedirectionEnabled}
		if _, err := e.cs.CoreV1().Pods(nsAmbient).Update(context.Background(), b, metav1.UpdateOptions{}); err != nil {
			t.Fatal(err)
		}
		e.waitEvent(nsAmbient, "b", "AmbientNetnsNotFound")

		e.stop()
		e.start()
		st := e.waitSim(sim, "the new agent's snapshot", func(s ztunnelsim.State) bool { return s.Snapshots == 2 })
		conn := snapshotConn(t, st, 2)
		var got []string
		for _, ev := range st.Events {
			if ev.Conn != conn || ev.Req.Kind == zds.KindSnapshotSent {
				continue
			}
			got = append(got, fmt.Sprintf("%s %s fds=%d", ev.Req.Kind, ev.Req.UID, ev.FDs))
			if ev.Req.Kind == zds.KindAdd && ev.Inode != inoA {
				t.Errorf("snapshot add of a with namespace inode %d, want %d", ev.Inode, inoA)
			}
		}
		want := []string{fmt.Sprintf("add %s fds=1", uidA), fmt.Sprintf("keep %s fds=0", uidB)}
		if len(got) < 2 || fmt.Sprint(got[:2]) != fmt.Sprint(want) {
			t.Errorf("second connection: %v, want first %v", got, want)
		}
		e.requireRules(nsA, defaultParams)
		e.requireProbes(map[string]string{"10.7.5.1": uidA, "10.7.5.2": uidB})
		if p := e.waitPod(nsAmbient, "a", "still enabled", redirection(RedirectionEnabled)); p == nil {
			t.Fatal("pod a")
		}
		if n := e.c.counts()["unreachable"]; n != 1 {
			t.Errorf("unreachable pods = %d, want 1 (b)", n)
		}
	})
}

// An ADD's enrolment does not wait for the pod's annotation: with the API
// server refusing the patch, the ADD succeeds once the rules, the probe
// set and ztunnel are done, and the work queue writes the annotation once
// the API server takes it.
func TestAnnotationOffTheADDPath(t *testing.T) {
	forEachBackend(t, func(t *testing.T, e *env) {
		var refuse atomic.Bool
		refuse.Store(true)
		var refused atomic.Int32
		e.cs.PrependReactor("patch", "pods", func(a k8stesting.Action) (bool, runtime.Object, error) {
			if a.GetSubresource() == "status" && refuse.Load() {
				refused.Add(1)
				return true, nil, errors.New("the API server is away")
			}
			return false, nil, nil
		})
		sim := e.startSim(nil)
		uid, pns := newUID(), e.podNS("10.7.9.1")
		e.createPod(nsAmbient, "p", uid, nil, "")
		f := e.openNS(pns)
		enrolled, err := e.c.EnrolOnAdd(context.Background(), nsAmbient, "p", uid, f)
		if err != nil || !enrolled {
			t.Fatalf("EnrolOnAdd = %v, %v; want the pod enrolled though its annotation cannot be written", enrolled, err)
		}
		e.waitSim(sim, "pod added", hasWorkload(uid, inode(t, pns)))
		e.requireRules(pns, defaultParams)
		e.requireProbes(map[string]string{"10.7.9.1": uid})
		deadline := time.Now().Add(waitLimit)
		for refused.Load() == 0 {
			if time.Now().After(deadline) {
				t.Fatal("the annotation was never tried")
			}
			time.Sleep(5 * time.Millisecond) // polling the work queue's goroutine
		}
		refuse.Store(false)
		e.waitPod(nsAmbient, "p", "enabled", redirection(RedirectionEnabled))
	})
}

// A ztunnel that stops answering: the ADD fails within the ack deadline
// (never hangs the runtime), the pod is pending with an Event, and once
// ztunnel answers again (its reconnect) the pod is handed over.
func TestStalledZtunnel(t *testing.T) {
	forEachBackend(t, func(t *testing.T, e *env) {
		sim := e.startSim(nil)
		e.stop()
		e.cfg.ZDS.AckTimeout = 200 * time.Millisecond
		e.start()
		e.waitSim(sim, "reconnected to the new agent", func(st ztunnelsim.State) bool { return st.Connected && st.Snapshots >= 2 })
		sim.Stall(true)
		uid, pns := newUID(), e.podNS("10.7.9.2")
		e.createPod(nsAmbient, "stalled", uid, nil, "")
		f := e.openNS(pns)
		start := time.Now()
		enrolled, err := e.c.EnrolOnAdd(context.Background(), nsAmbient, "stalled", uid, f)
		if err == nil || !enrolled || !strings.Contains(err.Error(), nsAmbient+"/stalled") {
			t.Fatalf("EnrolOnAdd with ztunnel stalled = %v, %v; want an error naming the pod", enrolled, err)
		}
		if d := time.Since(start); d > e.cfg.ZtunnelWait+2*time.Second {
			t.Fatalf("the ADD took %v with ztunnel stalled", d)
		}
		e.waitPod(nsAmbient, "stalled", "pending", redirection(RedirectionPending))
		e.waitEvent(nsAmbient, "stalled", "AmbientPending")
		sim.Stall(false)
		e.waitPod(nsAmbient, "stalled", "enabled", redirection(RedirectionEnabled))
		e.waitSim(sim, "pod added", hasWorkload(uid, inode(t, pns)))
	})
}

// A dual-stack pod with AMBIENT_IPV6: rules for both families, both
// addresses in the probe sets (found in the namespace on ADD, before the
// kubelet reports them), and both gone with the pod.
func TestDualStack(t *testing.T) {
	for _, b := range backends() {
		t.Run(b.name, func(t *testing.T) {
			e := newEnv(t, b, func(c *Config) {
				c.Defaults.IPv6 = true
				c.HostParams.IPv6 = true
			})
			sim := e.startSim(nil)
			uid, pns := newUID(), e.podNS("10.7.9.3")
			e.sh(pns, "ip", "-6", "addr", "add", "fd07::3/128", "dev", "eth0", "nodad")
			e.createPod(nsAmbient, "dual", uid, nil, "")
			f := e.openNS(pns)
			if enrolled, err := e.c.EnrolOnAdd(context.Background(), nsAmbient, "dual", uid, f); err != nil || !enrolled {
				t.Fatalf("EnrolOnAdd = %v, %v", enrolled, err)
			}
			e.requireRules(pns, ruleset.AmbientParams{DNSCapture: true, IPv6: true})
			e.requireProbes(map[string]string{"10.7.9.3": uid, "fd07::3": uid})
			e.waitSim(sim, "pod added", hasWorkload(uid, inode(t, pns)))
			e.waitPod(nsAmbient, "dual", "enabled", redirection(RedirectionEnabled))
			e.deletePod(nsAmbient, "dual")
			e.waitSim(sim, "pod deleted", deleted(uid))
			deadline := time.Now().Add(waitLimit)
			for len(e.probes()) != 0 {
				if time.Now().After(deadline) {
					t.Fatalf("probe set after the pod's deletion: %v", e.probes())
				}
				time.Sleep(5 * time.Millisecond) // polling the controller's work
			}
		})
	}
}

// waitLog waits for the controller's log to hold a line with every part.
func (e *env) waitLog(parts ...string) {
	e.t.Helper()
	deadline := time.Now().Add(waitLimit)
	for {
		e.logs.mu.Lock()
		text := e.logs.buf.String()
		e.logs.mu.Unlock()
		for line := range strings.SplitSeq(text, "\n") {
			all := true
			for _, p := range parts {
				all = all && strings.Contains(line, p)
			}
			if all {
				return
			}
		}
		if time.Now().After(deadline) {
			e.t.Fatalf("no log line with %q", parts)
		}
		time.Sleep(5 * time.Millisecond) // polling the controller's goroutines
	}
}

// A rollout: the new agent takes over enrolled pods before ztunnel has
// reconnected to it. The pods stay enabled (ztunnel still runs them: the
// agent restarted, not ztunnel), no Event says otherwise, and ztunnel's
// new connection gets each pod once, in its snapshot.
func TestRolloutKeepsPodsEnabled(t *testing.T) {
	forEachBackend(t, func(t *testing.T, e *env) {
		var pending atomic.Int32
		e.cs.PrependReactor("patch", "pods", func(a k8stesting.Action) (bool, runtime.Object, error) {
			if p, ok := a.(k8stesting.PatchAction); ok && strings.Contains(string(p.GetPatch()), RedirectionPending) {
				pending.Add(1)
			}
			return false, nil, nil
		})
		sim := e.startSim(nil)
		uid, pns := e.enrolRunning(sim, "r", "10.7.9.4")
		sim.Close()

		e.stop()
		e.start()
		e.waitLog("taken over", uid)
		sim2 := e.startSim(nil)
		e.requireRules(pns, defaultParams)
		e.waitSim(sim2, "pod added in the snapshot", hasWorkload(uid, inode(t, pns)))
		// Anything queued by the snapshot's end has run once the pod's
		// verify passes; a second add would show as a no-op event.
		e.c.verify(uid)
		st := sim2.State()
		adds := 0
		for _, ev := range st.Events {
			if ev.Req.Kind == zds.KindAdd && ev.Req.UID == uid {
				adds++
			}
		}
		if adds != 1 {
			t.Errorf("the new ztunnel connection got %d adds of the pod, want 1 (its snapshot's): %+v", adds, st.Events)
		}
		if n := pending.Load(); n != 0 {
			t.Errorf("the pod was patched pending %d times during the rollout", n)
		}
		if p := e.waitPod(nsAmbient, "r", "enabled", redirection(RedirectionEnabled)); p == nil {
			t.Fatal("pod r")
		}
	})
}

// An ambient annotation that does not parse fails the pod's ADD naming
// the annotation and its value, with an Event, and nothing is applied:
// the pod neither starts unmeshed nor with capture it asked not to have.
func TestInvalidAnnotationFailsTheADD(t *testing.T) {
	forEachBackend(t, func(t *testing.T, e *env) {
		sim := e.startSim(nil)
		uid, pns := newUID(), e.podNS("10.7.9.5")
		p := &corev1.Pod{
			ObjectMeta: metav1.ObjectMeta{Namespace: nsAmbient, Name: "bad", UID: k8stypes.UID(uid),
				Annotations: map[string]string{AnnotationDNSCapture: "sometimes"}},
			Spec: corev1.PodSpec{NodeName: node},
		}
		if _, err := e.cs.CoreV1().Pods(nsAmbient).Create(context.Background(), p, metav1.CreateOptions{}); err != nil {
			t.Fatal(err)
		}
		f := e.openNS(pns)
		enrolled, err := e.c.EnrolOnAdd(context.Background(), nsAmbient, "bad", uid, f)
		if !enrolled || err == nil || !strings.Contains(err.Error(), AnnotationDNSCapture) || !strings.Contains(err.Error(), "sometimes") {
			t.Fatalf("EnrolOnAdd = %v, %v; want the ADD failed naming the annotation and its value", enrolled, err)
		}
		e.waitEvent(nsAmbient, "bad", "AmbientInvalidAnnotation")
		e.requireNoRules(pns)
		if _, ok := sim.State().Workloads[uid]; ok {
			t.Fatal("ztunnel was handed a pod whose annotation does not parse")
		}
	})
}

// A node at the kubelet's default limit: 110 enrolled pods running when a
// namespace is labelled are all enrolled (rules, probe entries, ztunnel),
// and a new agent hands every one of them to ztunnel in its snapshot.
func TestFullNode(t *testing.T) {
	const pods = 110
	b := backends()[0]
	e := newEnv(t, b, nil)
	sim := e.startSim(nil)
	type pod struct {
		uid string
		n   ns.NetNS
		ip  string
	}
	var all []pod
	for i := range pods {
		ip := fmt.Sprintf("10.8.%d.%d", i/200, 1+i%200)
		p := pod{newUID(), e.podNS(ip), ip}
		e.running(p.uid, p.n)
		e.createPod(nsPlain, fmt.Sprintf("full-%d", i), p.uid, nil, ip)
		all = append(all, p)
	}
	start := time.Now()
	e.updateNamespace(nsPlain, ambientLabel)
	e.waitSim(sim, "every pod added", func(st ztunnelsim.State) bool {
		n := 0
		for _, p := range all {
			if w, ok := st.Workloads[p.uid]; ok && len(w.Listening) > 0 {
				n++
			}
		}
		return n == pods
	})
	t.Logf("%d running pods enrolled by their namespace's label in %v", pods, time.Since(start))
	want := map[string]string{}
	for _, p := range all {
		want[p.ip] = p.uid
	}
	e.requireProbes(want)
	for _, p := range all[:5] {
		e.requireRules(p.n, defaultParams)
	}

	e.stop()
	e.start()
	st := e.waitSim(sim, "the new agent's snapshot", func(s ztunnelsim.State) bool { return s.Snapshots == 2 })
	conn := snapshotConn(t, st, 2)
	adds := map[string]bool{}
	for _, ev := range st.Events {
		if ev.Conn == conn && ev.Req.Kind == zds.KindAdd {
			adds[ev.Req.UID] = true
		}
	}
	if len(adds) != pods {
		t.Fatalf("the new agent's snapshot added %d pods, want %d", len(adds), pods)
	}
	e.requireProbes(want)
}

func (e *env) updateNamespace(name string, lbls map[string]string) {
	e.t.Helper()
	n, err := e.cs.CoreV1().Namespaces().Get(context.Background(), name, metav1.GetOptions{})
	if err != nil {
		e.t.Fatal(err)
	}
	n.Labels = lbls
	if _, err := e.cs.CoreV1().Namespaces().Update(context.Background(), n, metav1.UpdateOptions{}); err != nil {
		e.t.Fatal(err)
	}
}

// TestOtherBackendsProbeSNATRemoved: the probe SNAT an earlier agent left
// with the other rule backend (Istio's ISTIO_POSTRT and ipsets before a
// switch to nftables, or the reverse) is removed once the controller's own
// is in place. Left, it SNATed the probes of every later pod given an
// address of its frozen set.
func TestOtherBackendsProbeSNATRemoved(t *testing.T) {
	root := uint32(0)
	for _, tc := range []struct {
		ours         string
		stale        ambientnet.Host
		staleDump    []string
		staleMarkers []string
		noSet        string
	}{
		{"nftables", &iptables.Applier{}, []string{"iptables-nft-save", "-t", "nat"}, []string{"ISTIO_POSTRT"}, "no such set"},
		{"iptables-nft", &nftables.Applier{}, []string{"nft", "list", "ruleset"}, []string{"istio-ambient-nat"}, "is missing"},
	} {
		t.Run(tc.ours, func(t *testing.T) {
			var b backend
			for _, c := range backends() {
				if c.name == tc.ours {
					b = c
				}
			}
			leftover := netip.MustParseAddr("10.244.9.9")
			var node ns.NetNS
			e := newEnv(t, b, func(cfg *Config) {
				if _, err := tc.stale.EnsureHost(cfg.HostNetns, ruleset.HostParams{KubeletUID: &root}); err != nil {
					t.Fatal(err)
				}
				if _, err := tc.stale.SyncProbes(cfg.HostNetns, map[netip.Addr]string{leftover: "uid-gone"}); err != nil {
					t.Fatal(err)
				}
				cfg.StaleHost = tc.stale
			})
			node = e.node
			if len(e.ours(node)) == 0 {
				t.Fatal("the controller's own probe SNAT is not in place")
			}
			dump, err := run(node, tc.staleDump...)
			if err != nil {
				t.Fatal(err)
			}
			for _, m := range tc.staleMarkers {
				if strings.Contains(dump, m) {
					t.Fatalf("the other backend's %s is still there:\n%s", m, dump)
				}
			}
			// The sets are gone, not only emptied: a sync into them fails.
			_, err = tc.stale.SyncProbes(node.Path(), map[netip.Addr]string{leftover: "uid-gone"})
			if err == nil || !strings.Contains(err.Error(), tc.noSet) {
				t.Fatalf("a sync into the other backend's probe sets: %v, want %q", err, tc.noSet)
			}
		})
	}
}

// TestEnrolAfterRulesetFlush: after the node's nftables ruleset is flushed
// (a firewall manager's reload), the next pod to enrol puts the probe
// SNAT and its set back itself: it used to fail, as every enrolling pod
// did, until the periodic check (30 s) made the set again.
func TestEnrolAfterRulesetFlush(t *testing.T) {
	var b backend
	for _, c := range backends() {
		if c.name == "nftables" {
			b = c
		}
	}
	e := newEnv(t, b, nil)
	sim := e.startSim(nil)
	uidA, _ := e.enrolRunning(sim, "a", "10.7.8.1")
	if _, err := run(e.node, b.flush...); err != nil {
		t.Fatal(err)
	}
	uidB, _ := e.enrolRunning(sim, "b", "10.7.8.2")
	e.requireProbes(map[string]string{"10.7.8.1": uidA, "10.7.8.2": uidB})
	if len(e.ours(e.node)) == 0 {
		t.Fatal("the node's probe SNAT is not back")
	}
}

// A pod ambient mode never enrols (here a sidecar pod) is decided without
// its namespace: one that cannot be read does not fail its ADD, as it
// does not when the fallback serves it.
func TestExcludedPodNeedsNoNamespace(t *testing.T) {
	forEachBackend(t, func(t *testing.T, e *env) {
		uid, pns := newUID(), e.podNS("10.7.9.6")
		p := &corev1.Pod{
			ObjectMeta: metav1.ObjectMeta{Namespace: "not-there", Name: "sidecar", UID: k8stypes.UID(uid),
				Annotations: map[string]string{"sidecar.istio.io/status": "{}"}},
			Spec: corev1.PodSpec{NodeName: node},
		}
		if _, err := e.cs.CoreV1().Pods("not-there").Create(context.Background(), p, metav1.CreateOptions{}); err != nil {
			t.Fatal(err)
		}
		f := e.openNS(pns)
		if enrolled, err := e.c.EnrolOnAdd(context.Background(), "not-there", "sidecar", uid, f); enrolled || err != nil {
			t.Fatalf("EnrolOnAdd = %v, %v; want the pod left to sidecar mode", enrolled, err)
		}
		if enrolled, err := e.c.CheckOnCNI(context.Background(), "not-there", "sidecar", uid, f); enrolled || err != nil {
			t.Fatalf("CheckOnCNI = %v, %v; want the pod left to sidecar mode", enrolled, err)
		}
	})
}

// A new sandbox of a running pod (a node's reboot, a sandbox that died)
// has a new address, and the pod's status keeps the old sandbox's until
// the kubelet reports it: the ADD enrols the namespace's own address, and
// the controller does not take it back for the stale status meanwhile;
// once the status changes, it is followed.
func TestNewSandboxAddressOverStaleStatus(t *testing.T) {
	forEachBackend(t, func(t *testing.T, e *env) {
		sim := e.startSim(nil)
		const oldIP, newIP = "10.7.3.8", "10.7.3.9"
		uid, pns := newUID(), e.podNS(newIP)
		pod := e.createPod(nsAmbient, "resandboxed", uid, nil, oldIP)
		f := e.openNS(pns)
		if err := e.c.AddPod(context.Background(), pod, f); err != nil {
			t.Fatal(err)
		}
		e.requireProbes(map[string]string{newIP: uid})
		e.waitSim(sim, "pod handed to ztunnel", hasWorkload(uid, inode(t, pns)))
		// The controller's own pass over the pod, with the stale status.
		for deadline := time.Now().Add(10 * time.Second); e.c.podByUID(uid) == nil; {
			if time.Now().After(deadline) {
				t.Fatal("the pod never reached the controller's cache")
			}
			time.Sleep(5 * time.Millisecond) // polling an informer, bounded
		}
		if err := e.c.reconcile(context.Background(), uid); err != nil {
			t.Fatalf("reconcile with the stale status: %v", err)
		}
		e.requireProbes(map[string]string{newIP: uid})
		// The kubelet reports the new address: nothing to change.
		pod, err := e.cs.CoreV1().Pods(nsAmbient).Get(context.Background(), "resandboxed", metav1.GetOptions{})
		if err != nil {
			t.Fatal(err)
		}
		pod.Status.PodIP, pod.Status.PodIPs = newIP, []corev1.PodIP{{IP: newIP}}
		if _, err := e.cs.CoreV1().Pods(nsAmbient).UpdateStatus(context.Background(), pod, metav1.UpdateOptions{}); err != nil {
			t.Fatal(err)
		}
		if err := e.c.reconcile(context.Background(), uid); err != nil {
			t.Fatalf("reconcile with the new status: %v", err)
		}
		e.requireProbes(map[string]string{newIP: uid})
	})
}

// A pod whose namespace holds more than its status names at its ADD (a
// secondary network's address) is enrolled with its status's address
// alone, when the namespace holds it: only the status is stale-checked.
func TestStatusAddressAmongMore(t *testing.T) {
	forEachBackend(t, func(t *testing.T, e *env) {
		sim := e.startSim(nil)
		const podIP, extra = "10.7.3.10", "10.7.30.10"
		uid, pns := newUID(), e.podNS(podIP)
		e.sh(pns, "ip", "addr", "add", extra+"/32", "dev", "eth0")
		pod := e.createPod(nsAmbient, "multi", uid, nil, podIP)
		f := e.openNS(pns)
		if err := e.c.AddPod(context.Background(), pod, f); err != nil {
			t.Fatal(err)
		}
		e.requireProbes(map[string]string{podIP: uid})
		e.waitSim(sim, "pod handed to ztunnel", hasWorkload(uid, inode(t, pns)))
	})
}

// TestRepeatedADDKeepsTheHeldNamespace: a second ADD handing over the
// namespace already held leaves the held file open, as a snapshot being
// sent may be using it; ztunnel keeps the pod.
func TestRepeatedADDKeepsTheHeldNamespace(t *testing.T) {
	forEachBackend(t, func(t *testing.T, e *env) {
		sim := e.startSim(nil)
		const podIP = "10.7.4.10"
		uid, pns := newUID(), e.podNS(podIP)
		pod := e.createPod(nsAmbient, "again", uid, nil, podIP)
		if err := e.c.AddPod(context.Background(), pod, e.openNS(pns)); err != nil {
			t.Fatal(err)
		}
		e.waitSim(sim, "pod handed to ztunnel", hasWorkload(uid, inode(t, pns)))
		snap := e.c.Snapshot()
		if len(snap) != 1 || snap[0].Netns == nil {
			t.Fatalf("snapshot %+v, want the pod with its namespace", snap)
		}
		if err := e.c.AddPod(context.Background(), pod, e.openNS(pns)); err != nil {
			t.Fatal(err)
		}
		rc, err := snap[0].Netns.SyscallConn()
		if err == nil {
			err = rc.Control(func(uintptr) {})
		}
		if err != nil {
			t.Fatalf("the namespace file a snapshot took was closed by the repeated ADD: %v", err)
		}
		e.waitSim(sim, "pod kept in ztunnel", hasWorkload(uid, inode(t, pns)))
	})
}

// heldList holds the pod list until released: an agent whose informers
// have not synced yet.
type heldList struct {
	kubeclient.Interface
	release chan struct{}
}

func (h heldList) Pods(namespace string) kubeclient.Pods {
	return heldPods{h.Interface.Pods(namespace), h.release}
}

type heldPods struct {
	kubeclient.Pods
	release chan struct{}
}

func (p heldPods) List(ctx context.Context, o metav1.ListOptions) (*corev1.PodList, error) {
	select {
	case <-p.release:
	case <-ctx.Done():
		return nil, ctx.Err()
	}
	return p.Pods.List(ctx, o)
}

// TestZtunnelConnectsWhileTheAgentSyncs: the ZDS socket is bound before
// the informers sync, so ztunnel's first try after the old agent went
// connects (it redials with a back-off growing to 15 s), and its snapshot
// comes once the agent knows every pod, never before.
func TestZtunnelConnectsWhileTheAgentSyncs(t *testing.T) {
	e := newEnv(t, backends()[0], nil)
	e.stop()
	release := make(chan struct{})
	cfg := e.cfg
	cfg.Kube = heldList{clientset.Of(e.cs), release}
	cfg.Namespaces = e.cs.CoreV1().Namespaces()
	cfg.Registerer = prometheus.NewRegistry()
	c, err := New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- c.Run(ctx) }()
	released := false
	defer func() {
		if !released {
			close(release)
		}
		cancel()
		select {
		case err := <-done:
			if err != nil {
				t.Errorf("Run: %v", err)
			}
		case <-time.After(waitLimit):
			t.Error("Run did not return after its context ended")
		}
	}()
	var sim *ztunnelsim.Sim
	deadline := time.Now().Add(waitLimit)
	for {
		// Without Reconnect, Start fails unless it connects.
		if sim, err = ztunnelsim.Start(ztunnelsim.Config{Path: e.sock, Listeners: true}); err == nil {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("ztunnel could not connect while the agent's pod list was held: %v", err)
		}
		time.Sleep(5 * time.Millisecond) // polling the condition, not synchronising
	}
	t.Cleanup(sim.Close)
	if st := sim.State(); st.Snapshots != 0 {
		t.Fatalf("a snapshot before the informers synced: %+v", st)
	}
	close(release)
	released = true
	e.waitSim(sim, "the snapshot once synced", func(st ztunnelsim.State) bool { return st.Snapshots == 1 })
}

// A pod the agent enrolled but could not annotate yet (the annotation is
// written after enrolment, and the API server refused it until the agent
// stopped) is in the next agent's first snapshot: its namespace holds
// exactly its rules, and left out, ztunnel would drop its proxy while its
// rules still send its traffic there.
func TestRestartBeforeTheAnnotation(t *testing.T) {
	forEachBackend(t, func(t *testing.T, e *env) {
		var pending atomic.Int32
		e.cs.PrependReactor("patch", "pods", func(a k8stesting.Action) (bool, runtime.Object, error) {
			if p, ok := a.(k8stesting.PatchAction); ok && strings.Contains(string(p.GetPatch()), RedirectionPending) {
				pending.Add(1)
			}
			if a.GetSubresource() == "status" {
				return true, nil, errors.New("the API server is away")
			}
			return false, nil, nil
		})
		sim := e.startSim(nil)
		uid, pns := newUID(), e.podNS("10.7.9.7")
		e.running(uid, pns)
		e.createPod(nsAmbient, "u", uid, nil, "10.7.9.7")
		e.waitSim(sim, "pod added", hasWorkload(uid, inode(t, pns)))
		sim.Close()

		e.stop()
		pending.Store(0)
		e.start()
		// Before ztunnel is back, the pod waits for its snapshot: ztunnel
		// still runs it, so it is not marked pending.
		e.waitLog("taken over", uid)
		sim2 := e.startSim(nil)
		st := e.waitSim(sim2, "the new agent's snapshot", func(s ztunnelsim.State) bool { return s.Snapshots == 1 })
		conn := snapshotConn(t, st, 1)
		var inSnapshot []string
		for _, ev := range st.Events {
			if ev.Conn != conn {
				continue
			}
			if ev.Req.Kind == zds.KindSnapshotSent {
				break
			}
			inSnapshot = append(inSnapshot, fmt.Sprintf("%s %s", ev.Req.Kind, ev.Req.UID))
		}
		if want := fmt.Sprintf("%s %s", zds.KindAdd, uid); !slices.Contains(inSnapshot, want) {
			t.Fatalf("the new agent's snapshot: %v, want it to hold %q", inSnapshot, want)
		}
		e.requireRules(pns, defaultParams)
		if n := pending.Load(); n != 0 {
			t.Errorf("the pod was patched pending %d times across the restart", n)
		}
	})
}
