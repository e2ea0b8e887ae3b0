package podnet

import (
	"errors"
	"fmt"
	"net"
	"os"
	"strings"
	"syscall"

	"github.com/containernetworking/plugins/pkg/netlinksafe"
	"github.com/vishvananda/netlink"
	"golang.org/x/sys/unix"

	"github.com/istio-cni-go/istio-cni/internal/nlsteps"
	"github.com/istio-cni-go/istio-cni/internal/ruleset"
)

// InboundRule is ambient mode's policy rule for a family: packets whose
// connection ztunnel opened towards the app (ConnMark, restored to the
// packet) look up the table that delivers everything locally, which is
// how the app's replies to ztunnel's transparent sockets (bound to the
// client's address) reach ztunnel instead of the client.
func InboundRule(family int) *netlink.Rule {
	r := netlink.NewRule()
	r.Family = family
	r.Mark = ruleset.ConnMarkValue
	mask := uint32(ruleset.MarkMask)
	r.Mask = &mask
	r.Table = ruleset.InboundRouteTable
	r.Priority = ruleset.InboundRulePriority
	return r
}

// inboundRoute is the one route of the inbound table for a family.
func inboundRoute(lo netlink.Link, family int) *netlink.Route {
	dst := &net.IPNet{IP: net.IPv4zero, Mask: net.CIDRMask(0, 32)}
	if family == netlink.FAMILY_V6 {
		dst = &net.IPNet{IP: net.IPv6zero, Mask: net.CIDRMask(0, 128)}
	}
	return &netlink.Route{LinkIndex: lo.Attrs().Index, Dst: dst, Table: ruleset.InboundRouteTable, Type: unix.RTN_LOCAL, Scope: netlink.SCOPE_HOST}
}

// ambientFamilies are the families of an ambient pod's routing. The
// IPv6 route needs IPv6 on lo, which some pods switch off: the rule
// alone then does no harm and the route is left out, as the reference
// does.
func ambientFamilies(v6 bool) (rules, routes []int) {
	rules, routes = []int{netlink.FAMILY_V4}, []int{netlink.FAMILY_V4}
	if v6 {
		rules = append(rules, netlink.FAMILY_V6)
		if b, err := os.ReadFile("/proc/sys/net/ipv6/conf/lo/disable_ipv6"); err == nil && strings.TrimSpace(string(b)) != "1" {
			routes = append(routes, netlink.FAMILY_V6)
		}
	}
	return rules, routes
}

func inboundRules(family int) ([]netlink.Rule, error) {
	rules, err := netlinksafe.RuleListFiltered(family, InboundRule(family),
		netlink.RT_FILTER_MARK|netlink.RT_FILTER_MASK|netlink.RT_FILTER_TABLE|netlink.RT_FILTER_PRIORITY)
	if err != nil {
		return nil, fmt.Errorf("listing policy rules: %w", err)
	}
	return rules, nil
}

func inboundRoutes(family int) ([]netlink.Route, error) {
	routes, err := netlinksafe.RouteListFiltered(family, &netlink.Route{Table: ruleset.InboundRouteTable}, netlink.RT_FILTER_TABLE)
	if err != nil {
		return nil, fmt.Errorf("listing routes of table %d: %w", ruleset.InboundRouteTable, err)
	}
	return routes, nil
}

