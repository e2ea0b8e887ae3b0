package agent

import (
	"os"
	"path/filepath"
	"testing"

	"github.com/istio-cni-go/istio-cni/internal/kubeclient"
)

// TestAPIRequestRate: the agent asks the API server at Istio's node
// agent's rate, one budget for every group it uses. At client-go's
// default an ambient pod's enrolment waited 0.3 s for its turn once a few
// pods had been labelled in a row.
func TestAPIRequestRate(t *testing.T) {
	kc := filepath.Join(t.TempDir(), "kubeconfig")
	if err := os.WriteFile(kc, []byte(`apiVersion: v1
kind: Config
clusters: [{name: c, cluster: {server: "https://127.0.0.1:6443"}}]
users: [{name: u, user: {token: t}}]
contexts: [{name: x, context: {cluster: c, user: u}}]
current-context: x
`), 0o600); err != nil {
		t.Fatal(err)
	}
	rc, err := restConfig(&Config{Kubeconfig: kc})
	if err != nil {
		t.Fatal(err)
	}
	if rc.QPS != 80 || rc.Burst != 160 {
		t.Fatalf("QPS %v, burst %d; want Istio's 80 and 160", rc.QPS, rc.Burst)
	}
	c, err := kubeclient.New(rc)
	if err != nil {
		t.Fatal(err)
	}
	core, apps := c.RateLimiters()
	if core == nil || core != apps || core.QPS() != 80 {
		t.Fatalf("rate limiters core %v, apps %v: want one, at 80 per second", core, apps)
	}
	// A rate without a burst gets client-go's burst, not a budget that
	// never lets a request through.
	rc.Burst = 0
	if c, err = kubeclient.New(rc); err != nil {
		t.Fatal(err)
	}
	if core, _ := c.RateLimiters(); !core.TryAccept() {
		t.Fatal("a rate limiter with no burst refused the first request")
	}
}
