package ambient

import (
	"errors"
	"fmt"

	"github.com/prometheus/client_golang/prometheus"
)

type metrics struct {
	// events is the reference's reconcile counter, by informer event type.
	events   *prometheus.CounterVec
	enrols   *prometheus.CounterVec
	duration *prometheus.HistogramVec
	verify   *prometheus.CounterVec
	host     *prometheus.CounterVec
}

func newMetrics(reg prometheus.Registerer, c *Controller) (metrics, error) {
	m := metrics{
		events: prometheus.NewCounterVec(prometheus.CounterOpts{Name: "nodeagent_reconcile_events_total",
			Help: "The total number of node agent reconcile events (pod and namespace add, update, delete)."}, []string{"type"}),
		enrols: prometheus.NewCounterVec(prometheus.CounterOpts{Name: "istio_cni_ambient_enrolments_total",
			Help: "Attempts to enrol a pod in the ambient mesh, by source (cni: a pod's ADD; controller: a running pod) and " +
				"result (enabled; pending: ztunnel not connected or refused; failed: rules, namespace or annotation)."},
			[]string{"source", "result"}),
		duration: prometheus.NewHistogramVec(prometheus.HistogramOpts{Name: "istio_cni_ambient_enrol_duration_seconds",
			Help:    "Time to enrol a pod, from the request to ztunnel's acknowledgement and the annotation, by source (cni, controller).",
			Buckets: []float64{.005, .01, .025, .05, .1, .25, .5, 1, 2.5, 5, 10, 30}}, []string{"source"}),
		verify: prometheus.NewCounterVec(prometheus.CounterOpts{Name: "istio_cni_ambient_verify_total",
			Help: "Periodic checks of enrolled pods, by result (ok; repaired: rules were missing or changed and were put back; " +
				"failed: could not be put back; unreachable: no network namespace found; pending: ztunnel has not acknowledged)."},
			[]string{"result"}),
		host: prometheus.NewCounterVec(prometheus.CounterOpts{Name: "istio_cni_ambient_host_reasserted_total",
			Help: "Times the node's probe SNAT rules (rules) or probe set entries (probes) were found missing or wrong and put back."},
			[]string{"what"}),
	}
	if reg == nil {
		return m, nil
	}
	var err error
	if m.events, err = register(reg, m.events); err != nil {
		return m, err
	}
	if m.enrols, err = register(reg, m.enrols); err != nil {
		return m, err
	}
	if m.duration, err = register(reg, m.duration); err != nil {
		return m, err
	}
	if m.verify, err = register(reg, m.verify); err != nil {
		return m, err
	}
	if m.host, err = register(reg, m.host); err != nil {
		return m, err
	}
	if err := reg.Register(podsCollector{c}); err != nil {
		return m, fmt.Errorf("registering istio_cni_ambient_pods: %w", err)
	}
	return m, nil
}

// register registers col, or takes the collector a previous controller
// of the same process registered, so that a restarted one keeps counting.
func register[C prometheus.Collector](reg prometheus.Registerer, col C) (C, error) {
	err := reg.Register(col)
	var are prometheus.AlreadyRegisteredError
	if errors.As(err, &are) {
		if existing, ok := are.ExistingCollector.(C); ok {
			return existing, nil
		}
	}
	return col, err
}

var podsDesc = prometheus.NewDesc("istio_cni_ambient_pods",
	"Pods of this node the agent holds as enrolled, by state (enabled: acknowledged by ztunnel; pending: not yet; "+
		"unreachable: enrolled before a restart and no network namespace found for it yet).",
	[]string{"state"}, nil)

// podsCollector counts the controller's pods at scrape time, so the
// figure cannot drift from the state it describes.
type podsCollector struct{ c *Controller }

func (p podsCollector) Describe(ch chan<- *prometheus.Desc) { ch <- podsDesc }

func (p podsCollector) Collect(ch chan<- prometheus.Metric) {
	counts := p.c.counts()
	for _, s := range []string{"enabled", "pending", "unreachable"} {
		ch <- prometheus.MustNewConstMetric(podsDesc, prometheus.GaugeValue, float64(counts[s]), s)
	}
}
