package podcache

import (
	"context"
	"io"
	"log/slog"
	"path/filepath"
	"strings"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes/fake"

	"github.com/istio-cni-go/istio-cni/internal/kubeclient/clientset"
	"github.com/istio-cni-go/istio-cni/internal/podinfo"
	"github.com/istio-cni-go/istio-cni/internal/sockserve/sockservetest"
)

var quiet = slog.New(slog.NewTextHandler(io.Discard, nil))

// fuzzPods is a synced pod cache holding one pod, ns/p, without a sidecar.
func fuzzPods(ctx context.Context, t testing.TB) *Cache {
	cs := fake.NewClientset(&corev1.Pod{ObjectMeta: metav1.ObjectMeta{Namespace: "ns", Name: "p", UID: "u"},
		Spec: corev1.PodSpec{NodeName: "n", Containers: []corev1.Container{{Name: "app"}}}})
	pc := Start(ctx, clientset.Of(cs), "n")
	if err := pc.WaitSynced(ctx); err != nil {
		t.Fatal(err)
	}
	return pc
}

// FuzzAgentSocket sends arbitrary bytes as an HTTP request to the agent
// socket: the server answers or closes, never panics, and keeps serving a
// good request after each.
func FuzzAgentSocket(f *testing.F) {
	for _, s := range []string{
		"GET /pod?namespace=ns&name=p&uid=u HTTP/1.1\r\nHost: a\r\n\r\n",
		"GET /pod?namespace=..&name=%00 HTTP/1.1\r\nHost: a\r\n\r\n",
		"GET /readyz HTTP/1.1\r\nHost: a\r\n\r\n",
		"POST /pod HTTP/1.1\r\nHost: a\r\nContent-Length: 99999999\r\n\r\n",
		"GET /" + strings.Repeat("a", 70000) + " HTTP/1.1\r\n\r\n",
		"\x00\x01\x02", "",
	} {
		f.Add([]byte(s))
	}
	ctx, cancel := context.WithCancel(context.Background())
	f.Cleanup(cancel)
	dir := f.TempDir()
	srvCtx, stop := context.WithCancel(ctx)
	done, err := fuzzPods(ctx, f).Serve(srvCtx, dir, func() string { return "" }, quiet, nil)
	if err != nil {
		f.Fatal(err)
	}
	f.Cleanup(func() { stop(); <-done })
	path := filepath.Join(dir, podinfo.AgentSocketName)
	good := podinfo.NewAgentClient(path, 10*time.Second)
	f.Fuzz(func(t *testing.T, data []byte) {
		sockservetest.Exchange(t, path, data)
		if _, err := good.GetPod(context.Background(), "ns", "p"); err != nil {
			t.Fatalf("the agent socket stopped serving: %v", err)
		}
	})
}
