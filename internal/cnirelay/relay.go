package cnirelay

import (
	"context"
	"encoding/binary"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"time"

	"golang.org/x/sys/unix"

	"github.com/istio-cni-go/istio-cni/internal/execrun"
	"github.com/istio-cni-go/istio-cni/internal/nlsteps"
	"github.com/istio-cni-go/istio-cni/internal/prepared"
)

// DefaultRunDir is the plugin's run directory when its config names none.
const DefaultRunDir = "/var/run/istio-cni"

// Timeout bounds one command in the agent. The agent bounds its own API
// lookups by the config's k8s_retry_budget (30 s by default); this only
// catches an agent that stopped answering altogether.
const Timeout = 2 * time.Minute

// AnswerWait bounds how long a command other than ADD waits for the agent
// to accept it and begin its answer before the fallback serves it. DEL,
// CHECK, GC and STATUS change nothing, so the fallback may serve one the
// agent is still on; only an agent that stopped answering takes this
// long (a healthy one answers in milliseconds), and without it CRI-O's
// CHECK, run while it creates each sandbox, and every DEL would wait for
// all of Timeout. Every command, ADD too, waits at most this long for the
// agent to accept its connection: a command the agent never took the
// fallback may always serve.
const AnswerWait = 10 * time.Second

// Relay sends CNI commands to the agent's socket and runs the fallback
// when no agent answers.
type Relay struct {
	// Fallback is the complete plugin's path.
	Fallback string
	// Environ is passed to the fallback.
	Environ []string
	Stdout  io.Writer
	Stderr  io.Writer
	Timeout time.Duration
	// AnswerWait replaces the constant AnswerWait when set.
	AnswerWait time.Duration
	// Runner starts the fallback; nil means execrun.OS.
	Runner execrun.Runner
	// NoSteps makes the relay one that cannot send prepared requests, as
	// relays before them were: the agent then applies the rules.
	NoSteps bool
	// Send sends a prepared transaction from inside the namespace; nil
	// means nlsteps.RunIn.
	Send func(netns *os.File, txn *nlsteps.Txn) (time.Duration, error)
	// Getenv reads the runtime's environment (FORCE_IPTABLES_BINARY);
	// nil means os.Getenv.
	Getenv func(string) string
	// SendHere sends a prepared record's transaction from the calling
	// thread, in the pod's namespace; nil means nlsteps.Run.
	SendHere func(txn *nlsteps.Txn) error
	// Start is when the runtime started the process, for the agent's
	// log; zero means when Run was called.
	Start time.Time
}

// errNoAgent means nothing answered on the socket: the fallback may run
// without any risk of doing the work twice at once.
var errNoAgent = errors.New("no node agent")

// errAgentBehind means a relay that may leave (Request.MayLeave, or a
// command that changes nothing) got no answer within its wait and closed
// the connection, or the agent did not accept the connection at all: the
// agent writes nothing to the namespace for such a request, so the
// fallback may run.
var errAgentBehind = errors.New("node agent behind")

// hasUID says the arguments name the pod's UID, which records go by.
func hasUID(args string) bool {
	_, _, uid := podArgs(args)
	return uid != ""
}

