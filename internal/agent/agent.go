package agent

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/fsnotify/fsnotify"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/collectors"
	"github.com/prometheus/client_golang/prometheus/promhttp"
	"k8s.io/client-go/kubernetes"

	"github.com/istio-cni-go/istio-cni/internal/cnirelay"
	"github.com/istio-cni-go/istio-cni/internal/install"
	"github.com/istio-cni-go/istio-cni/internal/iptables"
	"github.com/istio-cni-go/istio-cni/internal/logging"
	"github.com/istio-cni-go/istio-cni/internal/nftables"
	"github.com/istio-cni-go/istio-cni/internal/nslock"
	"github.com/istio-cni-go/istio-cni/internal/plugin"
	"github.com/istio-cni-go/istio-cni/internal/repair"
)

// Metrics are the agent's Prometheus metrics; the first two carry Istio's
// names so existing dashboards and alerts keep working.
type Metrics struct {
	Registry       *prometheus.Registry
	InstallReady   prometheus.Gauge
	Installs       *prometheus.CounterVec
	Reinsertions   prometheus.Counter
	Conflicts      prometheus.Counter
	ReinsertDelay  prometheus.Histogram
	Repaired       *prometheus.CounterVec
	RepairLatency  prometheus.Histogram
	PluginCommands *prometheus.CounterVec
	PluginLatency  *prometheus.HistogramVec
	PluginLookups  *prometheus.CounterVec
	Panics         *prometheus.CounterVec
	Resyncs        *prometheus.CounterVec
	Sockets        *SocketMetrics
}

// NewMetrics registers the metrics on a fresh registry.
func NewMetrics() *Metrics {
	m := &Metrics{
		Registry: prometheus.NewRegistry(),
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
	}
	m.Repaired = repair.NewMetric()
	m.RepairLatency = prometheus.NewHistogram(prometheus.HistogramOpts{Name: "istio_cni_repair_latency_seconds",
		Help:    "Time from a pod first seen broken to the repair controller's successful action.",
		Buckets: []float64{.005, .01, .025, .05, .1, .25, .5, 1, 2.5, 5}})
	m.PluginCommands, m.PluginLatency, m.PluginLookups = NewCNIMetrics()
	m.Panics = NewPanicMetric()
	m.Resyncs = prometheus.NewCounterVec(prometheus.CounterOpts{Name: "istio_cni_config_resyncs_total",
		Help: "Full install passes not caused by a file event, by reason: periodic, overflow (the kernel dropped file events), watch (the file watcher failed and was made again)."},
		[]string{"reason"})
	m.Sockets = NewSocketMetrics()
	// The Go runtime and process collectors, as Istio's agent exposes
	// (go_*, process_*): memory, goroutines, open descriptors.
	m.Registry.MustRegister(collectors.NewGoCollector(), collectors.NewProcessCollector(collectors.ProcessCollectorOpts{}))
	m.Registry.MustRegister(m.InstallReady, m.Installs, m.Reinsertions, m.Conflicts, m.ReinsertDelay, m.Repaired, m.RepairLatency,
		m.PluginCommands, m.PluginLatency, m.PluginLookups, m.Panics, m.Resyncs, m.Sockets.Rejected, m.Sockets.AcceptErrors)
	return m
}

// Agent is the running node agent.
type Agent struct {
	opts    *Options
	log     *slog.Logger
	in      *install.Installer
	metrics *Metrics
	getenv  func(string) string
	// DaemonSetPresent reports whether the agent's DaemonSet still exists
	// (and is not being deleted); nil means it cannot be checked.
	DaemonSetPresent func(ctx context.Context) (bool, error)
	// Clientset, when set, feeds the node-local pod cache.
	Clientset kubernetes.Interface
	// PluginLog receives the plugin's lines (scope cni-plugin), at its
	// scope's level; nil means the agent's logger.
	PluginLog *slog.Logger

	mu       sync.Mutex
	notReady string
	rewrites []time.Time
	backoff  time.Duration
	// health reports the sockets' state (nil while they accept).
	health []func() (time.Time, error)
	// beat is when the install loop last went round (unix nanoseconds).
	beat  atomic.Int64
	watch *watchSet
	// locker serialises rule writes per network namespace between the
	// CNI server and repair.
	locker *nslock.Locker
}

