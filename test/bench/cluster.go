package main

import (
	"bytes"
	"context"
	"encoding/json"
	"flag"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"
	"time"

	"golang.org/x/sys/unix"
	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/istio-cni-go/istio-cni/internal/testenv"
)

// clusterConfig is the cluster series' part of the command line.
type clusterConfig struct {
	// pods is the burst: sidecar pods created at once; 0 skips the series.
	pods int
	// rounds of each arm per node size.
	rounds int
	// roundsFor, when not zero, bounds the rounds by time: once this long
	// has passed since a node size's first round began, no other round of
	// it begins (each size has its first round whatever the time).
	roundsFor time.Duration
	// agentCPU is the agent's CPU request; empty keeps the chart's.
	agentCPU string
	// busy pods each keep one CPU thread spinning with busyCPU requested:
	// the node's own workload, against which the pods start.
	busy    int
	busyCPU string
	// full also measures the burst on a node filled up to maxPods (110)
	// with idle pods, besides the burst on a node with only the busy pods.
	full bool
	// small measures the burst on a node with only the busy pods; off,
	// with full, only the full node is measured.
	small bool
	// arms are the ways the node runs, comma-separated names of
	// clusterArms.
	arms string
	// svg, when set, is where the series, or the pool, is drawn (plot.go).
	svg string
	// pool, when set, names logs of earlier runs (comma-separated) to
	// pool round by round instead of measuring (pool.go).
	pool string
}

func (c *clusterConfig) register(fs *flag.FlagSet) {
	fs.IntVar(&c.pods, "cluster-pods", 0, "instead: start this many sidecar pods at once on a real kubelet node, in each arm")
	fs.IntVar(&c.rounds, "cluster-rounds", 3, "rounds of each arm per node size in the cluster series")
	fs.DurationVar(&c.roundsFor, "cluster-rounds-for", 0, "if not 0: begin no round of a node size once this long has passed since its first round began, but the rounds of a balanced order of the arms already begun (at most -cluster-rounds; set both before the run, as a machine's speed is not known before it)")
	fs.StringVar(&c.agentCPU, "cluster-agent-cpu", "", "the agent's CPU request in the cluster series (the chart's default when empty)")
	fs.IntVar(&c.busy, "cluster-busy", 2, "pods spinning one CPU thread each while the pods start")
	fs.StringVar(&c.busyCPU, "cluster-busy-cpu", "600m", "CPU each busy pod requests")
	fs.BoolVar(&c.full, "cluster-full", true, "also measure the burst on a node holding maxPods (110) pods")
	fs.BoolVar(&c.small, "cluster-small", true, "measure the burst on a node with only the busy pods besides it (off with -cluster-full: the full node alone)")
	fs.StringVar(&c.svg, "cluster-svg", "", "also draw the cluster series (or, with -cluster-pool, the pooled changes) into this SVG file")
	fs.StringVar(&c.pool, "cluster-pool", "", "instead of measuring: pool the rounds of earlier cluster runs from their logs (their stderr, comma-separated files), each arm but the mixed ones against without by node size")
	fs.StringVar(&c.arms, "cluster-arms", "without,plugin,mixed", "the ways the node runs, in a balanced order by round: without, plugin, agent, mixed, mixed-waiting, mixed-none, without-again, chart-only, chained-tuning")
}

// maxPods is the kubelet's default limit of pods on a node.
const maxPods = 110

// clusterArm is one way of running the node: without the plugin, or with
// the chart and some values.
type clusterArm struct {
	name, about string
	// values adds to the chart's values; nil runs without the plugin.
	values func(map[string]any)
	// mixed bursts run every other pod through the node's plain runtime
	// handler, which never runs istio-cni: the two halves start side by
	// side, under the same load, one with the plugin and one without.
	mixed bool
	// again marks a second arm without the plugin, compared with
	// `without` as the plugin's arms are: the alternation's own drift.
	again bool
	// plain runs every pod of the burst through the plain runtime
	// handler, with the chart installed: what the agent's presence on
	// the node costs a burst whose pods the plugin never serves.
	plain bool
	// tuning chains the reference tuning plugin, configured to do
	// nothing, after the primary, with no istio-cni: what any chained
	// plugin's process costs a burst, beside what the relay costs.
	tuning bool
}

// clusterArms are the arms the series knows. Each with-plugin arm is the
// chart at its defaults but for what the arm is about.
var clusterArms = map[string]clusterArm{
	"without": {name: "without", about: "no istio-cni"},
	"plugin": {name: "plugin", about: "istio-cni, chart defaults: the relay sends the rules the agent prepared",
		values: func(map[string]any) {}},
	"agent": {name: "agent", about: "istio-cni, the agent commits every pod's rules in its own container, sending the requests it prepared (CNI_RULES_COMMITTER=agent)",
		values: func(v map[string]any) { v["env"].(map[string]any)["CNI_RULES_COMMITTER"] = "agent" }},
	"mixed": {name: "mixed", about: "istio-cni, chart defaults, for every other pod of the burst; the rest run through a runtime handler without it (which half is which alternates by round)",
		values: func(map[string]any) {}, mixed: true},
	"without-again": {name: "without-again", about: "no istio-cni, as without, compared with it as the plugin's arms are: the alternation's own drift between rounds",
		again: true},
	"mixed-none": {name: "mixed-none", about: "no istio-cni, the burst split as mixed splits it (every other pod through the plain handler): the comparison's own spread, both halves without the plugin",
		mixed: true},
	"chart-only": {name: "chart-only", about: "istio-cni installed (chart defaults), but every pod of the burst through a runtime handler without it: the agent's presence alone",
		values: func(map[string]any) {}, plain: true},
	"chained-tuning": {name: "chained-tuning", about: "no istio-cni, but the reference tuning plugin chained after the primary, doing nothing: one more plugin process per pod, as the relay is",
		tuning: true},
	"mixed-waiting": {name: "mixed-waiting", about: "mixed, but relays with no record wait for the agent however long it takes (CNI_AGENT_WAIT=0), as before relays left a slow agent",
		values: func(v map[string]any) { v["env"].(map[string]any)["CNI_AGENT_WAIT"] = "0" }, mixed: true},
}

