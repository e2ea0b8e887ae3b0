// Package agent is the node agent (install-cni) put together: it turns
// Istio's flags and environment into each part's configuration, starts
// every part (the install loop, the plugin's log socket, the pod cache and
// its socket, the CNI server, the repair controller, the DaemonSet watch,
// the health and metrics servers), stops them and waits for each, and
// then removes the plugin unless this is an upgrade.
//
// What each part does is in its own package (installloop, install,
// cniserver, podcache, pluginlog, sockserve, repair); this one holds no
// logic of theirs.
package agent

import (
	"encoding/json"
	"flag"
	"fmt"
	"net/netip"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"time"

	"k8s.io/apimachinery/pkg/fields"
	"k8s.io/apimachinery/pkg/labels"

	"github.com/istio-cni-go/istio-cni/internal/ambient"
	"github.com/istio-cni-go/istio-cni/internal/cniserver"
	"github.com/istio-cni-go/istio-cni/internal/install"
	"github.com/istio-cni-go/istio-cni/internal/installloop"
	"github.com/istio-cni-go/istio-cni/internal/logging"
	"github.com/istio-cni-go/istio-cni/internal/repair"
)

// Config is the agent's configuration: each part's own configuration
// type, filled in place by ParseOptions, and what only the agent itself
// uses. Each setting is a flag (--kebab-case) and an environment variable
// (UPPER_SNAKE_CASE) with Istio's names; a flag that is set wins over the
// environment.
type Config struct {
	// Loop is the install loop's, with the installer's (Loop.Install)
	// inside: the CNI config, binaries, the plugin's kubeconfig and entry.
	Loop installloop.Config
	// Repair is the repair controller's; it runs when RepairEnabled.
	Repair        repair.Config
	RepairEnabled bool
	// HostProcDir is the host's /proc, where repair finds pods' network
	// namespaces.
	HostProcDir string

	MonitoringPort int
	ReadinessPort  int
	// NftablesAuto picks nftables when the host has no iptables binary;
	// Run decides, before the first install pass.
	NftablesAuto bool
	// HostRoot is the host's root file system as the agent sees it.
	HostRoot string
	// ForceIPTablesBinary forces the iptables variant, as the plugin's
	// FORCE_IPTABLES_BINARY does (environment only).
	ForceIPTablesBinary string
	// RulesCommitter is who writes a redirected pod's rules on ADD: the
	// plugin process (cniserver.CommitterPlugin) or the agent.
	RulesCommitter string
	// PrepareAhead keeps the ADDs of the node's pods that have not
	// started prepared for the relay (internal/prepared).
	PrepareAhead bool
	// AgentWait is how long, with PrepareAhead, a plugin process with no
	// record for its pod waits for the agent before it serves the pod with
	// the fallback (0: as long as the agent takes).
	AgentWait time.Duration
	// DisableSafeUpgrade removes the plugin on every termination, even
	// while the DaemonSet still exists (a rollout or a node reboot).
	DisableSafeUpgrade bool
	DaemonSetName      string
	NodeName           string
	// Kubeconfig is for the agent's own API access outside a pod.
	Kubeconfig string

	// Log are Istio's logging flags (--log_output_level and the rest).
	Log logging.Options
	// PluginLogLevelSet: plugin-log-level was given; otherwise the plugin's
	// level is the cni-plugin scope's of --log_output_level, as in Istio.
	PluginLogLevelSet bool
	// Ambient is ambient mode's; the controller runs when
	// Loop.Install.Entry.AmbientEnabled.
	Ambient AmbientOptions

	// Notes are start-up messages about settings accepted for
	// compatibility with Istio's manifests but without effect here.
	Notes []string
}

