package main

import (
	"bufio"
	"bytes"
	"cmp"
	"fmt"
	"io"
	"os"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"time"
)

// Runs of the cluster series on the same code, each in its own hour, pool
// round by round: a round's ratio compares two bursts that ran back to
// back, so rounds from different runs are alike as samples. Each burst's
// line on stderr holds what the comparison needs, so a run's log is its
// record and -cluster-pool pools logs without measuring anything.

// burstLine is a burst's line in the run's log; parseBurstLine reads it.
func burstLine(name string, f burstFigures) string {
	return fmt.Sprintf("burst %s done: Ready p50 %.2f s, last %.2f s; started p50 %.2f s; set-up p50 %.2f s; start-up CPU %.0f ms/pod; ADDs from records %d, fallback %d",
		name, burstP50(f).Seconds(), burstLast(f).Seconds(), pct(f.started, .5).Seconds(),
		pct(f.setup, .5).Seconds(), msf(burstStartCPU(f)), f.prepared, f.fallback)
}

// cpuParts name the parts of a burst's CPU per pod that burstCPULine
// logs, in its order.
var cpuParts = [...]string{"runtime's cgroup", "containerd", "processes it waited for", "kubelet", "shims and runc", "agent", "other pods", "control plane"}

// burstCPULine is the burst's CPU per pod by part, logged after its
// burstLine, so that a run cut short, or a pool of runs, keeps where the
// CPU went as well as how much there was.
func burstCPULine(name string, f burstFigures) string {
	c := f.cpu
	per := func(d time.Duration) float64 { return msf(f.perPod(d)) }
	return fmt.Sprintf("burst %s cpu per pod, ms: runtime %.1f (containerd %.1f, processes it waited for %.1f, kubelet %.1f, shims and runc %.1f), agent %.1f, other pods %.1f, control plane %.1f",
		name, per(c.runtime), per(c.containerd), per(c.cni), per(c.kubelet), per(c.shims()),
		per(c.agent), per(c.pods), per(c.control))
}

// burstCPULineRE is burstCPULine's form, the whole line. Every part is a
// difference of two readings, and the shims' and the other pods' are
// rests, so a part may come out below 0 (by rounding, or a process
// started again between the readings) and still be the line as written.
var burstCPULineRE = regexp.MustCompile(burstNameRE + ` cpu per pod, ms: runtime (-?[0-9.]+) \(containerd (-?[0-9.]+), ` +
	`processes it waited for (-?[0-9.]+), kubelet (-?[0-9.]+), shims and runc (-?[0-9.]+)\), agent (-?[0-9.]+), other pods (-?[0-9.]+), control plane (-?[0-9.]+)$`)

// loggedCPU is a burst's CPU line: which burst, and its parts by cpuParts.
type loggedCPU struct {
	arm         string
	pods, round int
	parts       [len(cpuParts)]float64
}

// parseBurstCPULine reads a line of burstCPULine; ok false for any other
// line, an error for one that says it is one and does not read as one.
func parseBurstCPULine(line string) (c loggedCPU, ok bool, err error) {
	m, ok, err := matchBurstLine(line, " cpu per pod, ms: ", burstCPULineRE, "a burst's CPU")
	if !ok || err != nil {
		return c, ok, err
	}
	if c.arm, c.pods, c.round, err = burstName(line, m); err != nil {
		return c, true, err
	}
	parts := make([]*float64, len(c.parts))
	for i := range c.parts {
		parts[i] = &c.parts[i]
	}
	return c, true, parseFigures(line, m[4:], parts)
}

// burstNameRE is the head of a burst's lines: "burst arm-pods-round",
// submatches 1 to 3.
const burstNameRE = `^burst ([a-z][a-z-]*)-([0-9]+)-([0-9]+)`

