package main

import (
	"encoding/xml"
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"
)

// TestBurstLine: the line the cluster series logs of a burst, to the
// byte (the kept logs in docs/bursts are in this form), and what pooling
// reads back from it, an arm's name with dashes included.
func TestBurstLine(t *testing.T) {
	milli := time.Millisecond
	f := burstFigures{startup: []time.Duration{9000 * milli, 10120 * milli, 12340 * milli}, started: []time.Duration{8 * time.Second},
		setup: []time.Duration{4500 * milli}, cpu: nodeCPU{runtime: 750 * milli, agent: 30 * milli}, prepared: 2, fallback: 1}
	line := burstLine("without-again-110-17", f)
	if want := "burst without-again-110-17 done: Ready p50 10.12 s, last 12.34 s; started p50 8.00 s; set-up p50 4.50 s; start-up CPU 260 ms/pod; ADDs from records 2, fallback 1"; line != want {
		t.Fatalf("logged\n%s\nwant\n%s", line, want)
	}
	b, ok, err := parseBurstLine(line)
	if err != nil || !ok {
		t.Fatalf("%q: ok %v, %v", line, ok, err)
	}
	want := loggedBurst{arm: "without-again", pods: 110, round: 17, ready: 10.12, last: 12.34, started: 8, setup: 4.5, startCPU: 260, prepared: 2, fallback: 1}
	if b != want {
		t.Fatalf("%q read as %+v, want %+v", line, b, want)
	}
	for _, other := range []string{"burst warm-0: CLOCK_MONOTONIC 1.0,2.0", "burst plugin-33-1-0: CLOCK_MONOTONIC 1.0,2.0", "I1128 02:42:22.191688 warnings.go:110] burst", ""} {
		if _, ok, err := parseBurstLine(other); ok || err != nil {
			t.Errorf("%q: ok %v, %v; want it skipped", other, ok, err)
		}
	}
	for _, bad := range []string{
		"burst plugin-33-1 done: Ready p50 x s",
		strings.Replace(line, "without-again-110-17", "plugin-17", 1),
		strings.Replace(line, "without-again-110-17", "plugin-many-17", 1),
		strings.Replace(line, "without-again-110-17", "-110-17", 1),
		strings.Replace(line, "without-again-110-17", "plugin-0-17", 1),
		strings.Replace(line, "10.12", "-10.12", 1),
		strings.Replace(line, "10.12", "NaN", 1),
		strings.Replace(line, "10.12", "1.0.12", 1),
		line + "burst plugin-110-17 done: Ready p50 1.00 s",
		line + ".5",
	} {
		if _, ok, err := parseBurstLine(bad); !ok || err == nil {
			t.Errorf("%q: ok %v, err %v; want an error", bad, ok, err)
		}
	}
}

