package agent

import (
	"k8s.io/client-go/kubernetes"
	appsv1client "k8s.io/client-go/kubernetes/typed/apps/v1"
	corev1client "k8s.io/client-go/kubernetes/typed/core/v1"
	"k8s.io/client-go/rest"
)

// groupsClient is a kubernetes.Interface with only the API groups the
// agent talks to: core (pods, events) and apps (its DaemonSet). Building
// the full Clientset instead links every group's typed client, apply
// configurations and the discovery client's OpenAPI models into the
// binary and runs their start-up code; about half of the agent's
// resident memory was that code's pages and heap. Calling another group
// panics on the nil embedded interface, which tests against the real API
// server would show at once.
type groupsClient struct {
	kubernetes.Interface
	core corev1client.CoreV1Interface
	apps appsv1client.AppsV1Interface
}

func (c *groupsClient) CoreV1() corev1client.CoreV1Interface { return c.core }

func (c *groupsClient) AppsV1() appsv1client.AppsV1Interface { return c.apps }

// newGroupsClient connects the groups the agent uses to rc's API server.
func newGroupsClient(rc *rest.Config) (kubernetes.Interface, error) {
	core, err := corev1client.NewForConfig(rc)
	if err != nil {
		return nil, err
	}
	apps, err := appsv1client.NewForConfig(rc)
	if err != nil {
		return nil, err
	}
	return &groupsClient{core: core, apps: apps}, nil
}
