package podcache

import (
	"encoding/json"
	"reflect"
	"testing"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/tools/cache"

	"github.com/istio-cni-go/istio-cni/internal/podinfo"
	"github.com/istio-cni-go/istio-cni/internal/testenv"
)

// TestTrimKeepsWhatIsRead: a trimmed pod gives pod selection the same
// facts, through the informer and through the socket's JSON, as the whole
// pod, and keeps what repair reads; it is much smaller, and trimming it
// again changes nothing.
func TestTrimKeepsWhatIsRead(t *testing.T) {
	full := testenv.InjectedPod("ns", "p", "node", 7)
	full.UID, full.ResourceVersion = "u-7", "42"
	full.Status = testenv.InjectedPodStatus(7)
	full.Status.InitContainerStatuses[0].State = corev1.ContainerState{Terminated: &corev1.ContainerStateTerminated{ExitCode: 126, Message: "no rules"}}
	full.Status.InitContainerStatuses[0].LastTerminationState = corev1.ContainerState{Terminated: &corev1.ContainerStateTerminated{ExitCode: 126}}
	now := metav1.Now()
	full.DeletionTimestamp = &now
	full.ManagedFields = []metav1.ManagedFieldsEntry{{Manager: "kubelet", Operation: metav1.ManagedFieldsOperationApply}}
	full.Annotations[lastApplied] = `{"kind":"Pod"}`
	hostUsers := false
	full.Spec.HostUsers = &hostUsers
	obj, err := Trim(full)
	if err != nil {
		t.Fatal(err)
	}
	trimmed := obj.(*corev1.Pod)
	// What selection reads, kubectl's copy of the object aside (no
	// annotation selection reads is of that name).
	read := full.DeepCopy()
	delete(read.Annotations, lastApplied)

	if got, want := PodFromCore(trimmed), PodFromCore(read); !reflect.DeepEqual(got, want) {
		t.Errorf("selection's facts differ:\n got %+v\nwant %+v", got, want)
	}
	decode := func(p *corev1.Pod) *podinfo.Pod {
		b, err := json.Marshal(p)
		if err != nil {
			t.Fatal(err)
		}
		d, err := podinfo.DecodeJSON(b)
		if err != nil {
			t.Fatal(err)
		}
		return d
	}
	if got, want := decode(trimmed), decode(read); !reflect.DeepEqual(got, want) {
		t.Errorf("the socket's JSON decodes to other facts:\n got %+v\nwant %+v", got, want)
	}
	if trimmed.ResourceVersion != "42" || trimmed.UID != "u-7" || trimmed.DeletionTimestamp == nil || *trimmed.Spec.HostUsers ||
		trimmed.Status.PodIP != full.Status.PodIP || !reflect.DeepEqual(trimmed.Status.InitContainerStatuses[0].State, full.Status.InitContainerStatuses[0].State) ||
		!reflect.DeepEqual(trimmed.Status.InitContainerStatuses[0].LastTerminationState, full.Status.InitContainerStatuses[0].LastTerminationState) {
		t.Errorf("repair's fields not kept: %+v", trimmed)
	}
	if _, ok := trimmed.Annotations[lastApplied]; ok {
		t.Error("kubectl's last applied configuration kept")
	}
	if _, ok := full.Annotations[lastApplied]; !ok {
		t.Error("the decoded pod's annotations were changed in place")
	}
	fullJSON, _ := json.Marshal(full)
	trimmedJSON, _ := json.Marshal(trimmed)
	if len(trimmedJSON)*3 > len(fullJSON) {
		t.Errorf("trimmed pod is %d bytes of JSON, the whole %d: expected under a third", len(trimmedJSON), len(fullJSON))
	}
	again, _ := Trim(trimmed)
	if !reflect.DeepEqual(again, trimmed) {
		t.Error("trimming a trimmed pod changes it")
	}
	tomb := cache.DeletedFinalStateUnknown{Key: "ns/p", Obj: trimmed}
	if got, _ := Trim(tomb); !reflect.DeepEqual(got, tomb) {
		t.Error("a tombstone was changed")
	}
}
