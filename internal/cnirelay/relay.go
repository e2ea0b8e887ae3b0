package cnirelay

import (
	"context"
	"encoding/binary"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"path/filepath"
	"strings"
	"syscall"
	"time"

	"github.com/containernetworking/cni/pkg/skel"
	"github.com/containernetworking/cni/pkg/types"
	"github.com/containernetworking/cni/pkg/version"

	"github.com/istio-cni-go/istio-cni/internal/execrun"
	"github.com/istio-cni-go/istio-cni/internal/nlsteps"
)

// DefaultRunDir is the plugin's run directory when its config names none.
const DefaultRunDir = "/var/run/istio-cni"

// Timeout bounds one command in the agent. The agent bounds its own API
// lookups by the config's k8s_retry_budget (30 s by default); this only
// catches an agent that stopped answering altogether.
const Timeout = 2 * time.Minute

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
	// Runner starts the fallback; nil means execrun.OS.
	Runner execrun.Runner
	// NoSteps makes the relay one that cannot send prepared requests, as
	// relays before them were: the agent then applies the rules.
	NoSteps bool
	// Send sends a prepared transaction from inside the namespace; nil
	// means nlsteps.RunIn.
	Send func(netns *os.File, txn *nlsteps.Txn) (time.Duration, error)
}

// Main runs the relay as a runtime executes it and returns the exit code.
func Main(about string) int {
	fallback := FallbackBinary
	if exe, err := os.Executable(); err == nil {
		fallback = filepath.Join(filepath.Dir(exe), FallbackBinary)
	}
	r := &Relay{Fallback: fallback, Environ: os.Environ(), Stdout: os.Stdout, Stderr: os.Stderr, Timeout: Timeout}
	cmd := func(name string) func(*skel.CmdArgs) error {
		return func(args *skel.CmdArgs) error { return r.Run(name, args) }
	}
	err := skel.PluginMainFuncsWithError(skel.CNIFuncs{
		Add: cmd("ADD"), Del: cmd("DEL"), Check: cmd("CHECK"), Status: cmd("STATUS"), GC: cmd("GC"),
	}, version.All, about)
	if err != nil {
		_ = err.Print()
		return 1
	}
	return 0
}

// errNoAgent means nothing answered on the socket: the fallback may run
// without any risk of doing the work twice at once.
var errNoAgent = errors.New("no node agent")

// Run serves one command: through the agent when one answers, else by
// running the complete plugin.
func (r *Relay) Run(command string, args *skel.CmdArgs) error {
	var conf struct {
		RunDir string `json:"cni_agent_run_dir"`
	}
	// A config that does not parse goes to the agent or the fallback all
	// the same: either reports it with the key that was wrong.
	_ = json.Unmarshal(args.StdinData, &conf)
	if conf.RunDir == "" {
		conf.RunDir = DefaultRunDir
	}
	sock := filepath.Join(conf.RunDir, SocketName)
	var netns *os.File
	if args.Netns != "" {
		f, err := os.Open(args.Netns)
		switch {
		case err == nil:
			defer f.Close()
			netns = f
		case command == "ADD" || command == "CHECK":
			return types.NewError(types.ErrInvalidNetNS, fmt.Sprintf("cannot open the pod's network namespace %s: %v", args.Netns, err), "")
		}
	}
	resp, conn, err := r.ask(sock, command, args, netns)
	if conn != nil {
		defer conn.Close()
	}
	switch {
	case errors.Is(err, errNoAgent) && command == "STATUS":
		return r.status(err.Error())
	case errors.Is(err, errNoAgent):
		return r.fallback(err.Error(), args)
	case err != nil:
		return err
	case resp.Unavailable != "" && command == "STATUS":
		return r.status("node agent unavailable: " + resp.Unavailable)
	case resp.Unavailable != "":
		return r.fallback("node agent unavailable: "+resp.Unavailable, args)
	case resp.Error != nil:
		return resp.Error
	case resp.Txn != nil:
		if err := r.send(conn, resp.Txn, netns, podOf(args.Args)); err != nil {
			return err
		}
	}
	_, err = r.Stdout.Write(resp.Stdout)
	return err
}

// send sends the agent's prepared requests from inside the pod's
// namespace and tells the agent how it went. A transaction that fails
// fails the ADD whether or not the agent heard.
func (r *Relay) send(conn *net.UnixConn, txn *nlsteps.Txn, netns *os.File, pod string) error {
	if r.NoSteps || netns == nil {
		// The agent prepares only for a relay that asked, with a namespace.
		return types.NewError(types.ErrInternal, "the node agent sent rules to a relay that cannot send them", "")
	}
	send := r.Send
	if send == nil {
		send = nlsteps.RunIn
	}
	took, err := send(netns, txn)
	acct := nlsteps.Outcome{Took: took}
	if err != nil {
		acct.Error = err.Error()
	}
	if body, jerr := json.Marshal(&acct); jerr == nil {
		var hdr [4]byte
		binary.BigEndian.PutUint32(hdr[:], uint32(len(body)))
		// The agent logs and counts the pod from this; the pod's
		// outcome does not depend on it.
		_, _ = conn.Write(append(hdr[:], body...))
		_ = conn.CloseWrite()
	}
	if err != nil {
		return types.NewError(types.ErrInternal, fmt.Sprintf("pod %s: %v", pod, err), "")
	}
	return nil
}

