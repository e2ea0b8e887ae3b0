// Package podrules takes a pod's redirect parameters into its network
// namespace: the plan for the addresses the namespace holds, applied by
// the backend the plugin's config names, or prepared as netlink requests
// for the relay to send.
//
// The node agent decides (its cache holds the pod) and prepares; the
// relay, a process the runtime starts in its own cgroup, sends: the CPU a
// pod's rules cost in the kernel is then spent where the runtime's other
// per-pod work is, weighted as the runtime is, instead of in the agent's
// container, whose small CPU request loses to a busy node's pods during a
// burst.
package podrules

import (
	"errors"
	"fmt"
	"net/netip"
	"strings"

	"golang.org/x/sys/unix"

	"github.com/istio-cni-go/istio-cni/internal/iptables"
	"github.com/istio-cni-go/istio-cni/internal/nftables"
	"github.com/istio-cni-go/istio-cni/internal/nlsteps"
	"github.com/istio-cni-go/istio-cni/internal/nsfacts"
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
	return planFor(addrs, params)
}

// HoldsRules reports whether the namespace holds redirect rules of ours
// in any form a release of ours writes, whichever backend or iptables
// variant wrote them: native nftables tables (istio-proxy-*,
// istio-ambient-*), or ISTIO_ chains through iptables-nft or legacy
// iptables. A backend switched across an upgrade must not make a running
// pod look bare. The iptables forms are read (Check against a plan of
// none, which differs exactly when any of ours is there) only where the
// namespace has tables of that variant.
func HoldsRules(netnsPath string) (bool, error) {
	facts, err := nsfacts.ReadFactsIn(netnsPath)
	if err != nil {
		return false, err
	}
	iptablesNFT := false
	for _, t := range facts.Tables {
		switch {
		case t.Family == unix.NFPROTO_INET && (strings.HasPrefix(t.Name, nftables.TablePrefix) || strings.HasPrefix(t.Name, nftables.AmbientTablePrefix)):
			return true, nil
		case t.Family == unix.NFPROTO_IPV4 || t.Family == unix.NFPROTO_IPV6:
			iptablesNFT = true
		}
	}
	var readers []Rules
	if iptablesNFT {
		readers = append(readers, &iptables.Applier{Force: iptables.VariantNFT})
	}
	if facts.LegacyTables {
		readers = append(readers, &iptables.Applier{Force: iptables.VariantLegacy})
	}
	none := &ruleset.Plan{V4: &ruleset.Set{Family: ruleset.IPv4}}
	for _, r := range readers {
		err := r.Check(netnsPath, none)
		var m *podnet.MismatchError
		switch {
		case errors.As(err, &m):
			return true, nil
		case err != nil:
			return false, err
		}
	}
	return false, nil
}

func planFor(addrs []netip.Addr, params redirect.Params) (*ruleset.Plan, error) {
	if !nsfacts.HasGlobalAddr(addrs) {
		return nil, errors.New("the pod network namespace has no address yet: is istio-cni chained after the primary plugin?")
	}
	return ruleset.Build(params, ruleset.NeedsIPv6(addrs, params.DualStack)), nil
}

// Preparer is a backend that can say what Apply would do to a namespace
// holding none of our rules as netlink requests, for the relay to send
// (iptables.Applier, nftables.Applier).
type Preparer interface {
	// Examine reads the namespace once: its facts (nsfacts.ReadFacts), and
	// why it cannot take prepared requests ("" when it can: rules are
	// there already, say).
	Examine(netnsPath string) (facts nsfacts.Facts, unfit string, err error)
	// PrepareFresh returns the requests for a namespace Examine found fit
	// (with the facts it read there), or why it cannot after all.
	PrepareFresh(facts nsfacts.Facts, plan *ruleset.Plan) (txn *nlsteps.Txn, inPlace string, err error)
}

var (
	_ Preparer = (*iptables.Applier)(nil)
	_ Preparer = (*nftables.Applier)(nil)
)

// PreparePod is a pod's plan and, when the namespace can take them, its
// rules as requests for the relay; with none, why the rules must be
// applied in place (a backend that cannot prepare, a namespace that holds
// rules already, a plan too large to hand over). The namespace is read
// once for both.
func PreparePod(rules Rules, netnsPath string, params redirect.Params) (*ruleset.Plan, *nlsteps.Txn, string, error) {
	p, ok := rules.(Preparer)
	if !ok {
		plan, err := BuildPlan(rules, netnsPath, params)
		return plan, nil, "the rule backend applies only in place", err
	}
	return prepareIn(p, netnsPath, params, func(facts nsfacts.Facts, plan *ruleset.Plan) (*nlsteps.Txn, string, error) {
		return prepareFresh(p, facts, plan)
	})
}

