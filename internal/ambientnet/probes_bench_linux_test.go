package ambientnet

import (
	"fmt"
	"net/netip"
	"testing"

	"github.com/istio-cni-go/istio-cni/internal/podnet"
	"github.com/istio-cni-go/istio-cni/internal/ruleset"
	"github.com/istio-cni-go/istio-cni/internal/testutil"
)

// BenchmarkProbes times what an enrolled pod's start costs the node's
// probe set, on a node with n pods enrolled already: a sync (the sets
// read, the difference written) or a blind change of the pod's address
// alone, as the controller makes once it knows what the sets hold. Each
// iteration adds the address, and the untimed part takes it out again.
func BenchmarkProbes(b *testing.B) {
	testutil.RequireRoot(b)
	for _, be := range backends() {
		if be.name == "nftables-any-local-socket" {
			continue
		}
		for _, n := range []int{1, 110, 250} {
			node := testutil.NewNS(b)
			if _, err := be.host.EnsureHost(node.Path(), ruleset.HostParams{IPv6: true, KubeletUID: be.uid}); err != nil {
				b.Fatal(err)
			}
			base := map[netip.Addr]string{}
			for i := 0; i < n; i++ {
				base[netip.AddrFrom4([4]byte{198, 18, byte(i >> 8), byte(i)})] = fmt.Sprintf("uid-%d", i)
			}
			if _, err := be.host.SyncProbes(node.Path(), base); err != nil {
				b.Fatal(err)
			}
			added := netip.MustParseAddr("198.18.200.1")
			more := map[netip.Addr]string{added: "uid-new"}
			for k, v := range base {
				more[k] = v
			}
			add := podnet.ProbeChanges{Added: []netip.Addr{added}}
			remove := podnet.ProbeChanges{Removed: []netip.Addr{added}}
			b.Run(fmt.Sprintf("%s/sync/pods=%d", be.name, n), func(b *testing.B) {
				for i := 0; i < b.N; i++ {
					if ch, err := be.host.SyncProbes(node.Path(), more); err != nil || len(ch.Added) != 1 {
						b.Fatal(ch, err)
					}
					b.StopTimer()
					if err := be.host.ChangeProbes(node.Path(), remove, base); err != nil {
						b.Fatal(err)
					}
					b.StartTimer()
				}
			})
			b.Run(fmt.Sprintf("%s/change/pods=%d", be.name, n), func(b *testing.B) {
				for i := 0; i < b.N; i++ {
					if err := be.host.ChangeProbes(node.Path(), add, more); err != nil {
						b.Fatal(err)
					}
					b.StopTimer()
					if err := be.host.ChangeProbes(node.Path(), remove, base); err != nil {
						b.Fatal(err)
					}
					b.StartTimer()
				}
			})
		}
	}
}
