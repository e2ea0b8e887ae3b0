package e2e

import (
	"bufio"
	"bytes"
	"context"
	"fmt"
	"io"
	"log/slog"
	"os"
	"path/filepath"
	"runtime"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	rbacv1 "k8s.io/api/rbac/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/istio-cni-go/istio-cni/internal/cnirelay"
	"github.com/istio-cni-go/istio-cni/internal/cniserver"
	"github.com/istio-cni-go/istio-cni/internal/testenv"
)

// TestHardeningLookupsShareATransport: an agent without API access of its
// own reads pods with the plugin's kubeconfig; a thousand pod starts must
// not leave a thousand idle connections behind.
func TestHardeningLookupsShareATransport(t *testing.T) {
	e := newEnv(t, nil)
	s := &cniserver.Server{Log: slog.New(slog.NewJSONHandler(io.Discard, nil)), ReadyReason: func() string { return "" }}
	conf := []byte(`{"cniVersion":"1.0.0","name":"k8s-pod-network","type":"istio-cni","cni_agent_run_dir":"` + e.node.RunDir + `"}`)
	lookup := func(name string) {
		t.Helper()
		resp := s.Handle(&cnirelay.Request{Command: "ADD", ContainerID: "c", IfName: "eth0",
			Args: "K8S_POD_NAMESPACE=" + testNS + ";K8S_POD_NAME=" + name, Stdin: conf}, nil)
		if resp.Error != nil {
			t.Fatalf("ADD of a plain pod: %v", resp.Error)
		}
	}
	// A pod without a sidecar: looked up, then left alone.
	name := fmt.Sprintf("plain-%d", podSeq.Add(1))
	if _, err := createPod(t, testenv.PodSpec{Namespace: testNS, Name: name}); err != nil {
		t.Fatal(err)
	}
	lookup(name)
	fds0, g0 := openFDs(t, os.Getpid()), runtime.NumGoroutine()
	for i := 0; i < 60; i++ {
		lookup(name)
	}
	if fds, g := openFDs(t, os.Getpid()), runtime.NumGoroutine(); fds > fds0+5 || g > g0+10 {
		t.Fatalf("60 lookups left %d descriptors and %d goroutines behind", fds-fds0, g-g0)
	}
}

