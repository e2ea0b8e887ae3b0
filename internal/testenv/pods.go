package testenv

import (
	"context"
	"fmt"

	corev1 "k8s.io/api/core/v1"
	nodev1 "k8s.io/api/node/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes"
)

// NodeName is the node the test pods are bound to.
const NodeName = "node-e2e"

// EnsureNamespace creates a namespace and its default service account.
func EnsureNamespace(ctx context.Context, cs kubernetes.Interface, name string) error {
	_, err := cs.CoreV1().Namespaces().Create(ctx, &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: name}}, metav1.CreateOptions{})
	if err != nil && !isExists(err) {
		return err
	}
	_, err = cs.CoreV1().ServiceAccounts(name).Create(ctx, &corev1.ServiceAccount{ObjectMeta: metav1.ObjectMeta{Name: "default"}}, metav1.CreateOptions{})
	if err != nil && !isExists(err) {
		return err
	}
	return nil
}

// PodSpec describes a test pod.
type PodSpec struct {
	Namespace, Name string
	Annotations     map[string]string
	Labels          map[string]string
	// Sidecar adds an injected istio-proxy container (and the status
	// annotation); NativeSidecar makes it an init container instead.
	Sidecar       bool
	NativeSidecar bool
	ProxyEnv      map[string]string
	ProxyUID      *int64
	ProxyGID      *int64
	ProxyArgs     []string
	InitNames     []string
	// Node overrides NodeName.
	Node string
}

// InjectedStatus is a typical sidecar.istio.io/status value.
const InjectedStatus = `{"initContainers":["istio-validation"],"containers":["istio-proxy"],"volumes":["istio-envoy"],"imagePullSecrets":null,"revision":"default"}`

// CreatePod creates the pod object bound to NodeName.
func CreatePod(ctx context.Context, cs kubernetes.Interface, s PodSpec) (*corev1.Pod, error) {
	falseV := false
	node := NodeName
	if s.Node != "" {
		node = s.Node
	}
	pod := &corev1.Pod{
		ObjectMeta: metav1.ObjectMeta{Namespace: s.Namespace, Name: s.Name, Annotations: map[string]string{}, Labels: s.Labels},
		Spec: corev1.PodSpec{
			NodeName:                     node,
			AutomountServiceAccountToken: &falseV,
			Containers:                   []corev1.Container{{Name: "app", Image: "app:test"}},
		},
	}
	for k, v := range s.Annotations {
		pod.Annotations[k] = v
	}
	for _, n := range s.InitNames {
		pod.Spec.InitContainers = append(pod.Spec.InitContainers, corev1.Container{Name: n, Image: "init:test"})
	}
	if s.Sidecar || s.NativeSidecar {
		if _, ok := pod.Annotations["sidecar.istio.io/status"]; !ok {
			pod.Annotations["sidecar.istio.io/status"] = InjectedStatus
		}
		args := s.ProxyArgs
		if args == nil {
			args = []string{"proxy", "sidecar"}
		}
		proxy := corev1.Container{Name: "istio-proxy", Image: "proxyv2:test", Args: args}
		for k, v := range s.ProxyEnv {
			proxy.Env = append(proxy.Env, corev1.EnvVar{Name: k, Value: v})
		}
		if s.ProxyUID != nil || s.ProxyGID != nil {
			proxy.SecurityContext = &corev1.SecurityContext{RunAsUser: s.ProxyUID, RunAsGroup: s.ProxyGID}
		}
		if s.NativeSidecar {
			always := corev1.ContainerRestartPolicyAlways
			proxy.RestartPolicy = &always
			pod.Spec.InitContainers = append(pod.Spec.InitContainers, proxy)
		} else {
			pod.Spec.Containers = append(pod.Spec.Containers, proxy)
		}
	}
	created, err := cs.CoreV1().Pods(s.Namespace).Create(ctx, pod, metav1.CreateOptions{})
	if err != nil {
		return nil, fmt.Errorf("creating pod %s/%s: %w", s.Namespace, s.Name, err)
	}
	return created, nil
}

// RuntimeClasses a pod may name to choose how the node sets up its
// network: PlainRuntimeClass runs it through PlainHandler (the primary
// plugin alone, never istio-cni); DefaultRuntimeClass through the node's
// default handler, as a pod naming none, so that pods compared with plain
// ones take the same path through the kubelet and the runtime.
const (
	PlainRuntimeClass   = "istio-cni-test-plain"
	DefaultRuntimeClass = "istio-cni-test-default"
)

// EnsureRuntimeClasses creates PlainRuntimeClass and DefaultRuntimeClass.
func EnsureRuntimeClasses(ctx context.Context, cs kubernetes.Interface) error {
	for name, handler := range map[string]string{PlainRuntimeClass: PlainHandler, DefaultRuntimeClass: "runc"} {
		_, err := cs.NodeV1().RuntimeClasses().Create(ctx, &nodev1.RuntimeClass{ObjectMeta: metav1.ObjectMeta{Name: name}, Handler: handler}, metav1.CreateOptions{})
		if err != nil && !isExists(err) {
			return fmt.Errorf("runtime class %s: %w", name, err)
		}
	}
	return nil
}
