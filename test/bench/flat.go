package main

import (
	"bufio"
	"context"
	"flag"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"time"

	"github.com/containernetworking/cni/libcni"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/istio-cni-go/istio-cni/internal/testenv"
)

// The pod start-up issue's flatness target: a pod's ADD costs the same
// whatever else is on the node, so with 1, 110 (the kubelet's default
// maximum) and 250 pods already running its p50 stays within 10% of the
// 1-pod figure, and likewise between 10 and 1,000 excluded outbound CIDRs
// and ports.
const flatTarget = 1.10

// flatSizes are the pods already running on the node while further pods
// are timed.
var flatSizes = []int{1, 110, 250}

// flatConfig is the pods-on-the-node series' share of the command line.
type flatConfig struct {
	// rounds is how often every size is visited; sizes alternate within a
	// round, so a machine's drift falls on all of them alike.
	rounds int
	// pods is pods timed per size, backend and round.
	pods int
	// listRounds is rounds of the list series timed for the flatness
	// target (10 and 1,000 entries).
	listRounds int
	// only runs this series and the list series through the agent alone.
	only bool
}

func (c *flatConfig) register(fs *flag.FlagSet) {
	fs.IntVar(&c.rounds, "flat-rounds", 8, "rounds of the pods-on-the-node series (each visits 1, 110 and 250 pods)")
	fs.IntVar(&c.pods, "flat-pods", 30, "pods timed per size, backend and round in the pods-on-the-node series")
	fs.IntVar(&c.listRounds, "flat-list-rounds", 150, "rounds of the list series (10 and 1,000 entries) for the flatness target")
	fs.BoolVar(&c.only, "flat-only", false, "run only the pods-on-the-node series and the list series, through the agent")
}

// flatBackends are the chains the series times: iptables (the node's
// default, iptables-nft) and native nftables, and the primary plugin
// alone, whose own growth with the node's pods is not istio-cni's.
func (b *bench) flatBackends() []series {
	return []series{{"primary", b.node.Primary}, {"iptables", b.node.Chained}, {"nftables", b.chainedNFT}}
}

func flatSeries(pods int, backend string) string {
	return fmt.Sprintf("flat/pods=%d/%s", pods, backend)
}

// flatOnly starts the agent and runs the pods-on-the-node series, then the
// list series through the agent: every flatness figure from one run.
func (b *bench) flatOnly(ctx context.Context, cfg config) (*results, error) {
	stop, err := b.startAgent(ctx)
	if err != nil {
		return nil, err
	}
	defer stop()
	res := newResults()
	s, err := b.podsOnNode(ctx, cfg.flat)
	if err != nil {
		return nil, err
	}
	res.add(s)
	if s, err = b.flatLists(ctx, cfg.flat); err != nil {
		return nil, err
	}
	res.add(s)
	return res, b.agentServedAll()
}

// flatListsPath is the list series' path for the flatness figures.
const flatListsPath = "agent/flat"

// flatLists is the list series through the agent for the flatness
// target: only the lengths it compares (the 5,000-entry pods took most of
// a round's time), in as many rounds as the 90% interval needs to be a
// few points wide.
func (b *bench) flatLists(ctx context.Context, cfg flatConfig) (*samples, error) {
	return b.lists(ctx, cfg.listRounds, flatListsPath, listLengths[0], 1000)
}