// New builds an agent from options.
func New(opts *Options, log *slog.Logger, getenv func(string) string) *Agent {
	if opts.NftablesAuto {
		// Decided once here and written into the plugin's config, so no
		// pod start pays for detection.
		has, err := HostHasIPTables(opts.HostRoot)
		switch {
		case err != nil:
			log.Warn("cannot inspect the host for iptables; using the iptables backend", "error", err.Error())
		case !has:
			opts.NativeNftables = true
			log.Info("no iptables on the host: the plugin will program nftables over netlink", "hostRoot", opts.HostRoot)
		default:
			log.Info("iptables found on the host: the plugin will use it", "hostRoot", opts.HostRoot)
		}
	}
	cfg := install.Config{
		MountedCNINetDir: opts.CNINetDir,
		CNIConfName:      opts.CNIConfName,
		Chained:          opts.Chained,
		RunDir:           opts.RunDir,
		BinSourceDir:     opts.BinSourceDir,
		BinTargetDirs:    opts.BinTargetDirs,
		KubeconfigMode:   opts.KubeconfigMode,
		ConfGroupRead:    opts.ConfGroupRead,
		Kubeconfig: install.KubeconfigSettings{
			Protocol:          getenv("KUBERNETES_SERVICE_PROTOCOL"),
			Host:              getenv("KUBERNETES_SERVICE_HOST"),
			Port:              getenv("KUBERNETES_SERVICE_PORT"),
			CAFile:            opts.KubeCAFile,
			SkipTLSVerify:     opts.SkipTLSVerify,
			ServiceAccountDir: opts.ServiceAccountDir,
		},
		Entry: install.EntrySettings{
			LogLevel:          opts.PluginLogLevel,
			RunDir:            opts.RunDir,
			ExcludeNamespaces: opts.ExcludeNamespaces,
			PodNamespace:      opts.PodNamespace,
			NativeNftables:    opts.NativeNftables,
			AmbientEnabled:    opts.AmbientEnabled,
		},
	}
	return &Agent{opts: opts, log: log, in: install.New(cfg, log), metrics: NewMetrics(), getenv: getenv,
		notReady: "starting", locker: nslock.New()}
}

// Metrics returns the agent's metrics.
func (a *Agent) Metrics() *Metrics { return a.metrics }

func (a *Agent) setReady(reason string) {
	a.mu.Lock()
	changed := a.notReady != reason
	a.notReady = reason
	a.mu.Unlock()
	if reason == "" {
		a.metrics.InstallReady.Set(1)
		if changed {
			a.log.Info("ready: plugin binary, kubeconfig and CNI config entry in place", "config", a.in.ConfPath())
		}
		return
	}
	a.metrics.InstallReady.Set(0)
	if changed {
		a.log.Warn("not ready", "reason", reason)
	}
}

// ReadyReason is "" when ready, else why not: the plugin's files, and
// the sockets.
func (a *Agent) ReadyReason() string {
	a.mu.Lock()
	reasons := []string{}
	if a.notReady != "" {
		reasons = append(reasons, a.notReady)
	}
	health := a.health
	a.mu.Unlock()
	for _, h := range health {
		if _, err := h(); err != nil {
			reasons = append(reasons, err.Error())
		}
	}
	return strings.Join(reasons, "; ")
}

// livenessGrace is how long a stuck loop, a socket that cannot accept or
// a vanished config dir is borne before /livez fails and the kubelet
// restarts the agent (which gets fresh descriptors and fresh mounts).
func (a *Agent) livenessGrace() time.Duration {
	return max(2*a.opts.ResyncInterval, time.Second)
}

