package e2e

import (
	"context"
	"errors"
	"io"
	"io/fs"
	"log/slog"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	promtest "github.com/prometheus/client_golang/prometheus/testutil"
	dto "github.com/prometheus/client_model/go"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/istio-cni-go/istio-cni/internal/cniserver"
	"github.com/istio-cni-go/istio-cni/internal/nsfacts"
	"github.com/istio-cni-go/istio-cni/internal/prepared"
	"github.com/istio-cni-go/istio-cni/internal/testenv"
)

// TestPreparedRecords: the agent keeps a record for each pod of its node
// whose sandbox has had no ADD, under the config it learnt from the ADDs
// it served, and drops it once the kubelet reports the pod's IP or the
// pod goes; a pod it cannot decide gets none, so its ADD asks the agent
// and fails with the annotation's name. An agent that does not prepare
// leaves no record behind for a relay to use.
func TestPreparedRecords(t *testing.T) {
	e := newEnv(t, nil)
	e.prepare = true
	e.serveCNI("")
	dir := filepath.Join(e.node.RunDir, prepared.DirName)
	// Before any config is learnt, nothing is prepared.
	early := e.newPod(&testenv.PodSpec{Sidecar: true})
	e.learnConfig()
	// Learning prepares the pods already waiting.
	e.waitRecord(early)

	t.Run("sidecar-pod", func(t *testing.T) {
		pod := e.newPod(&testenv.PodSpec{Sidecar: true})
		e.waitRecord(pod)
		rec, err := prepared.Read(dir, pod.UID)
		if err != nil {
			t.Fatal(err)
		}
		if len(rec.Entries) != 1 || rec.Namespace != testNS || rec.Name != pod.Name {
			t.Fatalf("record %+v", rec)
		}
		en := rec.Entries[0]
		if en.Skip != "" || en.Kind != nsfacts.KindIPTablesNFT || en.Mode != "REDIRECT" || len(en.Txn4) == 0 || len(en.Txn46) <= len(en.Txn4) {
			t.Fatalf("entry %+v", en)
		}
		// Started, the pod's record goes.
		setPodIP(t, pod.Name, "10.1.2.3")
		waitNoRecord(t, dir, pod.UID)
	})

	t.Run("pod-without-sidecar", func(t *testing.T) {
		pod := e.newPod(&testenv.PodSpec{})
		e.waitRecord(pod)
		rec, err := prepared.Read(dir, pod.UID)
		if err != nil || len(rec.Entries) != 1 || !strings.Contains(rec.Entries[0].Skip, "no istio-proxy container") {
			t.Fatalf("record %+v, %v", rec, err)
		}
		// Deleted, the pod's record goes.
		if err := cluster.Client.CoreV1().Pods(testNS).Delete(context.Background(), pod.Name, metav1.DeleteOptions{GracePeriodSeconds: new(int64)}); err != nil {
			t.Fatal(err)
		}
		waitNoRecord(t, dir, pod.UID)
	})

	t.Run("pod-that-cannot-be-decided", func(t *testing.T) {
		spec := &testenv.PodSpec{Sidecar: true, Annotations: map[string]string{"traffic.sidecar.istio.io/excludeOutboundPorts": "80,http"}}
		pod := e.newPod(spec)
		// Its record has no entry: its relay asks the agent and waits for
		// it (it would not leave it for the fallback).
		e.waitRecord(pod)
		if rec, err := prepared.Read(dir, pod.UID); err != nil || len(rec.Entries) != 0 {
			t.Fatalf("the record of a pod with a malformed annotation: %+v, %v; want one with no entry", rec, err)
		}
		_, err := e.node.Add(context.Background(), e.node.Chained, pod)
		if err == nil || !strings.Contains(err.Error(), "excludeOutboundPorts") || !strings.Contains(err.Error(), "http") {
			t.Fatalf("ADD: %v, want the annotation and its value named", err)
		}
	})

	t.Run("agent-that-does-not-prepare", func(t *testing.T) {
		pod := e.newPod(&testenv.PodSpec{Sidecar: true})
		e.waitRecord(pod)
		// A second server on the same run dir, told not to prepare, as an
		// agent restarted with --cni-prepare-ahead=false.
		sock := filepath.Join(t.TempDir(), "cni.sock")
		ctx, cancel := context.WithCancel(context.Background())
		defer cancel()
		s := &cniserver.Server{Log: slog.New(slog.NewJSONHandler(io.Discard, nil)), PreparedDir: dir}
		if _, err := s.Serve(ctx, sock, time.Second); err != nil {
			t.Fatal(err)
		}
		if _, err := os.Stat(dir); !errors.Is(err, fs.ErrNotExist) {
			t.Fatalf("records left for relays by an agent that does not prepare: %v", err)
		}
	})
}

// TestPreparedFromConflist: an agent told the conflist its entry is in
// prepares pods' ADDs from the start under the config libcni will hand
// the plugin, with no ADD to learn it from, and the first ADD of all is
// served from its pod's record. The pod's DEL, under that config, is
// answered by the relay alone: the agent counts it and served none.
func TestPreparedFromConflist(t *testing.T) {
	e := newEnv(t, nil)
	e.prepare = true
	e.serveCNI("")
	early := e.newPod(&testenv.PodSpec{Sidecar: true})
	if err := e.server.ExpectConflist(e.node.Chained.Bytes, "istio-cni"); err != nil {
		t.Fatal(err)
	}
	// The pods already waiting are prepared.
	e.waitRecord(early)
	// The first ADD: add fails unless the relay served it from the
	// record, the agent looking nothing up.
	sb := e.add(&testenv.PodSpec{Sidecar: true})
	if rules := rulesIn(t, sb.pod); !strings.Contains(rules, "ISTIO_REDIRECT") {
		t.Fatalf("the pod served from its record has no redirection:\n%s", rules)
	}
	if err := e.node.Del(context.Background(), e.node.Chained, sb.pod); err != nil {
		t.Fatalf("DEL: %v", err)
	}
	// The relay tells the agent without waiting for it.
	deadline := time.Now().Add(10 * time.Second)
	for promtest.ToFloat64(e.commands.WithLabelValues("DEL", "ok")) != 1 {
		if time.Now().After(deadline) {
			t.Fatal("the agent never heard of the DEL")
		}
		time.Sleep(time.Millisecond) // polling another goroutine's counter, bounded
	}
	var m dto.Metric
	if err := e.latency.WithLabelValues("DEL").(prometheus.Histogram).Write(&m); err != nil || m.GetHistogram().GetSampleCount() != 0 {
		t.Fatalf("the agent served %d DELs itself (%v), want the relay to answer under a config the agent keeps", m.GetHistogram().GetSampleCount(), err)
	}
	// A file the runtime would not hand the plugin from is refused,
	// saying why.
	if err := e.server.ExpectConflist([]byte(`{"name":"net","cniVersion":"1.0.0","plugins":[{"type":"ptp"}]}`), "istio-cni"); err == nil ||
		!strings.Contains(err.Error(), "no istio-cni entry") {
		t.Fatalf("a conflist without the entry: %v", err)
	}
}

func waitNoRecord(t *testing.T, dir, uid string) {
	t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for {
		_, err := prepared.Read(dir, uid)
		if errors.Is(err, fs.ErrNotExist) {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("the record of pod %s is still there: %v", uid, err)
		}
		time.Sleep(time.Millisecond) // polling the agent's directory, bounded
	}
}
