package testenv

import (
	"context"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"time"
)

// AgentHost is a simulated node file system for the install-cni agent:
// host CNI config and bin dirs, the run dir and a service account mount.
type AgentHost struct {
	NetDir, BinDir, RunDir, SADir, SrcDir string
	ReadyPort, MetricsPort                int
	Log                                   *os.File
	cluster                               *Cluster
	cmd                                   *exec.Cmd
	done                                  chan struct{}
}

// NewAgentHost lays out the dirs under dir, with the plugin binary as the
// image's /opt/cni/bin and a service account token for the plugin.
func NewAgentHost(ctx context.Context, dir string, c *Cluster, pluginBin string) (*AgentHost, error) {
	h := &AgentHost{NetDir: filepath.Join(dir, "etc-cni-net.d"), BinDir: filepath.Join(dir, "opt-cni-bin"),
		RunDir: filepath.Join(dir, "run"), SADir: filepath.Join(dir, "sa"), SrcDir: filepath.Join(dir, "image-opt-cni-bin"), cluster: c}
	for _, d := range []string{h.NetDir, h.BinDir, h.SADir, h.SrcDir} {
		if err := os.MkdirAll(d, 0o755); err != nil {
			return nil, err
		}
	}
	if err := linkPlugin(pluginBin, h.SrcDir); err != nil {
		return nil, err
	}
	if _, err := h.RotateToken(ctx); err != nil {
		return nil, err
	}
	ports, err := freePorts(2)
	if err != nil {
		return nil, err
	}
	h.ReadyPort, h.MetricsPort = ports[0], ports[1]
	h.Log, err = os.Create(filepath.Join(dir, "agent.log"))
	return h, err
}

// RotateToken mints a fresh plugin token and swaps it in the way the
// kubelet updates a projected volume: a new timestamped dir and an atomic
// rename of the ..data link. It returns the new token.
func (h *AgentHost) RotateToken(ctx context.Context) (string, error) {
	tok, err := h.cluster.PluginToken(ctx)
	if err != nil {
		return "", err
	}
	ca, err := os.ReadFile(h.cluster.CAFile)
	if err != nil {
		return "", err
	}
	ts := filepath.Join(h.SADir, fmt.Sprintf("..%d", time.Now().UnixNano()))
	if err := os.Mkdir(ts, 0o755); err != nil {
		return "", err
	}
	for name, data := range map[string][]byte{"token": []byte(tok), "ca.crt": ca, "namespace": []byte("istio-system")} {
		if err := os.WriteFile(filepath.Join(ts, name), data, 0o644); err != nil {
			return "", err
		}
		link := filepath.Join(h.SADir, name)
		if _, err := os.Lstat(link); err != nil {
			if err := os.Symlink(filepath.Join("..data", name), link); err != nil {
				return "", err
			}
		}
	}
	tmp := filepath.Join(h.SADir, "..data_tmp")
	_ = os.Remove(tmp)
	if err := os.Symlink(filepath.Base(ts), tmp); err != nil {
		return "", err
	}
	return tok, os.Rename(tmp, filepath.Join(h.SADir, "..data"))
}

// Start runs the agent binary for this host.
func (h *AgentHost) Start(agentBin string, extra ...string) error {
	kc, host, port, err := h.apiAccess()
	if err != nil {
		return err
	}
	args := append([]string{"--mounted-cni-net-dir", h.NetDir, "--cni-bin-target-dirs", h.BinDir,
		"--cni-bin-source-dir", h.SrcDir, "--cni-agent-run-dir", h.RunDir, "--service-account-dir", h.SADir,
		"--readiness-port", strconv.Itoa(h.ReadyPort), "--monitoring-port", strconv.Itoa(h.MetricsPort),
		"--pod-namespace", "istio-system", "--exclude-namespaces", "kube-system", "--kubeconfig", kc, "--log_as_json"}, extra...)
	return h.run(agentBin, args, []string{"KUBERNETES_SERVICE_HOST=" + host, "KUBERNETES_SERVICE_PORT=" + port, "PATH=" + os.Getenv("PATH")})
}