// podsOnNode times ADD (and DEL) of sidecar pods through the agent with 1,
// 110 and 250 pods already running on the node: each of those was started
// through the chain, keeps its namespace and link, and is a pod object
// bound to the node, so the agent's cache, the node's links and routes and
// host-local's allocations all hold them. Sizes go up in one round and
// down in the next, so growing and shrinking cost only the difference.
// The agent must be running.
func (b *bench) podsOnNode(ctx context.Context, cfg flatConfig) (*samples, error) {
	// Earlier series leave their pod objects behind; the node holds only
	// what this series starts.
	if err := b.deleteBenchPods(ctx); err != nil {
		return nil, err
	}
	bg := &background{b: b}
	// Best effort on the way out: the node namespace goes with the run.
	defer func() { _ = bg.resize(context.WithoutCancel(ctx), 0) }()
	s := newSamples()
	for r := 0; r < cfg.rounds; r++ {
		for i := range flatSizes {
			size := flatSizes[i]
			if r%2 == 1 {
				size = flatSizes[len(flatSizes)-1-i]
			}
			if err := bg.resize(ctx, size); err != nil {
				return nil, err
			}
			// The agent hears of the pods started and stopped after their
			// commands; its informer's and repair controller's work on them
			// is done before the next pods are timed.
			b.agentSettles()
			// On stderr, the timed pods' span, for perf report --time
			// over a perf record -a -k mono of the run.
			span := monoSpan()
			for j := 0; j < cfg.pods; j++ {
				for _, se := range b.flatBackends() {
					if err := b.flatPod(ctx, s, flatSeries(size, se.name), se.list); err != nil {
						return nil, err
					}
				}
				if err := b.processFloor(ctx, s, size); err != nil {
					return nil, err
				}
			}
			span(fmt.Sprintf("flat round %d, %d pods", r, size))
		}
	}
	return s, b.agentServedAll()
}

// processFloor times a relay that only starts and answers (VERSION), as
// libcni runs a plugin, beside the ADDs just timed: the floor any
// plugin's process pays on this node (its exec, the Go runtime's start,
// its exit), which may grow with the node's pods whatever the plugin
// does. (The own process less this floor, pod by pod, was too noisy on
// the development VM to settle anything: 90% intervals 0.5x-1.3x.)
func (b *bench) processFloor(ctx context.Context, s *samples, size int) error {
	start := time.Now()
	if _, err := b.exec.DefaultExec.ExecPlugin(ctx, filepath.Join(b.node.BinDir, "istio-cni"), nil, []string{"CNI_COMMAND=VERSION"}); err != nil {
		return fmt.Errorf("VERSION: %w", err)
	}
	s.record(flatSeries(size, "VERSION"), time.Since(start))
	return nil
}

// agentServedAll fails when the agent refused any relay: that relay ran
// the fallback, and a figure meant to be the agent's would not be.
func (b *bench) agentServedAll() error {
	lines, err := b.agentHost.Metrics("istio_cni_socket_connections_rejected_total{")
	if err != nil {
		return err
	}
	for _, l := range lines {
		if !strings.Contains(l, `socket="cni.sock"`) {
			continue
		}
		if f := strings.Fields(l); len(f) == 2 && f[1] != "0" {
			return fmt.Errorf("the agent refused relays, which then ran the fallback: %s", l)
		}
	}
	return nil
}

// flatPod is pod for this series: its object goes too once its sandbox
// is gone, so that timed pods do not add up on the node.
func (b *bench) flatPod(ctx context.Context, s *samples, name string, list *libcni.NetworkConfigList) error {
	return b.timedPod(ctx, s, name, list, nil, false)
}

// timedPod is flatPod for a pod with annotations, whose namespace holds
// a legacy iptables table when legacy is set.
func (b *bench) timedPod(ctx context.Context, s *samples, name string, list *libcni.NetworkConfigList, ann map[string]string, legacy bool) error {
	pod, err := b.preparePod(ctx, ann, legacy)
	if err != nil {
		return err
	}
	defer pod.Close()
	if err := b.addDel(ctx, s, name, list, pod); err != nil {
		return err
	}
	if list != b.node.Primary {
		if err := b.recordRelay(s, name, pod); err != nil {
			return err
		}
	}
	return b.deletePodObject(ctx, pod.Name)
}

// agentUsage is the CPU the agent and its children have used, zero when
// it runs in no group of its own.
func (b *bench) agentUsage() (time.Duration, error) {
	if b.agentCPU == nil {
		return 0, nil
	}
	return b.agentCPU.usage()
}

// agentSettles waits, at most 10 s, until the agent uses less than 2% of
// a CPU over 200 ms, then until the machine as a whole is quiet.
func (b *bench) agentSettles() {
	deadline := time.Now().Add(10 * time.Second)
	last, err := b.agentUsage()
	for err == nil && b.agentCPU != nil && time.Now().Before(deadline) {
		time.Sleep(200 * time.Millisecond) // sampling an outside process's CPU, untimed
		var now time.Duration
		if now, err = b.agentUsage(); err == nil && now-last < 4*time.Millisecond {
			break
		}
		last = now
	}
	machineSettles(10 * time.Second)
}

