package cnirelay

import (
	"bytes"
	"context"
	"encoding/binary"
	"encoding/json"
	"errors"
	"io"
	"net"
	"os"
	"path/filepath"
	"reflect"
	"slices"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/istio-cni-go/istio-cni/internal/execrun"
	"github.com/istio-cni-go/istio-cni/internal/nlsteps"
)

// agent is a stand-in node agent on a temp run dir: it reads one request
// as the real one does (length, JSON, a descriptor on the first bytes)
// and answers with reply.
type agent struct {
	runDir string
	got    chan received
}

type received struct {
	req   Request
	gotFD bool
	err   error
}

// startAgent serves one connection per reply given; reply nil closes the
// connection without an answer, and a reply "hang" never answers.
func startAgent(t *testing.T, replies ...[]byte) *agent {
	t.Helper()
	a := &agent{runDir: t.TempDir(), got: make(chan received, len(replies))}
	l, err := net.ListenUnix("unix", &net.UnixAddr{Name: filepath.Join(a.runDir, SocketName), Net: "unix"})
	if err != nil {
		t.Fatal(err)
	}
	done, release := make(chan struct{}), make(chan struct{})
	t.Cleanup(func() {
		close(release)
		_ = l.Close()
		<-done
	})
	go func() {
		defer close(done)
		for _, reply := range replies {
			c, err := l.AcceptUnix()
			if err != nil {
				return
			}
			a.got <- readRequest(c)
			switch {
			case string(reply) == "hang":
				// Hold the connection open until the test ends.
				<-release
			case reply != nil:
				_, _ = c.Write(reply)
			}
			_ = c.Close()
		}
	}()
	return a
}

func readRequest(c *net.UnixConn) received {
	var hdr [4]byte
	oob := make([]byte, syscall.CmsgSpace(4))
	n, oobn, _, _, err := c.ReadMsgUnix(hdr[:], oob)
	if err != nil {
		return received{err: err}
	}
	gotFD := false
	if oobn > 0 {
		msgs, err := syscall.ParseSocketControlMessage(oob[:oobn])
		if err == nil && len(msgs) == 1 {
			if fds, err := syscall.ParseUnixRights(&msgs[0]); err == nil {
				gotFD = len(fds) == 1
				for _, fd := range fds {
					_ = syscall.Close(fd)
				}
			}
		}
	}
	if _, err := io.ReadFull(c, hdr[n:]); err != nil {
		return received{err: err}
	}
	body := make([]byte, binary.BigEndian.Uint32(hdr[:]))
	if _, err := io.ReadFull(c, body); err != nil {
		return received{err: err}
	}
	var r received
	r.gotFD = gotFD
	r.err = json.Unmarshal(body, &r.req)
	return r
}

func answer(t *testing.T, r Response) []byte {
	t.Helper()
	b, err := json.Marshal(r)
	if err != nil {
		t.Fatal(err)
	}
	return b
}

// recorder is a Runner that records the fallback's command and answers
// as told.
type recorder struct {
	cmds []*execrun.Cmd
	res  execrun.Result
	err  error
}

func (r *recorder) Run(_ context.Context, c *execrun.Cmd) (execrun.Result, error) {
	r.cmds = append(r.cmds, c)
	return r.res, r.err
}

func conf(runDir string) []byte {
	return []byte(`{"cniVersion":"1.0.0","name":"k8s-pod-network","type":"istio-cni","cni_agent_run_dir":"` + runDir + `"}`)
}