// burstFigures are one burst's: each pod's creation to Ready, sorted, and
// the node's CPU over the burst by cgroup.
type burstFigures struct {
	startup []time.Duration
	// without is, in a mixed burst, each plain-handler pod's creation to
	// Ready, sorted (startup then holds the other half's).
	without []time.Duration
	// started is each pod's creation to its last container's start, and
	// setup its sandbox's set-up (the sandbox begun to the first
	// container created, the CNI ADD inside it), both as the runtime
	// stamped them, sorted; startedWithout and setupWithout are a mixed
	// burst's plain-handler half's.
	started, startedWithout []time.Duration
	setup, setupWithout     []time.Duration
	cpu                     nodeCPU
	// pluginCPU is each ADD's plugin process CPU as the agent logged it
	// (plugin_cpu); fallback counts the burst's ADDs that went to the
	// fallback plugin instead.
	pluginCPU []time.Duration
	// agentTime is each ADD's time in the agent as it logged it
	// (duration: from the request read to the relay's report), waits for
	// the CPU included.
	agentTime []time.Duration
	// agentOwn is each ADD's lookup and planning in the agent (lookup +
	// plan as logged): its part before the relay takes over.
	agentOwn []time.Duration
	fallback int
	// left counts the fallbacks of relays that left the agent after
	// cnirelay.LeaveAfter with no answer (no record for the pod yet);
	// fallbackTime is each fallback ADD's time as it logged it, and
	// fallbackLookup its pod lookup (from the API server) in it.
	left           int
	fallbackTime   []time.Duration
	fallbackLookup []time.Duration
	// fallbackCPU is each fallback ADD's process CPU, its children's
	// included, as it logged it (plugin_cpu).
	fallbackCPU []time.Duration
	// prepared counts the ADDs the relay served from the pod's prepared
	// record: no time in the agent (their duration is the relay's own,
	// left out of agentTime).
	prepared int
	// events counts the burst's pods' events beyond a plain start, by
	// reason (a sandbox made again costs the runtime a second start), and
	// eventText is one message of each reason.
	events    map[string]int
	eventText map[string]string
}

// pods is how many pods the burst started, both halves of a mixed one.
func (b *burstFigures) pods() int { return len(b.startup) + len(b.without) }

// perPod is d over the burst's pods, 0 for a burst that started none.
func (b *burstFigures) perPod(d time.Duration) time.Duration {
	if n := b.pods(); n > 0 {
		return d / time.Duration(n)
	}
	return 0
}

// nodeCPU is CPU time over a burst: the whole node, the runtime's
// cgroup (containerd, kubelet, runc, the CNI plugins they start), the
// agent's pod, and everything in kubepods besides the agent.
type nodeCPU struct {
	node, runtime, agent, pods time.Duration
	// The runtime's cgroup by process: containerd itself, the processes
	// it started and waited for (the CNI plugins, run by hand), and the
	// kubelet; the rest of it is the shims and the runc they start.
	containerd, cni, kubelet time.Duration
	// control is the cluster's own processes (etcd, the API server, the
	// controller manager): outside the node, but on this machine's CPUs,
	// serving the node's requests and watches (the agent's among them).
	control time.Duration
}

// shims is the runtime's cgroup but containerd, the processes it waited
// for and the kubelet: the shims and the runc they start.
func (c nodeCPU) shims() time.Duration { return c.runtime - c.containerd - c.cni - c.kubelet }

// plus and minus add and subtract readings field by field, so that a new
// field cannot be left out of a difference or a sum.
func (c nodeCPU) plus(o nodeCPU) nodeCPU {
	return nodeCPU{node: c.node + o.node, runtime: c.runtime + o.runtime, agent: c.agent + o.agent, pods: c.pods + o.pods,
		containerd: c.containerd + o.containerd, cni: c.cni + o.cni, kubelet: c.kubelet + o.kubelet, control: c.control + o.control}
}

func (c nodeCPU) minus(o nodeCPU) nodeCPU {
	return nodeCPU{node: c.node - o.node, runtime: c.runtime - o.runtime, agent: c.agent - o.agent, pods: c.pods - o.pods,
		containerd: c.containerd - o.containerd, cni: c.cni - o.cni, kubelet: c.kubelet - o.kubelet, control: c.control - o.control}
}

