package e2e

import (
	"bufio"
	"context"
	"fmt"
	"io"
	"net"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/containernetworking/cni/libcni"

	"github.com/istio-cni-go/istio-cni/internal/podinfo"
	"github.com/istio-cni-go/istio-cni/internal/testenv"
)

var agentSockets = []string{"cni.sock", "agent.sock", "log.sock"}

// TestHardeningSocketsRefuseOthers: an unprivileged user (root in a user
// namespace of its own, as a container's root is) can neither reach the
// agent's sockets through their modes nor, when a socket's mode has been
// loosened, forge plugin log lines, read pods from the agent's cache or
// hold connections: the agent checks the peer's uid and closes at once.
func TestHardeningSocketsRefuseOthers(t *testing.T) {
	ensureDaemonSet(t, false)
	n := startAgentNode(t, "10.241.1.0/24")
	makeTraversable(t, filepath.Join(n.RunDir, "cni.sock"))
	for _, name := range agentSockets {
		fi, err := os.Stat(filepath.Join(n.RunDir, name))
		if err != nil {
			t.Fatal(err)
		}
		if fi.Mode().Perm() != 0o600 {
			t.Errorf("%s has mode %o, want 0600", name, fi.Mode().Perm())
		}
	}
	// A pod whose proxy's environment carries a secret, in the agent's cache.
	const secret = "s3cr3t-token-value"
	victim := "victim-" + strings.ToLower(t.Name()[len(t.Name())-6:])
	if _, err := createPod(t, testenv.PodSpec{Namespace: testNS, Name: victim, Sidecar: true,
		ProxyEnv: map[string]string{"API_TOKEN": secret}}); err != nil {
		t.Fatal(err)
	}
	root := podinfo.NewAgentClient(filepath.Join(n.RunDir, podinfo.AgentSocketName), time.Second)
	deadline := time.Now().Add(10 * time.Second)
	for { // the informer sees the pod shortly after it is created
		if _, err := root.GetPod(context.Background(), testNS, victim); err == nil {
			break
		} else if time.Now().After(deadline) {
			t.Fatalf("the agent's cache never served the pod to root: %v", err)
		}
		time.Sleep(20 * time.Millisecond) // polling an outside process
	}
	pod := "ATTACK_POD=" + testNS + "/" + victim
	// The attacker is root in its own user namespace, and nobody outside.
	if who := runAttacker(t, "whoami", n.RunDir); who["Uid"] != "0,0,0,0" || who["map"] != "0,100000,1" {
		t.Fatalf("the attacker is not root in a user namespace mapped to uid %d: %v", attackerHostUID, who)
	}

	t.Run("modes", func(t *testing.T) {
		rep := runAttacker(t, "connect", n.RunDir)
		for _, name := range agentSockets {
			if !strings.HasPrefix(rep[name], "refused:") || !strings.Contains(rep[name], "permission_denied") {
				t.Errorf("unprivileged connect to %s: %q, want permission denied", name, rep[name])
			}
		}
	})

	// A runtime's umask or an operator's chmod loosened the modes: the
	// peer check alone must keep the attacker out.
	for _, name := range agentSockets {
		if err := os.Chmod(filepath.Join(n.RunDir, name), 0o666); err != nil {
			t.Fatal(err)
		}
	}
	t.Run("peer-check", func(t *testing.T) {
		if rep := runAttacker(t, "forge", n.RunDir, pod); rep["log"] != "closed" {
			t.Errorf("log.sock answered an unprivileged peer: %s", rep["log"])
		}
		if rep := runAttacker(t, "read-pod", n.RunDir, pod); rep["agent"] != "closed" {
			t.Errorf("agent.sock answered an unprivileged peer: %s", rep["agent"])
		}
		if rep := runAttacker(t, "cni", n.RunDir); rep["cni"] != "closed" {
			t.Errorf("cni.sock answered an unprivileged peer: %s", rep["cni"])
		}
		// The agent's own line about the refusal carries the attacker's
		// host uid, and nothing the attacker sent.
		n.waitLog("100000", 5*time.Second)
		if strings.Contains(n.LogText(), `"forged"`) {
			t.Fatalf("a forged plugin line reached the agent's output:\n%s", n.LogText())
		}
		if m := n.metric(`istio_cni_socket_connections_rejected_total{reason="peer",socket="log.sock"}`); metricValue(t, m) == 0 {
			t.Errorf("rejections not counted: %q", m)
		}
	})

	t.Run("held-connections", func(t *testing.T) {
		base := openFDs(t, n.Pid())
		cmd := attackerCmd(t, "hold", n.RunDir, "ATTACK_CONNS=200")
		stdin, err := cmd.StdinPipe()
		if err != nil {
			t.Fatal(err)
		}
		out, err := cmd.StdoutPipe()
		if err != nil {
			t.Fatal(err)
		}
		if err := cmd.Start(); err != nil {
			t.Fatal(err)
		}
		defer func() { _ = stdin.Close(); _ = cmd.Wait() }()
		line := make([]byte, 64)
		k, _ := io.ReadAtLeast(out, line, 1)
		if !strings.HasPrefix(string(line[:k]), "R:held ") {
			t.Fatalf("attacker: %q", line[:k])
		}
		// The agent closes each connection as soon as it sees who it is
		// from, long before any read timeout would.
		deadline := time.Now().Add(2 * time.Second)
		for openFDs(t, n.Pid()) > base+20 {
			if time.Now().After(deadline) {
				t.Fatalf("the agent holds %d descriptors with the attacker's connections open, %d before", openFDs(t, n.Pid()), base)
			}
			time.Sleep(20 * time.Millisecond) // polling an outside process
		}
		before := n.served("ADD")
		p := n.sandbox(testenv.PodSpec{Sidecar: true})
		if err := n.add(p, 20*time.Second); err != nil {
			t.Fatalf("ADD while the attacker holds connections: %v", err)
		}
		if got := n.servedReaching("ADD", before+1); got != before+1 {
			t.Fatalf("the agent served %d ADDs, want %d", got, before+1)
		}
	})
}