// LiveReason is "" while the agent is alive, else why a restart would help.
func (a *Agent) LiveReason() string {
	grace := a.livenessGrace()
	var reasons []string
	if b := a.beat.Load(); b != 0 {
		if d := time.Since(time.Unix(0, b)); d > grace {
			reasons = append(reasons, fmt.Sprintf("the install loop has not gone round for %s", d.Round(time.Second)))
		}
	}
	a.mu.Lock()
	health := a.health
	ws := a.watch
	a.mu.Unlock()
	for _, h := range health {
		if since, err := h(); err != nil && time.Since(since) > grace {
			reasons = append(reasons, err.Error())
		}
	}
	if ws != nil {
		if since := ws.missingSince(a.opts.CNINetDir); !since.IsZero() && time.Since(since) > grace {
			reasons = append(reasons, fmt.Sprintf("the CNI config dir %s has been gone since %s (a restart mounts it again)",
				a.opts.CNINetDir, since.UTC().Format(time.RFC3339)))
		}
	}
	return strings.Join(reasons, "; ")
}

// Handler serves /healthz (the process answers, as Istio's), /livez (the
// liveness the chart probes) and /readyz.
func (a *Agent) Handler() http.Handler {
	mux := http.NewServeMux()
	mux.HandleFunc("/healthz", func(w http.ResponseWriter, _ *http.Request) { _, _ = w.Write([]byte("ok\n")) })
	mux.HandleFunc("/livez", func(w http.ResponseWriter, _ *http.Request) {
		if r := a.LiveReason(); r != "" {
			w.WriteHeader(http.StatusServiceUnavailable)
			_, _ = fmt.Fprintf(w, "not live: %s\n", r)
			return
		}
		_, _ = w.Write([]byte("live\n"))
	})
	mux.HandleFunc("/readyz", func(w http.ResponseWriter, _ *http.Request) {
		if r := a.ReadyReason(); r != "" {
			w.WriteHeader(http.StatusServiceUnavailable)
			_, _ = fmt.Fprintf(w, "not ready: %s\n", r)
			return
		}
		_, _ = w.Write([]byte("ready\n"))
	})
	return mux
}

func serve(ctx context.Context, port int, h http.Handler) (net.Listener, error) {
	l, err := net.Listen("tcp", net.JoinHostPort("", strconv.Itoa(port)))
	if err != nil {
		return nil, err
	}
	srv := &http.Server{Handler: h, ReadHeaderTimeout: 5 * time.Second, IdleTimeout: 2 * time.Minute}
	go func() { _ = srv.Serve(l) }()
	go func() {
		<-ctx.Done()
		_ = srv.Close()
	}()
	return l, nil
}

