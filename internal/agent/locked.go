package agent

import (
	"log/slog"
	"net/netip"

	"github.com/istio-cni-go/istio-cni/internal/iptables"
	"github.com/istio-cni-go/istio-cni/internal/nftables"
	"github.com/istio-cni-go/istio-cni/internal/nslock"
	"github.com/istio-cni-go/istio-cni/internal/plugin"
	"github.com/istio-cni-go/istio-cni/internal/podnet"
	"github.com/istio-cni-go/istio-cni/internal/prepared"
	"github.com/istio-cni-go/istio-cni/internal/ruleset"
)

// lockedRules is a rule backend whose reads-then-writes of a namespace
// hold that namespace's lock, shared with the CNI server's commands, and
// whose writes also hold the namespace's writers' lock under runDir,
// shared with the relays and the fallback (nslock.LockWriters), taken
// after the first as the CNI server's commands take them.
type lockedRules struct {
	plugin.Rules
	locker *nslock.Locker
	runDir string
	log    *slog.Logger
}

var _ plugin.Rules = (*lockedRules)(nil)

func (r *lockedRules) lock(netnsPath string) func() {
	key, err := nslock.KeyOfPath(netnsPath)
	if err != nil {
		// The backend reports the missing namespace itself.
		return func() {}
	}
	return r.locker.Lock(key)
}

func (r *lockedRules) Apply(netnsPath string, plan *ruleset.Plan) (podnet.Report, error) {
	defer r.lock(netnsPath)()
	if r.runDir != "" {
		// A relay sending a prepared transaction into the namespace at
		// the same moment (a sandbox made again, whose pod the start-up
		// scan repairs) then finds the rules in, rather than has its
		// transaction refused.
		defer plugin.LockWriters(r.log, r.runDir, netnsPath)()
	}
	return r.Rules.Apply(netnsPath, plan)
}

func (r *lockedRules) Check(netnsPath string, plan *ruleset.Plan) error {
	defer r.lock(netnsPath)()
	return r.Rules.Check(netnsPath, plan)
}

func (r *lockedRules) PodAddrs(netnsPath string) ([]netip.Addr, error) {
	return r.Rules.PodAddrs(netnsPath)
}

// The agent's only references to the rule backends are in this file.

// iptablesRules is the iptables backend, with the variant forced as the
// plugin's FORCE_IPTABLES_BINARY does.
func iptablesRules(cfg *Config) plugin.Rules {
	return &iptables.Applier{Force: cfg.ForceIPTablesBinary}
}

// publishForcedVariant tells the fallback, in the run directory, the
// variant the agent forces, so that the pods it serves get their rules
// where the agent's go.
func publishForcedVariant(runDir string, cfg *Config) error {
	return prepared.WriteForcedVariant(runDir, cfg.ForceIPTablesBinary)
}

// nftablesRules is the nftables backend.
func nftablesRules() plugin.Rules { return &nftables.Applier{} }