// roundDue says whether round (from 0) of a node size begins, elapsed
// after its first round began, with design rounds balancing the arms'
// order (designRounds): past the time bound the rounds still run to the
// end of a design, so that every arm has followed every other equally
// often.
func (c *clusterConfig) roundDue(round int, elapsed time.Duration, design int) bool {
	if round >= c.rounds {
		return false
	}
	return round == 0 || c.roundsFor <= 0 || elapsed < c.roundsFor || round%max(design, 1) != 0
}

// clusterResult holds every burst by node size (pods on the node with the
// burst) and arm, in the order measured.
type clusterResult struct {
	sizes  []int
	arms   []clusterArm
	bursts map[int]map[string][]burstFigures
	// busyPods and idle are what shared the node with each burst.
	busyPods int
	idle     map[int]int
}

// roundsDone is the fewest rounds an arm ran at any node size: set, or
// fewer where -cluster-rounds-for stopped them.
func (r *clusterResult) roundsDone(set int) int {
	done := set
	for _, size := range r.sizes {
		for _, a := range r.arms {
			done = min(done, len(r.bursts[size][a.name]))
		}
	}
	return done
}

// clusterStartup measures pod start-up on a real kubelet+containerd node
// laid out in cgroups as a node is: a burst of sidecar pods created at
// once, time from creation to Ready, in rounds that rotate the arms, on a
// node loaded by busy pods and, with full, filled with idle pods up to
// maxPods.
func clusterStartup(ctx context.Context, cfg clusterConfig) (*clusterResult, error) {
	res := &clusterResult{bursts: map[int]map[string][]burstFigures{}, busyPods: cfg.busy, idle: map[int]int{}}
	for _, name := range parseArms(cfg.arms) {
		arm, ok := clusterArms[name]
		if !ok {
			return nil, fmt.Errorf("unknown cluster arm %q (known: without, plugin, agent, mixed, mixed-waiting, mixed-none, without-again, chart-only, chained-tuning)", name)
		}
		res.arms = append(res.arms, arm)
	}
	one, err := testenv.StartOneNodeIn(ctx, "istio-cni-bench-cluster-",
		testenv.NodeSetup{AgentImage: true, Namespaces: []string{"istio-system", "bench"}})
	if err != nil {
		return nil, err
	}
	defer one.Stop()
	cluster := one.Cluster
	if err := testenv.EnsureRuntimeClasses(ctx, cluster.Client); err != nil {
		return nil, err
	}
	busy := busyPods(cfg.busy, cfg.busyCPU)
	// A warm-up burst: images unpacked, caches filled; half of it through
	// the plain handler, whose config containerd loads apart.
	if _, err := burst(ctx, one, sidecarPods("warm", cfg.pods, mixedClasses(0)), ""); err != nil {
		return nil, err
	}
	// And one with the chart, when an arm installs it: the agent's first
	// start on the node reads its image from disk (29 ms of its CPU per
	// pod in run BG's first plugin burst, 3-4 ms in every later one), a
	// cost of the first round's arm alone, not of the plugin.
	for _, arm := range res.arms {
		if arm.values != nil {
			if _, err := armBurst(ctx, one, cfg, arm, "warm-chart", 0); err != nil {
				return nil, fmt.Errorf("warm-up with the chart (%s): %w", arm.name, err)
			}
			break
		}
	}
	// One burst's pods plus the agent and the busy pods; full fills the
	// node to maxPods with idle pods around the burst.
	var sizes []int
	if cfg.small || !cfg.full {
		sizes = append(sizes, 0)
	}
	if cfg.full {
		sizes = append(sizes, maxPods-cfg.pods-cfg.busy-1)
	}
	for _, idle := range sizes {
		size := idle + cfg.pods + cfg.busy + 1
		res.sizes = append(res.sizes, size)
		res.idle[size] = idle
		res.bursts[size] = map[string][]burstFigures{}
		// The idle pods first: BestEffort, their containers weigh next to
		// nothing against the busy pods' spinning, and would not start
		// beside them.
		idlePods := idleSidecarPods(idle)
		if len(idlePods) > 0 {
			if _, err := testenv.StartPods(ctx, cluster, "bench", idlePods, 5*time.Minute); err != nil {
				return nil, fmt.Errorf("idle pods: %w", err)
			}
		}
		if len(busy) > 0 {
			if _, err := testenv.StartPods(ctx, cluster, "bench", busy, 3*time.Minute); err != nil {
				return nil, fmt.Errorf("busy pods: %w", err)
			}
		}
		first := time.Now()
		for round := 0; round < cfg.rounds; round++ {
			if !cfg.roundDue(round, time.Since(first), designRounds(len(res.arms))) {
				fmt.Fprintf(os.Stderr, "%d pods on the node: %d of %d rounds in the %s -cluster-rounds-for gave them\n", size, round, cfg.rounds, cfg.roundsFor)
				break
			}
			for _, i := range armOrder(len(res.arms), round) {
				arm := res.arms[i]
				name := fmt.Sprintf("%s-%d-%d", arm.name, size, round)
				f, err := armBurst(ctx, one, cfg, arm, name, round)
				if err != nil {
					return nil, fmt.Errorf("%s, %d pods on the node, round %d: %w", arm.name, size, round, err)
				}
				res.bursts[size][arm.name] = append(res.bursts[size][arm.name], f)
				// As it goes, on stderr: a run that fails later keeps
				// what it measured.
				fmt.Fprintln(os.Stderr, burstLine(name, f))
				fmt.Fprintln(os.Stderr, burstCPULine(name, f))
			}
		}
		if err := testenv.DeletePods(ctx, cluster, "bench", append(busy, idlePods...), 5*time.Minute); err != nil {
			return nil, err
		}
	}
	return res, nil
}

