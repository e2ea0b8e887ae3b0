package nlsteps_test

import (
	"encoding/binary"
	"os"
	"runtime"
	"strings"
	"testing"

	"github.com/containernetworking/plugins/pkg/ns"
	"golang.org/x/sys/unix"

	"github.com/istio-cni-go/istio-cni/internal/nlsteps"
	"github.com/istio-cni-go/istio-cni/internal/podnet"
	"github.com/istio-cni-go/istio-cni/internal/ruleset"
	"github.com/istio-cni-go/istio-cni/internal/testutil"
)

// tableMsg is a request that makes nftables table name (inet), only if it
// is not there.
func tableMsg(s *nlsteps.Step, name string) {
	body := nlsteps.Attr(nlsteps.NfGen(unix.NFPROTO_INET, 0), unix.NFTA_TABLE_NAME, append([]byte(name), 0))
	s.Add(unix.NFNL_SUBSYS_NFTABLES<<8|unix.NFT_MSG_NEWTABLE, nlsteps.FlagCreate|nlsteps.FlagExcl, body, "table inet "+name)
}

// podNS is a fresh namespace and a descriptor on it, as a relay holds
// the pod's; both go when the test ends.
func podNS(t *testing.T) (ns.NetNS, *os.File) {
	t.Helper()
	pod := testutil.NewNS(t)
	f, err := os.Open(pod.Path())
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = f.Close() })
	return pod, f
}

// TestRunInTheNamespace: RunIn sends from inside the namespace it is
// given, and the calling thread and the rest of the process stay where
// they were; a refused batch names its message with the kernel's words
// and leaves nothing of itself; ensuring steps pass when what they make
// is there already; the undo steps run after a refusal.
func TestRunInTheNamespace(t *testing.T) {
	testutil.RequireTools(t, "nft", "ip")
	pod, f := podNS(t)
	// Locked, so that "the calling thread" below is one thread: RunIn's
	// own lock nests in this one.
	runtime.LockOSThread()
	defer runtime.UnlockOSThread()
	here, err := ns.GetCurrentNS()
	if err != nil {
		t.Fatal(err)
	}
	defer here.Close()

	batch := nlsteps.Step{Proto: unix.NETLINK_NETFILTER, Batch: true}
	tableMsg(&batch, "one")
	tableMsg(&batch, "two")
	if _, err := nlsteps.RunIn(f, &nlsteps.Txn{Steps: []nlsteps.Step{batch}}); err != nil {
		t.Fatal(err)
	}
	if got := testutil.RunIn(t, pod, "nft", "list", "tables"); got != "table inet one\ntable inet two\n" {
		t.Fatalf("the pod's namespace holds %q", got)
	}
	if now, err := ns.GetCurrentNS(); err != nil || now.Path() == "" {
		t.Fatal(err)
	} else {
		defer now.Close()
		var a, b unix.Stat_t
		if unix.Fstat(int(now.Fd()), &a) != nil || unix.Fstat(int(here.Fd()), &b) != nil || a.Ino != b.Ino {
			t.Fatal("the calling thread left its namespace")
		}
	}

	// A second batch whose second table exists: refused whole.
	again := nlsteps.Step{Proto: unix.NETLINK_NETFILTER, Batch: true}
	tableMsg(&again, "three")
	tableMsg(&again, "two")
	routes := podnet.RoutingSteps(&ruleset.Plan{V4: &ruleset.Set{}, V6: &ruleset.Set{}, TProxyRoutes: true})
	undo := nlsteps.Step{Proto: unix.NETLINK_NETFILTER, Batch: true}
	tableMsg(&undo, "undone")
	_, err = nlsteps.RunIn(f, &nlsteps.Txn{Steps: append(routes, again), Undo: []nlsteps.Step{undo}})
	if err == nil || !strings.Contains(err.Error(), "table inet two: file exists") || !strings.Contains(err.Error(), "nothing of it applied") ||
		!strings.Contains(err.Error(), "after the routing requests, which the kernel took; the undo steps ran") {
		t.Fatalf("a batch over an existing table: %v", err)
	}
	if got := testutil.RunIn(t, pod, "nft", "list", "tables"); got != "table inet one\ntable inet two\ntable inet undone\n" {
		t.Fatalf("after a refused batch and its undo the namespace holds %q", got)
	}
	// The routing went in before the refused batch, and goes in again.
	if _, err := nlsteps.RunIn(f, &nlsteps.Txn{Steps: routes}); err != nil {
		t.Fatalf("ensuring what is there: %v", err)
	}
	if got := testutil.RunIn(t, pod, "ip", "rule"); strings.Count(got, "fwmark 0x539 lookup 133") != 1 {
		t.Fatalf("policy rules after two sends:\n%s", got)
	}
}

