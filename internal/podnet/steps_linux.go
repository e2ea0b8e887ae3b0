package podnet

import (
	"encoding/binary"
	"net/netip"

	"github.com/vishvananda/netlink"
	"golang.org/x/sys/unix"

	"github.com/istio-cni-go/istio-cni/internal/nlsteps"
	"github.com/istio-cni-go/istio-cni/internal/ruleset"
)

// loIndex is lo's interface index: the kernel gives it 1 in every network
// namespace.
const loIndex = 1

// RoutingSteps is SyncRouting for a namespace that has none of it yet, as
// requests a relay sends from inside the pod's namespace: the IPv6
// passthrough address and the TPROXY policy route, each made as
// SyncRouting makes it (TestRoutingSteps compares the two).
func RoutingSteps(plan *ruleset.Plan) []nlsteps.Step {
	s := nlsteps.Step{Proto: unix.NETLINK_ROUTE, ExistOK: true}
	if plan.V6 != nil {
		s.Add(unix.RTM_NEWADDR, nlsteps.FlagAck|nlsteps.FlagCreate|nlsteps.FlagExcl, passthroughAddrMsg(), "address ::6/128 on lo")
	}
	if plan.TProxyRoutes {
		families := []uint8{unix.AF_INET}
		if plan.V6 != nil {
			families = append(families, unix.AF_INET6)
		}
		for _, fam := range families {
			name := "IPv4"
			if fam == unix.AF_INET6 {
				name = "IPv6"
			}
			s.Add(unix.RTM_NEWRULE, nlsteps.FlagAck|nlsteps.FlagCreate|nlsteps.FlagExcl, tproxyRuleMsg(fam),
				name+" policy rule fwmark 1337 lookup 133")
			s.Add(unix.RTM_NEWROUTE, nlsteps.FlagAck|nlsteps.FlagCreate|nlsteps.FlagReplace, tproxyRouteMsg(fam),
				name+" route local default dev lo table 133")
		}
	}
	if s.Len() == 0 {
		return nil
	}
	return []nlsteps.Step{s}
}

func passthroughAddrMsg() []byte {
	ip := netip.MustParseAddr("::6").AsSlice()
	// ifaddrmsg: family, prefix length, flags, scope, index.
	b := []byte{unix.AF_INET6, 128, 0, unix.RT_SCOPE_UNIVERSE}
	b = binary.NativeEndian.AppendUint32(b, loIndex)
	b = nlsteps.Attr(b, unix.IFA_LOCAL, ip)
	return nlsteps.Attr(b, unix.IFA_ADDRESS, ip)
}

// tproxyRulePriority is where the kernel puts the first rule added to a
// namespace, before main's (32766). Named, so that sending the rule twice
// makes one: a rule without a priority is a new rule each time.
const tproxyRulePriority = 32765

// tproxyRuleMsg is TProxyRule as netlink.RuleAdd sends it, at the
// priority the kernel gives it in a namespace that has no other.
func tproxyRuleMsg(family uint8) []byte {
	// fib_rule_hdr: family, dst_len, src_len, tos, table, two reserved
	// bytes (the library puts its rtmsg's protocol and scope there),
	// action, flags.
	b := []byte{family, 0, 0, 0, ruleset.TProxyRouteTable, unix.RTPROT_BOOT, unix.RT_SCOPE_UNIVERSE, unix.FR_ACT_TO_TBL}
	b = binary.NativeEndian.AppendUint32(b, 0)
	b = nlsteps.Attr(b, unix.FRA_PRIORITY, binary.NativeEndian.AppendUint32(nil, tproxyRulePriority))
	return nlsteps.Attr(b, unix.FRA_FWMARK, binary.NativeEndian.AppendUint32(nil, ruleset.TProxyMarkValue))
}

// tproxyRouteMsg is syncTProxyRoutes' route as netlink.RouteReplace
// sends it.
func tproxyRouteMsg(family uint8) []byte {
	dst := []byte{0, 0, 0, 0}
	if family == unix.AF_INET6 {
		dst = make([]byte, 16)
	}
	// rtmsg: family, dst_len, src_len, tos, table, protocol, scope, type,
	// flags.
	b := []byte{family, 0, 0, 0, ruleset.TProxyRouteTable, unix.RTPROT_BOOT, unix.RT_SCOPE_HOST, unix.RTN_LOCAL}
	b = binary.NativeEndian.AppendUint32(b, 0)
	b = nlsteps.Attr(b, unix.RTA_DST, dst)
	return nlsteps.Attr(b, unix.RTA_OIF, binary.NativeEndian.AppendUint32(nil, loIndex))
}

// HasTProxyRule reports whether the namespace (the calling thread's)
// has the TPROXY policy rule in either family: what SyncRouting would
// remove when the plan has no TPROXY.
func HasTProxyRule() (bool, error) {
	for _, fam := range []int{netlink.FAMILY_V4, netlink.FAMILY_V6} {
		has, err := hasTProxyRule(fam)
		if err != nil || has {
			return has, err
		}
	}
	return false, nil
}
