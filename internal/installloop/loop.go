// Package installloop keeps the istio-cni plugin installed on the node:
// it runs the installer's passes (binaries, the plugin's kubeconfig, our
// entry in the node's CNI config) at start, again whenever a file event
// says something of ours may have changed, periodically besides, and
// backs off from another component that keeps reverting the CNI config.
// It reports readiness (everything in place) and liveness (the loop goes
// round, the config dir exists) and removes the plugin when asked.
//
// The file operations themselves are internal/install's; this package
// decides when to run them. It serves nothing and knows no sockets.
package installloop

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/fsnotify/fsnotify"
	"github.com/prometheus/client_golang/prometheus"

	"github.com/istio-cni-go/istio-cni/internal/install"
)

// Config is the install loop's part of the agent configuration.
type Config struct {
	Install install.Config
	// ConflictWindow and ConflictLimit: more rewrites than the limit within
	// the window means another component keeps reverting us.
	ConflictWindow time.Duration
	ConflictLimit  int
	// ResyncInterval is how often the whole installation is checked
	// besides the file watch (what the watch missed, the run dir).
	ResyncInterval time.Duration
}

// Metrics are the loop's; istio_cni_install_ready and
// istio_cni_installs_total carry Istio's names so existing dashboards and
// alerts keep working.
type Metrics struct {
	InstallReady  prometheus.Gauge
	Installs      *prometheus.CounterVec
	Reinsertions  prometheus.Counter
	Conflicts     prometheus.Counter
	ReinsertDelay prometheus.Histogram
	Resyncs       *prometheus.CounterVec
}

// NewMetrics returns unregistered metrics.
func NewMetrics() *Metrics {
	return &Metrics{
		InstallReady: prometheus.NewGauge(prometheus.GaugeOpts{Name: "istio_cni_install_ready",
			Help: "1 when the plugin binary, its kubeconfig and its CNI config entry are all in place."}),
		Installs: prometheus.NewCounterVec(prometheus.CounterOpts{Name: "istio_cni_installs_total",
			Help: "Install passes by result."}, []string{"result"}),
		Reinsertions: prometheus.NewCounter(prometheus.CounterOpts{Name: "istio_cni_config_reinsertions_total",
			Help: "Times the istio-cni entry was put back after another component rewrote the CNI config."}),
		Conflicts: prometheus.NewCounter(prometheus.CounterOpts{Name: "istio_cni_config_conflicts_total",
			Help: "Times the agent backed off because another component keeps reverting the CNI config."}),
		ReinsertDelay: prometheus.NewHistogram(prometheus.HistogramOpts{Name: "istio_cni_config_reinsert_seconds",
			Help:    "Time from seeing the CNI config change to our entry being back.",
			Buckets: []float64{.001, .0025, .005, .01, .025, .05, .1, .25, .5, 1}}),
		Resyncs: prometheus.NewCounterVec(prometheus.CounterOpts{Name: "istio_cni_config_resyncs_total",
			Help: "Full install passes not caused by a file event, by reason: periodic, overflow (the kernel dropped file events), watch (the file watcher failed and was made again)."},
			[]string{"reason"}),
	}
}

// Collectors are the metrics, to register.
func (m *Metrics) Collectors() []prometheus.Collector {
	return []prometheus.Collector{m.InstallReady, m.Installs, m.Reinsertions, m.Conflicts, m.ReinsertDelay, m.Resyncs}
}

// Loop keeps the plugin installed while Run runs.
type Loop struct {
	cfg     Config
	log     *slog.Logger
	in      *install.Installer
	metrics *Metrics

	mu       sync.Mutex
	notReady string
	// conf is the config file holding our entry, as the last pass that
	// got that far placed it.
	conf string
	// source is the primary the Istio-owned copy at conf was made from.
	source string
	watch  *watchSet
	// beat is when the loop last went round (unix nanoseconds).
	beat atomic.Int64

	// rewrites and backoff belong to Run's goroutine.
	rewrites []time.Time
	backoff  time.Duration
	// placed, when set, is handed the CNI config file holding our entry
	// after each pass that placed it or found it placed the first time.
	placed func(conf []byte)
	// leave, when set, says another agent now keeps the node's files.
	leave func() bool
}

// LeaveWhen has the loop stop writing once fn says another agent keeps
// the node's files (a newer one, in an update with maxSurge): two agents
// would rewrite each other's kubeconfig, each with its own pod's token,
// and the stopping one's would be left dead on the node. Before Run.
func (l *Loop) LeaveWhen(fn func() bool) { l.leave = fn }

// OnPlaced has fn handed the content of the primary's config file each
// time a pass puts our entry in it, and once at the start when it finds
// it there, in chained mode; before Run.
func (l *Loop) OnPlaced(fn func(conf []byte)) {
	if l.cfg.Install.Chained {
		l.placed = fn
	}
}