// SyncAmbientRouting adds (want) or removes ambient mode's policy rule and
// local route, for IPv4 and, with v6, IPv6; doing what is already done
// changes nothing. Removal takes both families whatever v6 says, so a
// pod whose IPv6 setting changed keeps nothing of ours. It must run
// inside the pod's namespace.
func SyncAmbientRouting(want, v6 bool) error {
	lo, err := netlinksafe.LinkByName("lo")
	if err != nil {
		return fmt.Errorf("finding lo: %w", err)
	}
	ruleFams, routeFams := ambientFamilies(v6 || !want)
	for _, fam := range ruleFams {
		have, err := inboundRules(fam)
		if err != nil {
			return err
		}
		switch {
		case want && len(have) == 0:
			if err := netlink.RuleAdd(InboundRule(fam)); err != nil && !errors.Is(err, syscall.EEXIST) {
				return fmt.Errorf("adding policy rule fwmark %#x/%#x pref %d lookup %d: %w",
					ruleset.ConnMarkValue, ruleset.MarkMask, ruleset.InboundRulePriority, ruleset.InboundRouteTable, err)
			}
		case !want:
			for range have {
				if err := netlink.RuleDel(InboundRule(fam)); err != nil && !errors.Is(err, syscall.ENOENT) {
					return fmt.Errorf("deleting policy rule fwmark %#x/%#x lookup %d: %w", ruleset.ConnMarkValue, ruleset.MarkMask, ruleset.InboundRouteTable, err)
				}
			}
		}
	}
	for _, fam := range routeFams {
		route := inboundRoute(lo, fam)
		if want {
			if err := netlink.RouteReplace(route); err != nil {
				return fmt.Errorf("adding local default route dev lo in table %d: %w", ruleset.InboundRouteTable, err)
			}
			continue
		}
		have, err := inboundRoutes(fam)
		if err != nil {
			return err
		}
		for i := range have {
			if err := netlink.RouteDel(&have[i]); err != nil && !errors.Is(err, syscall.ESRCH) && !errors.Is(err, syscall.ENOENT) {
				return fmt.Errorf("deleting route %s of table %d: %w", have[i].Dst, ruleset.InboundRouteTable, err)
			}
		}
	}
	return nil
}

// AmbientRoutingMismatch lists what of ambient mode's routing the
// namespace lacks, for a check to report. It must run inside the pod's
// namespace.
func AmbientRoutingMismatch(v6 bool) ([]string, error) {
	var out []string
	ruleFams, routeFams := ambientFamilies(v6)
	name := map[int]string{netlink.FAMILY_V4: "IPv4", netlink.FAMILY_V6: "IPv6"}
	for _, fam := range ruleFams {
		have, err := inboundRules(fam)
		if err != nil {
			return nil, err
		}
		if len(have) == 0 {
			out = append(out, fmt.Sprintf("%s policy rule fwmark %#x/%#x pref %d lookup %d missing",
				name[fam], ruleset.ConnMarkValue, ruleset.MarkMask, ruleset.InboundRulePriority, ruleset.InboundRouteTable))
		}
	}
	for _, fam := range routeFams {
		have, err := inboundRoutes(fam)
		if err != nil {
			return nil, err
		}
		found := false
		for i := range have {
			r := &have[i]
			deflt := r.Dst == nil
			if !deflt {
				ones, _ := r.Dst.Mask.Size()
				deflt = ones == 0
			}
			found = found || (r.Type == unix.RTN_LOCAL && deflt)
		}
		if !found {
			out = append(out, fmt.Sprintf("%s local default route dev lo in table %d missing", name[fam], ruleset.InboundRouteTable))
		}
	}
	return out, nil
}

// SendAmbient gives the namespace at netnsPath an enrolled pod's rules as
// prepared requests (txn, for a namespace with none of our tables),
// sent from this thread inside it, then ambient mode's policy routing.
// sent is false, with nothing applied, when the kernel refused the
// requests (a table of ours made meanwhile, a kernel that wants what the
// preparation did not foresee): the caller then applies in place, which
// handles what is there and names a refusal in its own words.
func SendAmbient(netnsPath string, txn *nlsteps.Txn, v6 bool) (sent bool, err error) {
	f, err := os.Open(netnsPath) //nolint:gosec // G304: the agent's descriptor of the pod's namespace, entered only if it is one
	if err != nil {
		return false, fmt.Errorf("opening the pod's network namespace: %w", err)
	}
	defer f.Close()
	err = nlsteps.InNetNS(f, func() error {
		if nlsteps.Run(txn) != nil {
			return nil
		}
		sent = true
		return SyncAmbientRouting(true, v6)
	})
	return sent, err
}
