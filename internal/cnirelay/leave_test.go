package cnirelay

import (
	"bytes"
	"context"
	"io"
	"net"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/istio-cni-go/istio-cni/internal/execrun"
	"github.com/istio-cni-go/istio-cni/internal/prepared"
)

// slowAgent accepts one connection, reads the request and answers reply
// after delay; with no reply it never answers, and reports when the relay
// closed the connection (closed).
type slowAgent struct {
	runDir string
	got    chan received
	closed chan struct{}
}

func startSlowAgent(t *testing.T, reply []byte, delay time.Duration) *slowAgent {
	t.Helper()
	a := &slowAgent{runDir: t.TempDir(), got: make(chan received, 1), closed: make(chan struct{})}
	l, err := net.ListenUnix("unix", &net.UnixAddr{Name: filepath.Join(a.runDir, SocketName), Net: "unix"})
	if err != nil {
		t.Fatal(err)
	}
	done := make(chan struct{})
	t.Cleanup(func() {
		_ = l.Close()
		<-done
	})
	go func() {
		defer close(done)
		c, err := l.AcceptUnix()
		if err != nil {
			return
		}
		defer c.Close()
		a.got <- readRequest(c)
		if reply != nil {
			time.Sleep(delay) // the agent's slowness, which the test is about
			_, _ = c.Write(reply)
			_ = c.CloseWrite()
		}
		// Until the relay closes its end.
		_, _ = io.Copy(io.Discard, c)
		close(a.closed)
	}()
	return a
}

// fallbackRunner is a reasonRunner that also records whether the relay
// had closed its connection to the agent before the fallback started.
type fallbackRunner struct {
	reasonRunner
	agent        *slowAgent
	closedBefore bool
}

func (f *fallbackRunner) Run(ctx context.Context, c *execrun.Cmd) (execrun.Result, error) {
	select {
	case <-f.agent.closed:
		f.closedBefore = true
	case <-time.After(5 * time.Second):
	}
	return f.reasonRunner.Run(ctx, c)
}