// TestProtocol: what the relay sends the agent, and what it makes of each
// kind of answer, through a real socket.
func TestProtocol(t *testing.T) {
	for _, c := range []struct {
		name    string
		command string
		netns   string
		reply   func(t *testing.T) []byte
		// Exactly one of these is checked: the relay's output, its CNI
		// error code, or that the fallback ran with this reason.
		wantOut      string
		wantCode     uint
		wantFallback string
		wantFD       bool
	}{
		{name: "result passed on", command: "ADD", netns: "/proc/self/ns/net", wantFD: true,
			reply:   func(t *testing.T) []byte { return answer(t, Response{Stdout: []byte(`{"cniVersion":"1.0.0"}`)}) },
			wantOut: `{"cniVersion":"1.0.0"}`},
		{name: "the plugin's error passed on", command: "ADD",
			reply: func(t *testing.T) []byte {
				return answer(t, Response{Error: NewError(7, "bad config", "details")})
			},
			wantCode: 7},
		{name: "agent shutting down: fallback", command: "DEL",
			reply:        func(t *testing.T) []byte { return answer(t, Response{Unavailable: "shutting down"}) },
			wantFallback: "node agent unavailable: shutting down"},
		{name: "closed without an answer: fallback", command: "ADD",
			reply:        func(*testing.T) []byte { return nil },
			wantFallback: "no node agent: no answer on"},
		{name: "an answer that does not decode", command: "CHECK",
			reply:    func(*testing.T) []byte { return []byte("{not json") },
			wantCode: ErrInternal},
		{name: "no answer in time", command: "ADD",
			reply:    func(*testing.T) []byte { return []byte("hang") },
			wantCode: ErrTryAgainLater},
		{name: "a DEL whose namespace is gone goes without a descriptor", command: "DEL", netns: "/nonexistent/netns",
			reply:   func(t *testing.T) []byte { return answer(t, Response{}) },
			wantOut: ""},
	} {
		t.Run(c.name, func(t *testing.T) {
			reply := c.reply(t)
			a := startAgent(t, reply)
			// The bound on every wait for the stub agent: short only where
			// the case is that it never answers.
			timeout := 10 * time.Second
			if string(reply) == "hang" {
				timeout = 200 * time.Millisecond
			}
			var out bytes.Buffer
			rec := &recorder{res: execrun.Result{Stdout: []byte("from the fallback")}}
			r := &Relay{Fallback: "/opt/cni/bin/istio-cni-fallback", Stdout: &out, Stderr: io.Discard, Timeout: timeout, Runner: rec}
			args := &Args{ContainerID: "c1", Netns: c.netns, IfName: "eth0", Args: "K8S_POD_NAMESPACE=ns;K8S_POD_NAME=p",
				Path: "/opt/cni/bin", Stdin: conf(a.runDir)}
			err := r.Run(withCommand(args, c.command))
			got := <-a.got
			if got.err != nil {
				t.Fatalf("the agent could not read the request: %v", got.err)
			}
			want := Request{Command: c.command, ContainerID: "c1", Netns: c.netns, HasNetnsFD: c.wantFD, IfName: "eth0",
				Args: args.Args, Path: args.Path, Stdin: args.Stdin, Steps: c.command == "ADD" && c.wantFD, Framed: true}
			if want.Steps {
				want.TxnForm = nlsteps.BinaryForm
			}
			if !jsonEqual(t, got.req, want) || got.gotFD != c.wantFD {
				t.Fatalf("the agent got %+v (descriptor %t), want %+v (descriptor %t)", got.req, got.gotFD, want, c.wantFD)
			}
			switch {
			case c.wantCode != 0:
				var te *Error
				if !errors.As(err, &te) || te.Code != c.wantCode {
					t.Fatalf("error %v, want code %d", err, c.wantCode)
				}
				if len(rec.cmds) != 0 {
					t.Fatal("the fallback ran although the agent answered")
				}
			case c.wantFallback != "":
				if err != nil || out.String() != "from the fallback" || len(rec.cmds) != 1 {
					t.Fatalf("fallback: %v, output %q, %d runs", err, out.String(), len(rec.cmds))
				}
				env := rec.cmds[0].Env
				if last := env[len(env)-1]; !strings.HasPrefix(last, FallbackReasonEnv+"="+c.wantFallback) {
					t.Fatalf("reason given to the fallback: %q", last)
				}
			default:
				if err != nil || out.String() != c.wantOut || len(rec.cmds) != 0 {
					t.Fatalf("got %v, output %q, %d fallback runs", err, out.String(), len(rec.cmds))
				}
			}
		})
	}
}

