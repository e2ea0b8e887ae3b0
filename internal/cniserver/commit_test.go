package cniserver

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/netip"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/containernetworking/cni/pkg/skel"
	promtest "github.com/prometheus/client_golang/prometheus/testutil"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes/fake"

	"github.com/istio-cni-go/istio-cni/internal/cnirelay"
	"github.com/istio-cni-go/istio-cni/internal/kubeclient/clientset"
	"github.com/istio-cni-go/istio-cni/internal/logging"
	"github.com/istio-cni-go/istio-cni/internal/podcache"
	"github.com/istio-cni-go/istio-cni/internal/podnet"
	"github.com/istio-cni-go/istio-cni/internal/podrules"
	"github.com/istio-cni-go/istio-cni/internal/ruleset"
	"github.com/istio-cni-go/istio-cni/internal/sockserve/sockservetest"
)

// recordingRules is a backend that records the plans it applies, and
// fails them with fail when set.
type recordingRules struct {
	mu    sync.Mutex
	plans []*ruleset.Plan
	fail  error
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
		Committer: committer, ForceIPTables: "legacy", Commands: commands, Latency: latency, Lookups: lookups}
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

func (r *commitRig) add(pod string) *skel.CmdArgs {
	return &skel.CmdArgs{ContainerID: "c-" + pod, IfName: "eth0", Netns: r.netns,
		Args: "K8S_POD_NAMESPACE=ns;K8S_POD_NAME=" + pod, StdinData: []byte(r.conf)}
}

// relayCommitter is a relay's Commit over relay-side rules, which records
// what it was handed and whether the agent held the namespace meanwhile.
type relayCommitter struct {
	rules      *recordingRules
	agent      *Server
	prepared   []podrules.Prepared
	heldDuring []int
	// account, when false, sends the agent no account, as a relay killed
	// mid-commit.
	noAccount bool
}

func (c *relayCommitter) commit(prepared []byte, netns string) ([]byte, error) {
	var p podrules.Prepared
	if err := json.Unmarshal(prepared, &p); err != nil {
		return nil, err
	}
	c.prepared = append(c.prepared, p)
	c.heldDuring = append(c.heldDuring, c.agent.locker().Held())
	if c.noAccount {
		return nil, errors.New("killed mid-commit")
	}
	done := podrules.Commit(&p, c.rules, netns)
	out, err := json.Marshal(&done)
	if err != nil {
		return nil, err
	}
	if done.Error != "" {
		return out, fmt.Errorf("pod %s: %s", p.Pod, done.Error)
	}
	return out, nil
}

func (r *commitRig) relay(c *relayCommitter, out io.Writer) *cnirelay.Relay {
	rl := &cnirelay.Relay{Fallback: "/nonexistent/fallback", Stdout: out, Stderr: io.Discard, Timeout: 10 * time.Second}
	if c != nil {
		c.agent = r.s
		rl.Commit = c.commit
	}
	return rl
}

// TestRelayCommitsPreparedRules: with the plugin as committer, the agent
// decides and the relay applies: the agent's backend is never called, the
// relay gets the pod's parameters and the agent's backend settings, holds
// the namespace's lock (in the agent) while it commits, prints the result,
// and the agent logs and counts the pod from the relay's account.
func TestRelayCommitsPreparedRules(t *testing.T) {
	r := newCommitRig(t, CommitterPlugin)
	c := &relayCommitter{rules: &recordingRules{}}
	var out strings.Builder
	if err := r.relay(c, &out).Run("ADD", r.add("web")); err != nil {
		t.Fatalf("ADD: %v", err)
	}
	if n := len(r.agent.applied()); n != 0 {
		t.Fatalf("the agent applied %d plans itself", n)
	}
	plans := c.rules.applied()
	if len(plans) != 1 || !strings.Contains(plans[0].V4.Restore(), "--dport 5432 -j RETURN") {
		t.Fatalf("the relay applied %d plans, want one excluding port 5432: %+v", len(plans), plans)
	}
	if len(c.prepared) != 1 || c.prepared[0].Pod != "ns/web" || c.prepared[0].ForceIPTables != "legacy" || c.prepared[0].NativeNftables {
		t.Fatalf("prepared: %+v", c.prepared)
	}
	if c.heldDuring[0] != 1 {
		t.Fatalf("the agent held %d namespace locks during the commit, want 1", c.heldDuring[0])
	}
	if !strings.Contains(out.String(), `"10.1.0.2/24"`) {
		t.Fatalf("the relay did not print the previous result: %q", out.String())
	}
	// The lock was given back: a second ADD on the namespace commits too
	// (it would wait out the relay's timeout otherwise).
	if err := r.relay(c, io.Discard).Run("ADD", r.add("web")); err != nil {
		t.Fatalf("second ADD: %v", err)
	}
	// A pod without a sidecar gets nothing to commit.
	if err := r.relay(c, io.Discard).Run("ADD", r.add("plain")); err != nil {
		t.Fatalf("ADD of a plain pod: %v", err)
	}
	if len(c.prepared) != 2 {
		t.Fatalf("rules prepared for a pod without a sidecar: %+v", c.prepared)
	}
	r.stop()
	logs := r.logs.String()
	if !strings.Contains(logs, `"msg":"redirect rules programmed"`) || !strings.Contains(logs, `"committed_by":"plugin"`) || !strings.Contains(logs, `"pod":"ns/web"`) {
		t.Fatalf("the agent did not log the relay's commit:\n%s", logs)
	}
	if got := promtest.ToFloat64(r.s.Commands.WithLabelValues("ADD", "ok")); got != 3 {
		t.Fatalf("ADDs counted ok: %v", got)
	}
}

