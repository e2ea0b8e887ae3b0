// Package cnirelay is the runtime-facing istio-cni binary: a small process
// that hands each CNI command, with the pod's network namespace as an open
// file descriptor, to the node agent, which already holds the node's pods
// in memory and programs the rules in-process. When no agent answers it
// runs the complete plugin (istio-cni-fallback, installed next to it), so a
// pod never starts unmeshed because the agent is restarting.
//
// It imports as little as possible: a runtime starts it once per pod and
// per command, and every package initialised is paid for on each start.
// So it speaks CNI's process interface itself (the variables, VERSION,
// the error object) instead of through the CNI library's skel, whose
// checks of the command's arguments and config the agent makes
// (cniserver), and talks to the agent over raw socket calls.
package cnirelay

import "time"

// SocketName is the agent's CNI socket in the plugin's run directory.
const SocketName = "cni.sock"

// StoppedName is the file, in the plugin's run directory, whose time is
// when a node agent last stopped leaving the plugin in place (a rollout):
// its token then dies with its pod, and the fallback waits for the next
// agent's only within a while of it.
const StoppedName = ".agent-stopped"

// FallbackBinary is the complete plugin, installed next to the relay.
const FallbackBinary = "istio-cni-fallback"

// FallbackReasonEnv tells the fallback why it runs, for its log line.
const FallbackReasonEnv = "ISTIO_CNI_FALLBACK_REASON"

// FallbackSkipAgentEnv, set to 1, tells the fallback that the agent is
// behind (the relay left it): the fallback reads the pod from the API
// server without asking the agent's pod cache first.
const FallbackSkipAgentEnv = "ISTIO_CNI_FALLBACK_SKIP_AGENT"

// Request is one CNI command as the runtime gave it to the relay. The
// pod's network namespace travels as an SCM_RIGHTS descriptor with the
// first bytes, so the agent needs no view of the host's netns mounts.
type Request struct {
	Command     string `json:"command"`
	ContainerID string `json:"containerID"`
	// Netns is the runtime's path, for messages only.
	Netns      string `json:"netns,omitempty"`
	HasNetnsFD bool   `json:"hasNetnsFD,omitempty"`
	IfName     string `json:"ifName"`
	Args       string `json:"args"`
	Path       string `json:"path"`
	Stdin      []byte `json:"stdin"`
	// Steps says the relay sends a redirected pod's rules itself when the
	// agent prepares them as netlink requests (an older relay leaves it
	// unset, and the agent applies them).
	Steps bool `json:"steps,omitempty"`
	// TxnForm is the transaction form (nlsteps.BinaryForm) a relay that
	// sets Steps decodes. An agent writing another form (a release before
	// or after the relay's, met in an upgrade between the new agent's
	// socket and its copy of the binaries) treats the ADD as one without
	// Steps, or answers Unavailable to a relay that may leave, instead of
	// failing the pod with rules the relay cannot read.
	TxnForm string `json:"txnForm,omitempty"`
	// ForceIPTables is the runtime's FORCE_IPTABLES_BINARY, which the
	// agent honours when it has none of its own.
	ForceIPTables string `json:"forceIPTables,omitempty"`
	// Framed says the relay reads answers in the binary form
	// AppendFramed writes, the transaction's bytes as they are. Decoding
	// JSON cost a fresh relay process 0.08 ms per command, and the
	// transaction's base64 another 0.05 ms for Istio's default rules and
	// 0.4 ms for long lists. An older relay leaves it unset and gets
	// JSON.
	Framed bool `json:"framed,omitempty"`
	// Done, when set, says the relay served this ADD from the record the
	// agent prepared for the pod (internal/prepared), and how it went, or
	// (Command DEL) that it answered this DEL itself. The agent logs and
	// counts it and answers nothing; the relay does not wait for it to.
	Done *Done `json:"done,omitempty"`
	// Unprepared says why the relay did not serve this ADD from the
	// pod's prepared record though there was one, for the agent's log.
	Unprepared string `json:"unprepared,omitempty"`
	// MayLeave says the relay stops waiting for an answer after the
	// agent's wait (prepared.AgentWait) and runs the fallback instead:
	// the agent prepares ADDs ahead, yet had no record for this pod, so
	// it is behind (on a busy node its container's small CPU weight waits
	// for the CPU). The agent must then never write to the pod's
	// namespace itself: it hands the rules to the relay or answers
	// Unavailable, and a relay that leaves closes the connection before
	// the fallback starts.
	MayLeave bool `json:"mayLeave,omitempty"`
}

// Done is how a relay served an ADD from a prepared record.
type Done struct {
	// Skip is the record's reason the pod gets no rules; Mode its
	// interception mode otherwise.
	Skip string `json:"skip,omitempty"`
	Mode string `json:"mode,omitempty"`
	// Summary names what wrote the rules (nsfacts.Kind*); IPv6 says
	// they had IPv6 rules as well.
	Summary string `json:"summary,omitempty"`
	IPv6    bool   `json:"ipv6,omitempty"`
	// Error is why sending the rules failed, which failed the ADD.
	Error string `json:"error,omitempty"`
	// Unlocked is why the namespace's writers' lock could not be taken
	// (the rules were sent without it), for a warning in the agent's log.
	Unlocked string `json:"unlocked,omitempty"`
	// Took is the send's time, Total the relay's from its start, and CPU
	// the relay's CPU time (nanoseconds).
	Took  time.Duration `json:"took,omitempty"`
	Total time.Duration `json:"total,omitempty"`
	CPU   time.Duration `json:"cpu,omitempty"`
}

// Response is what the plugin would have printed, or its error.
type Response struct {
	Stdout []byte `json:"stdout,omitempty"`
	Error  *Error `json:"error,omitempty"`
	// Unavailable, when set, says why the agent cannot serve the command
	// (it is shutting down); the relay then runs the fallback.
	Unavailable string `json:"unavailable,omitempty"`
	// Txn, when set, is an nlsteps.Txn in its binary form: the requests
	// the relay sends from inside the pod's namespace before it prints
	// Stdout. It then sends the agent the nlsteps.Outcome, framed as the
	// request (4-byte length, JSON), on the same connection, which the
	// agent holds open, with the namespace's lock, until then.
	Txn []byte `json:"txn,omitempty"`
}

// Error is a CNI error object, as plugins print it and the CNI library's
// types.Error encodes it.
type Error struct {
	Code    uint   `json:"code"`
	Msg     string `json:"msg"`
	Details string `json:"details,omitempty"`
}

// CNI's error codes the relay uses itself (the specification's; the CNI
// library's types.Err* constants).
const (
	ErrIncompatibleCNIVersion      uint = 1
	ErrInvalidEnvironmentVariables uint = 4
	ErrIOFailure                   uint = 5
	ErrDecodingFailure             uint = 6
	ErrInvalidNetNS                uint = 8
	ErrTryAgainLater               uint = 11
	ErrInternal                    uint = 999
	// ErrPluginNotAvailable is CNI 1.1's STATUS code 50: the plugin cannot
	// service ADD requests.
	ErrPluginNotAvailable uint = 50
)

// NewError is an Error; it says what types.NewError says.
func NewError(code uint, msg, details string) *Error {
	return &Error{Code: code, Msg: msg, Details: details}
}

func (e *Error) Error() string {
	if e.Details != "" {
		return e.Msg + "; " + e.Details
	}
	return e.Msg
}

// MaxMessage bounds a request or response: a CNI config with its
// prevResult is a few kilobytes.
const MaxMessage = 4 << 20
