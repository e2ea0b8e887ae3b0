package cniserver

import (
	"bytes"
	"context"
	"hash/fnv"
	"log/slog"
	"maps"
	"slices"
	"sync"
	"time"

	"github.com/containernetworking/cni/pkg/types"
	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/api/equality"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/tools/cache"

	"github.com/istio-cni-go/istio-cni/internal/cnirelay"
	"github.com/istio-cni-go/istio-cni/internal/logging"
	"github.com/istio-cni-go/istio-cni/internal/plugin"
	"github.com/istio-cni-go/istio-cni/internal/podcache"
	"github.com/istio-cni-go/istio-cni/internal/podinfo"
	"github.com/istio-cni-go/istio-cni/internal/podrules"
	"github.com/istio-cni-go/istio-cni/internal/prepared"
	"github.com/istio-cni-go/istio-cni/internal/redirect"
)

// Preparing pods' ADDs ahead (internal/prepared): for every pod of the
// node whose sandbox has no network yet, the agent keeps a record of what
// its ADD would do under each plugin config it has learnt, so that the
// relay serves the ADD without asking the agent.

// How many plugin configs records are kept for, and how many a config
// must be seen in before it is one of them: a node runs pods with one
// config, two while it is rewritten; a runtime that put something of
// each pod's into the config would otherwise have every ADD re-prepare
// every pending pod.
const (
	maxLearnt    = 4
	learnAfter   = 2
	maxCandidate = 16
)

// preparer keeps the records.
type preparer struct {
	s    *Server
	dir  prepared.Dir
	inf  cache.SharedIndexInformer
	log  *slog.Logger
	work *prepQueue
	// done is closed when the worker has stopped: no record is written
	// after it.
	done chan struct{}

	mu     sync.Mutex
	learnt []learntConfig
	// learntGen counts the changes of learnt: a record is written only
	// under the newest.
	learntGen  uint64
	candidates map[string]int
	// written are the pods (by UID) with a record, and a hash of it
	// (never zero).
	written map[string]uint64
}

type learntConfig struct {
	canonical []byte
	conf      *plugin.Config
}

// startPreparing keeps records in dir for the pods of pc until ctx ends.
func (s *Server) startPreparing(ctx context.Context, dir string) error {
	p := &preparer{s: s, dir: prepared.Dir(dir), inf: s.Pods.Informer(), log: s.SocketLog,
		work: newPrepQueue(), candidates: map[string]int{}, written: map[string]uint64{}}
	if p.log == nil {
		p.log = s.Log
	}
	if err := p.dir.Reset(); err != nil {
		return err
	}
	if err := p.dir.SetAgentWait(s.AgentWait); err != nil {
		return err
	}
	if err := p.dir.Beat(); err != nil {
		return err
	}
	// The configs an earlier agent learnt: pods waiting for this one
	// (restarted by an upgrade, say) are prepared from the start.
	for _, c := range p.dir.LoadConfigs() {
		if conf, err := plugin.ParseConfig(c); err == nil && !conf.AmbientEnabled && len(p.learnt) < maxLearnt {
			p.learnt = append(p.learnt, learntConfig{canonical: c, conf: conf})
		}
	}
	if len(p.learnt) > 0 {
		p.log.Info("preparing the ADDs of pods not yet started under the plugin configs an earlier agent learnt", "configs", len(p.learnt))
	}
	_, err := p.inf.AddEventHandler(cache.ResourceEventHandlerFuncs{
		// A pod new to the node goes first: its sandbox is being made.
		AddFunc:    func(obj any) { p.enqueue(obj, true) },
		UpdateFunc: p.updated,
		DeleteFunc: func(obj any) {
			if t, ok := obj.(cache.DeletedFinalStateUnknown); ok {
				obj = t.Obj
			}
			if pod, ok := obj.(*corev1.Pod); ok {
				p.forget(pod)
			}
		},
	})
	if err != nil {
		return err
	}
	s.prep = p
	go func() {
		<-ctx.Done()
		p.work.shutDown()
	}()
	go p.beat(ctx, beatEvery)
	// Two workers: one for pods new to the node alone, so that none waits
	// behind a backlog item whose plan takes long to prepare (thousands of
	// ranges, when a config is learnt with many pods waiting).
	p.done = make(chan struct{})
	var wg sync.WaitGroup
	warm := slices.Clone(p.learnt)
	for _, newOnly := range []bool{true, false} {
		wg.Add(1)
		go func() {
			defer wg.Done()
			if !newOnly {
				p.warm(warm)
			}
			for p.next(newOnly) {
			}
		}()
	}
	go func() {
		wg.Wait()
		close(p.done)
	}()
	return nil
}

