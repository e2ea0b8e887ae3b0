package podnet

import (
	"net/netip"
	"slices"

	"github.com/istio-cni-go/istio-cni/internal/ruleset"
)

// ProbeChanges is what bringing the node's probe sets to the wanted
// entries did, each list sorted.
type ProbeChanges struct {
	// Added are addresses that were missing.
	Added []netip.Addr
	// Updated are addresses that were there with another pod's UID: the
	// address was reused.
	Updated []netip.Addr
	// Removed are addresses no enrolled pod has any more.
	Removed []netip.Addr
}

// Empty reports whether nothing changed.
func (c ProbeChanges) Empty() bool {
	return len(c.Added)+len(c.Updated)+len(c.Removed) == 0
}

// InSet is the part of the changes whose addresses belong in the named
// probe set (ruleset.ProbeSetOf), IPv4-mapped addresses unmapped.
func (c ProbeChanges) InSet(name string) ProbeChanges {
	var out ProbeChanges
	for _, l := range []struct{ from, to *[]netip.Addr }{{&c.Added, &out.Added}, {&c.Updated, &out.Updated}, {&c.Removed, &out.Removed}} {
		for _, ip := range *l.from {
			if ruleset.ProbeSetOf(ip) == name {
				*l.to = append(*l.to, ip.Unmap())
			}
		}
	}
	return out
}

// DiffProbes compares a probe set's entries (address to pod UID) with the
// wanted ones: what to add or re-comment, and what to delete. Entries
// already right are left as they are: the set is never emptied to be
// refilled, so no probe is ever refused for a missing entry.
func DiffProbes(have, want map[netip.Addr]string) ProbeChanges {
	var c ProbeChanges
	for ip, uid := range want {
		old, ok := have[ip]
		switch {
		case !ok:
			c.Added = append(c.Added, ip)
		case old != uid:
			c.Updated = append(c.Updated, ip)
		}
	}
	for ip := range have {
		if _, ok := want[ip]; !ok {
			c.Removed = append(c.Removed, ip)
		}
	}
	for _, l := range [][]netip.Addr{c.Added, c.Updated, c.Removed} {
		slices.SortFunc(l, netip.Addr.Compare)
	}
	return c
}

// SplitFamilies splits wanted probe entries by family, IPv4-mapped IPv6
// addresses counting as IPv4.
func SplitFamilies(want map[netip.Addr]string) (v4, v6 map[netip.Addr]string) {
	v4, v6 = map[netip.Addr]string{}, map[netip.Addr]string{}
	for ip, uid := range want {
		ip = ip.Unmap()
		if ip.Is4() {
			v4[ip] = uid
		} else {
			v6[ip] = uid
		}
	}
	return v4, v6
}
