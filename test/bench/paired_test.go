package main

import (
	"testing"
	"time"
)

func burstOf(ds ...time.Duration) burstFigures { return burstFigures{startup: ds} }

// TestPairRounds: ratios are taken round by round, so a drift that moves
// both arms of a round alike cancels; the interval contains the median,
// narrows when rounds agree, and says met, missed or not settled.
func TestPairRounds(t *testing.T) {
	s := time.Second
	// The machine drifts from 10 s to 20 s; the arm is 2% slower in each.
	var base, arm []burstFigures
	for i := 0; i < 8; i++ {
		d := time.Duration(10+i) * s
		base = append(base, burstOf(d, d, 2*d))
		arm = append(arm, burstOf(d*102/100, d*102/100, 2*d*102/100))
	}
	e := pairRounds(base, arm, burstP50, .9)
	if e.Median < 1.019 || e.Median > 1.021 || e.Low > e.Median || e.High < e.Median || e.High-e.Low > 0.001 {
		t.Fatalf("agreeing rounds: %+v", e)
	}
	if got := e.within(1.05); got != "met" {
		t.Fatalf("2%% slower against 5%%: %s", got)
	}
	if got := e.within(1.01); got != "missed" {
		t.Fatalf("2%% slower against 1%%: %s", got)
	}
	// Rounds that disagree widely settle nothing.
	noisy := []burstFigures{burstOf(12 * s), burstOf(8 * s), burstOf(11 * s), burstOf(9 * s)}
	e = pairRounds(base[:4], noisy, burstP50, .9)
	if got := e.within(1.05); got != "not settled" {
		t.Fatalf("noisy rounds: %+v, %s", e, got)
	}
	if last := pairRounds(base[:1], arm[:1], burstLast, .9); last.Median < 1.019 || last.Median > 1.021 {
		t.Fatalf("last pod: %+v", last)
	}
	if e := pairRounds(nil, arm, burstP50, .9); e.within(1.05) != "no rounds" {
		t.Fatalf("no rounds: %+v", e)
	}
}

// TestBurstStartCPU: the runtime's and the agent's CPU per pod of both
// halves, the pods' own CPU (the busy pods' spinning) left out.
func TestBurstStartCPU(t *testing.T) {
	b := burstFigures{startup: make([]time.Duration, 10), without: make([]time.Duration, 10),
		cpu: nodeCPU{runtime: 3 * time.Second, agent: time.Second, pods: time.Hour}}
	if got := burstStartCPU(b); got != 200*time.Millisecond {
		t.Fatalf("start-up CPU per pod %s, want 200ms", got)
	}
	if got := burstStartCPU(burstFigures{cpu: nodeCPU{runtime: time.Second}}); got != 0 {
		t.Fatalf("no pods: %s", got)
	}
	base := []burstFigures{{startup: make([]time.Duration, 2), cpu: nodeCPU{runtime: 400 * time.Millisecond}}}
	arm := []burstFigures{{startup: make([]time.Duration, 2), cpu: nodeCPU{runtime: 400 * time.Millisecond, agent: 20 * time.Millisecond}}}
	if e := pairRounds(base, arm, burstStartCPU, .9); e.Median < 1.049 || e.Median > 1.051 {
		t.Fatalf("the agent's CPU counts: %+v", e)
	}
}

// TestBurstControlCPU: the cluster's own processes' CPU per pod of both
// halves, apart from the node's.
func TestBurstControlCPU(t *testing.T) {
	b := burstFigures{startup: make([]time.Duration, 10), without: make([]time.Duration, 10),
		cpu: nodeCPU{runtime: time.Hour, control: 2 * time.Second}}
	if got := burstControlCPU(b); got != 100*time.Millisecond {
		t.Fatalf("control plane CPU per pod %s, want 100ms", got)
	}
	if got := burstControlCPU(burstFigures{cpu: nodeCPU{control: time.Second}}); got != 0 {
		t.Fatalf("no pods: %s", got)
	}
}

// TestNodeCPUArithmetic: every field takes part in a sum and a
// difference of readings.
func TestNodeCPUArithmetic(t *testing.T) {
	a := nodeCPU{node: 1, runtime: 2, agent: 3, pods: 4, containerd: 5, cni: 6, kubelet: 7, control: 8}
	if got := a.plus(a).minus(a); got != a {
		t.Errorf("a + a - a = %+v, want %+v", got, a)
	}
	if got := a.minus(a); got != (nodeCPU{}) {
		t.Errorf("a - a = %+v", got)
	}
}

// TestP50Ratio: the ratio of the p50s, with an interval from resampling
// rounds, so a drift shared by both series within a round does not widen
// it; a ratio that differs from round to round settles nothing.
func TestP50Ratio(t *testing.T) {
	ms := time.Millisecond
	var lo, hi, noisy []time.Duration
	for i := 0; i < 40; i++ {
		d := time.Duration(3+i%7) * ms
		lo = append(lo, d)
		hi = append(hi, d*104/100)
		noisy = append(noisy, d*time.Duration(80+i%9*10)/100)
	}
	e := p50Ratio(lo, hi, .9)
	if e.Median < 1.039 || e.Median > 1.041 || e.Low > e.Median || e.High < e.Median || len(e.Ratios) != 40 {
		t.Fatalf("4%% larger in every round: %+v", e)
	}
	if got := e.within(1.10); got != "met" {
		t.Fatalf("4%% larger against 10%%: %s (%+v)", got, e)
	}
	if got := e.within(1.02); got != "missed" {
		t.Fatalf("4%% larger against 2%%: %s", got)
	}
	if got := p50Ratio(lo, noisy, .9).within(1.10); got != "not settled" {
		t.Fatalf("rounds from 0.8x to 1.6x: %s (%+v)", got, p50Ratio(lo, noisy, .9))
	}
	// A series cut short (a failed round) is compared on the rounds both have.
	if e := p50Ratio(lo, hi[:10], .9); len(e.Ratios) != 10 {
		t.Fatalf("short series: %d rounds", len(e.Ratios))
	}
	if e := p50Ratio(nil, hi, .9); e.within(1.10) != "no rounds" {
		t.Fatalf("no rounds: %+v", e)
	}
}