// New returns a loop that is not ready until its first pass; it touches
// no file until Run.
func New(cfg Config, log *slog.Logger, m *Metrics) *Loop {
	return &Loop{cfg: cfg, log: log, in: install.New(cfg.Install, log), metrics: m, notReady: "starting"}
}

// NotReady is "" when the plugin's files are all in place, else why not.
func (l *Loop) NotReady() string {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.notReady
}

// Stuck says, once the loop has not gone round for grace, that it has
// not ("" otherwise).
func (l *Loop) Stuck(grace time.Duration) string {
	if b := l.beat.Load(); b != 0 {
		if d := time.Since(time.Unix(0, b)); d > grace {
			return fmt.Sprintf("the install loop has not gone round for %s", d.Round(time.Second))
		}
	}
	return ""
}

// ConfDirGone says, once the CNI config dir has been missing for grace,
// since when ("" otherwise): a restart mounts it again.
func (l *Loop) ConfDirGone(grace time.Duration) string {
	l.mu.Lock()
	ws := l.watch
	l.mu.Unlock()
	dir := l.cfg.Install.MountedCNINetDir
	if ws != nil {
		if since := ws.missingSince(dir); !since.IsZero() && time.Since(since) > grace {
			return fmt.Sprintf("the CNI config dir %s has been gone since %s (a restart mounts it again)",
				dir, since.UTC().Format(time.RFC3339))
		}
	}
	return ""
}

func (l *Loop) setReady(reason string) {
	l.mu.Lock()
	changed := l.notReady != reason
	l.notReady = reason
	conf := l.conf
	l.mu.Unlock()
	if reason == "" {
		l.metrics.InstallReady.Set(1)
		if changed {
			l.log.Info("ready: plugin binary, kubeconfig and CNI config entry in place", "config", conf)
		}
		return
	}
	l.metrics.InstallReady.Set(0)
	if changed {
		l.log.Warn("not ready", "reason", reason)
	}
}

// Run installs and keeps the installation in place until ctx ends; it
// then reports "shutting down" and returns once its file watcher is
// closed. It does not remove anything: that is Cleanup's.
func (l *Loop) Run(ctx context.Context) error {
	l.beat.Store(time.Now().UnixNano())
	l.setReady("starting")
	c := l.cfg.Install
	// The run dir for the kubeconfig: another agent stopping on the node
	// (Istio's, whose kubeconfig has the same name) removes it, and the
	// fallback must not go without credentials until the next resync.
	ws, err := newWatchSet(append([]string{c.MountedCNINetDir, c.Kubeconfig.ServiceAccountDir, filepath.Dir(l.in.KubeconfigPath())}, c.BinTargetDirs...), l.log)
	if err != nil {
		return fmt.Errorf("creating file watcher: %w", err)
	}
	l.mu.Lock()
	l.watch = ws
	l.mu.Unlock()
	defer ws.close()
	err = l.loop(ctx, ws)
	l.setReady("shutting down")
	return err
}

