// Package clientset fits a client-go Clientset (in tests, a fake one) to
// kubeclient.Interface. The agent's binary does not import it: it would
// bring client-go's every API group back.
package clientset

import (
	"k8s.io/client-go/kubernetes"
	typedcorev1 "k8s.io/client-go/kubernetes/typed/core/v1"
	"k8s.io/client-go/tools/record"

	"github.com/istio-cni-go/istio-cni/internal/kubeclient"
)

// Client is cs as a kubeclient.Interface.
type Client struct{ kubernetes.Interface }

// Of returns cs as a kubeclient.Interface.
func Of(cs kubernetes.Interface) Client { return Client{cs} }

// Pods implements kubeclient.Interface.
func (c Client) Pods(namespace string) kubeclient.Pods { return c.CoreV1().Pods(namespace) }

// DaemonSets implements kubeclient.Interface.
func (c Client) DaemonSets(namespace string) kubeclient.DaemonSets {
	return c.AppsV1().DaemonSets(namespace)
}

// Nodes implements kubeclient.Interface.
func (c Client) Nodes() kubeclient.Nodes { return c.CoreV1().Nodes() }

// Events implements kubeclient.Interface.
func (c Client) Events() record.EventSink {
	return &typedcorev1.EventSinkImpl{Interface: c.CoreV1().Events("")}
}