// StartAsContainer runs the agent with exactly the arguments and
// environment a pod spec gives its container, plus what the container's
// mounts would provide: the host's dirs at the paths the DaemonSet mounts
// them (given as the environment of those settings, so the command line
// stays as rendered), the service account, and the API server's address.
func (h *AgentHost) StartAsContainer(agentBin string, args []string, env map[string]string) error {
	kc, host, port, err := h.apiAccess()
	if err != nil {
		return err
	}
	mounts := map[string]string{
		"MOUNTED_CNI_NET_DIR": h.NetDir, "CNI_BIN_TARGET_DIRS": h.BinDir, "CNI_BIN_SOURCE_DIR": h.SrcDir,
		"CNI_AGENT_RUN_DIR": h.RunDir, "SERVICE_ACCOUNT_DIR": h.SADir, "REPAIR_HOST_PROC": "/proc", "HOST_ROOT": "/",
		"READINESS_PORT": strconv.Itoa(h.ReadyPort), "MONITORING_PORT": strconv.Itoa(h.MetricsPort),
		"KUBECONFIG": kc, "KUBERNETES_SERVICE_HOST": host, "KUBERNETES_SERVICE_PORT": port, "PATH": os.Getenv("PATH"),
	}
	var environ []string
	for k, v := range env {
		if _, ok := mounts[k]; ok {
			return fmt.Errorf("the pod spec sets %s, which the test's mounts provide", k)
		}
		environ = append(environ, k+"="+v)
	}
	for k, v := range mounts {
		environ = append(environ, k+"="+v)
	}
	return h.run(agentBin, args, environ)
}

func (h *AgentHost) apiAccess() (kubeconfig, host, port string, err error) {
	kubeconfig = filepath.Join(filepath.Dir(h.NetDir), "admin.kubeconfig")
	if err := h.cluster.AdminKubeconfig(kubeconfig); err != nil {
		return "", "", "", err
	}
	host, port, _ = net.SplitHostPort(strings.TrimPrefix(h.cluster.URL, "https://"))
	return kubeconfig, host, port, nil
}

func (h *AgentHost) run(agentBin string, args, env []string) error {
	h.cmd = exec.Command(agentBin, args...)
	h.cmd.Env = env
	if err := h.Log.Truncate(0); err != nil {
		return err
	}
	if _, err := h.Log.Seek(0, 0); err != nil {
		return err
	}
	h.cmd.Stdout, h.cmd.Stderr = h.Log, h.Log
	// A group of its own, which Kill kills whole, as a container's end
	// kills every process in it. Out of the terminal's group, a Ctrl-C
	// never reaches it, so it gets SIGTERM when the test process dies
	// (forked from a thread that lives as long as the process, as the
	// death signal follows the thread).
	h.cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true, Pdeathsig: syscall.SIGTERM}
	if err := startOnLongLivedThread(h.cmd); err != nil {
		return err
	}
	h.done = make(chan struct{})
	go func() { _ = h.cmd.Wait(); close(h.done) }()
	return nil
}

// WaitReady polls /readyz (an outside process) until it answers 200.
func (h *AgentHost) WaitReady(timeout time.Duration) error {
	deadline := time.Now().Add(timeout)
	last := ""
	for time.Now().Before(deadline) {
		resp, err := http.Get(fmt.Sprintf("http://127.0.0.1:%d/readyz", h.ReadyPort))
		if err == nil {
			b, _ := io.ReadAll(resp.Body)
			_ = resp.Body.Close()
			if resp.StatusCode == http.StatusOK {
				return nil
			}
			last = strings.TrimSpace(string(b))
		}
		select {
		case <-h.done:
			return fmt.Errorf("agent exited; see %s", h.Log.Name())
		case <-time.After(20 * time.Millisecond):
		}
	}
	return fmt.Errorf("agent not ready after %s: %s", timeout, last)
}

