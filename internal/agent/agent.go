package agent

import (
	"context"
	"fmt"
	"log/slog"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"time"

	"github.com/prometheus/client_golang/prometheus/promhttp"

	"github.com/istio-cni-go/istio-cni/internal/cnirelay"
	"github.com/istio-cni-go/istio-cni/internal/cniserver"
	"github.com/istio-cni-go/istio-cni/internal/install"
	"github.com/istio-cni-go/istio-cni/internal/installloop"
	"github.com/istio-cni-go/istio-cni/internal/kubeclient"
	"github.com/istio-cni-go/istio-cni/internal/logging"
	"github.com/istio-cni-go/istio-cni/internal/nslock"
	"github.com/istio-cni-go/istio-cni/internal/pluginlog"
	"github.com/istio-cni-go/istio-cni/internal/podcache"
	"github.com/istio-cni-go/istio-cni/internal/prepared"
	"github.com/istio-cni-go/istio-cni/internal/repair"
	"github.com/istio-cni-go/istio-cni/internal/sockserve"
)

// Agent is the running node agent.
type Agent struct {
	cfg     *Config
	log     *slog.Logger
	metrics *Metrics
	// DaemonSetPresent reports whether the agent's DaemonSet still exists
	// (and is not being deleted); nil means Run watches it when it has a
	// Clientset, and that it cannot be checked otherwise.
	DaemonSetPresent func(ctx context.Context) (bool, error)
	// Clientset, when set, feeds the node-local pod cache, the repair
	// controller and the DaemonSet watch.
	Clientset kubeclient.Interface
	// Namespaces are read in ambient mode (their labels enrol pods).
	Namespaces kubeclient.Namespaces
	// PluginLog receives the plugin's lines (scope cni-plugin), at its
	// scope's level; nil means the agent's logger.
	PluginLog *slog.Logger
	// listen opens the health and metrics ports (net.Listen; tests bind
	// the loopback's port 0 instead).
	listen func(network, addr string) (net.Listener, error)
	// stopped, when set, is called once every part has stopped, before the
	// clean-up (tests look for goroutines left behind there).
	stopped func()

	mu sync.Mutex
	// loop is the install loop of the current Run (nil before).
	loop *installloop.Loop
	// health reports the sockets' state (nil while they accept).
	health []func() (time.Time, error)
	// locker serialises rule writes per network namespace between the
	// CNI server and repair.
	locker *nslock.Locker
	// ambient is ambient mode's controller (nil when off).
	ambient *ambientPart
}

// New builds an agent from its configuration. It reads nothing from the
// node: Run does, when it starts.
func New(cfg *Config, log *slog.Logger) *Agent {
	return &Agent{cfg: cfg, log: log, metrics: NewMetrics(), locker: nslock.New(), listen: net.Listen}
}

// Metrics returns the agent's metrics.
func (a *Agent) Metrics() *Metrics { return a.metrics }

