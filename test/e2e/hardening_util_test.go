package e2e

import (
	"bufio"
	"bytes"
	"context"
	"encoding/binary"
	"encoding/json"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/containernetworking/cni/libcni"
	"golang.org/x/sys/unix"

	"github.com/istio-cni-go/istio-cni/internal/install"
	"github.com/istio-cni-go/istio-cni/internal/testenv"
)

// agentNode is an agent started for the test node on a ptp primary
// config; pods go through the chain the agent installed, as a runtime
// would run it.
type agentNode struct {
	*host
	cni *libcni.CNIConfig
}

// startAgentNode starts the agent for the test node with the given flags
// and waits until it is ready. Rewrites in these tests come from the
// tests themselves, not from a fight: no conflict back-off.
func startAgentNode(t *testing.T, subnet string, flags ...string) *agentNode {
	t.Helper()
	h := ptpHost(t, subnet)
	// The tests count the ADDs the agent served: a relay with no record
	// waits for it however loaded the machine is (TestAgentBehindRelayLeaves
	// has the relay leave a slow agent).
	h.start(append([]string{"--kubernetes-node-name", testenv.NodeName, "--conflict-limit", "100000", "--cni-agent-wait=0"}, flags...)...)
	h.waitReadyz(200, 20*time.Second)
	return &agentNode{host: h, cni: libcni.NewCNIConfigWithCacheDir([]string{h.BinDir}, t.TempDir(), nil)}
}

// list is the node's installed chain.
func (n *agentNode) list() *libcni.NetworkConfigList {
	n.t.Helper()
	primary, _, err := install.FindPrimary(n.NetDir, "")
	if err != nil {
		n.t.Fatal(err)
	}
	l, err := libcni.ConfListFromFile(primary)
	if err != nil {
		n.t.Fatal(err)
	}
	return l
}

// sandbox creates the pod object and its network namespace (no ADD yet).
func (n *agentNode) sandbox(spec testenv.PodSpec) *testenv.Pod {
	n.t.Helper()
	seq := podSeq.Add(1)
	spec.Namespace = testNS
	if spec.Name == "" {
		spec.Name = fmt.Sprintf("hpod-%d", seq)
	}
	p, err := createPod(n.t, spec)
	if err != nil {
		n.t.Fatal(err)
	}
	pod, err := testenv.NewPod(testNS, spec.Name, string(p.UID), fmt.Sprintf("h%063d", seq))
	if err != nil {
		n.t.Fatal(err)
	}
	n.t.Cleanup(pod.Close)
	return pod
}

// add runs the chain's ADD for pod within limit, as a runtime with a
// deadline would (the plugin processes are killed when it passes).
func (n *agentNode) add(pod *testenv.Pod, limit time.Duration) error {
	ctx, cancel := context.WithTimeout(context.Background(), limit)
	defer cancel()
	l := n.list()
	_, err := n.cni.AddNetworkList(ctx, l, pod.RT)
	n.t.Cleanup(func() { _ = n.cni.DelNetworkList(context.Background(), l, pod.RT) })
	return err
}

// served is how many commands of kind cmd the agent ran itself.
func (n *agentNode) served(cmd string) int {
	n.t.Helper()
	return metricValue(n.t, n.metric(`istio_cni_plugin_commands_total{command="`+cmd+`",result="ok"}`))
}

// servedReaching waits up to 10 s for the agent to count want commands of
// kind cmd and returns its count: the relay's ADD returns once it has
// committed, and the agent counts the command when it has read the
// relay's report, a moment later.
func (n *agentNode) servedReaching(cmd string, want int) int {
	n.t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for {
		got := n.served(cmd)
		if got >= want || time.Now().After(deadline) {
			return got
		}
		time.Sleep(20 * time.Millisecond) // polling the agent's metrics, bounded
	}
}

