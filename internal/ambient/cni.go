package ambient

import (
	"context"
	"errors"
	"fmt"
	"os"
	"time"

	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/fields"
)

// lookupTimeout bounds each API read an ADD makes when the informers do
// not hold its pod or namespace yet.
const lookupTimeout = 5 * time.Second

// EnrolOnAdd is the CNI server's ADD: it decides the pod (by its
// namespace, name and UID) and, when the pod is enrolled, enrols it with
// netns (AddPod). It returns false, and does nothing, for a pod that is
// not enrolled. The pod and its namespace come from the informers, else
// from the API server; an unreadable pod or namespace is an error, never
// a "no": the reference's plugin starts such a pod unmeshed (it fails
// open), this one does not.
func (c *Controller) EnrolOnAdd(ctx context.Context, namespace, name, uid string, netns *os.File) (bool, error) {
	pod, d, err := c.decideForCNI(ctx, namespace, name, uid)
	if err != nil {
		return false, err
	}
	if !d.Enrol {
		c.log.Debug("pod not enrolled in the ambient mesh", "pod", namespace+"/"+name, "reason", d.Reason)
		return false, nil
	}
	return true, c.AddPod(ctx, pod, netns)
}

// decideForCNI reads the pod of a CNI command and its namespace's labels
// and decides it.
func (c *Controller) decideForCNI(ctx context.Context, namespace, name, uid string) (*corev1.Pod, Decision, error) {
	pod, err := c.podForAdd(ctx, namespace, name, uid)
	if err != nil {
		return nil, Decision{}, fmt.Errorf("ambient mode: cannot read pod %s/%s: %w", namespace, name, err)
	}
	// A pod never enrolled (a sidecar pod, most often) needs no namespace:
	// one that cannot be read must not fail it, as it does not when the
	// fallback serves.
	if c.cfg.Policy.Exclusion(enablementPod(pod)) != "" {
		return pod, decide(c.cfg.Policy, pod, nil), nil
	}
	nsLabels, err := c.namespaceForAdd(ctx, namespace)
	if err != nil {
		return nil, Decision{}, fmt.Errorf("ambient mode: cannot read namespace %s of pod %s/%s: %w", namespace, namespace, name, err)
	}
	return pod, decide(c.cfg.Policy, pod, nsLabels), nil
}

// podForAdd is the pod of an ADD: the informer's copy when it is this
// pod (the UID matches), else the API server's.
func (c *Controller) podForAdd(ctx context.Context, namespace, name, uid string) (*corev1.Pod, error) {
	if obj, ok, _ := c.podInf.GetIndexer().GetByKey(namespace + "/" + name); ok {
		if p, ok := obj.(*corev1.Pod); ok && (uid == "" || string(p.UID) == uid) {
			return p, nil
		}
	}
	ctx, cancel := context.WithTimeout(ctx, lookupTimeout)
	defer cancel()
	p, err := c.cfg.Kube.Pods(namespace).Get(ctx, name, metav1.GetOptions{})
	if err != nil {
		return nil, err
	}
	if uid != "" && string(p.UID) != uid {
		// The runtime's pod is gone and another of that name exists: this
		// ADD's sandbox is being abandoned; nothing to enrol.
		return nil, fmt.Errorf("the API server's pod has uid %s, the runtime's %s", p.UID, uid)
	}
	out, _ := trimPod(p)
	return out.(*corev1.Pod), nil
}

// namespaceForAdd is the labels of the pod's namespace: the informer's,
// else the API server's.
func (c *Controller) namespaceForAdd(ctx context.Context, namespace string) (map[string]string, error) {
	if l, ok := c.namespaceLabels(namespace); ok {
		return l, nil
	}
	ctx, cancel := context.WithTimeout(ctx, lookupTimeout)
	defer cancel()
	list, err := c.cfg.Namespaces.List(ctx, metav1.ListOptions{FieldSelector: fields.OneTermEqualSelector("metadata.name", namespace).String()})
	if err != nil {
		return nil, err
	}
	for i := range list.Items {
		if list.Items[i].Name == namespace {
			return list.Items[i].Labels, nil
		}
	}
	return nil, apierrors.NewNotFound(corev1.Resource("namespaces"), namespace)
}

// CheckOnCNI is the CNI server's CHECK: for a pod the policy enrols, the
// pod's rules and routing in netns are compared with what its annotations
// ask for, and ztunnel's acknowledgement is looked up; false means the
// pod is not enrolled (the sidecar path checks it).
func (c *Controller) CheckOnCNI(ctx context.Context, namespace, name, uid string, netns *os.File) (bool, error) {
	pod, d, err := c.decideForCNI(ctx, namespace, name, uid)
	if err != nil {
		return false, err
	}
	if !d.Enrol {
		return false, nil
	}
	params, err := PodParams(pod, c.cfg.Defaults)
	if err != nil {
		return true, err
	}
	if err := c.cfg.InPod.CheckAmbient(fdPath(netns), params); err != nil {
		return true, fmt.Errorf("ambient redirection: %w", err)
	}
	c.mu.Lock()
	st := c.pods[string(pod.UID)]
	acked := st != nil && st.acked
	c.mu.Unlock()
	if !acked {
		return true, errors.New("ztunnel has not acknowledged the pod (it is pending)")
	}
	return true, nil
}
