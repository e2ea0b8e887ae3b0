package cniserver

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/containernetworking/cni/pkg/skel"
	"github.com/containernetworking/cni/pkg/types"
	promtest "github.com/prometheus/client_golang/prometheus/testutil"
	"golang.org/x/sys/unix"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes/fake"

	"github.com/istio-cni-go/istio-cni/internal/cnirelay"
	"github.com/istio-cni-go/istio-cni/internal/kubeclient/clientset"
	"github.com/istio-cni-go/istio-cni/internal/logging"
	"github.com/istio-cni-go/istio-cni/internal/nlsteps"
	"github.com/istio-cni-go/istio-cni/internal/podcache"
	"github.com/istio-cni-go/istio-cni/internal/sockserve/sockservetest"
)

// ambientCall is what the fake controller was asked, and what it saw of
// the namespace descriptor and the server while it was asked.
type ambientCall struct {
	ns, name, uid string
	// dev and ino identify the namespace the descriptor refers to.
	dev, ino uint64
	fstatErr error
	// deadline: the context was bounded.
	deadline bool
	// held is the number of namespace locks the CNI server held.
	held int
}

// fakeAmbient answers EnrolOnAdd by pod name: enrolled, or an error;
// any other pod is not enrolled.
type fakeAmbient struct {
	enrol map[string]bool
	fail  map[string]error
	// server, when set, is asked how many namespace locks it holds.
	server *Server

	// checkFail is CheckOnCNI's answer by pod name (enrolled pods only).
	checkFail map[string]error

	mu     sync.Mutex
	calls  []ambientCall
	checks []ambientCall
}

func (f *fakeAmbient) EnrolOnAdd(ctx context.Context, namespace, name, uid string, netns *os.File) (bool, error) {
	c := f.observe(ctx, namespace, name, uid, netns)
	f.mu.Lock()
	f.calls = append(f.calls, c)
	f.mu.Unlock()
	if err := f.fail[name]; err != nil {
		return false, err
	}
	return f.enrol[name], nil
}

func (f *fakeAmbient) CheckOnCNI(ctx context.Context, namespace, name, uid string, netns *os.File) (bool, error) {
	c := f.observe(ctx, namespace, name, uid, netns)
	f.mu.Lock()
	f.checks = append(f.checks, c)
	f.mu.Unlock()
	if !f.enrol[name] {
		return false, nil
	}
	return true, f.checkFail[name]
}

func (f *fakeAmbient) observe(ctx context.Context, namespace, name, uid string, netns *os.File) ambientCall {
	c := ambientCall{ns: namespace, name: name, uid: uid}
	if netns == nil {
		c.fstatErr = errors.New("no descriptor")
	} else {
		var st unix.Stat_t
		c.fstatErr = unix.Fstat(int(netns.Fd()), &st)
		c.dev, c.ino = st.Dev, st.Ino
	}
	_, c.deadline = ctx.Deadline()
	if f.server != nil {
		c.held = f.server.locker().Held()
	}
	return c
}

func (f *fakeAmbient) asked() []ambientCall {
	f.mu.Lock()
	defer f.mu.Unlock()
	return append([]ambientCall(nil), f.calls...)
}

func (f *fakeAmbient) checked() []ambientCall {
	f.mu.Lock()
	defer f.mu.Unlock()
	return append([]ambientCall(nil), f.checks...)
}

const ambientPrevResult = `{"cniVersion":"1.0.0","interfaces":[{"name":"eth0","sandbox":"/var/run/netns/x"}],"ips":[{"address":"10.1.0.7/24","gateway":"10.1.0.1","interface":0}]}`