// TestRelayLeavesAnAgentBehind: a relay with no record for its pod, on a
// node whose agent prepares records and set a wait, gives the agent that
// long to begin its answer, then closes the connection and runs the
// fallback, telling it not to ask the agent's pod cache either; the
// agent was told it might (MayLeave). Without the wait, a
// record of another pod, no UID, or another command, the relay waits as
// long as the agent takes.
func TestRelayLeavesAnAgentBehind(t *testing.T) {
	const uid = "0f4c1c2e-1d9a-4e53-9d61-5b1f2f3a4b5c"
	fromAgent := func(t *testing.T) []byte { return answer(t, Response{Stdout: []byte("from the agent")}) }
	for _, c := range []struct {
		name    string
		command string
		args    string
		// wait is the agent's (none: no file); noDir: the agent does not
		// prepare; record: a record of another pod under the UID.
		wait        time.Duration
		noDir       bool
		record      bool
		emptyRecord bool
		// stale: the pod's record is there, of an agent last seen two
		// minutes ago.
		stale bool
		// silent: the agent never answers; else it answers after delay.
		silent bool
		delay  time.Duration

		wantMayLeave bool
		wantOut      string
	}{
		{name: "a silent agent is left after its wait", wait: 50 * time.Millisecond, silent: true,
			wantMayLeave: true, wantOut: "from the fallback"},
		{name: "an agent that answers within its wait serves", wait: time.Minute,
			wantMayLeave: true, wantOut: "from the agent"},
		{name: "an agent that sets no wait is waited for", delay: 150 * time.Millisecond, wantOut: "from the agent"},
		{name: "an agent that does not prepare is waited for", noDir: true, delay: 150 * time.Millisecond, wantOut: "from the agent"},
		{name: "a record of another pod: the agent reads it", wait: 50 * time.Millisecond, record: true,
			delay: 150 * time.Millisecond, wantOut: "from the agent"},
		{name: "a record with no entry: the agent could not prepare", wait: 50 * time.Millisecond, emptyRecord: true,
			delay: 150 * time.Millisecond, wantOut: "from the agent"},
		{name: "a record of an agent long unseen is left after its wait", wait: 50 * time.Millisecond, stale: true, silent: true,
			wantMayLeave: true, wantOut: "from the fallback"},
		{name: "no UID", wait: 50 * time.Millisecond, args: "K8S_POD_NAMESPACE=ns;K8S_POD_NAME=p",
			delay: 150 * time.Millisecond, wantOut: "from the agent"},
		{name: "DEL", command: "DEL", wait: 50 * time.Millisecond, delay: 150 * time.Millisecond, wantOut: "from the agent"},
	} {
		t.Run(c.name, func(t *testing.T) {
			var reply []byte
			if !c.silent {
				reply = fromAgent(t)
			}
			a := startSlowAgent(t, reply, c.delay)
			dir := prepared.Dir(filepath.Join(a.runDir, prepared.DirName))
			if !c.noDir {
				if err := dir.Reset(); err != nil {
					t.Fatal(err)
				}
				if err := dir.Beat(); err != nil {
					t.Fatal(err)
				}
				if err := dir.SetAgentWait(c.wait); err != nil {
					t.Fatal(err)
				}
			}
			// The relay's clock starts when the beat is dated, so the
			// time taken before it runs cannot round into its message.
			var relayStart time.Time
			if c.stale {
				relayStart = time.Now()
				at := relayStart.Add(-2 * time.Minute)
				if err := os.Chtimes(filepath.Join(string(dir), ".agent-alive"), at, at); err != nil {
					t.Fatal(err)
				}
			}
			if c.record || c.emptyRecord || c.stale {
				name := "p"
				if c.record {
					name = "other"
				}
				if err := dir.Put(&prepared.Record{Namespace: "ns", Name: name, UID: uid}); err != nil {
					t.Fatal(err)
				}
			}
			netns := filepath.Join(t.TempDir(), "netns")
			if err := os.WriteFile(netns, nil, 0o600); err != nil {
				t.Fatal(err)
			}
			args := c.args
			if args == "" {
				args = "K8S_POD_NAMESPACE=ns;K8S_POD_NAME=p;K8S_POD_UID=" + uid
			}
			command := c.command
			if command == "" {
				command = "ADD"
			}
			fb := &fallbackRunner{agent: a}
			var out bytes.Buffer
			r := &Relay{Fallback: "/opt/cni/bin/istio-cni-fallback", Stdout: &out, Stderr: io.Discard, Timeout: time.Minute, Runner: fb, Start: relayStart}
			stdin := `{"cniVersion":"1.0.0","name":"k8s-pod-network","type":"istio-cni","cni_agent_run_dir":"` + a.runDir +
				`","prevResult":{"cniVersion":"1.0.0","ips":[{"address":"10.1.0.2/24"}]}}`
			start := time.Now()
			if err := r.Run(&Args{Command: command, ContainerID: "c1", Netns: netns, IfName: "eth0", Args: args, Stdin: []byte(stdin)}); err != nil {
				t.Fatalf("%s: %v", command, err)
			}
			took := time.Since(start)
			got := <-a.got
			if got.err != nil {
				t.Fatalf("the agent's read: %v", got.err)
			}
			if got.req.MayLeave != c.wantMayLeave {
				t.Fatalf("the agent was told MayLeave=%v", got.req.MayLeave)
			}
			if c.emptyRecord && got.req.Unprepared != "the agent could not prepare the pod's ADD" {
				t.Fatalf("the agent was told %q of the record", got.req.Unprepared)
			}
			if c.stale && got.req.Unprepared != "the agent that keeps the records was last seen 2m0s ago" {
				t.Fatalf("the agent was told %q of the record", got.req.Unprepared)
			}
			if out.String() != c.wantOut {
				t.Fatalf("the relay printed %q, want %q", out.String(), c.wantOut)
			}
			if c.wantOut != "from the fallback" {
				if len(fb.reasons) != 0 {
					t.Fatalf("the fallback ran: %q", fb.reasons)
				}
				return
			}
			if len(fb.reasons) != 1 || !strings.Contains(fb.reasons[0], "node agent behind: no answer within 50ms") {
				t.Fatalf("the fallback's reasons: %q", fb.reasons)
			}
			if !fb.skipAgent {
				t.Fatal("the fallback was not told to skip the agent's pod cache")
			}
			if !fb.closedBefore {
				t.Fatal("the fallback started while the relay's connection to the agent was open")
			}
			if took < c.wait {
				t.Fatalf("the relay left after %s, before the agent's wait of %s", took, c.wait)
			}
		})
	}
}

// reasonRunner records the fallback's reasons and whether it was told to
// skip the agent's pod cache.
type reasonRunner struct {
	reasons   []string
	skipAgent bool
}

