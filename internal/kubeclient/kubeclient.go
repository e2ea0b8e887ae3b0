// Package kubeclient is the agent's Kubernetes API client: the pods,
// events and DaemonSets it reads and writes, over REST clients whose
// scheme holds the core and apps groups only.
//
// client-go's typed clients would do, but each imports client-go's scheme
// of every API group: their packages' start-up code and the binary's pages
// it touches were about 10 MB of the agent's resident memory (43 MB with
// 250 pods on its node, 33 MB without them), and half of its binary. The interfaces here are the typed clients' own methods, so
// a client-go Clientset (a fake one in tests) fits them through package
// clientset.
package kubeclient

import (
	"cmp"
	"context"
	"time"

	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/runtime/schema"
	"k8s.io/apimachinery/pkg/runtime/serializer"
	k8stypes "k8s.io/apimachinery/pkg/types"
	"k8s.io/apimachinery/pkg/watch"
	"k8s.io/client-go/rest"
	"k8s.io/client-go/tools/record"
	"k8s.io/client-go/util/flowcontrol"
)

// Interface is what the agent asks of the API server.
type Interface interface {
	Pods(namespace string) Pods
	DaemonSets(namespace string) DaemonSets
	Nodes() Nodes
	// Events is where the repair controller's event recorder writes.
	Events() record.EventSink
}

// Pods are the pod requests of the pod cache, the repair controller and
// the CNI server's lookups.
type Pods interface {
	Get(ctx context.Context, name string, opts metav1.GetOptions) (*corev1.Pod, error)
	List(ctx context.Context, opts metav1.ListOptions) (*corev1.PodList, error)
	Watch(ctx context.Context, opts metav1.ListOptions) (watch.Interface, error)
	Delete(ctx context.Context, name string, opts metav1.DeleteOptions) error
	Patch(ctx context.Context, name string, pt k8stypes.PatchType, data []byte, opts metav1.PatchOptions, subresources ...string) (*corev1.Pod, error)
}

// DaemonSets are the agent's reads of its own DaemonSet.
type DaemonSets interface {
	Get(ctx context.Context, name string, opts metav1.GetOptions) (*appsv1.DaemonSet, error)
	Watch(ctx context.Context, opts metav1.ListOptions) (watch.Interface, error)
}

// Nodes are the agent's reads of its own node, at termination (does its
// DaemonSet still target it).
type Nodes interface {
	Get(ctx context.Context, name string, opts metav1.GetOptions) (*corev1.Node, error)
}

// Scheme knows the core and apps groups' types, for decoding and for
// event references.
var Scheme = runtime.NewScheme()

var (
	codecs     = serializer.NewCodecFactory(Scheme)
	parameters = runtime.NewParameterCodec(Scheme)
)

func init() {
	metav1.AddToGroupVersion(Scheme, schema.GroupVersion{Version: "v1"})
	for _, add := range []func(*runtime.Scheme) error{corev1.AddToScheme, appsv1.AddToScheme} {
		if err := add(Scheme); err != nil {
			panic(err)
		}
	}
}

// Client talks to one API server.
type Client struct {
	core, apps rest.Interface
}

// New connects to rc's API server, in protobuf as the typed clients do:
// it is what the API server encodes fastest and the agent decodes with
// the least garbage.
func New(rc *rest.Config) (*Client, error) {
	if rc.RateLimiter == nil && rc.QPS > 0 {
		// One budget for both groups, as client-go's clientset keeps one
		// for all of its groups.
		rc = rest.CopyConfig(rc)
		rc.RateLimiter = flowcontrol.NewTokenBucketRateLimiter(rc.QPS, cmp.Or(rc.Burst, rest.DefaultBurst))
	}
	core, err := restFor(rc, "/api", corev1.SchemeGroupVersion)
	if err != nil {
		return nil, err
	}
	apps, err := restFor(rc, "/apis", appsv1.SchemeGroupVersion)
	if err != nil {
		return nil, err
	}
	return &Client{core: core, apps: apps}, nil
}

func restFor(rc *rest.Config, path string, gv schema.GroupVersion) (*rest.RESTClient, error) {
	c := rest.CopyConfig(rc)
	c.APIPath, c.GroupVersion = path, &gv
	c.NegotiatedSerializer = codecs.WithoutConversion()
	c.ContentType = runtime.ContentTypeProtobuf
	c.AcceptContentTypes = runtime.ContentTypeProtobuf + "," + runtime.ContentTypeJSON
	if c.UserAgent == "" {
		c.UserAgent = rest.DefaultKubernetesUserAgent()
	}
	return rest.RESTClientFor(c)
}

// RateLimiters are the core and apps groups' request budgets.
func (c *Client) RateLimiters() (core, apps flowcontrol.RateLimiter) {
	return c.core.GetRateLimiter(), c.apps.GetRateLimiter()
}

// Pods implements Interface.
func (c *Client) Pods(namespace string) Pods { return pods{c.core, namespace} }

// DaemonSets implements Interface.
func (c *Client) DaemonSets(namespace string) DaemonSets { return daemonSets{c.apps, namespace} }

// Nodes implements Interface.
func (c *Client) Nodes() Nodes { return nodes{c.core} }

// Events implements Interface.
func (c *Client) Events() record.EventSink { return events{c.core} }

