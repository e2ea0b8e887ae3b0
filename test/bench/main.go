// Command bench measures what istio-cni adds to pod start: ADD and DEL
// through libcni, as a runtime calls them, for the primary plugin alone and
// for the chain with istio-cni, sequentially and with pods in parallel,
// against a real kube-apiserver. It prints p50/p99 and ratios measured in
// the same run.
package main

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"sort"
	"strings"
	"sync"
	"syscall"
	"time"

	"github.com/containernetworking/cni/libcni"
	"github.com/containernetworking/cni/pkg/invoke"
	current "github.com/containernetworking/cni/pkg/types/100"
	"github.com/containernetworking/plugins/pkg/testutils"
	"github.com/fsnotify/fsnotify"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/istio-cni-go/istio-cni/internal/iptables"
	"github.com/istio-cni-go/istio-cni/internal/nftables"
	"github.com/istio-cni-go/istio-cni/internal/plugin"
	"github.com/istio-cni-go/istio-cni/internal/podinfo"
	"github.com/istio-cni-go/istio-cni/internal/redirect"
	"github.com/istio-cni-go/istio-cni/internal/ruleset"
	"github.com/istio-cni-go/istio-cni/internal/testenv"
)

var (
	seqPods       = flag.Int("pods", 40, "pods per sequential series")
	parallel      = flag.Int("parallel", 20, "pods started at once in the parallel series")
	rounds        = flag.Int("rounds", 3, "rounds of the parallel series")
	agentCPU      = flag.String("cluster-agent-cpu", "", "the agent's CPU request in the cluster series (the chart's default when empty)")
	clusterRounds = flag.Int("cluster-rounds", 3, "rounds of each side in the cluster series")
	clusterN      = flag.Int("cluster-pods", 0, "instead: start this many sidecar pods at once on a real kubelet node, without and with the plugin")
)

func main() {
	testenv.EnterNodeNamespace()
	flag.Parse()
	run := run
	if *clusterN > 0 {
		run = func() error { return runCluster(*clusterN) }
	}
	err := run()
	testenv.RemoveSandboxCgroups()
	if err != nil {
		fmt.Fprintln(os.Stderr, "bench:", err)
		os.Exit(1)
	}
}

type bench struct {
	exec    *timedExec
	agent   *podinfo.AgentClient
	confDir string
	node    *testenv.Node
	seq     int
	mu      sync.Mutex
	samples map[string][]time.Duration
	// agentCPU holds the agent and its children, when cgroup v2 is there.
	agentCPU *cpuGroup
	// cpu is CPU time per parallel series and command, and pods counted.
	cpu     map[string]cpuSplit
	cpuPods map[string]int
}