// armBurst runs one burst with the node as arm has it: the chart installed
// with the arm's values for the burst and removed after it.
func armBurst(ctx context.Context, one *testenv.OneNode, cfg clusterConfig, arm clusterArm, round string, index int) (burstFigures, error) {
	var classes func(int) string
	if arm.mixed {
		classes = mixedClasses(index)
	}
	ps := sidecarPods(round, cfg.pods, classes)
	if arm.plain {
		// Named as a plugin arm's pods, so the burst is compared with
		// `without` as theirs are.
		plain := testenv.PlainRuntimeClass
		for _, p := range ps {
			p.Spec.RuntimeClassName = &plain
		}
	}
	if arm.tuning {
		restore, err := chainTuning(ctx, one.Node)
		if err != nil {
			return burstFigures{}, err
		}
		f, err := burst(ctx, one, ps, "")
		if rerr := restore(); err == nil {
			err = rerr
		}
		return f, err
	}
	if arm.values == nil {
		return burst(ctx, one, ps, "")
	}
	values := testenv.NodeChartValues(one.Cluster, one.Node, false)
	if cfg.agentCPU != "" {
		values["resources"] = map[string]any{"requests": map[string]any{"cpu": cfg.agentCPU, "memory": "100Mi"}}
	}
	arm.values(values)
	rel, err := testenv.InstallChart(one.Cluster, values)
	if err != nil {
		return burstFigures{}, err
	}
	agent, err := waitAgentPodReady(ctx, one.Cluster)
	if err != nil {
		return burstFigures{}, err
	}
	f, err := burst(ctx, one, ps, testenv.PodCgroupRel(string(agent.UID), agent.Status.QOSClass))
	if err != nil {
		return burstFigures{}, err
	}
	pl := pluginLines(agent, round)
	f.pluginCPU, f.agentTime, f.agentOwn, f.fallback, f.prepared = pl.cpu, pl.took, pl.own, pl.fallback, pl.prepared
	f.left, f.fallbackTime, f.fallbackLookup, f.fallbackCPU = pl.left, pl.fbTook, pl.fbLookup, pl.fbCPU
	if arm.plain && len(f.pluginCPU)+f.fallback > 0 {
		return burstFigures{}, fmt.Errorf("round %s: the plugin served %d ADDs of pods of the plain runtime handler", round, len(f.pluginCPU)+f.fallback)
	}
	if arm.mixed {
		// Each half is what it says: the plugin served every pod of its
		// half, and never saw one of the other.
		text, _ := podLogs(agent)
		for _, line := range strings.Split(text, "\n") {
			// A CNI command's lines name it; the repair controller's
			// (which sees every pod of the node come and go) do not.
			if strings.Contains(line, "pod=bench/"+plainPrefix+round) && strings.Contains(line, "cmd=") {
				return burstFigures{}, fmt.Errorf("the plugin served a pod of the plain runtime handler: %s", line)
			}
		}
		if got := len(f.pluginCPU) + f.fallback; got < len(f.startup) {
			return burstFigures{}, fmt.Errorf("round %s: %d ADDs of the plugin's half logged, want %d", round, got, len(f.startup))
		}
	}
	// The agent's last words say why, if it leaves the plugin behind.
	logs := followLogs(ctx, one.Cluster, agent)
	if err := rel.Uninstall(); err != nil {
		return burstFigures{}, err
	}
	if err := waitAgentPodGone(ctx, one.Cluster); err != nil {
		return burstFigures{}, err
	}
	if err := waitPluginRemoved(ctx, one.Node); err != nil {
		return burstFigures{}, fmt.Errorf("%w; the agent's log ends:\n%s", err, lastLines(logs(), 15))
	}
	return f, nil
}

// pluginLog is what the agent's log says of a round's ADDs.
type pluginLog struct {
	// cpu is the plugin process CPU of each ADD the agent served; took
	// its time in the agent, own the lookup and planning in that.
	cpu, took, own []time.Duration
	// fallback counts the ADDs the fallback served, left those of them
	// whose relay left a slow agent; fbTook and fbLookup are the
	// fallback's time and its pod lookup in it.
	fallback, left          int
	fbTook, fbLookup, fbCPU []time.Duration
	// prepared counts the ADDs the relay served from prepared records.
	prepared int
}

