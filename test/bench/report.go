package main

import (
	"cmp"
	"fmt"
	"maps"
	"slices"
	"sort"
	"strings"
	"time"
)

// The functions here only format: every figure they print was measured by
// a series and handed over in results (or clusterResult).

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

func msf(d time.Duration) float64 { return float64(d) / float64(time.Millisecond) }

func ratioOf(a, b time.Duration) float64 {
	if b <= 0 {
		return 0
	}
	return float64(a) / float64(b)
}

func mean(ds []time.Duration) time.Duration {
	var sum time.Duration
	for _, d := range ds {
		sum += d
	}
	return sum / time.Duration(max(len(ds), 1))
}

// report prints every series of the micro run: the table of all samples,
// then the figures the targets are about.
func report(cfg config, r *results) {
	fmt.Printf("%-26s %5s %10s %10s\n", "series", "n", "p50", "p99")
	keys := make([]string, 0, len(r.samples))
	for k := range r.samples {
		keys = append(keys, k)
	}
	sort.Strings(keys)
	for _, k := range keys {
		fmt.Printf("%-26s %5d %s %s\n", k, len(r.samples[k]), ms(pct(r.samples[k], .5)), ms(pct(r.samples[k], .99)))
	}
	p50 := func(k string) time.Duration { return pct(r.samples[k], .5) }
	ratio := func(a, c string) float64 { return float64(p50(a)) / float64(p50(c)) }
	fmt.Println()
	// istio-cni's own share: its process inside the chained ADD, from the
	// runtime starting it to its answer.
	own := func(series string) string { return ms(p50(series + " istio-cni ADD")) }
	primary := p50("seq/primary (agent up) ADD")
	fmt.Printf("istio-cni own share of the chained ADD, sequential p50 (its process, start to answer), against the primary's ADD %s:\n", ms(primary))
	fmt.Printf("  with the agent, iptables:   %s = %.2fx (target <= 0.35x, #15)\n", own("seq/chain+agent"), ratioOf(p50("seq/chain+agent istio-cni ADD"), primary))
	fmt.Printf("  with the agent, nftables:   %s = %.2fx (target <= 0.35x, #15)\n", own("seq/chain+agent/nftables"), ratioOf(p50("seq/chain+agent/nftables istio-cni ADD"), primary))
	fmt.Printf("  no agent (fallback), iptables: %s, nftables: %s\n", own("seq/chain (no agent)"), own("seq/chain (no agent)/nftables"))
	fmt.Printf("  DEL with the agent (start-up floor): %s\n", ms(p50("seq/chain+agent istio-cni DEL")))
	fmt.Printf("  the rules alone, Istio's default set into a fresh netns from a warm process: sent prepared (the relay) nftables %s, iptables %s;\n",
		ms(p50("floor/default rules sent prepared into a fresh netns, nftables")), ms(p50("floor/default rules sent prepared into a fresh netns, iptables")))
	fmt.Printf("    applied in place (the agent when it cannot prepare, the fallback) nftables %s, iptables %s\n",
		ms(p50("floor/default rules applied into a fresh netns, nftables")), ms(p50("floor/default rules applied into a fresh netns, iptables")))
	fmt.Printf("chain - primary ADD p50, sequential: agent %s, agent+nftables %s, no agent %s\n",
		ms(p50("seq/chain+agent ADD")-p50("seq/primary (agent up) ADD")), ms(p50("seq/chain+agent/nftables ADD")-p50("seq/primary (agent up) ADD")),
		ms(p50("seq/chain (no agent) ADD")-p50("seq/primary ADD")))
	fmt.Printf("chain+agent / primary ADD p50, %d parallel: %.2fx (target <= 1.5x)\n", cfg.parallel, ratio("par/chain+agent ADD", "par/primary ADD"))
	fmt.Printf("nftables chain+agent / primary ADD p50, %d parallel: %.2fx (target <= 1.4x)\n", cfg.parallel, ratio("par/chain+agent/nftables ADD", "par/primary ADD"))
	reportCPU(cfg, r)
	if rs := r.samples["repair"]; len(rs) > 0 {
		fmt.Printf("broken pod to repaired p50/p99:             %s / %s (target < 1 s)\n", ms(pct(rs, .5)), ms(pct(rs, .99)))
	}
	if rs := r.samples["reinsert"]; len(rs) > 0 {
		fmt.Printf("config re-insertion after a rewrite p50/p99: %s / %s (target <= 100 ms)\n", ms(pct(rs, .5)), ms(pct(rs, .99)))
	}
	if len(r.binaries) == 2 {
		relay, fallback := r.binaries[0], r.binaries[1]
		fmt.Printf("plugin binary size: %s %.1f MB, %s %.1f MB (target <= 20 MB)\n", relay.name, float64(relay.size)/1e6, fallback.name, float64(fallback.size)/1e6)
	}
	for _, c := range r.binaries {
		fmt.Printf("VERSION start-up p50 / p99, %-18s %s / %s (CPU p50 %s)\n", c.name+":", ms(pct(c.wall, .5)), ms(pct(c.wall, .99)), ms(pct(c.cpu, .5)))
	}
	reportCPUFloor(cfg, r)
	reportMemory(r.memory)
	reportLists(r)
	reportFlat(r)
	reportAmbient(r)
}

