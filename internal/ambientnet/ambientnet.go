// Package ambientnet is what the agent's ambient mode programs in network
// namespaces, whatever the backend: an enrolled pod's redirection to
// ztunnel (rules and policy routing) and the node's SNAT of the kubelet's
// probes with the set of enrolled pods' addresses. The rules themselves
// are package ruleset's; packages iptables and nftables apply them.
package ambientnet

import (
	"net/netip"

	"github.com/istio-cni-go/istio-cni/internal/iptables"
	"github.com/istio-cni-go/istio-cni/internal/nftables"
	"github.com/istio-cni-go/istio-cni/internal/podnet"
	"github.com/istio-cni-go/istio-cni/internal/ruleset"
)

// InPod programs an enrolled pod's namespace. Each call is atomic per
// family (iptables) or whole (nftables), doing again what is done changes
// nothing, and other components' rules are left alone.
type InPod interface {
	// ApplyAmbient makes the namespace hold exactly the rules and
	// routing for p.
	ApplyAmbient(netnsPath string, p ruleset.AmbientParams) (podnet.Report, error)
	// CheckAmbient names every difference from what ApplyAmbient(p)
	// makes.
	CheckAmbient(netnsPath string, p ruleset.AmbientParams) error
	// RemoveAmbient leaves nothing of ours.
	RemoveAmbient(netnsPath string) (podnet.Report, error)
}

// Host programs the node's namespace.
type Host interface {
	// EnsureHost puts the probe SNAT and its sets in place if anything
	// of them is missing or different, and reports whether it wrote.
	EnsureHost(netnsPath string, p ruleset.HostParams) (bool, error)
	// SyncProbes brings the probe sets to want (pod address to pod UID)
	// by difference; want must be complete.
	SyncProbes(netnsPath string, want map[netip.Addr]string) (podnet.ProbeChanges, error)
	// ChangeProbes makes changes found against what the sets held after
	// the last write, without reading them (want gives the UIDs); an
	// error leaves the sets for a SyncProbes to put right.
	ChangeProbes(netnsPath string, ch podnet.ProbeChanges, want map[netip.Addr]string) error
	// ForgetProbe deletes an address only if its entry is uid's.
	ForgetProbe(netnsPath string, ip netip.Addr, uid string) (bool, error)
	// ProbeEntries lists the probe sets: address to pod UID.
	ProbeEntries(netnsPath string) (map[netip.Addr]string, error)
	// RemoveHost deletes the rules and the sets.
	RemoveHost(netnsPath string) error
}

var (
	_ InPod = (*iptables.Applier)(nil)
	_ Host  = (*iptables.Applier)(nil)
	_ InPod = (*nftables.Applier)(nil)
	_ Host  = (*nftables.Applier)(nil)
)

// Backends returns the in-pod and node backends: nftables through netlink
// when nft is set, else iptables (variant "legacy", "nft" or "" to
// detect, as FORCE_IPTABLES_BINARY says).
func Backends(nft bool, variant string) (InPod, Host) {
	if nft {
		a := &nftables.Applier{}
		return a, a
	}
	a := &iptables.Applier{Force: variant}
	return a, a
}

// OtherHost is the host backend Backends(nft, ...) does not pick, to
// remove an earlier agent's probe SNAT after a switch of backend: both
// iptables variants are read, whatever the one forced for ours.
func OtherHost(nft bool) Host {
	if nft {
		return &iptables.Applier{}
	}
	return &nftables.Applier{}
}
