package cniserver

import (
	"context"
	"encoding/binary"
	"encoding/json"
	"io"
	"net"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	promtest "github.com/prometheus/client_golang/prometheus/testutil"
	"golang.org/x/sys/unix"

	"github.com/istio-cni-go/istio-cni/internal/cnirelay"
	"github.com/istio-cni-go/istio-cni/internal/execrun"
	"github.com/istio-cni-go/istio-cni/internal/nlsteps"
	"github.com/istio-cni-go/istio-cni/internal/prepared"
)

// reasonRunner stands in for the fallback: it records why it ran, and
// whether it was told to skip the agent's pod cache.
type reasonRunner struct {
	reasons   []string
	skipAgent bool
}

func (f *reasonRunner) Run(_ context.Context, c *execrun.Cmd) (execrun.Result, error) {
	for _, e := range c.Env {
		if r, ok := strings.CutPrefix(e, cnirelay.FallbackReasonEnv+"="); ok {
			f.reasons = append(f.reasons, r)
		}
		f.skipAgent = f.skipAgent || strings.HasPrefix(e, cnirelay.FallbackSkipAgentEnv+"=")
	}
	return execrun.Result{Stdout: []byte("from the fallback")}, nil
}

// sendMayLeave writes web's ADD from a relay that may leave to client, as
// the relay frames it, with r's namespace as the descriptor.
func sendMayLeave(t *testing.T, r *commitRig, client *net.UnixConn) {
	t.Helper()
	sendWebADD(t, r, client, true)
}

// sendWebADD writes web's ADD (from a relay that may leave, with
// mayLeave) to client, as the relay frames it, with r's namespace as the
// descriptor.
func sendWebADD(t *testing.T, r *commitRig, client *net.UnixConn, mayLeave bool) {
	t.Helper()
	f, err := os.Open(r.netns)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	body, err := json.Marshal(&cnirelay.Request{Command: "ADD", ContainerID: "c-web", Netns: r.netns, HasNetnsFD: true, IfName: "eth0",
		Args: "K8S_POD_NAMESPACE=ns;K8S_POD_NAME=web;K8S_POD_UID=u1", Stdin: []byte(r.conf), Steps: true, TxnForm: nlsteps.BinaryForm, MayLeave: mayLeave})
	if err != nil {
		t.Fatal(err)
	}
	if _, _, err := client.WriteMsgUnix(binary.BigEndian.AppendUint32(nil, uint32(len(body))), unixRights(f), nil); err != nil {
		t.Fatal(err)
	}
	if _, err := client.Write(body); err != nil {
		t.Fatal(err)
	}
}

// newPreparingRig is a commit rig whose agent prepares ADDs ahead.
func newPreparingRig(t *testing.T) *commitRig {
	t.Helper()
	dir := filepath.Join(t.TempDir(), "prepared")
	return newCommitRigWith(t, CommitterPlugin, func(s *Server) { s.PreparedDir, s.Prepare = dir, true })
}