func metricValue(t *testing.T, line string) int {
	t.Helper()
	if line == "" {
		return 0
	}
	v, err := strconv.ParseFloat(line[strings.LastIndex(line, " ")+1:], 64)
	if err != nil {
		t.Fatalf("metric line %q: %v", line, err)
	}
	return int(v)
}

// openFDs counts the descriptors process pid holds.
func openFDs(t *testing.T, pid int) int {
	t.Helper()
	entries, err := os.ReadDir(fmt.Sprintf("/proc/%d/fd", pid))
	if err != nil {
		t.Fatal(err)
	}
	return len(entries)
}

// lowestFreeFD is the descriptor number process pid would get next: a
// soft RLIMIT_NOFILE at or below it makes every new descriptor fail with
// EMFILE, whatever the open count (the limit is on numbers, and new
// descriptors fill holes first).
func lowestFreeFD(t *testing.T, pid int) int {
	t.Helper()
	entries, err := os.ReadDir(fmt.Sprintf("/proc/%d/fd", pid))
	if err != nil {
		t.Fatal(err)
	}
	used := map[int]bool{}
	for _, e := range entries {
		if n, err := strconv.Atoi(e.Name()); err == nil {
			used[n] = true
		}
	}
	n := 0
	for used[n] {
		n++
	}
	return n
}

// setFDLimit sets the soft RLIMIT_NOFILE of process pid and returns a
// function that restores the old limits.
func setFDLimit(t *testing.T, pid int, soft uint64) func() {
	t.Helper()
	var old unix.Rlimit
	if err := unix.Prlimit(pid, unix.RLIMIT_NOFILE, nil, &old); err != nil {
		t.Fatal(err)
	}
	lim := unix.Rlimit{Cur: soft, Max: old.Max}
	if err := unix.Prlimit(pid, unix.RLIMIT_NOFILE, &lim, nil); err != nil {
		t.Fatal(err)
	}
	return func() {
		if err := unix.Prlimit(pid, unix.RLIMIT_NOFILE, &old, nil); err != nil {
			t.Error(err)
		}
	}
}

// keepAlive is an HTTP client on one kept-alive connection to the agent's
// health port, so it can still ask while the agent has no descriptor left
// for a new connection.
func keepAlive(t *testing.T, port int) func(path string) (int, string) {
	t.Helper()
	var once sync.Once
	var conn net.Conn
	tr := &http.Transport{MaxConnsPerHost: 1, MaxIdleConnsPerHost: 1, IdleConnTimeout: time.Hour,
		DialContext: func(ctx context.Context, network, addr string) (net.Conn, error) {
			err := fmt.Errorf("the kept-alive connection to the health port was closed")
			once.Do(func() {
				var d net.Dialer
				conn, err = d.DialContext(ctx, network, addr)
			})
			return conn, err
		}}
	c := &http.Client{Transport: tr, Timeout: 5 * time.Second}
	t.Cleanup(tr.CloseIdleConnections)
	return func(path string) (int, string) {
		resp, err := c.Get(fmt.Sprintf("http://127.0.0.1:%d%s", port, path))
		if err != nil {
			t.Fatalf("GET %s on the kept-alive connection: %v", path, err)
		}
		defer resp.Body.Close()
		b, _ := io.ReadAll(resp.Body)
		return resp.StatusCode, string(b)
	}
}

// pollStatus asks get(path) until it answers want, bounded by limit.
func pollStatus(t *testing.T, get func(string) (int, string), path string, want int, limit time.Duration) string {
	t.Helper()
	deadline := time.Now().Add(limit)
	for {
		code, body := get(path)
		if code == want {
			return body
		}
		if time.Now().After(deadline) {
			t.Fatalf("%s answers %d (%q), want %d within %s", path, code, body, want, limit)
		}
		time.Sleep(20 * time.Millisecond) // polling an outside process
	}
}