func jsonEqual(t *testing.T, a, b any) bool {
	t.Helper()
	x, err := json.Marshal(a)
	if err != nil {
		t.Fatal(err)
	}
	y, err := json.Marshal(b)
	if err != nil {
		t.Fatal(err)
	}
	return bytes.Equal(x, y)
}

// TestRequestEncoding: the field names are the protocol between two
// binaries of possibly different versions (a relay from before an
// upgrade talks to the new agent), so they are pinned here.
func TestRequestEncoding(t *testing.T) {
	b, err := json.Marshal(Request{Command: "ADD", ContainerID: "c", Netns: "/n", HasNetnsFD: true, IfName: "eth0", Args: "a", Path: "/p", Stdin: []byte("{}"),
		Steps: true, TxnForm: "NLS1", ForceIPTables: "legacy", Framed: true})
	if err != nil {
		t.Fatal(err)
	}
	want := `{"command":"ADD","containerID":"c","netns":"/n","hasNetnsFD":true,"ifName":"eth0","args":"a","path":"/p","stdin":"e30=","steps":true,"txnForm":"NLS1","forceIPTables":"legacy","framed":true}`
	if string(b) != want {
		t.Fatalf("request:\n got %s\nwant %s", b, want)
	}
	b, err = json.Marshal(Response{Stdout: []byte("x"), Error: NewError(7, "m", "d"), Unavailable: "u", Txn: []byte("NLS1")})
	if err != nil {
		t.Fatal(err)
	}
	want = `{"stdout":"eA==","error":{"code":7,"msg":"m","details":"d"},"unavailable":"u","txn":"TkxTMQ=="}`
	if string(b) != want {
		t.Fatalf("response:\n got %s\nwant %s", b, want)
	}
	var r Response
	if err := json.Unmarshal([]byte(`{}`), &r); err != nil || r.Error != nil || r.Unavailable != "" || r.Stdout != nil {
		t.Fatalf("an empty response is a success with no output: %+v %v", r, err)
	}
	b, err = json.Marshal(nlsteps.Outcome{Error: "e", Took: time.Millisecond})
	if err != nil || string(b) != `{"error":"e","took":1000000}` {
		t.Fatalf("outcome: %s %v", b, err)
	}
}

// TestStepsAgainstOlderAgent: a relay that can send prepared rules says
// so, and an agent that does not know the field answers as before, with
// the rules applied itself: the relay passes the result on and sends
// nothing. An agent that sends rules to a relay that did not ask fails
// the ADD rather than leave the pod without them.
func TestStepsAgainstOlderAgent(t *testing.T) {
	a := startAgent(t, answer(t, Response{Stdout: []byte(`{"cniVersion":"1.0.0"}`)}))
	sent := 0
	var out bytes.Buffer
	r := &Relay{Fallback: "/f", Stdout: &out, Stderr: io.Discard, Timeout: 5 * time.Second,
		Send: func(*os.File, *nlsteps.Txn) (time.Duration, error) { sent++; return 0, nil }}
	args := &Args{ContainerID: "c1", Netns: "/proc/self/ns/net", IfName: "eth0", Args: "K8S_POD_NAMESPACE=ns;K8S_POD_NAME=p", Stdin: conf(a.runDir)}
	if err := r.Run(withCommand(args, "ADD")); err != nil || out.String() != `{"cniVersion":"1.0.0"}` || sent != 0 {
		t.Fatalf("ADD against an agent that applies: %v, output %q, %d sent", err, out.String(), sent)
	}
	if got := <-a.got; got.err != nil || !got.req.Steps {
		t.Fatalf("the relay did not say it sends prepared rules: %+v", got)
	}

	step := nlsteps.Step{Proto: 12}
	step.Add(1, 0, nil, "x")
	prepared, err := (&nlsteps.Txn{Steps: []nlsteps.Step{step}}).MarshalBinary()
	if err != nil {
		t.Fatal(err)
	}
	a = startAgent(t, answer(t, Response{Txn: prepared, Stdout: []byte(`{}`)}))
	r = &Relay{Fallback: "/f", Stdout: io.Discard, Stderr: io.Discard, Timeout: 5 * time.Second, NoSteps: true}
	args.Stdin = conf(a.runDir)
	err = r.Run(withCommand(args, "ADD"))
	if err == nil || !strings.Contains(err.Error(), "cannot send") {
		t.Fatalf("prepared rules to a relay that cannot send them: %v", err)
	}
	if got := <-a.got; got.err != nil || got.req.Steps {
		t.Fatalf("a relay that cannot send said it can: %+v", got)
	}
}