// Run serves one command: through the agent when one answers, else by
// running the complete plugin. Its error is an *Error, for the runtime.
func (r *Relay) Run(a *Args) error {
	start := r.Start
	if start.IsZero() {
		start = time.Now()
	}
	var runDir string
	conf, cerr := prepared.ParseConfig(a.Stdin)
	if cerr == nil {
		runDir = conf.RunDir
	} else {
		var c struct {
			RunDir string `json:"cni_agent_run_dir"`
		}
		// A config that does not parse goes to the agent or the fallback
		// all the same: either reports it with the key that was wrong.
		_ = json.Unmarshal(a.Stdin, &c)
		runDir = c.RunDir
	}
	if runDir == "" {
		runDir = DefaultRunDir
	}
	sock := filepath.Join(runDir, SocketName)
	var netns *os.File
	if a.Netns != "" {
		f, err := os.Open(a.Netns)
		switch {
		case err == nil:
			defer f.Close()
			netns = f
		case a.Command == "ADD" || a.Command == "CHECK":
			return NewError(ErrInvalidNetNS, fmt.Sprintf("cannot open the pod's network namespace %s: %v", a.Netns, err), "")
		}
	}
	if cerr == nil && a.Command == "DEL" && r.serveDel(a, conf, runDir, start) {
		return nil
	}
	unprepared, leaveAfter := "", time.Duration(0)
	if cerr == nil && a.Command == "ADD" && netns != nil && !r.NoSteps {
		served, why, stale, err := r.servePrepared(start, a, conf, runDir, netns)
		if served {
			return err
		}
		unprepared = why
		// No record for a pod of an agent that prepares them: the agent
		// has not got to the pod yet, and may not soon. Nor one of an
		// agent not seen for long: it may be hung.
		if (why == "" || stale) && hasUID(a.Args) {
			leaveAfter = prepared.AgentWait(filepath.Join(runDir, prepared.DirName))
		}
	}
	var agentBefore os.FileInfo
	if a.Command == "ADD" {
		agentBefore, _ = os.Stat(sock)
	}
	resp, conn, err := r.ask(sock, a, netns, unprepared, leaveAfter)
	if conn != nil {
		defer conn.close()
	}
	switch {
	case errors.Is(err, errAgentBehind) && a.Command == "STATUS":
		return r.status(err.Error())
	case errors.Is(err, errAgentBehind):
		return r.fallback(err.Error(), a, FallbackSkipAgentEnv+"=1")
	case errors.Is(err, errNoAgent) && a.Command == "STATUS":
		return r.status(err.Error())
	case errors.Is(err, errNoAgent):
		ferr := r.fallback(err.Error(), a)
		if ferr != nil && a.Command == "ADD" && AgentCame(sock, agentBefore) {
			return r.askTheNewAgent(sock, a, netns, ferr)
		}
		return ferr
	case err != nil:
		return err
	case resp.Unavailable != "" && a.Command == "STATUS":
		return r.status("node agent unavailable: " + resp.Unavailable)
	case resp.Unavailable != "":
		return r.fallback("node agent unavailable: "+resp.Unavailable, a)
	}
	return r.finish(resp, conn, a, netns)
}

// finish answers the runtime with the agent's answer, sending its rules
// first when it has any.
func (r *Relay) finish(resp *Response, conn *agentConn, a *Args, netns *os.File) error {
	switch {
	case resp.Error != nil:
		return resp.Error
	case resp.Txn != nil:
		if err := r.send(conn, resp.Txn, netns, PodOf(a.Args)); err != nil {
			return err
		}
	}
	_, err := r.Stdout.Write(resp.Stdout)
	return err
}

// AgentCame says whether an agent's socket is at path now that was not
// (missing, or a dead agent's, as before found it) when the caller first
// looked.
func AgentCame(path string, before os.FileInfo) bool {
	fi, err := os.Stat(path)
	return err == nil && (before == nil || !os.SameFile(fi, before))
}

// askTheNewAgent asks an agent that started while the fallback ran (the
// node agent replaced in a rollout) to serve an ADD the fallback failed:
// the fallback refuses an ambient pod without an agent, and may have
// waited for the new agent's token. The fallback's error stands when
// this agent cannot answer either.
func (r *Relay) askTheNewAgent(sock string, a *Args, netns *os.File, ferr error) error {
	resp, conn, err := r.ask(sock, a, netns, "a node agent started while istio-cni-fallback served the ADD, which failed", 0)
	if conn != nil {
		defer conn.close()
	}
	if err != nil || resp.Unavailable != "" {
		return ferr
	}
	return r.finish(resp, conn, a, netns)
}