// TestHardeningForbiddenAtShutdown: an API server that refuses the
// DaemonSet read at termination is not taken for an uninstall unless the
// agent saw its DaemonSet go first (helm uninstall deletes the DaemonSet,
// then its RBAC); an agent that could never read it (Istio's chart grants
// no DaemonSet access in sidecar mode) removes the plugin, as Istio's does.
func TestHardeningForbiddenAtShutdown(t *testing.T) {
	ctx := context.Background()
	kubeconfigFor := func(t *testing.T, name string, rules []rbacv1.PolicyRule) string {
		tok, err := cluster.TokenFor(ctx, name, rules)
		if err != nil {
			t.Fatal(err)
		}
		kc := filepath.Join(t.TempDir(), "agent.kubeconfig")
		if err := testenv.WriteKubeconfig(kc, cluster.URL, cluster.CAFile, tok); err != nil {
			t.Fatal(err)
		}
		return kc
	}
	pods := rbacv1.PolicyRule{APIGroups: []string{""}, Resources: []string{"pods"}, Verbs: []string{"get", "list", "watch"}}
	ds := rbacv1.PolicyRule{APIGroups: []string{"apps"}, Resources: []string{"daemonsets"}, ResourceNames: []string{"istio-cni-node"}, Verbs: []string{"get", "watch"}}

	// Istio's RBAC in sidecar mode: the DaemonSet is there, but the agent
	// can never read it. Kept as "cannot tell", the plugin stayed after
	// helm uninstall with the deleted service account's credentials and
	// failed every later pod; it goes, as with Istio's agent.
	t.Run("never-readable-removes-as-istio", func(t *testing.T) {
		ensureDaemonSet(t, true)
		h := newHost(t)
		calico := filepath.Join(h.NetDir, "10-calico.conflist")
		copyFile(t, filepath.Join(primaryDir, "10-calico.conflist"), calico)
		h.start("--kubeconfig", kubeconfigFor(t, "agent-no-ds-access", []rbacv1.PolicyRule{pods}))
		h.waitReadyz(200, 20*time.Second)
		if code := h.stop(syscall.SIGTERM); code != 0 {
			t.Fatalf("exit %d", code)
		}
		if n, _ := entryCount(t, calico); n != 0 {
			t.Fatalf("a DaemonSet never readable: %d entries left, want the plugin removed as Istio's agent does\n%s", n, h.LogText())
		}
		if !strings.Contains(h.LogText(), "could never be read") {
			t.Fatalf("the removal's reason is not logged:\n%s", h.LogText())
		}
	})

	// helm uninstall: the DaemonSet, then at once the agent's RBAC, and the
	// kubelet's SIGTERM. In "deleted-then-refused" the agent has heard of
	// the deletion before; in "deleted-refused-at-once" nobody waits for it:
	// the watch outlives the agent's other parts, so the refused read at
	// termination can still learn the DaemonSet went.
	for _, c := range []struct {
		name          string
		heardDeletion bool
	}{{"deleted-then-refused", true}, {"deleted-refused-at-once", false}} {
		t.Run(c.name, func(t *testing.T) {
			ensureDaemonSet(t, true)
			h := newHost(t)
			calico := filepath.Join(h.NetDir, "10-calico.conflist")
			copyFile(t, filepath.Join(primaryDir, "10-calico.conflist"), calico)
			name := "agent-" + c.name
			h.start("--kubeconfig", kubeconfigFor(t, name, []rbacv1.PolicyRule{pods, ds}))
			h.waitReadyz(200, 20*time.Second)
			h.waitLog("watching its DaemonSet", 10*time.Second)
			ensureDaemonSet(t, false)
			if c.heardDeletion {
				h.waitLog("DaemonSet was deleted", 10*time.Second)
			}
			if err := cluster.Client.RbacV1().ClusterRoleBindings().Delete(ctx, name, metav1.DeleteOptions{}); err != nil && !apierrors.IsNotFound(err) {
				t.Fatal(err)
			}
			t.Cleanup(func() { _ = cluster.Client.RbacV1().ClusterRoles().Delete(ctx, name, metav1.DeleteOptions{}) })
			if code := h.stop(syscall.SIGTERM); code != 0 {
				t.Fatalf("exit %d", code)
			}
			if n, _ := entryCount(t, calico); n != 0 {
				t.Fatalf("the plugin stayed after an uninstall:\n%s", h.LogText())
			}
		})
	}
}

// podWatches is the API server's count of open pod watches.
func podWatches(t *testing.T) int {
	t.Helper()
	raw, err := cluster.Client.CoreV1().RESTClient().Get().AbsPath("/metrics").DoRaw(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	total := 0
	sc := bufio.NewScanner(bytes.NewReader(raw))
	sc.Buffer(make([]byte, 1<<20), 1<<20)
	for sc.Scan() {
		l := sc.Text()
		if strings.HasPrefix(l, "apiserver_longrunning_requests{") && strings.Contains(l, `resource="pods"`) && strings.Contains(l, `verb="WATCH"`) {
			v, err := strconv.ParseFloat(l[strings.LastIndex(l, " ")+1:], 64)
			if err != nil {
				t.Fatal(err)
			}
			total += int(v)
		}
	}
	return total
}

// TestHardeningOnePodWatch: the pod cache and the repair controller share
// one watch on the node's pods.
func TestHardeningOnePodWatch(t *testing.T) {
	ensureDaemonSet(t, false)
	// Watches of earlier tests may still be closing: wait for a steady count.
	before := podWatches(t)
	for settled := time.Now().Add(10 * time.Second); time.Now().Before(settled); {
		time.Sleep(300 * time.Millisecond) // polling the API server's metrics
		now := podWatches(t)
		if now == before {
			break
		}
		before = now
	}
	h := repairHost(t, "--repair-host-proc", "/proc")
	h.waitReadyz(200, 20*time.Second)
	h.waitLog("repair controller watching", 10*time.Second)
	most := 0
	for end := time.Now().Add(3 * time.Second); time.Now().Before(end); {
		most = max(most, podWatches(t))
		time.Sleep(100 * time.Millisecond) // polling the API server's metrics
	}
	if most-before != 1 {
		t.Fatalf("the agent holds %d pod watches, want 1", most-before)
	}
}