// The CPU line splits the burst's CPU per pod by part, the shims as the
// runtime's rest, and is not a burst's figures to the pool.
func TestBurstCPULine(t *testing.T) {
	milli := time.Millisecond
	f := burstFigures{startup: []time.Duration{1, 2, 3, 4}, cpu: nodeCPU{runtime: 2000 * milli, containerd: 400 * milli, cni: 100 * milli,
		kubelet: 600 * milli, agent: 20 * milli, pods: 800 * milli, control: 1000 * milli, node: 4000 * milli}}
	line := burstCPULine("plugin-110-3", f)
	if want := "burst plugin-110-3 cpu per pod, ms: runtime 500.0 (containerd 100.0, processes it waited for 25.0, kubelet 150.0, shims and runc 225.0), agent 5.0, other pods 200.0, control plane 250.0"; line != want {
		t.Fatalf("logged\n%s\nwant\n%s", line, want)
	}
	if _, ok, err := parseBurstLine(line); ok || err != nil {
		t.Errorf("the CPU line: ok %v, %v; want it skipped by the pool", ok, err)
	}
	if got := burstCPULine("without-33-0", burstFigures{}); !strings.Contains(got, "runtime 0.0 (") {
		t.Errorf("a burst of no pods: %q", got)
	}
	c, ok, err := parseBurstCPULine(line)
	if err != nil || !ok {
		t.Fatalf("%q: ok %v, %v", line, ok, err)
	}
	if want := (loggedCPU{arm: "plugin", pods: 110, round: 3, parts: [len(cpuParts)]float64{500, 100, 25, 150, 225, 5, 200, 250}}); c != want {
		t.Fatalf("%q read as %+v, want %+v", line, c, want)
	}
	if c, _, err := parseBurstCPULine(strings.Replace(line, "shims and runc 225.0", "shims and runc -0.1", 1)); err != nil || c.parts[4] != -0.1 {
		t.Errorf("a rest below 0 by rounding: %+v, %v", c, err)
	}
	if c, _, err := parseBurstCPULine(strings.Replace(line, "control plane 250.0", "control plane -2.5", 1)); err != nil || c.parts[7] != -2.5 {
		t.Errorf("a part below 0: %+v, %v", c, err)
	}
	if _, ok, err := parseBurstCPULine(logLine("plugin", 110, 3, 1, 1, 1, 1)); ok || err != nil {
		t.Errorf("a burst's figures read as its CPU: ok %v, %v", ok, err)
	}
	for _, bad := range []string{
		strings.Replace(line, "runtime 500.0", "runtime x", 1),
		strings.Replace(line, "agent 5.0", "agent 5.0.0", 1),
		strings.Replace(line, "agent 5.0", "agent --5.0", 1),
		strings.Replace(line, "plugin-110-3", "plugin-3", 1),
		line + ", kubelet 1.0",
	} {
		if _, ok, err := parseBurstCPULine(bad); !ok || err == nil {
			t.Errorf("%q: ok %v, err %v; want an error", bad, ok, err)
		}
	}
}

// cpuLogLine is a burst's CPU line with the given runtime and agent parts;
// the runtime's parts are its fixed shares (containerd 1/2, processes
// 1/10, kubelet 1/4, shims the rest), the other pods 4 and the control
// plane 1/5 times it, so that each part's pooling is told apart.
func cpuLogLine(arm string, pods, round int, runtime, agent float64) string {
	return fmt.Sprintf("burst %s-%d-%d cpu per pod, ms: runtime %.1f (containerd %.1f, processes it waited for %.1f, kubelet %.1f, shims and runc %.1f), agent %.1f, other pods %.1f, control plane %.1f\n",
		arm, pods, round, runtime, runtime/2, runtime/10, runtime/4, runtime*3/20, agent, 4*runtime, runtime/5)
}

// -cluster-rounds-for stops the rounds by time, never before the first,
// never beyond -cluster-rounds, and only where a balanced order of the
// arms ends.
func TestRoundDue(t *testing.T) {
	c := clusterConfig{rounds: 5}
	for r := range 5 {
		if !c.roundDue(r, 100*time.Hour, 2) {
			t.Errorf("no time bound: round %d not due", r)
		}
	}
	if c.roundDue(5, 0, 1) {
		t.Error("round 5 of 5 due")
	}
	c.rounds, c.roundsFor = 20, time.Hour
	for _, tc := range []struct {
		round, design int
		elapsed       time.Duration
		due           bool
	}{
		{0, 1, 2 * time.Hour, true}, {1, 1, 59 * time.Minute, true}, {1, 1, time.Hour, false}, {4, 1, 10 * time.Minute, true},
		// Three arms balance over six rounds: past the bound, rounds 7
		// to 11 finish the design begun, and 12 is not begun.
		{7, 6, 2 * time.Hour, true}, {11, 6, 2 * time.Hour, true}, {12, 6, 2 * time.Hour, false}, {6, 6, time.Hour, false},
		{12, 6, 59 * time.Minute, true}, {19, 6, 3 * time.Hour, true}, {20, 6, 0, false}, {3, 0, 2 * time.Hour, false},
	} {
		if got := c.roundDue(tc.round, tc.elapsed, tc.design); got != tc.due {
			t.Errorf("round %d (design of %d) after %s: due %v, want %v", tc.round, tc.design, tc.elapsed, got, tc.due)
		}
	}
}