// pluginLines reads, from the agent's log as the kubelet keeps it, the
// round's ADDs: those the agent served, those the relay served from
// prepared records, and those the fallback served (its lines reach the
// agent's log marked fallback).
func pluginLines(p *corev1.Pod, round string) pluginLog {
	var l pluginLog
	text, _ := podLogs(p)
	for _, line := range strings.Split(text, "\n") {
		if !strings.Contains(line, "pod=bench/"+round+"-") {
			continue
		}
		fb := strings.Contains(line, "fallback=true")
		if strings.Contains(line, "served without the node agent") {
			l.fallback++
			if strings.Contains(line, "node agent behind") {
				l.left++
			}
		}
		if !strings.Contains(line, "redirect rules programmed") {
			continue
		}
		if fb {
			if d, err := testenv.LogDuration(line, "duration"); err == nil {
				l.fbTook = append(l.fbTook, d)
			}
			if d, err := testenv.LogDuration(line, "lookup"); err == nil {
				l.fbLookup = append(l.fbLookup, d)
			}
			if d, err := testenv.LogDuration(line, "plugin_cpu"); err == nil {
				l.fbCPU = append(l.fbCPU, d)
			}
			continue
		}
		if d, err := testenv.LogDuration(line, "plugin_cpu"); err == nil {
			l.cpu = append(l.cpu, d)
		}
		if strings.Contains(line, "prepared=true") {
			l.prepared++
		} else if d, err := testenv.LogDuration(line, "duration"); err == nil {
			l.took = append(l.took, d)
		}
		lk, lerr := testenv.LogDuration(line, "lookup")
		pl, perr := testenv.LogDuration(line, "plan")
		if lerr == nil && perr == nil {
			l.own = append(l.own, lk+pl)
		}
	}
	for _, d := range [][]time.Duration{l.took, l.own, l.fbTook, l.fbLookup, l.fbCPU} {
		slices.Sort(d)
	}
	return l
}

// podLogs is a pod's log as the kubelet keeps it (under /var/log/pods,
// in this process's mount namespace), its containers' files one after
// another, and how many files there were.
func podLogs(p *corev1.Pod) (string, int) {
	dir := kubeletPodLogs + "/" + p.Namespace + "_" + p.Name + "_" + string(p.UID)
	files, _ := filepath.Glob(filepath.Join(dir, "*", "*.log"))
	var all strings.Builder
	for _, f := range files {
		if b, err := os.ReadFile(f); err == nil {
			all.Write(b)
		}
	}
	return all.String(), len(files)
}

// kubeletPodLogs is the kubelet's default podLogsDir.
const kubeletPodLogs = "/var/log/pods"

// followLogs copies the pod's log as the kubelet writes it (under
// /var/log/pods, in this process's mount namespace) until ctx ends or the
// log is gone; the returned function gives what was read so far. The API
// server's log endpoint needs the node's name to resolve, which the test
// node's does not.
func followLogs(ctx context.Context, _ *testenv.Cluster, p *corev1.Pod) func() string {
	var mu sync.Mutex
	var text string
	dir := kubeletPodLogs + "/" + p.Namespace + "_" + p.Name + "_" + string(p.UID)
	ctx, cancel := context.WithCancel(ctx)
	go func() {
		defer cancel()
		for ctx.Err() == nil {
			all, files := podLogs(p)
			mu.Lock()
			if len(all) >= len(text) {
				text = all
			}
			mu.Unlock()
			if files == 0 && text != "" {
				return // the kubelet removed the pod's logs
			}
			select {
			case <-ctx.Done():
			case <-time.After(100 * time.Millisecond): // copying a file as it grows
			}
		}
	}()
	return func() string {
		mu.Lock()
		defer mu.Unlock()
		if text == "" {
			return "(no log found under " + dir + ")"
		}
		return text
	}
}

func lastLines(s string, n int) string {
	lines := strings.Split(strings.TrimRight(s, "\n"), "\n")
	return strings.Join(lines[max(0, len(lines)-n):], "\n")
}

// waitPluginRemoved waits for the uninstalled agent's clean-up: a node
// whose config still chains the plugin would fail the next arm's pods.
func waitPluginRemoved(ctx context.Context, n *testenv.KubeNode) error {
	conf := filepath.Join(n.ConfDir, "10-ptp.conflist")
	deadline := time.Now().Add(30 * time.Second)
	for {
		b, err := os.ReadFile(conf)
		if err != nil {
			return err
		}
		if !strings.Contains(string(b), `"istio-cni"`) {
			return nil
		}
		if time.Now().After(deadline) || ctx.Err() != nil {
			return fmt.Errorf("the uninstalled agent left the plugin in %s", conf)
		}
		time.Sleep(100 * time.Millisecond) // polling a file the agent rewrites, untimed
	}
}

