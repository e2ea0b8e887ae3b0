package cniserver

import (
	"bytes"
	"context"
	"encoding/binary"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"net/netip"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/containernetworking/cni/pkg/skel"
	promtest "github.com/prometheus/client_golang/prometheus/testutil"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes/fake"

	"github.com/istio-cni-go/istio-cni/internal/cnirelay"
	"github.com/istio-cni-go/istio-cni/internal/iptables"
	"github.com/istio-cni-go/istio-cni/internal/kubeclient/clientset"
	"github.com/istio-cni-go/istio-cni/internal/logging"
	"github.com/istio-cni-go/istio-cni/internal/nlsteps"
	"github.com/istio-cni-go/istio-cni/internal/nsfacts"
	"github.com/istio-cni-go/istio-cni/internal/podcache"
	"github.com/istio-cni-go/istio-cni/internal/podnet"
	"github.com/istio-cni-go/istio-cni/internal/podrules"
	"github.com/istio-cni-go/istio-cni/internal/prepared"
	"github.com/istio-cni-go/istio-cni/internal/ruleset"
	"github.com/istio-cni-go/istio-cni/internal/sockserve/sockservetest"
)

// recordingRules is a backend that records the plans it applies (and
// fails them with fail when set), and prepares a canned transaction for
// the relay, or, with inPlace set, declines to.
type recordingRules struct {
	mu      sync.Mutex
	plans   []*ruleset.Plan
	fail    error
	inPlace string
	// sent are the summaries of the transactions the agent sent itself.
	sent []string
	// preparedPlans are the plans PrepareFresh was asked for, as their
	// IPv4 rules.
	preparedPlans []string
	// onPrepare, when set, is called at each PrepareFresh.
	onPrepare func()
}

// send records a transaction the agent sends itself (Server.Send).
func (r *recordingRules) send(_ *os.File, txn *nlsteps.Txn) (time.Duration, error) {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.sent = append(r.sent, txn.Summary)
	return time.Millisecond, nil
}

func (r *recordingRules) sentHere() []string {
	r.mu.Lock()
	defer r.mu.Unlock()
	return append([]string(nil), r.sent...)
}

func (r *recordingRules) Apply(_ string, plan *ruleset.Plan) (podnet.Report, error) {
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.fail != nil {
		return podnet.Report{}, r.fail
	}
	r.plans = append(r.plans, plan)
	return podnet.Report{}, nil
}
func (r *recordingRules) Check(string, *ruleset.Plan) error { return nil }
func (r *recordingRules) PodAddrs(string) ([]netip.Addr, error) {
	return []netip.Addr{netip.MustParseAddr("10.1.0.2")}, nil
}
func (r *recordingRules) applied() []*ruleset.Plan {
	r.mu.Lock()
	defer r.mu.Unlock()
	return append([]*ruleset.Plan(nil), r.plans...)
}

// A fake that stopped matching the interface would silently turn
// every ADD into an in-place apply.
var _ podrules.Preparer = (*recordingRules)(nil)

// Examine says inPlace.
func (r *recordingRules) Examine(string) (nsfacts.Facts, string, error) {
	r.mu.Lock()
	defer r.mu.Unlock()
	return nsfacts.Facts{Addrs: []netip.Addr{netip.MustParseAddr("10.1.0.2")}}, r.inPlace, nil
}

// PrepareFresh names the plan in the transaction's summary, so the test
// sees which plan the relay was handed.
func (r *recordingRules) PrepareFresh(_ nsfacts.Facts, plan *ruleset.Plan) (*nlsteps.Txn, string, error) {
	r.mu.Lock()
	r.preparedPlans = append(r.preparedPlans, plan.V4.Restore())
	hook := r.onPrepare
	r.mu.Unlock()
	if hook != nil {
		hook()
	}
	s := nlsteps.Step{Proto: 12}
	s.Add(1, 0, nil, "nothing")
	return &nlsteps.Txn{Summary: plan.V4.Restore(), Steps: []nlsteps.Step{s}}, "", nil
}

// commitRig is an agent's CNI server on a real socket with a synced pod
// cache, and what a relay needs to talk to it.
type commitRig struct {
	s     *Server
	agent *recordingRules
	logs  *sockservetest.Buffer
	conf  string
	netns string
	// stop ends the server once every command under way is done, so its
	// logs and metrics are complete (the relay does not wait for them).
	stop func()
}

