package main

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"time"

	"github.com/istio-cni-go/istio-cni/internal/podinfo"
	"github.com/istio-cni-go/istio-cni/internal/testenv"
)

// The memory series' load, issue #15's: a node holding 250 of the
// cluster's 5,000 Istio-injected pods, then 200 of them replaced, three
// times (-memory-cycles).
const (
	memoryClusterPods = 5000
	memoryNodePods    = 250
	memoryChurn       = 200
	memoryTargetMB    = 40
	// memoryNode is the series' node: the bench's node keeps the other
	// series' pod objects, which its cache would hold too.
	memoryNode = "node-memory"
)

// memoryResult is what the memory series measured of its agent.
type memoryResult struct {
	// applied is how long the cluster's pods took to apply.
	applied time.Duration
	// held is how many of the cluster's pods the agent's socket served.
	held int
	// syncedKB is the agent's stable RSS with its cache synced; churnKB
	// after each churn cycle.
	syncedKB int
	churnKB  []int
	// breakdown is where the synced agent's memory was.
	breakdown string
}

// memory starts an agent of its own, for a node of its own (the other
// series' agent stays up, idle), once the cluster holds the pods, and
// reads its resident memory, stable, after its cache synced and after
// each of cycles churn cycles. Its pods stay: no other series runs after
// it.
func (b *bench) memory(ctx context.Context, cycles int) (*memoryResult, error) {
	res := &memoryResult{}
	began := time.Now()
	set, err := testenv.NewPodSet(ctx, b.cluster, "mem", memoryNode, memoryClusterPods, memoryNodePods)
	if err != nil {
		return nil, err
	}
	res.applied = time.Since(began)
	agentBin, err := testenv.BuildCommand(b.dir, "install-cni")
	if err != nil {
		return nil, err
	}
	h, err := testenv.NewAgentHost(ctx, filepath.Join(b.dir, "memory-agent"), b.cluster, filepath.Join(b.node.BinDir, "istio-cni"))
	if err != nil {
		return nil, err
	}
	if err := os.WriteFile(filepath.Join(h.NetDir, "10-calico.conflist"), calicoConf, 0o644); err != nil {
		return nil, err
	}
	if err := h.Start(agentBin, "--disable-safe-upgrade", "--kubernetes-node-name", memoryNode,
		"--repair-host-proc", "/proc", "--repair-repair-pods"); err != nil {
		return nil, err
	}
	defer func() { _, _ = h.Stop(10 * time.Second) }()
	if err := h.WaitReady(30 * time.Second); err != nil {
		return nil, err
	}
	sock := testenv.NewSockClient(filepath.Join(h.RunDir, podinfo.AgentSocketName))
	defer sock.Close()
	if err := set.WaitServed(sock, 30*time.Second); err != nil {
		return nil, err
	}
	held, err := set.Held(sock)
	if err != nil {
		return nil, err
	}
	res.held = len(held)
	if res.syncedKB, err = testenv.StableRSS(h.Pid(), 30*time.Second); err != nil {
		return nil, err
	}
	res.breakdown = testenv.MemoryBreakdown(h)
	for range cycles {
		if err := set.Churn(ctx, memoryChurn); err != nil {
			return nil, err
		}
		if err := set.WaitServed(sock, 30*time.Second); err != nil {
			return nil, err
		}
		kb, err := testenv.StableRSS(h.Pid(), 30*time.Second)
		if err != nil {
			return nil, err
		}
		res.churnKB = append(res.churnKB, kb)
	}
	return res, nil
}

// reportMemory prints the memory series.
func reportMemory(r *memoryResult) {
	if r == nil {
		return
	}
	mb := func(kb int) string { return fmt.Sprintf("%.1f MB", float64(kb)/1024) }
	fmt.Printf("agent RSS, %d of %d Istio-injected pods on its node (applied in %s, %d served from its cache): %s (target <= %d MB, #15)\n",
		memoryNodePods, memoryClusterPods, r.applied.Round(100*time.Millisecond), r.held, mb(r.syncedKB), memoryTargetMB)
	fmt.Printf("agent RSS after each of %d cycles of %d of its pods replaced:", len(r.churnKB), memoryChurn)
	for _, kb := range r.churnKB {
		fmt.Printf(" %s", mb(kb))
	}
	fmt.Println(" (target: no growth)")
	fmt.Printf("  synced: %s\n", strings.ReplaceAll(r.breakdown, "\n", ", "))
}
