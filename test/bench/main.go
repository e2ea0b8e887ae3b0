// Command bench measures what istio-cni adds to pod start: ADD and DEL
// through libcni, as a runtime calls them, for the primary plugin alone and
// for the chain with istio-cni, sequentially and with pods in parallel,
// against a real kube-apiserver. It prints p50/p99 and ratios measured in
// the same run.
//
// Each series is one function that measures and returns its samples;
// report and its helpers only format what the series returned.
package main

import (
	"context"
	"encoding/json"
	"flag"
	"fmt"
	"os"
	"os/signal"
	"path/filepath"
	"sync"
	"syscall"
	"time"

	"github.com/containernetworking/cni/libcni"

	"github.com/istio-cni-go/istio-cni/internal/testenv"
)

// config is the command line, parsed once in main and handed to the
// series, so a series' size is visible where it runs.
type config struct {
	// seqPods is pods per sequential series.
	seqPods int
	// parallel is pods started at once in the parallel series.
	parallel int
	// rounds is rounds of the parallel series.
	rounds int
	// listPods is pods per list length and backend in the list series.
	listPods int
	// listsOnly runs the list series alone.
	listsOnly bool
	// ambientPods is pods per ambient series and backend; ambientOnly
	// runs the ambient series alone.
	ambientPods int
	ambientOnly bool
	// memoryCycles is churn cycles of the memory series; memoryOnly runs
	// that series alone.
	memoryCycles int
	memoryOnly   bool
	// cluster, when its pods are above zero, runs the cluster series
	// instead (cluster.go).
	cluster clusterConfig
	// flat is the pods-on-the-node series' (flat.go).
	flat flatConfig
}

// parseFlags reads the command line into a config; fs exits on -h or a
// bad flag as flag.CommandLine does.
func parseFlags(fs *flag.FlagSet, args []string) (config, error) {
	var c config
	fs.IntVar(&c.seqPods, "pods", 40, "pods per sequential series")
	fs.IntVar(&c.parallel, "parallel", 20, "pods started at once in the parallel series")
	fs.IntVar(&c.rounds, "rounds", 3, "rounds of the parallel series")
	fs.IntVar(&c.listPods, "list-pods", 15, "pods per list length and backend in the list series")
	fs.BoolVar(&c.listsOnly, "lists-only", false, "run only the list series (and the primary plugin alone, alternated with it)")
	fs.IntVar(&c.ambientPods, "ambient-pods", 30, "pods per ambient series and backend (0 skips ambient mode)")
	fs.IntVar(&c.memoryCycles, "memory-cycles", 3, "cycles of 200 of the memory series' node pods replaced, each followed by a reading of the agent's RSS")
	fs.BoolVar(&c.memoryOnly, "memory-only", false, "run only the memory series (5,000 pods in the cluster, 250 on the agent's node, then the churn cycles)")
	fs.BoolVar(&c.ambientOnly, "ambient-only", false, "run only the ambient series (primary alone, a sidecar pod and an enrolled pod alternated, and running pods enrolled)")
	c.cluster.register(fs)
	c.flat.register(fs)
	err := fs.Parse(args)
	return c, err
}

func main() {
	cfg, err := parseFlags(flag.CommandLine, os.Args[1:])
	if err != nil {
		fmt.Fprintln(os.Stderr, "bench:", err)
		os.Exit(2)
	}
	if cfg.cluster.pool != "" {
		// Reading logs needs no node.
		p, err := readPooled(parseArms(cfg.cluster.pool), "without")
		if err == nil {
			p.report(os.Stdout)
			if cfg.cluster.svg != "" {
				err = p.writeSVG(cfg.cluster.svg)
			}
		}
		if err != nil {
			fmt.Fprintln(os.Stderr, "bench:", err)
			os.Exit(1)
		}
		return
	}
	testenv.EnterNodeNamespace()
	// Interrupted, the series stop at their next API call or pod and tear
	// down what they started (a cluster left running would load the
	// machine for whatever runs next).
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	err = run(ctx, cfg)
	stop()
	testenv.RemoveSandboxCgroups()
	if err != nil {
		fmt.Fprintln(os.Stderr, "bench:", err)
		os.Exit(1)
	}
}