// AmbientOptions are ambient mode's settings, with Istio's names.
type AmbientOptions struct {
	// SelectorsYAML is AMBIENT_ENABLEMENT_SELECTOR as given (empty:
	// Istio's default); Selectors is it parsed, when ambient is enabled.
	SelectorsYAML string
	Selectors     *ambient.Selectors
	// DNSCapture and IPv6 are the pods' defaults (AMBIENT_DNS_CAPTURE,
	// AMBIENT_IPV6; the binary's default false, the chart's true).
	DNSCapture, IPv6 bool
	// ReconcileOnStartup is AMBIENT_RECONCILE_POD_RULES_ON_STARTUP. The
	// controller always re-applies the pods' rules when it starts and
	// verifies them periodically; false is noted, not obeyed.
	ReconcileOnStartup bool
	// ZtunnelSocket is ZTUNNEL_UDS_ADDRESS, where ztunnel connects.
	ZtunnelSocket string
	// SwitchToHostNS is ALLOW_SWITCH_TO_HOST_NS: the node's rules go into
	// the host's namespace (HostProcDir/1/ns/net), since the agent runs
	// in a pod network of its own; false means the agent's own namespace
	// is the node's (the chart's shareHostNetworkNamespace).
	SwitchToHostNS bool
	// NodeNetns is which namespace is the node's with SwitchToHostNS:
	// "" (the kubelet's, else PID 1's), "kubelet" (the kubelet's or
	// fail), "pid1" (Istio's), or a path.
	NodeNetns string
	// ZtunnelWait bounds how long an enrolled pod's ADD waits for ztunnel
	// to be connected; VerifyInterval and HostInterval are the periodic
	// checks of the pods' rules and of the node's probe SNAT.
	ZtunnelWait, VerifyInterval, HostInterval time.Duration
}

type optDef struct {
	name, help, def string
	set             func(string) error
	// istio marks Istio's own settings: as with Istio's viper binding
	// (AllowEmptyEnv), an environment variable that is set but empty
	// counts, as "", false or 0. Our own keys treat it as unset.
	istio bool
	// env is the variable's name when it is not the flag's upper-cased;
	// "-" means a flag only (Istio's logging flags).
	env string
	// ignored says why a setting accepted for compatibility has no effect;
	// it is named in the start-up log when given (and not false).
	ignored string
	isBool  bool
}

// serviceLink reports whether v is a Kubernetes service link's value
// (tcp://10.0.0.1:9090), as the kubelet sets <SERVICE>_PORT.
func serviceLink(v string) bool {
	return strings.HasPrefix(v, "tcp://") || strings.HasPrefix(v, "udp://") || strings.HasPrefix(v, "sctp://")
}

// rawFlag keeps a flag's text for later parsing; boolean options accept
// the bare form (--disable-safe-upgrade). A repeatable flag
// (--log_target) keeps every occurrence.
type rawFlag struct {
	v      string
	all    []string
	isBool bool
}

func (f *rawFlag) String() string     { return f.v }
func (f *rawFlag) Set(v string) error { f.v = v; f.all = append(f.all, v); return nil }
func (f *rawFlag) IsBoolFlag() bool   { return f.isBool }

// ErrHelp is returned for --help; the usage has been printed.
var ErrHelp = flag.ErrHelp