// burst creates n sidecar pods at once and measures each one's creation
// to Ready and the node's CPU meanwhile, agentCgroup being the agent's
// pod ("" when there is none); the pods are deleted before it returns.
func burst(ctx context.Context, one *testenv.OneNode, ps []*corev1.Pod, agentCgroup string) (burstFigures, error) {
	cg := one.Node.Cgroups
	read := func() (nodeCPU, error) {
		var s nodeCPU
		var err error
		if s.node, err = cg.CPUUsage(""); err != nil {
			return s, err
		}
		if s.runtime, err = cg.CPUUsage("runtime"); err != nil {
			return s, err
		}
		if s.pods, err = cg.CPUUsage("kubepods"); err != nil {
			return s, err
		}
		if agentCgroup != "" {
			if s.agent, err = cg.CPUUsage(agentCgroup); err != nil {
				return s, err
			}
		}
		pids := one.Node.RuntimePIDs()
		if len(pids) != 2 {
			return s, fmt.Errorf("node processes %v, want containerd and the kubelet", pids)
		}
		var kubeletChildren time.Duration
		if s.containerd, s.cni, err = procCPU(pids[0]); err != nil {
			return s, err
		}
		if s.kubelet, kubeletChildren, err = procCPU(pids[1]); err != nil {
			return s, err
		}
		s.kubelet += kubeletChildren
		for _, pid := range one.Cluster.ControlPlanePIDs() {
			self, children, err := procCPU(pid)
			if err != nil {
				return s, err
			}
			s.control += self + children
		}
		return s, nil
	}
	// The kubelet's container GC removes the sandboxes of deleted pods
	// once a minute, each with a CNI DEL down the whole chain: tens of
	// DELs (with istio-cni, a relay each) that land in whichever burst is
	// running then. Removed now, before the node settles, they cost no
	// burst anything.
	if _, err := one.Node.RemoveStoppedSandboxes(ctx); err != nil {
		return burstFigures{}, err
	}
	if err := settle(ctx, cg, agentCgroup); err != nil {
		return burstFigures{}, err
	}
	before, err := read()
	if err != nil {
		return burstFigures{}, err
	}
	// On stderr, the burst's span, so that perf report --time can split a
	// whole run's profile by burst.
	span := monoSpan()
	created, byPod, err := testenv.StartPodsAt(ctx, one.Cluster, "bench", ps, 5*time.Minute)
	if len(ps) > 0 {
		span("burst " + ps[0].Name)
	}
	if err != nil {
		return burstFigures{}, err
	}
	var f burstFigures
	for name, d := range byPod {
		if strings.HasPrefix(name, plainPrefix) {
			f.without = append(f.without, d)
		} else {
			f.startup = append(f.startup, d)
		}
	}
	// The runtime's own stamps of the same starts, in nanoseconds: the
	// kubelet sees a container start at its next relist, once a second,
	// so Ready comes in batches a second apart, which a round's p50 falls
	// on one of or the next. What the plugin can delay (the sandbox's
	// set-up) ends before the containers start.
	rts, err := one.Node.RuntimeTimes(ctx, "bench")
	if err != nil {
		return burstFigures{}, err
	}
	for _, p := range ps {
		rt, ok := rts[p.Name]
		if !ok || rt.Started.IsZero() || rt.ContainersCreated.IsZero() {
			return burstFigures{}, fmt.Errorf("the runtime has no running sandbox and containers for Ready pod %s", p.Name)
		}
		started, setup := rt.Started.Sub(created[p.Name]), rt.ContainersCreated.Sub(rt.SandboxCreated)
		if strings.HasPrefix(p.Name, plainPrefix) {
			f.startedWithout = append(f.startedWithout, started)
			f.setupWithout = append(f.setupWithout, setup)
		} else {
			f.started = append(f.started, started)
			f.setup = append(f.setup, setup)
		}
	}
	for _, ds := range [][]time.Duration{f.startup, f.without, f.started, f.startedWithout, f.setup, f.setupWithout} {
		slices.Sort(ds)
	}
	after, err := read()
	if err != nil {
		return burstFigures{}, err
	}
	if f.events, f.eventText, err = podEvents(ctx, one.Cluster, ps); err != nil {
		return burstFigures{}, err
	}
	split := after.minus(before)
	// The agent's pod is one of the pods; its CPU is shown on its own.
	split.pods -= split.agent
	f.cpu = split
	return f, testenv.DeletePods(ctx, one.Cluster, "bench", ps, 3*time.Minute)
}

// routineEvents are a pod's events on a plain start. MissingClusterDNS
// is one too: the test kubelet has no cluster DNS to give pods, and says
// so for every pod in every arm.
var routineEvents = map[string]bool{"Scheduled": true, "Pulled": true, "Created": true, "Started": true, "MissingClusterDNS": true}

// podEvents counts the events of pods beyond a plain start (warnings,
// and such as SandboxChanged, a Normal event) by reason, with one
// message of each reason.
func podEvents(ctx context.Context, c *testenv.Cluster, ps []*corev1.Pod) (map[string]int, map[string]string, error) {
	names := map[string]bool{}
	for _, p := range ps {
		names[p.Name] = true
	}
	evs, err := c.Client.CoreV1().Events("bench").List(ctx, metav1.ListOptions{})
	if err != nil {
		return nil, nil, err
	}
	count, text := map[string]int{}, map[string]string{}
	for i := range evs.Items {
		e := &evs.Items[i]
		if e.InvolvedObject.Kind != "Pod" || !names[e.InvolvedObject.Name] || routineEvents[e.Reason] {
			continue
		}
		count[e.Reason] += int(max(e.Count, 1))
		if _, ok := text[e.Reason]; !ok {
			text[e.Reason] = e.Message
		}
	}
	return count, text, nil
}

// procCPU is a process's own CPU time and that of its children it has
// waited for, from /proc/<pid>/stat (in clock ticks of 10 ms).
func procCPU(pid int) (self, children time.Duration, err error) {
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
	if err != nil {
		return 0, 0, err
	}
	// The command name is in parentheses and may hold spaces: fields
	// count from after its closing one (state is field 3).
	i := bytes.LastIndexByte(b, ')')
	if i < 0 {
		return 0, 0, fmt.Errorf("/proc/%d/stat: %q", pid, b)
	}
	f := strings.Fields(string(b[i+1:]))
	if len(f) < 15 {
		return 0, 0, fmt.Errorf("/proc/%d/stat: %q", pid, b)
	}
	tick := func(s string) time.Duration {
		v, _ := strconv.ParseInt(s, 10, 64)
		return time.Duration(v) * 10 * time.Millisecond
	}
	// utime, stime, cutime, cstime are fields 14-17.
	return tick(f[11]) + tick(f[12]), tick(f[13]) + tick(f[14]), nil
}

