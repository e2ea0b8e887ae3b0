// Package podrules takes a pod's redirect parameters into its network
// namespace: the plan for the addresses the namespace holds, applied by
// the backend the plugin's config names.
//
// The node agent decides (its cache holds the pod) and the relay, a
// process the runtime starts in its own cgroup, commits: the CPU a pod's
// rules cost is then spent where the runtime's other per-pod work is,
// weighted as the runtime is, instead of in the agent's container, whose
// small CPU request loses to a busy node's pods during a burst. The
// package links no Kubernetes or HTTP client, since every relay start
// pays for what it links.
package podrules

import (
	"encoding/json"
	"errors"
	"fmt"
	"net/netip"
	"os"
	"time"

	"github.com/istio-cni-go/istio-cni/internal/iptables"
	"github.com/istio-cni-go/istio-cni/internal/nftables"
	"github.com/istio-cni-go/istio-cni/internal/podnet"
	"github.com/istio-cni-go/istio-cni/internal/redirect"
	"github.com/istio-cni-go/istio-cni/internal/ruleset"
)

// Rules is what the plugin needs from a rule backend.
type Rules interface {
	Apply(netnsPath string, plan *ruleset.Plan) (podnet.Report, error)
	Check(netnsPath string, plan *ruleset.Plan) error
	PodAddrs(netnsPath string) ([]netip.Addr, error)
}

// Both backends must serve as Rules: a method of one drifting from the
// interface fails the build here, beside the interface, not in whichever
// caller (agent, relay, repair, diag) wires that backend first.
var (
	_ Rules = (*iptables.Applier)(nil)
	_ Rules = (*nftables.Applier)(nil)
)

// BuildPlan computes the rules for a pod in a namespace: the same function
// serves the plugin, the relay, the repair controller and diagnostics, so
// all of them mean the same rules.
func BuildPlan(rules Rules, netnsPath string, params redirect.Params) (*ruleset.Plan, error) {
	addrs, err := rules.PodAddrs(netnsPath)
	if err != nil {
		return nil, err
	}
	global := false
	for _, a := range addrs {
		if !a.IsLoopback() && !a.IsLinkLocalUnicast() {
			global = true
		}
	}
	if !global {
		return nil, errors.New("the pod network namespace has no address yet: is istio-cni chained after the primary plugin?")
	}
	return ruleset.Build(params, ruleset.NeedsIPv6(addrs, params.DualStack)), nil
}

// Prepared is what the agent decided for a pod whose rules the relay
// commits: everything the commit needs, and nothing it must look up.
type Prepared struct {
	// Pod is namespace/name, for messages.
	Pod            string `json:"pod"`
	NativeNftables bool   `json:"nativeNftables,omitempty"`
	// ForceIPTables is the agent's FORCE_IPTABLES_BINARY.
	ForceIPTables string          `json:"forceIPTables,omitempty"`
	Params        redirect.Params `json:"params"`
}

// Committed is the relay's account of a commit, for the agent's log line
// and metrics.
type Committed struct {
	// Error, when set, is why the pod got no rules (its ADD fails).
	Error  string        `json:"error,omitempty"`
	Result string        `json:"result,omitempty"`
	IPv6   bool          `json:"ipv6,omitempty"`
	Plan   time.Duration `json:"plan"`
	Apply  time.Duration `json:"apply"`
}

// Backend is the rule backend the agent's decision names.
func (p *Prepared) Backend() Rules {
	if p.NativeNftables {
		return &nftables.Applier{}
	}
	return &iptables.Applier{Force: p.ForceIPTables}
}

// Commit plans the pod's rules for the namespace's addresses and applies
// them with rules (nil: the backend p names).
func Commit(p *Prepared, rules Rules, netnsPath string) Committed {
	if rules == nil {
		rules = p.Backend()
	}
	start := time.Now()
	plan, err := BuildPlan(rules, netnsPath, p.Params)
	c := Committed{Plan: time.Since(start)}
	if err != nil {
		c.Error = err.Error()
		return c
	}
	c.IPv6 = plan.V6 != nil
	applied := time.Now()
	rep, err := rules.Apply(netnsPath, plan)
	c.Apply = time.Since(applied)
	if err != nil {
		c.Error = err.Error()
		return c
	}
	c.Result = rep.String()
	return c
}

// CommitJSON is Commit over the relay's wire: the agent's Prepared in,
// the Committed to send back out, and the error that fails the ADD.
func CommitJSON(prepared []byte, netnsPath string) ([]byte, error) {
	var p Prepared
	if err := json.Unmarshal(prepared, &p); err != nil {
		return nil, fmt.Errorf("the node agent's prepared rules do not decode: %w", err)
	}
	if p.ForceIPTables == "" {
		// The runtime's setting, as the fallback plugin reads it.
		p.ForceIPTables = os.Getenv("FORCE_IPTABLES_BINARY")
	}
	c := Commit(&p, nil, netnsPath)
	out, err := json.Marshal(&c)
	if err != nil {
		return nil, err
	}
	if c.Error != "" {
		return out, fmt.Errorf("pod %s: %s", p.Pod, c.Error)
	}
	return out, nil
}