// timeout is a list's or watch's own, as the typed clients pass it.
func timeout(opts metav1.ListOptions) time.Duration {
	if opts.TimeoutSeconds != nil {
		return time.Duration(*opts.TimeoutSeconds) * time.Second
	}
	return 0
}

type pods struct {
	c  rest.Interface
	ns string
}

func (p pods) Get(ctx context.Context, name string, opts metav1.GetOptions) (*corev1.Pod, error) {
	out := &corev1.Pod{}
	err := p.c.Get().Namespace(p.ns).Resource("pods").Name(name).VersionedParams(&opts, parameters).Do(ctx).Into(out)
	return out, err
}

func (p pods) List(ctx context.Context, opts metav1.ListOptions) (*corev1.PodList, error) {
	out := &corev1.PodList{}
	err := p.c.Get().Namespace(p.ns).Resource("pods").VersionedParams(&opts, parameters).Timeout(timeout(opts)).Do(ctx).Into(out)
	return out, err
}

func (p pods) Watch(ctx context.Context, opts metav1.ListOptions) (watch.Interface, error) {
	opts.Watch = true
	return p.c.Get().Namespace(p.ns).Resource("pods").VersionedParams(&opts, parameters).Timeout(timeout(opts)).Watch(ctx)
}

func (p pods) Delete(ctx context.Context, name string, opts metav1.DeleteOptions) error {
	return p.c.Delete().Namespace(p.ns).Resource("pods").Name(name).Body(&opts).Do(ctx).Error()
}

func (p pods) Patch(ctx context.Context, name string, pt k8stypes.PatchType, data []byte, opts metav1.PatchOptions, subresources ...string) (*corev1.Pod, error) {
	out := &corev1.Pod{}
	err := p.c.Patch(pt).Namespace(p.ns).Resource("pods").Name(name).SubResource(subresources...).
		VersionedParams(&opts, parameters).Body(data).Do(ctx).Into(out)
	return out, err
}

type daemonSets struct {
	c  rest.Interface
	ns string
}

func (d daemonSets) Get(ctx context.Context, name string, opts metav1.GetOptions) (*appsv1.DaemonSet, error) {
	out := &appsv1.DaemonSet{}
	err := d.c.Get().Namespace(d.ns).Resource("daemonsets").Name(name).VersionedParams(&opts, parameters).Do(ctx).Into(out)
	return out, err
}

func (d daemonSets) Watch(ctx context.Context, opts metav1.ListOptions) (watch.Interface, error) {
	opts.Watch = true
	return d.c.Get().Namespace(d.ns).Resource("daemonsets").VersionedParams(&opts, parameters).Timeout(timeout(opts)).Watch(ctx)
}

type nodes struct{ c rest.Interface }

func (n nodes) Get(ctx context.Context, name string, opts metav1.GetOptions) (*corev1.Node, error) {
	out := &corev1.Node{}
	err := n.c.Get().Resource("nodes").Name(name).VersionedParams(&opts, parameters).Do(ctx).Into(out)
	return out, err
}

// events is the recorder's sink, each event in its own namespace (the
// pod's), as client-go's EventSinkImpl writes them.
type events struct{ c rest.Interface }

func (e events) Create(ev *corev1.Event) (*corev1.Event, error) {
	out := &corev1.Event{}
	err := e.c.Post().Namespace(ev.Namespace).Resource("events").Body(ev).Do(context.TODO()).Into(out)
	return out, err
}

func (e events) Update(ev *corev1.Event) (*corev1.Event, error) {
	out := &corev1.Event{}
	err := e.c.Put().Namespace(ev.Namespace).Resource("events").Name(ev.Name).Body(ev).Do(context.TODO()).Into(out)
	return out, err
}

func (e events) Patch(ev *corev1.Event, data []byte) (*corev1.Event, error) {
	out := &corev1.Event{}
	err := e.c.Patch(k8stypes.StrategicMergePatchType).Namespace(ev.Namespace).Resource("events").Name(ev.Name).
		Body(data).Do(context.TODO()).Into(out)
	return out, err
}

// Namespaces are ambient mode's reads of the cluster's namespaces, whose
// labels enrol pods. A client-go Clientset's CoreV1().Namespaces() fits.
type Namespaces interface {
	List(ctx context.Context, opts metav1.ListOptions) (*corev1.NamespaceList, error)
	Watch(ctx context.Context, opts metav1.ListOptions) (watch.Interface, error)
}

// Namespaces reads namespaces; it is not part of Interface, since only
// ambient mode (and its RBAC) needs them.
func (c *Client) Namespaces() Namespaces { return namespaces{c.core} }

type namespaces struct{ c rest.Interface }

func (n namespaces) List(ctx context.Context, opts metav1.ListOptions) (*corev1.NamespaceList, error) {
	out := &corev1.NamespaceList{}
	err := n.c.Get().Resource("namespaces").VersionedParams(&opts, parameters).Timeout(timeout(opts)).Do(ctx).Into(out)
	return out, err
}

func (n namespaces) Watch(ctx context.Context, opts metav1.ListOptions) (watch.Interface, error) {
	opts.Watch = true
	return n.c.Get().Resource("namespaces").VersionedParams(&opts, parameters).Timeout(timeout(opts)).Watch(ctx)
}