func (f *reasonRunner) Run(_ context.Context, c *execrun.Cmd) (execrun.Result, error) {
	for _, e := range c.Env {
		if r, ok := strings.CutPrefix(e, FallbackReasonEnv+"="); ok {
			f.reasons = append(f.reasons, r)
		}
		f.skipAgent = f.skipAgent || e == FallbackSkipAgentEnv+"=1"
	}
	return execrun.Result{Stdout: []byte("from the fallback")}, nil
}

// TestAgentThatStoppedAnswering: an agent frozen with its socket open
// (its queue of connections not accepted full: the kernel blocks every
// connect) or one that takes commands and never answers holds no command
// for the relay's whole Timeout. Each command goes to the fallback (told
// to skip the agent's cache) after AnswerWait, and STATUS answers as with
// no agent: the fallback could serve an ADD.
func TestAgentThatStoppedAnswering(t *testing.T) {
	netns := filepath.Join(t.TempDir(), "netns")
	if err := os.WriteFile(netns, nil, 0o600); err != nil {
		t.Fatal(err)
	}
	frozen := func(t *testing.T) string {
		dir := t.TempDir()
		fd, err := unix.Socket(unix.AF_UNIX, unix.SOCK_STREAM|unix.SOCK_CLOEXEC, 0)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { _ = unix.Close(fd) })
		addr := &unix.SockaddrUnix{Name: filepath.Join(dir, SocketName)}
		if err := unix.Bind(fd, addr); err != nil {
			t.Fatal(err)
		}
		// A queue of one, filled here; nothing is ever accepted.
		if err := unix.Listen(fd, 0); err != nil {
			t.Fatal(err)
		}
		c, err := unix.Socket(unix.AF_UNIX, unix.SOCK_STREAM|unix.SOCK_CLOEXEC, 0)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { _ = unix.Close(c) })
		if err := unix.Connect(c, addr); err != nil {
			t.Fatal(err)
		}
		return dir
	}
	silent := func(t *testing.T) string { return startAgent(t, []byte("hang")).runDir }
	for _, agent := range []struct {
		name   string
		start  func(*testing.T) string
		reason string
	}{
		{"frozen", frozen, "accepted no connection within 100ms"},
		{"silent", silent, "node agent behind: no answer within 100ms"},
	} {
		for _, command := range []string{"ADD", "DEL", "CHECK", "GC", "STATUS"} {
			if agent.name == "silent" && command == "ADD" {
				continue // an ADD the agent took waits for it: TestLeaveForFallback
			}
			t.Run(agent.name+"/"+command, func(t *testing.T) {
				runDir := agent.start(t)
				fb := &reasonRunner{}
				var out bytes.Buffer
				// An executable file stands in for the fallback STATUS looks for.
				r := &Relay{Fallback: os.Args[0], Stdout: &out, Stderr: io.Discard, Timeout: 3 * time.Second,
					AnswerWait: 100 * time.Millisecond, Runner: fb}
				stdin := `{"cniVersion":"1.1.0","name":"k8s-pod-network","type":"istio-cni","cni_agent_run_dir":"` + runDir +
					`","prevResult":{"cniVersion":"1.1.0","ips":[{"address":"10.1.0.2/24"}]}}`
				a := &Args{Command: command, ContainerID: "c1", Netns: netns, IfName: "eth0",
					Args: "K8S_POD_NAMESPACE=ns;K8S_POD_NAME=p", Stdin: []byte(stdin)}
				if command == "STATUS" || command == "GC" {
					a.ContainerID, a.Netns, a.IfName, a.Args = "", "", "", ""
				}
				if err := r.Run(a); err != nil {
					t.Fatalf("%s: %v", command, err)
				}
				if command == "STATUS" {
					if len(fb.reasons) != 0 || out.Len() != 0 {
						t.Fatalf("STATUS ran the fallback (%q) or printed %q", fb.reasons, out.String())
					}
					return
				}
				if len(fb.reasons) != 1 || !strings.Contains(fb.reasons[0], agent.reason) || !fb.skipAgent || out.String() != "from the fallback" {
					t.Fatalf("fallback reasons %q (want one saying %q), told to skip the agent: %v; printed %q",
						fb.reasons, agent.reason, fb.skipAgent, out.String())
				}
			})
		}
	}
}