func newCommitRig(t *testing.T, committer string) *commitRig {
	t.Helper()
	return newCommitRigWith(t, committer, nil)
}

// newCommitRigWith is newCommitRig with the server set by with before it
// serves.
func newCommitRigWith(t *testing.T, committer string, with func(*Server)) *commitRig {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	sidecar := corev1.PodSpec{NodeName: "n", Containers: []corev1.Container{{Name: "app"}, {Name: "istio-proxy", Args: []string{"proxy", "sidecar"}}}}
	cs := fake.NewClientset(
		&corev1.Pod{ObjectMeta: metav1.ObjectMeta{Namespace: "ns", Name: "web", UID: "u1",
			Annotations: map[string]string{"sidecar.istio.io/status": "{}", "traffic.sidecar.istio.io/excludeOutboundPorts": "5432"}}, Spec: sidecar},
		&corev1.Pod{ObjectMeta: metav1.ObjectMeta{Namespace: "ns", Name: "plain", UID: "u2"},
			Spec: corev1.PodSpec{NodeName: "n", Containers: []corev1.Container{{Name: "app"}}}})
	pods := podcache.Start(ctx, clientset.Of(cs), "n")
	if err := pods.WaitSynced(ctx); err != nil {
		t.Fatal(err)
	}
	logs := &sockservetest.Buffer{}
	root, err := logging.Open(logging.Options{OutputLevel: "default:info", AsJSON: true, Targets: []string{"stdout"}}, logs, io.Discard)
	if err != nil {
		t.Fatal(err)
	}
	commands, latency, lookups := NewMetrics()
	r := &commitRig{agent: &recordingRules{}, logs: logs}
	r.s = &Server{Log: root.Logger(logging.ScopePlugin), Rules: r.agent, NFTables: r.agent, Pods: pods, Clientset: clientset.Of(cs),
		Committer: committer, ForceIPTables: "legacy", Commands: commands, Latency: latency, Lookups: lookups, Send: r.agent.send}
	if with != nil {
		with(r.s)
	}
	sock := filepath.Join(t.TempDir(), cnirelay.SocketName)
	done, err := r.s.Serve(ctx, sock, time.Second)
	if err != nil {
		t.Fatal(err)
	}
	var once sync.Once
	r.stop = func() { once.Do(func() { cancel(); <-done }) }
	t.Cleanup(r.stop)
	r.conf = fmt.Sprintf(`{"cniVersion":"1.0.0","name":"n","type":"istio-cni","cni_agent_run_dir":%q,`+
		`"prevResult":{"cniVersion":"1.0.0","ips":[{"address":"10.1.0.2/24"}]}}`, filepath.Dir(sock))
	// Any file stands for the pod's namespace: the backends are fakes,
	// and the agent keys its lock by the descriptor's inode.
	r.netns = filepath.Join(t.TempDir(), "netns")
	if err := os.WriteFile(r.netns, nil, 0o600); err != nil {
		t.Fatal(err)
	}
	return r
}

func (r *commitRig) runDir() string {
	var c struct {
		RunDir string `json:"cni_agent_run_dir"`
	}
	_ = json.Unmarshal([]byte(r.conf), &c)
	return c.RunDir
}

func (r *commitRig) add(pod string) *skel.CmdArgs {
	return &skel.CmdArgs{ContainerID: "c-" + pod, IfName: "eth0", Netns: r.netns,
		Args: "K8S_POD_NAMESPACE=ns;K8S_POD_NAME=" + pod, StdinData: []byte(r.conf)}
}

// relaySender stands in for the kernel on the relay's side: it records
// the transactions it was handed and whether the agent held the
// namespace meanwhile, and fails them with fail when set.
type relaySender struct {
	agent      *Server
	sent       []*nlsteps.Txn
	heldDuring []int
	fail       error
}

func (c *relaySender) send(_ *os.File, txn *nlsteps.Txn) (time.Duration, error) {
	c.sent = append(c.sent, txn)
	c.heldDuring = append(c.heldDuring, c.agent.locker().Held())
	return time.Millisecond, c.fail
}