// run picks what cfg asks for, measures it, then reports it.
func run(ctx context.Context, cfg config) error {
	if cfg.cluster.pods > 0 {
		res, err := clusterStartup(ctx, cfg.cluster)
		if err != nil {
			return err
		}
		reportCluster(cfg.cluster, res)
		if cfg.cluster.svg != "" {
			return writeClusterSVG(cfg.cluster.svg, cfg.cluster, res)
		}
		return nil
	}
	dir, err := os.MkdirTemp("", "istio-cni-bench-")
	if err != nil {
		return err
	}
	defer os.RemoveAll(dir)
	b, stop, err := newBench(ctx, dir)
	if err != nil {
		return err
	}
	defer stop()
	if cfg.flat.only {
		res, err := b.flatOnly(ctx, cfg)
		if err != nil {
			return err
		}
		reportFlat(res)
		return nil
	}
	if cfg.memoryOnly {
		m, err := b.memory(ctx, cfg.memoryCycles)
		if err != nil {
			return err
		}
		reportMemory(m)
		return nil
	}
	if cfg.ambientOnly {
		s, err := b.ambientSeries(ctx, cfg.ambientPods)
		if err != nil {
			return err
		}
		res := newResults()
		res.add(s)
		reportAmbient(res)
		return nil
	}
	if cfg.listsOnly {
		res, err := b.listsOnly(ctx, cfg)
		if err != nil {
			return err
		}
		reportLists(res)
		fmt.Println()
		reportFlatLists(res)
		return nil
	}
	res, err := b.measure(ctx, cfg)
	if err != nil {
		return err
	}
	report(cfg, res)
	return nil
}

// newBench starts what every micro series runs against: the plugin built
// from this tree, a kube-apiserver, a simulated node, and a warmed-up
// chain. stop tears the API server down.
func newBench(ctx context.Context, dir string) (b *bench, stop func(), err error) {
	bin, err := testenv.BuildPlugin(dir)
	if err != nil {
		return nil, nil, err
	}
	cluster, err := testenv.StartCluster(filepath.Join(dir, "cluster"))
	if err != nil {
		return nil, nil, err
	}
	defer func() {
		if err != nil {
			cluster.Stop()
		}
	}()
	if err := testenv.EnsureNamespace(ctx, cluster.Client, "bench"); err != nil {
		return nil, nil, err
	}
	// The plugin's log level at Istio's default: an operator's pods log
	// their ADD, and the list series reads the relay's figures from it.
	node, err := testenv.NewNode(filepath.Join(dir, "node"), bin, map[string]any{"plugin_log_level": "info"})
	if err != nil {
		return nil, nil, err
	}
	if err := cluster.PluginKubeconfig(ctx, filepath.Join(node.RunDir, "istio-cni-kubeconfig")); err != nil {
		return nil, nil, err
	}
	chainedNFT, err := withNativeNftables(node.Chained)
	if err != nil {
		return nil, nil, err
	}
	b = &bench{dir: dir, bin: bin, cluster: cluster, node: node, chainedNFT: chainedNFT, exec: newTimedExec()}
	// Time istio-cni's own process inside each chained command: that is
	// its share of the pod's start, measured where a runtime runs it.
	node.CNI = libcni.NewCNIConfigWithCacheDir([]string{node.BinDir}, filepath.Join(node.Dir, "cache"), b.exec)

	// Warm up: page cache, API server caches, first TLS session. Its
	// samples are dropped.
	warm := newSamples()
	for i := 0; i < 3; i++ {
		if err := b.pod(ctx, warm, "warmup", node.Chained); err != nil {
			return nil, nil, err
		}
	}
	return b, cluster.Stop, nil
}

// withNativeNftables is the chain with istio-cni set to program nftables
// itself.
func withNativeNftables(chained *libcni.NetworkConfigList) (*libcni.NetworkConfigList, error) {
	var conf map[string]any
	if err := json.Unmarshal(chained.Bytes, &conf); err != nil {
		return nil, err
	}
	plugins := conf["plugins"].([]any)
	plugins[len(plugins)-1].(map[string]any)["native_nftables"] = true
	b, err := json.Marshal(conf)
	if err != nil {
		return nil, err
	}
	return libcni.ConfListFromBytes(b)
}

// series is one named way of running a pod's network: a config list.
type series struct {
	name string
	list *libcni.NetworkConfigList
}