// The report's header gives the rounds each arm ran, not the rounds set.
func TestRoundsDone(t *testing.T) {
	r := &clusterResult{sizes: []int{33, 110}, arms: []clusterArm{{name: "without"}, {name: "plugin"}},
		bursts: map[int]map[string][]burstFigures{
			33:  {"without": make([]burstFigures, 5), "plugin": make([]burstFigures, 5)},
			110: {"without": make([]burstFigures, 3), "plugin": make([]burstFigures, 2)}}}
	if got := r.roundsDone(5); got != 2 {
		t.Errorf("rounds done %d, want 2", got)
	}
	r.bursts[110]["plugin"] = make([]burstFigures, 5)
	r.bursts[110]["without"] = make([]burstFigures, 5)
	if got := r.roundsDone(5); got != 5 {
		t.Errorf("rounds done %d, want 5", got)
	}
}

// TestKeptBurstLogs: every burst line of the kept logs reads, and each
// log pairs rounds, so the figures the documents quote from them can be
// printed again.
func TestKeptBurstLogs(t *testing.T) {
	logs, err := filepath.Glob("../../docs/bursts/*.log")
	if err != nil || len(logs) == 0 {
		t.Fatalf("no kept logs: %v", err)
	}
	for _, l := range logs {
		p, err := readPooled([]string{l}, "without")
		if err != nil {
			t.Errorf("%s: %v", l, err)
			continue
		}
		p.report(&strings.Builder{})
	}
}

// logLine is a burst's line as the cluster series logs it, each figure
// its own: containers started 1 s before Ready, set-up 3 s.
func logLine(arm string, pods, round int, ready, last, setup, cpu float64) string {
	return fmt.Sprintf("burst %s-%d-%d done: Ready p50 %.2f s, last %.2f s; started p50 %.2f s; set-up p50 %.2f s; start-up CPU %.0f ms/pod; ADDs from records 0, fallback 0\n",
		arm, pods, round, ready, last, ready-1, setup, cpu)
}

func logs(texts ...string) []namedLog {
	out := make([]namedLog, len(texts))
	for i, s := range texts {
		out[i] = namedLog{string(rune('a' + i)), strings.NewReader(s)}
	}
	return out
}