// matchBurstLine matches line against re, a form of one kind of a burst's
// lines, which marker tells from the log's other lines: ok false for a
// line without it, an error (naming what the kind holds) for one with it
// that does not match.
func matchBurstLine(line, marker string, re *regexp.Regexp, what string) (m []string, ok bool, err error) {
	if !strings.HasPrefix(line, "burst ") || !strings.Contains(line, marker) {
		return nil, false, nil
	}
	if m = re.FindStringSubmatch(line); m == nil {
		return nil, true, fmt.Errorf("not %s as the cluster series logs it: %q", what, line)
	}
	return m, true, nil
}

// burstName reads the arm, node size and round of a line's burstNameRE
// submatches m.
func burstName(line string, m []string) (arm string, pods, round int, err error) {
	if pods, err = strconv.Atoi(m[2]); err == nil {
		round, err = strconv.Atoi(m[3])
	}
	if err != nil {
		return "", 0, 0, fmt.Errorf("%q: %w", line, err)
	}
	if pods == 0 {
		return "", 0, 0, fmt.Errorf("%q: a node of 0 pods", line)
	}
	return m[1], pods, round, nil
}

// parseFigures reads the figures ss of line into dst, in order.
func parseFigures(line string, ss []string, dst []*float64) error {
	for i, s := range ss {
		v, err := strconv.ParseFloat(s, 64)
		if err != nil {
			return fmt.Errorf("%q: figure %q is not a number", line, s)
		}
		*dst[i] = v
	}
	return nil
}

// burstLineRE is burstLine's form, the whole line.
var burstLineRE = regexp.MustCompile(burstNameRE + ` done: Ready p50 ([0-9.]+) s, last ([0-9.]+) s; ` +
	`started p50 ([0-9.]+) s; set-up p50 ([0-9.]+) s; start-up CPU ([0-9.]+) ms/pod; ADDs from records ([0-9]+), fallback ([0-9]+)$`)

// loggedBurst is a burst as its log line gives it: times in seconds, the
// start-up CPU in ms per pod.
type loggedBurst struct {
	arm                string
	pods, round        int
	ready, last        float64
	started, setup     float64
	startCPU           float64
	prepared, fallback int
	// cpu is the burst's CPU line's parts, when hasCPU (logs before run
	// BG have none).
	cpu    [len(cpuParts)]float64
	hasCPU bool
}

// parseBurstLine reads a line of burstLine. A line that is not a burst's
// end (the log's other lines) gives ok false; one that says it is and
// does not read as one is an error.
func parseBurstLine(line string) (b loggedBurst, ok bool, err error) {
	m, ok, err := matchBurstLine(line, " done: ", burstLineRE, "a burst's figures")
	if !ok || err != nil {
		return b, ok, err
	}
	if b.arm, b.pods, b.round, err = burstName(line, m); err != nil {
		return b, true, err
	}
	counts := []*int{&b.prepared, &b.fallback}
	for i, s := range m[9:11] {
		if *counts[i], err = strconv.Atoi(s); err != nil {
			return b, true, fmt.Errorf("%q: %w", line, err)
		}
	}
	return b, true, parseFigures(line, m[4:9], []*float64{&b.ready, &b.last, &b.started, &b.setup, &b.startCPU})
}

// loggedStatistics are what pooled rounds compare, each a ratio of a
// round's arm to its baseline.
var loggedStatistics = []struct {
	name string
	f    func(loggedBurst) float64
}{
	{"Ready p50", func(b loggedBurst) float64 { return b.ready }},
	{"Ready, last pod", func(b loggedBurst) float64 { return b.last }},
	{"containers started p50", func(b loggedBurst) float64 { return b.started }},
	{"sandbox set-up p50", func(b loggedBurst) float64 { return b.setup }},
	{"start-up CPU per pod (runtime + agent)", func(b loggedBurst) float64 { return b.startCPU }},
}

// pooledArm is an arm's rounds against the baseline at one node size,
// from every log that has both: ratios by loggedStatistics, in the logs'
// order and each log's round order (a statistic whose baseline is 0 in a
// round leaves that round out).
type pooledArm struct {
	logs, rounds int
	ratios       [][]float64
	// cpuRounds are the rounds whose bursts of both arms logged their CPU
	// by part: the sums of the parts over them, and each round's
	// difference, arm minus baseline, by part.
	cpuRounds       int
	cpuBase, cpuArm [len(cpuParts)]float64
	cpuDiff         [len(cpuParts)][]float64
	// estimates are the ratios' medians and intervals, by
	// loggedStatistics (readPooled).
	estimates []pairedEstimate
}