// newAmbientRig is newCommitRig's agent with an ambient controller
// (none when amb is nil): a
// pod cache with an injected pod (web), a plain one (plain) and one
// labelled for ambient (amb).
func newAmbientRig(t *testing.T, committer string, amb *fakeAmbient) *commitRig {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	sidecar := corev1.PodSpec{NodeName: "n", Containers: []corev1.Container{{Name: "app"}, {Name: "istio-proxy", Args: []string{"proxy", "sidecar"}}}}
	plain := corev1.PodSpec{NodeName: "n", Containers: []corev1.Container{{Name: "app"}}}
	cs := fake.NewClientset(
		&corev1.Pod{ObjectMeta: metav1.ObjectMeta{Namespace: "ns", Name: "web", UID: "u1",
			Annotations: map[string]string{"sidecar.istio.io/status": "{}"}}, Spec: sidecar},
		&corev1.Pod{ObjectMeta: metav1.ObjectMeta{Namespace: "ns", Name: "plain", UID: "u2"}, Spec: plain},
		&corev1.Pod{ObjectMeta: metav1.ObjectMeta{Namespace: "ns", Name: "amb", UID: "u3",
			Labels: map[string]string{"istio.io/dataplane-mode": "ambient"}}, Spec: plain})
	pods := podcache.Start(ctx, clientset.Of(cs), "n")
	if err := pods.WaitSynced(ctx); err != nil {
		cancel()
		t.Fatal(err)
	}
	logs := &sockservetest.Buffer{}
	root, err := logging.Open(logging.Options{OutputLevel: "default:info", AsJSON: true, Targets: []string{"stdout"}}, logs, io.Discard)
	if err != nil {
		cancel()
		t.Fatal(err)
	}
	commands, latency, lookups := NewMetrics()
	r := &commitRig{agent: &recordingRules{}, logs: logs}
	r.s = &Server{Log: root.Logger(logging.ScopePlugin), Rules: r.agent, NFTables: r.agent, Pods: pods, Clientset: clientset.Of(cs),
		Committer: committer, Commands: commands, Latency: latency, Lookups: lookups, Send: r.agent.send}
	if amb != nil {
		r.s.Ambient = amb
		amb.server = r.s
	}
	sock := filepath.Join(t.TempDir(), cnirelay.SocketName)
	done, err := r.s.Serve(ctx, sock, time.Second)
	if err != nil {
		cancel()
		t.Fatal(err)
	}
	var once sync.Once
	r.stop = func() { once.Do(func() { cancel(); <-done }) }
	t.Cleanup(r.stop)
	// The agent writes ambient_enabled as it runs the controller.
	r.conf = fmt.Sprintf(`{"cniVersion":"1.0.0","name":"n","type":"istio-cni","ambient_enabled":%v,"pod_namespace":"istio-system",`+
		`"cni_agent_run_dir":%q,"prevResult":%s}`, amb != nil, filepath.Dir(sock), ambientPrevResult)
	// Any file stands for the pod's namespace: the backends are fakes.
	r.netns = filepath.Join(t.TempDir(), "netns")
	if err := os.WriteFile(r.netns, nil, 0o600); err != nil {
		t.Fatal(err)
	}
	return r
}

// addArgs is an ADD of ns/pod with its UID, as containerd passes it.
func (r *commitRig) addArgs(pod, uid string) *skel.CmdArgs {
	return &skel.CmdArgs{ContainerID: "c-" + pod, IfName: "eth0", Netns: r.netns,
		Args: "K8S_POD_UID=" + uid + ";IgnoreUnknown=1;K8S_POD_NAMESPACE=ns;K8S_POD_NAME=" + pod, StdinData: []byte(r.conf)}
}

func netnsID(t *testing.T, path string) (dev, ino uint64) {
	t.Helper()
	var st unix.Stat_t
	if err := unix.Stat(path, &st); err != nil {
		t.Fatal(err)
	}
	return st.Dev, st.Ino
}

func sameJSONValue(a, b []byte) bool {
	var x, y any
	if json.Unmarshal(a, &x) != nil || json.Unmarshal(b, &y) != nil {
		return false
	}
	xa, _ := json.Marshal(x)
	ya, _ := json.Marshal(y)
	return bytes.Equal(xa, ya)
}