// settle waits, up to settleLimit, until the runtime and the agent have
// been quiet (under a tenth of a CPU) for two windows in a row: the
// chart's install, an agent's start and the last burst's teardown leave
// work behind that would otherwise land in one arm's burst and not the
// other's.
func settle(ctx context.Context, cg *testenv.NodeCgroups, agentCgroup string) error {
	const window, quiet, settleLimit = 500 * time.Millisecond, 0.1, 30 * time.Second
	busy := func() (time.Duration, error) {
		d, err := cg.CPUUsage("runtime")
		if err != nil || agentCgroup == "" {
			return d, err
		}
		a, err := cg.CPUUsage(agentCgroup)
		return d + a, err
	}
	deadline := time.Now().Add(settleLimit)
	calm := 0
	for calm < 2 && time.Now().Before(deadline) {
		before, err := busy()
		if err != nil {
			return err
		}
		start := time.Now()
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-time.After(window): // a measuring window, not a wait for an event
		}
		after, err := busy()
		if err != nil {
			return err
		}
		if float64(after-before)/float64(time.Since(start)) < quiet {
			calm++
		} else {
			calm = 0
		}
	}
	return nil
}

// plainPrefix starts the name of a mixed burst's pods that run through
// the plain runtime handler.
const plainPrefix = "plain-"

// mixedClasses gives a mixed burst's pod i its runtime class: every other
// pod the plain handler's, starting with the second in even rounds and
// the first in odd ones, so neither half always has the head of the queue.
func mixedClasses(round int) func(int) string {
	return func(i int) string {
		if (i+round)%2 == 1 {
			return testenv.PlainRuntimeClass
		}
		return testenv.DefaultRuntimeClass
	}
}

// sidecarPods are n pods shaped as Istio's injector shapes a sidecar pod,
// named after the round. The proxy requests a tenth of Istio's default
// (100m CPU, 128Mi) so that a burst plus a full node fits the 2-core
// machine's allocatable: Burstable pods, as injected pods are. classes,
// when not nil, gives pod i its runtime class; those of the plain handler
// are named with plainPrefix.
func sidecarPods(round string, n int, classes func(int) string) []*corev1.Pod {
	never := corev1.PullNever
	f := false
	uid := int64(1337)
	var out []*corev1.Pod
	for i := 0; i < n; i++ {
		name := fmt.Sprintf("%s-%d", round, i)
		var class *string
		if classes != nil {
			c := classes(i)
			class = &c
			if c == testenv.PlainRuntimeClass {
				name = plainPrefix + name
			}
		}
		out = append(out, &corev1.Pod{
			ObjectMeta: metav1.ObjectMeta{Name: name,
				Annotations: map[string]string{"sidecar.istio.io/status": testenv.InjectedStatus}},
			Spec: corev1.PodSpec{NodeName: testenv.NodeName, AutomountServiceAccountToken: &f, RuntimeClassName: class,
				Containers: []corev1.Container{
					{Name: "app", Image: testenv.AppImage, ImagePullPolicy: never, Args: []string{"serve", ":8080"}},
					{Name: "istio-proxy", Image: testenv.AppImage, ImagePullPolicy: never, Args: []string{"proxy", "sidecar", ":15001", ":15006"},
						SecurityContext: &corev1.SecurityContext{RunAsUser: &uid, RunAsGroup: &uid},
						Resources: corev1.ResourceRequirements{Requests: corev1.ResourceList{
							corev1.ResourceCPU: resource.MustParse("10m"), corev1.ResourceMemory: resource.MustParse("13Mi")}}},
				}},
		})
	}
	return out
}

// idleSidecarPods are the pods a node already runs when the burst comes.
func idleSidecarPods(n int) []*corev1.Pod {
	ps := sidecarPods("idle", n, nil)
	for _, p := range ps {
		// Requests of their own would leave no allocatable CPU for the
		// burst on this machine: BestEffort.
		for i := range p.Spec.Containers {
			p.Spec.Containers[i].Resources = corev1.ResourceRequirements{}
		}
	}
	return ps
}

// busyPods keep the node's CPU busy as its workload does, each with one
// spinning thread and cpu requested: Burstable pods whose weight is what
// the agent's competes with.
func busyPods(n int, cpu string) []*corev1.Pod {
	never := corev1.PullNever
	f := false
	var out []*corev1.Pod
	for i := 0; i < n; i++ {
		out = append(out, &corev1.Pod{
			ObjectMeta: metav1.ObjectMeta{Name: fmt.Sprintf("busy-%d", i)},
			Spec: corev1.PodSpec{NodeName: testenv.NodeName, AutomountServiceAccountToken: &f,
				Containers: []corev1.Container{{Name: "spin", Image: testenv.AppImage, ImagePullPolicy: never, Args: []string{"spin", "1"},
					Resources: corev1.ResourceRequirements{Requests: corev1.ResourceList{corev1.ResourceCPU: resource.MustParse(cpu)}}}}},
		})
	}
	return out
}