// reportCPU prints CPU per pod for the parallel ADDs: what a burst of pod
// starts costs the node, and who spends it.
func reportCPU(cfg config, r *results) {
	base := r.cpuPerPod["par/primary ADD"]
	fmt.Printf("CPU per pod, %d parallel ADDs (runtime/libcni + plugin processes + agent = total):\n", cfg.parallel)
	for _, s := range []string{"par/primary", "par/chain+agent", "par/chain+agent/nftables"} {
		c := r.cpuPerPod[s+" ADD"]
		agent := ms(c.agent)
		if !r.agentCPUCounted {
			agent = "    n/a   "
		}
		fmt.Printf("  %-26s %s + %s + %s = %s (%.2fx)\n", s, ms(c.runtime), ms(c.plugins), agent, ms(c.total()),
			float64(c.total())/float64(max(base.total(), 1)))
	}
	if !r.agentCPUCounted {
		return
	}
	// The agent works for a pod before its ADD too: its informer decodes
	// the pod, and it prepares the pod's ADD (internal/prepared).
	fmt.Println("  the agent's CPU per pod before the ADD, while the pods were created (informer, prepared ADD):")
	for _, s := range []string{"par/primary", "par/chain+agent", "par/chain+agent/nftables"} {
		fmt.Printf("    %-24s %s\n", s, ms(r.cpuPerPod[s+" created"].agent))
	}
}

// reportCPUFloor prints the least CPU a chained ADD can add to the
// primary's in a burst, from parts measured in this run: the runtime
// running one more plugin (libcni, not ours), a relay process that only
// starts (VERSION), and Istio's default rules sent as prepared requests
// from a warm process (the kernel's work). A ratio target below this
// cannot be met by any code in the agent or the relay.
func reportCPUFloor(cfg config, r *results) {
	primary := r.cpuPerPod["par/primary ADD"]
	if primary.total() == 0 {
		return
	}
	var relay time.Duration
	if len(r.binaries) > 0 {
		relay = mean(r.binaries[0].cpu)
	}
	fmt.Printf("CPU floor of a chained ADD over the primary's, %d parallel (runtime's extra plugin + relay start + rules sent):\n", cfg.parallel)
	for _, s := range []struct{ series, rules string }{
		{"par/chain+agent", "iptables"}, {"par/chain+agent/nftables", "nftables"}} {
		runtime := r.cpuPerPod[s.series+" ADD"].runtime - primary.runtime
		rules := mean(r.samples["cpu/default rules sent prepared into a fresh netns, "+s.rules])
		floor := primary.total() + runtime + relay + rules
		fmt.Printf("  %-26s %s + %s + %s = %s over %s: at least %.2fx\n", s.series, ms(runtime), ms(relay), ms(rules),
			ms(floor-primary.total()), ms(primary.total()), float64(floor)/float64(primary.total()))
	}
}