func (r *commitRig) relay(c *relaySender, out io.Writer) *cnirelay.Relay {
	rl := &cnirelay.Relay{Fallback: "/nonexistent/fallback", Stdout: out, Stderr: io.Discard, Timeout: 10 * time.Second, NoSteps: c == nil}
	if c != nil {
		c.agent = r.s
		rl.Send = c.send
	}
	return rl
}

// TestRelaySendsPreparedRules: with the plugin as committer, the agent
// decides and prepares, and the relay sends: the agent's backend never
// applies, the relay gets the pod's plan prepared, sends it while the
// agent holds the namespace's lock, prints the result, and the agent
// logs and counts the pod from the relay's outcome.
func TestRelaySendsPreparedRules(t *testing.T) {
	r := newCommitRig(t, CommitterPlugin)
	c := &relaySender{}
	var out strings.Builder
	if err := runRelay(r.relay(c, &out), "ADD", r.add("web")); err != nil {
		t.Fatalf("ADD: %v", err)
	}
	if n := len(r.agent.applied()); n != 0 {
		t.Fatalf("the agent applied %d plans itself", n)
	}
	if len(c.sent) != 1 || !strings.Contains(c.sent[0].Summary, "--dport 5432 -j RETURN") {
		t.Fatalf("the relay sent %d transactions, want the plan excluding port 5432: %+v", len(c.sent), c.sent)
	}
	if c.heldDuring[0] != 1 {
		t.Fatalf("the agent held %d namespace locks while the relay sent, want 1", c.heldDuring[0])
	}
	if !strings.Contains(out.String(), `"10.1.0.2/24"`) {
		t.Fatalf("the relay did not print the previous result: %q", out.String())
	}
	// The lock was given back: a second ADD on the namespace goes
	// through too (it would wait out the relay's timeout otherwise).
	if err := runRelay(r.relay(c, io.Discard), "ADD", r.add("web")); err != nil {
		t.Fatalf("second ADD: %v", err)
	}
	// A pod without a sidecar gets nothing to send.
	if err := runRelay(r.relay(c, io.Discard), "ADD", r.add("plain")); err != nil {
		t.Fatalf("ADD of a plain pod: %v", err)
	}
	if len(c.sent) != 2 {
		t.Fatalf("rules prepared for a pod without a sidecar: %d sent", len(c.sent))
	}
	r.stop()
	logs := r.logs.String()
	if !strings.Contains(logs, `"msg":"redirect rules programmed"`) || !strings.Contains(logs, `"committed_by":"plugin"`) ||
		!strings.Contains(logs, `"pod":"ns/web"`) || !strings.Contains(logs, `"apply":"1ms"`) {
		t.Fatalf("the agent did not log the relay's send:\n%s", logs)
	}
	if got := promtest.ToFloat64(r.s.Commands.WithLabelValues("ADD", "ok")); got != 3 {
		t.Fatalf("ADDs counted ok: %v", got)
	}
}

// TestRelaySendFailureFailsTheADD: the kernel refusing the relay's
// requests fails the ADD with the pod and the kernel's words, and the
// agent logs and counts it as failed; a relay that dies before reporting
// fails its ADD, and the agent logs that it never heard and gives the
// namespace's lock back.
func TestRelaySendFailureFailsTheADD(t *testing.T) {
	r := newCommitRig(t, CommitterPlugin)
	c := &relaySender{fail: errors.New("the kernel refused the nf_tables transaction: rule 3: invalid argument")}
	err := runRelay(r.relay(c, io.Discard), "ADD", r.add("web"))
	if err == nil || !strings.Contains(err.Error(), "pod ns/web") || !strings.Contains(err.Error(), "rule 3: invalid argument") {
		t.Fatalf("ADD with a refused send: %v", err)
	}

	// A relay killed after the agent's answer: it reads the prepared
	// rules and goes away.
	conn := r.sendRaw(t, cnirelay.Request{Command: "ADD", ContainerID: "c-web", Netns: r.netns, HasNetnsFD: true,
		IfName: "eth0", Args: "K8S_POD_NAMESPACE=ns;K8S_POD_NAME=web", Stdin: []byte(r.conf), Steps: true, TxnForm: nlsteps.BinaryForm})
	var resp cnirelay.Response
	if err := json.NewDecoder(conn).Decode(&resp); err != nil || resp.Txn == nil {
		t.Fatalf("the agent's answer: %+v %v", resp, err)
	}
	conn.Close()

	c.fail = nil
	if err := runRelay(r.relay(c, io.Discard), "ADD", r.add("web")); err != nil {
		t.Fatalf("ADD after a relay died: %v", err)
	}
	r.stop()
	logs := r.logs.String()
	if !strings.Contains(logs, `"msg":"programming redirect rules failed"`) || !strings.Contains(logs, "rule 3: invalid argument") {
		t.Fatalf("the agent did not log the refused send:\n%s", logs)
	}
	if !strings.Contains(logs, "did not report sending") {
		t.Fatalf("the agent did not log the relay that never reported:\n%s", logs)
	}
	if got := promtest.ToFloat64(r.s.Commands.WithLabelValues("ADD", "999")); got != 2 {
		t.Fatalf("failed ADDs counted: %v", got)
	}
}