// beatEvery is how often the agent tells relays it is running
// (prepared.BeatEvery; shorter in tests).
var beatEvery = prepared.BeatEvery

// beat renews the agent's file every d until ctx ends. A renewal that
// fails is logged once until one succeeds: relays stop using the records
// after prepared.AliveFor and ask the agent, which is slower, not wrong.
func (p *preparer) beat(ctx context.Context, d time.Duration) {
	t := time.NewTicker(d)
	defer t.Stop()
	failing := false
	for {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
		err := p.dir.Beat()
		switch {
		case err != nil && !failing:
			p.log.Warn("cannot tell relays the agent is running; once that is a minute old they stop using the prepared records", "error", err.Error())
		case err == nil && failing:
			p.log.Info("telling relays the agent is running again")
		}
		failing = err != nil
	}
}

// updated takes a pod's update. The kubelet's status updates of a pod it
// is starting come as its sandbox is made, in a burst while the agent's
// container is shortest of CPU: a record they cannot change is not
// prepared again. One they change (an annotation, or the pod started) is
// removed at once, before the worker, which may be behind, writes the new
// one: until then the pod's relay asks the agent, which reads the pod as
// it is now, rather than send what its old version asked for.
func (p *preparer) updated(old, obj any) {
	if o, ok := old.(*corev1.Pod); ok {
		if n, ok := obj.(*corev1.Pod); ok {
			if sameForADD(o, n) {
				return
			}
			if o.UID != n.UID {
				// Deleted and made again under the name while the watch
				// was down: the relist tells it as an update.
				p.forget(o)
			}
			p.forget(n)
		}
	}
	p.enqueue(obj, false)
}

func (p *preparer) enqueue(obj any, first bool) {
	if key, err := cache.DeletionHandlingMetaNamespaceKeyFunc(obj); err == nil {
		p.work.add(key, first)
	}
}

// pending: the pod's sandbox has had no ADD yet, as far as the API
// server knows (the kubelet reports the pod's IP after it).
func pending(pod *corev1.Pod) bool {
	return pod.Status.PodIP == "" && !pod.Spec.HostNetwork && pod.DeletionTimestamp == nil
}

// next prepares the next pod in the queue (of the pods new to the node
// only, with newOnly); false once the queue is shut.
func (p *preparer) next(newOnly bool) bool {
	key, ok := p.work.get(newOnly)
	if !ok {
		return false
	}
	obj, exists, err := p.inf.GetIndexer().GetByKey(key)
	pod, _ := obj.(*corev1.Pod)
	if err != nil || !exists || pod == nil {
		// Gone: its deletion removed its record.
		return true
	}
	if !pending(pod) {
		p.forget(pod)
		return true
	}
	p.mu.Lock()
	learnt, gen := p.learnt, p.learntGen
	p.mu.Unlock()
	if len(learnt) == 0 {
		p.forget(pod)
		return true
	}
	// A record with no entry (the pod cannot be decided, or its rules
	// not prepared, under any config learnt) still tells the pod's relay
	// to ask the agent and wait for it (the agent applies such rules in
	// place), rather than leave it for the fallback.
	rec := p.record(pod, learnt)
	data, err := rec.MarshalBinary()
	if err != nil {
		p.log.Warn("cannot keep a pod's prepared ADD; its relay will ask the agent", "pod", key, "error", err.Error())
		p.forget(pod)
		return true
	}
	// A pending pod is updated a few times before its sandbox starts
	// (scheduled, conditions), mostly in what its ADD does not read.
	h := fnv.New64a()
	_, _ = h.Write(data)
	sum := h.Sum64() | 1
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.work.isShut() {
		// The agent is stopping: it writes nothing more.
		return false
	}
	if p.learntGen != gen {
		// A config learnt meanwhile: the record the other worker may
		// have written under it must not be replaced by this one, which
		// lacks it. adopt has queued the pod again.
		p.work.add(key, false)
		return true
	}
	if p.written[string(pod.UID)] == sum {
		return true
	}
	if err := p.dir.PutData(rec.UID, data); err != nil {
		p.log.Warn("cannot keep a pod's prepared ADD; its relay will ask the agent", "pod", key, "error", err.Error())
		// The record there, if any, is of an older version of the pod.
		delete(p.written, string(pod.UID))
		_ = p.dir.Remove(string(pod.UID))
		return true
	}
	// The informer takes a pod out of its store before it tells the
	// deletion: a pod deleted since it was read is caught here, one
	// deleted later by forget. A pod changed since it was read (the
	// other worker may have seen it started, with no record to remove
	// yet) is read again.
	now, ok, _ := p.inf.GetIndexer().GetByKey(key)
	np, _ := now.(*corev1.Pod)
	if !ok || np == nil || np.UID != pod.UID {
		_ = p.dir.Remove(string(pod.UID))
		return true
	}
	if np.ResourceVersion != pod.ResourceVersion && !sameForADD(pod, np) {
		delete(p.written, string(pod.UID))
		_ = p.dir.Remove(string(pod.UID))
		p.work.add(key, false)
		return true
	}
	p.written[string(pod.UID)] = sum
	p.log.Debug("pod's ADD prepared", "pod", key, "configs", len(rec.Entries))
	return true
}

