package podnet

import (
	"errors"
	"fmt"
	"net"
	"net/netip"
	"strings"
	"syscall"

	"github.com/containernetworking/plugins/pkg/netlinksafe"
	"github.com/containernetworking/plugins/pkg/ns"
	"github.com/vishvananda/netlink"
	"golang.org/x/sys/unix"

	"github.com/istio-cni-go/istio-cni/internal/ruleset"
)

// SyncRouting sets up what the rules need besides netfilter: the IPv6
// passthrough address and the TPROXY policy route (removed when not
// wanted). It must run inside the pod's namespace.
func SyncRouting(plan *ruleset.Plan) error {
	if plan.V6 != nil {
		if err := ensurePassthroughV6(); err != nil {
			return err
		}
	}
	return syncTProxyRoutes(plan.TProxyRoutes, plan.V6 != nil)
}

// Mismatch completes a backend's rule differences with the routing the
// plan needs but the namespace lacks, and says all of it in one error (nil
// when nothing differs). It must run inside the pod's namespace.
func Mismatch(plan *ruleset.Plan, diffs []string) error {
	if plan.TProxyRoutes {
		ok, err := hasTProxyRule(netlink.FAMILY_V4)
		if err != nil {
			return err
		}
		if !ok {
			diffs = append(diffs, "IPv4 policy rule fwmark 1337 lookup 133 missing")
		}
	}
	if len(diffs) > 0 {
		return &MismatchError{Diffs: diffs}
	}
	return nil
}

// MismatchError is a Check's finding that the namespace's rules differ
// from the plan, as against a failure to read them.
type MismatchError struct {
	// Diffs says what differs, for people to read.
	Diffs []string
}

func (e *MismatchError) Error() string {
	return "redirect rules differ from what the pod needs: " + strings.Join(e.Diffs, "; ")
}

// ensurePassthroughV6 adds ::6/128 to lo: IPv6 loopback is a single
// address, and the proxy binds ::6 as the source of inbound passthrough.
func ensurePassthroughV6() error {
	lo, err := netlinksafe.LinkByName("lo")
	if err != nil {
		return fmt.Errorf("finding lo: %w", err)
	}
	addr := &netlink.Addr{IPNet: &net.IPNet{IP: net.ParseIP("::6"), Mask: net.CIDRMask(128, 128)}}
	if err := netlink.AddrAdd(lo, addr); err != nil && !errors.Is(err, syscall.EEXIST) {
		return fmt.Errorf("adding ::6/128 to lo: %w", err)
	}
	return nil
}

// TProxyRule is the policy rule of the TPROXY mode for a family: packets
// marked 1337 look up table 133.
func TProxyRule(family int) *netlink.Rule {
	r := netlink.NewRule()
	r.Family = family
	r.Mark = ruleset.TProxyMarkValue
	r.Table = ruleset.TProxyRouteTable
	return r
}

func hasTProxyRule(family int) (bool, error) {
	rules, err := netlinksafe.RuleListFiltered(family, TProxyRule(family), netlink.RT_FILTER_MARK|netlink.RT_FILTER_TABLE)
	if err != nil {
		return false, fmt.Errorf("listing policy rules: %w", err)
	}
	return len(rules) > 0, nil
}

// syncTProxyRoutes sends packets marked 1337 to a table whose only route
// delivers everything locally, which is what lets TPROXY hand foreign
// destinations to the proxy's socket.
func syncTProxyRoutes(want, v6 bool) error {
	lo, err := netlinksafe.LinkByName("lo")
	if err != nil {
		return fmt.Errorf("finding lo: %w", err)
	}
	families := []int{netlink.FAMILY_V4}
	if v6 || !want {
		families = append(families, netlink.FAMILY_V6)
	}
	for _, fam := range families {
		has, err := hasTProxyRule(fam)
		if err != nil {
			return err
		}
		dst := &net.IPNet{IP: net.IPv4zero, Mask: net.CIDRMask(0, 32)}
		if fam == netlink.FAMILY_V6 {
			dst = &net.IPNet{IP: net.IPv6zero, Mask: net.CIDRMask(0, 128)}
		}
		route := &netlink.Route{LinkIndex: lo.Attrs().Index, Dst: dst, Table: ruleset.TProxyRouteTable, Type: unix.RTN_LOCAL, Scope: netlink.SCOPE_HOST}
		if !want {
			if has {
				if err := netlink.RuleDel(TProxyRule(fam)); err != nil && !errors.Is(err, syscall.ENOENT) {
					return fmt.Errorf("deleting TPROXY policy rule: %w", err)
				}
				if err := netlink.RouteDel(route); err != nil && !errors.Is(err, syscall.ESRCH) && !errors.Is(err, syscall.ENOENT) {
					return fmt.Errorf("deleting TPROXY route: %w", err)
				}
			}
			continue
		}
		if !has {
			if err := netlink.RuleAdd(TProxyRule(fam)); err != nil && !errors.Is(err, syscall.EEXIST) {
				return fmt.Errorf("adding policy rule fwmark %d lookup %d: %w", ruleset.TProxyMarkValue, ruleset.TProxyRouteTable, err)
			}
		}
		if err := netlink.RouteReplace(route); err != nil {
			return fmt.Errorf("adding local default route in table %d: %w", ruleset.TProxyRouteTable, err)
		}
	}
	return nil
}

// PodAddrs lists the namespace's addresses in the kernel's order (all IPv4
// first), which is what decides whether IPv6 rules are needed.
func PodAddrs(netnsPath string) ([]netip.Addr, error) {
	var out []netip.Addr
	err := ns.WithNetNSPath(netnsPath, func(ns.NetNS) error {
		addrs, err := netlinksafe.AddrList(nil, netlink.FAMILY_ALL)
		if err != nil {
			return fmt.Errorf("listing pod addresses: %w", err)
		}
		for _, a := range addrs {
			if ip, ok := netip.AddrFromSlice(a.IP); ok {
				out = append(out, ip.Unmap())
			}
		}
		return nil
	})
	return out, err
}