// TestPoolLogs: each log's rounds pair within that log, at the same node
// size; a round whose baseline is missing (a run cut short) is left out;
// logs pool in order; mixed arms, whose line holds half a burst, are left
// out.
func TestPoolLogs(t *testing.T) {
	a := logLine("without", 33, 0, 10, 12, 3, 250) + logLine("plugin", 33, 0, 11, 12, 3.3, 255) +
		"burst plugin-33-1-0: CLOCK_MONOTONIC 1.0,2.0\n" +
		logLine("plugin", 33, 1, 10, 13, 3, 260) + logLine("without", 33, 1, 10, 13, 3, 250) +
		logLine("mixed", 33, 1, 20, 26, 6, 500) +
		logLine("without", 110, 0, 20, 25, 3, 300) + logLine("plugin", 110, 0, 22, 25, 3, 309)
	b := logLine("without", 33, 0, 5, 6, 0, 200) + logLine("plugin", 33, 0, 6, 6, 4, 220) +
		logLine("plugin", 33, 1, 50, 60, 3, 400)
	got, err := poolLogs(logs(a, b), "without")
	if err != nil {
		t.Fatal(err)
	}
	p33 := got[poolKey{33, "plugin"}]
	if p33 == nil || p33.logs != 2 || p33.rounds != 3 || len(got) != 2 {
		t.Fatalf("pooled %+v", got)
	}
	for i, want := range [][]float64{
		{1.1, 1, 1.2},        // Ready p50
		{1, 1, 1},            // last pod
		{10. / 9, 1, 5. / 4}, // containers started
		{1.1, 1},             // set-up: b's baseline has none
		{1.02, 1.04, 1.1},    // CPU
	} {
		if !approx(p33.ratios[i], want) {
			t.Errorf("33 pods, %s: ratios %v, want %v", loggedStatistics[i].name, p33.ratios[i], want)
		}
	}
	if p110 := got[poolKey{110, "plugin"}]; p110 == nil || p110.logs != 1 || !approx(p110.ratios[0], []float64{1.1}) {
		t.Errorf("110 pods: %+v", p110)
	}
	// The CPU by part, where both bursts of a round logged it.
	c := logLine("without", 33, 0, 10, 12, 3, 250) + cpuLogLine("without", 33, 0, 240, 0) +
		logLine("plugin", 33, 0, 11, 12, 3, 260) + cpuLogLine("plugin", 33, 0, 250, 3) +
		logLine("without", 33, 1, 10, 12, 3, 250) + cpuLogLine("without", 33, 1, 250, 0) +
		logLine("plugin", 33, 1, 11, 12, 3, 260) + cpuLogLine("plugin", 33, 1, 254, 4) +
		logLine("without", 33, 2, 10, 12, 3, 250) + logLine("plugin", 33, 2, 11, 12, 3, 260) + cpuLogLine("plugin", 33, 2, 300, 9)
	got, err = poolLogs(logs(c), "without")
	if err != nil {
		t.Fatal(err)
	}
	p := got[poolKey{33, "plugin"}]
	if p == nil || p.rounds != 3 || p.cpuRounds != 2 {
		t.Fatalf("the CPU by part: %+v", p)
	}
	// Rounds 0 and 1: runtime 240 -> 250 and 250 -> 254, agent 0 -> 3 and 0 -> 4.
	for i, share := range []float64{1, 1. / 2, 1. / 10, 1. / 4, 3. / 20, 0, 4, 1. / 5} {
		base, arm, diff := 490*share, 504*share, []float64{10 * share, 4 * share}
		if i == 5 {
			base, arm, diff = 0, 7, []float64{3, 4}
		}
		if d := p.cpuBase[i] - base; d > 0.11 || d < -0.11 {
			t.Errorf("%s: without's sum %.2f, want %.2f", cpuParts[i], p.cpuBase[i], base)
		}
		if d := p.cpuArm[i] - arm; d > 0.11 || d < -0.11 {
			t.Errorf("%s: plugin's sum %.2f, want %.2f", cpuParts[i], p.cpuArm[i], arm)
		}
		for j := range diff {
			if d := p.cpuDiff[i][j] - diff[j]; d > 0.11 || d < -0.11 {
				t.Errorf("%s: differences %v, want %v", cpuParts[i], p.cpuDiff[i], diff)
			}
		}
	}
	for _, c := range []struct{ log, err string }{
		{a + logLine("plugin", 33, 1, 1, 1, 1, 1), "a:9: burst plugin-33-1 logged twice"},
		{cpuLogLine("plugin", 33, 0, 1, 1) + logLine("plugin", 33, 0, 1, 1, 1, 1), "a:1: the CPU of burst plugin-33-0, whose figures come before it in no line"},
		{logLine("plugin", 33, 0, 1, 1, 1, 1) + cpuLogLine("plugin", 33, 0, 1, 1) + cpuLogLine("plugin", 33, 0, 1, 1), "a:3: the CPU of burst plugin-33-0 logged twice"},
		{"burst plugin-33-0 cpu per pod, ms: runtime x\n", "a:1: not a burst's CPU"},
		{"burst plugin-33-0 done: Ready p50 x s\n", "a:1: not a burst's figures"},
		{logLine("plugins", 33, 0, 1, 1, 1, 1), `a:1: no arm is named "plugins"`},
	} {
		if _, err := poolLogs(logs(c.log), "without"); err == nil || !strings.Contains(err.Error(), c.err) {
			t.Errorf("got %v, want %q", err, c.err)
		}
	}
}

func approx(got, want []float64) bool {
	if len(got) != len(want) {
		return false
	}
	for i := range got {
		if d := got[i] - want[i]; d > 1e-9 || d < -1e-9 {
			return false
		}
	}
	return true
}