// TestAgentAppliesWhenTheRelayCannotSend: an older relay, and a namespace
// the backend cannot prepare for (it holds rules already), get the rules
// applied by the agent; the last is logged with why.
func TestAgentAppliesWhenTheRelayCannotSend(t *testing.T) {
	for _, tc := range []struct {
		name      string
		committer string
		canSend   bool
		inPlace   string
	}{
		{"old relay", CommitterPlugin, false, ""},
		{"namespace not fresh", CommitterPlugin, true, "the namespace holds ipsets"},
		{"agent committer, namespace not fresh", CommitterAgent, true, "the namespace holds ipsets"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			r := newCommitRig(t, tc.committer)
			r.agent.mu.Lock()
			r.agent.inPlace = tc.inPlace
			r.agent.mu.Unlock()
			addCommittedByAgent(t, r, tc.canSend)
			if n := len(r.agent.applied()); n != 1 {
				t.Fatalf("the agent applied %d plans, want 1", n)
			}
			r.stop()
			if tc.inPlace != "" && !strings.Contains(r.logs.String(), `"committed_by":"agent","why":"`+tc.inPlace+`"`) {
				t.Fatalf("the agent did not say why it applied:\n%s", r.logs.String())
			}
		})
	}
}

// sendRaw sends req on the rig's CNI socket as a relay does, with the
// rig's pod namespace as the descriptor, and returns the connection.
func (r *commitRig) sendRaw(t *testing.T, req cnirelay.Request) *net.UnixConn {
	t.Helper()
	conn, err := net.DialUnix("unix", nil, &net.UnixAddr{Name: filepath.Join(r.runDir(), cnirelay.SocketName), Net: "unix"})
	if err != nil {
		t.Fatal(err)
	}
	f, err := os.Open(r.netns)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	body, _ := json.Marshal(&req)
	hdr := binary.BigEndian.AppendUint32(nil, uint32(len(body)))
	if _, _, err := conn.WriteMsgUnix(hdr, syscall.UnixRights(int(f.Fd())), nil); err != nil {
		t.Fatal(err)
	}
	if _, err := conn.Write(body); err != nil {
		t.Fatal(err)
	}
	return conn
}

