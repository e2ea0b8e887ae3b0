package main

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"sync"
	"syscall"
	"time"

	"github.com/containernetworking/cni/libcni"
	current "github.com/containernetworking/cni/pkg/types/100"
	"github.com/containernetworking/plugins/pkg/testutils"
	"github.com/fsnotify/fsnotify"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/istio-cni-go/istio-cni/internal/iptables"
	"github.com/istio-cni-go/istio-cni/internal/nftables"
	"github.com/istio-cni-go/istio-cni/internal/nlsteps"
	"github.com/istio-cni-go/istio-cni/internal/nsfacts"
	"github.com/istio-cni-go/istio-cni/internal/plugin"
	"github.com/istio-cni-go/istio-cni/internal/podinfo"
	"github.com/istio-cni-go/istio-cni/internal/podrules"
	"github.com/istio-cni-go/istio-cni/internal/redirect"
	"github.com/istio-cni-go/istio-cni/internal/ruleset"
	"github.com/istio-cni-go/istio-cni/internal/testenv"
	"github.com/istio-cni-go/istio-cni/internal/testutil"
)

// sequential runs n pods through each series, one at a time. The series
// interleave pod by pod, so machine noise falls on all of them alike.
func (b *bench) sequential(ctx context.Context, n int, all ...series) (*samples, error) {
	s := newSamples()
	for i := 0; i < n; i++ {
		for _, se := range all {
			if err := b.pod(ctx, s, se.name, se.list); err != nil {
				return nil, err
			}
		}
	}
	return s, nil
}

// concurrentResult is what the parallel series measured.
type concurrentResult struct {
	samples *samples
	// cpuPerPod is CPU time per pod, by series and command.
	cpuPerPod map[string]cpuSplit
}

// concurrent starts n pods at once through each series, rounds times,
// and counts the CPU each burst costs.
func (b *bench) concurrent(ctx context.Context, n, rounds int, all ...series) (concurrentResult, error) {
	s := newSamples()
	used := map[string]cpuSplit{}
	pods := map[string]int{}
	for r := 0; r < rounds; r++ {
		for _, se := range all {
			if err := b.concurrentRound(ctx, s, se, n, used, pods); err != nil {
				return concurrentResult{}, err
			}
		}
	}
	perPod := map[string]cpuSplit{}
	for k, c := range used {
		perPod[k] = c.div(pods[k])
	}
	return concurrentResult{samples: s, cpuPerPod: perPod}, nil
}

// concurrentRound is one burst of n pods through one series: all ADDs at
// once, then, once all are up, all DELs at once, so teardown does not
// weigh on start-up. The round's pods are gone when it returns.
func (b *bench) concurrentRound(ctx context.Context, s *samples, se series, n int, used map[string]cpuSplit, counted map[string]int) error {
	// Every pod is known to the API and the agent before the runtime
	// starts them all at once.
	pods := make([]*testenv.Pod, 0, n)
	defer func() {
		for _, p := range pods {
			p.Close()
		}
	}()
	// The agent's CPU while the pods are created: its informer's, and
	// the records it prepares for their ADDs (internal/prepared), which
	// are the agent's part of each pod's start.
	before, err := b.agentUsage()
	if err != nil {
		return err
	}
	for i := 0; i < n; i++ {
		p, err := b.prepare(ctx)
		if err != nil {
			return err
		}
		pods = append(pods, p)
	}
	after, err := b.agentUsage()
	if err != nil {
		return err
	}
	k := se.name + " created"
	used[k] = used[k].add(cpuSplit{agent: after - before})
	counted[k] += len(pods)
	for _, cmd := range []string{"ADD", "DEL"} {
		c, err := b.burst(ctx, s, se, cmd, pods)
		if err != nil {
			return err
		}
		k := se.name + " " + cmd
		used[k] = used[k].add(c)
		counted[k] += len(pods)
	}
	return nil
}

