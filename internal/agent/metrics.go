package agent

import (
	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/collectors"

	"github.com/istio-cni-go/istio-cni/internal/cniserver"
	"github.com/istio-cni-go/istio-cni/internal/installloop"
	"github.com/istio-cni-go/istio-cni/internal/repair"
	"github.com/istio-cni-go/istio-cni/internal/sockserve"
)

// Metrics are every part's Prometheus metrics on one registry, served on
// the monitoring port.
type Metrics struct {
	Registry       *prometheus.Registry
	Install        *installloop.Metrics
	Repaired       *prometheus.CounterVec
	RepairLatency  prometheus.Histogram
	PluginCommands *prometheus.CounterVec
	PluginRequests *prometheus.CounterVec
	PluginLatency  *prometheus.HistogramVec
	PluginLookups  *prometheus.CounterVec
	PreparedAdds   *prometheus.CounterVec
	Panics         *prometheus.CounterVec
	Sockets        *sockserve.Metrics
}

// NewMetrics registers the metrics on a fresh registry.
func NewMetrics() *Metrics {
	m := &Metrics{Registry: prometheus.NewRegistry(), Install: installloop.NewMetrics()}
	m.Repaired = repair.NewMetric()
	m.RepairLatency = prometheus.NewHistogram(prometheus.HistogramOpts{Name: "istio_cni_repair_latency_seconds",
		Help:    "Time from a pod first seen broken to the repair controller's successful action.",
		Buckets: []float64{.005, .01, .025, .05, .1, .25, .5, 1, 2.5, 5}})
	m.PluginCommands, m.PluginLatency, m.PluginLookups = cniserver.NewMetrics()
	m.PluginRequests = cniserver.NewRequestsMetric()
	m.Panics = cniserver.NewPanicMetric()
	m.PreparedAdds = cniserver.NewPreparedMetric()
	m.Sockets = sockserve.NewMetrics()
	// The Go runtime and process collectors, as Istio's agent exposes
	// (go_*, process_*): memory, goroutines, open descriptors.
	m.Registry.MustRegister(collectors.NewGoCollector(), collectors.NewProcessCollector(collectors.ProcessCollectorOpts{}))
	m.Registry.MustRegister(m.Install.Collectors()...)
	m.Registry.MustRegister(m.Repaired, m.RepairLatency, m.PluginCommands, m.PluginRequests, m.PluginLatency, m.PluginLookups, m.PreparedAdds, m.Panics,
		m.Sockets.Rejected, m.Sockets.AcceptErrors)
	return m
}