// machineSettles waits, at most limit, until every CPU together is busy
// less than 3% of a 500 ms window. Stopping pods leaves work the agent's
// CPU does not show: the kernel tears a deleted network namespace down
// later, in a worker, holding the RTNL lock that the primary plugin's
// link and route changes wait for; the API server and etcd delete the
// pods' objects. A size reached by stopping pods would otherwise be timed
// beside that work, one reached by starting them not.
func machineSettles(limit time.Duration) {
	deadline := time.Now().Add(limit)
	busy, total, err := cpuJiffies()
	share := 0.0
	for err == nil && time.Now().Before(deadline) {
		time.Sleep(500 * time.Millisecond) // sampling the machine's CPU, untimed
		b, t, e := cpuJiffies()
		if e != nil || (t > total && (b-busy)*100 < 3*(t-total)) {
			return
		}
		if t > total {
			share = float64(b-busy) / float64(t-total)
		}
		busy, total, err = b, t, e
	}
	if err == nil {
		fmt.Fprintf(os.Stderr, "the machine did not settle within %s: %.0f%% busy\n", limit, 100*share)
	}
}

// cpuJiffies reads /proc/stat's first line: the jiffies every CPU spent
// busy, and in all (steal left out: the host's, not this machine's).
func cpuJiffies() (busy, total uint64, err error) {
	f, err := os.Open("/proc/stat")
	if err != nil {
		return 0, 0, err
	}
	defer f.Close()
	line, err := bufio.NewReader(f).ReadString('\n')
	if err != nil {
		return 0, 0, err
	}
	fields := strings.Fields(line)
	if len(fields) < 8 || fields[0] != "cpu" {
		return 0, 0, fmt.Errorf("/proc/stat: unexpected first line %q", line)
	}
	// user nice system idle iowait irq softirq
	for i, f := range fields[1:8] {
		v, err := strconv.ParseUint(f, 10, 64)
		if err != nil {
			return 0, 0, fmt.Errorf("/proc/stat: %w", err)
		}
		total += v
		if i != 3 && i != 4 {
			busy += v
		}
	}
	return busy, total, nil
}

// background are the pods running on the node while others are timed.
type background struct {
	b    *bench
	pods []*testenv.Pod
}

// resize starts or stops pods, the latest first, until n run.
func (g *background) resize(ctx context.Context, n int) error {
	for len(g.pods) < n {
		pod, err := g.b.prepare(ctx)
		if err != nil {
			return err
		}
		if _, err := g.b.node.Add(ctx, g.b.node.Chained, pod); err != nil {
			pod.Close()
			return fmt.Errorf("starting pod %d on the node: %w", len(g.pods)+1, err)
		}
		g.pods = append(g.pods, pod)
	}
	for len(g.pods) > n {
		pod := g.pods[len(g.pods)-1]
		g.pods = g.pods[:len(g.pods)-1]
		err := g.b.node.Del(ctx, g.b.node.Chained, pod)
		pod.Close()
		if err != nil {
			return fmt.Errorf("stopping a pod on the node: %w", err)
		}
		if err := g.b.deletePodObject(ctx, pod.Name); err != nil {
			return err
		}
	}
	return nil
}

// deletePodObject removes a pod from the API at once, as the kubelet's
// final delete does once a sandbox is gone.
func (b *bench) deletePodObject(ctx context.Context, name string) error {
	zero := int64(0)
	return b.cluster.Client.CoreV1().Pods("bench").Delete(ctx, name, metav1.DeleteOptions{GracePeriodSeconds: &zero})
}