// Run installs, keeps the installation in place until ctx ends, then
// removes it (unless this is an upgrade). It returns nil on a clean stop;
// its sockets are gone when it returns.
func (a *Agent) Run(ctx context.Context) error {
	srvCtx, stopServers := context.WithCancel(context.Background())
	defer stopServers()
	a.beat.Store(time.Now().UnixNano())
	if a.opts.ReadinessPort > 0 {
		if _, err := serve(srvCtx, a.opts.ReadinessPort, a.Handler()); err != nil {
			return fmt.Errorf("readiness server: %w", err)
		}
	}
	if a.opts.MonitoringPort > 0 {
		mux := http.NewServeMux()
		mux.Handle("/metrics", promhttp.HandlerFor(a.metrics.Registry, promhttp.HandlerOpts{}))
		if _, err := serve(srvCtx, a.opts.MonitoringPort, mux); err != nil {
			return fmt.Errorf("metrics server: %w", err)
		}
	}
	a.setReady("starting")
	ws, err := newWatchSet(append([]string{a.opts.CNINetDir, a.opts.ServiceAccountDir}, a.opts.BinTargetDirs...), a.log)
	if err != nil {
		return fmt.Errorf("creating file watcher: %w", err)
	}
	defer ws.close()
	a.mu.Lock()
	a.watch = ws
	a.mu.Unlock()
	if err := os.MkdirAll(a.opts.RunDir, 0o755); err != nil {
		return fmt.Errorf("creating run dir: %w", err)
	}
	pluginLog := a.PluginLog
	if pluginLog == nil {
		pluginLog = a.log.With("scope", logging.ScopePlugin)
	}
	// Each socket is removed before Run returns, whatever the path out.
	var sockets []io.Closer
	defer func() {
		for _, c := range sockets {
			_ = c.Close()
		}
	}()
	logSock, err := serveLogSocket(a.opts.RunDir, pluginLog, a.metrics.Sockets)
	if err != nil {
		return fmt.Errorf("plugin log socket: %w", err)
	}
	sockets = append(sockets, logSock)
	var pods *PodCache
	if a.Clientset != nil {
		pods = StartPodCache(srvCtx, a.Clientset, a.opts.NodeName)
	}
	agentSock, err := pods.Serve(a.opts.RunDir, a.ReadyReason, a.log, a.metrics.Sockets)
	if err != nil {
		return fmt.Errorf("agent socket: %w", err)
	}
	sockets = append(sockets, agentSock)
	cni := &CNIServer{
		Log: pluginLog, SocketLog: a.log,
		Rules: a.iptablesRules(), NFTables: &nftables.Applier{},
		Pods: pods, Clientset: a.Clientset, Locker: a.locker,
		Commands: a.metrics.PluginCommands, Latency: a.metrics.PluginLatency, Lookups: a.metrics.PluginLookups,
		Panics: a.metrics.Panics, Sockets: a.metrics.Sockets,
	}
	cniDone, err := cni.Serve(srvCtx, filepath.Join(a.opts.RunDir, cnirelay.SocketName), 5*time.Second)
	if err != nil {
		return fmt.Errorf("CNI socket: %w", err)
	}
	a.mu.Lock()
	a.health = append(a.health, cni.Health)
	a.mu.Unlock()
	// The CNI socket goes first at the end (relays then run the fallback),
	// and the commands under way finish, before the other sockets go.
	defer func() {
		stopServers()
		<-cniDone
	}()
	if a.opts.RepairEnabled && a.Clientset != nil {
		a.startRepair(srvCtx, pods)
	}
	loopErr := a.loop(ctx, ws)
	a.setReady("shutting down")
	return errors.Join(loopErr, a.shutdown())
}

func (a *Agent) loop(ctx context.Context, ws *watchSet) error {
	first := true
	var changedAt time.Time
	again := false
	resync := time.NewTicker(a.opts.ResyncInterval)
	defer resync.Stop()
	for {
		a.beat.Store(time.Now().UnixNano())
		ws.sync()
		wrote, err := a.installOnce()
		// A primary config that is a link into another directory is
		// watched there too.
		if f := a.in.ConfFile(); f != "" {
			ws.follow(filepath.Dir(f))
		}
		firstPass := first
		var hold <-chan time.Time
		if wrote && !first {
			a.metrics.Reinsertions.Inc()
			if !changedAt.IsZero() {
				a.metrics.ReinsertDelay.Observe(time.Since(changedAt).Seconds())
			}
			if d := a.noteRewrite(); d > 0 {
				a.metrics.Conflicts.Inc()
				hint := ""
				if strings.Contains(strings.ToLower(a.in.ConfPath()), "cilium") {
					hint = "; Cilium was detected: set cni.exclusive=false in its configuration"
				}
				a.log.Warn("another component keeps rewriting the CNI config; backing off"+hint,
					"file", a.in.ConfPath(), "backoff", d.String())
				hold = time.After(d)
			}
		}
		if err == nil {
			first = false
		}
		switch {
		case errors.Is(err, install.ErrNoPrimary):
			a.setReady("waiting for the primary CNI plugin to write its config in " + a.opts.CNINetDir)
		case err != nil:
			a.setReady(err.Error())
			var se *install.StepError
			if errors.As(err, &se) {
				a.metrics.Installs.WithLabelValues(se.Result).Inc()
			}
		default:
			// As Istio counts: every pass that put the plugin in place,
			// the first, each re-insertion and each recovery.
			if firstPass || wrote || a.installNotReady() {
				a.metrics.Installs.WithLabelValues(install.ResultSuccess).Inc()
			}
			if r := a.in.Ready(); r != nil {
				a.setReady(r.Error())
				// Rewritten right after our write: its event may have come
				// in with our own, which are ignored. Go again at once (a
				// component that keeps at it is met with back-off).
				again = wrote
			} else {
				a.setReady("")
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
				a.beat.Store(time.Now().UnixNano())
				a.metrics.Resyncs.WithLabelValues("periodic").Inc()
				pending = true
			case ev, ok := <-ws.events():
				switch {
				case !ok:
					a.log.Warn("the file watcher stopped; making a new one and resyncing")
					a.metrics.Resyncs.WithLabelValues("watch").Inc()
					ws.reset()
					pending = true
				case ws.concerns(ev) || a.relevant(ev) || (ws.isExtra(filepath.Dir(ev.Name)) && isConfName(filepath.Base(ev.Name))):
					if changedAt.IsZero() {
						changedAt = time.Now()
					}
					pending = true
				}
			case err, ok := <-ws.errors():
				switch {
				case ok && errors.Is(err, fsnotify.ErrEventOverflow):
					// The kernel dropped events: whatever they said, a full
					// pass finds it.
					a.log.Warn("the inotify queue overflowed and file events were lost; resyncing everything")
					a.metrics.Resyncs.WithLabelValues("overflow").Inc()
				default:
					msg := "the file watcher stopped"
					if ok {
						msg = err.Error()
					}
					a.log.Warn("file watcher failed; making a new one and resyncing", "error", msg)
					a.metrics.Resyncs.WithLabelValues("watch").Inc()
					ws.reset()
				}
				pending = true
			}
		}
	}
}