// measure runs every micro series in the order that keeps their
// conditions comparable: without the agent first, then with it, the
// parallel bursts, then the agent's own jobs and the floors.
func (b *bench) measure(ctx context.Context, cfg config) (*results, error) {
	res := newResults()
	// No agent: the relay runs the fallback plugin, which reads the pod
	// from the API server and programs the rules itself.
	s, err := b.sequential(ctx, cfg.seqPods, series{"seq/primary", b.node.Primary},
		series{"seq/chain (no agent)", b.node.Chained}, series{"seq/chain (no agent)/nftables", b.chainedNFT})
	if err != nil {
		return nil, err
	}
	res.add(s)
	if s, err = b.lists(ctx, cfg.listPods, "no agent"); err != nil {
		return nil, err
	}
	res.add(s)
	// The same with the node agent running: the relay hands each command
	// to it, and pods come from its cache.
	stopSidecarAgent, err := b.startAgent(ctx)
	if err != nil {
		return nil, err
	}
	var stopOnce sync.Once
	stopAgent := func() { stopOnce.Do(stopSidecarAgent) }
	defer stopAgent()
	res.agentCPUCounted = b.agentCPU != nil
	if s, err = b.sequential(ctx, cfg.seqPods, series{"seq/primary (agent up)", b.node.Primary},
		series{"seq/chain+agent", b.node.Chained}, series{"seq/chain+agent/nftables", b.chainedNFT}); err != nil {
		return nil, err
	}
	res.add(s)
	if s, err = b.lists(ctx, cfg.listPods, "agent"); err != nil {
		return nil, err
	}
	res.add(s)
	if s, err = b.flatLists(ctx, cfg.flat); err != nil {
		return nil, err
	}
	res.add(s)
	if s, err = b.podsOnNode(ctx, cfg.flat); err != nil {
		return nil, err
	}
	res.add(s)
	par, err := b.concurrent(ctx, cfg.parallel, cfg.rounds, series{"par/primary", b.node.Primary},
		series{"par/chain+agent", b.node.Chained}, series{"par/chain+agent/nftables", b.chainedNFT})
	if err != nil {
		return nil, err
	}
	res.add(par.samples)
	res.cpuPerPod = par.cpuPerPod
	if s, err = b.reinsertions(50); err != nil {
		return nil, err
	}
	res.add(s)
	if s, err = b.repairs(ctx, 20); err != nil {
		return nil, err
	}
	res.add(s)
	if s, err = ruleFloors(40); err != nil {
		return nil, err
	}
	res.add(s)
	// Still with the agent up, as the pods' ADDs above ran.
	if res.binaries, err = binaryCosts(b.bin, 50); err != nil {
		return nil, err
	}
	if res.memory, err = b.memory(ctx, cfg.memoryCycles); err != nil {
		return nil, err
	}
	if cfg.ambientPods > 0 {
		// Ambient mode needs agents of its own: the sidecar one goes.
		stopAgent()
		if s, err = b.ambientSeries(ctx, cfg.ambientPods); err != nil {
			return nil, err
		}
		res.add(s)
	}
	return res, nil
}

// listsOnly runs the list series alone: without and with the agent.
func (b *bench) listsOnly(ctx context.Context, cfg config) (*results, error) {
	res := newResults()
	s, err := b.lists(ctx, cfg.listPods, "no agent")
	if err != nil {
		return nil, err
	}
	res.add(s)
	stop, err := b.startAgent(ctx)
	if err != nil {
		return nil, err
	}
	defer stop()
	if s, err = b.lists(ctx, cfg.listPods, "agent"); err != nil {
		return nil, err
	}
	res.add(s)
	return res, nil
}

// results are what the micro series measured, for report.
type results struct {
	// samples are durations by series name.
	samples map[string][]time.Duration
	// cpuPerPod is the parallel series' CPU per pod, by series and
	// command.
	cpuPerPod map[string]cpuSplit
	// agentCPUCounted says whether the agent ran in a cgroup of its own,
	// so that its CPU is in cpuPerPod.
	agentCPUCounted bool
	// binaries are the relay's and the fallback's size and VERSION
	// start-up, the relay first.
	binaries []binaryCost
	// memory is the agent's resident memory under a node's pods.
	memory *memoryResult
}

func newResults() *results {
	return &results{samples: map[string][]time.Duration{}, cpuPerPod: map[string]cpuSplit{}}
}

// add takes a series' samples into the results.
func (r *results) add(s *samples) {
	for k, ds := range s.m {
		r.samples[k] = append(r.samples[k], ds...)
	}
}