// poolKey is an arm at a node size.
type poolKey struct {
	pods int
	arm  string
}

// namedLog is a run's log and the name errors give it.
type namedLog struct {
	name string
	r    io.Reader
}

// poolLogs pairs each log's bursts of every arm with the same round's
// burst of base at the same node size and pools the rounds over the logs.
// Arms that split their bursts (mixed) are left out: their line holds the
// plugin's half alone, and their own comparison is with the other half,
// which the line does not hold.
func poolLogs(logs []namedLog, base string) (map[poolKey]*pooledArm, error) {
	out := map[poolKey]*pooledArm{}
	for _, l := range logs {
		type roundKey struct {
			pods  int
			arm   string
			round int
		}
		seen := map[roundKey]loggedBurst{}
		sc := bufio.NewScanner(l.r)
		sc.Buffer(make([]byte, 0, 64*1024), 1024*1024)
		for line := 1; sc.Scan(); line++ {
			c, ok, err := parseBurstCPULine(sc.Text())
			if err != nil {
				return nil, fmt.Errorf("%s:%d: %w", l.name, line, err)
			}
			if ok {
				// burstCPULine follows its burst's line.
				k := roundKey{c.pods, c.arm, c.round}
				b, done := seen[k]
				switch {
				case !done:
					return nil, fmt.Errorf("%s:%d: the CPU of burst %s-%d-%d, whose figures come before it in no line", l.name, line, c.arm, c.pods, c.round)
				case b.hasCPU:
					return nil, fmt.Errorf("%s:%d: the CPU of burst %s-%d-%d logged twice", l.name, line, c.arm, c.pods, c.round)
				}
				b.cpu, b.hasCPU = c.parts, true
				seen[k] = b
				continue
			}
			b, ok, err := parseBurstLine(sc.Text())
			if err != nil {
				return nil, fmt.Errorf("%s:%d: %w", l.name, line, err)
			}
			if !ok {
				continue
			}
			if _, known := clusterArms[b.arm]; !known {
				return nil, fmt.Errorf("%s:%d: no arm is named %q", l.name, line, b.arm)
			}
			k := roundKey{b.pods, b.arm, b.round}
			if _, dup := seen[k]; dup {
				return nil, fmt.Errorf("%s:%d: burst %s-%d-%d logged twice (two runs in one log?)", l.name, line, b.arm, b.pods, b.round)
			}
			seen[k] = b
		}
		if err := sc.Err(); err != nil {
			return nil, fmt.Errorf("%s: %w", l.name, err)
		}
		if len(seen) == 0 {
			return nil, fmt.Errorf("%s holds no burst's line: not a cluster run's stderr?", l.name)
		}
		keys := make([]roundKey, 0, len(seen))
		for k := range seen {
			keys = append(keys, k)
		}
		slices.SortFunc(keys, func(a, b roundKey) int {
			return cmp.Or(cmp.Compare(a.pods, b.pods), strings.Compare(a.arm, b.arm), cmp.Compare(a.round, b.round))
		})
		counted := map[poolKey]bool{}
		for _, k := range keys {
			bb, ok := seen[roundKey{k.pods, base, k.round}]
			if k.arm == base || clusterArms[k.arm].mixed || !ok {
				// Without a baseline burst, the run ended first.
				continue
			}
			pk := poolKey{k.pods, k.arm}
			p := out[pk]
			if p == nil {
				p = &pooledArm{ratios: make([][]float64, len(loggedStatistics))}
				out[pk] = p
			}
			if !counted[pk] {
				counted[pk] = true
				p.logs++
			}
			p.rounds++
			b := seen[k]
			for i, st := range loggedStatistics {
				if v := st.f(bb); v > 0 {
					p.ratios[i] = append(p.ratios[i], st.f(b)/v)
				}
			}
			if b.hasCPU && bb.hasCPU {
				p.cpuRounds++
				for i := range cpuParts {
					p.cpuBase[i] += bb.cpu[i]
					p.cpuArm[i] += b.cpu[i]
					p.cpuDiff[i] = append(p.cpuDiff[i], b.cpu[i]-bb.cpu[i])
				}
			}
		}
	}
	return out, nil
}

