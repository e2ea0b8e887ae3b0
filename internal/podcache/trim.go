package podcache

import (
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
)

// lastApplied is kubectl's copy of the whole object it applied: often
// the largest annotation of a pod, and read by nothing here.
const lastApplied = "kubectl.kubernetes.io/last-applied-configuration"

// Trim is the informers' transform: a pod reduced to what pod selection
// (PodFromCore, and the plugin decoding the socket's JSON) and the repair
// controller read. A real pod is mostly what neither reads: managed
// fields, volumes, probes, resources, env from references, container
// statuses. The trimmed pod is a new object, so the decoded one is left
// to the collector whole.
//
// Kept: name, namespace, uid, resource version (repair's delete
// precondition, event references), labels, annotations, deletion
// timestamp; containers' and init containers' name, args, literal env
// values and run-as user and group; host network, host users and node
// name; pod phase and IPs; and of the init containers' statuses, how they
// ended (repair's predicate).
func Trim(obj any) (any, error) {
	p, ok := obj.(*corev1.Pod)
	if !ok {
		// A tombstone (cache.DeletedFinalStateUnknown) holds a pod the
		// cache trimmed already.
		return obj, nil
	}
	annotations := p.Annotations
	if _, ok := annotations[lastApplied]; ok {
		annotations = make(map[string]string, len(p.Annotations)-1)
		for k, v := range p.Annotations {
			if k != lastApplied {
				annotations[k] = v
			}
		}
	}
	out := &corev1.Pod{
		TypeMeta: p.TypeMeta,
		ObjectMeta: metav1.ObjectMeta{Name: p.Name, Namespace: p.Namespace, UID: p.UID, ResourceVersion: p.ResourceVersion,
			Labels: p.Labels, Annotations: annotations, DeletionTimestamp: p.DeletionTimestamp},
		Spec: corev1.PodSpec{NodeName: p.Spec.NodeName, HostNetwork: p.Spec.HostNetwork, HostUsers: p.Spec.HostUsers,
			InitContainers: trimContainers(p.Spec.InitContainers), Containers: trimContainers(p.Spec.Containers)},
		Status: corev1.PodStatus{Phase: p.Status.Phase, PodIP: p.Status.PodIP, PodIPs: p.Status.PodIPs},
	}
	if n := len(p.Status.InitContainerStatuses); n > 0 {
		out.Status.InitContainerStatuses = make([]corev1.ContainerStatus, n)
		for i := range p.Status.InitContainerStatuses {
			st := &p.Status.InitContainerStatuses[i]
			out.Status.InitContainerStatuses[i] = corev1.ContainerStatus{Name: st.Name,
				State:                corev1.ContainerState{Terminated: st.State.Terminated},
				LastTerminationState: corev1.ContainerState{Terminated: st.LastTerminationState.Terminated}}
		}
	}
	return out, nil
}

func trimContainers(in []corev1.Container) []corev1.Container {
	if in == nil {
		return nil
	}
	out := make([]corev1.Container, len(in))
	for i := range in {
		c := &in[i]
		t := corev1.Container{Name: c.Name, Args: c.Args}
		for _, e := range c.Env {
			// What the JSON of the pod would say: a value from a reference,
			// or an empty one, is no value (podinfo.DecodeJSON).
			if e.Value != "" {
				t.Env = append(t.Env, corev1.EnvVar{Name: e.Name, Value: e.Value})
			}
		}
		if sc := c.SecurityContext; sc != nil && (sc.RunAsUser != nil || sc.RunAsGroup != nil) {
			t.SecurityContext = &corev1.SecurityContext{RunAsUser: sc.RunAsUser, RunAsGroup: sc.RunAsGroup}
		}
		out[i] = t
	}
	return out
}