// waitLog polls an outside process's log until it holds s.
func (h *host) waitLog(s string, limit time.Duration) {
	h.t.Helper()
	deadline := time.Now().Add(limit)
	for !strings.Contains(h.LogText(), s) {
		if time.Now().After(deadline) {
			h.t.Fatalf("agent log has no %q after %s", s, limit)
		}
		select {
		case <-h.Done():
			h.t.Fatalf("agent exited while waiting for %q", s)
		case <-time.After(20 * time.Millisecond): // polling an outside process
		}
	}
}

// The attacker: this test binary started again in a user namespace of its
// own, where it is root but which maps its uid 0 to an unprivileged host
// uid, as a container's root without host privileges is.
const (
	attackerEnv     = "ISTIO_CNI_HARDENING_ATTACKER"
	attackerHostUID = 100000
)

func init() {
	if os.Getenv(attackerEnv) != "" {
		os.Exit(attack(os.Getenv(attackerEnv)))
	}
}

var attackerBin struct {
	once sync.Once
	path string
	err  error
}

// runAttacker runs the attacker's action against runDir and returns its
// report lines ("key value"). The binary is copied where an unprivileged
// uid can execute it.
func runAttacker(t *testing.T, action, runDir string, extraEnv ...string) map[string]string {
	t.Helper()
	cmd := attackerCmd(t, action, runDir, extraEnv...)
	out, err := cmd.CombinedOutput()
	if err != nil {
		t.Fatalf("attacker %s: %v\n%s", action, err, out)
	}
	return parseReport(out)
}

func attackerCmd(t *testing.T, action, runDir string, extraEnv ...string) *exec.Cmd {
	t.Helper()
	attackerBin.once.Do(func() {
		attackerBin.path = filepath.Join(workDir, "attacker")
		src, err := os.ReadFile(os.Args[0])
		if err == nil {
			err = os.WriteFile(attackerBin.path, src, 0o755)
		}
		attackerBin.err = err
	})
	if attackerBin.err != nil {
		t.Fatal(attackerBin.err)
	}
	cmd := exec.Command(attackerBin.path)
	cmd.Env = append([]string{attackerEnv + "=" + action, "ATTACK_RUN_DIR=" + runDir}, extraEnv...)
	// Creating the user namespace does not change who the process is; the
	// setuid(0) inside it (Credential) makes it host uid 100000.
	cmd.SysProcAttr = &syscall.SysProcAttr{Cloneflags: syscall.CLONE_NEWUSER,
		UidMappings: []syscall.SysProcIDMap{{ContainerID: 0, HostID: attackerHostUID, Size: 1}},
		GidMappings: []syscall.SysProcIDMap{{ContainerID: 0, HostID: attackerHostUID, Size: 1}},
		Credential:  &syscall.Credential{Uid: 0, Gid: 0, NoSetGroups: true}}
	return cmd
}

func parseReport(out []byte) map[string]string {
	rep := map[string]string{}
	sc := bufio.NewScanner(bytes.NewReader(out))
	for sc.Scan() {
		if k, v, ok := strings.Cut(sc.Text(), " "); ok && strings.HasPrefix(k, "R:") {
			rep[strings.TrimPrefix(k, "R:")] = v
		}
	}
	return rep
}

// makeTraversable opens the directories above path to everyone, as the
// host's /var/run is: the sockets' own modes must be what keeps others out.
func makeTraversable(t *testing.T, path string) {
	t.Helper()
	for d := filepath.Dir(path); d != "/" && d != "."; d = filepath.Dir(d) {
		fi, err := os.Stat(d)
		if err != nil {
			t.Fatal(err)
		}
		// The sticky and set-id bits stay: the walk reaches the
		// machine's /tmp, whose sticky bit every user relies on.
		mode := fi.Mode() & (os.ModePerm | os.ModeSticky | os.ModeSetuid | os.ModeSetgid)
		if mode&0o011 == 0o011 {
			continue
		}
		if err := os.Chmod(d, mode|0o011); err != nil {
			t.Fatal(err)
		}
	}
}