// TestRelayCommitFailureFailsTheADD: the relay's failed commit fails the
// ADD with the pod and the backend's error, and the agent logs and counts
// it as failed.
func TestRelayCommitFailureFailsTheADD(t *testing.T) {
	r := newCommitRig(t, CommitterPlugin)
	c := &relayCommitter{rules: &recordingRules{fail: errors.New("iptables-restore: line 3 failed")}}
	err := r.relay(c, io.Discard).Run("ADD", r.add("web"))
	if err == nil || !strings.Contains(err.Error(), "pod ns/web") || !strings.Contains(err.Error(), "line 3 failed") {
		t.Fatalf("ADD with a failing commit: %v", err)
	}

	// A relay that dies mid-commit fails its ADD; the agent logs that it
	// never heard, and gives the namespace's lock back.
	c = &relayCommitter{rules: &recordingRules{}, noAccount: true}
	if err := r.relay(c, io.Discard).Run("ADD", r.add("web")); err == nil {
		t.Fatal("ADD whose commit died succeeded")
	}
	c.noAccount = false
	if err := r.relay(c, io.Discard).Run("ADD", r.add("web")); err != nil {
		t.Fatalf("ADD after a relay died mid-commit: %v", err)
	}
	r.stop()
	logs := r.logs.String()
	if !strings.Contains(logs, `"msg":"programming redirect rules failed"`) || !strings.Contains(logs, "line 3 failed") {
		t.Fatalf("the agent did not log the failed commit:\n%s", logs)
	}
	if !strings.Contains(logs, "did not report its commit") {
		t.Fatalf("the agent did not log the relay that never reported:\n%s", logs)
	}
	if got := promtest.ToFloat64(r.s.Commands.WithLabelValues("ADD", "999")); got != 2 {
		t.Fatalf("failed ADDs counted: %v", got)
	}
}

// TestAgentCommitsForOldRelaysAndWhenTold: a relay that cannot commit (an
// older one), and any relay when the agent is told to commit itself, get
// the rules applied by the agent, as before.
func TestAgentCommitsForOldRelaysAndWhenTold(t *testing.T) {
	for _, tc := range []struct {
		name      string
		committer string
		canCommit bool
	}{
		{"old relay", CommitterPlugin, false},
		{"agent committer", CommitterAgent, true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			r := newCommitRig(t, tc.committer)
			var c *relayCommitter
			if tc.canCommit {
				c = &relayCommitter{rules: &recordingRules{}}
			}
			var out strings.Builder
			if err := r.relay(c, &out).Run("ADD", r.add("web")); err != nil {
				t.Fatalf("ADD: %v", err)
			}
			if n := len(r.agent.applied()); n != 1 {
				t.Fatalf("the agent applied %d plans, want 1", n)
			}
			if c != nil && len(c.prepared) != 0 {
				t.Fatalf("the relay was handed rules: %+v", c.prepared)
			}
			if !strings.Contains(out.String(), `"10.1.0.2/24"`) {
				t.Fatalf("the relay did not print the previous result: %q", out.String())
			}
		})
	}
}
