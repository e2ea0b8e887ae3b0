package main

import (
	"flag"
	"io"
	"testing"
	"time"
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
	want := config{seqPods: 40, parallel: 20, rounds: 3, listPods: 15, flat: flatConfig{rounds: 4, pods: 5},
		cluster: clusterConfig{rounds: 3, busy: 2, busyCPU: "600m", full: true, arms: "without,plugin,agent"}}
	if got := parse(); got != want {
		t.Errorf("defaults: got %+v, want %+v", got, want)
	}
	want = config{seqPods: 1, parallel: 2, rounds: 4, listPods: 5, listsOnly: true,
		cluster: clusterConfig{pods: 6, rounds: 7, agentCPU: "250m", busy: 1, busyCPU: "1", full: false, arms: "agent,without"},
		flat:    flatConfig{rounds: 8, pods: 9, only: true}}
	if got := parse("-pods", "1", "-parallel", "2", "-rounds", "4", "-list-pods", "5", "-lists-only",
		"-cluster-pods", "6", "-cluster-rounds", "7", "-cluster-agent-cpu", "250m", "-cluster-busy", "1", "-cluster-busy-cpu", "1",
		"-cluster-full=false", "-cluster-arms", "agent,without",
		"-flat-rounds", "8", "-flat-pods", "9", "-flat-only"); got != want {
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