// TestNoAgent: with no socket the command goes to the fallback, and a
// STATUS succeeds exactly when the fallback could run.
func TestNoAgent(t *testing.T) {
	dir := t.TempDir()
	exe := filepath.Join(dir, "istio-cni-fallback")
	if err := os.WriteFile(exe, []byte("#!/bin/sh\n"), 0o755); err != nil {
		t.Fatal(err)
	}
	notExe := filepath.Join(dir, "not-executable")
	if err := os.WriteFile(notExe, nil, 0o644); err != nil {
		t.Fatal(err)
	}
	args := &Args{ContainerID: "c1", IfName: "eth0", Stdin: conf(t.TempDir())}
	for _, c := range []struct {
		fallback string
		wantOK   bool
	}{{exe, true}, {notExe, false}, {filepath.Join(dir, "missing"), false}, {dir, false}} {
		rec := &recorder{}
		r := &Relay{Fallback: c.fallback, Stdout: io.Discard, Stderr: io.Discard, Runner: rec}
		err := r.Run(withCommand(args, "STATUS"))
		var te *Error
		switch {
		case c.wantOK && err != nil:
			t.Errorf("%s: STATUS %v", c.fallback, err)
		case !c.wantOK && (!errors.As(err, &te) || te.Code != ErrPluginNotAvailable):
			t.Errorf("%s: STATUS %v, want code %d", c.fallback, err, ErrPluginNotAvailable)
		}
		if len(rec.cmds) != 0 {
			t.Errorf("%s: STATUS ran the fallback", c.fallback)
		}
	}
	rec := &recorder{res: execrun.Result{Stdout: []byte("ok")}}
	var out bytes.Buffer
	r := &Relay{Fallback: exe, Environ: []string{"CNI_COMMAND=ADD", "PATH=/opt/cni/bin"}, Stdout: &out, Stderr: io.Discard, Runner: rec}
	if err := r.Run(withCommand(args, "ADD")); err != nil || out.String() != "ok" || len(rec.cmds) != 1 {
		t.Fatalf("ADD without an agent: %v %q %d", err, out.String(), len(rec.cmds))
	}
	if env := strings.Join(rec.cmds[0].Env, "\n"); !strings.HasPrefix(env, "CNI_COMMAND=ADD\nPATH=/opt/cni/bin\n"+FallbackReasonEnv+"=no node agent") {
		t.Fatalf("the fallback's environment:\n%s", env)
	}
}

