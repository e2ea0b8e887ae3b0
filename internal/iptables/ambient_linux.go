package iptables

import (
	"time"

	"golang.org/x/sys/unix"

	"github.com/istio-cni-go/istio-cni/internal/nlsteps"
	"github.com/istio-cni-go/istio-cni/internal/podnet"
	"github.com/istio-cni-go/istio-cni/internal/ruleset"
)

// ApplyAmbient makes an enrolled pod's namespace hold exactly ambient
// mode's rules for p (ruleset.BuildAmbient) and its policy routing: one
// iptables-restore per family, none when the rules are already there.
// Rules of other components are left alone, and so is the sidecar
// TPROXY routing.
//
// A namespace iptables-nft would write fresh tables into (an enrolling
// pod's) gets them as requests prepared once per plan and sent from
// inside it: what iptables-nft-restore costs there, a process start and
// its reads, made up most of an enrolled pod's rules time (3.6 ms, against
// well under one prepared).
func (a *Applier) ApplyAmbient(netnsPath string, p ruleset.AmbientParams) (podnet.Report, error) {
	start := time.Now()
	plan := ruleset.BuildAmbient(p)
	if facts, why, err := a.Examine(netnsPath); err == nil && why == "" {
		// Not stored for the fallback, which serves no ambient pod.
		// Rules over a relay's bound are kept as their size alone, with
		// no requests: those are applied in place.
		if txn, _, err := a.prepareFresh(facts, plan, ""); err == nil && txn != nil && txn.Oversize == 0 {
			// A sidecar's routing steps (its IPv6 passthrough address)
			// are not ambient mode's, which SendAmbient sets itself.
			rules := &nlsteps.Txn{Undo: txn.Undo, Summary: txn.Summary}
			for _, st := range txn.Steps {
				if st.Proto != unix.NETLINK_ROUTE {
					rules.Steps = append(rules.Steps, st)
				}
			}
			if sent, err := podnet.SendAmbient(netnsPath, rules, p.IPv6); sent {
				// Reported as an apply in place reports a fresh namespace.
				v6 := map[bool]string{false: "none", true: "applied"}[p.IPv6]
				rep := podnet.Report{Families: []podnet.FamilyReport{
					{Family: ruleset.IPv4, Variant: VariantNFT, Action: "applied", Duration: time.Since(start), Note: podnet.NotePrepared},
					{Family: ruleset.IPv6, Variant: VariantNFT, Action: v6, Note: podnet.NotePrepared}}}
				return rep, err
			}
		}
	}
	var rep podnet.Report
	err := a.inPod(netnsPath, func(t *podTarget) error {
		var err error
		if rep, err = a.apply(t, plan); err != nil {
			return err
		}
		return podnet.SyncAmbientRouting(true, p.IPv6)
	})
	return rep, err
}

// RemoveAmbient deletes every rule and chain of ours and ambient mode's
// policy routing from the namespace.
func (a *Applier) RemoveAmbient(netnsPath string) (podnet.Report, error) {
	var rep podnet.Report
	err := a.inPod(netnsPath, func(t *podTarget) error {
		var err error
		if rep, err = a.apply(t, &ruleset.Plan{V4: &ruleset.Set{Family: ruleset.IPv4}}); err != nil {
			return err
		}
		return podnet.SyncAmbientRouting(false, true)
	})
	return rep, err
}

// CheckAmbient returns an error naming every difference between the
// namespace and what ApplyAmbient(p) makes of it.
func (a *Applier) CheckAmbient(netnsPath string, p ruleset.AmbientParams) error {
	plan := ruleset.BuildAmbient(p)
	return a.inPod(netnsPath, func(t *podTarget) error {
		plan, diffs, err := a.diff(t, plan)
		if err != nil {
			return err
		}
		missing, err := podnet.AmbientRoutingMismatch(p.IPv6)
		if err != nil {
			return err
		}
		return podnet.Mismatch(plan, append(diffs, missing...))
	})
}