// TestAmbientEnrolsOnAdd drives real relays against a real CNI server
// whose ambient controller is a fake: the controller is asked first with
// the pod's namespace, name and UID and a descriptor of the pod's
// namespace, under the namespace's lock and within a deadline; an
// enrolled pod gets the previous result and nothing else (no rules
// prepared for the relay, no backend called), whoever commits; a pod not
// enrolled takes the sidecar path as before; the controller's error fails
// the ADD with code 11 naming it; DEL and CHECK never ask it.
func TestAmbientEnrolsOnAdd(t *testing.T) {
	for _, tc := range []struct {
		name      string
		committer string
		canCommit bool
	}{
		{"relay commits", CommitterPlugin, true},
		{"old relay", CommitterPlugin, false},
		{"agent commits", CommitterAgent, true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			amb := &fakeAmbient{enrol: map[string]bool{"amb": true},
				fail: map[string]error{"broken": errors.New("ztunnel did not acknowledge pod ns/broken within 5s")}}
			r := newAmbientRig(t, tc.committer, amb)
			dev, ino := netnsID(t, r.netns)
			var c *relaySender
			if tc.canCommit {
				c = &relaySender{}
			}
			prepared := func() int {
				if c == nil {
					return 0
				}
				return len(c.sent)
			}

			// Enrolled: the plain result, nothing else.
			var out bytes.Buffer
			if err := runRelay(r.relay(c, &out), "ADD", r.addArgs("amb", "u3")); err != nil {
				t.Fatalf("ADD of an enrolled pod: %v", err)
			}
			if !sameJSONValue(out.Bytes(), []byte(ambientPrevResult)) {
				t.Fatalf("an enrolled pod's ADD printed %q, want the previous result %s", out.String(), ambientPrevResult)
			}
			calls := amb.asked()
			if len(calls) != 1 {
				t.Fatalf("controller asked %d times: %+v", len(calls), calls)
			}
			got := calls[0]
			if got.ns != "ns" || got.name != "amb" || got.uid != "u3" {
				t.Errorf("controller asked about %s/%s uid %q, want ns/amb uid u3", got.ns, got.name, got.uid)
			}
			if got.fstatErr != nil || got.dev != dev || got.ino != ino {
				t.Errorf("controller's descriptor is namespace %d:%d (%v), want the relay's %s, %d:%d", got.dev, got.ino, got.fstatErr, r.netns, dev, ino)
			}
			if !got.deadline {
				t.Error("the enrolment is not bounded by a deadline")
			}
			if got.held != 1 {
				t.Errorf("the CNI server held %d namespace locks while the controller enrolled, want 1", got.held)
			}
			if n := prepared(); n != 0 {
				t.Errorf("the relay was handed rules for an enrolled pod: %+v", c.sent)
			}
			if n := len(r.agent.applied()); n != 0 {
				t.Errorf("sidecar rules applied by the agent for an enrolled pod: %d", n)
			}

			// Not enrolled: the sidecar path, committed as before.
			out.Reset()
			if err := runRelay(r.relay(c, &out), "ADD", r.addArgs("web", "u1")); err != nil {
				t.Fatalf("ADD of a sidecar pod: %v", err)
			}
			if !sameJSONValue(out.Bytes(), []byte(ambientPrevResult)) {
				t.Fatalf("a sidecar pod's ADD printed %q", out.String())
			}
			if calls := amb.asked(); len(calls) != 2 || calls[1].name != "web" || calls[1].uid != "u1" {
				t.Fatalf("controller not asked about ns/web: %+v", calls)
			}
			// The relay sends them when it can and the agent lets it; an
			// agent that commits sends them itself; an older relay's get
			// applied by the agent in place.
			wantPrepared, wantSent, wantAgent := 0, 0, 1
			switch {
			case tc.committer == CommitterAgent:
				wantSent, wantAgent = 1, 0
			case tc.canCommit:
				wantPrepared, wantAgent = 1, 0
			}
			if n := prepared(); n != wantPrepared {
				t.Errorf("rules prepared for the relay %d times, want %d", n, wantPrepared)
			}
			if n := len(r.agent.sentHere()); n != wantSent {
				t.Errorf("the agent sent prepared rules %d times, want %d", n, wantSent)
			}
			if n := len(r.agent.applied()); n != wantAgent {
				t.Errorf("the agent applied %d plans, want %d", n, wantAgent)
			}

			// The controller's error fails the ADD, naming it.
			out.Reset()
			err := runRelay(r.relay(c, &out), "ADD", r.addArgs("broken", "u9"))
			var te *cnirelay.Error
			if !errors.As(err, &te) || te.Code != types.ErrTryAgainLater || !strings.Contains(te.Msg, "ztunnel did not acknowledge pod ns/broken") {
				t.Fatalf("ADD the controller failed: %v, want code %d naming its error", err, types.ErrTryAgainLater)
			}
			if out.Len() != 0 {
				t.Errorf("a failed ADD printed %q", out.String())
			}
			if n := prepared(); n != wantPrepared {
				t.Errorf("rules prepared for a failed pod")
			}

			// DEL and CHECK never enrol.
			for _, cmd := range []string{"DEL", "CHECK"} {
				if err := runRelay(r.relay(c, io.Discard), cmd, r.addArgs("amb", "u3")); err != nil {
					t.Fatalf("%s: %v", cmd, err)
				}
			}
			if n := len(amb.asked()); n != 3 {
				t.Errorf("controller asked to enrol %d times after DEL and CHECK, want 3", n)
			}

			r.stop()
			if ok, failed := promtest.ToFloat64(r.s.Commands.WithLabelValues("ADD", "ok")), promtest.ToFloat64(r.s.Commands.WithLabelValues("ADD", "11")); ok != 2 || failed != 1 {
				t.Errorf("ADDs counted ok %v, failed (11) %v; want 2 and 1", ok, failed)
			}
			logs := r.logs.String()
			if !strings.Contains(logs, `"msg":"enrolled in the ambient mesh"`) || !strings.Contains(logs, `"pod":"ns/amb"`) {
				t.Errorf("the enrolment is not logged with its pod:\n%s", logs)
			}
		})
	}
}