// reportLists prints the plugin's share of ADD per list length and
// backend: the p50 of each chained ADD minus the primary's alone in the
// same round, and istio-cni's own process inside it, with the ratios the
// cost target is about.
func reportLists(r *results) {
	p50 := func(k string) time.Duration { return pct(r.samples[k], .5) }
	if len(r.samples["lists/no agent/primary ADD"]) == 0 {
		return
	}
	fmt.Println()
	fmt.Println("list-valued settings: excludeOutboundIPRanges with N IPv4 CIDRs and excludeOutboundPorts with N ports, one pod each")
	fmt.Println("plugin share of ADD, p50 of (chain - primary alone in the same round), and istio-cni's own process p50 in brackets, ms;")
	fmt.Println("through the agent, its CPU per ADD, and as the agent logs them, the relay's send and CPU and the agent's lookup and planning:")
	fmt.Printf("  %-26s", "")
	for _, n := range listLengths {
		fmt.Printf(" %20s", fmt.Sprintf("N=%d", n))
	}
	fmt.Printf("  %9s %9s\n", "1000/10", "5000/10")
	for _, path := range []string{"no agent", "agent"} {
		primary := p50("lists/" + path + "/primary ADD")
		if primary == 0 {
			continue
		}
		for _, be := range listBackends {
			fmt.Printf("  %-26s", path+", "+be.name)
			share := map[int]time.Duration{}
			for _, n := range listLengths {
				s := listSeries(path, n, be)
				share[n] = p50(s + " share")
				fmt.Printf(" %20s", fmt.Sprintf("%.2f (%.2f)", msf(share[n]), msf(p50(s+" istio-cni ADD"))))
			}
			fmt.Printf("  %8.2fx %8.2fx\n", ratioOf(share[1000], share[10]), ratioOf(share[5000], share[10]))
			if path != "agent" {
				continue
			}
			fmt.Printf("  %-26s", "  agent CPU per ADD")
			for _, n := range listLengths {
				fmt.Printf(" %20.2f", msf(p50(listSeries(path, n, be)+" agent CPU ADD")))
			}
			fmt.Println()
			if len(r.samples[listSeries(path, 10, be)+" apply"]) == 0 {
				continue
			}
			fmt.Printf("  %-26s", "  relay send/CPU, agent")
			for _, n := range listLengths {
				k := listSeries(path, n, be)
				fmt.Printf(" %20s", fmt.Sprintf("%.2f/%.2f, %.2f", msf(p50(k+" apply")), msf(p50(k+" plugin_cpu")), msf(p50(k+" lookup")+p50(k+" plan"))))
			}
			fmt.Println()
		}
		fmt.Printf("  %-26s primary alone %.2f ms\n", "", msf(primary))
	}
}