// Metrics returns the lines of the agent's metrics that start with prefix.
func (h *AgentHost) Metrics(prefix string) ([]string, error) {
	resp, err := http.Get(fmt.Sprintf("http://127.0.0.1:%d/metrics", h.MetricsPort))
	if err != nil {
		return nil, err
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	var out []string
	for _, l := range strings.Split(string(b), "\n") {
		if strings.HasPrefix(l, prefix) {
			out = append(out, l)
		}
	}
	return out, err
}

// Stop sends SIGTERM and returns the exit code.
func (h *AgentHost) Stop(timeout time.Duration) (int, error) {
	if h.cmd == nil || h.cmd.Process == nil {
		return 0, nil
	}
	_ = h.cmd.Process.Signal(syscall.SIGTERM)
	select {
	case <-h.done:
		return h.cmd.ProcessState.ExitCode(), nil
	case <-time.After(timeout):
		h.Kill()
		return -1, fmt.Errorf("agent did not stop within %s", timeout)
	}
}

// ReadyZ returns the agent's /readyz status code and body.
func (h *AgentHost) ReadyZ() (int, string) {
	resp, err := http.Get(fmt.Sprintf("http://127.0.0.1:%d/readyz", h.ReadyPort))
	if err != nil {
		return 0, err.Error()
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	return resp.StatusCode, string(b)
}

// LogText is what the running (or last) agent has logged.
func (h *AgentHost) LogText() string {
	b, _ := os.ReadFile(h.Log.Name())
	return string(b)
}

// WaitLog waits up to limit for the agent's log to satisfy ok and returns
// it. A command's ADD returns once the relay has committed, before the
// agent has logged the relay's report, so tests about that line wait.
func (h *AgentHost) WaitLog(limit time.Duration, ok func(log string) bool) string {
	deadline := time.Now().Add(limit)
	for {
		text := h.LogText()
		if ok(text) || time.Now().After(deadline) {
			return text
		}
		time.Sleep(20 * time.Millisecond) // polling a file the agent appends to, bounded
	}
}

// LogLine is a WaitLog condition: some line holds every part.
func LogLine(parts ...string) func(string) bool {
	return func(log string) bool {
		for _, l := range strings.Split(log, "\n") {
			all := true
			for _, p := range parts {
				all = all && strings.Contains(l, p)
			}
			if all {
				return true
			}
		}
		return false
	}
}

// Done is closed when the agent process has exited.
func (h *AgentHost) Done() <-chan struct{} { return h.done }

// Pid is the agent's process id.
func (h *AgentHost) Pid() int { return h.cmd.Process.Pid }

// Signal sends sig to the agent.
func (h *AgentHost) Signal(sig syscall.Signal) { _ = h.cmd.Process.Signal(sig) }

// Kill kills the agent and waits for it.
func (h *AgentHost) Kill() {
	if h.cmd != nil && h.cmd.Process != nil {
		pgid := h.cmd.Process.Pid
		_ = syscall.Kill(-pgid, syscall.SIGKILL)
		<-h.done
		// A child the agent was starting holds a copy of every fd until
		// its exec closes them, the listening sockets included: killed
		// with the group, it lets go of them only once it has exited. An
		// agent started at once on the same ports would find them taken.
		deadline := time.Now().Add(5 * time.Second)
		for !h.portsFree() && time.Now().Before(deadline) {
			time.Sleep(time.Millisecond) // polling the ports, bounded
		}
	}
}

// portsFree says whether the agent's ports can be listened on again.
func (h *AgentHost) portsFree() bool {
	for _, port := range []int{h.ReadyPort, h.MetricsPort} {
		l, err := net.Listen("tcp", ":"+strconv.Itoa(port))
		if err != nil {
			return false
		}
		_ = l.Close()
	}
	return true
}

// ExitCode is the exit code of the agent once Done.
func (h *AgentHost) ExitCode() int { return h.cmd.ProcessState.ExitCode() }

// LogDuration is the duration an agent log line gives key, in the
// console format (key=1.5ms) or JSON ("key":"1.5ms").
func LogDuration(line, key string) (time.Duration, error) {
	for _, prefix := range []string{key + "=", `"` + key + `":"`} {
		_, rest, ok := strings.Cut(line, prefix)
		if !ok {
			continue
		}
		end := strings.IndexAny(rest, " \"")
		if end < 0 {
			end = len(rest)
		}
		return time.ParseDuration(rest[:end])
	}
	return 0, fmt.Errorf("no %s in %q", key, line)
}