// TestAmbientEnrolledResponseHasNoPreparedRules speaks the relay's
// protocol by hand: a committing relay's ADD of an enrolled pod is
// answered with the result alone (no Prepared, no Error), in one
// response, without any pod lookup (the server has neither a cache nor
// an API client).
func TestAmbientEnrolledResponseHasNoPreparedRules(t *testing.T) {
	amb := &fakeAmbient{enrol: map[string]bool{"amb": true}}
	rules := &recordingRules{}
	s := &Server{Log: quiet, Rules: rules, NFTables: rules, Ambient: amb}
	netns, err := os.Open(os.DevNull)
	if err != nil {
		t.Fatal(err)
	}
	defer netns.Close()
	conf := `{"cniVersion":"1.0.0","name":"n","type":"istio-cni","ambient_enabled":true,"cni_agent_run_dir":"/nonexistent","prevResult":` + ambientPrevResult + `}`
	body, err := json.Marshal(&cnirelay.Request{Command: "ADD", ContainerID: "c1", IfName: "eth0", Netns: "/var/run/netns/x", HasNetnsFD: true,
		Steps: true, TxnForm: nlsteps.BinaryForm, Args: "K8S_POD_NAMESPACE=ns;K8S_POD_NAME=amb;K8S_POD_UID=u3", Stdin: []byte(conf)})
	if err != nil {
		t.Fatal(err)
	}
	client, server := socketPair(t)
	done := make(chan struct{})
	go func() {
		defer close(done)
		s.serveConn(server, nopConnState{server})
	}()
	frame := withFrame(body)
	if _, _, err := client.WriteMsgUnix(frame[:4], unixRights(netns), nil); err != nil {
		t.Fatal(err)
	}
	if _, err := client.Write(frame[4:]); err != nil {
		t.Fatal(err)
	}
	if err := client.SetReadDeadline(time.Now().Add(30 * time.Second)); err != nil {
		t.Fatal(err)
	}
	// The server closes the connection after its one response: reading
	// to the end proves no commit is awaited.
	out, err := io.ReadAll(client)
	if err != nil {
		t.Fatalf("reading the response: %v", err)
	}
	<-done
	var resp cnirelay.Response
	if err := json.Unmarshal(out, &resp); err != nil {
		t.Fatalf("response %q: %v", out, err)
	}
	if resp.Txn != nil || resp.Error != nil || resp.Unavailable != "" {
		t.Fatalf("response to an enrolled pod's ADD: %s", out)
	}
	if !sameJSONValue(resp.Stdout, []byte(ambientPrevResult)) {
		t.Fatalf("stdout %q, want the previous result", resp.Stdout)
	}
	dev, ino := netnsID(t, os.DevNull)
	if calls := amb.asked(); len(calls) != 1 || calls[0].dev != dev || calls[0].ino != ino || calls[0].uid != "u3" {
		t.Fatalf("controller calls %+v, want one with %s (%d:%d)", calls, os.DevNull, dev, ino)
	}
	if n := len(rules.applied()); n != 0 {
		t.Fatalf("rules applied %d times", n)
	}
}