// TestHardeningSlowClients: 200 connections to each socket that never send
// a byte, from root, with the agent's descriptors limited: the agent keeps
// a bounded number of them, closes them when they stay silent, and a
// relay's ADD is still served by the agent meanwhile.
func TestHardeningSlowClients(t *testing.T) {
	ensureDaemonSet(t, false)
	n := startAgentNode(t, "10.241.2.0/24")
	base := openFDs(t, n.Pid())
	restore := setFDLimit(t, n.Pid(), uint64(lowestFreeFD(t, n.Pid())+250))
	defer restore()
	var held []net.Conn
	defer func() {
		for _, c := range held {
			c.Close()
		}
	}()
	// The CNI socket last: the others' connections use up the descriptors
	// first, as a flood on log.sock did.
	for _, name := range []string{"log.sock", "agent.sock", "cni.sock"} {
		for i := 0; i < 200; i++ {
			c, err := net.DialTimeout("unix", filepath.Join(n.RunDir, name), 2*time.Second)
			if err != nil {
				t.Fatalf("connection %d to %s: %v", i, name, err)
			}
			held = append(held, c)
		}
	}
	p := n.sandbox(testenv.PodSpec{Sidecar: true})
	before := n.served("ADD")
	if err := n.add(p, 20*time.Second); err != nil {
		t.Fatalf("ADD with 600 silent connections open: %v", err)
	}
	if got := n.servedReaching("ADD", before+1); got != before+1 {
		t.Fatalf("the agent served %d ADDs, want %d: a silent client cost more than its own connection", got, before+1)
	}
	if got := openFDs(t, n.Pid()); got > base+230 {
		t.Fatalf("the agent holds %d descriptors, %d before the silent connections", got, base)
	}
	// Every silent connection is closed by the agent: at once past the
	// limit, else when its read timeout passes.
	for i, c := range held {
		_ = c.SetReadDeadline(time.Now().Add(20 * time.Second))
		if _, err := c.Read(make([]byte, 1)); err == nil || os.IsTimeout(err) {
			t.Fatalf("silent connection %d still open after 20s: %v", i, err)
		}
	}
	if code, body := n.ReadyZ(); code != 200 {
		t.Fatalf("readyz %d after the silent connections: %s", code, body)
	}
}

// filler keeps the agent out of descriptors, the way many clients do: its
// soft limit is set a little above the highest descriptor it holds, and
// kept-alive connections to its health port (served without a connection
// limit) take the rest, and take again whatever the agent frees.
type filler struct {
	t     *testing.T
	n     *agentNode
	limit int
	held  []net.Conn
	undo  func()
}

func fillDescriptors(t *testing.T, n *agentNode) *filler {
	t.Helper()
	highest := 0
	entries, err := os.ReadDir(fmt.Sprintf("/proc/%d/fd", n.Pid()))
	if err != nil {
		t.Fatal(err)
	}
	for _, e := range entries {
		if v, err := strconv.Atoi(e.Name()); err == nil && v > highest {
			highest = v
		}
	}
	f := &filler{t: t, n: n, limit: highest + 30}
	f.undo = setFDLimit(t, n.Pid(), uint64(f.limit))
	// topUp stops once the agent holds its limit, which may count
	// descriptors it holds only for a moment (its start-up preparing ADDs):
	// those come back free after, so take them too until a count made
	// after topUp returned still finds the agent at its limit. A failed
	// dial ends it at once: retrying would only spin on a port that
	// does not take connections.
	deadline := time.Now().Add(15 * time.Second)
	for {
		err := f.topUp(time.Until(deadline))
		got := openFDs(t, n.Pid())
		if got >= f.limit {
			return f
		}
		if err != nil || time.Now().After(deadline) {
			f.release()
			t.Fatalf("the agent holds %d descriptors, could not bring it to its limit %d (dial: %v)", got, f.limit, err)
		}
	}
}