// burst runs cmd for all pods at once and returns the CPU it cost.
func (b *bench) burst(ctx context.Context, s *samples, se series, cmd string, pods []*testenv.Pod) (cpuSplit, error) {
	var wg sync.WaitGroup
	errs := make(chan error, len(pods))
	start := make(chan struct{})
	for _, p := range pods {
		wg.Add(1)
		go func() {
			defer wg.Done()
			<-start
			if err := b.step(ctx, s, se.name, cmd, se.list, p); err != nil {
				errs <- err
			}
		}()
	}
	before, err := b.cpuNow()
	if err != nil {
		// Release the waiting goroutines before giving up.
		close(start)
		wg.Wait()
		return cpuSplit{}, err
	}
	close(start)
	wg.Wait()
	after, err := b.cpuNow()
	if err != nil {
		return cpuSplit{}, err
	}
	close(errs)
	if err := <-errs; err != nil {
		return cpuSplit{}, err
	}
	return after.sub(before), nil
}

// startAgent runs install-cni for the node: its own conf and bin dirs, and
// the node's run dir, where the plugin looks for the agent. From then on,
// pods are created only once the agent serves them.
func (b *bench) startAgent(ctx context.Context) (func(), error) {
	stop, err := b.startAgentIn(ctx, "agent")
	if err != nil {
		return nil, err
	}
	// The agent prepares pods' ADDs under the configs it has seen the
	// runtime use: two ADDs of each chain, untimed, as on a node whose
	// agent has been up a while.
	learn := newSamples()
	for _, list := range []*libcni.NetworkConfigList{b.node.Chained, b.chainedNFT} {
		for i := 0; i < 2; i++ {
			if err := b.pod(ctx, learn, "learn", list); err != nil {
				stop()
				return nil, err
			}
		}
	}
	b.records = true
	return func() { b.records = false; stop() }, nil
}

// startAgentIn is startAgent with the agent's files under dir (one per
// agent run) and extra flags.
func (b *bench) startAgentIn(ctx context.Context, dir string, extra ...string) (func(), error) {
	agentBin, err := testenv.BuildCommand(b.dir, "install-cni")
	if err != nil {
		return nil, err
	}
	h, err := testenv.NewAgentHost(ctx, filepath.Join(b.dir, dir), b.cluster, filepath.Join(b.node.BinDir, "istio-cni"))
	if err != nil {
		return nil, err
	}
	h.RunDir = b.node.RunDir
	b.agentHost = h
	b.confDir = h.NetDir
	if err := os.WriteFile(filepath.Join(b.confDir, "10-calico.conflist"), calicoConf, 0o644); err != nil {
		return nil, err
	}
	// Relays wait for the agent however long it takes: these series
	// time the agent's path and the records' (the cluster series has
	// relays leave a busy node's agent, the chart's default).
	if err := h.Start(agentBin, append([]string{"--conflict-limit", "100000", "--disable-safe-upgrade",
		"--kubernetes-node-name", testenv.NodeName, "--repair-host-proc", "/proc", "--repair-repair-pods", "--cni-agent-wait=0"}, extra...)...); err != nil {
		return nil, err
	}
	stop := func() { _, _ = h.Stop(10 * time.Second) }
	// Its own group, as in its container: its CPU and its children's
	// (iptables-restore) add up there.
	if g, err := newCPUGroup("istio-cni-bench-agent"); err != nil {
		fmt.Fprintln(os.Stderr, "bench: the agent's CPU is not counted:", err)
	} else if err := g.add(h.Pid()); err != nil {
		g.close()
		fmt.Fprintln(os.Stderr, "bench: the agent's CPU is not counted:", err)
	} else {
		b.agentCPU = g
		stop = func() { _, _ = h.Stop(10 * time.Second); g.close() }
	}
	if err := h.WaitReady(30 * time.Second); err != nil {
		stop()
		return nil, err
	}
	b.agent = podinfo.NewAgentClient(filepath.Join(b.node.RunDir, podinfo.AgentSocketName), time.Second)
	return stop, nil
}