// TestFallback: how the fallback is started, and what its answer becomes.
func TestFallback(t *testing.T) {
	stdin := []byte(`{"cniVersion":"1.0.0","type":"istio-cni"}`)
	for _, c := range []struct {
		name     string
		res      execrun.Result
		err      error
		wantOut  string
		wantCode uint
		wantMsg  string
	}{
		{name: "success: its output is the result", res: execrun.Result{Stdout: []byte(`{"cniVersion":"1.0.0"}`)}, wantOut: `{"cniVersion":"1.0.0"}`},
		{name: "its CNI error is passed on", res: execrun.Result{Stdout: []byte(`{"code":11,"msg":"pod lookup failed","details":"d"}`)},
			err: &execrun.ExitError{Cmd: "/f", Code: 1}, wantCode: 11, wantMsg: "pod lookup failed"},
		{name: "a failure without a CNI error", res: execrun.Result{Stdout: []byte("panic: x")},
			err: &execrun.ExitError{Cmd: "/f", Code: 2}, wantCode: ErrInternal, wantMsg: `/f failed (exit status 2) with output "panic: x"`},
		{name: "killed by a signal", err: &execrun.ExitError{Cmd: "/f", Code: -1, Status: "signal: killed"},
			wantCode: ErrInternal, wantMsg: `/f failed (signal: killed) with output ""`},
		{name: "an error without a message", res: execrun.Result{Stdout: []byte(`{"code":11}`)},
			err: &execrun.ExitError{Cmd: "/f", Code: 1}, wantCode: ErrInternal, wantMsg: "with output"},
		{name: "it cannot start", err: os.ErrPermission, wantCode: ErrInternal,
			wantMsg: "agent away; and the plugin that works without it cannot run: permission denied"},
	} {
		t.Run(c.name, func(t *testing.T) {
			rec := &recorder{res: c.res, err: c.err}
			var out, stderr bytes.Buffer
			r := &Relay{Fallback: "/f", Environ: []string{"A=1"}, Stdout: &out, Stderr: &stderr, Runner: rec}
			err := r.fallback("agent away", &Args{Stdin: stdin})
			if len(rec.cmds) != 1 {
				t.Fatalf("%d runs", len(rec.cmds))
			}
			cmd := rec.cmds[0]
			if cmd.Path != "/f" || len(cmd.Args) != 0 || !bytes.Equal(cmd.Stdin, stdin) || cmd.Stderr != &stderr || cmd.Stdout != nil ||
				strings.Join(cmd.Env, ",") != "A=1,"+FallbackReasonEnv+"=agent away" {
				t.Fatalf("command: %+v", cmd)
			}
			if c.wantCode == 0 {
				if err != nil || out.String() != c.wantOut {
					t.Fatalf("%v %q", err, out.String())
				}
				return
			}
			var te *Error
			if !errors.As(err, &te) || te.Code != c.wantCode || !strings.Contains(te.Msg, c.wantMsg) {
				t.Fatalf("error %v, want code %d with %q", err, c.wantCode, c.wantMsg)
			}
			if out.Len() != 0 {
				t.Fatalf("output on failure: %q", out.String())
			}
		})
	}
}

// TestRealFallbackRuns: the default runner starts the fallback for real,
// with the config on its stdin.
func TestRealFallbackRuns(t *testing.T) {
	sh, err := lookPath("sh")
	if err != nil {
		t.Fatalf("no sh on PATH to stand in for the fallback: %v", err)
	}
	dir := t.TempDir()
	f := filepath.Join(dir, "fallback")
	if err := os.WriteFile(f, []byte("#!"+sh+"\ncat\necho \"$"+FallbackReasonEnv+"\" >&2\n"), 0o755); err != nil {
		t.Fatal(err)
	}
	var out, stderr bytes.Buffer
	r := &Relay{Fallback: f, Stdout: &out, Stderr: &stderr}
	if err := r.fallback("why", &Args{Stdin: []byte("config")}); err != nil {
		t.Fatal(err)
	}
	if out.String() != "config" || stderr.String() != "why\n" {
		t.Fatalf("stdout %q, stderr %q", out.String(), stderr.String())
	}
}

// lookPath finds a program on PATH without os/exec, which the relay's
// own code leaves to execrun.
func lookPath(name string) (string, error) {
	for _, dir := range filepath.SplitList(os.Getenv("PATH")) {
		p := filepath.Join(dir, name)
		if fi, err := os.Stat(p); err == nil && fi.Mode().IsRegular() && fi.Mode().Perm()&0o111 != 0 {
			return p, nil
		}
	}
	return "", os.ErrNotExist
}

