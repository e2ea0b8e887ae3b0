package repair

import (
	"errors"
	"io"
	"log/slog"
	"net/netip"
	"os"
	"path/filepath"
	"syscall"
	"testing"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes/fake"

	"github.com/istio-cni-go/istio-cni/internal/kubeclient/clientset"
	"github.com/istio-cni-go/istio-cni/internal/podnet"
	"github.com/istio-cni-go/istio-cni/internal/ruleset"
	"github.com/istio-cni-go/istio-cni/internal/testutil"
)

// swappingRules stands for the backend while the sandbox's process ends
// and another takes its PID: at the first look into the namespace the
// fake /proc's entry comes to name another namespace. It records which
// namespace each call reached.
type swappingRules struct {
	t       *testing.T
	link    string // the fake /proc/<pid>/ns/net
	other   string // the namespace the PID comes to mean
	podIP   netip.Addr
	swapped bool
	reached []uint64
}

func (r *swappingRules) inode(path string) uint64 {
	var st syscall.Stat_t
	if err := syscall.Stat(path, &st); err != nil {
		r.t.Fatal(err)
	}
	return st.Ino
}

func (r *swappingRules) PodAddrs(path string) ([]netip.Addr, error) {
	if !r.swapped {
		r.swapped = true
		if err := os.Remove(r.link); err != nil {
			r.t.Fatal(err)
		}
		if err := os.Symlink(r.other, r.link); err != nil {
			r.t.Fatal(err)
		}
	}
	r.reached = append(r.reached, r.inode(path))
	return []netip.Addr{r.podIP}, nil
}

func (r *swappingRules) Check(path string, _ *ruleset.Plan) error {
	r.reached = append(r.reached, r.inode(path))
	return errors.New("no rules")
}

func (r *swappingRules) Apply(path string, _ *ruleset.Plan) (podnet.Report, error) {
	r.reached = append(r.reached, r.inode(path))
	return podnet.Report{}, nil
}

// TestRepairWritesIntoTheNamespaceItVerified: the namespace is verified
// and programmed through one open file. Found by a path under /proc, it
// would be whatever namespace the PID's next process has by the time the
// rules are written, the node's among them.
func TestRepairWritesIntoTheNamespaceItVerified(t *testing.T) {
	const uid = "c9f6489b-3f23-45b1-b3bb-9328fd1ebf64"
	pod, other := testutil.NewNS(t), testutil.NewNS(t)
	podIP := netip.MustParseAddr("10.77.0.5")
	testutil.RunIn(t, pod, "ip", "addr", "add", podIP.String()+"/32", "dev", "lo")
	proc := t.TempDir()
	dir := filepath.Join(proc, "200")
	if err := os.MkdirAll(filepath.Join(dir, "ns"), 0o755); err != nil {
		t.Fatal(err)
	}
	files := map[string]string{
		"cgroup": "0::/kubepods.slice/kubepods-pod" + "c9f6489b_3f23_45b1_b3bb_9328fd1ebf64" + ".slice/cri-containerd-x.scope\n",
		"stat":   "200 (pause) S 1 1 1 0 -1 0 0 0 0 0 0 0 0 0 20 0 1 0 20 0 0\n",
	}
	for name, data := range files {
		if err := os.WriteFile(filepath.Join(dir, name), []byte(data), 0o600); err != nil {
			t.Fatal(err)
		}
	}
	link := filepath.Join(dir, "ns", "net")
	if err := os.Symlink(pod.Path(), link); err != nil {
		t.Fatal(err)
	}
	rules := &swappingRules{t: t, link: link, other: other.Path(), podIP: podIP}
	c := New(DefaultConfig(), clientset.Of(fake.NewClientset()), rules, proc, NewMetric(), slog.New(slog.NewTextHandler(io.Discard, nil)))
	k8sPod := &corev1.Pod{ObjectMeta: metav1.ObjectMeta{Namespace: "ns", Name: "p", UID: uid,
		Annotations: map[string]string{"sidecar.istio.io/status": "{}"}},
		Spec:   corev1.PodSpec{Containers: []corev1.Container{{Name: "app"}, {Name: "istio-proxy"}}},
		Status: corev1.PodStatus{Phase: corev1.PodRunning, PodIP: podIP.String(), PodIPs: []corev1.PodIP{{IP: podIP.String()}}}}
	if err := c.repair(k8sPod, "validation failed"); err != nil {
		t.Fatalf("repair: %v", err)
	}
	want := rules.inode(pod.Path())
	if len(rules.reached) != 3 {
		t.Fatalf("the backend was called %d times, want plan, check and apply", len(rules.reached))
	}
	for i, got := range rules.reached {
		if got != want {
			t.Fatalf("call %d of the backend reached namespace %d, not the verified pod's %d (the other is %d)",
				i, got, want, rules.inode(other.Path()))
		}
	}
}
