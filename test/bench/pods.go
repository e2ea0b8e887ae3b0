package main

import (
	"context"
	"fmt"
	"io"
	"path/filepath"
	"strings"
	"sync"
	"time"

	"github.com/containernetworking/cni/libcni"
	"github.com/containernetworking/cni/pkg/invoke"

	"github.com/istio-cni-go/istio-cni/internal/podinfo"
	"github.com/istio-cni-go/istio-cni/internal/prepared"
	"github.com/istio-cni-go/istio-cni/internal/testenv"
)

// bench is what the micro series run against; each series keeps its
// measurements in samples of its own and returns them.
type bench struct {
	// dir holds the run's files; bin is the relay built there.
	dir, bin string
	cluster  *testenv.Cluster
	node     *testenv.Node
	// chainedNFT is the node's chain with istio-cni on native nftables.
	chainedNFT *libcni.NetworkConfigList
	exec       *timedExec
	// agent is set while the node agent runs: pods are then created only
	// once it serves them.
	agent *podinfo.AgentClient
	// records is set once the agent prepares every new pod's ADD (it
	// has learnt the chains' configs): pods are then created only once
	// their record is there, as a kubelet starts a sandbox only after
	// the binding the agent's informer hears of.
	records bool
	confDir string
	// agentCPU holds the agent and its children, when cgroup v2 is there.
	agentCPU *cpuGroup
	// agentHost is the running agent; logSeen how much of its log the
	// list series has read.
	agentHost *testenv.AgentHost
	logSeen   int
	mu        sync.Mutex
	seq       int
}

// samples are durations by series name, recorded by concurrent pods.
type samples struct {
	mu sync.Mutex
	m  map[string][]time.Duration
}

func newSamples() *samples { return &samples{m: map[string][]time.Duration{}} }

func (s *samples) record(k string, d time.Duration) {
	s.mu.Lock()
	s.m[k] = append(s.m[k], d)
	s.mu.Unlock()
}

// last is the latest sample of a series.
func (s *samples) last(k string) time.Duration {
	s.mu.Lock()
	defer s.mu.Unlock()
	ds := s.m[k]
	if len(ds) == 0 {
		return 0
	}
	return ds[len(ds)-1]
}

// pod creates a pod object and sandbox, times ADD, then times DEL, and
// keeps istio-cni's own time inside each.
func (b *bench) pod(ctx context.Context, s *samples, series string, list *libcni.NetworkConfigList) error {
	pod, err := b.prepare(ctx)
	if err != nil {
		return err
	}
	defer pod.Close()
	return b.addDel(ctx, s, series, list, pod)
}

// prepare creates the pod object and its sandbox namespace, untimed.
func (b *bench) prepare(ctx context.Context) (*testenv.Pod, error) {
	return b.preparePod(ctx, nil, false)
}

// preparePod is prepare for a pod with annotations, whose namespace
// holds a legacy iptables table when legacy is set.
func (b *bench) preparePod(ctx context.Context, ann map[string]string, legacy bool) (*testenv.Pod, error) {
	pod, err := b.preparePodSpec(ctx, testenv.PodSpec{Sidecar: true, Annotations: ann})
	if err != nil || !legacy {
		return pod, err
	}
	if err := seedLegacy(pod); err != nil {
		pod.Close()
		return nil, err
	}
	return pod, nil
}

// preparePodSpec creates a pod shaped by spec (in the bench's namespace,
// named by the bench) and its sandbox namespace, untimed.
func (b *bench) preparePodSpec(ctx context.Context, spec testenv.PodSpec) (*testenv.Pod, error) {
	b.mu.Lock()
	b.seq++
	n := b.seq
	b.mu.Unlock()
	name := fmt.Sprintf("p%d", n)
	spec.Namespace, spec.Name = "bench", name
	p, err := testenv.CreatePod(ctx, b.cluster.Client, spec)
	if err != nil {
		return nil, err
	}
	if b.agent != nil {
		// Untimed: the agent's informer learns about a new pod within
		// milliseconds; a kubelet only starts the sandbox after that too.
		if err := waitAgentKnows(ctx, b.agent, "bench", name); err != nil {
			return nil, err
		}
		if b.records {
			if err := waitRecord(ctx, filepath.Join(b.node.RunDir, prepared.DirName), string(p.UID)); err != nil {
				return nil, err
			}
		}
	}
	return testenv.NewPod("bench", name, string(p.UID), fmt.Sprintf("b%063d", n))
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

// waitRecord waits until the agent has prepared the pod's ADD.
func waitRecord(ctx context.Context, dir, uid string) error {
	deadline := time.Now().Add(10 * time.Second)
	for {
		_, err := prepared.Read(dir, uid)
		if err == nil {
			return nil
		}
		if time.Now().After(deadline) || ctx.Err() != nil {
			return fmt.Errorf("the agent prepared no ADD for pod %s: %w", uid, err)
		}
		time.Sleep(time.Millisecond) // polling an outside process, untimed
	}
}

// addDel times ADD, then DEL, and istio-cni's own process inside each,
// and counts the agent's CPU in the ADD: its own work per pod, which the
// machine's other load leaves as it is, unlike the time.
func (b *bench) addDel(ctx context.Context, s *samples, series string, list *libcni.NetworkConfigList, pod *testenv.Pod) error {
	before, err := b.agentUsage()
	if err != nil {
		return err
	}
	if err := b.step(ctx, s, series, "ADD", list, pod); err != nil {
		return err
	}
	after, err := b.agentUsage()
	if err != nil {
		return err
	}
	if b.agentCPU != nil {
		s.record(series+" agent CPU ADD", after-before)
	}
	return b.step(ctx, s, series, "DEL", list, pod)
}

// step times one command and istio-cni's own process inside it.
func (b *bench) step(ctx context.Context, s *samples, series, cmd string, list *libcni.NetworkConfigList, pod *testenv.Pod) error {
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
	s.record(series+" "+cmd, time.Since(start))
	if d, ok := b.exec.take(pod.ContainerID, cmd); ok {
		s.record(series+" istio-cni "+cmd, d)
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
	// The plugins' stderr is their log (each ADD's line, at Istio's
	// default level); a failure reaches the bench as the CNI error.
	return &timedExec{DefaultExec: &invoke.DefaultExec{RawExec: &invoke.RawExec{Stderr: io.Discard}},
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