// withCommand is the runtime's command with its arguments.
func withCommand(a *Args, command string) *Args {
	c := *a
	c.Command = command
	return &c
}

// TestFramedAnswers: a relay asks for framed answers and reads them, and
// still reads an older agent's JSON; it sends the same transaction either
// way. Frames that do not add up are refused, not half read.
func TestFramedAnswers(t *testing.T) {
	step := nlsteps.Step{Proto: 12}
	step.Add(1, 0, []byte("body"), "x")
	prepared, err := (&nlsteps.Txn{Summary: "s", Steps: []nlsteps.Step{step}}).MarshalBinary()
	if err != nil {
		t.Fatal(err)
	}
	resp := Response{Txn: prepared, Stdout: []byte(`{"cniVersion":"1.0.0"}`)}
	framed := AppendFramed(nil, &resp)
	if framed[0] != 0 || !bytes.HasSuffix(framed, prepared) {
		t.Fatalf("framed answer %q: want a zero byte first and the transaction as it is", framed)
	}
	for name, reply := range map[string][]byte{"framed": framed, "JSON, from an older agent": answer(t, resp)} {
		a := startAgent(t, reply)
		var got *nlsteps.Txn
		var out bytes.Buffer
		r := &Relay{Fallback: "/f", Stdout: &out, Stderr: io.Discard, Timeout: 5 * time.Second,
			Send: func(_ *os.File, txn *nlsteps.Txn) (time.Duration, error) { got = txn; return 0, nil }}
		args := &Args{ContainerID: "c1", Netns: "/proc/self/ns/net", IfName: "eth0", Args: "K8S_POD_NAMESPACE=ns;K8S_POD_NAME=p", Stdin: conf(a.runDir)}
		if err := r.Run(withCommand(args, "ADD")); err != nil || out.String() != `{"cniVersion":"1.0.0"}` {
			t.Fatalf("%s: %v, output %q", name, err, out.String())
		}
		if got == nil || got.Summary != "s" || len(got.Steps) != 1 || !bytes.Equal(got.Steps[0].Msgs, step.Msgs) {
			t.Fatalf("%s: sent %+v, want the agent's transaction", name, got)
		}
		if req := <-a.got; req.err != nil || !req.req.Framed {
			t.Fatalf("%s: the relay did not ask for framed answers: %+v", name, req)
		}
	}
	for _, want := range []*Response{
		{Stdout: []byte("x")},
		{Error: NewError(7, "m", "d"), Unavailable: "u"},
		{Error: NewError(999, "", "")},
		{},
	} {
		got, err := ParseResponse(AppendFramed(nil, want))
		if err != nil || !reflect.DeepEqual(got, want) {
			t.Fatalf("framed %+v read back as %+v, %v", want, got, err)
		}
	}
	for name, bad := range map[string][]byte{
		"empty":               nil,
		"short":               framed[:3],
		"not framed":          []byte("\x00XYZ...."),
		"length past the end": framed[:10],
		"trailing bytes":      append(slices.Clone(framed), 'x'),
		"unknown error flag":  AppendFramed(nil, &Response{})[:12],
	} {
		if r, err := ParseResponse(bad); err == nil {
			t.Errorf("%s: read as %+v", name, r)
		}
	}
}