// topUp takes the descriptors the agent freed since. A connection the
// agent does not answer ends the attempt only once the agent holds its
// limit: it may have refused it while briefly holding more descriptors
// than it keeps (its start-up preparing ADDs, an apiserver watch), and
// those come back free a moment later.
func (f *filler) topUp(budget time.Duration) error {
	deadline := time.Now().Add(budget)
	for openFDs(f.t, f.n.Pid()) < f.limit && time.Now().Before(deadline) {
		c, err := net.DialTimeout("tcp", fmt.Sprintf("127.0.0.1:%d", f.n.ReadyPort), time.Second)
		if err != nil {
			return err
		}
		_ = c.SetDeadline(time.Now().Add(time.Second))
		if _, err := c.Write([]byte("GET /healthz HTTP/1.1\r\nHost: agent\r\n\r\n")); err != nil {
			c.Close()
			continue
		}
		if _, err := bufio.NewReader(c).ReadString('\n'); err != nil {
			// Not accepted: the agent had no descriptor left then.
			c.Close()
			continue
		}
		f.held = append(f.held, c)
	}
	return nil
}

func (f *filler) release() {
	for _, c := range f.held {
		c.Close()
	}
	f.held = nil
	if f.undo != nil {
		f.undo()
		f.undo = nil
	}
}

// TestHardeningAcceptErrors: an agent that once ran out of descriptors
// keeps serving. While accepting fails the relay gets an immediate answer
// and runs the fallback, /readyz says why and /livez fails after the grace;
// once descriptors are back the agent serves commands again.
func TestHardeningAcceptErrors(t *testing.T) {
	ensureDaemonSet(t, false)
	n := startAgentNode(t, "10.241.3.0/24", "--resync-interval", "1s")
	get := keepAlive(t, n.ReadyPort)
	pollStatus(t, get, "/readyz", 200, 10*time.Second)
	first := n.sandbox(testenv.PodSpec{Sidecar: true})

	fill := fillDescriptors(t, n)
	defer fill.release()
	start := time.Now()
	if err := n.add(first, 20*time.Second); err != nil {
		t.Fatalf("ADD while the agent has no descriptor to spare: %v", err)
	}
	t.Logf("ADD with the agent out of descriptors took %s", time.Since(start))
	if rules := rulesIn(t, first); !strings.Contains(rules, "-A ISTIO_OUTPUT") {
		t.Fatalf("no rules after the ADD the fallback served:\n%s", rules)
	}
	// A client knocking makes the agent try to accept; readiness then
	// says the socket cannot, and liveness fails once that lasts. The
	// fallback's own connections may have freed descriptors: take them.
	knock := func() {
		_ = fill.topUp(3 * time.Second)
		if c, err := net.DialTimeout("unix", filepath.Join(n.RunDir, "cni.sock"), time.Second); err == nil {
			_ = c.SetReadDeadline(time.Now().Add(5 * time.Second))
			_, _ = c.Read(make([]byte, 1))
			c.Close()
		}
	}
	// The install loop's resync may fail for want of descriptors too and
	// say so first: wait for the socket's own reason.
	until := func(path string, want int, mention string, limit time.Duration) string {
		deadline := time.Now().Add(limit)
		for {
			knock()
			code, body := get(path)
			if code == want && strings.Contains(body, mention) {
				return body
			}
			if time.Now().After(deadline) {
				t.Fatalf("%s answers %d (%q) with the agent out of descriptors, want %d naming %q", path, code, body, want, mention)
			}
		}
	}
	until("/readyz", 503, "cni.sock", 10*time.Second)
	until("/livez", 503, "", 10*time.Second)
	fill.release()

	pollStatus(t, get, "/readyz", 200, 10*time.Second)
	pollStatus(t, get, "/livez", 200, 10*time.Second)
	before := n.served("ADD")
	second := n.sandbox(testenv.PodSpec{Sidecar: true})
	if err := n.add(second, 20*time.Second); err != nil {
		t.Fatalf("ADD after descriptors are back: %v", err)
	}
	if got := n.servedReaching("ADD", before+1); got != before+1 {
		t.Fatalf("the agent served %d ADDs after recovering, want %d", got-before, 1)
	}
	if m := n.metric(`istio_cni_socket_accept_errors_total{socket="cni.sock"}`); metricValue(t, m) == 0 {
		t.Errorf("accept errors not counted: %q", m)
	}
}