// deleteBenchPods removes every pod object of the bench namespace and
// waits until the API no longer lists any.
func (b *bench) deleteBenchPods(ctx context.Context) error {
	zero := int64(0)
	pods := b.cluster.Client.CoreV1().Pods("bench")
	if err := pods.DeleteCollection(ctx, metav1.DeleteOptions{GracePeriodSeconds: &zero}, metav1.ListOptions{}); err != nil {
		return err
	}
	deadline := time.Now().Add(30 * time.Second)
	for {
		list, err := pods.List(ctx, metav1.ListOptions{})
		if err != nil {
			return err
		}
		if len(list.Items) == 0 {
			return nil
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("%d bench pods still listed after 30s", len(list.Items))
		}
		time.Sleep(50 * time.Millisecond) // polling the API server, untimed
	}
}

// reportFlat prints the flatness figures: ADD p50/p99 through the agent
// per pods on the node and backend, with the ratio to the 1-pod figure,
// then the list series' 1,000/10 ratios, each with its target.
func reportFlat(r *results) {
	p50 := func(k string) time.Duration { return pct(r.samples[k], .5) }
	p99 := func(k string) time.Duration { return pct(r.samples[k], .99) }
	if len(r.samples[flatSeries(flatSizes[0], "iptables")+" ADD"]) == 0 {
		reportFlatLists(r)
		return
	}
	fmt.Println()
	fmt.Println("ADD through the agent vs pods already running on the node (chained ADD; istio-cni's own process in brackets), p50 / p99,")
	fmt.Println("and the agent's CPU per ADD (its process and children, p50), which the machine's other load does not change:")
	for _, be := range []string{"iptables", "nftables"} {
		first := flatSeries(flatSizes[0], be)
		base, baseOwn, baseCPU := p50(first+" ADD"), p50(first+" istio-cni ADD"), p50(first+" agent CPU ADD")
		for _, n := range flatSizes {
			k := flatSeries(n, be)
			fmt.Printf("  %-8s %3d pods (n=%d): %s / %s (%s / %s)  vs 1 pod: %.2fx (%.2fx), target <= %.2fx; agent CPU %s (%.2fx)\n", be, n, len(r.samples[k+" ADD"]),
				ms(p50(k+" ADD")), ms(p99(k+" ADD")), ms(p50(k+" istio-cni ADD")), ms(p99(k+" istio-cni ADD")),
				ratioOf(p50(k+" ADD"), base), ratioOf(p50(k+" istio-cni ADD"), baseOwn), flatTarget,
				ms(p50(k+" agent CPU ADD")), ratioOf(p50(k+" agent CPU ADD"), baseCPU))
			if len(r.samples[k+" duration"]) > 0 {
				// Where the relay's time goes: its run from main to its
				// answer (the rest of its process is exec, the Go
				// runtime's start and exit), the send into the pod's
				// namespace, and its CPU.
				fmt.Printf("  %-8s %3d pods, the relay: run %s (%.2fx), send %s (%.2fx), CPU %s (%.2fx)\n", "", n,
					ms(p50(k+" duration")), ratioOf(p50(k+" duration"), p50(first+" duration")),
					ms(p50(k+" apply")), ratioOf(p50(k+" apply"), p50(first+" apply")),
					ms(p50(k+" plugin_cpu")), ratioOf(p50(k+" plugin_cpu"), p50(first+" plugin_cpu")))
			}
			if n != flatSizes[0] {
				// The primary's own growth (below) is not istio-cni's.
				fmt.Printf("  %-8s %3d pods vs 1 pod, istio-cni's own process, %s\n", "", n, flatVerdict(r, first+" istio-cni ADD", k+" istio-cni ADD"))
				if len(r.samples[k+" duration"]) > 0 {
					// The relay's own code, without the process's start
					// and exit, which any plugin's process pays.
					fmt.Printf("  %-8s %3d pods vs 1 pod, the relay's run, %s\n", "", n, flatVerdict(r, first+" duration", k+" duration"))
				}
			}
		}
	}
	if len(r.samples[flatSeries(flatSizes[0], "VERSION")]) > 0 {
		base := p50(flatSeries(flatSizes[0], "VERSION"))
		fmt.Printf("  the process floor, istio-cni answering VERSION, p50:")
		for _, n := range flatSizes {
			fmt.Printf(" %d pods %s (%.2fx)", n, ms(p50(flatSeries(n, "VERSION"))), ratioOf(p50(flatSeries(n, "VERSION")), base))
		}
		fmt.Println()
	}
	primary := func(n int) time.Duration { return p50(flatSeries(n, "primary") + " ADD") }
	fmt.Printf("  the primary plugin alone (ptp, host-local), ADD p50:")
	for _, n := range flatSizes {
		fmt.Printf(" %d pods %s (%.2fx)", n, ms(primary(n)), ratioOf(primary(n), primary(flatSizes[0])))
	}
	fmt.Println()
	reportFlatLists(r)
}

