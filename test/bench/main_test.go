package main

import (
	"flag"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/istio-cni-go/istio-cni/internal/testenv"
)

func TestParseFlags(t *testing.T) {
	parse := func(args ...string) config {
		t.Helper()
		fs := flag.NewFlagSet("bench", flag.ContinueOnError)
		fs.SetOutput(io.Discard)
		c, err := parseFlags(fs, args)
		if err != nil {
			t.Fatal(err)
		}
		return c
	}
	want := config{seqPods: 40, parallel: 20, rounds: 3, listPods: 15, ambientPods: 30, memoryCycles: 3, flat: flatConfig{rounds: 8, pods: 30, listRounds: 150},
		cluster: clusterConfig{rounds: 3, busy: 2, busyCPU: "600m", full: true, small: true, arms: "without,plugin,mixed"}}
	if got := parse(); got != want {
		t.Errorf("defaults: got %+v, want %+v", got, want)
	}
	want = config{seqPods: 1, parallel: 2, rounds: 4, listPods: 5, listsOnly: true, ambientPods: 10, ambientOnly: true, memoryCycles: 12, memoryOnly: true,
		cluster: clusterConfig{pods: 6, rounds: 7, roundsFor: 90 * time.Minute, agentCPU: "250m", busy: 1, busyCPU: "1", full: false, small: false, arms: "agent,without", svg: "/tmp/c.svg", pool: "a.log,b.log"},
		flat:    flatConfig{rounds: 8, pods: 9, listRounds: 11, only: true}}
	if got := parse("-pods", "1", "-parallel", "2", "-rounds", "4", "-list-pods", "5", "-lists-only", "-ambient-pods", "10", "-ambient-only", "-memory-cycles", "12", "-memory-only",
		"-cluster-pods", "6", "-cluster-rounds", "7", "-cluster-rounds-for", "1h30m", "-cluster-agent-cpu", "250m", "-cluster-busy", "1", "-cluster-busy-cpu", "1",
		"-cluster-full=false", "-cluster-small=false", "-cluster-arms", "agent,without", "-cluster-svg", "/tmp/c.svg", "-cluster-pool", "a.log,b.log",
		"-flat-rounds", "8", "-flat-pods", "9", "-flat-list-rounds", "11", "-flat-only"); got != want {
		t.Errorf("every flag set: got %+v, want %+v", got, want)
	}
	fs := flag.NewFlagSet("bench", flag.ContinueOnError)
	fs.SetOutput(io.Discard)
	if _, err := parseFlags(fs, []string{"-pods", "many"}); err == nil {
		t.Error("a non-number for -pods was accepted")
	}
}

// The parallel series report CPU per pod; a series that started no pod
// must not divide by zero.
func TestCPUSplitDiv(t *testing.T) {
	c := cpuSplit{runtime: 10 * time.Millisecond, plugins: 20 * time.Millisecond, agent: 30 * time.Millisecond}
	if got, want := c.div(10), (cpuSplit{time.Millisecond, 2 * time.Millisecond, 3 * time.Millisecond}); got != want {
		t.Errorf("div(10) = %+v, want %+v", got, want)
	}
	if got := c.div(0); got != c {
		t.Errorf("div(0) = %+v, want %+v", got, c)
	}
}

// The plot draws one panel per node size and one curve per arm measured,
// each ending at the slowest pod.
func TestClusterSVG(t *testing.T) {
	burstOf := func(ms ...int) burstFigures {
		var f burstFigures
		for _, m := range ms {
			f.startup = append(f.startup, time.Duration(m)*time.Millisecond)
		}
		return f
	}
	r := &clusterResult{sizes: []int{33, 110}, arms: []clusterArm{clusterArms["without"], clusterArms["plugin"]},
		bursts: map[int]map[string][]burstFigures{
			33:  {"without": {burstOf(1000, 2000)}, "plugin": {burstOf(1100, 2100)}},
			110: {"without": {burstOf(3000, 9000)}, "plugin": {burstOf(3100, 9400)}},
		}}
	path := filepath.Join(t.TempDir(), "c.svg")
	if err := writeClusterSVG(path, clusterConfig{pods: 2, rounds: 1}, r); err != nil {
		t.Fatal(err)
	}
	b, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	svg := string(b)
	if n := strings.Count(svg, "<polyline"); n != 4 {
		t.Fatalf("%d curves, want 4:\n%s", n, svg)
	}
	for _, want := range []string{"33 pods on the node", "110 pods on the node", "without istio-cni", "the relay commits", ">10s<"} {
		if !strings.Contains(svg, want) {
			t.Errorf("the plot lacks %q", want)
		}
	}
}