// prepareIn reads the namespace once, builds the pod's plan for its
// addresses, and, when the namespace can take requests, asks prepare for
// them; otherwise it says why the rules must be applied in place.
func prepareIn(p Preparer, netnsPath string, params redirect.Params,
	prepare func(nsfacts.Facts, *ruleset.Plan) (*nlsteps.Txn, string, error)) (*ruleset.Plan, *nlsteps.Txn, string, error) {
	facts, why, err := p.Examine(netnsPath)
	if err != nil {
		return nil, nil, "", err
	}
	plan, err := planFor(facts.Addrs, params)
	if err != nil || why != "" {
		return plan, nil, why, err
	}
	txn, why, err := prepare(facts, plan)
	return plan, txn, why, err
}

// StoredPreparer is a backend whose prepared requests the agent stores
// for other processes (iptables.Applier: its requests cost an
// iptables-restore to prepare).
type StoredPreparer interface {
	Preparer
	// PrepareStored returns the requests the agent stored in dir for a
	// namespace Examine found fit, or why there are none to send.
	PrepareStored(dir string, facts nsfacts.Facts, plan *ruleset.Plan) (txn *nlsteps.Txn, inPlace string, err error)
}

var _ StoredPreparer = (*iptables.Applier)(nil)

// PrepareFromStore is PreparePod for a process that prepares nothing
// itself (the fallback): the pod's plan and, when the namespace can take
// them and the agent stored them in dir, the plan's requests; with none,
// why the rules must be applied in place. The namespace is read once for
// both.
func PrepareFromStore(rules Rules, dir, netnsPath string, params redirect.Params) (*ruleset.Plan, *nlsteps.Txn, string, error) {
	p, ok := rules.(StoredPreparer)
	if !ok {
		plan, err := BuildPlan(rules, netnsPath, params)
		return plan, nil, "the rule backend stores no requests", err
	}
	return prepareIn(p, netnsPath, params, func(facts nsfacts.Facts, plan *ruleset.Plan) (*nlsteps.Txn, string, error) {
		return p.PrepareStored(dir, facts, plan)
	})
}

// prepareFresh is p.PrepareFresh with transactions too large to hand to
// a relay turned down.
func prepareFresh(p Preparer, facts nsfacts.Facts, plan *ruleset.Plan) (*nlsteps.Txn, string, error) {
	txn, why, err := p.PrepareFresh(facts, plan)
	if txn != nil && (txn.Oversize > 0 || txn.Size() > nlsteps.MaxTxn) {
		return nil, fmt.Sprintf("its rules are %d KiB of requests, more than a relay is handed", max(txn.Oversize, txn.Size())>>10), nil
	}
	return txn, why, err
}

// HerePreparer is a backend whose requests cost the process that sends
// them little to prepare (nftables.Applier: they are recorded from the
// library's messages), so a process with no agent's store to read (the
// fallback) prepares its pod's itself rather than apply in place.
type HerePreparer interface {
	Preparer
	// PrepareHere is PrepareFresh for the process that sends the
	// requests itself: nothing is kept for others or handed over, so no
	// plan is too large.
	PrepareHere(facts nsfacts.Facts, plan *ruleset.Plan) (txn *nlsteps.Txn, inPlace string, err error)
}

var _ HerePreparer = (*nftables.Applier)(nil)

// PrepareToSend is PreparePod for the process that sends the requests
// itself, of a backend that prepares them cheaply (HerePreparer): the
// pod's plan and its requests, or why the rules must be applied in place
// (the backend prepares none this way, or the namespace holds rules
// already).
func PrepareToSend(rules Rules, netnsPath string, params redirect.Params) (*ruleset.Plan, *nlsteps.Txn, string, error) {
	p, ok := rules.(HerePreparer)
	if !ok {
		plan, err := BuildPlan(rules, netnsPath, params)
		return plan, nil, "the rule backend prepares no requests for the process that sends them", err
	}
	return prepareIn(p, netnsPath, params, p.PrepareHere)
}

// PrepareAhead is a pod's rules as requests for a namespace that holds
// none of ours, prepared before the namespace exists (internal/prepared):
// with IPv6 rules as well when v6 is set. With none, why the backend
// cannot prepare them; the relay then asks the agent, which reads the
// namespace.
func PrepareAhead(rules Rules, params redirect.Params, v6 bool) (*nlsteps.Txn, string, error) {
	p, ok := rules.(Preparer)
	if !ok {
		return nil, "the rule backend applies only in place", nil
	}
	return prepareFresh(p, nsfacts.Facts{}, ruleset.Build(params, v6))
}