// reportFlatLists prints the list series' 1,000/10 ratios through the
// agent, each with its target.
func reportFlatLists(r *results) {
	p50 := func(k string) time.Duration { return pct(r.samples[k], .5) }
	path := flatListsPath
	if len(r.samples["lists/"+path+"/primary ADD"]) == 0 {
		// The list series alone (-lists-only) has no rounds of its own
		// for these figures.
		if path = "agent"; len(r.samples["lists/"+path+"/primary ADD"]) == 0 {
			return
		}
	}
	fmt.Println("ADD through the agent, 1,000 vs 10 excluded outbound CIDRs and ports, p50: istio-cni's own process; the chain's share over the")
	fmt.Println("primary alone; the agent's CPU:")
	for _, be := range listBackends {
		lo, hi := listSeries(path, listLengths[0], be), listSeries(path, 1000, be)
		ratio := func(k string) string {
			return fmt.Sprintf("%.2f -> %.2f ms: %.2fx", msf(p50(lo+k)), msf(p50(hi+k)), ratioOf(p50(hi+k), p50(lo+k)))
		}
		fmt.Printf("  %-16s %s, target <= %.2fx; share %s; agent CPU %s\n", be.name, ratio(" istio-cni ADD"), flatTarget, ratio(" share"), ratio(" agent CPU ADD"))
		fmt.Printf("  %-16s istio-cni's own process, %s\n", "", flatVerdict(r, lo+" istio-cni ADD", hi+" istio-cni ADD"))
		// The ADD the runtime waits for, the primary's part included: the
		// lists' cost as a pod's start feels it.
		fmt.Printf("  %-16s the chained ADD, %s\n", "", flatVerdict(r, lo+" ADD", hi+" ADD"))
		if len(r.samples[lo+" duration"]) > 0 && len(r.samples[hi+" duration"]) > 0 {
			fmt.Printf("  %-16s the relay's run, %s; its send %s\n", "", flatVerdict(r, lo+" duration", hi+" duration"), ratio(" apply"))
		}
		if len(r.samples[lo+" apply"]) > 0 && len(r.samples[hi+" apply"]) > 0 {
			fmt.Printf("  %-16s %s\n", "", sendBudget(p50(lo+" apply"), p50(hi+" apply"), p50(lo+" istio-cni ADD")))
		}
	}
}

// sendBudget sets what the relay's send grew by from 10 to 1,000 entries
// beside what the flatness target allows the whole process (own, its p50
// at 10). The send is one write the kernel answers once it has taken
// every request, nearly all of it the kernel's work: where its growth
// alone is beyond the allowance, no change outside the kernel meets the
// target for that backend.
func sendBudget(lo, hi, own time.Duration) string {
	grew := hi - lo
	allowed := time.Duration(float64(own) * (flatTarget - 1))
	return fmt.Sprintf("the send alone grew by %.2f ms, %.2f times the %.2f ms the %.2fx target allows the whole process",
		msf(grew), float64(grew)/float64(allowed), msf(allowed), flatTarget)
}

// flatVerdict is a flatness ratio with its 90% interval over pairs of
// ADDs timed in the same round, and what that says of the target: the
// p50s of a few dozen ADDs move by several percent between runs, as much
// as the target allows.
func flatVerdict(r *results, lo, hi string) string {
	e := p50Ratio(r.samples[lo], r.samples[hi], .9)
	return fmt.Sprintf("p50 ratio %.2fx, 90%% interval [%.2fx, %.2fx] over %d pairs: %s", e.Median, e.Low, e.High, len(e.Ratios), e.within(flatTarget))
}
