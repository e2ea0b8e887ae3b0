package agent

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"path/filepath"
	"time"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/informers"
	"k8s.io/client-go/kubernetes"
	listersv1 "k8s.io/client-go/listers/core/v1"
	"k8s.io/client-go/tools/cache"

	"github.com/istio-cni-go/istio-cni/internal/podinfo"
)

// PodCache is an informer on the pods of this node, served to the plugin
// over a Unix socket so that a pod start costs no API request.
type PodCache struct {
	lister   listersv1.PodLister
	synced   cache.InformerSynced
	informer cache.SharedIndexInformer
}

// Informer is the cache's pod informer, for the repair controller to
// share (one watch on the node's pods, not two).
func (pc *PodCache) Informer() cache.SharedIndexInformer { return pc.informer }

// StartPodCache starts the informer. It does not wait for the sync: until
// then the socket answers "unknown" and the plugin asks the API server.
func StartPodCache(ctx context.Context, cs kubernetes.Interface, node string) *PodCache {
	factory := informers.NewSharedInformerFactoryWithOptions(cs, 0,
		informers.WithTweakListOptions(func(o *metav1.ListOptions) { o.FieldSelector = "spec.nodeName=" + node }))
	inf := factory.Core().V1().Pods()
	// Keep only what pod selection reads; managed fields alone are often
	// larger than the rest of a pod.
	_ = inf.Informer().SetTransform(func(obj any) (any, error) {
		if p, ok := obj.(*corev1.Pod); ok {
			p.ManagedFields = nil
		}
		return obj, nil
	})
	pc := &PodCache{lister: inf.Lister(), synced: inf.Informer().HasSynced, informer: inf.Informer()}
	factory.Start(ctx.Done())
	return pc
}

// Limits of the agent socket: the fallback plugin asks it once per
// command, when the agent does not run the command itself.
var agentSocketLimits = sockLimits{maxConns: 32, readTimeout: 5 * time.Second}

// Serve answers GET /pod?namespace=&name=&uid= with the pod's JSON (404
// when the cache does not hold it, or holds another pod of that name) and
// GET /readyz with the agent's readiness, for the plugin's STATUS. Closing
// the returned server removes the socket.
func (pc *PodCache) Serve(runDir string, readyReason func() string, log *slog.Logger, m *SocketMetrics) (io.Closer, error) {
	srv, err := newSockServer(filepath.Join(runDir, podinfo.AgentSocketName), agentSocketLimits, log, m)
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
		pod, err := pc.lister.Pods(ns).Get(name)
		if err != nil || (uid != "" && string(pod.UID) != uid) {
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
	return serveHTTPSocket(srv, mux), nil
}

// WaitSynced waits for the first list of the node's pods.
func (pc *PodCache) WaitSynced(ctx context.Context) error {
	if !cache.WaitForCacheSync(ctx.Done(), pc.synced) {
		return fmt.Errorf("pod cache did not sync")
	}
	return nil
}