func (l *Loop) loop(ctx context.Context, ws *watchSet) error {
	first, untold := true, false
	var changedAt time.Time
	again := false
	resync := time.NewTicker(l.cfg.ResyncInterval)
	defer resync.Stop()
	for {
		l.beat.Store(time.Now().UnixNano())
		if l.leaving() {
			return l.stayAway(ctx, resync)
		}
		ws.sync()
		wrote, err := l.installOnce()
		if errors.Is(err, errLeft) {
			return l.stayAway(ctx, resync)
		}
		conf := l.confPath()
		l.log.Debug("install pass", "wrote", wrote, "error", err)
		// A primary config that is a link into another directory is
		// watched there too.
		// In Istio-owned mode that is the primary the copy follows.
		f := l.in.ConfFile(conf)
		if src := l.sourcePath(); src != "" {
			f = src
		}
		if f != "" {
			ws.follow(filepath.Dir(f))
		}
		firstPass := first
		// The entry as placed has not been handed to l.placed yet.
		untold = untold || firstPass || wrote
		var hold <-chan time.Time
		if wrote && !first {
			l.metrics.Reinsertions.Inc()
			if !changedAt.IsZero() {
				l.metrics.ReinsertDelay.Observe(time.Since(changedAt).Seconds())
			}
			// An Istio-owned copy following its primary's rewrites
			// reverts nobody's file: no back-off.
			if d := l.noteRewrite(time.Now(), changedAt); d > 0 && !l.cfg.Install.IstioOwned {
				l.metrics.Conflicts.Inc()
				hint := ""
				if strings.Contains(strings.ToLower(conf), "cilium") {
					hint = "; Cilium was detected: set cni.exclusive=false in its configuration"
				}
				l.log.Warn("another component keeps rewriting the CNI config; backing off"+hint,
					"file", conf, "backoff", d.String())
				hold = time.After(d)
			}
		}
		if err == nil {
			first = false
		}
		switch {
		case errors.Is(err, install.ErrNoPrimary):
			l.setReady("waiting for the primary CNI plugin to write its config in " + l.cfg.Install.MountedCNINetDir)
		case err != nil:
			l.setReady(err.Error())
			var se *install.StepError
			if errors.As(err, &se) {
				l.metrics.Installs.WithLabelValues(se.Result).Inc()
			}
		default:
			// As Istio counts: every pass that put the plugin in place,
			// the first, each re-insertion and each recovery.
			if firstPass || wrote || l.NotReady() != "" {
				l.metrics.Installs.WithLabelValues(install.ResultSuccess).Inc()
			}
			if r := l.in.Ready(conf); r != nil {
				l.setReady(r.Error())
				// Rewritten right after our write: its event may have come
				// in with our own, which are ignored. Go again at once (a
				// component that keeps at it is met with back-off).
				again = wrote
			} else {
				l.setReady("")
				if l.placed != nil && untold {
					if data, err := os.ReadFile(l.in.ConfFile(conf)); err == nil {
						l.placed(data)
						untold = false
					}
				}
			}
		}
		// Wait for a change that matters, a failed pass's retry or the
		// periodic resync; anything else is ignored so our own writes do
		// not wake us in a loop. While backing off from a component that
		// keeps reverting us, changes wait for the back-off to end.
		changedAt = time.Time{}
		var retry <-chan time.Time
		if err != nil && !errors.Is(err, install.ErrNoPrimary) {
			retry = time.After(5 * time.Second)
		}
		pending := again
		again = false
		for !pending || hold != nil {
			select {
			case <-ctx.Done():
				return nil
			case <-hold:
				hold = nil
			case <-retry:
				pending = true
			case <-resync.C:
				l.beat.Store(time.Now().UnixNano())
				l.metrics.Resyncs.WithLabelValues("periodic").Inc()
				pending = true
			case ev, ok := <-ws.events():
				switch {
				case !ok:
					l.log.Warn("the file watcher stopped; making a new one and resyncing")
					l.metrics.Resyncs.WithLabelValues("watch").Inc()
					ws.reset()
					pending = true
				case l.wakes(ws, ev):
					l.log.Debug("file event", "file", ev.Name, "op", ev.Op.String())
					if changedAt.IsZero() {
						changedAt = time.Now()
					}
					pending = true
					if hold != nil {
						// The entry is put back only when the back-off
						// ends; until then readiness and
						// istio_cni_install_ready say whether it is there
						// (Istio's agent turns not ready at every event).
						l.recheck(conf)
					}
				}
			case err, ok := <-ws.errors():
				switch {
				case ok && errors.Is(err, fsnotify.ErrEventOverflow):
					// The kernel dropped events: whatever they said, a full
					// pass finds it.
					l.log.Warn("the inotify queue overflowed and file events were lost; resyncing everything")
					l.metrics.Resyncs.WithLabelValues("overflow").Inc()
				default:
					msg := "the file watcher stopped"
					if ok {
						msg = err.Error()
					}
					l.log.Warn("file watcher failed; making a new one and resyncing", "error", msg)
					l.metrics.Resyncs.WithLabelValues("watch").Inc()
					ws.reset()
				}
				pending = true
			}
		}
	}
}

func (l *Loop) sourcePath() string {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.source
}

func (l *Loop) confPath() string {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.conf
}

// wakes says whether a file event calls for a pass: one of our
// directories itself went or came back, a file of ours changed, or a
// config file changed beside a linked primary config.
func (l *Loop) wakes(ws *watchSet, ev fsnotify.Event) bool {
	return ws.concerns(ev) || l.relevant(ev) || (ws.isExtra(filepath.Dir(ev.Name)) && isConfName(filepath.Base(ev.Name)))
}

// relevant says whether an event in one of our directories is about a
// file we install or read. Our own temp files and mode changes are not:
// every write of ours makes them, and they must not wake us in a loop.
func (l *Loop) relevant(ev fsnotify.Event) bool {
	base := filepath.Base(ev.Name)
	if strings.Contains(base, ".istio-cni-tmp-") {
		return false
	}
	if filepath.Clean(ev.Name) == l.in.KubeconfigPath() {
		// Its mode is checked as well as its content.
		return true
	}
	if ev.Op == fsnotify.Chmod {
		return false
	}
	dir := filepath.Dir(ev.Name)
	switch {
	case dir == filepath.Clean(l.cfg.Install.MountedCNINetDir):
		return isConfName(base)
	case dir == filepath.Clean(l.cfg.Install.Kubeconfig.ServiceAccountDir):
		return true
	default:
		return base == install.PluginType || base == install.FallbackBinary
	}
}

