package ambient

import (
	"context"
	"time"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/runtime/serializer"
	"k8s.io/apimachinery/pkg/watch"
	"k8s.io/client-go/rest"
	"k8s.io/client-go/tools/cache"

	"github.com/istio-cni-go/istio-cni/internal/kubeclient"
	"github.com/istio-cni-go/istio-cni/internal/podcache"
)

// Namespaces is the controller's read of the cluster's namespaces: their
// labels enrol pods. A client-go Clientset's CoreV1().Namespaces() fits
// it, and so does NamespacesFor's.
type Namespaces interface {
	List(ctx context.Context, opts metav1.ListOptions) (*corev1.NamespaceList, error)
	Watch(ctx context.Context, opts metav1.ListOptions) (watch.Interface, error)
}

// NamespacesFor reads namespaces over rc's API server with the agent's
// own core-only scheme (kubeclient.Scheme), so the agent need not link
// client-go's typed clients for one more resource.
func NamespacesFor(rc *rest.Config) (Namespaces, error) {
	c := rest.CopyConfig(rc)
	gv := corev1.SchemeGroupVersion
	c.APIPath, c.GroupVersion = "/api", &gv
	c.NegotiatedSerializer = serializer.NewCodecFactory(kubeclient.Scheme).WithoutConversion()
	c.ContentType = runtime.ContentTypeProtobuf
	c.AcceptContentTypes = runtime.ContentTypeProtobuf + "," + runtime.ContentTypeJSON
	if c.UserAgent == "" {
		c.UserAgent = rest.DefaultKubernetesUserAgent()
	}
	rc2, err := rest.RESTClientFor(c)
	if err != nil {
		return nil, err
	}
	return restNamespaces{rc2}, nil
}

type restNamespaces struct{ c rest.Interface }

var parameters = runtime.NewParameterCodec(kubeclient.Scheme)

func (n restNamespaces) List(ctx context.Context, opts metav1.ListOptions) (*corev1.NamespaceList, error) {
	out := &corev1.NamespaceList{}
	err := n.c.Get().Resource("namespaces").VersionedParams(&opts, parameters).Timeout(listTimeout(opts)).Do(ctx).Into(out)
	return out, err
}

func (n restNamespaces) Watch(ctx context.Context, opts metav1.ListOptions) (watch.Interface, error) {
	opts.Watch = true
	return n.c.Get().Resource("namespaces").VersionedParams(&opts, parameters).Timeout(listTimeout(opts)).Watch(ctx)
}

func listTimeout(opts metav1.ListOptions) time.Duration {
	if opts.TimeoutSeconds != nil {
		return time.Duration(*opts.TimeoutSeconds) * time.Second
	}
	return 0
}

// uidIndex finds the node's pods by UID, the work queue's key.
const uidIndex = "uid"

func newPodInformer(cs kubeclient.Interface, node string) cache.SharedIndexInformer {
	inf := podcache.NewPodInformer(cs, "spec.nodeName="+node, "")
	_ = inf.SetTransform(trimPod)
	_ = inf.AddIndexers(cache.Indexers{uidIndex: func(obj any) ([]string, error) {
		if p, ok := obj.(*corev1.Pod); ok {
			return []string{string(p.UID)}, nil
		}
		return nil, nil
	}})
	return inf
}

func newNamespaceInformer(nss Namespaces) cache.SharedIndexInformer {
	lw := &cache.ListWatch{
		ListWithContextFunc: func(ctx context.Context, o metav1.ListOptions) (runtime.Object, error) {
			return nss.List(ctx, o)
		},
		WatchFuncWithContext: func(ctx context.Context, o metav1.ListOptions) (watch.Interface, error) {
			return nss.Watch(ctx, o)
		},
	}
	inf := cache.NewSharedIndexInformer(lw, &corev1.Namespace{}, 0, cache.Indexers{})
	_ = inf.SetTransform(trimNamespace)
	return inf
}

// trimPod keeps what the controller reads: identity, labels and
// annotations (selection, parameters, the redirection state), the service
// account (ztunnel's workload info), host network and users, the phase
// (a finished Job's pod leaves the mesh) and the IPs. podcache.Trim drops
// the service account and the phase, so the pod cache's informer cannot
// be shared as it is.
func trimPod(obj any) (any, error) {
	p, ok := obj.(*corev1.Pod)
	if !ok {
		return obj, nil
	}
	return &corev1.Pod{
		TypeMeta: p.TypeMeta,
		ObjectMeta: metav1.ObjectMeta{Name: p.Name, Namespace: p.Namespace, UID: p.UID, ResourceVersion: p.ResourceVersion,
			Labels: p.Labels, Annotations: p.Annotations, DeletionTimestamp: p.DeletionTimestamp},
		Spec: corev1.PodSpec{NodeName: p.Spec.NodeName, HostNetwork: p.Spec.HostNetwork, HostUsers: p.Spec.HostUsers,
			ServiceAccountName: p.Spec.ServiceAccountName},
		Status: corev1.PodStatus{Phase: p.Status.Phase, PodIP: p.Status.PodIP, PodIPs: p.Status.PodIPs},
	}, nil
}

func trimNamespace(obj any) (any, error) {
	n, ok := obj.(*corev1.Namespace)
	if !ok {
		return obj, nil
	}
	return &corev1.Namespace{TypeMeta: n.TypeMeta,
		ObjectMeta: metav1.ObjectMeta{Name: n.Name, UID: n.UID, ResourceVersion: n.ResourceVersion, Labels: n.Labels}}, nil
}
