package cniserver

import (
	"bytes"
	"errors"
	"io/fs"
	"log/slog"
	"strings"
	"sync"
	"testing"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/tools/cache"

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

// TestUpdateWithNewUIDRemovesOldRecord: a pod deleted and made again
// under its name while the watch was down comes, after the relist, as an
// update from the old UID to the new one: the old UID's record goes too.
func TestUpdateWithNewUIDRemovesOldRecord(t *testing.T) {
	dir := t.TempDir()
	p := &preparer{dir: prepared.Dir(dir), work: newPrepQueue(), written: map[string]uint64{}, candidates: map[string]int{}}
	old := &corev1.Pod{
		ObjectMeta: metav1.ObjectMeta{Namespace: "ns", Name: "p", UID: "u1", ResourceVersion: "1"},
		Spec:       corev1.PodSpec{NodeName: "node", Containers: []corev1.Container{{Name: "app"}, {Name: "istio-proxy"}}},
	}
	for _, uid := range []string{"u1", "u2"} {
		if err := p.dir.Put(&prepared.Record{Namespace: "ns", Name: "p", UID: uid}); err != nil {
			t.Fatal(err)
		}
		p.written[uid] = 1
	}
	made := old.DeepCopy()
	made.UID, made.ResourceVersion = "u2", "5"
	p.updated(old, made)
	for _, uid := range []string{"u1", "u2"} {
		if _, err := prepared.Read(dir, uid); !errors.Is(err, fs.ErrNotExist) {
			t.Fatalf("the record of %s is still there: %v", uid, err)
		}
	}
	if len(p.written) != 0 {
		t.Fatalf("records still counted: %v", p.written)
	}
}

// TestRecordUnderOlderConfigsNotWritten: a config learnt while a worker
// prepares a pod under the configs learnt before (here, during its
// PrepareFresh) keeps that worker from writing its record, which lacks
// the new config and could replace the other worker's, written under
// it; the pod is prepared again, under both.
func TestRecordUnderOlderConfigsNotWritten(t *testing.T) {
	learn := func(stdin string) learntConfig {
		c, err := prepared.ParseConfig([]byte(stdin))
		if err != nil {
			t.Fatal(err)
		}
		conf, err := plugin.ParseConfig(c.Canonical)
		if err != nil {
			t.Fatal(err)
		}
		return learntConfig{canonical: c.Canonical, conf: conf}
	}
	older := learn(`{"cniVersion":"1.0.0","name":"a","type":"istio-cni","prevResult":{}}`)
	newer := learn(`{"cniVersion":"1.0.0","name":"b","type":"istio-cni","prevResult":{}}`)
	agent := &recordingRules{}
	inf := cache.NewSharedIndexInformer(&cache.ListWatch{}, &corev1.Pod{}, 0, cache.Indexers{})
	if err := inf.GetIndexer().Add(&corev1.Pod{
		ObjectMeta: metav1.ObjectMeta{Namespace: "ns", Name: "p", UID: "u1", ResourceVersion: "1",
			Annotations: map[string]string{"sidecar.istio.io/status": "{}"}},
		Spec: corev1.PodSpec{NodeName: "node", Containers: []corev1.Container{{Name: "app"}, {Name: "istio-proxy"}}},
	}); err != nil {
		t.Fatal(err)
	}
	dir := t.TempDir()
	p := &preparer{s: &Server{Rules: agent}, dir: prepared.Dir(dir), inf: inf, log: slog.New(slog.DiscardHandler),
		work: newPrepQueue(), written: map[string]uint64{}, candidates: map[string]int{}, learnt: []learntConfig{older}}
	var once sync.Once
	agent.onPrepare = func() {
		once.Do(func() {
			p.mu.Lock()
			p.learnt = []learntConfig{newer, older}
			p.learntGen++
			p.mu.Unlock()
		})
	}
	p.work.add("ns/p", false)
	if !p.next(false) {
		t.Fatal("the queue shut")
	}
	if _, err := prepared.Read(dir, "u1"); !errors.Is(err, fs.ErrNotExist) {
		t.Fatalf("a record prepared under the configs learnt before was written: %v", err)
	}
	if !p.work.waiting["ns/p"] {
		t.Fatal("the pod was not queued to be prepared again")
	}
	if !p.next(false) {
		t.Fatal("the queue shut")
	}
	rec, err := prepared.Read(dir, "u1")
	if err != nil {
		t.Fatal(err)
	}
	if len(rec.Entries) != 2 || !bytes.Equal(rec.Entries[0].Config, newer.canonical) || !bytes.Equal(rec.Entries[1].Config, older.canonical) {
		t.Fatalf("the record has %d entries, want one under each config", len(rec.Entries))
	}
}