// TestNoAmbientControllerMeansSidecarPath: a server without a controller
// (ambient off, and so ambient_enabled false in the entry) serves a pod
// labelled for ambient as any other.
func TestNoAmbientControllerMeansSidecarPath(t *testing.T) {
	r := newAmbientRig(t, CommitterAgent, nil)
	var out bytes.Buffer
	for _, pod := range [][2]string{{"amb", "u3"}, {"web", "u1"}} {
		out.Reset()
		if err := runRelay(r.relay(nil, &out), "ADD", r.addArgs(pod[0], pod[1])); err != nil {
			t.Fatalf("ADD of %s: %v", pod[0], err)
		}
		if !sameJSONValue(out.Bytes(), []byte(ambientPrevResult)) {
			t.Fatalf("ADD of %s printed %q", pod[0], out.String())
		}
	}
	if sent := r.agent.sentHere(); len(sent) != 1 || len(r.agent.applied()) != 0 {
		t.Fatalf("the agent sent %d prepared plans and applied %d in place, want web's sent", len(sent), len(r.agent.applied()))
	}
}

// TestAmbientCheck: CHECK asks the controller (never to enrol) with the
// pod and its namespace's descriptor; an enrolled pod's failed check
// fails the CHECK naming what differs; a pod not enrolled is checked on
// the sidecar path.
func TestAmbientCheck(t *testing.T) {
	amb := &fakeAmbient{enrol: map[string]bool{"amb": true, "drifted": true},
		checkFail: map[string]error{"drifted": errors.New("ambient redirection: chain ISTIO_OUTPUT is missing")}}
	r := newAmbientRig(t, CommitterAgent, amb)
	dev, ino := netnsID(t, r.netns)
	if err := runRelay(r.relay(nil, io.Discard), "CHECK", r.addArgs("amb", "u3")); err != nil {
		t.Fatalf("CHECK of an enrolled pod: %v", err)
	}
	err := runRelay(r.relay(nil, io.Discard), "CHECK", r.addArgs("drifted", "u8"))
	if err == nil || !strings.Contains(err.Error(), "chain ISTIO_OUTPUT is missing") || !strings.Contains(err.Error(), "ns/drifted") {
		t.Fatalf("CHECK of a drifted enrolled pod: %v", err)
	}
	if err := runRelay(r.relay(nil, io.Discard), "CHECK", r.addArgs("web", "u1")); err != nil {
		t.Fatalf("CHECK of a sidecar pod: %v", err)
	}
	checks := amb.checked()
	if len(checks) != 3 {
		t.Fatalf("controller checked %d times: %+v", len(checks), checks)
	}
	for i, want := range []string{"amb/u3", "drifted/u8", "web/u1"} {
		c := checks[i]
		if c.ns+"/"+c.name+"/"+c.uid != "ns/"+want || c.dev != dev || c.ino != ino || !c.deadline {
			t.Errorf("check %d: %+v, want ns/%s with namespace %d:%d and a deadline", i, c, want, dev, ino)
		}
	}
	if n := len(amb.asked()); n != 0 {
		t.Fatalf("CHECK enrolled pods: %+v", amb.asked())
	}
}
