package cniserver

import (
	"bytes"
	"errors"
	"io/fs"
	"log/slog"
	"strings"
	"testing"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/istio-cni-go/istio-cni/internal/cnirelay"
	"github.com/istio-cni-go/istio-cni/internal/plugin"
	"github.com/istio-cni-go/istio-cni/internal/prepared"
)

// TestUpdateRemovesStaleRecord: an update that changes what a pending
// pod's ADD reads removes its record at once, before the worker (here
// not running at all, as one far behind) writes the new one, so that
// the pod's relay never sends what the old version asked for; the
// kubelet's status updates leave the record and queue nothing.
func TestUpdateRemovesStaleRecord(t *testing.T) {
	dir := t.TempDir()
	p := &preparer{dir: prepared.Dir(dir), work: newPrepQueue(), written: map[string]uint64{}, candidates: map[string]int{}}
	pod := &corev1.Pod{
		ObjectMeta: metav1.ObjectMeta{Namespace: "ns", Name: "p", UID: "u1", ResourceVersion: "1",
			Annotations: map[string]string{"sidecar.istio.io/status": "{}"}},
		Spec:   corev1.PodSpec{NodeName: "node", Containers: []corev1.Container{{Name: "app"}, {Name: "istio-proxy"}}},
		Status: corev1.PodStatus{Phase: corev1.PodPending},
	}
	data, err := (&prepared.Record{Namespace: "ns", Name: "p", UID: "u1"}).MarshalBinary()
	if err != nil {
		t.Fatal(err)
	}
	if err := p.dir.PutData("u1", data); err != nil {
		t.Fatal(err)
	}
	p.written["u1"] = 1

	status := pod.DeepCopy()
	status.ResourceVersion = "2"
	status.Status.Conditions = []corev1.PodCondition{{Type: corev1.PodScheduled, Status: corev1.ConditionTrue}}
	p.updated(pod, status)
	if _, err := prepared.Read(dir, "u1"); err != nil {
		t.Fatalf("a status update removed the record: %v", err)
	}
	if p.work.waiting["ns/p"] {
		t.Fatal("a status update queued the pod to be prepared again")
	}

	annotated := status.DeepCopy()
	annotated.ResourceVersion = "3"
	annotated.Annotations["traffic.sidecar.istio.io/excludeOutboundIPRanges"] = "10.0.0.0/8"
	p.updated(status, annotated)
	if _, err := prepared.Read(dir, "u1"); !errors.Is(err, fs.ErrNotExist) {
		t.Fatalf("the record of the pod's old annotations is still there: %v", err)
	}
	if key, ok := p.work.get(false); !ok || key != "ns/p" {
		t.Fatalf("queued %q, %v; want the pod prepared again", key, ok)
	}
}

// TestNoteDoneWarnsWithoutLock: a relay's account of an ADD it served
// without the namespace's writers' lock is logged as a warning, with why.
func TestNoteDoneWarnsWithoutLock(t *testing.T) {
	var logs bytes.Buffer
	s := &Server{Log: slog.New(slog.NewJSONHandler(&logs, nil))}
	s.noteDone(&cnirelay.Request{Command: "ADD", Args: "K8S_POD_NAMESPACE=ns;K8S_POD_NAME=p",
		Done: &cnirelay.Done{Mode: "REDIRECT", Summary: "nftables", Unlocked: "/run/locks is not a directory private to uid 0"}})
	if !strings.Contains(logs.String(), `"level":"WARN","msg":"`+plugin.UnlockedWarning) || !strings.Contains(logs.String(), "/run/locks is not a directory private") {
		t.Fatalf("the agent's log:\n%s", logs.String())
	}
}
