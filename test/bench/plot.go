package main

import (
	"fmt"
	"html"
	"math"
	"os"
	"path/filepath"
	"sort"
	"strings"
	"time"
)

// armColours keep an arm's colour the same in every panel.
var armColours = map[string]string{"without": "#4d4d4d", "plugin": "#1b9e77", "agent": "#d95f02", "chart-only": "#7570b3"}

// writeClusterSVG draws the cluster series as one panel per node size:
// for each arm, the share of the burst Ready (x) against the time since
// creation (y), every round's pods pooled, so the p50 is the curve at 50%
// and the last pod its right end.
func writeClusterSVG(path string, cfg clusterConfig, r *clusterResult) error {
	const (
		panelW, panelH = 360, 260
		left, top      = 55, 40
		gap            = 40
	)
	width := left + len(r.sizes)*(panelW+gap)
	height := top + panelH + 70
	var ymax time.Duration
	for _, size := range r.sizes {
		for _, a := range r.arms {
			all, _, _ := burstStats(r.bursts[size][a.name])
			if n := len(all); n > 0 && all[n-1] > ymax {
				ymax = all[n-1]
			}
		}
	}
	ystep := niceStep(ymax.Seconds() / 5)
	ytop := math.Ceil(ymax.Seconds()/ystep) * ystep
	var b strings.Builder
	fmt.Fprintf(&b, `<svg xmlns="http://www.w3.org/2000/svg" width="%d" height="%d" font-family="sans-serif" font-size="12">`+"\n", width, height)
	fmt.Fprintf(&b, `<rect width="%d" height="%d" fill="white"/>`+"\n", width, height)
	fmt.Fprintf(&b, `<text x="%d" y="18" font-size="14">%d sidecar pods created at once: time to Ready, by share of the burst Ready (%d rounds pooled)</text>`+"\n",
		left, cfg.pods, r.roundsDone(cfg.rounds))
	for i, size := range r.sizes {
		x0 := left + i*(panelW+gap)
		y0 := top
		fmt.Fprintf(&b, `<text x="%d" y="%d">%d pods on the node</text>`+"\n", x0, y0-6, size)
		fmt.Fprintf(&b, `<rect x="%d" y="%d" width="%d" height="%d" fill="none" stroke="#999"/>`+"\n", x0, y0, panelW, panelH)
		for v := 0.0; v <= ytop+1e-9; v += ystep {
			y := float64(y0+panelH) - v/ytop*panelH
			fmt.Fprintf(&b, `<line x1="%d" x2="%d" y1="%.1f" y2="%.1f" stroke="#eee"/>`+"\n", x0, x0+panelW, y, y)
			fmt.Fprintf(&b, `<text x="%d" y="%.1f" text-anchor="end">%gs</text>`+"\n", x0-4, y+4, v)
		}
		for _, p := range []int{0, 50, 100} {
			x := float64(x0) + float64(p)/100*panelW
			fmt.Fprintf(&b, `<text x="%.1f" y="%d" text-anchor="middle">%d%%</text>`+"\n", x, y0+panelH+16, p)
		}
		fmt.Fprintf(&b, `<line x1="%.1f" x2="%.1f" y1="%d" y2="%d" stroke="#bbb" stroke-dasharray="4 3"/>`+"\n",
			float64(x0)+panelW/2, float64(x0)+panelW/2, y0, y0+panelH)
		for _, a := range r.arms {
			all, _, _ := burstStats(r.bursts[size][a.name])
			if len(all) == 0 {
				continue
			}
			sort.Slice(all, func(i, j int) bool { return all[i] < all[j] })
			var pts []string
			for k, d := range all {
				x := float64(x0) + float64(k+1)/float64(len(all))*panelW
				y := float64(y0+panelH) - d.Seconds()/ytop*panelH
				pts = append(pts, fmt.Sprintf("%.1f,%.1f", x, y))
			}
			fmt.Fprintf(&b, `<polyline fill="none" stroke="%s" stroke-width="2" points="%s"/>`+"\n", armColours[a.name], strings.Join(pts, " "))
		}
	}
	ly := top + panelH + 40
	for i, a := range r.arms {
		x := left + i*230
		fmt.Fprintf(&b, `<line x1="%d" x2="%d" y1="%d" y2="%d" stroke="%s" stroke-width="3"/>`+"\n", x, x+24, ly, ly, armColours[a.name])
		fmt.Fprintf(&b, `<text x="%d" y="%d">%s</text>`+"\n", x+30, ly+4, armLegend(a))
	}
	b.WriteString("</svg>\n")
	return os.WriteFile(path, []byte(b.String()), 0o644)
}