// TestRelayOfAnotherTxnForm: a relay that reads another transaction form
// than this agent writes (another release, met during an upgrade) is not
// handed rules it cannot decode: the agent applies them itself, or, for a
// relay that may leave it for the fallback, writes nothing and answers
// Unavailable, which sends the relay to its fallback.
func TestRelayOfAnotherTxnForm(t *testing.T) {
	// "": a relay from before relays said it, which may read another form.
	for _, c := range []struct {
		form     string
		mayLeave bool
	}{{"NLS0", false}, {"NLS0", true}, {"", false}, {"", true}} {
		form, mayLeave := c.form, c.mayLeave
		t.Run(fmt.Sprintf("form %q may leave %t", form, mayLeave), func(t *testing.T) {
			r := newCommitRig(t, CommitterPlugin)
			conn := r.sendRaw(t, cnirelay.Request{Command: "ADD", ContainerID: "c-web", Netns: r.netns, HasNetnsFD: true,
				IfName: "eth0", Args: "K8S_POD_NAMESPACE=ns;K8S_POD_NAME=web;K8S_POD_UID=u1", Stdin: []byte(r.conf),
				Steps: true, TxnForm: form, MayLeave: mayLeave})
			defer conn.Close()
			_ = conn.CloseWrite()
			var resp cnirelay.Response
			if err := json.NewDecoder(conn).Decode(&resp); err != nil {
				t.Fatal(err)
			}
			if resp.Txn != nil {
				t.Fatalf("a relay of form %q was handed a transaction of form %s", form, resp.Txn[:4])
			}
			applied := len(r.agent.applied())
			if mayLeave {
				if !strings.Contains(resp.Unavailable, fmt.Sprintf("%q", form)) || resp.Error != nil || applied != 0 {
					t.Fatalf("a relay that may leave: answer %+v, %d plans applied by the agent", resp, applied)
				}
				return
			}
			if resp.Error != nil || resp.Unavailable != "" || !strings.Contains(string(resp.Stdout), `"10.1.0.2/24"`) || applied != 1 {
				t.Fatalf("answer %+v (stdout %s), %d plans applied by the agent, want 1", resp, resp.Stdout, applied)
			}
		})
	}
}

// addCommittedByAgent runs web's ADD through a relay that can send rules
// or not, where the agent commits them, and checks what then holds
// whichever way the agent does: the relay was handed no rules, and it
// printed the previous result.
func addCommittedByAgent(t *testing.T, r *commitRig, canSend bool) {
	t.Helper()
	var c *relaySender
	if canSend {
		c = &relaySender{}
	}
	var out strings.Builder
	if err := runRelay(r.relay(c, &out), "ADD", r.add("web")); err != nil {
		t.Fatalf("ADD: %v", err)
	}
	if c != nil && len(c.sent) != 0 {
		t.Fatalf("the relay was handed rules: %+v", c.sent)
	}
	if !strings.Contains(out.String(), `"10.1.0.2/24"`) {
		t.Fatalf("the relay did not print the previous result: %q", out.String())
	}
}

// TestAgentSendsWhenItCommits: an agent told to commit the rules itself
// sends the requests it prepared from its own process, to a relay that
// could have sent them as much as to one that could not; the relay prints
// the previous result it gets with the answer, and the log names the
// agent as the committer.
func TestAgentSendsWhenItCommits(t *testing.T) {
	for _, canSend := range []bool{true, false} {
		t.Run(fmt.Sprintf("relay can send %t", canSend), func(t *testing.T) {
			r := newCommitRig(t, CommitterAgent)
			addCommittedByAgent(t, r, canSend)
			sent := r.agent.sentHere()
			if len(sent) != 1 || !strings.Contains(sent[0], "5432") {
				t.Fatalf("the agent sent %q, want the pod's plan once", sent)
			}
			if n := len(r.agent.applied()); n != 0 {
				t.Fatalf("the agent also applied %d plans in place", n)
			}
			r.stop()
			if !strings.Contains(r.logs.String(), `"committed_by":"agent"`) || strings.Contains(r.logs.String(), "plugin_cpu") {
				t.Fatalf("the log does not name the agent as the committer:\n%s", r.logs.String())
			}
		})
	}
}

// TestRelayForcesTheVariant: the runtime's FORCE_IPTABLES_BINARY, which
// the relay passes on, picks the iptables variant when the agent names
// none; the agent's own setting wins.
func TestRelayForcesTheVariant(t *testing.T) {
	for _, c := range []struct {
		agent, relay, want string
	}{
		{"", "legacy", "legacy"},
		{"nft", "legacy", "nft"},
		{"", "", ""},
	} {
		s := &Server{Rules: &iptables.Applier{Force: c.agent}, ForceIPTables: c.agent}
		got := s.rulesFor(&cnirelay.Request{ForceIPTables: c.relay}).(*iptables.Applier)
		if got.Force != c.want {
			t.Errorf("agent %q, relay %q: variant %q, want %q", c.agent, c.relay, got.Force, c.want)
		}
	}
	if s := (&Server{Rules: &recordingRules{}}); s.rulesFor(&cnirelay.Request{ForceIPTables: "legacy"}) != s.Rules {
		t.Error("a backend that is not iptables was replaced")
	}
}

