package cniserver_test

import (
	"bytes"
	"context"
	"fmt"
	"os/exec"
	"path/filepath"
	"syscall"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	promtest "github.com/prometheus/client_golang/prometheus/testutil"
	dto "github.com/prometheus/client_model/go"

	"github.com/istio-cni-go/istio-cni/internal/cniserver"
	"github.com/istio-cni-go/istio-cni/internal/prepared"
	"github.com/istio-cni-go/istio-cni/internal/testenv"
	"github.com/istio-cni-go/istio-cni/internal/testutil"
)

// BenchmarkRelay is the plugin's own share of a pod start as a runtime
// sees it: the real istio-cni binary, started per command as a runtime
// starts it, against an agent serving in this process (its informer
// holding the pod). VERSION is the process's start alone; DEL adds the
// round trip to the agent; ADD adds the agent's decision and preparation
// and the relay's send into a fresh namespace. Besides wall time it
// reports the relay process's CPU and the agent's (this process's) per
// command, and the relay's minor page faults (every page its process
// touches, which its exit tears down again): the bench's sequential
// own-share figure, without the primary plugin, the API server and
// libcni around it.
func BenchmarkRelay(b *testing.B) {
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	s := benchAgent(ctx, b)
	dir := b.TempDir()
	relay, err := testenv.BuildCommand(dir, "istio-cni")
	if err != nil {
		b.Fatal(err)
	}
	done, err := s.Serve(ctx, filepath.Join(dir, "cni.sock"), time.Second)
	if err != nil {
		b.Fatal(err)
	}
	defer func() { cancel(); <-done }()
	// A second agent that sends the prepared rules itself
	// (CNI_RULES_COMMITTER=agent), on a socket of its own.
	agentDir := b.TempDir()
	sa := benchAgent(ctx, b)
	sa.Committer = cniserver.CommitterAgent
	doneAgent, err := sa.Serve(ctx, filepath.Join(agentDir, "cni.sock"), time.Second)
	if err != nil {
		b.Fatal(err)
	}
	defer func() { cancel(); <-doneAgent }()
	// A third that prepares pods' ADDs ahead (the default): the relay
	// serves them from the records and only tells the agent.
	prepDir := b.TempDir()
	sp := benchAgent(ctx, b)
	sp.PreparedDir, sp.Prepare = filepath.Join(prepDir, prepared.DirName), true
	sp.PreparedAdds = cniserver.NewPreparedMetric()
	sp.Commands, sp.Latency, _ = cniserver.NewMetrics()
	donePrep, err := sp.Serve(ctx, filepath.Join(prepDir, "cni.sock"), time.Second)
	if err != nil {
		b.Fatal(err)
	}
	defer func() { cancel(); <-donePrep }()
	for _, c := range []struct{ name, command, backend, args, runDir string }{
		{"VERSION", "VERSION", "", benchPodArgs, dir}, {"DEL", "DEL", "", benchPodArgs, dir},
		{"ADD/iptables", "ADD", "iptables", benchPodArgs, dir}, {"ADD/nftables", "ADD", "nftables", benchPodArgs, dir},
		// 1,000 CIDRs and ports: what a long list adds to the process.
		{"ADD/iptables/lists", "ADD", "iptables", benchListsPodArgs, dir}, {"ADD/nftables/lists", "ADD", "nftables", benchListsPodArgs, dir},
		// The agent sends what it prepared; the relay only asks.
		{"ADD/iptables/agent-commits", "ADD", "iptables", benchPodArgs, agentDir},
		{"ADD/nftables/agent-commits", "ADD", "nftables", benchPodArgs, agentDir},
		{"ADD/nftables/lists/agent-commits", "ADD", "nftables", benchListsPodArgs, agentDir},
		// The relay serves the ADD from the pod's record.
		{"ADD/iptables/prepared", "ADD", "iptables", benchPodArgs, prepDir},
		{"ADD/nftables/prepared", "ADD", "nftables", benchPodArgs, prepDir},
		{"ADD/iptables/lists/prepared", "ADD", "iptables", benchListsPodArgs, prepDir},
		{"ADD/nftables/lists/prepared", "ADD", "nftables", benchListsPodArgs, prepDir},
		// A DEL under a config that agent keeps: the relay answers it
		// and only tells the agent.
		{"DEL/prepared", "DEL", "iptables", benchPodArgs, prepDir},
	} {
		conf := fmt.Sprintf(`{"cniVersion":"1.0.0","name":"k8s-pod-network","type":"istio-cni","cni_agent_run_dir":%q,"native_nftables":%t,
			"prevResult":{"cniVersion":"1.0.0","interfaces":[{"name":"eth0","sandbox":"/var/run/netns/x"}],"ips":[{"interface":0,"address":"10.1.0.2/24","gateway":"10.1.0.1"}],"routes":[{"dst":"0.0.0.0/0"}]}}`,
			c.runDir, c.backend == "nftables")
		var minflt int64
		run := func(b *testing.B) (relayCPU, agentCPU time.Duration) {
			podNS, f := cniserver.BenchNamespace(b)
			_ = f.Close()
			cmd := exec.Command(relay)
			cmd.Stdin = bytes.NewReader([]byte(conf))
			cmd.Env = []string{"CNI_COMMAND=" + c.command, "CNI_CONTAINERID=c1", "CNI_NETNS=" + podNS.Path(), "CNI_IFNAME=eth0",
				"CNI_ARGS=" + c.args, "CNI_PATH=" + dir}
			var out bytes.Buffer
			cmd.Stdout = &out
			before := selfCPU(b)
			b.StartTimer()
			err := cmd.Run()
			b.StopTimer()
			agentCPU = selfCPU(b) - before
			if err != nil {
				b.Fatalf("%s: %v: %s", c.command, err, out.String())
			}
			ru := cmd.ProcessState.SysUsage().(*syscall.Rusage)
			minflt += ru.Minflt
			if err := testutil.RemoveNS(podNS); err != nil {
				b.Fatal(err)
			}
			return time.Duration(ru.Utime.Nano() + ru.Stime.Nano()), agentCPU
		}
		fromRecords := c.runDir == prepDir && c.command == "ADD"
		if fromRecords {
			// The agent learns the config from two ADDs it serves, then
			// prepares the pods.
			for i := 0; i < 2; i++ {
				run(b)
			}
			waitRecords(b, sp.PreparedDir, conf, "uid-1", "uid-2")
		}
		b.Run(c.name, func(b *testing.B) {
			var relayCPU, agentCPU time.Duration
			served := promtest.ToFloat64(sp.PreparedAdds.WithLabelValues("ok"))
			dels := promtest.ToFloat64(sp.Commands.WithLabelValues("DEL", "ok"))
			b.StopTimer()
			minflt = 0
			for i := 0; i < b.N; i++ {
				r, a := run(b)
				relayCPU += r
				agentCPU += a
			}
			b.ReportMetric(float64(relayCPU.Microseconds())/float64(b.N), "relay-cpu-us/op")
			b.ReportMetric(float64(minflt)/float64(b.N), "minflt/op")
			b.ReportMetric(float64(agentCPU.Microseconds())/float64(b.N), "agent-cpu-us/op")
			if fromRecords {
				// Every ADD was served from the record: the agent heard
				// of each (the relay does not wait for it to).
				deadline := time.Now().Add(10 * time.Second)
				for promtest.ToFloat64(sp.PreparedAdds.WithLabelValues("ok"))-served < float64(b.N) {
					if time.Now().After(deadline) {
						b.Fatalf("%v of %d ADDs served from the pod's record", promtest.ToFloat64(sp.PreparedAdds.WithLabelValues("ok"))-served, b.N)
					}
					time.Sleep(time.Millisecond) // polling the agent's goroutines, untimed
				}
			}
			if c.runDir == prepDir && c.command == "DEL" {
				// Every DEL was answered by the relay, which told the agent;
				// the agent served none itself.
				deadline := time.Now().Add(10 * time.Second)
				for promtest.ToFloat64(sp.Commands.WithLabelValues("DEL", "ok"))-dels < float64(b.N) {
					if time.Now().After(deadline) {
						b.Fatalf("the agent heard of %v of %d DELs", promtest.ToFloat64(sp.Commands.WithLabelValues("DEL", "ok"))-dels, b.N)
					}
					time.Sleep(time.Millisecond) // polling the agent's goroutines, untimed
				}
				var m dto.Metric
				if err := sp.Latency.WithLabelValues("DEL").(prometheus.Histogram).Write(&m); err != nil || m.GetHistogram().GetSampleCount() != 0 {
					b.Fatalf("the agent served %d DELs itself (%v)", m.GetHistogram().GetSampleCount(), err)
				}
			}
		})
	}
}

// waitRecords waits until the agent has prepared the pods' ADDs under
// the config.
func waitRecords(b *testing.B, dir, conf string, uids ...string) {
	c, err := prepared.ParseConfig([]byte(conf))
	if err != nil {
		b.Fatal(err)
	}
	deadline := time.Now().Add(10 * time.Second)
	for _, uid := range uids {
		for {
			rec, err := prepared.Read(dir, uid)
			if err == nil && rec.Find(c.Canonical) != nil {
				break
			}
			if time.Now().After(deadline) {
				b.Fatalf("no record for pod %s under the config: %v", uid, err)
			}
			time.Sleep(time.Millisecond) // polling the agent's goroutine, untimed
		}
	}
}

func selfCPU(b *testing.B) time.Duration {
	var ru syscall.Rusage
	if err := syscall.Getrusage(syscall.RUSAGE_SELF, &ru); err != nil {
		b.Fatal(err)
	}
	return time.Duration(ru.Utime.Nano() + ru.Stime.Nano())
}
