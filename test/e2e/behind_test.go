package e2e

import (
	"net"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/containernetworking/cni/libcni"

	"github.com/istio-cni-go/istio-cni/internal/prepared"
	"github.com/istio-cni-go/istio-cni/internal/testenv"
)

// TestAgentBehindRelayLeaves: an agent with its default settings that
// does not answer an ADD it had no record for (stopped here, as an agent
// starved of CPU on a busy node is for a while) is left by the relay
// after the agent's wait, and the fallback serves the pod: it reads the
// pod from the API server and programs its rules, and traffic is
// redirected. The agent, resumed, finds the relay gone: it writes nothing
// to the pod's namespace and counts the ADD as left. The fallback's lines
// reach the agent's log, with why it ran.
func TestAgentBehindRelayLeaves(t *testing.T) {
	h := ptpHost(t, "10.241.13.0/24")
	h.start("--kubernetes-node-name", testenv.NodeName)
	h.waitReadyz(200, 20*time.Second)
	n := &agentNode{host: h, cni: libcni.NewCNIConfigWithCacheDir([]string{h.BinDir}, t.TempDir(), nil)}
	dir := filepath.Join(h.RunDir, prepared.DirName)
	if w := prepared.AgentWait(dir); w != 25*time.Millisecond {
		t.Fatalf("the agent's wait for relays is %s, want the default 25ms", w)
	}
	// Two pods through the agent: it learns the node's config, as it
	// does before it prepares anything.
	for range 2 {
		if err := n.add(n.sandbox(testenv.PodSpec{Sidecar: true}), 30*time.Second); err != nil {
			t.Fatalf("ADD through the agent: %v", err)
		}
	}
	// The agent prepares its first plan while the first relays wait, and
	// on a loaded machine may answer one after the relay's 25 ms and count
	// it as left: wait until it is done with both (its plan stored), and
	// count the stopped pod's ADD from there.
	const okADDs = `istio_cni_plugin_commands_total{command="ADD",result="ok"}`
	const leftADDs = `istio_cni_plugin_commands_total{command="ADD",result="left"}`
	for deadline := time.Now().Add(20 * time.Second); h.metricCount(t, okADDs)+h.metricCount(t, leftADDs) < 2; {
		if time.Now().After(deadline) {
			t.Fatalf("the agent counted %d ADDs served and %d left of the first two", h.metricCount(t, okADDs), h.metricCount(t, leftADDs))
		}
		time.Sleep(10 * time.Millisecond) // polling an outside process, bounded
	}
	left := h.metricCount(t, leftADDs)

	h.Signal(syscall.SIGSTOP)
	stopped := true
	t.Cleanup(func() {
		if stopped {
			h.Signal(syscall.SIGCONT)
		}
	})
	pod := n.sandbox(testenv.PodSpec{Sidecar: true})
	start := time.Now()
	if err := n.add(pod, time.Minute); err != nil {
		t.Fatalf("ADD with the agent stopped: %v", err)
	}
	t.Logf("ADD with the agent stopped took %s", time.Since(start))
	expectRedirect(t, pod, "tcp4", "0.0.0.0:15001", ap(testenv.RemoteV4+":80"), func() (net.Conn, error) {
		return testenv.Dial(pod, "tcp4", testenv.RemoteV4+":80")
	})
	rules := sameRulesIn(t, pod)

	h.Signal(syscall.SIGCONT)
	stopped = false
	h.waitMetric(leftADDs, strconv.Itoa(left+1), 20*time.Second)
	if got := sameRulesIn(t, pod); got != rules {
		t.Fatalf("the pod's rules changed once the agent resumed:\nbefore:\n%s\nafter:\n%s", rules, got)
	}
	logs := h.WaitLog(10*time.Second, testenv.LogLine("served without the node agent", testNS+"/"+pod.Name))
	if !strings.Contains(logs, "node agent behind: no answer within 25ms") {
		t.Fatalf("the fallback's line does not say why it ran:\n%s", logs)
	}
	// Its ADD line carries what its process spent (children included),
	// as the agent's lines carry a relay's.
	logs = h.WaitLog(10*time.Second, testenv.LogLine("redirect rules programmed", `"fallback":true`, testNS+"/"+pod.Name))
	var cpu, line string
	for _, l := range strings.Split(logs, "\n") {
		if strings.Contains(l, "redirect rules programmed") && strings.Contains(l, `"fallback":true`) && strings.Contains(l, testNS+"/"+pod.Name) {
			line = l
			if m := regexp.MustCompile(`"plugin_cpu":"([^"]+)"`).FindStringSubmatch(l); m != nil {
				cpu = m[1]
			}
		}
	}
	if d, err := time.ParseDuration(cpu); err != nil || d <= 0 {
		t.Fatalf("the fallback's plugin_cpu %q (%v), want a positive duration:\n%s", cpu, err, logs)
	}
	// The agent prepared this plan for the first pod and stored it: the
	// fallback sent those requests and ran no iptables-restore (the
	// rules' arrival and contents are asserted above).
	if !strings.Contains(line, `"stored_plan":true`) {
		t.Fatalf("the fallback did not send the agent's stored plan:\n%s", line)
	}
	t.Logf("the fallback's process CPU for the ADD: %s", cpu)
}