// TestRunSaysWhatLanded: a step refused after a batch the kernel took
// says so, since the batch's rules stay in the namespace for whoever
// reads the error (a fallback that then applies in place finds them).
func TestRunSaysWhatLanded(t *testing.T) {
	testutil.RequireTools(t, "nft")
	pod, f := podNS(t)
	batch := nlsteps.Step{Proto: unix.NETLINK_NETFILTER, Batch: true}
	tableMsg(&batch, "landed")
	// A default route through an interface the namespace lacks.
	route := nlsteps.Step{Proto: unix.NETLINK_ROUTE}
	body := []byte{unix.AF_INET, 0, 0, 0, 100, unix.RTPROT_BOOT, unix.RT_SCOPE_UNIVERSE, unix.RTN_UNICAST, 0, 0, 0, 0}
	oif := make([]byte, 4)
	binary.NativeEndian.PutUint32(oif, 9999)
	route.Add(unix.RTM_NEWROUTE, nlsteps.FlagCreate|nlsteps.FlagExcl, nlsteps.Attr(body, unix.RTA_OIF, oif), "route default dev #9999 table 100")
	_, err := nlsteps.RunIn(f, &nlsteps.Txn{Steps: []nlsteps.Step{batch, route}})
	if err == nil || !strings.Contains(err.Error(), "route default dev #9999 table 100") ||
		!strings.HasSuffix(err.Error(), "(after the nf_tables transaction, which the kernel took)") {
		t.Fatalf("a route refused after a batch: %v", err)
	}
	if got := testutil.RunIn(t, pod, "nft", "list", "tables"); got != "table inet landed\n" {
		t.Fatalf("the namespace holds %q", got)
	}
}

// TestInNetNS: fn runs in the namespace given, on the calling thread,
// which is back in its own namespace afterwards, also when fn panics; a
// descriptor that is not a network namespace is refused before fn runs.
func TestInNetNS(t *testing.T) {
	testutil.RequireRoot(t)
	pod, f := podNS(t)
	inode := func(path string) uint64 {
		var st unix.Stat_t
		if err := unix.Stat(path, &st); err != nil {
			t.Fatal(err)
		}
		return st.Ino
	}
	runtime.LockOSThread()
	defer runtime.UnlockOSThread()
	before := inode("/proc/thread-self/ns/net")
	var inside uint64
	if err := nlsteps.InNetNS(f, func() error { inside = inode("/proc/thread-self/ns/net"); return nil }); err != nil {
		t.Fatal(err)
	}
	if inside != inode(pod.Path()) || inside == before {
		t.Fatalf("fn ran in namespace %d; the pod's is %d, the caller's %d", inside, inode(pod.Path()), before)
	}
	if now := inode("/proc/thread-self/ns/net"); now != before {
		t.Fatalf("the calling thread is in namespace %d after, not its own %d", now, before)
	}
	// A panic in fn leaves the thread where it was, for a caller that
	// recovers.
	func() {
		defer func() { _ = recover() }()
		_ = nlsteps.InNetNS(f, func() error { panic("in the pod's namespace") })
	}()
	if now := inode("/proc/thread-self/ns/net"); now != before {
		t.Fatalf("after a panic in fn the calling thread is in namespace %d, not its own %d", now, before)
	}
	devNull, err := os.Open(os.DevNull)
	if err != nil {
		t.Fatal(err)
	}
	defer devNull.Close()
	ran := false
	err = nlsteps.InNetNS(devNull, func() error { ran = true; return nil })
	if err == nil || ran || !strings.Contains(err.Error(), "entering the pod's network namespace") {
		t.Fatalf("a descriptor that is no namespace: ran %v, %v", ran, err)
	}
}

// TestValidate: what the relay would send is checked before the kernel
// sees it: messages that do not parse, names that do not match them, and
// messages that are not requests.
func TestValidate(t *testing.T) {
	good := nlsteps.Step{Proto: unix.NETLINK_NETFILTER}
	tableMsg(&good, "x")
	truncated := good
	truncated.Msgs = good.Msgs[:10]
	unnamed := good
	unnamed.What = nil
	notRequest := nlsteps.Step{Proto: unix.NETLINK_NETFILTER, Msgs: append([]byte(nil), good.Msgs...), What: good.What}
	notRequest.Msgs[6] = 0
	for name, s := range map[string]nlsteps.Step{"truncated": truncated, "unnamed": unnamed, "not a request": notRequest} {
		if err := (&nlsteps.Txn{Steps: []nlsteps.Step{s}}).Validate(); err == nil {
			t.Errorf("%s: validated", name)
		}
	}
	if err := (&nlsteps.Txn{Steps: []nlsteps.Step{good}}).Validate(); err != nil {
		t.Fatal(err)
	}
}