// send sends the agent's prepared requests from inside the pod's
// namespace and tells the agent how it went. A transaction that fails
// fails the ADD whether or not the agent heard.
func (r *Relay) send(conn *agentConn, prepared []byte, netns *os.File, pod string) error {
	if r.NoSteps || netns == nil {
		// The agent prepares only for a relay that asked, with a namespace.
		return NewError(ErrInternal, "the node agent sent rules to a relay that cannot send them", "")
	}
	var txn nlsteps.Txn
	err := txn.UnmarshalBinary(prepared)
	var took time.Duration
	if err == nil {
		send := r.Send
		if send == nil {
			send = nlsteps.RunIn
		}
		took, err = send(netns, &txn)
	}
	out := nlsteps.Outcome{Took: took}
	if err != nil {
		out.Error = err.Error()
	}
	var ru unix.Rusage
	if unix.Getrusage(unix.RUSAGE_SELF, &ru) == nil {
		out.CPU = time.Duration(ru.Utime.Nano() + ru.Stime.Nano())
	}
	// The agent logs and counts the pod from this; the pod's outcome
	// does not depend on it.
	body := appendOutcomeJSON(nil, &out)
	_ = conn.write(binary.BigEndian.AppendUint32(nil, uint32(len(body))), nil)
	_ = conn.write(body, nil)
	conn.closeWrite()
	if err != nil {
		return NewError(ErrInternal, fmt.Sprintf("pod %s: %v", pod, err), "")
	}
	return nil
}

// PodOf names the pod of a CNI_ARGS string ("namespace/name"), for
// messages and log lines: the relay's and the agent's.
func PodOf(args string) string {
	ns, name, _ := podArgs(args)
	return ns + "/" + name
}

// ask sends the command to the agent and reads its answer. With
// leaveAfter set (an ADD the agent had no record for), it gives up when
// no answer has begun by then (errAgentBehind).
func (r *Relay) ask(sock string, a *Args, netns *os.File, unprepared string, leaveAfter time.Duration) (*Response, *agentConn, error) {
	req := Request{Command: a.Command, ContainerID: a.ContainerID, Netns: a.Netns, IfName: a.IfName,
		Args: a.Args, Path: a.Path, Stdin: a.Stdin, Steps: !r.NoSteps && a.Command == "ADD" && netns != nil, Unprepared: unprepared}
	req.MayLeave = leaveAfter > 0 && req.Steps
	req.Framed = true
	if req.Steps {
		req.TxnForm = nlsteps.BinaryForm
		getenv := r.Getenv
		if getenv == nil {
			getenv = os.Getenv
		}
		req.ForceIPTables = getenv("FORCE_IPTABLES_BINARY")
	}
	req.HasNetnsFD = netns != nil
	body := req.appendJSON(make([]byte, 0, 512+len(a.Stdin)*4/3))
	var first time.Duration
	switch {
	case req.MayLeave:
		first = leaveAfter
	case a.Command != "ADD":
		first = r.answerWait()
	}
	connectWait := first
	if connectWait <= 0 {
		connectWait = r.answerWait()
	}
	conn, err := dialAgent(sock, connectWait, r.Timeout)
	if errors.Is(err, unix.EAGAIN) {
		return nil, nil, fmt.Errorf("%w: %s accepted no connection within %s", errAgentBehind, sock, connectWait)
	}
	if err != nil {
		// Missing socket or a dead agent's leftover one.
		return nil, nil, fmt.Errorf("%w: dial unix %s: %w", errNoAgent, sock, err)
	}
	// Closed by the caller, which may still owe the agent a send's
	// outcome; closed here on every error.
	keep := false
	defer func() {
		if !keep {
			conn.close()
		}
	}()
	// The descriptor rides on a small first write, which a stream socket
	// delivers whole; the body follows.
	var rights []byte
	if netns != nil {
		rights = unix.UnixRights(int(netns.Fd()))
	}
	if err := conn.write(binary.BigEndian.AppendUint32(nil, uint32(len(body))), rights); err != nil {
		return nil, nil, fmt.Errorf("%w: sending to %s: %w", errNoAgent, sock, err)
	}
	if err := conn.write(body, nil); err != nil {
		return nil, nil, fmt.Errorf("%w: sending to %s: %w", errNoAgent, sock, err)
	}
	if !req.Steps {
		conn.closeWrite()
	}
	// The agent ends its answer by closing its side (for a transaction,
	// only its side: it then reads the outcome).
	out, err := conn.readAll(MaxMessage, first, r.Timeout)
	if errors.Is(err, errWaitedFirst) {
		// Closed (deferred) before the fallback starts.
		return nil, nil, fmt.Errorf("%w: no answer within %s", errAgentBehind, first)
	}
	if errors.Is(err, errTooLarge) {
		return nil, nil, NewError(ErrInternal, fmt.Sprintf("bad answer from the node agent on %s: %v", sock, err), "")
	}
	if errors.Is(err, unix.EAGAIN) {
		return nil, nil, NewError(ErrTryAgainLater, fmt.Sprintf("the istio-cni node agent did not answer %s within %s", a.Command, r.Timeout), "")
	}
	// The agent went away mid-command (a restart): the command is
	// idempotent, so the fallback can do it.
	if err != nil {
		return nil, nil, fmt.Errorf("%w: no answer on %s (%w)", errNoAgent, sock, err)
	}
	if len(out) == 0 {
		return nil, nil, fmt.Errorf("%w: no answer on %s (<nil>)", errNoAgent, sock)
	}
	resp, err := ParseResponse(out)
	if err != nil {
		return nil, nil, NewError(ErrInternal, fmt.Sprintf("bad answer from the node agent on %s: %v", sock, err), "")
	}
	keep = true
	return resp, conn, nil
}