// ReadyReason is "" when ready, else why not: the plugin's files, and
// the sockets.
func (a *Agent) ReadyReason() string {
	a.mu.Lock()
	reasons := []string{}
	if a.loop == nil {
		reasons = append(reasons, "starting")
	} else if r := a.loop.NotReady(); r != "" {
		reasons = append(reasons, r)
	}
	// Ambient mode is ready once it holds every enrolled pod of the node
	// and serves ztunnel's socket; whether a ztunnel is connected is not
	// the agent's readiness (ztunnel's own pod needs the agent to start).
	if a.ambient != nil && !a.ambient.c.Ready() {
		reasons = append(reasons, "ambient mode: taking over the node's enrolled pods")
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
	return max(2*a.cfg.Loop.ResyncInterval, time.Second)
}

// LiveReason is "" while the agent is alive, else why a restart would help.
func (a *Agent) LiveReason() string {
	grace := a.livenessGrace()
	a.mu.Lock()
	loop := a.loop
	health := a.health
	a.mu.Unlock()
	var reasons []string
	if loop != nil {
		if r := loop.Stuck(grace); r != "" {
			reasons = append(reasons, r)
		}
	}
	for _, h := range health {
		if since, err := h(); err != nil && time.Since(since) > grace {
			reasons = append(reasons, err.Error())
		}
	}
	if loop != nil {
		if r := loop.ConfDirGone(grace); r != "" {
			reasons = append(reasons, r)
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

// parts are the goroutines Run started besides the install loop, each
// with a channel closed when it has ended. The CNI server stops first
// (relays then run the fallback) and its commands under way finish,
// before the rest stop.
type parts struct {
	stopCNI, stopRest context.CancelFunc
	cni               <-chan struct{}
	rest              []<-chan struct{}
	once              sync.Once
	// displaced says whether a newer agent took the CNI socket's path.
	displaced func() bool
	// stopWatch and watchDone are the DaemonSet watch's, stopped last.
	stopWatch context.CancelFunc
	watchDone <-chan struct{}
	watchOnce sync.Once
}

// stopTheWatch ends the DaemonSet watch and waits for it.
func (p *parts) stopTheWatch() {
	p.watchOnce.Do(func() {
		if p.stopWatch != nil {
			p.stopWatch()
			<-p.watchDone
		}
	})
}

// stop ends every part and waits for each; it may be called more than once.
func (p *parts) stop() {
	p.once.Do(func() {
		p.stopCNI()
		if p.cni != nil {
			<-p.cni
		}
		p.stopRest()
		for _, done := range p.rest {
			<-done
		}
	})
}

// Run installs, keeps the installation in place until ctx ends, then
// removes it (unless this is an upgrade). It returns nil on a clean stop.
// Every goroutine it started (servers, pod cache, repair, DaemonSet watch,
// file watcher) has ended and its sockets are gone before the clean-up,
// and so before it returns.
func (a *Agent) Run(ctx context.Context) error {
	cfg := *a.cfg
	cfg.Loop.Install.Entry.NativeNftables = a.nativeNftables(&cfg)
	loop := installloop.New(cfg.Loop, a.log, a.metrics.Install)
	a.mu.Lock()
	a.loop = loop
	a.mu.Unlock()

	cniCtx, stopCNI := context.WithCancel(context.Background())
	restCtx, stopRest := context.WithCancel(context.Background())
	p := &parts{stopCNI: stopCNI, stopRest: stopRest}
	// Last, once ambient mode's controller has stopped and the node's
	// rules are removed or kept.
	defer func() {
		a.mu.Lock()
		amb := a.ambient
		a.mu.Unlock()
		if amb != nil {
			amb.closeNetns()
		}
	}()
	defer p.stopTheWatch()
	defer p.stop()
	present, err := a.start(restCtx, cniCtx, &cfg, p)
	if err != nil {
		return err
	}
	// The loop fails only before its first pass (no file watcher): then,
	// as for a part that cannot start, nothing is removed.
	if err := loop.Run(ctx); err != nil {
		return err
	}
	p.stop()
	// Two agents overlap on a node in an update with maxSurge: the one
	// stopping must not remove what the newer one serves with (the config
	// entry, the binaries, the kubeconfig, the records), whatever it would
	// decide alone (Istio's RBAC, which cannot read the DaemonSet, says
	// remove).
	keep := p.displaced != nil && p.displaced()
	if keep {
		a.log.Info("a newer agent took this node's CNI socket over; leaving the plugin and its files to it")
	} else {
		keep = a.keepPlugin(&cfg, present)
	}
	p.stopTheWatch()
	if a.stopped != nil {
		a.stopped()
	}
	if keep {
		// Tells the fallback that a rollout is under way: its ADDs wait a
		// while for the next agent's token, this one's dying with its pod.
		markStopped(cfg.Loop.Install.RunDir, a.log)
		return nil
	}
	a.mu.Lock()
	amb := a.ambient
	a.mu.Unlock()
	if amb != nil {
		amb.uninstall(a)
	}
	if err := loop.Cleanup(); err != nil {
		return err
	}
	// The pods' records, the stored plans and the configs learnt serve
	// only the relay just removed; on the node's tmpfs they would stay
	// until a reboot (hundreds of KiB to MiBs on a full node). Kept when
	// the clean-up stopped: the relay is still there to use them.
	dir := filepath.Join(cfg.Loop.Install.RunDir, prepared.DirName)
	if err := os.RemoveAll(dir); err != nil {
		a.log.Warn("could not remove the prepared records", "dir", dir, "error", err.Error())
	}
	return nil
}

// markStopped records, in the run dir, when this agent stopped leaving the
// plugin in place (cnirelay.StoppedName).
func markStopped(runDir string, log *slog.Logger) {
	path := filepath.Join(runDir, cnirelay.StoppedName)
	now := time.Now()
	err := os.WriteFile(path, []byte(now.UTC().Format(time.RFC3339)+"\n"), 0o600)
	if err == nil {
		err = os.Chtimes(path, now, now)
	}
	if err != nil {
		log.Warn("cannot record the agent's stop for the fallback; during the rollout, pods it did not prepare fail at once and are retried", "error", err.Error())
	}
}

// start starts every part but the install loop, in the order that lets
// each find what it needs, and records each in p.
func (a *Agent) start(ctx, cniCtx context.Context, cfg *Config, p *parts) (func(context.Context) (bool, error), error) {
	metrics := promhttp.HandlerFor(a.metrics.Registry, promhttp.HandlerOpts{})
	if cfg.ReadinessPort > 0 {
		h := a.Handler()
		if cfg.MonitoringPort == cfg.ReadinessPort {
			// One port set twice would otherwise fail the agent on its
			// own bind; both handlers share the listener instead.
			mux := http.NewServeMux()
			mux.Handle("/metrics", metrics)
			mux.Handle("/", h)
			h = mux
		}
		done, err := sockserve.ServeTCPOn(ctx, a.listen, cfg.ReadinessPort, h)
		if err != nil {
			return nil, fmt.Errorf("readiness server on port %d: %w", cfg.ReadinessPort, err)
		}
		p.rest = append(p.rest, done)
	}
	if cfg.MonitoringPort > 0 && cfg.MonitoringPort != cfg.ReadinessPort {
		mux := http.NewServeMux()
		mux.Handle("/metrics", metrics)
		done, err := sockserve.ServeTCPOn(ctx, a.listen, cfg.MonitoringPort, mux)
		if err != nil {
			return nil, fmt.Errorf("metrics server on port %d: %w", cfg.MonitoringPort, err)
		}
		p.rest = append(p.rest, done)
	}
	runDir := cfg.Loop.Install.RunDir
	if err := os.MkdirAll(runDir, 0o755); err != nil { //nolint:gosec // G301: Istio's mode for the run dir, which the plugin and host tools read
		return nil, fmt.Errorf("creating run dir: %w", err)
	}
	if err := publishForcedVariant(runDir, cfg); err != nil {
		return nil, fmt.Errorf("telling the fallback the forced iptables variant: %w", err)
	}
	a.mu.Lock()
	loop := a.loop
	a.mu.Unlock()
	// The plugin kubeconfig before any socket: a relay that leaves this
	// starting agent for the fallback must find its credentials, not the
	// previous agent's, which the API server invalidated with that pod.
	if changed, err := loop.WriteKubeconfig(); err != nil {
		a.log.Warn("cannot write the plugin kubeconfig yet; the install pass retries", "error", err.Error())
	} else if changed {
		a.log.Info("wrote the plugin kubeconfig ahead of the first install pass")
	}
	pluginLog := a.PluginLog
	if pluginLog == nil {
		pluginLog = a.log.With("scope", logging.ScopePlugin)
	}
	logDone, err := pluginlog.Serve(ctx, runDir, pluginLog, a.metrics.Sockets)
	if err != nil {
		return nil, fmt.Errorf("plugin log socket: %w", err)
	}
	p.rest = append(p.rest, logDone)
	var pods *podcache.Cache
	if a.Clientset != nil {
		pods = podcache.Start(ctx, a.Clientset, cfg.NodeName)
		p.rest = append(p.rest, pods.Done())
	}
	agentDone, err := pods.Serve(ctx, runDir, a.ReadyReason, a.log, a.metrics.Sockets)
	if err != nil {
		return nil, fmt.Errorf("agent socket: %w", err)
	}
	p.rest = append(p.rest, agentDone)
	var amb *ambientPart
	if cfg.Loop.Install.Entry.AmbientEnabled {
		if amb, err = a.newAmbient(cfg); err != nil {
			return nil, fmt.Errorf("ambient mode: %w", err)
		}
		// Stopped after the CNI server, whose ADDs it serves.
		p.rest = append(p.rest, amb.start(ctx, a))
		a.mu.Lock()
		a.ambient = amb
		a.health = append(a.health, amb.c.SocketHealth)
		a.mu.Unlock()
	}
	// The plugin's log file in the run directory, as Istio's plugin keeps
	// it: the commands this agent serves write theirs there; a plugin
	// process (the fallback) writes its own, so the lines it forwards to
	// the log socket are not written again.
	pluginFile := logging.NewPluginFile(runDir)
	cni := &cniserver.Server{
		Log: slog.New(logging.TeeToFile(pluginLog.Handler(), pluginFile)), SocketLog: a.log,
		Rules: iptablesRules(cfg), NFTables: nftablesRules(),
		Pods: pods, Clientset: a.Clientset, Locker: a.locker,
		Committer: cfg.RulesCommitter, ForceIPTables: cfg.ForceIPTablesBinary,
		Commands: a.metrics.PluginCommands, Requests: a.metrics.PluginRequests, Latency: a.metrics.PluginLatency, Lookups: a.metrics.PluginLookups,
		PreparedAdds: a.metrics.PreparedAdds,
		Panics:       a.metrics.Panics, Sockets: a.metrics.Sockets,
		PreparedDir: filepath.Join(runDir, prepared.DirName), Prepare: cfg.PrepareAhead,
		AgentWait: cfg.AgentWait,
	}
	if amb != nil {
		cni.Ambient = amb.c
	}
	cniDone, err := cni.Serve(cniCtx, filepath.Join(runDir, cnirelay.SocketName), 5*time.Second)
	if err != nil {
		return nil, fmt.Errorf("CNI socket: %w", err)
	}
	p.cni = cniDone
	p.displaced = cni.Displaced
	loop.LeaveWhen(cni.Displaced)
	a.mu.Lock()
	a.health = append(a.health, cni.Health)
	a.mu.Unlock()
	loop.OnPlaced(func(conf []byte) {
		if err := cni.ExpectConflist(conf, install.PluginType); err != nil {
			a.log.Info("cannot tell from the CNI config file what config the runtime will hand the plugin; it is learnt from the first ADDs instead",
				"error", err.Error())
		}
	})
	if cfg.RepairEnabled && a.Clientset != nil {
		if done := a.startRepair(ctx, cfg, pods); done != nil {
			p.rest = append(p.rest, done)
		}
	}
	present := a.DaemonSetPresent
	if present == nil && a.Clientset != nil {
		// The watch outlives the other parts: the termination's decision
		// may wait for its news of the DaemonSet (watchGrace).
		wctx, stop := context.WithCancel(context.Background())
		w := watchDaemonSet(wctx, a.Clientset, cfg.Loop.Install.Entry.PodNamespace, cfg.DaemonSetName, cfg.NodeName, a.log)
		p.stopWatch, p.watchDone = stop, w.done
		present = w.present
	}
	return present, nil
}

// startRepair starts the repair controller; the channel is closed once it
// has stopped (nil when it does not run).
func (a *Agent) startRepair(ctx context.Context, cfg *Config, pods *podcache.Cache) <-chan struct{} {
	if cfg.Repair.Mode() == "" {
		a.log.Warn("repair is enabled but no mode is: set repair-repair-pods, repair-delete-pods or repair-label-pods")
		return nil
	}
	// Repair writes rules under the same per-namespace locks as the CNI
	// commands and the relays, so the start-up scan and an ADD never race.
	rules := &lockedRules{Rules: iptablesRules(cfg), locker: a.locker, runDir: cfg.Loop.Install.RunDir, log: a.log}
	if cfg.Loop.Install.Entry.NativeNftables {
		rules.Rules = nftablesRules()
	}
	c := repair.New(cfg.Repair, a.Clientset, rules, cfg.HostProcDir, a.metrics.Repaired, a.log)
	c.Latency = a.metrics.RepairLatency
	c.Panics = a.metrics.Panics.WithLabelValues("repair")
	// One watch on the node's pods: the repair controller shares the pod
	// cache's unless it narrows the watch with selectors of its own.
	if pods != nil && cfg.Repair.LabelSelectors == "" && cfg.Repair.FieldSelectors == "" {
		c.Informer = pods.Informer()
	}
	done := make(chan struct{})
	go func() {
		defer close(done)
		if err := c.Run(ctx, cfg.NodeName); err != nil {
			a.log.Error("repair controller stopped", "error", err.Error())
		}
	}()
	return done
}

// keepPlugin says whether termination leaves the plugin in place: when
// the DaemonSet still exists (a rollout or a node restart: pods started
// meanwhile must stay meshed) or that cannot be told.
func (a *Agent) keepPlugin(cfg *Config, present func(context.Context) (bool, error)) bool {
	if cfg.DisableSafeUpgrade || present == nil {
		return false
	}
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	ok, err := present(ctx)
	cancel()
	switch {
	case err != nil:
		a.log.Warn("cannot tell an upgrade from an uninstall; leaving the plugin in place so new pods stay meshed",
			"error", err.Error())
		return true
	case ok:
		a.log.Info("DaemonSet still exists (rollout or node restart): leaving the plugin in place so pods started meanwhile stay meshed",
			"daemonset", cfg.Loop.Install.Entry.PodNamespace+"/"+cfg.DaemonSetName)
		return true
	}
	return false
}

// nativeNftables decides, once before the first install pass, whether the
// plugin programs nftables: as configured, or with native-nftables=auto,
// when the host has no iptables. It is written into the plugin's config
// so no pod start pays for detection.
func (a *Agent) nativeNftables(cfg *Config) bool {
	if !cfg.NftablesAuto {
		return cfg.Loop.Install.Entry.NativeNftables
	}
	has, err := HostHasIPTables(cfg.HostRoot)
	switch {
	case err != nil:
		a.log.Warn("cannot inspect the host for iptables; using the iptables backend", "error", err.Error())
	case !has:
		a.log.Info("no iptables on the host: the plugin will program nftables over netlink", "hostRoot", cfg.HostRoot)
		return true
	default:
		a.log.Info("iptables found on the host: the plugin will use it", "hostRoot", cfg.HostRoot)
	}
	return cfg.Loop.Install.Entry.NativeNftables
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