// ParseOptions reads flags from args and the environment through
// lookupEnv (os.LookupEnv) into a Config.
func ParseOptions(args []string, lookupEnv func(string) (string, bool)) (*Config, error) {
	o := &Config{Log: logging.DefaultOptions()}
	in := &o.Loop.Install
	rp := &o.Repair
	str := func(p *string) func(string) error { return func(v string) error { *p = v; return nil } }
	// Empty means false and 0, as viper's casts read an empty variable.
	boolean := func(p *bool) func(string) error {
		return func(v string) error {
			if v == "" {
				*p = false
				return nil
			}
			b, err := strconv.ParseBool(v)
			*p = b
			return err
		}
	}
	integer := func(p *int) func(string) error {
		return func(v string) error {
			if v == "" {
				*p = 0
				return nil
			}
			n, err := strconv.Atoi(v)
			*p = n
			return err
		}
	}
	selector := func(p *string, parse func(string) error) func(string) error {
		return func(v string) error {
			*p = strings.TrimSpace(v)
			if *p == "" {
				return nil
			}
			return parse(*p)
		}
	}
	list := func(p *[]string) func(string) error {
		return func(v string) error {
			*p = nil
			for _, s := range strings.Split(v, ",") {
				if s = strings.TrimSpace(s); s != "" {
					*p = append(*p, s)
				}
			}
			return nil
		}
	}
	int32Of := func(p *int32) func(string) error {
		return func(v string) error {
			var n int
			err := integer(&n)(v)
			*p = int32(n)
			return err
		}
	}
	duration := func(p *time.Duration) func(string) error {
		return func(v string) error {
			d, err := time.ParseDuration(v)
			*p = d
			return err
		}
	}
	nonNegative := func(p *time.Duration) func(string) error {
		return func(v string) error {
			d, err := time.ParseDuration(v)
			if err == nil && (d < 0 || d > time.Minute) {
				err = fmt.Errorf("must be from 0 to 1m")
			}
			*p = d
			return err
		}
	}
	positive := func(p *time.Duration) func(string) error {
		return func(v string) error {
			d, err := time.ParseDuration(v)
			if err == nil && d <= 0 {
				err = fmt.Errorf("must be positive")
			}
			*p = d
			return err
		}
	}
	// A setting whose other values would need ztunnel configured to match:
	// refused rather than half obeyed.
	fixed := func(want string) func(string) error {
		return func(v string) error {
			if v == "" || v == want {
				return nil
			}
			if a, err := netip.ParseAddr(v); err == nil && a == netip.MustParseAddr(want) {
				return nil
			}
			return fmt.Errorf("only %s is provided", want)
		}
	}
	am := &o.Ambient
	var repairNode string
	var ambientDisableSafeUpgrade bool
	defs := []optDef{
		{name: "mounted-cni-net-dir", help: "host CNI config dir as mounted in the agent", def: "/host/etc/cni/net.d", set: str(&in.MountedCNINetDir), istio: true},
		{name: "cni-conf-name", help: "CNI config file to use (empty: the runtime's choice)", set: str(&in.CNIConfName), istio: true},
		{name: "chained-cni-plugin", help: "insert into the primary config (false: write a standalone config)", def: "true", set: boolean(&in.Chained), istio: true},
		{name: "cni-agent-run-dir", help: "run dir shared with the plugin", def: "/var/run/istio-cni", set: func(v string) error {
			// The run dir is both where the agent writes and what the entry tells the plugin.
			in.RunDir, in.Entry.RunDir = v, v
			return nil
		}, istio: true},
		{name: "cni-bin-source-dir", help: "binaries to install", def: "/opt/cni/bin", set: str(&in.BinSourceDir)},
		{name: "cni-bin-target-dirs", help: "host CNI bin dirs, comma separated", def: "/host/opt/cni/bin", set: list(&in.BinTargetDirs)},
		{name: "kubeconfig-mode", help: "mode of the plugin kubeconfig", def: "0600", istio: true, set: func(v string) error {
			if v == "" {
				in.KubeconfigMode = 0
				return nil
			}
			m, err := strconv.ParseUint(v, 0, 32)
			if err != nil {
				return err
			}
			if m&^0o777 != 0 {
				// 600 reads as the number 600 (0o1130), as in Istio.
				return fmt.Errorf("mode %#o is not a file permission; write it in octal with a leading 0 (0600)", m)
			}
			in.KubeconfigMode = os.FileMode(m)
			return nil
		}},
		{name: "cni-conf-group-read", help: "make files the agent creates group readable", def: "false", set: boolean(&in.ConfGroupRead), istio: true},
		{name: "kube-ca-file", help: "CA for the plugin kubeconfig (default: the service account's)", set: str(&in.Kubeconfig.CAFile), istio: true},
		{name: "skip-tls-verify", help: "let the plugin skip API server certificate checks", def: "false", set: boolean(&in.Kubeconfig.SkipTLSVerify), istio: true},
		{name: "service-account-dir", help: "service account mount", def: "/var/run/secrets/kubernetes.io/serviceaccount", set: str(&in.Kubeconfig.ServiceAccountDir)},
		{name: "monitoring-port", help: "Prometheus metrics port (0 disables)", def: "15014", set: integer(&o.MonitoringPort), istio: true},
		{name: "readiness-port", help: "health and readiness port", def: "8000", set: integer(&o.ReadinessPort)},
		{name: "exclude-namespaces", help: "namespaces whose pods are never redirected", set: list(&in.Entry.ExcludeNamespaces), istio: true},
		{name: "pod-namespace", help: "the agent's namespace", set: str(&in.Entry.PodNamespace), istio: true},
		{name: "plugin-log-level", help: "plugin log level written into its config (default: the cni-plugin scope's level of --log_output_level)", set: func(v string) error {
			in.Entry.LogLevel = v
			return nil
		}},
		{name: "native-nftables", help: "rule backend: true (nftables over netlink), false (iptables) or auto (nftables when the host has no iptables)", def: "false", istio: true, set: func(v string) error {
			if strings.EqualFold(v, "auto") {
				o.NftablesAuto = true
				return nil
			}
			return boolean(&in.Entry.NativeNftables)(v)
		}},
		{name: "cni-rules-committer", help: "who writes a redirected pod's rules on ADD: plugin (the plugin process the runtime starts, in the runtime's cgroup, commits what the agent prepared) or agent (the agent's container does the work)", def: "plugin", set: func(v string) error {
			switch v {
			case cniserver.CommitterPlugin, cniserver.CommitterAgent:
				o.RulesCommitter = v
				return nil
			}
			return fmt.Errorf("want %s or %s", cniserver.CommitterPlugin, cniserver.CommitterAgent)
		}},
		{name: "cni-prepare-ahead", help: "decide and prepare each pod's ADD when the pod is bound to the node, so the plugin process serves the ADD without asking the agent (false: it always asks)", def: "true", set: boolean(&o.PrepareAhead)},
		{name: "cni-agent-wait", help: "with cni-prepare-ahead, how long the plugin process waits for the agent to answer an ADD it found no prepared record for, before it serves the pod with istio-cni-fallback (which reads the pod from the API server) and the agent drops the ADD; 0 waits as long as the agent takes", def: "25ms", set: nonNegative(&o.AgentWait)},
		{name: "host-root", help: "the host's root file system, for native-nftables=auto", def: "/host/proc/1/root", set: str(&o.HostRoot)},
		{name: "ambient-enabled", help: "ambient mode: enrol the pods the enablement selectors select and serve them to ztunnel", def: "false", set: boolean(&in.Entry.AmbientEnabled), istio: true},
		{name: "ambient-enablement-selector", help: "pods enrolled in ambient mode: Istio's YAML list of {podSelector, namespaceSelector} (empty: Istio's default)", set: str(&am.SelectorsYAML), istio: true},
		{name: "ambient-dns-capture", help: "ambient pods' DNS goes to ztunnel (pod annotation ambient.istio.io/dns-capture overrides)", def: "false", set: boolean(&am.DNSCapture), istio: true},
		{name: "ambient-ipv6", help: "ambient pods get IPv6 rules too", def: "false", set: boolean(&am.IPv6), istio: true},
		{name: "ambient-reconcile-pod-rules-on-startup", help: "accepted; the rules of enrolled pods are always re-applied at start and verified periodically", def: "false", set: boolean(&am.ReconcileOnStartup), istio: true},
		{name: "ambient-disable-safe-upgrade", help: "Istio's name of disable-safe-upgrade in ambient mode", def: "false", set: boolean(&ambientDisableSafeUpgrade), istio: true},
		{name: "ztunnel-uds-address", help: "ztunnel's socket, where the agent serves ztunnel in ambient mode", def: "/var/run/ztunnel/ztunnel.sock", set: str(&am.ZtunnelSocket), istio: true},
		{name: "enable-ambient-detection-retry", help: "written into the plugin's config as Istio does; this plugin never starts an enrolled pod unmeshed, retry or not", def: "false", set: boolean(&in.Entry.AmbientDetectionRetry), istio: true},
		{name: "allow-switch-to-host-ns", help: "the agent runs in a pod network of its own and writes the node's rules into the host's network namespace (repair-host-proc's 1/ns/net)", def: "false", set: boolean(&am.SwitchToHostNS), istio: true},
		{name: "ambient-node-netns", help: "with allow-switch-to-host-ns, the node's network namespace: empty (the kubelet's, found in the host's /proc, else PID 1's), kubelet (the kubelet's or fail), pid1 (Istio's choice) or a path", set: func(v string) error {
			if v != "" && v != "kubelet" && v != "pid1" && !filepath.IsAbs(v) {
				return fmt.Errorf("want kubelet, pid1 or an absolute path")
			}
			am.NodeNetns = v
			return nil
		}},
		{name: "ambient-ztunnel-wait", help: "how long an enrolled pod's ADD waits for ztunnel to be connected", def: ambient.DefaultZtunnelWait.String(), set: positive(&am.ZtunnelWait)},
		{name: "ambient-verify-interval", help: "how often every enrolled pod's rules and ztunnel's acknowledgement are verified", def: ambient.DefaultVerifyInterval.String(), set: positive(&am.VerifyInterval)},
		{name: "ambient-host-interval", help: "how often the node's probe SNAT rules and set are re-asserted", def: ambient.DefaultHostInterval.String(), set: positive(&am.HostInterval)},
		{name: "host-probe-snat-ip", help: "the kubelet's probes' source address in ambient mode; only Istio's default is provided", def: "169.254.7.127", set: fixed("169.254.7.127"), istio: true},
		{name: "host-probe-snat-ipv6", help: "the kubelet's probes' IPv6 source address in ambient mode; only Istio's default is provided", def: "fd16:9254:7127:1337:ffff:ffff:ffff:ffff", set: fixed("fd16:9254:7127:1337:ffff:ffff:ffff:ffff"), istio: true},
		{name: "disable-safe-upgrade", help: "remove the plugin on every termination, even during a rollout", def: "false", set: boolean(&o.DisableSafeUpgrade)},
		{name: "daemonset-name", help: "the agent's DaemonSet, checked on termination", def: "istio-cni-node", set: str(&o.DaemonSetName)},
		{name: "kubernetes-node-name", help: "this node (default: --repair-node-name, NODE_NAME, the host name)", set: str(&o.NodeName), istio: true},
		{name: "kubeconfig", help: "kubeconfig for the agent itself (default: in-cluster)", set: str(&o.Kubeconfig)},
		{name: "conflict-window", help: "window for detecting a component that reverts us", def: "10s", set: duration(&o.Loop.ConflictWindow)},
		{name: "conflict-limit", help: "rewrites within the window before backing off", def: "5", set: integer(&o.Loop.ConflictLimit)},
		{name: "resync-interval", help: "how often binaries, kubeconfig and config entry are checked besides the file watch; twice this is the liveness grace", def: "60s", set: func(v string) error {
			d, err := time.ParseDuration(v)
			if err == nil && d <= 0 {
				err = fmt.Errorf("must be positive")
			}
			o.Loop.ResyncInterval = d
			return err
		}},
		{name: "repair-enabled", help: "run the repair controller", def: "true", set: boolean(&o.RepairEnabled), istio: true},
		// Istio's binary defaults to false here; its chart sets true.
		{name: "repair-repair-pods", help: "repair broken pods in place", def: "false", set: boolean(&rp.RepairPods), istio: true},
		{name: "repair-delete-pods", help: "delete broken pods (when not repairing)", def: "false", set: boolean(&rp.DeletePods), istio: true},
		{name: "repair-label-pods", help: "label broken pods (when not repairing or deleting)", def: "false", set: boolean(&rp.LabelPods), istio: true},
		{name: "repair-broken-pod-label-key", help: "label key for broken pods", def: "cni.istio.io/uninitialized", set: str(&rp.LabelKey), istio: true},
		{name: "repair-broken-pod-label-value", help: "label value for broken pods", def: "true", set: str(&rp.LabelValue), istio: true},
		{name: "repair-init-container-name", help: "the validation init container", def: "istio-validation", set: str(&rp.InitContainerName), istio: true},
		{name: "repair-init-container-exit-code", help: "its exit code when the rules are missing", def: "126", set: int32Of(&rp.ExitCode), istio: true},
		{name: "repair-init-container-termination-message", help: "its termination message (empty: any)", set: str(&rp.TerminationMessage), istio: true},
		{name: "repair-sidecar-annotation", help: "annotation that marks pods with a sidecar", def: "sidecar.istio.io/status", set: str(&rp.SidecarAnnotation), istio: true},
		{name: "repair-host-proc", help: "the host's /proc, to find pod network namespaces", def: "/host/proc", set: str(&o.HostProcDir)},
		{name: "repair-label-selectors", help: "label selector (key=value,...) added to the repair controller's pod watch", istio: true,
			set: selector(&rp.LabelSelectors, func(v string) error { _, err := labels.Parse(v); return err })},
		{name: "repair-field-selectors", help: "field selector (field=value,...) added to the repair controller's pod watch", istio: true,
			set: selector(&rp.FieldSelectors, func(v string) error { _, err := fields.ParseSelector(v); return err })},
		{name: "repair-node-name", help: "the node whose pods are repaired (default: this node)", istio: true, set: func(v string) error {
			repairNode = v
			return nil
		}},
		// Istio's logging flags.
		{name: "log_output_level", help: "per-scope levels: <scope>:<level>,... (scopes default, cni-agent, cni-plugin, cni for both, all; levels debug, info, warn, error, none)", def: o.Log.OutputLevel, set: str(&o.Log.OutputLevel), env: "-"},
		{name: "log_stacktrace_level", help: "per-scope level at which stack traces are added", def: o.Log.StacktraceLevel, set: str(&o.Log.StacktraceLevel), env: "-"},
		{name: "log_caller", help: "scopes whose lines name their source line", set: str(&o.Log.Caller), env: "-"},
		{name: "log_as_json", help: "JSON lines instead of Istio's console format", def: "false", set: boolean(&o.Log.AsJSON), env: "-"},
		{name: "log_target", help: "where to log: stdout, stderr or a file path (repeatable)", def: "stdout", env: "-"},
		{name: "log_rotate", help: "a rotating log file, besides the targets", set: str(&o.Log.RotatePath), env: "-"},
		{name: "log_rotate_max_age", help: "days to keep rotated files (0: no limit)", def: "30", set: integer(&o.Log.RotateMaxAgeDays), env: "-"},
		{name: "log_rotate_max_size", help: "megabytes before the file is rotated", def: "104857600", set: integer(&o.Log.RotateMaxSizeMB), env: "-"},
		{name: "log_rotate_max_backups", help: "rotated files to keep (0: no limit)", def: "1000", set: integer(&o.Log.RotateMaxBackups), env: "-"},
		// Accepted so that Istio's manifests and command lines run unchanged.
		{name: "ctrlz_port", help: "Istio's ControlZ introspection port (not provided; ignored)", def: "9876", env: "-", ignored: "ControlZ is not provided; use :15014/metrics and the logs"},
		{name: "ctrlz_address", help: "Istio's ControlZ address (not provided; ignored)", def: "localhost", env: "-", ignored: "ControlZ is not provided"},
		{name: "log-level", help: "unused, as in Istio (the plugin's level follows --log_output_level)", ignored: "unused in Istio too; the plugin's level follows the cni-plugin scope of --log_output_level"},
		{name: "cni-network-config", help: "unused, as in Istio", ignored: "unused in Istio too"},
		{name: "cni-network-config-file", help: "unused, as in Istio", ignored: "unused in Istio too"},
		{name: "istio-owned-cni-config", help: "in chained ambient mode, leave the primary config untouched and write a copy of it with the plugin under istio-owned-cni-config-filename, which sorts first (a primary that rewrites its file at boot cannot drop the plugin)", def: "false", set: boolean(&in.IstioOwned), istio: true},
		{name: "istio-owned-cni-config-filename", help: "the Istio-owned config's name; without istio-owned-cni-config, one left there (by Istio's agent, or this one before the setting changed) is removed once the plugin is in the primary config, as it would shadow the primary", def: install.DefaultIstioOwnedConfName, set: str(&in.IstioOwnedConfName), istio: true},
	}
	// Older Istio releases' settings, accepted so that their manifests start.
	for _, name := range []string{"cni-net-dir", "kubecfg-file-name", "update-cni-binaries", "skip-cni-binaries", "log-uds-address", "ebpf-enabled"} {
		// Their boolean flags keep their bare form (--update-cni-binaries).
		isBool := name == "update-cni-binaries" || name == "ebpf-enabled"
		defs = append(defs, optDef{name: name, help: "older Istio releases' setting, ignored", ignored: "a setting of older Istio releases, without effect today", isBool: isBool})
	}
	// Istio's chart still sets it, and Istio's agent does not read it
	// either: no note.
	defs = append(defs, optDef{name: "repair-run-as-daemon", help: "set by Istio's chart, unused (as in Istio)", isBool: true, set: func(string) error { return nil }})
	for _, name := range []string{"v", "stderrthreshold", "alsologtostderr", "logtostderr"} {
		defs = append(defs, optDef{name: name, help: "deprecated in Istio, ignored", env: "-", isBool: strings.HasSuffix(name, "tostderr"),
			ignored: "deprecated in Istio; use --log_output_level and --log_target"})
	}
	fs := flag.NewFlagSet("install-cni", flag.ContinueOnError)
	values := map[string]*rawFlag{}
	for _, d := range defs {
		// native-nftables also takes "auto", so it needs its value.
		values[d.name] = &rawFlag{isBool: d.isBool || (d.def == "true" || d.def == "false") && d.name != "native-nftables"}
		env := ""
		if e := d.envName(); e != "" {
			env = "env " + e + ", "
		}
		fs.Var(values[d.name], d.name, fmt.Sprintf("%s (%sdefault %q)", d.help, env, d.def))
	}
	if err := fs.Parse(args); err != nil {
		return nil, err
	}
	if fs.NArg() > 0 {
		return nil, fmt.Errorf("unexpected arguments %q (flags take --name=value)", fs.Args())
	}
	setFlags := map[string]bool{}
	fs.Visit(func(f *flag.Flag) { setFlags[f.Name] = true })
	for _, d := range defs {
		v, src := d.def, "default"
		if e := d.envName(); e != "" {
			if ev, ok := lookupEnv(e); ok && (ev != "" || d.istio) {
				v, src = ev, "env "+e
				if strings.HasSuffix(e, "_PORT") && serviceLink(ev) && !setFlags[d.name] {
					// The kubelet's variable for a Service named after
					// the setting (a "monitoring" Service in the agent's
					// namespace sets MONITORING_PORT=tcp://...). Istio
					// reads it as 0 and serves no metrics.
					o.Notes = append(o.Notes, fmt.Sprintf("env %s=%q is the kubelet's link to a Service of that name, not a port; the default %s is used (set enableServiceLinks: false, or the flag, to silence this)", e, ev, d.def))
					v, src = d.def, "default"
				}
			}
		}
		if setFlags[d.name] {
			v, src = values[d.name].v, "flag --"+d.name
		}
		if d.ignored != "" {
			if src != "default" && (!d.isBool || v != "" && v != "false") {
				o.Notes = append(o.Notes, fmt.Sprintf("%s=%q is accepted for compatibility with Istio and ignored: %s", src, v, d.ignored))
			}
			continue
		}
		if d.name == "log_target" {
			if setFlags[d.name] {
				o.Log.Targets = values[d.name].all
			}
			continue
		}
		if d.name == "plugin-log-level" {
			o.PluginLogLevelSet = src != "default"
		}
		if err := d.set(v); err != nil {
			return nil, fmt.Errorf("invalid %s value %q: %w", src, v, err)
		}
	}
	if in.IstioOwnedConfName == "" {
		// Istio's default for an empty value.
		in.IstioOwnedConfName = install.DefaultIstioOwnedConfName
	}
	if in.IstioOwned && (!in.Chained || !in.Entry.AmbientEnabled) {
		// As in Istio, where it takes effect only there.
		o.Notes = append(o.Notes, "ISTIO_OWNED_CNI_CONFIG=true takes effect only in ambient mode with the chained plugin, as in Istio; the plugin goes into the primary config")
		in.IstioOwned = false
	}
	if in.IstioOwned && (filepath.Base(in.IstioOwnedConfName) != in.IstioOwnedConfName || !install.IsList(in.IstioOwnedConfName)) {
		return nil, fmt.Errorf("istio-owned-cni-config-filename (env ISTIO_OWNED_CNI_CONFIG_FILENAME) %q: want a file name ending in .conflist, such as %s", in.IstioOwnedConfName, install.DefaultIstioOwnedConfName)
	}
	if in.IstioOwned && in.CNIConfName != "" && install.ListName(in.CNIConfName) == in.IstioOwnedConfName {
		// The agent would wait for ever for a primary of that name.
		return nil, fmt.Errorf("cni-conf-name (env CNI_CONF_NAME) %q names the Istio-owned copy (%s); name the primary's config, or leave it empty", in.CNIConfName, in.IstioOwnedConfName)
	}
	// Either name forces the clean-up, whichever is read first.
	o.DisableSafeUpgrade = o.DisableSafeUpgrade || ambientDisableSafeUpgrade
	// An older chart's spelling of EXCLUDE_NAMESPACES.
	if v, ok := lookupEnv("EXCLUDED_NAMESPACES"); ok && len(in.Entry.ExcludeNamespaces) == 0 {
		_ = list(&in.Entry.ExcludeNamespaces)(v)
	}
	// Where the plugin reaches the API server, as the kubelet tells every
	// pod; and the plugin's own variant override. Environment only, as in
	// Istio.
	in.Kubeconfig.Protocol, _ = lookupEnv("KUBERNETES_SERVICE_PROTOCOL")
	in.Kubeconfig.Host, _ = lookupEnv("KUBERNETES_SERVICE_HOST")
	in.Kubeconfig.Port, _ = lookupEnv("KUBERNETES_SERVICE_PORT")
	o.ForceIPTablesBinary, _ = lookupEnv("FORCE_IPTABLES_BINARY")
	switch o.ForceIPTablesBinary {
	case "", "legacy", "nft":
	default:
		// Every ADD would fail on it.
		return nil, fmt.Errorf("FORCE_IPTABLES_BINARY=%q: want legacy or nft, or leave it unset to detect the variant", o.ForceIPTablesBinary)
	}
	if o.NodeName == "" {
		o.NodeName = repairNode
	}
	for _, k := range []string{"REPAIR_NODE_NAME", "NODE_NAME"} {
		if o.NodeName == "" {
			o.NodeName, _ = lookupEnv(k)
		}
	}
	if o.NodeName == "" {
		o.NodeName, _ = os.Hostname()
	}
	if in.Entry.AmbientEnabled {
		sel, err := ambient.ParseSelectors(am.SelectorsYAML)
		if err != nil {
			return nil, fmt.Errorf("invalid AMBIENT_ENABLEMENT_SELECTOR: %w", err)
		}
		am.Selectors = sel
		if in.Entry.EnablementSelectors, err = json.Marshal(sel.Source()); err != nil {
			return nil, fmt.Errorf("AMBIENT_ENABLEMENT_SELECTOR: %w", err)
		}
		if !am.ReconcileOnStartup {
			o.Notes = append(o.Notes, "AMBIENT_RECONCILE_POD_RULES_ON_STARTUP=false is accepted for compatibility with Istio and ignored: "+
				"enrolled pods' rules are always re-applied at start and verified periodically")
		}
		if am.ZtunnelSocket == "" {
			return nil, fmt.Errorf("ztunnel-uds-address (env ZTUNNEL_UDS_ADDRESS) is empty")
		}
	}
	// Empty is what Istio would take from an empty variable, but a node
	// agent cannot work without these two.
	for name, v := range map[string]string{"mounted-cni-net-dir": in.MountedCNINetDir, "cni-agent-run-dir": in.RunDir} {
		if v == "" {
			return nil, fmt.Errorf("%s (env %s) is empty", name, envName(name))
		}
	}
	return o, nil
}

func (d optDef) envName() string {
	switch d.env {
	case "-":
		return ""
	case "":
		return envName(d.name)
	}
	return d.env
}

func envName(flagName string) string {
	return strings.ToUpper(strings.ReplaceAll(flagName, "-", "_"))
}