// podOf names the pod of a CNI_ARGS string, for messages.
func podOf(args string) string {
	var ns, name string
	for _, kv := range strings.Split(args, ";") {
		k, v, _ := strings.Cut(kv, "=")
		switch k {
		case "K8S_POD_NAMESPACE":
			ns = v
		case "K8S_POD_NAME":
			name = v
		}
	}
	return ns + "/" + name
}

func (r *Relay) ask(sock, command string, args *skel.CmdArgs, netns *os.File) (*Response, *net.UnixConn, error) {
	req := Request{Command: command, ContainerID: args.ContainerID, Netns: args.Netns, IfName: args.IfName,
		Args: args.Args, Path: args.Path, Stdin: args.StdinData, Steps: !r.NoSteps && command == "ADD" && netns != nil}
	if req.Steps {
		req.ForceIPTables = os.Getenv("FORCE_IPTABLES_BINARY")
	}
	var oob []byte
	if netns != nil {
		req.HasNetnsFD = true
		oob = syscall.UnixRights(int(netns.Fd()))
	}
	body, err := json.Marshal(&req)
	if err != nil {
		return nil, nil, types.NewError(types.ErrInternal, err.Error(), "")
	}
	conn, err := net.DialUnix("unix", nil, &net.UnixAddr{Name: sock, Net: "unix"})
	if err != nil {
		// Missing socket or a dead agent's leftover one.
		return nil, nil, fmt.Errorf("%w: %w", errNoAgent, err)
	}
	// Closed by the caller, which may still owe the agent a commit's
	// account; closed here on every error.
	keep := false
	defer func() {
		if !keep {
			_ = conn.Close()
		}
	}()
	if r.Timeout > 0 {
		_ = conn.SetDeadline(time.Now().Add(r.Timeout))
	}
	// The descriptor rides on a small first write, which a stream socket
	// delivers whole; the body follows.
	var hdr [4]byte
	binary.BigEndian.PutUint32(hdr[:], uint32(len(body)))
	if _, _, err := conn.WriteMsgUnix(hdr[:], oob, nil); err != nil {
		return nil, nil, fmt.Errorf("%w: sending to %s: %w", errNoAgent, sock, err)
	}
	if _, err := conn.Write(body); err != nil {
		return nil, nil, fmt.Errorf("%w: sending to %s: %w", errNoAgent, sock, err)
	}
	if !req.Steps {
		_ = conn.CloseWrite()
	}
	// The agent ends its answer by closing its side (for a commit, only
	// its side: it then reads the account).
	out, err := io.ReadAll(io.LimitReader(conn, MaxMessage))
	var ne net.Error
	if errors.As(err, &ne) && ne.Timeout() {
		return nil, nil, types.NewError(types.ErrTryAgainLater, fmt.Sprintf("the istio-cni node agent did not answer %s within %s", command, r.Timeout), "")
	}
	// The agent went away mid-command (a restart): the command is
	// idempotent, so the fallback can do it.
	if err != nil {
		return nil, nil, fmt.Errorf("%w: no answer on %s (%w)", errNoAgent, sock, err)
	}
	if len(out) == 0 {
		return nil, nil, fmt.Errorf("%w: no answer on %s (<nil>)", errNoAgent, sock)
	}
	resp := &Response{}
	if err := json.Unmarshal(out, resp); err != nil {
		return nil, nil, types.NewError(types.ErrInternal, fmt.Sprintf("bad answer from the node agent on %s: %v", sock, err), "")
	}
	keep = true
	return resp, conn, nil
}

// errPluginNotAvailable is CNI 1.1's STATUS code 50: the plugin cannot
// service ADD requests.
const errPluginNotAvailable uint = 50

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
		return types.NewError(errPluginNotAvailable, fmt.Sprintf("istio-cni cannot serve pods on this node: %s, and %s cannot run: %v",
			reason, r.Fallback, err), "")
	}
	return nil
}

// fallback runs the complete plugin with the runtime's environment and
// config, and passes its answer on.
func (r *Relay) fallback(reason string, args *skel.CmdArgs) error {
	runner := r.Runner
	if runner == nil {
		runner = execrun.OS{}
	}
	// The fallback's stderr is the runtime's, as it comes; its stdout is
	// the CNI answer, read whole.
	res, err := runner.Run(context.Background(), &execrun.Cmd{Path: r.Fallback,
		Env:   append(append([]string{}, r.Environ...), FallbackReasonEnv+"="+reason),
		Stdin: args.StdinData, Stderr: r.Stderr})
	var exit *execrun.ExitError
	switch {
	case err == nil:
		_, err = r.Stdout.Write(res.Stdout)
		return err
	case errors.As(err, &exit):
		e := &types.Error{}
		if jerr := json.Unmarshal(res.Stdout, e); jerr != nil || e.Msg == "" {
			return types.NewError(types.ErrInternal, fmt.Sprintf("%s failed (%s) with output %q", r.Fallback, exit.State(), res.Stdout), "")
		}
		return e
	}
	return types.NewError(types.ErrInternal, fmt.Sprintf("%s; and the plugin that works without it cannot run: %v", reason, err), "")
}