// statusList is a CNI 1.1 list holding the node's istio-cni entry, as a
// runtime that calls STATUS loads it.
func statusList(t *testing.T, runDir string) *libcni.NetworkConfigList {
	t.Helper()
	l, err := libcni.ConfListFromBytes([]byte(`{"cniVersion":"1.1.0","name":"k8s-pod-network","plugins":[` +
		`{"type":"istio-cni","name":"istio-cni","cni_agent_run_dir":"` + runDir + `","pod_namespace":"istio-system","exclude_namespaces":["kube-system"]}]}`))
	if err != nil {
		t.Fatal(err)
	}
	return l
}

// TestHardeningStatus: STATUS fails only when an ADD would: never on the
// sockets a killed agent leaves, never after a reboot emptied the run dir
// (the agent's own pod, not on the host network, must start to fix it),
// and only when neither the agent nor the fallback can serve.
func TestHardeningStatus(t *testing.T) {
	ensureDaemonSet(t, true)
	n := startAgentNode(t, "10.241.4.0/24")
	status := func() error {
		return n.cni.GetStatusNetworkList(context.Background(), statusList(t, n.RunDir))
	}
	if err := status(); err != nil {
		t.Fatalf("STATUS with the agent running: %v", err)
	}
	n.Kill()
	for _, name := range agentSockets {
		if _, err := os.Stat(filepath.Join(n.RunDir, name)); err != nil {
			t.Fatalf("a SIGKILLed agent left no %s (the case to test): %v", name, err)
		}
	}
	if err := status(); err != nil {
		t.Fatalf("STATUS with a killed agent's sockets left, fallback present: %v", err)
	}
	// The fallback run on its own (not through the relay) agrees: it
	// serves ADD itself, whatever sockets are left.
	fallback := filepath.Join(filepath.Dir(pluginBin), testenv.FallbackBinary)
	conf := []byte(`{"cniVersion":"1.1.0","name":"k8s-pod-network","type":"istio-cni","cni_agent_run_dir":"` + n.RunDir + `"}`)
	if res, _ := execPluginAt(t, fallback, "STATUS", "", "", conf); res != nil {
		t.Fatalf("the fallback's own STATUS with a killed agent's sockets left: %v", res)
	}
	p := n.sandbox(testenv.PodSpec{Sidecar: true})
	if err := n.add(p, 20*time.Second); err != nil {
		t.Fatalf("ADD through the fallback: %v", err)
	}

	// After a reboot: the run dir is a tmpfs, empty; binaries and config
	// are still on disk.
	entries, _ := os.ReadDir(n.RunDir)
	for _, e := range entries {
		if err := os.RemoveAll(filepath.Join(n.RunDir, e.Name())); err != nil {
			t.Fatal(err)
		}
	}
	if err := status(); err != nil {
		t.Fatalf("STATUS after a reboot (no agent yet, no kubeconfig): %v", err)
	}
	// The agent's own pod needs no lookup: no pod object, no kubeconfig.
	own, err := testenv.NewPod("istio-system", "istio-cni-node-x7k2p", "6b1c0e4e-0000-4000-8000-000000000001", "cagentpodafterreboot")
	if err != nil {
		t.Fatal(err)
	}
	defer own.Close()
	if err := n.add(own, 20*time.Second); err != nil {
		t.Fatalf("the agent's own pod after a reboot: %v", err)
	}

	// The relay alone, no agent: nothing can serve an ADD.
	if err := os.Remove(filepath.Join(n.BinDir, testenv.FallbackBinary)); err != nil {
		t.Fatal(err)
	}
	err = status()
	if err == nil || !strings.Contains(err.Error(), testenv.FallbackBinary) {
		t.Fatalf("STATUS with neither agent nor fallback: %v, want a failure naming %s", err, testenv.FallbackBinary)
	}
}

// TestHardeningSocketsRemovedOnExit: a clean stop leaves no socket behind,
// every time.
func TestHardeningSocketsRemovedOnExit(t *testing.T) {
	ensureDaemonSet(t, true)
	h := ptpHost(t, "10.241.5.0/24")
	for i := 0; i < 30; i++ {
		h.start("--kubernetes-node-name", testenv.NodeName)
		h.waitReadyz(200, 20*time.Second)
		if code := h.stop(syscall.SIGTERM); code != 0 {
			t.Fatalf("exit %d", code)
		}
		for _, name := range agentSockets {
			if _, err := os.Lstat(filepath.Join(h.RunDir, name)); err == nil {
				t.Fatalf("stop %d: %s left behind", i, name)
			}
		}
	}
}
