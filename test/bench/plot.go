package main

import (
	"fmt"
	"math"
	"os"
	"sort"
	"strings"
	"time"
)

// armColours keep an arm's colour the same in every panel.
var armColours = map[string]string{"without": "#4d4d4d", "plugin": "#1b9e77", "agent": "#d95f02"}

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