func isConfName(base string) bool {
	return !strings.Contains(base, ".istio-cni-tmp-") &&
		(strings.HasSuffix(base, ".conf") || strings.HasSuffix(base, ".conflist") || strings.HasSuffix(base, ".json"))
}

// WriteKubeconfig writes the plugin kubeconfig now, ahead of the first
// pass (which writes it again only if it changed), and reports whether
// it wrote.
func (l *Loop) WriteKubeconfig() (bool, error) { return l.in.WriteKubeconfig() }

// errLeft ends a pass that found another agent keeping the node's files.
var errLeft = errors.New("another agent keeps the node's files")

func (l *Loop) leaving() bool { return l.leave != nil && l.leave() }

// stayAway writes nothing more until ctx ends, and beats: a restart by
// the liveness probe would have this agent take the socket back from the
// newer one.
func (l *Loop) stayAway(ctx context.Context, resync *time.Ticker) error {
	l.log.Info("another agent keeps this node's plugin files now; this one no longer writes them")
	for {
		select {
		case <-ctx.Done():
			return nil
		case <-resync.C:
			l.beat.Store(time.Now().UnixNano())
		}
	}
}

// installOnce runs every install step and reports whether the CNI config
// was written. Before each write it looks again whether another agent
// took the node over since the pass began.
func (l *Loop) installOnce() (bool, error) {
	if l.leaving() {
		return false, errLeft
	}
	if err := l.in.InstallBinaries(); err != nil {
		return false, err
	}
	if l.leaving() {
		return false, errLeft
	}
	if changed, err := l.in.WriteKubeconfig(); err != nil {
		return false, err
	} else if changed {
		l.log.Info("wrote the plugin kubeconfig", "path", l.in.KubeconfigPath())
	}
	if l.leaving() {
		return false, errLeft
	}
	placed, err := l.in.EnsureConf()
	if placed.Path != "" {
		l.mu.Lock()
		l.conf = placed.Path
		l.source = placed.Source
		l.mu.Unlock()
	}
	return placed.Wrote, err
}

// recheck turns not ready when the config, as it is now, lacks our
// entry, while backing off from a component that keeps reverting it.
// Ready again waits for the pass after the back-off.
func (l *Loop) recheck(conf string) {
	if r := l.in.Ready(conf); r != nil {
		l.setReady("backing off from another component that keeps rewriting the CNI config: " + r.Error())
	}
}

// noteRewrite records a re-insertion at now, of a config reverted at
// changedAt (zero when no file event said), and returns how long to back
// off when the rewrites come faster than the conflict limit allows.
func (l *Loop) noteRewrite(now, changedAt time.Time) time.Duration {
	n := len(l.rewrites)
	quick := l.cfg.ConflictWindow / time.Duration(max(l.cfg.ConflictLimit, 1))
	if l.backoff > 0 && n > 0 && !changedAt.IsZero() && changedAt.Sub(l.rewrites[n-1]) < quick &&
		now.Sub(l.rewrites[n-1]) <= l.backoff+l.cfg.ConflictWindow {
		// Reverted as quickly as before (faster than the limit's rate),
		// right after the back-off's end: counting rewrites within the
		// window alone would miss the ones the back-off spaced out, and
		// start over with a burst of immediate rewrites. A component that
		// only reverts now and then is no conflict, whatever came before.
		l.rewrites = append(l.rewrites[:0], now)
		l.backoff = min(2*l.backoff, 30*time.Second)
		return l.backoff
	}
	keep := l.rewrites[:0]
	for _, t := range l.rewrites {
		if now.Sub(t) < l.cfg.ConflictWindow {
			keep = append(keep, t)
		}
	}
	keep = append(keep, now)
	l.rewrites = keep
	if len(l.rewrites) <= l.cfg.ConflictLimit {
		l.backoff = 0
		return 0
	}
	if l.backoff == 0 {
		l.backoff = time.Second
	} else {
		l.backoff = min(2*l.backoff, 30*time.Second)
	}
	return l.backoff
}

// Cleanup removes the plugin from the node (our entry, the kubeconfig,
// the binaries), logging what it did or what it left.
func (l *Loop) Cleanup() error {
	if err := l.in.Cleanup(); err != nil {
		var ce *install.CleanupError
		if errors.As(err, &ce) {
			l.log.Error("clean-up stopped at the first failed step; what the node needs to start pods is left in place",
				"error", ce.Err.Error(), "left", strings.Join(ce.Left, ", "))
		} else {
			l.log.Error("clean-up failed", "error", err.Error())
		}
		return fmt.Errorf("clean-up: %w", err)
	}
	l.log.Info("removed the plugin: CNI config entry, kubeconfig and binary")
	return nil
}