func run() error {
	dir, err := os.MkdirTemp("", "istio-cni-bench-")
	if err != nil {
		return err
	}
	defer os.RemoveAll(dir)
	bin, err := testenv.BuildPlugin(dir)
	if err != nil {
		return err
	}
	cluster, err := testenv.StartCluster(filepath.Join(dir, "cluster"))
	if err != nil {
		return err
	}
	defer cluster.Stop()
	ctx := context.Background()
	if err := testenv.EnsureNamespace(ctx, cluster.Client, "bench"); err != nil {
		return err
	}
	node, err := testenv.NewNode(filepath.Join(dir, "node"), bin, map[string]any{"plugin_log_level": "warn"})
	if err != nil {
		return err
	}
	if err := cluster.PluginKubeconfig(ctx, filepath.Join(node.RunDir, "istio-cni-kubeconfig")); err != nil {
		return err
	}
	var chained map[string]any
	if err := json.Unmarshal(node.Chained.Bytes, &chained); err != nil {
		return err
	}
	plugins := chained["plugins"].([]any)
	plugins[len(plugins)-1].(map[string]any)["native_nftables"] = true
	b, err := json.Marshal(chained)
	if err != nil {
		return err
	}
	chainedNFT, err := libcni.ConfListFromBytes(b)
	if err != nil {
		return err
	}
	bn := &bench{node: node, samples: map[string][]time.Duration{}, exec: newTimedExec(),
		cpu: map[string]cpuSplit{}, cpuPods: map[string]int{}}
	// Time istio-cni's own process inside each chained command: that is
	// its share of the pod's start, measured where a runtime runs it.
	node.CNI = libcni.NewCNIConfigWithCacheDir([]string{node.BinDir}, filepath.Join(node.Dir, "cache"), bn.exec)

	// Warm up: page cache, API server caches, first TLS session.
	for i := 0; i < 3; i++ {
		if err := bn.pod(ctx, cluster, "warmup", node.Chained); err != nil {
			return err
		}
	}
	bn.samples = map[string][]time.Duration{}

	type series struct {
		name string
		list *libcni.NetworkConfigList
	}
	// Sequential series interleave pod by pod, so machine noise falls on
	// all of them alike.
	sequential := func(all ...series) error {
		for i := 0; i < *seqPods; i++ {
			for _, s := range all {
				if err := bn.pod(ctx, cluster, s.name, s.list); err != nil {
					return err
				}
			}
		}
		return nil
	}
	if *listsOnly {
		return bn.listsOnly(ctx, cluster, dir, chainedNFT)
	}
	// No agent: the relay runs the fallback plugin, which reads the pod
	// from the API server and programs the rules itself.
	if err := sequential(series{"seq/primary", node.Primary}, series{"seq/chain (no agent)", node.Chained},
		series{"seq/chain (no agent)/nftables", chainedNFT}); err != nil {
		return err
	}
	if err := bn.lists(ctx, cluster, "no agent", node.Chained, chainedNFT); err != nil {
		return err
	}
	// The same with the node agent running: the relay hands each command
	// to it, and pods come from its cache.
	stopAgent, err := bn.startAgent(ctx, cluster, dir)
	if err != nil {
		return err
	}
	defer stopAgent()
	bn.agent = podinfo.NewAgentClient(filepath.Join(node.RunDir, podinfo.AgentSocketName), time.Second)
	if err := sequential(series{"seq/primary (agent up)", node.Primary}, series{"seq/chain+agent", node.Chained},
		series{"seq/chain+agent/nftables", chainedNFT}); err != nil {
		return err
	}
	if err := bn.lists(ctx, cluster, "agent", node.Chained, chainedNFT); err != nil {
		return err
	}
	for r := 0; r < *rounds; r++ {
		for _, series := range []series{{"par/primary", node.Primary}, {"par/chain+agent", node.Chained}, {"par/chain+agent/nftables", chainedNFT}} {
			// Every pod is known to the API and the agent before the
			// runtime starts them all at once.
			pods := make([]*testenv.Pod, *parallel)
			for i := range pods {
				if pods[i], err = bn.prepare(ctx, cluster); err != nil {
					return err
				}
				defer pods[i].Close()
			}
			// All sandboxes start at once; once all are up, all stop at
			// once, so teardown does not weigh on start-up.
			for _, cmd := range []string{"ADD", "DEL"} {
				var wg sync.WaitGroup
				errs := make(chan error, *parallel)
				start := make(chan struct{})
				for _, p := range pods {
					wg.Add(1)
					go func() {
						defer wg.Done()
						<-start
						if err := bn.step(ctx, series.name, cmd, series.list, p); err != nil {
							errs <- err
						}
					}()
				}
				before, err := bn.cpuNow()
				if err != nil {
					return err
				}
				close(start)
				wg.Wait()
				after, err := bn.cpuNow()
				if err != nil {
					return err
				}
				close(errs)
				if err := <-errs; err != nil {
					return err
				}
				k := series.name + " " + cmd
				bn.cpu[k] = bn.cpu[k].add(after.sub(before))
				bn.cpuPods[k] += len(pods)
			}
		}
	}
	if err := bn.reinsertions(50); err != nil {
		return err
	}
	if err := bn.repairs(ctx, cluster, 20); err != nil {
		return err
	}
	if err := bn.ruleFloors(40); err != nil {
		return err
	}
	return bn.report(bin)
}

func waitAgentKnows(ctx context.Context, a *podinfo.AgentClient, ns, name string) error {
	deadline := time.Now().Add(10 * time.Second)
	for {
		if _, err := a.GetPod(ctx, ns, name); err == nil {
			return nil
		} else if time.Now().After(deadline) {
			return fmt.Errorf("agent never served pod %s/%s: %w", ns, name, err)
		}
		time.Sleep(2 * time.Millisecond) // polling an outside process, untimed
	}
}