// TestReportPooled: from files, each statistic with its verdict, and the
// rounds a statistic lacks; what cannot be pooled is an error naming why.
func TestReportPooled(t *testing.T) {
	dir := t.TempDir()
	var log strings.Builder
	for r := 0; r < 40; r++ {
		setup := 3.0
		if r == 0 {
			setup = 0
		}
		log.WriteString(logLine("without", 33, r, 10, 12, setup, 250) + cpuLogLine("without", 33, r, 250, 0) +
			logLine("plugin", 33, r, 10.2, 12.24, 3, 255) + cpuLogLine("plugin", 33, r, 250, 5))
	}
	write := func(name, text string) string {
		p := filepath.Join(dir, name)
		if err := os.WriteFile(p, []byte(text), 0o600); err != nil {
			t.Fatal(err)
		}
		return p
	}
	a := write("a.log", log.String())
	var out strings.Builder
	p, err := readPooled([]string{a}, "without")
	if err != nil {
		t.Fatal(err)
	}
	p.report(&out)
	for _, want := range []string{
		"33 pods on the node, plugin against without, 40 rounds from 1 of the logs:\n",
		"  Ready p50:                               median +2.0%, 90% interval [+2.0%, +2.0%]; within 5%: met\n",
		"  Ready, last pod:                         median +2.0%, 90% interval [+2.0%, +2.0%]; within 5%: met\n",
		"  containers started p50:                  median +2.2%, 90% interval [+2.2%, +2.2%]; within 5%: met\n",
		"  sandbox set-up p50:                      median +0.0%, 90% interval [+0.0%, +0.0%]; within 5%: met (39 rounds with a baseline figure)\n",
		"  start-up CPU per pod (runtime + agent):  median +2.0%, 90% interval [+2.0%, +2.0%]; within 5%: met\n",
		"  CPU per pod by part, 40 rounds that logged it, ms: without's mean, plugin's, and the round-by-round difference (median, 90% interval):\n",
		"    runtime's cgroup:            250.0   250.0     +0.0 [+0.0, +0.0]\n",
		"    agent:                         0.0     5.0     +5.0 [+5.0, +5.0]\n",
		"    control plane:                50.0    50.0     +0.0 [+0.0, +0.0]\n",
	} {
		if !strings.Contains(out.String(), want) {
			t.Errorf("report lacks %q:\n%s", want, out.String())
		}
	}
	for _, c := range []struct {
		paths []string
		err   string
	}{
		{nil, "names no log"},
		{[]string{a, a}, "named twice"},
		{[]string{write("only.log", logLine("without", 33, 0, 10, 12, 3, 250))}, "no round in"},
		{[]string{a, write("stdout.log", "30 sidecar pods created at once\n")}, "holds no burst's line"},
		{[]string{filepath.Join(dir, "missing.log")}, "missing.log"},
	} {
		if _, err := readPooled(c.paths, "without"); err == nil || !strings.Contains(err.Error(), c.err) {
			t.Errorf("%v: got %v, want %q", c.paths, err, c.err)
		}
	}
}

// The pool's plot has a row per statistic and arm, each with its
// interval, median and verdict, and is well-formed SVG.
func TestPooledSVG(t *testing.T) {
	dir := t.TempDir()
	var log strings.Builder
	for r := 0; r < 40; r++ {
		log.WriteString(logLine("without", 33, r, 10, 12, 3, 250) + logLine("plugin", 33, r, 10.2, 12.24, 3, 255) +
			logLine("without", 110, r, 20, 24, 6, 400) + logLine("plugin", 110, r, 21.6, 25.92, 6, 420))
	}
	logPath := filepath.Join(dir, "a.log")
	if err := os.WriteFile(logPath, []byte(log.String()), 0o600); err != nil {
		t.Fatal(err)
	}
	path := filepath.Join(dir, "p.svg")
	p, err := readPooled([]string{logPath}, "without")
	if err != nil {
		t.Fatal(err)
	}
	if err := p.writeSVG(path); err != nil {
		t.Fatal(err)
	}
	b, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	svg := string(b)
	if n := strings.Count(svg, "<circle"); n != 2*len(loggedStatistics) {
		t.Errorf("%d medians drawn, want %d:\n%s", n, 2*len(loggedStatistics), svg)
	}
	for _, want := range []string{
		"pooled from a.log",
		"33 pods on the node: istio-cni, the relay commits (default), 40 rounds from 1 run<",
		"110 pods on the node: istio-cni, the relay commits (default), 40 rounds from 1 run<",
		">+2.0% [+2.0%, +2.0%] met<",
		">+8.0% [+8.0%, +8.0%] missed<",
		">target: within 5%<",
	} {
		if !strings.Contains(svg, want) {
			t.Errorf("the plot lacks %q:\n%s", want, svg)
		}
	}
	d := xml.NewDecoder(strings.NewReader(svg))
	for {
		if _, err := d.Token(); errors.Is(err, io.EOF) {
			break
		} else if err != nil {
			t.Fatalf("not well-formed: %v", err)
		}
	}
	if _, err := readPooled(nil, "without"); err == nil || !strings.Contains(err.Error(), "names no log") {
		t.Errorf("no logs: got %v", err)
	}
}