// TestAgentLeftByTheRelay: for an ADD whose relay may leave it
// (cnirelay.Request.MayLeave), the agent never writes to the namespace
// itself. A relay already gone when the agent reads the request costs no
// lookup; one gone after the answer is logged and counted as left, not as
// a failure; rules the backend can only apply in place go to the
// fallback; an agent in time hands the rules over as always.
func TestAgentLeftByTheRelay(t *testing.T) {
	t.Run("gone before the agent read the ADD", func(t *testing.T) {
		r := newPreparingRig(t)
		// Twice: the agent learns the config all the same, and prepares
		// the pods from then on.
		for range learnAfter {
			client, server := socketPair(t)
			sendMayLeave(t, r, client)
			client.Close()
			r.s.serveConn(server, nopConnState{server})
		}
		if n := promtest.CollectAndCount(r.s.Lookups); n != 0 {
			t.Fatalf("the agent looked the pod up for a relay that had left (%d lookup series)", n)
		}
		if got := promtest.ToFloat64(r.s.Commands.WithLabelValues("ADD", resultLeft)); got != learnAfter {
			t.Fatalf("ADDs counted left: %v", got)
		}
		if n := len(r.agent.applied()); n != 0 {
			t.Fatalf("the agent applied %d plans", n)
		}
		r.s.prep.mu.Lock()
		learnt := len(r.s.prep.learnt)
		r.s.prep.mu.Unlock()
		if learnt != 1 {
			t.Fatalf("%d configs learnt from ADDs whose relays had left, want 1", learnt)
		}
	})

	// The agent's answer is written; the relay's end is then closed
	// with it unread (a relay whose wait passed as it came), or after
	// reading it (a relay that took the rules and died: it may have sent
	// them, which the agent must not count as left).
	for _, tc := range []struct {
		name     string
		read     bool
		wantLeft bool
	}{
		{name: "gone with the answer unread", wantLeft: true},
		{name: "read the answer and died", read: true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			r := newPreparingRig(t)
			client, server := socketPair(t)
			sendMayLeave(t, r, client)
			served := make(chan struct{})
			go func() {
				defer close(served)
				r.s.serveConn(server, nopConnState{server})
			}()
			if tc.read {
				if answer, err := io.ReadAll(client); err != nil || len(answer) == 0 {
					t.Fatalf("the agent's answer: %d bytes, %v", len(answer), err)
				}
			} else {
				// Until the answer is there to read.
				rc, err := client.SyscallConn()
				if err != nil {
					t.Fatal(err)
				}
				var perr error
				if err := rc.Control(func(fd uintptr) {
					fds := []unix.PollFd{{Fd: int32(fd), Events: unix.POLLIN}}
					_, perr = unix.Poll(fds, 10_000)
				}); err != nil || perr != nil {
					t.Fatal(err, perr)
				}
			}
			client.Close()
			<-served
			left, failed := promtest.ToFloat64(r.s.Commands.WithLabelValues("ADD", resultLeft)), promtest.ToFloat64(r.s.Commands.WithLabelValues("ADD", "999"))
			if tc.wantLeft != (left == 1) || tc.wantLeft != (failed == 0) {
				t.Fatalf("ADDs counted left %v, failed %v", left, failed)
			}
			r.stop()
			logs := r.logs.String()
			if tc.wantLeft != strings.Contains(logs, "the relay stopped waiting; the fallback serves the pod") ||
				tc.wantLeft == strings.Contains(logs, "did not report sending") {
				t.Fatalf("the agent's log:\n%s", logs)
			}
			if n := len(r.agent.applied()); n != 0 {
				t.Fatalf("the agent applied %d plans", n)
			}
		})
	}

	t.Run("the wait goes with the agent", func(t *testing.T) {
		dir := filepath.Join(t.TempDir(), "prepared")
		r := newCommitRigWith(t, CommitterPlugin, func(s *Server) { s.PreparedDir, s.Prepare, s.AgentWait = dir, true, 25*time.Millisecond })
		if w := prepared.AgentWait(dir); w != 25*time.Millisecond {
			t.Fatalf("the agent's wait for relays: %s", w)
		}
		// Relays must not leave the next agent (an older one, say)
		// before it says they may.
		r.stop()
		if w := prepared.AgentWait(dir); w != 0 {
			t.Fatalf("the wait of an agent that stopped: %s", w)
		}
	})

	for _, committer := range []string{CommitterPlugin, CommitterAgent} {
		t.Run("an agent that does not prepare, committer "+committer, func(t *testing.T) {
			// As an agent started on an earlier agent's records may be
			// asked: it would write to the namespace itself.
			r := newCommitRig(t, committer)
			client, server := socketPair(t)
			sendMayLeave(t, r, client)
			r.s.serveConn(server, nopConnState{server})
			var resp cnirelay.Response
			if err := json.NewDecoder(client).Decode(&resp); err != nil || resp.Unavailable == "" {
				t.Fatalf("the agent's answer: %+v, %v; want unavailable", resp, err)
			}
			if n := len(r.agent.applied()) + len(r.agent.sentHere()); n != 0 {
				t.Fatalf("the agent wrote %d rule sets", n)
			}
		})
	}

	for _, tc := range []struct {
		name    string
		inPlace string
		// wantReason: the fallback ran for it; else the relay sent.
		wantReason string
	}{
		{name: "rules only the agent could apply go to the fallback", inPlace: "the namespace holds ipsets",
			wantReason: "node agent unavailable: the rules must be applied in place (the namespace holds ipsets)"},
		{name: "an agent in time hands the rules over"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			r := newPreparingRig(t)
			r.agent.mu.Lock()
			r.agent.inPlace = tc.inPlace
			r.agent.mu.Unlock()
			// The agent's records and wait, as an agent that prepares
			// leaves them; none for this pod.
			d := prepared.Dir(filepath.Join(r.runDir(), prepared.DirName))
			if err := d.Reset(); err != nil {
				t.Fatal(err)
			}
			if err := d.SetAgentWait(time.Minute); err != nil {
				t.Fatal(err)
			}
			c := &relaySender{}
			fb := &reasonRunner{}
			var out strings.Builder
			rl := r.relay(c, &out)
			rl.Runner = fb
			a := r.add("web")
			a.Args += ";K8S_POD_UID=u1"
			if err := runRelay(rl, "ADD", a); err != nil {
				t.Fatalf("ADD: %v", err)
			}
			r.stop()
			if n := len(r.agent.applied()); n != 0 {
				t.Fatalf("the agent applied %d plans", n)
			}
			if tc.wantReason == "" {
				if len(fb.reasons) != 0 || len(c.sent) != 1 {
					t.Fatalf("fallback reasons %q, %d transactions sent; want the relay to send one", fb.reasons, len(c.sent))
				}
				if got := promtest.ToFloat64(r.s.Commands.WithLabelValues("ADD", "ok")); got != 1 {
					t.Fatalf("ADDs counted ok: %v", got)
				}
				return
			}
			if len(fb.reasons) != 1 || fb.reasons[0] != tc.wantReason || out.String() != "from the fallback" || len(c.sent) != 0 {
				t.Fatalf("fallback reasons %q (want %q), output %q, %d sent", fb.reasons, tc.wantReason, out.String(), len(c.sent))
			}
			if fb.skipAgent {
				t.Fatal("the fallback of an agent that answered was told to skip its pod cache")
			}
			if got := promtest.ToFloat64(r.s.Commands.WithLabelValues("ADD", "unavailable")); got != 1 {
				t.Fatalf("ADDs counted unavailable: %v", got)
			}
		})
	}
}