// TestRequestAsJSON: the relay writes its request without encoding/json;
// the agent reads it with encoding/json, and must read what
// encoding/json's own encoding gives.
func TestRequestAsJSON(t *testing.T) {
	for _, req := range []Request{
		{Command: "ADD", ContainerID: "c", Netns: "/n", HasNetnsFD: true, IfName: "eth0", Args: "a", Path: "/p", Stdin: []byte("{}"), Steps: true, TxnForm: "NLS1", ForceIPTables: "legacy", Framed: true},
		{Command: "DEL"},
		{Command: "ADD", Args: "a", Done: &Done{}},
		{Command: "ADD", Args: "a", Unprepared: "no entry for \"this\" config"},
		{Command: "ADD", Args: "a", Done: &Done{Skip: "s\"", Mode: "REDIRECT", Summary: "nftables", IPv6: true, Error: "e\n", Unlocked: "dir \"x\"", Took: 1, Total: -2, CPU: 3}},
		{Command: "ADD", Args: "K=\"q\"\\;\n\t\x01\x1f\u2028é<&>", Stdin: []byte{0, 0xff}, Netns: "bad \xff\xfe utf-8"},
	} {
		checkRequestJSON(t, req)
	}
}

func checkRequestJSON(t *testing.T, req Request) {
	t.Helper()
	ours := req.appendJSON(nil)
	theirs, err := json.Marshal(&req)
	if err != nil {
		t.Fatal(err)
	}
	var a, b Request
	if err := json.Unmarshal(ours, &a); err != nil {
		t.Fatalf("%q does not decode: %v", ours, err)
	}
	if err := json.Unmarshal(theirs, &b); err != nil {
		t.Fatal(err)
	}
	if !reflect.DeepEqual(a, b) {
		t.Fatalf("request %+v:\n ours   %s reads as %+v\n theirs %s reads as %+v", req, ours, a, theirs, b)
	}
}

func FuzzRequestAsJSON(f *testing.F) {
	f.Add("ADD", "c1", "/var/run/netns/x", "K8S_POD_NAME=p", []byte(`{"cniVersion":"1.0.0"}`), true)
	f.Add("DEL", "\x00\\\"", "\xff", "é\u2028", []byte(nil), false)
	f.Fuzz(func(t *testing.T, cmd, id, netns, args string, stdin []byte, steps bool) {
		checkRequestJSON(t, Request{Command: cmd, ContainerID: id, Netns: netns, Args: args, Stdin: stdin, Steps: steps, TxnForm: id, HasNetnsFD: steps, ForceIPTables: netns, Framed: !steps})
	})
}

// TestOutcomeAsJSON: the relay's account of a send, written without
// encoding/json, reads back as encoding/json's does.
func TestOutcomeAsJSON(t *testing.T) {
	for _, o := range []nlsteps.Outcome{{}, {Error: "refused: \"x\"\n", Took: 1234567, CPU: 42}, {Took: -1}} {
		var got nlsteps.Outcome
		if err := json.Unmarshal(appendOutcomeJSON(nil, &o), &got); err != nil || got != o {
			t.Fatalf("outcome %+v: %s reads as %+v, %v", o, appendOutcomeJSON(nil, &o), got, err)
		}
	}
}

// FuzzParseResponse: whatever an agent (or something else on its socket)
// sends, the relay either refuses it or reads an answer that, framed
// again, reads back the same.
func FuzzParseResponse(f *testing.F) {
	f.Add(AppendFramed(nil, &Response{Stdout: []byte("{}"), Txn: []byte("NLS1xyz"), Error: NewError(1, "m", "")}))
	f.Add([]byte(`{"stdout":"e30=","txn":"TkxTMQ=="}`))
	f.Add([]byte(`{"error":{"code":4294967297,"msg":"m"}}`))
	f.Fuzz(func(t *testing.T, b []byte) {
		r, err := ParseResponse(b)
		if err != nil {
			return
		}
		again := AppendFramed(nil, r)
		r2, err := ParseResponse(again)
		if err != nil || !bytes.Equal(r2.Txn, r.Txn) || !bytes.Equal(r2.Stdout, r.Stdout) || r2.Unavailable != r.Unavailable || !reflect.DeepEqual(r2.Error, r.Error) {
			t.Fatalf("framed again %q read back as %+v, %v; first read %+v", again, r2, err, r)
		}
	})
}