// sameForADD: two versions of a pod whose records would be the same,
// both pending, with what an ADD reads of a pod (podcache.PodFromCore:
// its labels, annotations and spec, as the cache trims them) unchanged.
func sameForADD(a, b *corev1.Pod) bool {
	return a.UID == b.UID && pending(a) && pending(b) &&
		maps.Equal(a.Labels, b.Labels) && maps.Equal(a.Annotations, b.Annotations) &&
		equality.Semantic.DeepEqual(a.Spec, b.Spec)
}

// forget removes the pod's record, if it has one.
func (p *preparer) forget(pod *corev1.Pod) {
	uid := string(pod.UID)
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.written[uid] != 0 {
		delete(p.written, uid)
		_ = p.dir.Remove(uid)
	}
}

// record is what the pod's ADD would do under each learnt config: what
// plugin.Add decides, and the rules PreparePod would hand the relay for
// a namespace with IPv4 rules only and with IPv6 ones too. A config under
// which the pod cannot be decided (an annotation that does not parse) or
// prepared for gets no entry: its ADD asks the agent, which says why.
func (p *preparer) record(pod *corev1.Pod, learnt []learntConfig) *prepared.Record {
	rec := &prepared.Record{Namespace: pod.Namespace, Name: pod.Name, UID: string(pod.UID)}
	info := podcache.PodFromCore(pod)
	args := &plugin.K8sArgs{K8S_POD_NAMESPACE: types.UnmarshallableString(pod.Namespace),
		K8S_POD_NAME: types.UnmarshallableString(pod.Name), K8S_POD_UID: types.UnmarshallableString(pod.UID)}
	source := func(*plugin.Config, string) (podinfo.Source, error) { return knownPod{info}, nil }
	for _, lc := range learnt {
		d, err := plugin.Decide(context.Background(), lc.conf, args, source)
		if err != nil {
			continue
		}
		e := prepared.Entry{Config: lc.canonical, Skip: d.Skip}
		if d.Skip == "" {
			rules := p.s.Rules
			if lc.conf.NativeNftables && p.s.NFTables != nil {
				rules = p.s.NFTables
			}
			txn4, _, err := podrules.PrepareAhead(rules, d.Params, false)
			if txn4 == nil || err != nil {
				continue
			}
			if e.Txn4, err = txn4.MarshalBinary(); err != nil {
				continue
			}
			e.Mode, e.Kind, e.IPSets, e.DualStack = string(d.Params.Mode), txn4.Summary, len(txn4.Undo) > 0, d.Params.DualStack
			// A node that cannot make the IPv6 rules (IPv6 off) still
			// serves its IPv4 pods from records; a pod with IPv6 then
			// asks the agent, which says why.
			if txn46, _, err := podrules.PrepareAhead(rules, d.Params, true); txn46 != nil && err == nil {
				if b, err := txn46.MarshalBinary(); err == nil {
					e.Txn46, e.IPSets = b, e.IPSets || len(txn46.Undo) > 0
				}
			}
		}
		rec.Entries = append(rec.Entries, e)
	}
	return rec
}