// runRelay runs one command through the relay as the runtime gives it.
func runRelay(rl *cnirelay.Relay, command string, a *skel.CmdArgs) error {
	return rl.Run(&cnirelay.Args{Command: command, ContainerID: a.ContainerID, Netns: a.Netns, IfName: a.IfName,
		Args: a.Args, Path: a.Path, Stdin: a.StdinData})
}

// TestPreparesUnderLearntConfigs: the agent prepares the ADDs of its
// node's pods that have not started under the configs it has seen in two
// ADDs it served, not before, and never under a config that differs from
// one ADD to the next (a runtime putting something of each pod's into
// it) or that the plugin's checks refuse; a pod without a sidecar is
// prepared as one that gets no rules.
func TestPreparesUnderLearntConfigs(t *testing.T) {
	dir := filepath.Join(t.TempDir(), "prepared")
	r := newCommitRigWith(t, CommitterPlugin, func(s *Server) { s.PreparedDir, s.Prepare = dir, true })
	rl := r.relay(&relaySender{}, io.Discard)
	records := func() []string {
		entries, err := os.ReadDir(dir)
		if err != nil {
			t.Fatal(err)
		}
		var names []string
		for _, e := range entries {
			// The learnt configs' file, and records being written.
			if !strings.HasPrefix(e.Name(), ".") {
				names = append(names, e.Name())
			}
		}
		return names
	}
	for i := 0; i < 20; i++ {
		a := r.add("web")
		a.StdinData = []byte(strings.Replace(r.conf, `"name":"n"`, fmt.Sprintf(`"name":"n","runtimeConfig":{"i":%d}`, i), 1))
		if err := runRelay(rl, "ADD", a); err != nil {
			t.Fatal(err)
		}
	}
	// A config the plugin's checks refuse is never learnt.
	for i := 0; i < 2; i++ {
		a := r.add("web")
		a.StdinData = []byte(strings.Replace(r.conf, `"name":"n"`, `"name":"bad name"`, 1))
		if err := runRelay(rl, "ADD", a); err == nil {
			t.Fatal("ADD with an invalid network name succeeded")
		}
	}
	if err := runRelay(rl, "ADD", r.add("web")); err != nil {
		t.Fatal(err)
	}
	// The preparer has had the pods since the start, and each config is
	// seen once so far (the agent's work is synchronous with the ADDs).
	learnt := func() int {
		r.s.prep.mu.Lock()
		defer r.s.prep.mu.Unlock()
		return len(r.s.prep.learnt)
	}
	if n, got := learnt(), records(); n != 0 || len(got) != 0 {
		t.Fatalf("%d configs learnt and records %v after configs seen once each", n, got)
	}
	if err := runRelay(rl, "ADD", r.add("web")); err != nil {
		t.Fatal(err)
	}
	if n := learnt(); n != 1 {
		t.Fatalf("%d configs learnt, want the one seen twice", n)
	}
	deadline := time.Now().Add(20 * time.Second)
	for len(records()) < 2 {
		if time.Now().After(deadline) {
			t.Fatalf("records after the config was seen twice: %v", records())
		}
		time.Sleep(time.Millisecond) // polling the preparer's goroutine, bounded
	}
	web, err := prepared.Read(dir, "u1")
	if err != nil {
		t.Fatal(err)
	}
	want, err := prepared.ParseConfig([]byte(r.conf))
	if err != nil {
		t.Fatal(err)
	}
	if len(web.Entries) != 1 || !bytes.Equal(web.Entries[0].Config, want.Canonical) || web.Entries[0].Skip != "" ||
		len(web.Entries[0].Txn4) == 0 || len(web.Entries[0].Txn46) == 0 {
		t.Fatalf("web's record: %+v", web)
	}
	var txn nlsteps.Txn
	if err := txn.UnmarshalBinary(web.Entries[0].Txn4); err != nil || !strings.Contains(txn.Summary, "--dport 5432 -j RETURN") {
		t.Fatalf("web's prepared rules %q (%v), want the plan excluding port 5432", txn.Summary, err)
	}
	plain, err := prepared.Read(dir, "u2")
	if err != nil || len(plain.Entries) != 1 || !strings.Contains(plain.Entries[0].Skip, "no istio-proxy container") {
		t.Fatalf("plain's record: %+v, %v", plain, err)
	}
	// The next agent on the node prepares under the learnt config from
	// its start, before it has served any ADD.
	r.stop()
	r2 := newCommitRigWith(t, CommitterPlugin, func(s *Server) { s.PreparedDir, s.Prepare = dir, true })
	for len(records()) < 2 {
		if time.Now().After(deadline) {
			t.Fatalf("records of the next agent: %v", records())
		}
		time.Sleep(time.Millisecond) // polling the preparer's goroutine, bounded
	}
	if got := promtest.ToFloat64(r2.s.Commands.WithLabelValues("ADD", "ok")); got != 0 {
		t.Fatalf("the next agent served %v ADDs", got)
	}
	// It also prepared, unasked, the plan of a pod that sets nothing of
	// its redirection (no pod of the node has it: web excludes 5432), so
	// the most common plan is there for a burst right after its start.
	warmed := func() bool {
		r2.agent.mu.Lock()
		defer r2.agent.mu.Unlock()
		for _, p := range r2.agent.preparedPlans {
			if !strings.Contains(p, "5432") && strings.Contains(p, "ISTIO_OUTPUT") {
				return true
			}
		}
		return false
	}
	for !warmed() {
		if time.Now().After(deadline) {
			t.Fatalf("the next agent prepared no plan of a default pod: %q", r2.agent.preparedPlans)
		}
		time.Sleep(time.Millisecond) // polling the preparer's goroutine, bounded
	}
	// The first agent, which learnt its config from ADDs, had nothing to
	// warm at its start.
	r.agent.mu.Lock()
	defer r.agent.mu.Unlock()
	for _, p := range r.agent.preparedPlans {
		if !strings.Contains(p, "5432") {
			t.Fatalf("the first agent prepared a plan no pod of its node has:\n%s", p)
		}
	}
}