// A mixed burst alternates its pods between the two runtime classes,
// which half starts first flips by round, and the plain half is told
// apart by name (how burst splits the times, and how the plugin's log is
// checked).
func TestMixedBurstPods(t *testing.T) {
	for round := 0; round < 2; round++ {
		ps := sidecarPods(fmt.Sprintf("mixed-33-%d", round), 6, mixedClasses(round))
		plain := 0
		for i, p := range ps {
			isPlain := *p.Spec.RuntimeClassName == testenv.PlainRuntimeClass
			if isPlain != strings.HasPrefix(p.Name, plainPrefix) {
				t.Errorf("round %d: pod %s has class %s", round, p.Name, *p.Spec.RuntimeClassName)
			}
			if want := (i+round)%2 == 1; isPlain != want {
				t.Errorf("round %d: pod %d plain %t, want %t", round, i, isPlain, want)
			}
			if isPlain {
				plain++
			}
		}
		if plain != 3 {
			t.Errorf("round %d: %d of 6 pods plain, want 3", round, plain)
		}
	}
	if p := sidecarPods("plugin-33-0", 1, nil)[0]; p.Spec.RuntimeClassName != nil || strings.HasPrefix(p.Name, plainPrefix) {
		t.Errorf("a pod of an unmixed burst names runtime class %v (%s)", p.Spec.RuntimeClassName, p.Name)
	}
	halves := plainHalves([]burstFigures{{startup: []time.Duration{1, 2}, without: []time.Duration{3}}})
	if len(halves) != 1 || len(halves[0].startup) != 1 || halves[0].startup[0] != 3 {
		t.Errorf("plain halves %v", halves)
	}
}

// TestArmOrderBalancesPredecessors: over a full design every round runs
// every arm once, and every arm follows every other arm equally often.
func TestArmOrderBalancesPredecessors(t *testing.T) {
	for k := 1; k <= 7; k++ {
		rows := designRounds(k)
		follows := map[[2]int]int{}
		for round := 0; round < rows; round++ {
			order := armOrder(k, round)
			seen := map[int]bool{}
			for j, a := range order {
				if a < 0 || a >= k || seen[a] {
					t.Fatalf("k=%d round %d: order %v is not a permutation", k, round, order)
				}
				seen[a] = true
				if j > 0 {
					follows[[2]int{order[j-1], a}]++
				}
			}
			if len(seen) != k {
				t.Fatalf("k=%d round %d: order %v", k, round, order)
			}
		}
		want := rows / k // rows*(k-1) pairs over k*(k-1) ordered pairs
		if k == 1 {
			continue
		}
		for a := range k {
			for b := range k {
				if a != b && follows[[2]int{a, b}] != want {
					t.Fatalf("k=%d: arm %d follows arm %d %d times, want %d (all: %v)", k, b, a, follows[[2]int{a, b}], want, follows)
				}
			}
		}
	}
	if got := armOrder(3, 6); !slices.Equal(got, armOrder(3, 0)) {
		t.Fatalf("the design does not repeat: %v", got)
	}
}

func TestEventsByRound(t *testing.T) {
	if got := eventsByRound([]burstFigures{{}, {}}); got != "" {
		t.Fatalf("no events: %q", got)
	}
	got := eventsByRound([]burstFigures{{}, {events: map[string]int{"FailedCreatePodSandBox": 3, "BackOff": 1},
		eventText: map[string]string{"FailedCreatePodSandBox": "plugin type=\"istio-cni\" failed (add): boom", "BackOff": "back-off"}}})
	want := "the pods' events beyond a plain start, by round: - BackOff×1+FailedCreatePodSandBox×3\n" +
		"           BackOff: back-off\n           FailedCreatePodSandBox: plugin type=\"istio-cni\" failed (add): boom"
	if got != want {
		t.Fatalf("got\n%s\nwant\n%s", got, want)
	}
}

// TestCPUJiffies: the machine's busy jiffies are part of its total, and
// both only grow.
func TestCPUJiffies(t *testing.T) {
	busy, total, err := cpuJiffies()
	if err != nil {
		t.Fatal(err)
	}
	if total == 0 || busy > total {
		t.Fatalf("busy %d of %d jiffies", busy, total)
	}
	for total2 := total; total2 == total; {
		var busy2 uint64
		if busy2, total2, err = cpuJiffies(); err != nil {
			t.Fatal(err)
		}
		if busy2 < busy || total2 < total {
			t.Fatalf("went back: busy %d -> %d, total %d -> %d", busy, busy2, total, total2)
		}
	}
}

// TestSendBudget: the send's growth is set beside a tenth of the
// process's time at 10 entries.
func TestSendBudget(t *testing.T) {
	got := sendBudget(930*time.Microsecond, 1820*time.Microsecond, 5090*time.Microsecond)
	want := "the send alone grew by 0.89 ms, 1.75 times the 0.51 ms the 1.10x target allows the whole process"
	if got != want {
		t.Errorf("sendBudget = %q, want %q", got, want)
	}
}