// startAgent runs install-cni for the node: its own conf and bin dirs, and
// the node's run dir, where the plugin looks for the agent.
func (b *bench) startAgent(ctx context.Context, c *testenv.Cluster, dir string) (func(), error) {
	agentBin, err := testenv.BuildCommand(dir, "install-cni")
	if err != nil {
		return nil, err
	}
	h, err := testenv.NewAgentHost(ctx, filepath.Join(dir, "agent"), c, filepath.Join(b.node.BinDir, "istio-cni"))
	if err != nil {
		return nil, err
	}
	h.RunDir = b.node.RunDir
	b.confDir = h.NetDir
	if err := os.WriteFile(filepath.Join(b.confDir, "10-calico.conflist"), calicoConf, 0o644); err != nil {
		return nil, err
	}
	if err := h.Start(agentBin, "--conflict-limit", "100000", "--disable-safe-upgrade",
		"--kubernetes-node-name", testenv.NodeName, "--repair-host-proc", "/proc", "--repair-repair-pods"); err != nil {
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
	return stop, nil
}

var calicoConf = []byte(`{"name":"k8s-pod-network","cniVersion":"0.3.1","plugins":[{"type":"calico","datastore_type":"kubernetes","ipam":{"type":"calico-ipam"}},{"type":"portmap","snat":true,"capabilities":{"portMappings":true}}]}`)

// reinsertions rewrites the primary config as a CNI agent would and times
// how long until our entry is back, seen through file events.
func (b *bench) reinsertions(n int) error {
	path := filepath.Join(b.confDir, "10-calico.conflist")
	w, err := fsnotify.NewWatcher()
	if err != nil {
		return err
	}
	defer w.Close()
	if err := w.Add(b.confDir); err != nil {
		return err
	}
	hasEntry := func() bool {
		data, err := os.ReadFile(path)
		return err == nil && bytes.Contains(data, []byte(`"istio-cni"`))
	}
	for i := 0; i < n; i++ {
		start := time.Now()
		if err := os.WriteFile(path, calicoConf, 0o644); err != nil {
			return err
		}
		timeout := time.After(5 * time.Second)
		for !hasEntry() {
			select {
			case <-w.Events:
			case err := <-w.Errors:
				return err
			case <-timeout:
				return errors.New("entry not re-inserted within 5s")
			}
		}
		b.record("reinsert", time.Since(start))
	}
	return nil
}

// pod creates a pod object and sandbox, times ADD, then times DEL, and
// keeps istio-cni's own time inside each.
func (b *bench) pod(ctx context.Context, c *testenv.Cluster, series string, list *libcni.NetworkConfigList) error {
	pod, err := b.prepare(ctx, c)
	if err != nil {
		return err
	}
	defer pod.Close()
	return b.run(ctx, series, list, pod)
}

// prepare creates the pod object and its sandbox namespace, untimed.
func (b *bench) prepare(ctx context.Context, c *testenv.Cluster) (*testenv.Pod, error) {
	return b.preparePod(ctx, c, nil, false)
}

// preparePod is prepare for a pod with annotations, whose namespace
// holds a legacy iptables table when legacy is set.
func (b *bench) preparePod(ctx context.Context, c *testenv.Cluster, ann map[string]string, legacy bool) (*testenv.Pod, error) {
	b.mu.Lock()
	b.seq++
	n := b.seq
	b.mu.Unlock()
	name := fmt.Sprintf("p%d", n)
	p, err := testenv.CreatePod(ctx, c.Client, testenv.PodSpec{Namespace: "bench", Name: name, Sidecar: true, Annotations: ann})
	if err != nil {
		return nil, err
	}
	if b.agent != nil {
		// Untimed: the agent's informer learns about a new pod within
		// milliseconds; a kubelet only starts the sandbox after that too.
		if err := waitAgentKnows(ctx, b.agent, "bench", name); err != nil {
			return nil, err
		}
	}
	pod, err := testenv.NewPod("bench", name, string(p.UID), fmt.Sprintf("b%063d", n))
	if err != nil || !legacy {
		return pod, err
	}
	if err := seedLegacy(pod); err != nil {
		pod.Close()
		return nil, err
	}
	return pod, nil
}

// run times ADD, then DEL, and istio-cni's own process inside each.
func (b *bench) run(ctx context.Context, series string, list *libcni.NetworkConfigList, pod *testenv.Pod) error {
	if err := b.step(ctx, series, "ADD", list, pod); err != nil {
		return err
	}
	return b.step(ctx, series, "DEL", list, pod)
}

// step times one command and istio-cni's own process inside it.
func (b *bench) step(ctx context.Context, series, cmd string, list *libcni.NetworkConfigList, pod *testenv.Pod) error {
	start := time.Now()
	var err error
	if cmd == "ADD" {
		_, err = b.node.Add(ctx, list, pod)
	} else {
		err = b.node.Del(ctx, list, pod)
	}
	if err != nil {
		return fmt.Errorf("%s %s: %w", series, cmd, err)
	}
	b.record(series+" "+cmd, time.Since(start))
	if d, ok := b.exec.take(pod.ContainerID, cmd); ok {
		b.record(series+" istio-cni "+cmd, d)
	}
	return nil
}

// timedExec runs plugins as libcni does and keeps how long each istio-cni
// process took, by container and command.
type timedExec struct {
	*invoke.DefaultExec
	mu   sync.Mutex
	took map[string]time.Duration
}

func newTimedExec() *timedExec {
	return &timedExec{DefaultExec: &invoke.DefaultExec{RawExec: &invoke.RawExec{Stderr: os.Stderr}},
		took: map[string]time.Duration{}}
}

func (e *timedExec) ExecPlugin(ctx context.Context, pluginPath string, stdin []byte, environ []string) ([]byte, error) {
	start := time.Now()
	out, err := e.DefaultExec.ExecPlugin(ctx, pluginPath, stdin, environ)
	took := time.Since(start)
	if filepath.Base(pluginPath) == "istio-cni" {
		var id, cmd string
		for _, kv := range environ {
			if v, ok := strings.CutPrefix(kv, "CNI_CONTAINERID="); ok {
				id = v
			} else if v, ok := strings.CutPrefix(kv, "CNI_COMMAND="); ok {
				cmd = v
			}
		}
		e.mu.Lock()
		e.took[id+"/"+cmd] = took
		e.mu.Unlock()
	}
	return out, err
}

func (e *timedExec) take(id, cmd string) (time.Duration, bool) {
	e.mu.Lock()
	defer e.mu.Unlock()
	d, ok := e.took[id+"/"+cmd]
	delete(e.took, id+"/"+cmd)
	return d, ok
}

func (b *bench) record(k string, d time.Duration) {
	b.mu.Lock()
	b.samples[k] = append(b.samples[k], d)
	b.mu.Unlock()
}

func pct(ds []time.Duration, p float64) time.Duration {
	s := append([]time.Duration(nil), ds...)
	sort.Slice(s, func(i, j int) bool { return s[i] < s[j] })
	if len(s) == 0 {
		return 0
	}
	i := int(p*float64(len(s))+0.5) - 1
	return s[max(0, min(i, len(s)-1))]
}

func ms(d time.Duration) string { return fmt.Sprintf("%7.2f ms", float64(d)/float64(time.Millisecond)) }

func (b *bench) report(bin string) error {
	fmt.Printf("%-26s %5s %10s %10s\n", "series", "n", "p50", "p99")
	keys := make([]string, 0, len(b.samples))
	for k := range b.samples {
		keys = append(keys, k)
	}
	sort.Strings(keys)
	for _, k := range keys {
		fmt.Printf("%-26s %5d %s %s\n", k, len(b.samples[k]), ms(pct(b.samples[k], .5)), ms(pct(b.samples[k], .99)))
	}
	p50 := func(k string) time.Duration { return pct(b.samples[k], .5) }
	ratio := func(a, c string) float64 { return float64(p50(a)) / float64(p50(c)) }
	fmt.Println()
	// istio-cni's own share: its process inside the chained ADD, from the
	// runtime starting it to its answer.
	own := func(series string) string { return ms(p50(series + " istio-cni ADD")) }
	fmt.Printf("istio-cni own share of the chained ADD, sequential p50 (its process, start to answer):\n")
	fmt.Printf("  with the agent, iptables:   %s (target <= 3 ms, #3; <= 10 ms, #2)\n", own("seq/chain+agent"))
	fmt.Printf("  with the agent, nftables:   %s (target <= 2 ms, #5)\n", own("seq/chain+agent/nftables"))
	fmt.Printf("  no agent (fallback), iptables: %s, nftables: %s\n", own("seq/chain (no agent)"), own("seq/chain (no agent)/nftables"))
	fmt.Printf("  DEL with the agent (start-up floor): %s\n", ms(p50("seq/chain+agent istio-cni DEL")))
	fmt.Printf("  the rules alone (Apply of Istio's default rules into a fresh netns, warm process): nftables %s, iptables %s\n",
		ms(p50("floor/default rules into a fresh netns, nftables (netlink)")), ms(p50("floor/default rules into a fresh netns, iptables (iptables-restore)")))
	fmt.Printf("chain - primary ADD p50, sequential: agent %s, agent+nftables %s, no agent %s\n",
		ms(p50("seq/chain+agent ADD")-p50("seq/primary (agent up) ADD")), ms(p50("seq/chain+agent/nftables ADD")-p50("seq/primary (agent up) ADD")),
		ms(p50("seq/chain (no agent) ADD")-p50("seq/primary ADD")))
	fmt.Printf("chain+agent / primary ADD p50, %d parallel: %.2fx (target <= 1.5x)\n", *parallel, ratio("par/chain+agent ADD", "par/primary ADD"))
	fmt.Printf("nftables chain+agent / primary ADD p50, %d parallel: %.2fx (target <= 1.2x)\n", *parallel, ratio("par/chain+agent/nftables ADD", "par/primary ADD"))
	b.reportCPU()
	if rs := b.samples["repair"]; len(rs) > 0 {
		fmt.Printf("broken pod to repaired p50/p99:             %s / %s (target < 1 s)\n", ms(pct(rs, .5)), ms(pct(rs, .99)))
	}
	if rs := b.samples["reinsert"]; len(rs) > 0 {
		fmt.Printf("config re-insertion after a rewrite p50/p99: %s / %s (target <= 100 ms)\n", ms(pct(rs, .5)), ms(pct(rs, .99)))
	}

	fi, err := os.Stat(bin)
	if err != nil {
		return err
	}
	fb, err := os.Stat(filepath.Join(filepath.Dir(bin), testenv.FallbackBinary))
	if err != nil {
		return err
	}
	fmt.Printf("plugin binary size: istio-cni %.1f MB, istio-cni-fallback %.1f MB (target <= 20 MB)\n", float64(fi.Size())/1e6, float64(fb.Size())/1e6)
	for _, path := range []string{bin, filepath.Join(filepath.Dir(bin), testenv.FallbackBinary)} {
		var vs, cs []time.Duration
		for i := 0; i < 50; i++ {
			cmd := exec.Command(path)
			cmd.Env = []string{"CNI_COMMAND=VERSION"}
			start := time.Now()
			if err := cmd.Run(); err != nil {
				return fmt.Errorf("VERSION: %w", err)
			}
			vs = append(vs, time.Since(start))
			ru := cmd.ProcessState.SysUsage().(*syscall.Rusage)
			cs = append(cs, time.Duration(ru.Utime.Nano()+ru.Stime.Nano()))
		}
		fmt.Printf("VERSION start-up p50 / p99, %-18s %s / %s (CPU p50 %s)\n", filepath.Base(path)+":", ms(pct(vs, .5)), ms(pct(vs, .99)), ms(pct(cs, .5)))
		if path == bin {
			b.samples["cpu/relay start"] = cs
		}
	}
	b.reportCPUFloor()
	b.reportLists()
	return nil
}

// listsOnly runs the list series alone: without and with the agent.
func (b *bench) listsOnly(ctx context.Context, c *testenv.Cluster, dir string, chainedNFT *libcni.NetworkConfigList) error {
	if err := b.lists(ctx, c, "no agent", b.node.Chained, chainedNFT); err != nil {
		return err
	}
	stop, err := b.startAgent(ctx, c, dir)
	if err != nil {
		return err
	}
	defer stop()
	b.agent = podinfo.NewAgentClient(filepath.Join(b.node.RunDir, podinfo.AgentSocketName), time.Second)
	if err := b.lists(ctx, c, "agent", b.node.Chained, chainedNFT); err != nil {
		return err
	}
	b.reportLists()
	return nil
}

// ruleFloors times Istio's default rule set going into fresh namespaces
// from this process, warm: the kernel's share of every ADD, which no plugin
// design avoids.
func (b *bench) ruleFloors(n int) error {
	params, _, err := redirect.FromPod(&podinfo.Pod{
		Annotations: map[string]string{redirect.AnnotationStatus: "{}"},
		Containers:  []podinfo.Container{{Name: redirect.ProxyContainerName}}})
	if err != nil {
		return err
	}
	plan := ruleset.Build(params, false)
	backends := []struct {
		name  string
		rules plugin.Rules
	}{{"nftables (netlink)", &nftables.Applier{}}, {"iptables (iptables-restore)", &iptables.Applier{}}}
	for i := 0; i < n+3; i++ {
		for _, be := range backends {
			netns, err := testutils.NewNS()
			if err != nil {
				return err
			}
			cpuBefore, err := ownCPU()
			if err != nil {
				return err
			}
			start := time.Now()
			_, err = be.rules.Apply(netns.Path(), plan)
			took := time.Since(start)
			cpuAfter, cerr := ownCPU()
			if cerr != nil {
				return cerr
			}
			_ = netns.Close()
			_ = testutils.UnmountNS(netns)
			if err != nil {
				return err
			}
			if i >= 3 { // the first ones warm up
				b.record("floor/default rules into a fresh netns, "+be.name, took)
				b.record("cpu/default rules into a fresh netns, "+be.name, cpuAfter-cpuBefore)
			}
		}
	}
	return nil
}

// repairs starts pods without the plugin (the start-up race), reports
// their validation as failed the way the kubelet would, and times how long
// until the agent's repair controller has their rules in place.
func (b *bench) repairs(ctx context.Context, c *testenv.Cluster, n int) error {
	check := &iptables.Applier{}
	for i := 0; i < n; i++ {
		name := fmt.Sprintf("raced-%d", i)
		p, err := testenv.CreatePod(ctx, c.Client, testenv.PodSpec{Namespace: "bench", Name: name, Sidecar: true})
		if err != nil {
			return err
		}
		pod, err := testenv.NewPod("bench", name, string(p.UID), fmt.Sprintf("r%063d", i))
		if err != nil {
			return err
		}
		res, err := b.node.Add(ctx, b.node.Primary, pod)
		if err != nil {
			pod.Close()
			return err
		}
		r, err := current.NewResultFromResult(res)
		if err != nil {
			pod.Close()
			return err
		}
		stop, err := pod.StartSandboxProcess()
		if err != nil {
			pod.Close()
			return err
		}
		cleanup := func() {
			stop()
			_ = b.node.Del(ctx, b.node.Primary, pod)
			pod.Close()
		}
		p.Status.PodIP = r.IPs[0].Address.IP.String()
		p.Status.InitContainerStatuses = []corev1.ContainerStatus{{Name: "istio-validation", Image: "x",
			State: corev1.ContainerState{Terminated: &corev1.ContainerStateTerminated{ExitCode: 126, Reason: "Error"}}}}
		start := time.Now()
		if _, err := c.Client.CoreV1().Pods("bench").UpdateStatus(ctx, p, metav1.UpdateOptions{}); err != nil {
			cleanup()
			return err
		}
		deadline := time.Now().Add(10 * time.Second)
		for {
			if pod.RulesPresent(check) {
				break
			}
			if time.Now().After(deadline) {
				cleanup()
				return fmt.Errorf("pod %s not repaired within 10s", name)
			}
			time.Sleep(2 * time.Millisecond) // polling the kernel state, bounded
		}
		b.record("repair", time.Since(start))
		cleanup()
	}
	return nil
}