// installNotReady: the last pass left the plugin's files incomplete.
func (a *Agent) installNotReady() bool {
	a.mu.Lock()
	defer a.mu.Unlock()
	return a.notReady != ""
}

func (a *Agent) startRepair(ctx context.Context, pods *PodCache) {
	cfg := repair.Config{
		RepairPods: a.opts.RepairPods, DeletePods: a.opts.RepairDeletePods, LabelPods: a.opts.RepairLabelPods,
		LabelKey: a.opts.RepairLabelKey, LabelValue: a.opts.RepairLabelValue,
		SidecarAnnotation: a.opts.RepairSidecarAnno, InitContainerName: a.opts.RepairInitContainer,
		ExitCode: int32(a.opts.RepairExitCode), TerminationMessage: a.opts.RepairTermMessage,
		LabelSelectors: a.opts.RepairLabelSelector, FieldSelectors: a.opts.RepairFieldSelector,
	}
	if cfg.Mode() == "" {
		a.log.Warn("repair is enabled but no mode is: set repair-repair-pods, repair-delete-pods or repair-label-pods")
		return
	}
	var rules plugin.Rules = a.iptablesRules()
	if a.opts.NativeNftables {
		rules = &nftables.Applier{}
	}
	// Repair writes rules under the same per-namespace lock as the CNI
	// commands, so the start-up scan and an ADD never race.
	rules = &lockedRules{Rules: rules, locker: a.locker}
	c := repair.New(cfg, a.Clientset, rules, a.opts.HostProcDir, a.metrics.Repaired, a.log)
	c.Latency = a.metrics.RepairLatency
	c.Panics = a.metrics.Panics.WithLabelValues("repair")
	// One watch on the node's pods: the repair controller shares the pod
	// cache's unless it narrows the watch with selectors of its own.
	if pods != nil && cfg.LabelSelectors == "" && cfg.FieldSelectors == "" {
		c.Informer = pods.Informer()
	}
	go func() {
		if err := c.Run(ctx, a.opts.NodeName); err != nil {
			a.log.Error("repair controller stopped", "error", err.Error())
		}
	}()
}

// iptablesRules is the iptables backend, with the variant forced as the
// plugin's FORCE_IPTABLES_BINARY does.
func (a *Agent) iptablesRules() plugin.Rules {
	return &iptables.Applier{Force: a.getenv("FORCE_IPTABLES_BINARY")}
}

