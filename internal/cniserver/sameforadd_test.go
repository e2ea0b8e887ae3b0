package cniserver

import (
	"testing"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/istio-cni-go/istio-cni/internal/podcache"
)

// TestSameForADD: the updates a pending pod's record is prepared again
// for are those that change what its ADD reads, or whether it is pending;
// the kubelet's status updates before the sandbox has a network are not.
func TestSameForADD(t *testing.T) {
	base := func() *corev1.Pod {
		uid := int64(1337)
		p := &corev1.Pod{
			ObjectMeta: metav1.ObjectMeta{Namespace: "ns", Name: "p", UID: "u1", ResourceVersion: "1",
				Labels: map[string]string{"app": "a"}, Annotations: map[string]string{"sidecar.istio.io/status": "{}"}},
			Spec: corev1.PodSpec{NodeName: "node", Containers: []corev1.Container{{Name: "app"},
				{Name: "istio-proxy", Args: []string{"proxy", "sidecar"}, SecurityContext: &corev1.SecurityContext{RunAsUser: &uid}}}},
			Status: corev1.PodStatus{Phase: corev1.PodPending, Conditions: []corev1.PodCondition{{Type: corev1.PodScheduled, Status: corev1.ConditionTrue}}},
		}
		// As the agent's informer holds it.
		out, err := podcache.Trim(p)
		if err != nil {
			t.Fatal(err)
		}
		return out.(*corev1.Pod)
	}
	trim := func(p *corev1.Pod) *corev1.Pod {
		out, err := podcache.Trim(p)
		if err != nil {
			t.Fatal(err)
		}
		return out.(*corev1.Pod)
	}
	now := metav1.Now()
	for _, c := range []struct {
		name   string
		change func(*corev1.Pod)
		same   bool
	}{
		{"status only", func(p *corev1.Pod) {
			p.ResourceVersion = "2"
			p.Status.Conditions = append(p.Status.Conditions, corev1.PodCondition{Type: corev1.ContainersReady, Status: corev1.ConditionFalse})
		}, true},
		{"pod IP", func(p *corev1.Pod) { p.Status.PodIP = "10.0.0.5" }, false},
		{"deleted", func(p *corev1.Pod) { p.DeletionTimestamp = &now }, false},
		{"annotation", func(p *corev1.Pod) { p.Annotations["traffic.sidecar.istio.io/excludeOutboundPorts"] = "80" }, false},
		{"label", func(p *corev1.Pod) { p.Labels["sidecar.istio.io/inject"] = "false" }, false},
		{"proxy uid", func(p *corev1.Pod) { uid := int64(1000); p.Spec.Containers[1].SecurityContext.RunAsUser = &uid }, false},
		{"proxy args", func(p *corev1.Pod) { p.Spec.Containers[1].Args = []string{"proxy", "router"} }, false},
		{"another pod of the name", func(p *corev1.Pod) { p.UID = "u2" }, false},
	} {
		t.Run(c.name, func(t *testing.T) {
			old := base()
			n := base()
			c.change(n)
			if got := sameForADD(old, trim(n)); got != c.same {
				t.Fatalf("sameForADD = %v, want %v", got, c.same)
			}
		})
	}
}
