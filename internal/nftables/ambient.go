package nftables

import (
	"fmt"
	"slices"
	"strings"

	"github.com/google/nftables"

	"github.com/istio-cni-go/istio-cni/internal/ruleset"
)

// AmbientTablePrefix names ambient mode's tables, in a pod and on the
// node, as the reference's native nftables mode does: istio-ambient-nat,
// -mangle, -raw.
const AmbientTablePrefix = "istio-ambient-"

// AmbientNATTable is the node's table of the probe SNAT and its sets.
const AmbientNATTable = AmbientTablePrefix + "nat"

// probeSetComment is the reference's description of the probe sets.
const probeSetComment = "UUID of the pods that are part of ambient mesh"

// chainPrerouting is ISTIO_PRERT under the name the reference's nftables
// mode gives it (istio-prerouting, once ChainName has lowered it).
const chainPrerouting = "ISTIO_PREROUTING"

// BuildAmbient translates an enrolled pod's plan (ruleset.BuildAmbient)
// into ambient mode's tables: the sidecar translation, under the ambient
// table and chain names.
func BuildAmbient(plan *ruleset.Plan) (*Ruleset, error) {
	rs, err := Build(renameChain(plan, ruleset.ChainPrerouting, chainPrerouting))
	if err != nil {
		return nil, err
	}
	rs.retable(AmbientTablePrefix)
	return rs, nil
}

// renameChain returns the plan with a chain renamed, as a chain and as a
// jump target.
func renameChain(plan *ruleset.Plan, from, to string) *ruleset.Plan {
	out := &ruleset.Plan{TProxyRoutes: plan.TProxyRoutes}
	for _, s := range plan.Sets() {
		c := &ruleset.Set{Family: s.Family, IPSets: s.IPSets, Rules: make([]ruleset.Rule, len(s.Rules))}
		for i, r := range s.Rules {
			if r.Chain == from {
				r.Chain = to
			}
			if r.Target() == from {
				r.Args = slices.Clone(r.Args)
				r.Args[slices.Index(r.Args, "-j")+1] = to
			}
			c.Rules[i] = r
		}
		if s.Family == ruleset.IPv6 {
			out.V6 = c
		} else {
			out.V4 = c
		}
	}
	return out
}

// retable moves the ruleset from the sidecar's tables to those of
// prefix.
func (rs *Ruleset) retable(prefix string) {
	name := func(t string) string { return prefix + strings.TrimPrefix(t, TablePrefix) }
	for i := range rs.Tables {
		rs.Tables[i] = name(rs.Tables[i])
	}
	for i := range rs.Chains {
		rs.Chains[i].Table = name(rs.Chains[i].Table)
	}
	for i := range rs.Rules {
		rs.Rules[i].Table = name(rs.Rules[i].Table)
	}
	for _, s := range rs.Sets {
		s.Table = name(s.Table)
	}
	rs.prefix = prefix
}

// BuildHostProbe translates the node's probe SNAT plan
// (ruleset.BuildHostProbe, with the kubelet's uid) into the node's
// istio-ambient-nat table, with the probe sets it looks addresses up in.
// The sets are the table's, but their elements are the probe set's
// (SyncProbes): replacing the table's rules never touches them.
func BuildHostProbe(plan *ruleset.Plan) (*Ruleset, error) {
	rs := &Ruleset{Tables: []string{AmbientNATTable}, IPv6: plan.V6 != nil, prefix: AmbientNATTable}
	sets := func(fam ruleset.Family) func(string) (*Set, error) {
		return func(name string) (*Set, error) {
			want, key := ruleset.ProbeSetV4, nftables.TypeIPAddr
			if fam == ruleset.IPv6 {
				want, key = ruleset.ProbeSetV6, nftables.TypeIP6Addr
			}
			if name != want {
				return nil, fmt.Errorf("no set %s in the node's rules (only %s)", name, want)
			}
			return rs.addSet(&Set{Table: AmbientNATTable, Name: name, KeyType: key, Comment: probeSetComment, KeepElements: true}), nil
		}
	}
	// The reference's shape: the rules straight in the base chain, with
	// no chain of their own to jump to.
	base := baseChain("nat", "POSTROUTING")
	rs.Chains = []Chain{{Table: AmbientNATTable, Name: ChainName("POSTROUTING"), Base: base}}
	for _, set := range plan.Sets() {
		for _, r := range set.Final()["nat"][ruleset.ChainPostrouting] {
			nr, err := translate(set.Family, r.Args, sets(set.Family))
			if err != nil {
				return nil, fmt.Errorf("%s nat/%s %q: %w", set.Family, ruleset.ChainPostrouting, strings.Join(r.Args, " "), err)
			}
			nr.Table, nr.Chain = AmbientNATTable, rs.Chains[0].Name
			rs.Rules = append(rs.Rules, nr)
		}
	}
	return rs, nil
}
