// Package cnirelay is the runtime-facing istio-cni binary: a small process
// that hands each CNI command, with the pod's network namespace as an open
// file descriptor, to the node agent, which already holds the node's pods
// in memory and programs the rules in-process. When no agent answers it
// runs the complete plugin (istio-cni-fallback, installed next to it), so a
// pod never starts unmeshed because the agent is restarting.
//
// It imports as little as possible: a runtime starts it once per pod and
// per command, and every package initialised is paid for on each start.
package cnirelay

import (
	"github.com/containernetworking/cni/pkg/types"

	"github.com/istio-cni-go/istio-cni/internal/nlsteps"
)

// SocketName is the agent's CNI socket in the plugin's run directory.
const SocketName = "cni.sock"

// FallbackBinary is the complete plugin, installed next to the relay.
const FallbackBinary = "istio-cni-fallback"

// FallbackReasonEnv tells the fallback why it runs, for its log line.
const FallbackReasonEnv = "ISTIO_CNI_FALLBACK_REASON"

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
	// ForceIPTables is the runtime's FORCE_IPTABLES_BINARY, which the
	// agent honours when it has none of its own.
	ForceIPTables string `json:"forceIPTables,omitempty"`
}

// Response is what the plugin would have printed, or its error.
type Response struct {
	Stdout []byte       `json:"stdout,omitempty"`
	Error  *types.Error `json:"error,omitempty"`
	// Unavailable, when set, says why the agent cannot serve the command
	// (it is shutting down); the relay then runs the fallback.
	Unavailable string `json:"unavailable,omitempty"`
	// Txn, when set, are the requests the relay sends from inside the
	// pod's namespace before it prints Stdout; it then sends the agent the
	// nlsteps.Outcome, framed as the request (4-byte length, JSON), on the
	// same connection, which the agent holds open, with the namespace's
	// lock, until then.
	Txn *nlsteps.Txn `json:"txn,omitempty"`
}

// MaxMessage bounds a request or response: a CNI config with its
// prevResult is a few kilobytes.
const MaxMessage = 4 << 20