// evictedState is the socket's bookkeeping of a connection it evicted as
// the request was being read: its claim fails.
type evictedState struct{ conn *net.UnixConn }

func (evictedState) Claim() bool    { return false }
func (evictedState) TimedOut()      {}
func (e evictedState) Close() error { return e.conn.Close() }

// TestEvictedRequestNotServed: a relay's connection evicted by the socket
// (past its connection limit) as its request was read saw the connection
// closed and runs the fallback, so the agent neither looks the pod up nor
// writes its rules, and counts no command. A relay's account of an ADD it
// served from a record is still taken.
func TestEvictedRequestNotServed(t *testing.T) {
	r := newCommitRigWith(t, CommitterAgent, nil)
	client, server := socketPair(t)
	sendWebADD(t, r, client, false)
	r.s.serveConn(server, evictedState{server})
	if answer, err := io.ReadAll(client); err != nil || len(answer) != 0 {
		t.Fatalf("the evicted relay got %d bytes (%v)", len(answer), err)
	}
	if n := promtest.CollectAndCount(r.s.Lookups); n != 0 {
		t.Fatalf("the agent looked the pod up for an evicted relay (%d lookup series)", n)
	}
	if n := len(r.agent.applied()); n != 0 {
		t.Fatalf("the agent applied %d plans for an evicted relay", n)
	}
	if n := promtest.CollectAndCount(r.s.Commands); n != 0 {
		t.Fatalf("commands counted for an evicted relay: %d series", n)
	}

	client, server = socketPair(t)
	body, err := json.Marshal(&cnirelay.Request{Command: "ADD", ContainerID: "c-web", Args: "K8S_POD_NAMESPACE=ns;K8S_POD_NAME=web;K8S_POD_UID=u1",
		Done: &cnirelay.Done{Summary: "nftables", Mode: "REDIRECT"}})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := client.Write(append(binary.BigEndian.AppendUint32(nil, uint32(len(body))), body...)); err != nil {
		t.Fatal(err)
	}
	r.s.serveConn(server, evictedState{server})
	if got := promtest.ToFloat64(r.s.Commands.WithLabelValues("ADD", "ok")); got != 1 {
		t.Fatalf("ADDs served from records counted: %v, want the evicted relay's account taken", got)
	}
}
