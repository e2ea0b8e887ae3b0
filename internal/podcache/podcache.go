// Package podcache holds the node's pods in memory (an informer on the
// pods of this node, trimmed to what pod selection reads) and serves them
// to the plugin on the agent socket (agent.sock), with the agent's
// readiness for the plugin's STATUS, so a pod start costs no API request.
//
// It does not decide anything about a pod: selection is the plugin's, and
// the repair controller only shares the informer.
package podcache

import (
	"context"
	"encoding/json"
	"fmt"
	"log/slog"
	"net/http"
	"path/filepath"
	"time"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/watch"
	listersv1 "k8s.io/client-go/listers/core/v1"
	"k8s.io/client-go/tools/cache"

	"github.com/istio-cni-go/istio-cni/internal/kubeclient"
	"github.com/istio-cni-go/istio-cni/internal/podinfo"
	"github.com/istio-cni-go/istio-cni/internal/sockserve"
)

// Cache is an informer on the pods of this node.
type Cache struct {
	lister   listersv1.PodLister
	synced   cache.InformerSynced
	informer cache.SharedIndexInformer
	done     chan struct{}
}

// Informer is the cache's pod informer, for the repair controller to
// share (one watch on the node's pods, not two).
func (pc *Cache) Informer() cache.SharedIndexInformer { return pc.informer }

// Start starts the informer until ctx ends. It does not wait for the
// sync: until then the socket answers "unknown" and the plugin asks the
// API server. Done says when the informer's goroutines have all ended.
func Start(ctx context.Context, cs kubeclient.Interface, node string) *Cache {
	inf := NewPodInformer(cs, "spec.nodeName="+node, "")
	// Keep only what pod selection and repair read.
	_ = inf.SetTransform(Trim)
	pc := &Cache{lister: listersv1.NewPodLister(inf.GetIndexer()), synced: inf.HasSynced, informer: inf, done: make(chan struct{})}
	go func() {
		defer close(pc.done)
		// Run returns once the informer's goroutines have ended, after ctx.
		inf.RunWithContext(ctx)
	}()
	return pc
}

// NewPodInformer is an informer on the pods the field and label selectors
// select. It is built by hand: the informer factory of client-go would
// link every group's informers, listers and typed clients into the agent,
// for the one it uses.
func NewPodInformer(cs kubeclient.Interface, fieldSelector, labelSelector string) cache.SharedIndexInformer {
	pods := cs.Pods(metav1.NamespaceAll)
	narrow := func(o *metav1.ListOptions) { o.FieldSelector, o.LabelSelector = fieldSelector, labelSelector }
	lw := &cache.ListWatch{
		ListWithContextFunc: func(ctx context.Context, o metav1.ListOptions) (runtime.Object, error) {
			narrow(&o)
			return pods.List(ctx, o)
		},
		WatchFuncWithContext: func(ctx context.Context, o metav1.ListOptions) (watch.Interface, error) {
			narrow(&o)
			return pods.Watch(ctx, o)
		},
	}
	return cache.NewSharedIndexInformer(lw, &corev1.Pod{}, 0, cache.Indexers{cache.NamespaceIndex: cache.MetaNamespaceIndexFunc})
}

// Done is closed once the informer has stopped, after the context given
// to Start ended.
func (pc *Cache) Done() <-chan struct{} { return pc.done }

// Synced reports whether the first list of the node's pods has arrived.
func (pc *Cache) Synced() bool { return pc.synced() }

// Pod is the cached pod ns/name, or ErrNotFound when the cache does not
// hold it or holds another pod of that name (uid, when given, differs).
func (pc *Cache) Pod(ns, name, uid string) (*corev1.Pod, error) {
	pod, err := pc.lister.Pods(ns).Get(name)
	if err != nil || (uid != "" && string(pod.UID) != uid) {
		return nil, podinfo.ErrNotFound
	}
	return pod, nil
}

// Limits of the agent socket: the fallback plugin asks it once per
// command, when the agent does not run the command itself.
var socketLimits = sockserve.Limits{MaxConns: 32, ReadTimeout: 5 * time.Second}

// Serve answers, on runDir's agent socket until ctx ends, GET
// /pod?namespace=&name=&uid= with the pod's JSON (404 when the cache does
// not hold it, or holds another pod of that name) and GET /readyz with the
// agent's readiness, for the plugin's STATUS. pc may be nil (no API
// access): /pod then always answers 503. The returned channel is closed
// once the socket is gone and the server has stopped.
func (pc *Cache) Serve(ctx context.Context, runDir string, readyReason func() string, log *slog.Logger, m *sockserve.Metrics) (<-chan struct{}, error) {
	srv, err := sockserve.Listen(filepath.Join(runDir, podinfo.AgentSocketName), socketLimits, log, m)
	if err != nil {
		return nil, err
	}
	mux := http.NewServeMux()
	mux.HandleFunc("/pod", func(w http.ResponseWriter, r *http.Request) {
		q := r.URL.Query()
		ns, name, uid := q.Get("namespace"), q.Get("name"), q.Get("uid")
		if pc == nil || !pc.synced() {
			http.Error(w, "pod cache not synced", http.StatusServiceUnavailable)
			return
		}
		if podinfo.ValidateName(ns, name) != nil {
			http.Error(w, "invalid pod name", http.StatusBadRequest)
			return
		}
		pod, err := pc.Pod(ns, name, uid)
		if err != nil {
			http.Error(w, "pod not in the node's cache", http.StatusNotFound)
			return
		}
		w.Header().Set("Content-Type", "application/json")
		_ = json.NewEncoder(w).Encode(pod)
	})
	mux.HandleFunc("/readyz", func(w http.ResponseWriter, _ *http.Request) {
		if reason := readyReason(); reason != "" {
			http.Error(w, "not ready: "+reason, http.StatusServiceUnavailable)
			return
		}
		_, _ = w.Write([]byte("ready\n"))
	})
	return sockserve.ServeSocket(ctx, srv, mux), nil
}

// WaitSynced waits for the first list of the node's pods.
func (pc *Cache) WaitSynced(ctx context.Context) error {
	if !cache.WaitForCacheSync(ctx.Done(), pc.synced) {
		return fmt.Errorf("pod cache did not sync")
	}
	return nil
}

// PodFromCore reduces a pod to what selection reads, with the same result
// as decoding its JSON (podinfo.DecodeJSON): an env var with an empty or
// referenced value is left out, as the JSON omits empty values.
func PodFromCore(p *corev1.Pod) *podinfo.Pod {
	out := &podinfo.Pod{
		Namespace: p.Namespace, Name: p.Name, UID: string(p.UID),
		Labels: p.Labels, Annotations: p.Annotations, HostNetwork: p.Spec.HostNetwork,
		InitContainers: containersFromCore(p.Spec.InitContainers),
		Containers:     containersFromCore(p.Spec.Containers),
	}
	for _, ip := range p.Status.PodIPs {
		out.PodIPs = append(out.PodIPs, ip.IP)
	}
	return out
}

func containersFromCore(in []corev1.Container) []podinfo.Container {
	out := make([]podinfo.Container, 0, len(in))
	for i := range in {
		c := &in[i]
		pc := podinfo.Container{Name: c.Name, Args: c.Args}
		for _, e := range c.Env {
			if e.Value == "" {
				continue
			}
			if pc.Env == nil {
				pc.Env = map[string]string{}
			}
			pc.Env[e.Name] = e.Value
		}
		if sc := c.SecurityContext; sc != nil {
			pc.RunAsUser, pc.RunAsGroup = sc.RunAsUser, sc.RunAsGroup
		}
		out = append(out, pc)
	}
	return out
}
