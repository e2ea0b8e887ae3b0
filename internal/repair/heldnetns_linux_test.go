package repair

import (
	"errors"
	"io"
	"log/slog"
	"net/netip"
	"os"
	"path/filepath"
	"strings"
	"syscall"
	"testing"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes/fake"

	"github.com/containernetworking/plugins/pkg/ns"

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
	pod, other := testutil.NewNS(t), testutil.NewNS(t)
	proc, link, k8sPod := procOfPod(t, pod)
	rules := &swappingRules{t: t, link: link, other: other.Path(), podIP: netip.MustParseAddr(k8sPod.Status.PodIP)}
	c := New(DefaultConfig(), clientset.Of(fake.NewClientset()), rules, proc, NewMetric(), slog.New(slog.NewTextHandler(io.Discard, nil)))
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

// procOfPod makes a fake /proc holding the pod's sandbox process, whose
// namespace is pod (given the pod's IP), and the pod object; it returns
// the /proc, the process's ns/net link and the pod.
func procOfPod(t *testing.T, pod ns.NetNS) (string, string, *corev1.Pod) {
	t.Helper()
	const uid = "c9f6489b-3f23-45b1-b3bb-9328fd1ebf64"
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
	k8sPod := &corev1.Pod{ObjectMeta: metav1.ObjectMeta{Namespace: "ns", Name: "p", UID: uid,
		Annotations: map[string]string{"sidecar.istio.io/status": "{}"}},
		Spec:   corev1.PodSpec{Containers: []corev1.Container{{Name: "app"}, {Name: "istio-proxy"}}},
		Status: corev1.PodStatus{Phase: corev1.PodRunning, PodIP: podIP.String(), PodIPs: []corev1.PodIP{{IP: podIP.String()}}}}
	return proc, link, k8sPod
}

// differingRules is a backend whose check finds the plugin's rules
// missing, counting what it writes.
type differingRules struct {
	countingRules
	podIP netip.Addr
}

func (r *differingRules) PodAddrs(string) ([]netip.Addr, error) {
	return []netip.Addr{r.podIP}, nil
}

func (*differingRules) Check(string, *ruleset.Plan) error {
	return errors.New("the plan's rules are not there")
}

// TestRepairLeavesRulesOfAnotherForm: a namespace whose rules differ from
// the plan but that holds redirect rules of another form is not written
// (the pod did not race the plugin), and one whose rules cannot be read
// is not written either: repair fails, as the start-up scan leaves it,
// rather than add a second set beside rules it cannot see.
func TestRepairLeavesRulesOfAnotherForm(t *testing.T) {
	for _, c := range []struct {
		name    string
		holds   bool
		err     error
		wantErr bool
	}{
		{name: "other rules", holds: true},
		{name: "unreadable", err: errors.New("iptables-legacy-save failed"), wantErr: true},
		{name: "none", holds: false},
	} {
		t.Run(c.name, func(t *testing.T) {
			proc, _, k8sPod := procOfPod(t, testutil.NewNS(t))
			rules := &differingRules{podIP: netip.MustParseAddr(k8sPod.Status.PodIP)}
			ctl := New(DefaultConfig(), clientset.Of(fake.NewClientset()), rules, proc, NewMetric(), slog.New(slog.NewTextHandler(io.Discard, nil)))
			ctl.holdsRules = func(string) (bool, error) { return c.holds, c.err }
			err := ctl.repair(k8sPod, "validation failed")
			if c.wantErr && (err == nil || !strings.Contains(err.Error(), "cannot tell whether")) {
				t.Fatalf("repair: %v, want it to say the rules could not be read", err)
			}
			wantApplied := 0
			if !c.holds && c.err == nil {
				wantApplied = 1
			}
			if (err != nil) != c.wantErr || rules.applied != wantApplied {
				t.Fatalf("repair: %v, rules written %d times; want error %v, written %d", err, rules.applied, c.wantErr, wantApplied)
			}
		})
	}
}