// runnerFunc is a Runner that runs a function in place of the fallback.
type runnerFunc func(c *execrun.Cmd) (execrun.Result, error)

func (f runnerFunc) Run(_ context.Context, c *execrun.Cmd) (execrun.Result, error) { return f(c) }

// TestAgentStartedDuringTheFallback: an ADD the fallback failed while a
// node agent started (a rollout: the fallback refuses an ambient pod
// without an agent, or waited for the new agent's token) is asked of
// that agent, whose answer is the runtime's; with no new agent, an agent
// socket that was there before (a dead agent's), or another command, the
// fallback's error stands.
func TestAgentStartedDuringTheFallback(t *testing.T) {
	refused := execrun.Result{Stdout: []byte(`{"code":11,"msg":"pod ns/p is enrolled in the ambient mesh; the node agent is not serving this node"}`)}
	exit := &execrun.ExitError{Cmd: "/f", Code: 1}
	for _, c := range []struct {
		name     string
		command  string
		deadSock bool // a dead agent's socket is in place from the start
		starts   bool // an agent starts while the fallback runs
		wantOut  string
	}{
		{name: "agent started", command: "ADD", starts: true, wantOut: `{"cniVersion":"1.0.0","from":"agent"}`},
		{name: "agent started over a dead one's socket", command: "ADD", deadSock: true, starts: true, wantOut: `{"cniVersion":"1.0.0","from":"agent"}`},
		{name: "no agent", command: "ADD"},
		{name: "only the dead agent's socket", command: "ADD", deadSock: true},
		{name: "a CHECK", command: "CHECK", starts: true},
	} {
		t.Run(c.name, func(t *testing.T) {
			runDir := t.TempDir()
			sock := filepath.Join(runDir, SocketName)
			if c.deadSock {
				l, err := net.ListenUnix("unix", &net.UnixAddr{Name: sock, Net: "unix"})
				if err != nil {
					t.Fatal(err)
				}
				l.SetUnlinkOnClose(false)
				l.Close()
			}
			var a *agent
			if c.starts {
				a = startAgent(t, answer(t, Response{Stdout: []byte(`{"cniVersion":"1.0.0","from":"agent"}`)}))
			}
			runs := 0
			run := runnerFunc(func(*execrun.Cmd) (execrun.Result, error) {
				runs++
				if a != nil {
					// The new agent's socket takes the path, as a bind
					// after the old one's removal does.
					if err := os.Rename(filepath.Join(a.runDir, SocketName), sock); err != nil {
						t.Error(err)
					}
				}
				return refused, exit
			})
			var out bytes.Buffer
			r := &Relay{Fallback: "/f", Stdout: &out, Stderr: io.Discard, Timeout: 10 * time.Second, Runner: run}
			args := &Args{ContainerID: "c1", IfName: "eth0", Args: "K8S_POD_NAMESPACE=ns;K8S_POD_NAME=p", Stdin: conf(runDir)}
			err := r.Run(withCommand(args, c.command))
			if runs != 1 {
				t.Fatalf("the fallback ran %d times", runs)
			}
			if c.wantOut != "" {
				if err != nil || out.String() != c.wantOut {
					t.Fatalf("ADD: %v, output %q, want the new agent's answer", err, out.String())
				}
				got := <-a.got
				if got.err != nil || got.req.Command != "ADD" || !strings.Contains(got.req.Unprepared, "started while istio-cni-fallback") {
					t.Fatalf("the new agent got %+v", got)
				}
				return
			}
			var te *Error
			if !errors.As(err, &te) || te.Code != 11 || !strings.Contains(te.Msg, "enrolled in the ambient mesh") || out.Len() != 0 {
				t.Fatalf("got %v, output %q, want the fallback's error", err, out.String())
			}
			if a != nil {
				select {
				case got := <-a.got:
					t.Fatalf("the agent was asked a %s: %+v", c.command, got.req)
				default:
				}
			}
		})
	}
}