// warmPod is an injected pod with nothing of its own to say about its
// redirection: most sidecar pods' plan.
var warmPod = &corev1.Pod{
	ObjectMeta: metav1.ObjectMeta{Namespace: "default", Name: "istio-cni-warm-up", UID: "warm-up",
		Annotations: map[string]string{redirect.AnnotationStatus: "{}"}},
	Spec: corev1.PodSpec{Containers: []corev1.Container{{Name: "app"}, {Name: redirect.ProxyContainerName}}},
}

// warm prepares, under the configs an earlier agent learnt, the plan of
// a pod that sets nothing of its redirection, before any pod asks: the
// backend keeps it (and iptables stores it for the fallback,
// Applier.StorePlansIn), so a burst right after an agent's start finds
// the most common plan prepared, whoever serves it.
func (p *preparer) warm(learnt []learntConfig) {
	if len(learnt) > 0 {
		_ = p.record(warmPod, learnt)
	}
}

// knownPod is a pod source that holds the one pod being prepared.
type knownPod struct{ pod *podinfo.Pod }

func (k knownPod) GetPod(_ context.Context, namespace, name string) (*podinfo.Pod, error) {
	if k.pod.Namespace != namespace || k.pod.Name != name {
		return nil, podinfo.ErrNotFound
	}
	return k.pod, nil
}

// learn takes note of the config of an ADD the agent served (its config
// and arguments passed the checks a plugin's are put to): once seen in
// learnAfter ADDs, pending pods get records for it. Configs the relay
// could not serve an ADD under alone (ambient mode) are not learnt.
func (p *preparer) learn(stdin []byte) {
	c, err := prepared.ParseConfig(stdin)
	if err != nil {
		return
	}
	p.mu.Lock()
	if p.learntLocked(c.Canonical) {
		p.mu.Unlock()
		return
	}
	key := string(c.Canonical)
	p.candidates[key]++
	if p.candidates[key] < learnAfter {
		if len(p.candidates) > maxCandidate {
			clear(p.candidates)
		}
		p.mu.Unlock()
		return
	}
	delete(p.candidates, key)
	p.mu.Unlock()
	conf, err := plugin.ParseConfig(stdin)
	if err != nil || conf.AmbientEnabled {
		return
	}
	p.adopt(c.Canonical, conf, false)
}

// adopt makes a config one that records are kept for, the newest, and
// has every pending pod prepared under it. expected says the config was
// not learnt from ADDs but read from the CNI config file (what the
// runtime will hand the plugin): no ADD under it has prepared the most
// common plan yet, so it is prepared now.
func (p *preparer) adopt(canonical []byte, conf *plugin.Config, expected bool) {
	p.mu.Lock()
	if p.learntLocked(canonical) {
		// Learnt meanwhile, from another ADD, or already expected.
		p.mu.Unlock()
		return
	}
	lc := learntConfig{canonical: canonical, conf: conf}
	learnt := append([]learntConfig{lc}, p.learnt...)
	if len(learnt) > maxLearnt {
		learnt = learnt[:maxLearnt]
	}
	p.learnt = learnt
	p.learntGen++
	keep := make([][]byte, len(learnt))
	for i, lc := range learnt {
		keep[i] = lc.canonical
	}
	if err := p.dir.SaveConfigs(keep); err != nil {
		p.log.Warn("cannot keep the learnt plugin configs for the next agent", "error", err.Error())
	}
	p.mu.Unlock()
	if expected {
		p.log.Info("preparing the ADDs of pods not yet started under the plugin config the runtime will read from the CNI config file", "configs", len(learnt))
		p.warm([]learntConfig{lc})
	} else {
		p.log.Info("preparing the ADDs of pods not yet started under a plugin config the runtime uses", "configs", len(learnt))
	}
	for _, obj := range p.inf.GetIndexer().List() {
		if pod, ok := obj.(*corev1.Pod); ok && pending(pod) {
			p.enqueue(pod, false)
		}
	}
}

// learntLocked reports whether the canonical config is learnt; p.mu is
// held.
func (p *preparer) learntLocked(canonical []byte) bool {
	for _, lc := range p.learnt {
		if bytes.Equal(lc.canonical, canonical) {
			return true
		}
	}
	return false
}

