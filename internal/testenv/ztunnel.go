package testenv

import (
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"syscall"
	"time"

	"github.com/istio-cni-go/istio-cni/internal/ztunnelsim"
)

// ZtunnelSocketDir is where the chart's agent serves ztunnel (ZDS) in
// ambient mode: the host path it mounts at /var/run/ztunnel.
const ZtunnelSocketDir = "/var/run/ztunnel"

// ZtunnelStandin is test/ztunnel-standin running as a process of the
// node (in the test's namespaces, where the kubelet runs), as ztunnel's
// in-pod manager runs next to the agent: it connects to the agent's ZDS
// socket and binds ztunnel's listeners in each pod it is handed.
type ZtunnelStandin struct {
	// StatePath is the stand-in's account of what it has seen
	// (ztunnelsim.State as JSON); LogPath its stderr.
	StatePath, LogPath string
	cmd                *exec.Cmd
	done               chan struct{}
}

// BuildZtunnelStandin compiles ./test/ztunnel-standin into dir and
// returns its path.
func BuildZtunnelStandin(dir string) (string, error) {
	root, err := RepoRoot()
	if err != nil {
		return "", err
	}
	out := filepath.Join(dir, "ztunnel-standin")
	cmd := exec.Command("go", "build", "-trimpath", "-o", out, "./test/ztunnel-standin")
	cmd.Dir, cmd.Env = root, append(os.Environ(), "CGO_ENABLED=0")
	if b, err := cmd.CombinedOutput(); err != nil {
		return "", fmt.Errorf("building the stand-in ztunnel: %w: %s", err, b)
	}
	return out, nil
}

// StartZtunnelStandin starts the stand-in built by BuildZtunnelStandin,
// connecting (and reconnecting) to socket; its state and log go into
// dir. It dies with the test process.
func StartZtunnelStandin(bin, dir, socket string) (*ZtunnelStandin, error) {
	z := &ZtunnelStandin{StatePath: filepath.Join(dir, "ztunnel-state.json"), LogPath: filepath.Join(dir, "ztunnel.log"),
		done: make(chan struct{})}
	logf, err := os.Create(z.LogPath)
	if err != nil {
		return nil, err
	}
	defer logf.Close()
	z.cmd = exec.Command(bin, "--socket", socket, "--state", z.StatePath)
	z.cmd.Stdout, z.cmd.Stderr = logf, logf
	z.cmd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
	if err := startOnLongLivedThread(z.cmd); err != nil {
		return nil, fmt.Errorf("starting the stand-in ztunnel: %w", err)
	}
	go func() { _ = z.cmd.Wait(); close(z.done) }()
	return z, nil
}

// State reads the stand-in's latest state; before its first change it
// is the zero State.
func (z *ZtunnelStandin) State() (ztunnelsim.State, error) {
	var st ztunnelsim.State
	b, err := os.ReadFile(z.StatePath)
	if errors.Is(err, os.ErrNotExist) {
		return st, nil
	}
	if err != nil {
		return st, err
	}
	err = json.Unmarshal(b, &st)
	return st, err
}

// Log returns the stand-in's log so far.
func (z *ZtunnelStandin) Log() string {
	b, _ := os.ReadFile(z.LogPath)
	return string(b)
}

// Exited reports whether the process has ended.
func (z *ZtunnelStandin) Exited() bool {
	select {
	case <-z.done:
		return true
	default:
		return false
	}
}

// Stop sends SIGTERM and waits for the stand-in to close its proxies and
// exit, killing it after limit.
func (z *ZtunnelStandin) Stop(limit time.Duration) {
	_ = z.cmd.Process.Signal(syscall.SIGTERM)
	select {
	case <-z.done:
	case <-time.After(limit):
		_ = z.cmd.Process.Kill()
		<-z.done
	}
}
