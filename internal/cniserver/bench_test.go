package cniserver_test

import (
	"context"
	"fmt"
	"io"
	"log/slog"
	"net"
	"os"
	"syscall"
	"testing"
	"time"

	"github.com/containernetworking/plugins/pkg/netlinksafe"
	"github.com/containernetworking/plugins/pkg/ns"
	"github.com/containernetworking/plugins/pkg/testutils"
	"github.com/vishvananda/netlink"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/kubernetes/fake"

	"github.com/istio-cni-go/istio-cni/internal/cnirelay"
	"github.com/istio-cni-go/istio-cni/internal/cniserver"
	"github.com/istio-cni-go/istio-cni/internal/iptables"
	"github.com/istio-cni-go/istio-cni/internal/kubeclient/clientset"
	"github.com/istio-cni-go/istio-cni/internal/nftables"
	"github.com/istio-cni-go/istio-cni/internal/podcache"
	"github.com/istio-cni-go/istio-cni/internal/testenv"
	"github.com/istio-cni-go/istio-cni/internal/testutil"
)

// BenchmarkAgentADD is the agent's share of one pod start: a chained ADD
// for a sidecar pod, handled as it arrives from the relay (pod from the
// informer cache, Istio's default rules into a fresh namespace), on each
// backend. It reports CPU per ADD besides wall time, since CPU is what a
// burst of pod starts queues on; run with -cpuprofile to see where it goes.
func BenchmarkAgentADD(b *testing.B) {
	testutil.RequireRoot(b)
	testutil.RequireTools(b, "iptables-nft-restore")
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	cs := fake.NewClientset()
	pod, err := testenv.CreatePod(ctx, cs, testenv.PodSpec{Namespace: "bench", Name: "p", Sidecar: true})
	if err != nil {
		b.Fatal(err)
	}
	pod.UID = types.UID("uid-1")
	if _, err := cs.CoreV1().Pods("bench").Update(ctx, pod, metav1.UpdateOptions{}); err != nil {
		b.Fatal(err)
	}
	cache := podcache.Start(ctx, clientset.Of(cs), testenv.NodeName)
	if err := cache.WaitSynced(ctx); err != nil {
		b.Fatal(err)
	}
	for _, backend := range []string{"iptables", "nftables"} {
		b.Run(backend, func(b *testing.B) {
			s := &cniserver.Server{Log: slog.New(slog.NewJSONHandler(io.Discard, nil)),
				Rules: &iptables.Applier{Force: iptables.VariantNFT}, NFTables: &nftables.Applier{},
				Pods: cache, ReadyReason: func() string { return "" }}
			conf := fmt.Sprintf(`{"cniVersion":"1.0.0","name":"k8s-pod-network","type":"istio-cni","native_nftables":%t,
				"prevResult":{"cniVersion":"1.0.0","ips":[{"address":"10.1.0.2/24"}]}}`, backend == "nftables")
			req := &cnirelay.Request{Command: "ADD", ContainerID: "c1", IfName: "eth0",
				Args: "K8S_POD_NAMESPACE=bench;K8S_POD_NAME=p;K8S_POD_UID=uid-1", Stdin: []byte(conf)}
			var cpu time.Duration
			b.ResetTimer()
			for i := 0; i < b.N; i++ {
				b.StopTimer()
				podNS, f := podNamespace(b)
				before := processCPU(b)
				b.StartTimer()
				resp := s.Handle(req, f)
				b.StopTimer()
				cpu += processCPU(b) - before
				if resp.Error != nil {
					b.Fatalf("ADD: %v", resp.Error)
				}
				_ = f.Close()
				_ = podNS.Close()
				_ = testutils.UnmountNS(podNS)
				b.StartTimer()
			}
			b.ReportMetric(float64(cpu.Microseconds())/float64(b.N), "cpu-us/op")
		})
	}
}

// podNamespace is a fresh namespace with an address, as the primary
// plugin leaves it, and an open descriptor on it, as the relay sends it.
func podNamespace(b *testing.B) (ns.NetNS, *os.File) {
	n, err := testutils.NewNS()
	if err != nil {
		b.Fatal(err)
	}
	err = n.Do(func(ns.NetNS) error {
		lo, err := netlinksafe.LinkByName("lo")
		if err != nil {
			return err
		}
		if err := netlink.LinkSetUp(lo); err != nil {
			return err
		}
		if err := netlink.LinkAdd(&netlink.Veth{LinkAttrs: netlink.LinkAttrs{Name: "eth0"}, PeerName: "peer0"}); err != nil {
			return err
		}
		eth, err := netlinksafe.LinkByName("eth0")
		if err != nil {
			return err
		}
		return netlink.AddrAdd(eth, &netlink.Addr{IPNet: &net.IPNet{IP: net.IPv4(10, 1, 0, 2), Mask: net.CIDRMask(24, 32)}})
	})
	if err != nil {
		b.Fatal(err)
	}
	f, err := os.Open(n.Path())
	if err != nil {
		b.Fatal(err)
	}
	return n, f
}

// processCPU is this process's CPU time plus that of its waited-for
// children (iptables-restore).
func processCPU(b *testing.B) time.Duration {
	var total time.Duration
	for _, who := range []int{syscall.RUSAGE_SELF, syscall.RUSAGE_CHILDREN} {
		var ru syscall.Rusage
		if err := syscall.Getrusage(who, &ru); err != nil {
			b.Fatal(err)
		}
		total += time.Duration(ru.Utime.Nano() + ru.Stime.Nano())
	}
	return total
}