// level is the plugin's log level under the newest learnt config.
func (p *preparer) level() slog.Level {
	p.mu.Lock()
	defer p.mu.Unlock()
	if len(p.learnt) == 0 {
		return slog.LevelInfo
	}
	lv, _ := logging.PluginLevel(p.learnt[0].conf.PluginLogLevel)
	return lv
}

// noteDone logs and counts an ADD a relay served from a record, or a DEL
// it answered itself, as the agent logs and counts the commands it serves.
func (s *Server) noteDone(req *cnirelay.Request) {
	lv := slog.LevelInfo
	if s.prep != nil {
		lv = s.prep.level()
	}
	log := logging.Over(s.Log.Handler())
	log.SetLevel(lv)
	l := log.With("cmd", req.Command, "pod", cnirelay.PodOf(req.Args), "containerID", req.ContainerID)
	if req.Command == "DEL" {
		// A DEL the relay answered itself (cnirelay.Relay.serveDel), as
		// the plugin would have.
		s.count("DEL", "ok")
		l.Debug("pod deleted; its rules go with its network namespace", "served_by", "plugin")
		return
	}
	d := req.Done
	if d.Unlocked != "" {
		// The line plugin.LockWriters logs for the agent, the fallback
		// and repair.
		l.Warn(plugin.UnlockedWarning, "error", d.Unlocked, "prepared", true)
	}
	result := "ok"
	if d.Error != "" {
		result = "999"
	}
	s.count("ADD", result)
	if s.PreparedAdds != nil {
		s.PreparedAdds.WithLabelValues(result).Inc()
	}
	switch {
	case d.Error != "":
		l.Error("programming redirect rules failed", "error", d.Error, "committed_by", "plugin", "prepared", true)
	case d.Skip != "":
		l.Info("no redirection", "reason", d.Skip, "duration", d.Total.String(), "prepared", true)
	default:
		l.Info("redirect rules programmed", "mode", d.Mode, "ipv6", d.IPv6, "result", d.Summary+" applied",
			"duration", d.Total.String(), "apply", d.Took.String(), "committed_by", "plugin", "prepared", true,
			"plugin_cpu", d.CPU.String())
	}
}

// prepQueue is the preparer's queue of pod keys, each waiting once: the
// pods new to the node first, then the rest (updates, and every pending
// pod again when a config is learnt), so that a pod whose sandbox is
// being made does not wait behind a backlog. Two workers take from it,
// one of them the new pods only; a pod may be prepared by both at once,
// and a record of a version of the pod that is no longer the cache's is
// removed and the pod prepared again (next).
type prepQueue struct {
	mu          sync.Mutex
	cond        *sync.Cond
	first, rest []string
	waiting     map[string]bool
	shut        bool
}

func newPrepQueue() *prepQueue {
	q := &prepQueue{waiting: map[string]bool{}}
	q.cond = sync.NewCond(&q.mu)
	return q
}

func (q *prepQueue) add(key string, first bool) {
	q.mu.Lock()
	defer q.mu.Unlock()
	if q.shut || q.waiting[key] {
		return
	}
	q.waiting[key] = true
	if first {
		q.first = append(q.first, key)
	} else {
		q.rest = append(q.rest, key)
	}
	// Either worker may be the one that can take it.
	q.cond.Broadcast()
}

// get waits for a key, of the pods new to the node only with newOnly;
// false once the queue is shut.
func (q *prepQueue) get(newOnly bool) (string, bool) {
	q.mu.Lock()
	defer q.mu.Unlock()
	for !q.shut && len(q.first) == 0 && (newOnly || len(q.rest) == 0) {
		q.cond.Wait()
	}
	if q.shut {
		return "", false
	}
	var key string
	if len(q.first) > 0 {
		key, q.first = q.first[0], q.first[1:]
	} else {
		key, q.rest = q.rest[0], q.rest[1:]
	}
	delete(q.waiting, key)
	return key, true
}

func (q *prepQueue) isShut() bool {
	q.mu.Lock()
	defer q.mu.Unlock()
	return q.shut
}

func (q *prepQueue) shutDown() {
	q.mu.Lock()
	defer q.mu.Unlock()
	q.shut = true
	q.cond.Broadcast()
}