// reportCluster prints the cluster series: per node size and arm, the
// burst's creation to Ready (pooled p50 and p99, the median over rounds
// of each burst's last pod, each round's p50), the node's CPU per started
// pod by cgroup, and each arm against the node without the plugin.
func reportCluster(cfg clusterConfig, r *clusterResult) {
	fmt.Printf("%d sidecar pods created at once on one kubelet+containerd node with a node's cgroups (QoS tree, runtime in its own cgroup),\n", cfg.pods)
	rounds, of := r.roundsDone(cfg.rounds), ""
	if rounds < cfg.rounds {
		of = fmt.Sprintf(" (of %d; the rest past -cluster-rounds-for %s)", cfg.rounds, cfg.roundsFor)
	}
	fmt.Printf("%d busy pods spinning a thread each (%s requested each), agent CPU request %s; creation to Ready, %d rounds per arm%s,\n",
		r.busyPods, cfg.busyCPU, cmp.Or(cfg.agentCPU, "100m (chart default)"), rounds, of)
	balance := "every arm follows every other equally often"
	if design := designRounds(len(r.arms)); len(r.arms) > 1 && rounds%design != 0 {
		balance = fmt.Sprintf("balanced only over multiples of %d rounds", design)
	}
	fmt.Printf("arms in a Williams design's order by round (%s):\n", balance)
	for _, a := range r.arms {
		fmt.Printf("  %-8s %s\n", a.name, a.about)
	}
	for _, size := range r.sizes {
		fmt.Printf("\n%d pods on the node with the burst (%d idle, %d busy, the agent, the burst):\n", size, r.idle[size], r.busyPods)
		fmt.Printf("  %-8s %10s %10s %10s   %-30s %s\n", "arm", "p50", "p99", "last", "round p50s, s", "CPU per pod: node = runtime + agent + pods")
		base := r.bursts[size]["without"]
		for _, a := range r.arms {
			bs := r.bursts[size][a.name]
			all, lasts, rounds := burstStats(bs)
			var cpu nodeCPU
			n := 0
			for i := range bs {
				b := &bs[i]
				cpu = cpu.plus(b.cpu)
				n += b.pods()
			}
			n = max(n, 1)
			per := func(d time.Duration) float64 { return msf(d) / float64(n) }
			fmt.Printf("  %-8s %s %s %s   %-30s %.1f = %.1f + %.1f + %.1f ms\n", a.name, ms(pct(all, .5)), ms(pct(all, .99)), ms(pct(lasts, .5)), rounds,
				per(cpu.node), per(cpu.runtime), per(cpu.agent), per(cpu.pods))
			// Per round: the start-up CPU per pod beside the round's p50,
			// to tell a round that did more work from one that got less
			// CPU for it.
			var cpuByRound []string
			for i := range bs {
				cpuByRound = append(cpuByRound, fmt.Sprintf("%.0f", msf(burstStartCPU(bs[i]))))
			}
			fmt.Printf("  %-8s start-up CPU per pod (runtime + agent) by round, ms: %s\n", "", strings.Join(cpuByRound, " "))
			for _, m := range runtimeMeasures {
				all, lasts, rounds := burstStats(as(bs, m.pick))
				fmt.Printf("  %-8s %s %s %s   %-30s %s\n", "", ms(pct(all, .5)), ms(pct(all, .99)), ms(pct(lasts, .5)), rounds, m.about)
			}
			if w := eventsByRound(bs); w != "" {
				fmt.Printf("  %-8s %s\n", "", w)
			}
			if a.values != nil {
				// Per round: the agent's time per ADD, p50 / slowest, to
				// set beside the rounds' start-up.
				byRound := func(get func(*burstFigures) []time.Duration) string {
					var per []string
					for i := range bs {
						t := get(&bs[i])
						if len(t) == 0 {
							per = append(per, "-")
							continue
						}
						per = append(per, fmt.Sprintf("%.1f/%.0f", msf(pct(t, .5)), msf(t[len(t)-1])))
					}
					return strings.Join(per, " ")
				}
				fmt.Printf("  %-8s the agent's time per ADD by round, p50/slowest, ms: %s\n", "",
					byRound(func(b *burstFigures) []time.Duration { return b.agentTime }))
				fmt.Printf("  %-8s of it lookup and planning, before the relay takes over: %s\n", "",
					byRound(func(b *burstFigures) []time.Duration { return b.agentOwn }))
				fmt.Printf("  %-8s the fallback's time per ADD by round, p50/slowest, ms: %s\n", "",
					byRound(func(b *burstFigures) []time.Duration { return b.fallbackTime }))
				fmt.Printf("  %-8s of it the pod's lookup (the API server): %s\n", "",
					byRound(func(b *burstFigures) []time.Duration { return b.fallbackLookup }))
				fmt.Printf("  %-8s the fallback's process CPU per ADD (iptables-restore included) by round: %s\n", "",
					byRound(func(b *burstFigures) []time.Duration { return b.fallbackCPU }))
			}
			if a.mixed {
				all, lasts, rounds := burstStats(plainHalves(bs))
				fmt.Printf("  %-8s %s %s %s   %-30s (the same bursts' plain-handler half; the row above is the plugin's half, the CPU both)\n", "  plain",
					ms(pct(all, .5)), ms(pct(all, .99)), ms(pct(lasts, .5)), rounds)
				for _, m := range runtimeMeasures {
					all, lasts, rounds := burstStats(as(plainHalves(bs), m.pick))
					fmt.Printf("  %-8s %s %s %s   %-30s %s, the plain half\n", "", ms(pct(all, .5)), ms(pct(all, .99)), ms(pct(lasts, .5)), rounds, m.about)
				}
			}
			fmt.Printf("  %-8s runtime per pod: containerd %.1f, processes it waited for (CNI plugins, shim starts) %.1f, kubelet %.1f, shims and runc %.1f ms\n", "",
				per(cpu.containerd), per(cpu.cni), per(cpu.kubelet), per(cpu.shims()))
			fmt.Printf("  %-8s control plane per pod (etcd, the API server, the controller manager; outside the node's CPU above): %.1f ms\n", "", per(cpu.control))
			// By round too: which part of the runtime a costly round spent.
			var split []string
			for i := range bs {
				b := &bs[i]
				n := float64(max(b.pods(), 1))
				c := b.cpu
				split = append(split, fmt.Sprintf("%.0f/%.0f/%.0f/%.0f", msf(c.containerd)/n, msf(c.cni)/n, msf(c.kubelet)/n,
					msf(c.shims())/n))
			}
			fmt.Printf("  %-8s the same by round, ms: %s\n", "", strings.Join(split, " "))
			var pluginCPU, fallbackCPU []time.Duration
			fallback, left, prepared := 0, 0, 0
			for i := range bs {
				b := &bs[i]
				pluginCPU = append(pluginCPU, b.pluginCPU...)
				fallbackCPU = append(fallbackCPU, b.fallbackCPU...)
				fallback += b.fallback
				left += b.left
				prepared += b.prepared
			}
			if a.values != nil {
				fmt.Printf("  %-8s istio-cni process CPU per ADD (as it reports it to the agent): p50 %s, p99 %s, %d ADDs reported; %d ADDs served by the fallback, %d of them for relays that left an agent behind\n", "",
					ms(pct(pluginCPU, .5)), ms(pct(pluginCPU, .99)), len(pluginCPU), fallback, left)
				fmt.Printf("  %-8s ADDs the relay served from the pod's prepared record, without the agent: %d of %d\n", "", prepared, len(pluginCPU))
				if len(fallbackCPU) > 0 {
					fmt.Printf("  %-8s istio-cni-fallback process CPU per ADD (iptables-restore included): p50 %s, p99 %s, %d ADDs\n", "",
						ms(pct(fallbackCPU, .5)), ms(pct(fallbackCPU, .99)), len(fallbackCPU))
				}
			}
		}
		for _, a := range r.arms {
			against, base := "without", base
			if a.mixed {
				// Its own bursts' plain half, started side by side.
				against, base = "its plain half", plainHalves(r.bursts[size][a.name])
			}
			if (a.values == nil && !a.mixed && !a.again && !a.tuning) || len(base) == 0 {
				continue
			}
			baseAll, baseLasts, _ := burstStats(base)
			all, lasts, _ := burstStats(r.bursts[size][a.name])
			fmt.Printf("  %-8s against %s, all rounds pooled: p50 %+.1f%%, last pod %+.1f%%\n", a.name, against,
				100*(ratioOf(pct(all, .5), pct(baseAll, .5))-1), 100*(ratioOf(pct(lasts, .5), pct(baseLasts, .5))-1))
			// Each round ran both arms back to back: its ratio is free of
			// the machine's drift between rounds.
			for _, st := range burstStatistics {
				e := pairRounds(base, r.bursts[size][a.name], st.f, .9)
				fmt.Printf("  %-8s %-8s round by round: median %+.1f%%, 90%% interval [%+.1f%%, %+.1f%%]; target within %g%%: %s (rounds %s)\n",
					a.name, st.name, 100*(e.Median-1), 100*(e.Low-1), 100*(e.High-1), burstTargetPercent, e.within(burstTarget), percents(e.Ratios))
			}
			// The same starts as the runtime stamped them, free of the
			// relist's one-second steps.
			for _, m := range runtimeMeasures {
				mb, ma := as(base, m.pick), as(r.bursts[size][a.name], m.pick)
				baseAll, baseLasts, _ := burstStats(mb)
				all, lasts, _ := burstStats(ma)
				fmt.Printf("  %-8s %s, all rounds pooled: p50 %+.1f%%, last pod %+.1f%%\n", a.name, m.short,
					100*(ratioOf(pct(all, .5), pct(baseAll, .5))-1), 100*(ratioOf(pct(lasts, .5), pct(baseLasts, .5))-1))
				for _, st := range burstStatistics {
					e := pairRounds(mb, ma, st.f, .9)
					fmt.Printf("  %-8s %s, %s, round by round: median %+.1f%%, 90%% interval [%+.1f%%, %+.1f%%]; within %g%%: %s (rounds %s)\n",
						a.name, m.short, st.name, 100*(e.Median-1), 100*(e.Low-1), 100*(e.High-1), burstTargetPercent, e.within(burstTarget), percents(e.Ratios))
				}
			}
			if !a.mixed {
				// The work a pod's start costs the node, which a round's
				// wall time divides by the CPU that round got: steadier
				// from round to round than the time is on a shared machine.
				e := pairRounds(base, r.bursts[size][a.name], burstStartCPU, .9)
				fmt.Printf("  %-8s start-up CPU per pod (runtime + agent) round by round: median %+.1f%%, 90%% interval [%+.1f%%, %+.1f%%]; within %g%%: %s (rounds %s)\n",
					a.name, 100*(e.Median-1), 100*(e.Low-1), 100*(e.High-1), burstTargetPercent, e.within(burstTarget), percents(e.Ratios))
				e = pairRounds(base, r.bursts[size][a.name], burstControlCPU, .9)
				fmt.Printf("  %-8s control plane CPU per pod round by round: median %+.1f%%, 90%% interval [%+.1f%%, %+.1f%%] (rounds %s)\n",
					a.name, 100*(e.Median-1), 100*(e.Low-1), 100*(e.High-1), percents(e.Ratios))
			}
		}
	}
}