func waitAgentPodGone(ctx context.Context, c *testenv.Cluster) error {
	deadline := time.Now().Add(2 * time.Minute)
	for time.Now().Before(deadline) {
		pods, err := c.Client.CoreV1().Pods("istio-system").List(ctx, metav1.ListOptions{LabelSelector: "k8s-app=istio-cni-node"})
		if err == nil && len(pods.Items) == 0 {
			return nil
		}
		time.Sleep(200 * time.Millisecond) // polling the API server, untimed
	}
	return fmt.Errorf("agent pod still there 2m after uninstall")
}

func waitAgentPodReady(ctx context.Context, c *testenv.Cluster) (*corev1.Pod, error) {
	deadline := time.Now().Add(2 * time.Minute)
	for time.Now().Before(deadline) {
		pods, err := c.Client.CoreV1().Pods("istio-system").List(ctx, metav1.ListOptions{LabelSelector: "k8s-app=istio-cni-node"})
		if err == nil && len(pods.Items) == 1 {
			for _, cond := range pods.Items[0].Status.Conditions {
				if cond.Type == corev1.PodReady && cond.Status == corev1.ConditionTrue {
					return &pods.Items[0], nil
				}
			}
		}
		time.Sleep(200 * time.Millisecond) // polling the API server, untimed
	}
	return nil, fmt.Errorf("agent pod not Ready within 2m")
}

// parseArms reads -cluster-arms.
// armOrder is round's order of k arms, a row of a Williams design: over
// k rounds (2k when k is odd) every arm follows every other arm equally
// often within a round. A cyclic rotation would not: with three arms
// each arm's predecessor is one arm in two rounds of three, so whatever
// one arm leaves behind (a chart just removed) lands on the same other.
func armOrder(k, round int) []int {
	first := make([]int, 0, k)
	for lo, hi := 0, k-1; lo <= hi; {
		first = append(first, lo)
		lo++
		if lo <= hi {
			first = append(first, hi)
			hi--
		}
	}
	// first is 0, k-1, 1, k-2, ...: its successive differences are all
	// distinct mod k, which is what balances the shifted rows.
	r := round % designRounds(k)
	order := make([]int, k)
	for j := range order {
		order[j] = (first[j] + r%k) % k
	}
	if r >= k {
		slices.Reverse(order)
	}
	return order
}

// designRounds is how many rounds of k arms armOrder takes to balance
// them: k rows, and as many again reversed when k is odd.
func designRounds(k int) int {
	if k%2 == 1 {
		return 2 * k
	}
	return k
}

func parseArms(s string) []string {
	var out []string
	for _, a := range strings.Split(s, ",") {
		if a = strings.TrimSpace(a); a != "" {
			out = append(out, a)
		}
	}
	return out
}

// monoSpan starts a span on CLOCK_MONOTONIC, the clock `perf record -k
// mono` stamps samples with. The function it returns ends the span and
// writes "label: CLOCK_MONOTONIC start,end" to stderr, in the form perf
// report --time takes.
func monoSpan() (end func(label string)) {
	var t0 unix.Timespec
	_ = unix.ClockGettime(unix.CLOCK_MONOTONIC, &t0)
	return func(label string) {
		var t1 unix.Timespec
		_ = unix.ClockGettime(unix.CLOCK_MONOTONIC, &t1)
		fmt.Fprintf(os.Stderr, "%s: CLOCK_MONOTONIC %d.%06d,%d.%06d\n", label, t0.Sec, t0.Nsec/1000, t1.Sec, t1.Nsec/1000)
	}
}

// chainTuning puts the reference tuning plugin, with nothing to tune,
// after the primary in the node's CNI config, and waits for the runtime
// to load it; restore puts the config back as it was and waits again.
func chainTuning(ctx context.Context, n *testenv.KubeNode) (restore func() error, err error) {
	path := filepath.Join(n.ConfDir, "10-ptp.conflist")
	orig, err := os.ReadFile(path) //nolint:gosec // G304: the test node's own config
	if err != nil {
		return nil, err
	}
	var list map[string]any
	if err := json.Unmarshal(orig, &list); err != nil {
		return nil, err
	}
	plugins, _ := list["plugins"].([]any)
	list["plugins"] = append(plugins, map[string]any{"type": "tuning"})
	chained, err := json.Marshal(list)
	if err != nil {
		return nil, err
	}
	bin := filepath.Join(n.BinDir, "tuning")
	if _, err := os.Lstat(bin); err != nil {
		if err := os.Symlink(filepath.Join(testenv.ReferencePluginDir, "tuning"), bin); err != nil {
			return nil, err
		}
	}
	write := func(data []byte, loaded bool) error {
		tmp := path + ".new"
		if err := os.WriteFile(tmp, data, 0o644); err != nil { //nolint:gosec // G306: a CNI config, world-readable as the runtime's are
			return err
		}
		if err := os.Rename(tmp, path); err != nil {
			return err
		}
		deadline := time.Now().Add(30 * time.Second)
		for {
			names, err := n.CNIConfigNames(ctx, `tuning`)
			if err != nil {
				return err
			}
			if names == loaded {
				return nil
			}
			if time.Now().After(deadline) {
				return fmt.Errorf("the runtime did not take up the CNI config with tuning %v in 30 s", loaded)
			}
			time.Sleep(20 * time.Millisecond) // polling the runtime's loaded config, bounded
		}
	}
	if err := write(chained, true); err != nil {
		return nil, err
	}
	return func() error { return write(orig, false) }, nil
}