var calicoConf = []byte(`{"name":"k8s-pod-network","cniVersion":"0.3.1","plugins":[{"type":"calico","datastore_type":"kubernetes","ipam":{"type":"calico-ipam"}},{"type":"portmap","snat":true,"capabilities":{"portMappings":true}}]}`)

// reinsertions rewrites the primary config as a CNI agent would and times
// how long until our entry is back, seen through file events. The agent
// must be running.
func (b *bench) reinsertions(n int) (*samples, error) {
	s := newSamples()
	path := filepath.Join(b.confDir, "10-calico.conflist")
	w, err := fsnotify.NewWatcher()
	if err != nil {
		return nil, err
	}
	defer w.Close()
	if err := w.Add(b.confDir); err != nil {
		return nil, err
	}
	hasEntry := func() bool {
		data, err := os.ReadFile(path)
		return err == nil && bytes.Contains(data, []byte(`"istio-cni"`))
	}
	for i := 0; i < n; i++ {
		start := time.Now()
		if err := os.WriteFile(path, calicoConf, 0o644); err != nil {
			return nil, err
		}
		timeout := time.After(5 * time.Second)
		for !hasEntry() {
			select {
			case <-w.Events:
			case err := <-w.Errors:
				return nil, err
			case <-timeout:
				return nil, errors.New("entry not re-inserted within 5s")
			}
		}
		s.record("reinsert", time.Since(start))
	}
	return s, nil
}

// repairs starts pods without the plugin (the start-up race), reports
// their validation as failed the way the kubelet would, and times how long
// until the agent's repair controller has their rules in place.
func (b *bench) repairs(ctx context.Context, n int) (*samples, error) {
	s := newSamples()
	for i := 0; i < n; i++ {
		d, err := b.repair(ctx, i)
		if err != nil {
			return nil, err
		}
		s.record("repair", d)
	}
	return s, nil
}

// repair is one pod of the repair series; its sandbox is gone when it
// returns.
func (b *bench) repair(ctx context.Context, i int) (time.Duration, error) {
	name := fmt.Sprintf("raced-%d", i)
	p, err := testenv.CreatePod(ctx, b.cluster.Client, testenv.PodSpec{Namespace: "bench", Name: name, Sidecar: true})
	if err != nil {
		return 0, err
	}
	pod, err := testenv.NewPod("bench", name, string(p.UID), fmt.Sprintf("r%063d", i))
	if err != nil {
		return 0, err
	}
	defer pod.Close()
	res, err := b.node.Add(ctx, b.node.Primary, pod)
	if err != nil {
		return 0, err
	}
	r, err := current.NewResultFromResult(res)
	if err != nil {
		return 0, err
	}
	stop, err := pod.StartSandboxProcess()
	if err != nil {
		return 0, err
	}
	defer func() {
		stop()
		_ = b.node.Del(ctx, b.node.Primary, pod)
	}()
	p.Status.PodIP = r.IPs[0].Address.IP.String()
	p.Status.InitContainerStatuses = []corev1.ContainerStatus{{Name: "istio-validation", Image: "x",
		State: corev1.ContainerState{Terminated: &corev1.ContainerStateTerminated{ExitCode: 126, Reason: "Error"}}}}
	start := time.Now()
	if _, err := b.cluster.Client.CoreV1().Pods("bench").UpdateStatus(ctx, p, metav1.UpdateOptions{}); err != nil {
		return 0, err
	}
	check := &iptables.Applier{}
	deadline := time.Now().Add(10 * time.Second)
	for !pod.RulesPresent(check) {
		if time.Now().After(deadline) {
			return 0, fmt.Errorf("pod %s not repaired within 10s", name)
		}
		time.Sleep(2 * time.Millisecond) // polling the kernel state, bounded
	}
	return time.Since(start), nil
}