// writeSVG draws what report prints: for each node size and
// arm, each statistic's round-by-round change against base, its median
// and 90% interval, beside the 5% target, so the verdicts read at a
// glance and the node sizes side by side.
func (pl *pool) writeSVG(path string) error {
	const (
		labelW, plotW, numW = 270, 420, 230
		top, groupH, rowH   = 56, 26, 20
	)
	width := labelW + plotW + numW
	lo, hi := -burstTargetPercent, burstTargetPercent
	type row struct {
		name string
		e    pairedEstimate
	}
	rows := make([][]row, len(pl.keys))
	height := top + 40
	for i, k := range pl.keys {
		for j, st := range loggedStatistics {
			e := pl.arms[k].estimates[j]
			if len(e.Ratios) == 0 {
				continue
			}
			rows[i] = append(rows[i], row{st.name, e})
			lo, hi = min(lo, 100*(e.Low-1)), max(hi, 100*(e.High-1))
		}
		height += groupH + len(rows[i])*rowH
	}
	step := niceStep((hi - lo) / 6)
	lo, hi = math.Floor(lo/step)*step, math.Ceil(hi/step)*step
	xOf := func(pc float64) float64 { return labelW + (pc-lo)/(hi-lo)*plotW }
	var b strings.Builder
	fmt.Fprintf(&b, `<svg xmlns="http://www.w3.org/2000/svg" width="%d" height="%d" font-family="sans-serif" font-size="12">`+"\n", width, height)
	fmt.Fprintf(&b, `<rect width="%d" height="%d" fill="white"/>`+"\n", width, height)
	fmt.Fprintf(&b, `<text x="10" y="18" font-size="14">Each burst against the same round's burst %s: median change and 90%% interval over the rounds</text>`+"\n", armLegend(clusterArms[pl.base]))
	names := make([]string, len(pl.paths))
	for i, p := range pl.paths {
		names[i] = filepath.Base(p)
	}
	fmt.Fprintf(&b, `<text x="10" y="36" fill="#555">pooled from %s</text>`+"\n", html.EscapeString(strings.Join(names, ", ")))
	bottom := height - 30
	for v := lo; v <= hi+1e-9; v += step {
		x := xOf(v)
		stroke := "#eee"
		if math.Abs(v) < 1e-9 {
			stroke = "#888"
		}
		fmt.Fprintf(&b, `<line x1="%.1f" x2="%.1f" y1="%d" y2="%d" stroke="%s"/>`+"\n", x, x, top, bottom, stroke)
		fmt.Fprintf(&b, `<text x="%.1f" y="%d" text-anchor="middle">%+g%%</text>`+"\n", x, bottom+16, v)
	}
	fmt.Fprintf(&b, `<line x1="%.1f" x2="%.1f" y1="%d" y2="%d" stroke="#d62728" stroke-dasharray="5 3"/>`+"\n", xOf(burstTargetPercent), xOf(burstTargetPercent), top, bottom)
	fmt.Fprintf(&b, `<text x="%.1f" y="%d" fill="#d62728">target: within %g%%</text>`+"\n", xOf(burstTargetPercent)+4, top-4, burstTargetPercent)
	y := top
	for i, k := range pl.keys {
		p := pl.arms[k]
		colour := armColours[k.arm]
		if colour == "" {
			colour = "#000"
		}
		y += groupH
		runs := "runs"
		if p.logs == 1 {
			runs = "run"
		}
		fmt.Fprintf(&b, `<text x="10" y="%d" font-weight="bold">%d pods on the node: %s, %d rounds from %d %s</text>`+"\n",
			y-8, k.pods, html.EscapeString(armLegend(clusterArms[k.arm])), p.rounds, p.logs, runs)
		for _, r := range rows[i] {
			cy := float64(y) + rowH/2
			fmt.Fprintf(&b, `<text x="20" y="%.1f">%s</text>`+"\n", cy+4, html.EscapeString(r.name))
			fmt.Fprintf(&b, `<line x1="%.1f" x2="%.1f" y1="%.1f" y2="%.1f" stroke="%s" stroke-width="3"/>`+"\n",
				xOf(100*(r.e.Low-1)), xOf(100*(r.e.High-1)), cy, cy, colour)
			fmt.Fprintf(&b, `<circle cx="%.1f" cy="%.1f" r="4" fill="%s"/>`+"\n", xOf(100*(r.e.Median-1)), cy, colour)
			fmt.Fprintf(&b, `<text x="%d" y="%.1f">%+.1f%% [%+.1f%%, %+.1f%%] %s</text>`+"\n", labelW+plotW+10, cy+4,
				100*(r.e.Median-1), 100*(r.e.Low-1), 100*(r.e.High-1), r.e.within(burstTarget))
			y += rowH
		}
	}
	b.WriteString("</svg>\n")
	return os.WriteFile(path, []byte(b.String()), 0o644)
}

func armLegend(a clusterArm) string {
	switch a.name {
	case "without":
		return "without istio-cni"
	case "plugin":
		return "istio-cni, the relay commits (default)"
	case "agent":
		return "istio-cni, the agent commits"
	case "mixed":
		return "istio-cni, half of a mixed burst"
	case "mixed-none":
		return "half of a mixed burst, neither with istio-cni"
	case "without-again":
		return "without istio-cni, a second arm"
	case "chart-only":
		return "the chart installed, the pods not through it"
	}
	return a.name
}

// niceStep rounds a step up to 1, 2 or 5 times a power of ten.
func niceStep(raw float64) float64 {
	if raw <= 0 {
		return 1
	}
	p := math.Pow(10, math.Floor(math.Log10(raw)))
	for _, m := range []float64{1, 2, 5, 10} {
		if m*p >= raw {
			return m * p
		}
	}
	return 10 * p
}
