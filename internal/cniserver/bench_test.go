package cniserver_test

import (
	"context"
	"fmt"
	"io"
	"log/slog"
	"os"
	"testing"

	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/kubernetes/fake"

	"github.com/istio-cni-go/istio-cni/internal/cnirelay"
	"github.com/istio-cni-go/istio-cni/internal/cniserver"
	"github.com/istio-cni-go/istio-cni/internal/iptables"
	"github.com/istio-cni-go/istio-cni/internal/kubeclient/clientset"
	"github.com/istio-cni-go/istio-cni/internal/nftables"
	"github.com/istio-cni-go/istio-cni/internal/podcache"
	"github.com/istio-cni-go/istio-cni/internal/redirect"
	"github.com/istio-cni-go/istio-cni/internal/testenv"
	"github.com/istio-cni-go/istio-cni/internal/testutil"
)

// BenchmarkAgentADD is the agent's share of one pod start: a chained ADD
// for a sidecar pod, handled as it arrives from the relay (pod from the
// informer cache, Istio's default rules into a fresh namespace), on each
// backend. It reports CPU per ADD besides wall time, since CPU is what a
// burst of pod starts queues on; run with -cpuprofile to see where it goes.
func BenchmarkAgentADD(b *testing.B) {
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	s := benchAgent(ctx, b)
	for _, backend := range []string{"iptables", "nftables"} {
		b.Run(backend, func(b *testing.B) {
			conf := fmt.Sprintf(`{"cniVersion":"1.0.0","name":"k8s-pod-network","type":"istio-cni","native_nftables":%t,
				"prevResult":{"cniVersion":"1.0.0","ips":[{"address":"10.1.0.2/24"}]}}`, backend == "nftables")
			req := &cnirelay.Request{Command: "ADD", ContainerID: "c1", IfName: "eth0", Args: benchPodArgs, Stdin: []byte(conf)}
			cniserver.BenchInFreshNS(b, func(f *os.File) error {
				if resp := s.Handle(req, f); resp.Error != nil {
					return fmt.Errorf("ADD: %w", resp.Error)
				}
				return nil
			})
		})
	}
}

// benchPodArgs are the CNI_ARGS of benchAgent's pod.
const benchPodArgs = "K8S_POD_NAMESPACE=bench;K8S_POD_NAME=p;K8S_POD_UID=uid-1"

// benchListsPodArgs name benchAgent's pod with 1,000 CIDRs and ports
// excluded.
const benchListsPodArgs = "K8S_POD_NAMESPACE=bench;K8S_POD_NAME=lists;K8S_POD_UID=uid-2"

// benchAgent is the agent's CNI server, both backends, over a pod cache
// (stopped with ctx) holding one sidecar pod, bench/p, as the benchmarks
// of a pod's ADD need it.
func benchAgent(ctx context.Context, b *testing.B) *cniserver.Server {
	testutil.RequireRoot(b)
	testutil.RequireTools(b, "iptables-nft-restore")
	cs := fake.NewClientset()
	pod, err := testenv.CreatePod(ctx, cs, testenv.PodSpec{Namespace: "bench", Name: "p", Sidecar: true})
	if err != nil {
		b.Fatal(err)
	}
	pod.UID = types.UID("uid-1")
	if _, err := cs.CoreV1().Pods("bench").Update(ctx, pod, metav1.UpdateOptions{}); err != nil {
		b.Fatal(err)
	}
	// The same pod with the long lists: 1,000 CIDRs and ports.
	l := testenv.Lists{N: 1000}
	lists, err := testenv.CreatePod(ctx, cs, testenv.PodSpec{Namespace: "bench", Name: "lists", Sidecar: true,
		Annotations: map[string]string{redirect.AnnotationExcludeOutboundCIDRs: l.CIDRs4(), redirect.AnnotationExcludeOutboundPorts: l.Ports()}})
	if err != nil {
		b.Fatal(err)
	}
	lists.UID = types.UID("uid-2")
	if _, err := cs.CoreV1().Pods("bench").Update(ctx, lists, metav1.UpdateOptions{}); err != nil {
		b.Fatal(err)
	}
	cache := podcache.Start(ctx, clientset.Of(cs), testenv.NodeName)
	if err := cache.WaitSynced(ctx); err != nil {
		b.Fatal(err)
	}
	return &cniserver.Server{Log: slog.New(slog.NewJSONHandler(io.Discard, nil)),
		Rules: &iptables.Applier{Force: iptables.VariantNFT}, NFTables: &nftables.Applier{},
		Pods: cache, ReadyReason: func() string { return "" }}
}