// attack runs in the attacker process and prints "R:<key> <value>" lines.
func attack(action string) int {
	dir := os.Getenv("ATTACK_RUN_DIR")
	report := func(k string, v any) { fmt.Printf("R:%s %v\n", k, v) }
	dial := func(name string) (net.Conn, error) {
		return net.DialTimeout("unix", filepath.Join(dir, name), 2*time.Second)
	}
	// answer says what the server did with a request: "closed" when the
	// connection ended without a byte, else what came back.
	answer := func(c net.Conn, req []byte) string {
		defer c.Close()
		_ = c.SetDeadline(time.Now().Add(5 * time.Second))
		if _, err := c.Write(req); err != nil {
			return "closed"
		}
		if uc, ok := c.(*net.UnixConn); ok {
			_ = uc.CloseWrite()
		}
		b, _ := io.ReadAll(c)
		if len(b) == 0 {
			return "closed"
		}
		return strconv.Quote(string(b))
	}
	switch action {
	case "whoami":
		m, _ := os.ReadFile("/proc/self/uid_map")
		st, _ := os.ReadFile("/proc/self/status")
		report("uid", os.Getuid())
		report("map", strings.Join(strings.Fields(string(m)), ","))
		for _, l := range strings.Split(string(st), "\n") {
			if strings.HasPrefix(l, "Uid:") || strings.HasPrefix(l, "CapEff:") {
				report(strings.TrimSuffix(strings.Fields(l)[0], ":"), strings.Join(strings.Fields(l)[1:], ","))
			}
		}
	case "connect":
		for _, name := range []string{"cni.sock", "agent.sock", "log.sock"} {
			c, err := dial(name)
			if err != nil {
				report(name, "refused:"+strings.ReplaceAll(err.Error(), " ", "_"))
				continue
			}
			c.Close()
			report(name, "connected")
		}
	case "forge":
		line, _ := json.Marshal([]string{`{"level":"info","msg":"redirect rules programmed","pod":"` + os.Getenv("ATTACK_POD") + `","forged":"yes"}`})
		req := fmt.Sprintf("POST /log HTTP/1.1\r\nHost: unix\r\nContent-Type: application/json\r\nContent-Length: %d\r\nConnection: close\r\n\r\n%s", len(line), line)
		c, err := dial("log.sock")
		if err != nil {
			report("log", "refused")
			break
		}
		report("log", answer(c, []byte(req)))
	case "read-pod":
		ns, name, _ := strings.Cut(os.Getenv("ATTACK_POD"), "/")
		c, err := dial("agent.sock")
		if err != nil {
			report("agent", "refused")
			break
		}
		report("agent", answer(c, []byte("GET /pod?namespace="+ns+"&name="+name+" HTTP/1.1\r\nHost: agent\r\nConnection: close\r\n\r\n")))
	case "cni":
		body := []byte(`{"command":"DEL","containerID":"x","ifName":"eth0","args":"","path":"","stdin":null}`)
		var hdr [4]byte
		binary.BigEndian.PutUint32(hdr[:], uint32(len(body)))
		c, err := dial("cni.sock")
		if err != nil {
			report("cni", "refused")
			break
		}
		report("cni", answer(c, append(hdr[:], body...)))
	case "hold":
		// Connections that never send a byte, held until stdin closes.
		n, _ := strconv.Atoi(os.Getenv("ATTACK_CONNS"))
		var held []net.Conn
		for _, name := range []string{"cni.sock", "agent.sock", "log.sock"} {
			for i := 0; i < n; i++ {
				if c, err := dial(name); err == nil {
					held = append(held, c)
				}
			}
		}
		report("held", len(held))
		_, _ = io.Copy(io.Discard, os.Stdin)
		for _, c := range held {
			c.Close()
		}
	default:
		fmt.Fprintln(os.Stderr, "unknown attack", action)
		return 2
	}
	return 0
}