// TestPrepQueueOrder: pods new to the node are prepared before the
// backlog, and by a worker of their own; each key waits once, and a shut
// queue gives nothing more.
func TestPrepQueueOrder(t *testing.T) {
	q := newPrepQueue()
	q.add("a", false)
	q.add("b", false)
	q.add("a", true) // waiting already: stays where it is
	q.add("c", true)
	var got []string
	for i := 0; i < 3; i++ {
		k, ok := q.get(false)
		if !ok {
			t.Fatal("queue shut")
		}
		got = append(got, k)
	}
	if strings.Join(got, ",") != "c,a,b" {
		t.Fatalf("order %v, want c,a,b", got)
	}
	done := make(chan bool)
	// The worker for new pods leaves the backlog alone.
	q.add("e", false)
	go func() {
		k, ok := q.get(true)
		done <- ok && k == "f"
	}()
	q.add("f", true)
	if !<-done {
		t.Fatal("the new pods' worker did not get the new pod")
	}
	if k, ok := q.get(false); !ok || k != "e" {
		t.Fatalf("backlog: %q, %t", k, ok)
	}
	go func() {
		_, ok := q.get(false)
		done <- ok
	}()
	q.shutDown()
	if <-done {
		t.Fatal("a shut queue gave a key")
	}
	q.add("d", true)
	if _, ok := q.get(true); ok {
		t.Fatal("a shut queue took a key")
	}
}

// TestUnpreparedInTheLog: why a relay did not serve an ADD from the pod's
// record goes into the agent's lines of that ADD.
func TestUnpreparedInTheLog(t *testing.T) {
	r := newCommitRig(t, CommitterPlugin)
	a := r.add("web")
	req := &cnirelay.Request{Command: "ADD", ContainerID: a.ContainerID, IfName: a.IfName, Args: a.Args, Stdin: a.StdinData,
		Unprepared: "the namespace has tables of ours already"}
	f, err := os.Open(r.netns)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	if resp := r.s.Handle(req, f); resp.Error != nil {
		t.Fatalf("ADD: %v", resp.Error)
	}
	r.stop()
	if logs := r.logs.String(); !strings.Contains(logs, `"unprepared":"the namespace has tables of ours already"`) {
		t.Fatalf("the agent's lines do not say why the record went unused:\n%s", logs)
	}
}
