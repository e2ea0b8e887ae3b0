// Package nsfacts reads what preparing a pod's rules needs to know of its
// network namespace, in plain system calls: the node agent before it
// prepares, and the relay before it sends rules the agent prepared ahead
// of the pod's ADD. It imports nothing a relay process would not start
// anyway.
package nsfacts

import "net/netip"

// The kinds of prepared rules: what wrote the requests, which decides
// what of a namespace's contents keeps them from being sent there.
const (
	// KindIPTablesNFT: requests read back from iptables-nft-restore.
	KindIPTablesNFT = "iptables-nft"
	// KindNFTables: the native nftables backend's transaction.
	KindNFTables = "nftables"
)

// NFTablesPrefix begins the names of the native backend's tables
// (nftables.TablePrefix).
const NFTablesPrefix = "istio-proxy-"

// The policy rule that sends TPROXY-marked packets to their routing
// table: its mark and table (ruleset's TProxyMarkValue and
// TProxyRouteTable), whose presence in a namespace ReadFacts reports.
const (
	TProxyMark  = 1337
	TProxyTable = 133
)

// HasGlobalAddr reports whether a namespace with these addresses has one
// a pod's traffic can use: the primary plugin has given it one.
func HasGlobalAddr(addrs []netip.Addr) bool {
	for _, a := range addrs {
		if !a.IsLoopback() && !a.IsLinkLocalUnicast() {
			return true
		}
	}
	return false
}

// NeedsIPv6 decides whether a pod gets IPv6 rules, from its addresses in
// the order the network reports them: the first global address decides,
// unless dual stack is asked for, in which case any IPv6 address does.
// The agent plans and the relay picks prepared rules by it.
func NeedsIPv6(addrs []netip.Addr, dualStack bool) bool {
	for _, a := range addrs {
		if a.IsLoopback() || a.IsLinkLocalUnicast() || a.IsUnspecified() {
			continue
		}
		if a.Is6() && !a.Is4In6() {
			return true
		}
		if !dualStack {
			return false
		}
	}
	return false
}