func (a *Agent) relevant(ev fsnotify.Event) bool {
	base := filepath.Base(ev.Name)
	if strings.Contains(base, ".istio-cni-tmp-") {
		return false
	}
	if ev.Op == fsnotify.Chmod {
		return false
	}
	dir := filepath.Dir(ev.Name)
	switch {
	case dir == filepath.Clean(a.opts.CNINetDir):
		return isConfName(base)
	case dir == filepath.Clean(a.opts.ServiceAccountDir):
		return true
	default:
		return base == install.PluginType || base == install.FallbackBinary
	}
}

func isConfName(base string) bool {
	return !strings.Contains(base, ".istio-cni-tmp-") &&
		(strings.HasSuffix(base, ".conf") || strings.HasSuffix(base, ".conflist") || strings.HasSuffix(base, ".json"))
}

// installOnce runs every install step and reports whether the CNI config
// was written.
func (a *Agent) installOnce() (bool, error) {
	if err := a.in.InstallBinaries(); err != nil {
		return false, err
	}
	if changed, err := a.in.WriteKubeconfig(); err != nil {
		return false, err
	} else if changed {
		a.log.Info("wrote the plugin kubeconfig", "path", a.in.KubeconfigPath())
	}
	return a.in.EnsureConf()
}

// noteRewrite records a re-insertion and returns how long to back off when
// the rewrites come faster than the conflict limit allows.
func (a *Agent) noteRewrite() time.Duration {
	now := time.Now()
	keep := a.rewrites[:0]
	for _, t := range a.rewrites {
		if now.Sub(t) < a.opts.ConflictWindow {
			keep = append(keep, t)
		}
	}
	a.rewrites = append(keep, now)
	if len(a.rewrites) <= a.opts.ConflictLimit {
		a.backoff = 0
		return 0
	}
	if a.backoff == 0 {
		a.backoff = time.Second
	} else {
		a.backoff = min(2*a.backoff, 30*time.Second)
	}
	return a.backoff
}

func (a *Agent) shutdown() error {
	if !a.opts.DisableSafeUpgrade && a.DaemonSetPresent != nil {
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		present, err := a.DaemonSetPresent(ctx)
		cancel()
		switch {
		case err != nil:
			a.log.Warn("cannot tell an upgrade from an uninstall; leaving the plugin in place so new pods stay meshed",
				"error", err.Error())
			return nil
		case present:
			a.log.Info("DaemonSet still exists (rollout or node restart): leaving the plugin in place so pods started meanwhile stay meshed",
				"daemonset", a.opts.PodNamespace+"/"+a.opts.DaemonSetName)
			return nil
		}
	}
	if err := a.in.Cleanup(); err != nil {
		var ce *install.CleanupError
		if errors.As(err, &ce) {
			a.log.Error("clean-up stopped at the first failed step; what the node needs to start pods is left in place",
				"error", ce.Err.Error(), "left", strings.Join(ce.Left, ", "))
		} else {
			a.log.Error("clean-up failed", "error", err.Error())
		}
		return fmt.Errorf("clean-up: %w", err)
	}
	a.log.Info("removed the plugin: CNI config entry, kubeconfig and binary")
	return nil
}

// HostHasIPTables reports whether the host has an iptables-restore of any
// variant in the usual directories under root.
func HostHasIPTables(root string) (bool, error) {
	if _, err := os.Stat(root); err != nil {
		return false, err
	}
	for _, dir := range []string{"usr/sbin", "sbin", "usr/local/sbin", "usr/bin", "bin"} {
		for _, name := range []string{"iptables-restore", "iptables-nft-restore", "iptables-legacy-restore"} {
			// Lstat: on merged-/usr hosts these are often links whose
			// targets only resolve inside the host's own root.
			if _, err := os.Lstat(filepath.Join(root, dir, name)); err == nil {
				return true, nil
			}
		}
	}
	return false, nil
}