// pool is the rounds of a set of logs pooled against base, read once
// for both the report and the plot.
type pool struct {
	paths []string
	base  string
	arms  map[poolKey]*pooledArm
	// keys are arms' keys in the order the report and the plot give
	// them: by node size, then arm.
	keys []poolKey
}

// readPooled reads the logs at paths, pools their rounds against base
// (poolLogs) and estimates each arm's statistics.
func readPooled(paths []string, base string) (*pool, error) {
	if len(paths) == 0 {
		return nil, fmt.Errorf("-cluster-pool names no log")
	}
	logs := make([]namedLog, 0, len(paths))
	for i, path := range paths {
		if slices.Contains(paths[:i], path) {
			return nil, fmt.Errorf("log %s named twice", path)
		}
		b, err := os.ReadFile(path)
		if err != nil {
			return nil, err
		}
		logs = append(logs, namedLog{path, bytes.NewReader(b)})
	}
	pooled, err := poolLogs(logs, base)
	if err != nil {
		return nil, err
	}
	if len(pooled) == 0 {
		return nil, fmt.Errorf("no round in %s has a burst of %s and of another arm", strings.Join(paths, ", "), base)
	}
	keys := make([]poolKey, 0, len(pooled))
	for k, p := range pooled {
		keys = append(keys, k)
		p.estimates = make([]pairedEstimate, len(loggedStatistics))
		for i := range loggedStatistics {
			p.estimates[i] = medianInterval(p.ratios[i], .9)
		}
	}
	slices.SortFunc(keys, func(a, b poolKey) int {
		return cmp.Or(cmp.Compare(a.pods, b.pods), strings.Compare(a.arm, b.arm))
	})
	return &pool{paths: paths, base: base, arms: pooled, keys: keys}, nil
}

// report prints, per node size and arm, the pooled rounds against the
// base, each statistic with its 5% target's verdict.
func (pl *pool) report(w io.Writer) {
	paths, base := pl.paths, pl.base
	fmt.Fprintf(w, "cluster bursts pooled round by round from %s (each round's ratio to its own %s burst):\n", strings.Join(paths, ", "), base)
	for _, k := range pl.keys {
		p := pl.arms[k]
		fmt.Fprintf(w, "%d pods on the node, %s against %s, %d rounds from %d of the logs:\n", k.pods, k.arm, base, p.rounds, p.logs)
		for i, st := range loggedStatistics {
			e := p.estimates[i]
			fmt.Fprintf(w, "  %-40s median %+.1f%%, 90%% interval [%+.1f%%, %+.1f%%]; within %g%%: %s", st.name+":",
				100*(e.Median-1), 100*(e.Low-1), 100*(e.High-1), burstTargetPercent, e.within(burstTarget))
			if n := len(p.ratios[i]); n != p.rounds {
				fmt.Fprintf(w, " (%d rounds with a baseline figure)", n)
			}
			fmt.Fprintln(w)
		}
		if p.cpuRounds == 0 {
			continue
		}
		// Differences, not ratios: a part can be 0 in the baseline (the
		// agent's) and the parts of one burst add up.
		fmt.Fprintf(w, "  CPU per pod by part, %d rounds that logged it, ms: %s's mean, %s's, and the round-by-round difference (median, 90%% interval):\n", p.cpuRounds, base, k.arm)
		n := float64(p.cpuRounds)
		for i, part := range cpuParts {
			e := medianInterval(p.cpuDiff[i], .9)
			fmt.Fprintf(w, "    %-26s %7.1f %7.1f   %+6.1f [%+.1f, %+.1f]\n", part+":", p.cpuBase[i]/n, p.cpuArm[i]/n, e.Median, e.Low, e.High)
		}
	}
}