// plainHalves are mixed bursts' plain-handler halves, as bursts of their
// own.
func plainHalves(bs []burstFigures) []burstFigures {
	out := make([]burstFigures, len(bs))
	for i := range bs {
		out[i] = burstFigures{startup: bs[i].without, started: bs[i].startedWithout, setup: bs[i].setupWithout}
	}
	return out
}

// burstStatistics are what the arms are compared on, round by round.
var burstStatistics = []struct {
	name string
	f    func(burstFigures) time.Duration
}{{"p50", burstP50}, {"last pod", burstLast}}

// runtimeMeasures are the per-pod series the runtime's stamps give,
// reported as creation to Ready is.
var runtimeMeasures = []struct {
	short, about string
	pick         func(*burstFigures) []time.Duration
}{
	{"containers started", "creation to the last container's start (the runtime's stamps; no relist steps)",
		func(b *burstFigures) []time.Duration { return b.started }},
	{"sandbox set-up", "sandbox begun to first container created (the CNI ADD's span, the runtime's stamps)",
		func(b *burstFigures) []time.Duration { return b.setup }},
}

// as are bursts whose start-up series is another of their series, so
// that what reads creation to Ready reads that one.
func as(bs []burstFigures, pick func(*burstFigures) []time.Duration) []burstFigures {
	out := make([]burstFigures, len(bs))
	for i := range bs {
		out[i] = burstFigures{startup: pick(&bs[i])}
	}
	return out
}

