package main

import (
	"context"
	"flag"
	"fmt"
	"os/exec"
	"time"

	"github.com/containernetworking/cni/libcni"

	"github.com/istio-cni-go/istio-cni/internal/redirect"
	"github.com/istio-cni-go/istio-cni/internal/testenv"
)

var (
	listPods  = flag.Int("list-pods", 15, "pods per list length and backend in the list series")
	listsOnly = flag.Bool("lists-only", false, "run only the list series (and the primary plugin alone, alternated with it)")
)

// listLengths are the list lengths of the list series: the pod start-up
// issue's cost target is the plugin's share within 10% between 10 and
// 1,000 entries; 5,000 shows what lies beyond.
var listLengths = []int{10, 1000, 5000}

// listBackend is one way of programming the rules.
type listBackend struct {
	name string
	// nft selects the chain with native_nftables.
	nft bool
	// legacy gives each pod's namespace a legacy table first, so the
	// plugin picks iptables-legacy as Istio's detection does.
	legacy bool
}

var listBackends = []listBackend{{name: "iptables-nft"}, {name: "iptables-legacy", legacy: true}, {name: "nftables", nft: true}}

func listSeries(path string, n int, be listBackend) string {
	return fmt.Sprintf("lists/%s/N=%d/%s", path, n, be.name)
}

// listAnnotations are the issue's: N IPv4 CIDRs and N ports excluded.
func listAnnotations(n int) map[string]string {
	l := testenv.Lists{N: n}
	return map[string]string{
		redirect.AnnotationExcludeOutboundCIDRs: l.CIDRs4(),
		redirect.AnnotationExcludeOutboundPorts: l.Ports(),
	}
}

// lists times ADD and DEL of sidecar pods carrying the lists, for
// every length and backend, pod by pod interleaved with the primary
// plugin alone, so machine noise falls on all series alike. path names
// how the plugin runs ("no agent": the fallback; "agent").
func (b *bench) lists(ctx context.Context, c *testenv.Cluster, path string, chained, chainedNFT *libcni.NetworkConfigList) error {
	for i := 0; i < *listPods; i++ {
		if err := b.pod(ctx, c, "lists/"+path+"/primary", b.node.Primary); err != nil {
			return err
		}
		primary := b.last("lists/" + path + "/primary ADD")
		for _, n := range listLengths {
			for _, be := range listBackends {
				list := chained
				if be.nft {
					list = chainedNFT
				}
				pod, err := b.preparePod(ctx, c, listAnnotations(n), be.legacy)
				if err != nil {
					return err
				}
				err = b.run(ctx, listSeries(path, n, be), list, pod)
				pod.Close()
				if err != nil {
					return err
				}
				// Against the primary of the same round: the load of a
				// shared machine drifts less within a round than across.
				b.record(listSeries(path, n, be)+" share", b.last(listSeries(path, n, be)+" ADD")-primary)
			}
		}
	}
	return nil
}

// last is the latest sample of a series.
func (b *bench) last(k string) time.Duration {
	b.mu.Lock()
	defer b.mu.Unlock()
	s := b.samples[k]
	if len(s) == 0 {
		return 0
	}
	return s[len(s)-1]
}

// seedLegacy gives a pod's namespace a legacy iptables table, as a node
// whose other components use iptables-legacy has.
func seedLegacy(pod *testenv.Pod) error {
	return pod.InPod(func() error {
		out, err := exec.Command("iptables-legacy", "-t", "filter", "-A", "INPUT", "-p", "255", "-j", "RETURN").CombinedOutput()
		if err != nil {
			return fmt.Errorf("seeding a legacy table: %v: %s", err, out)
		}
		return nil
	})
}

// reportLists prints the plugin's share of ADD per list length and
// backend: the p50 of each chained ADD minus the primary's alone in the
// same round, and istio-cni's own process inside it, with the ratios the
// cost target is about.
func (b *bench) reportLists() {
	p50 := func(k string) time.Duration { return pct(b.samples[k], .5) }
	if len(b.samples["lists/no agent/primary ADD"]) == 0 {
		return
	}
	fmt.Println()
	fmt.Println("list-valued settings: excludeOutboundIPRanges with N IPv4 CIDRs and excludeOutboundPorts with N ports, one pod each")
	fmt.Println("plugin share of ADD, p50 of (chain - primary alone in the same round), and istio-cni's own process p50 in brackets, ms:")
	fmt.Printf("  %-26s", "")
	for _, n := range listLengths {
		fmt.Printf(" %20s", fmt.Sprintf("N=%d", n))
	}
	fmt.Printf("  %9s %9s\n", "1000/10", "5000/10")
	for _, path := range []string{"no agent", "agent"} {
		primary := p50("lists/" + path + "/primary ADD")
		if primary == 0 {
			continue
		}
		for _, be := range listBackends {
			fmt.Printf("  %-26s", path+", "+be.name)
			share := map[int]time.Duration{}
			for _, n := range listLengths {
				s := listSeries(path, n, be)
				share[n] = p50(s + " share")
				fmt.Printf(" %20s", fmt.Sprintf("%.2f (%.2f)", msf(share[n]), msf(p50(s+" istio-cni ADD"))))
			}
			fmt.Printf("  %8.2fx %8.2fx\n", ratioOf(share[1000], share[10]), ratioOf(share[5000], share[10]))
		}
		fmt.Printf("  %-26s primary alone %.2f ms\n", "", msf(primary))
	}
}

func msf(d time.Duration) float64 { return float64(d) / float64(time.Millisecond) }

func ratioOf(a, b time.Duration) float64 {
	if b <= 0 {
		return 0
	}
	return float64(a) / float64(b)
}
