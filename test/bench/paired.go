package main

import (
	"math/rand/v2"
	"slices"
	"time"
)

// pairedEstimate is how much slower an arm's bursts are than the
// baseline's, from rounds that ran both: the median of the rounds'
// ratios, and a bootstrap interval around it.
type pairedEstimate struct {
	// Ratios are arm/baseline per round, in round order.
	Ratios []float64
	// Median of Ratios; Low and High bound it at the confidence asked.
	Median, Low, High float64
}

// pairRounds compares each round's statistic of arm with the same round's
// of base (the arms ran back to back in that round), so the machine's
// drift from round to round cancels in each ratio.
func pairRounds(base, arm []burstFigures, stat func(burstFigures) time.Duration, confidence float64) pairedEstimate {
	var ratios []float64
	for i := 0; i < min(len(base), len(arm)); i++ {
		if b := stat(base[i]); b > 0 {
			ratios = append(ratios, float64(stat(arm[i]))/float64(b))
		}
	}
	return medianInterval(ratios, confidence)
}

// medianInterval is the median of per-round ratios and a bootstrap
// interval around it at confidence.
func medianInterval(ratios []float64, confidence float64) pairedEstimate {
	e := pairedEstimate{Ratios: ratios}
	if len(ratios) == 0 {
		return e
	}
	e.Median = median(ratios)
	// The median of resampled rounds, many times over; a fixed seed, so
	// the same rounds always print the same interval.
	r := rand.New(rand.NewPCG(1, 2))
	const draws = 4000
	meds := make([]float64, draws)
	sample := make([]float64, len(ratios))
	for d := range meds {
		for i := range sample {
			sample[i] = ratios[r.IntN(len(ratios))]
		}
		meds[d] = median(sample)
	}
	e.Low, e.High = bounds(meds, confidence)
	return e
}

// bounds are the two-sided interval at confidence of bootstrap draws,
// which it sorts.
func bounds(draws []float64, confidence float64) (low, high float64) {
	slices.Sort(draws)
	tail := (1 - confidence) / 2
	return draws[int(tail*float64(len(draws)))], draws[min(len(draws)-1, int((1-tail)*float64(len(draws))))]
}

// p50Ratio is how much larger hi's p50 is than lo's, for the flatness
// targets: the ratio of the two p50s and a bootstrap interval around it.
// The i-th samples of lo and hi were measured in the same round, back to
// back, so rounds are what is resampled: a round's drift moves both.
// Ratios holds each round's own ratio, for the record.
func p50Ratio(lo, hi []time.Duration, confidence float64) pairedEstimate {
	var e pairedEstimate
	n := min(len(lo), len(hi))
	if n == 0 || pct(lo[:n], .5) <= 0 {
		return e
	}
	for i := 0; i < n; i++ {
		e.Ratios = append(e.Ratios, ratioOf(hi[i], lo[i]))
	}
	e.Median = ratioOf(pct(hi[:n], .5), pct(lo[:n], .5))
	r := rand.New(rand.NewPCG(1, 2))
	const draws = 4000
	ratios := make([]float64, draws)
	slo, shi := make([]time.Duration, n), make([]time.Duration, n)
	for d := range ratios {
		for i := range slo {
			j := r.IntN(n)
			slo[i], shi[i] = lo[j], hi[j]
		}
		ratios[d] = ratioOf(pct(shi, .5), pct(slo, .5))
	}
	e.Low, e.High = bounds(ratios, confidence)
	return e
}

func median(xs []float64) float64 {
	s := slices.Clone(xs)
	slices.Sort(s)
	n := len(s)
	if n%2 == 1 {
		return s[n/2]
	}
	return (s[n/2-1] + s[n/2]) / 2
}

// burstP50 and burstLast are a burst's median pod and its last pod.
func burstP50(b burstFigures) time.Duration { return pct(b.startup, .5) }

func burstLast(b burstFigures) time.Duration {
	if len(b.startup) == 0 {
		return 0
	}
	return b.startup[len(b.startup)-1]
}

// burstStartCPU is the CPU a burst's start cost the node per pod: the
// runtime's cgroup (containerd, the kubelet, the CNI plugins, the shims)
// and the agent's pod. The pods' own cgroups are left out: the busy pods
// spin in them and take whatever CPU the start leaves.
func burstStartCPU(b burstFigures) time.Duration { return b.perPod(b.cpu.runtime + b.cpu.agent) }

// burstControlCPU is the CPU per pod the cluster's own processes spent
// over a burst: what the node's watches and requests cost them.
func burstControlCPU(b burstFigures) time.Duration { return b.perPod(b.cpu.control) }

// burstTarget is issue #15's bound on a burst with the plugin against
// one without: within 5%.
const burstTarget = 1.05

// burstTargetPercent is burstTarget as the change the reports and the
// plot print: 5 (%).
const burstTargetPercent = 100 * (burstTarget - 1)

// within says what the interval shows of a target ratio: met when all of
// it is below, missed when all of it is above, else not settled by these
// rounds.
func (e pairedEstimate) within(target float64) string {
	switch {
	case len(e.Ratios) == 0:
		return "no rounds"
	case e.High <= target:
		return "met"
	case e.Low > target:
		return "missed"
	}
	return "not settled"
}