// percents renders ratios as signed percentages.
func percents(rs []float64) string {
	out := make([]string, len(rs))
	for i, r := range rs {
		out[i] = fmt.Sprintf("%+.0f%%", 100*(r-1))
	}
	return strings.Join(out, " ")
}

// burstStats pools a series' start-up times, collects each burst's last
// pod, and renders each round's p50 in seconds.
func burstStats(bs []burstFigures) (all, lasts []time.Duration, rounds string) {
	for i := range bs {
		b := &bs[i]
		all = append(all, b.startup...)
		if len(b.startup) > 0 {
			lasts = append(lasts, b.startup[len(b.startup)-1])
		}
		if i > 0 {
			rounds += " "
		}
		rounds += fmt.Sprintf("%.2f", pct(b.startup, .5).Seconds())
	}
	return all, lasts, rounds
}

// reportAmbient prints the ambient series: per backend, an enrolled
// pod's ADD beside a sidecar pod's and the primary's alone, measured
// alternately in the same run, and the enrolment of a running pod.
func reportAmbient(r *results) {
	p := func(k string, q float64) time.Duration { return pct(r.samples[k], q) }
	fmt.Println("ambient mode (agent with a stand-in ztunnel that binds its listeners in each pod), sequential:")
	for _, backend := range ambientBackends {
		pre := "amb/" + backend + "/"
		if len(r.samples[pre+"enrolled ADD"]) == 0 {
			continue
		}
		fmt.Printf("  %s: ADD p50/p99 primary alone %s / %s, sidecar pod %s / %s, enrolled pod %s / %s (%.2fx the primary's p50)\n",
			backend, ms(p(pre+"primary ADD", .5)), ms(p(pre+"primary ADD", .99)),
			ms(p(pre+"sidecar ADD", .5)), ms(p(pre+"sidecar ADD", .99)),
			ms(p(pre+"enrolled ADD", .5)), ms(p(pre+"enrolled ADD", .99)),
			ratioOf(p(pre+"enrolled ADD", .5), p(pre+"primary ADD", .5)))
		fmt.Printf("  %s: istio-cni's own share p50/p99, sidecar pod %s / %s, enrolled pod %s / %s (rules, ztunnel's acknowledgement, probe set)\n",
			backend, ms(p(pre+"sidecar istio-cni ADD", .5)), ms(p(pre+"sidecar istio-cni ADD", .99)),
			ms(p(pre+"enrolled istio-cni ADD", .5)), ms(p(pre+"enrolled istio-cni ADD", .99)))
		if ds := r.samples[pre+"enrol running pod"]; len(ds) > 0 {
			fmt.Printf("  %s: a running pod labelled into the mesh, label patched to ztunnel's acknowledgement p50/p99: %s / %s (n=%d)\n",
				backend, ms(pct(ds, .5)), ms(pct(ds, .99)), len(ds))
		}
	}
}

// eventsByRound lists the bursts' pods' unusual events by round and
// reason (a sandbox made twice is a second start's work in a round), and
// one message of each reason; "" when there were none.
func eventsByRound(bs []burstFigures) string {
	var rounds []string
	text := map[string]string{}
	found := false
	for i := range bs {
		b := &bs[i]
		var parts []string
		for _, reason := range slices.Sorted(maps.Keys(b.events)) {
			parts = append(parts, fmt.Sprintf("%s×%d", reason, b.events[reason]))
			found = true
			if _, ok := text[reason]; !ok {
				text[reason] = b.eventText[reason]
			}
		}
		rounds = append(rounds, cmp.Or(strings.Join(parts, "+"), "-"))
	}
	if !found {
		return ""
	}
	out := "the pods' events beyond a plain start, by round: " + strings.Join(rounds, " ")
	for _, reason := range slices.Sorted(maps.Keys(text)) {
		msg := text[reason]
		if len(msg) > 200 {
			msg = msg[:200] + "..."
		}
		out += fmt.Sprintf("\n           %s: %s", reason, msg)
	}
	return out
}