func (r *Relay) answerWait() time.Duration {
	if r.AnswerWait > 0 {
		return r.AnswerWait
	}
	return AnswerWait
}

// status answers STATUS when no agent serves: an ADD would be served by
// the fallback, so STATUS fails only when the fallback cannot run. A
// missing kubeconfig does not fail it: after a reboot the run dir is empty
// until the agent starts, and the agent's own pod (not on the host
// network, as in Istio) needs no lookup and must be able to start; other
// pods then fail their ADD (closed) until the agent is back.
func (r *Relay) status(reason string) error {
	fi, err := os.Stat(r.Fallback)
	if err == nil && (!fi.Mode().IsRegular() || fi.Mode().Perm()&0o111 == 0) {
		err = errors.New("not an executable file")
	}
	if err != nil {
		return NewError(ErrPluginNotAvailable, fmt.Sprintf("istio-cni cannot serve pods on this node: %s, and %s cannot run: %v",
			reason, r.Fallback, err), "")
	}
	return nil
}

// fallback runs the complete plugin with the runtime's environment and
// config, and passes its answer on; env adds to the environment.
func (r *Relay) fallback(reason string, a *Args, env ...string) error {
	runner := r.Runner
	if runner == nil {
		runner = execrun.OS{}
	}
	// The fallback's stderr is the runtime's, as it comes; its stdout is
	// the CNI answer, read whole.
	res, err := runner.Run(context.Background(), &execrun.Cmd{Path: r.Fallback,
		Env:   append(append(append([]string{}, r.Environ...), FallbackReasonEnv+"="+reason), env...),
		Stdin: a.Stdin, Stderr: r.Stderr,
		// Its own budgets bound it (API calls, lock waits, its commands'
		// timeouts), and it dies with the relay when the runtime kills
		// the relay at its deadline.
		Timeout: -1})
	var exit *execrun.ExitError
	switch {
	case err == nil:
		_, err = r.Stdout.Write(res.Stdout)
		return err
	case errors.As(err, &exit):
		e := &Error{}
		if jerr := json.Unmarshal(res.Stdout, e); jerr != nil || e.Msg == "" {
			return NewError(ErrInternal, fmt.Sprintf("%s failed (%s) with output %q", r.Fallback, exit.State(), res.Stdout), "")
		}
		return e
	}
	return NewError(ErrInternal, fmt.Sprintf("%s; and the plugin that works without it cannot run: %v", reason, err), "")
}