// ruleFloors times Istio's default rule set going into fresh namespaces
// from this process, warm: the kernel's share of every ADD, which no plugin
// design avoids.
func ruleFloors(n int) (*samples, error) {
	params, _, err := redirect.FromPod(&podinfo.Pod{
		Annotations: map[string]string{redirect.AnnotationStatus: "{}"},
		Containers:  []podinfo.Container{{Name: redirect.ProxyContainerName}}})
	if err != nil {
		return nil, err
	}
	plan := ruleset.Build(params, false)
	backends := []struct {
		name  string
		rules plugin.Rules
	}{{"nftables", &nftables.Applier{}}, {"iptables", &iptables.Applier{}}}
	s := newSamples()
	for i := 0; i < n+3; i++ {
		for _, be := range backends {
			// Applied in place, as the agent does when it cannot prepare
			// (and the fallback does), and sent as prepared requests, as
			// the relay does by default.
			took, cpu, err := ruleFloor(func(path string) error { _, err := be.rules.Apply(path, plan); return err })
			if err != nil {
				return nil, err
			}
			txn, why, err := be.rules.(podrules.Preparer).PrepareFresh(nsfacts.Facts{}, plan)
			if err != nil || txn == nil {
				return nil, fmt.Errorf("preparing the default rules (%s): %w", why, err)
			}
			sentTook, sentCPU, err := ruleFloor(func(path string) error {
				f, err := os.Open(path)
				if err != nil {
					return err
				}
				defer f.Close()
				_, err = nlsteps.RunIn(f, txn)
				return err
			})
			if err != nil {
				return nil, err
			}
			if i >= 3 { // the first ones warm up
				s.record("floor/default rules applied into a fresh netns, "+be.name, took)
				s.record("cpu/default rules applied into a fresh netns, "+be.name, cpu)
				s.record("floor/default rules sent prepared into a fresh netns, "+be.name, sentTook)
				s.record("cpu/default rules sent prepared into a fresh netns, "+be.name, sentCPU)
			}
		}
	}
	return s, nil
}

// ruleFloor runs write on a fresh namespace's path, and returns the time
// it took and the CPU it cost this process and its children.
func ruleFloor(write func(path string) error) (took, cpu time.Duration, err error) {
	netns, err := testutils.NewNS()
	if err != nil {
		return 0, 0, err
	}
	defer func() {
		_ = testutil.RemoveNS(netns)
	}()
	cpuBefore, err := ownCPU()
	if err != nil {
		return 0, 0, err
	}
	start := time.Now()
	err = write(netns.Path())
	took = time.Since(start)
	cpuAfter, cerr := ownCPU()
	if cerr != nil {
		return 0, 0, cerr
	}
	if err != nil {
		return 0, 0, err
	}
	return took, cpuAfter - cpuBefore, nil
}

// binaryCost is a plugin binary's size and how long a process of it
// takes to start and answer VERSION.
type binaryCost struct {
	name string
	size int64
	// wall and cpu are per VERSION run.
	wall, cpu []time.Duration
}

// binaryCosts measures the relay at bin and the fallback beside it, n
// VERSION runs each.
func binaryCosts(bin string, n int) ([]binaryCost, error) {
	var out []binaryCost
	for _, path := range []string{bin, filepath.Join(filepath.Dir(bin), testenv.FallbackBinary)} {
		fi, err := os.Stat(path)
		if err != nil {
			return nil, err
		}
		c := binaryCost{name: filepath.Base(path), size: fi.Size()}
		for i := 0; i < n; i++ {
			cmd := exec.Command(path)
			cmd.Env = []string{"CNI_COMMAND=VERSION"}
			start := time.Now()
			if err := cmd.Run(); err != nil {
				return nil, fmt.Errorf("VERSION: %w", err)
			}
			c.wall = append(c.wall, time.Since(start))
			ru := cmd.ProcessState.SysUsage().(*syscall.Rusage)
			c.cpu = append(c.cpu, time.Duration(ru.Utime.Nano()+ru.Stime.Nano()))
		}
		out = append(out, c)
	}
	return out, nil
}
