// Package agent composes the node agent (install-cni): installer, watch
// loop, health and metrics servers, and clean-up on termination.
package agent

import (
	"flag"
	"fmt"
	"os"
	"strconv"
	"strings"
	"time"
)

// Options are the agent's settings. Each is a flag (--kebab-case) and an
// environment variable (UPPER_SNAKE_CASE) with Istio's names; a flag that
// is set wins over the environment.
type Options struct {
	CNINetDir         string
	CNIConfName       string
	Chained           bool
	RunDir            string
	BinSourceDir      string
	BinTargetDirs     []string
	KubeconfigMode    os.FileMode
	ConfGroupRead     bool
	KubeCAFile        string
	SkipTLSVerify     bool
	ServiceAccountDir string
	MonitoringPort    int
	ReadinessPort     int
	ExcludeNamespaces []string
	PodNamespace      string
	PluginLogLevel    string
	NativeNftables    bool
	// NftablesAuto picks nftables when the host has no iptables binary.
	NftablesAuto bool
	// HostRoot is the host's root file system as the agent sees it.
	HostRoot       string
	AmbientEnabled bool
	// DisableSafeUpgrade removes the plugin on every termination, even
	// while the DaemonSet still exists (a rollout or a node reboot).
	DisableSafeUpgrade bool
	DaemonSetName      string
	NodeName           string
	// Kubeconfig is for the agent's own API access outside a pod.
	Kubeconfig string
	// ConflictWindow and ConflictLimit: more rewrites than the limit within
	// the window means another component keeps reverting us.
	ConflictWindow time.Duration
	ConflictLimit  int

	RepairEnabled       bool
	RepairPods          bool
	RepairDeletePods    bool
	RepairLabelPods     bool
	RepairLabelKey      string
	RepairLabelValue    string
	RepairInitContainer string
	RepairExitCode      int
	RepairTermMessage   string
	RepairSidecarAnno   string
	HostProcDir         string
}

type optDef struct {
	name, help, def string
	set             func(string) error
}

// rawFlag keeps a flag's text for later parsing; boolean options accept
// the bare form (--disable-safe-upgrade).
type rawFlag struct {
	v      string
	isBool bool
}

func (f *rawFlag) String() string     { return f.v }
func (f *rawFlag) Set(v string) error { f.v = v; return nil }
func (f *rawFlag) IsBoolFlag() bool   { return f.isBool }

// ParseOptions reads flags from args and the environment from getenv.
func ParseOptions(args []string, getenv func(string) string) (*Options, error) {
	o := &Options{}
	str := func(p *string) func(string) error { return func(v string) error { *p = v; return nil } }
	boolean := func(p *bool) func(string) error {
		return func(v string) error {
			b, err := strconv.ParseBool(v)
			*p = b
			return err
		}
	}
	integer := func(p *int) func(string) error {
		return func(v string) error {
			n, err := strconv.Atoi(v)
			*p = n
			return err
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
	defs := []optDef{
		{"mounted-cni-net-dir", "host CNI config dir as mounted in the agent", "/host/etc/cni/net.d", str(&o.CNINetDir)},
		{"cni-conf-name", "CNI config file to use (empty: the runtime's choice)", "", str(&o.CNIConfName)},
		{"chained-cni-plugin", "insert into the primary config (false: write a standalone config)", "true", boolean(&o.Chained)},
		{"cni-agent-run-dir", "run dir shared with the plugin", "/var/run/istio-cni", str(&o.RunDir)},
		{"cni-bin-source-dir", "binaries to install", "/opt/cni/bin", str(&o.BinSourceDir)},
		{"cni-bin-target-dirs", "host CNI bin dirs, comma separated", "/host/opt/cni/bin", list(&o.BinTargetDirs)},
		{"kubeconfig-mode", "mode of the plugin kubeconfig", "0600", func(v string) error {
			m, err := strconv.ParseUint(v, 0, 32)
			o.KubeconfigMode = os.FileMode(m)
			return err
		}},
		{"cni-conf-group-read", "make files the agent creates group readable", "false", boolean(&o.ConfGroupRead)},
		{"kube-ca-file", "CA for the plugin kubeconfig (default: the service account's)", "", str(&o.KubeCAFile)},
		{"skip-tls-verify", "let the plugin skip API server certificate checks", "false", boolean(&o.SkipTLSVerify)},
		{"service-account-dir", "service account mount", "/var/run/secrets/kubernetes.io/serviceaccount", str(&o.ServiceAccountDir)},
		{"monitoring-port", "Prometheus metrics port (0 disables)", "15014", integer(&o.MonitoringPort)},
		{"readiness-port", "health and readiness port", "8000", integer(&o.ReadinessPort)},
		{"exclude-namespaces", "namespaces whose pods are never redirected", "", list(&o.ExcludeNamespaces)},
		{"pod-namespace", "the agent's namespace", "", str(&o.PodNamespace)},
		{"plugin-log-level", "plugin log level written into its config", "info", str(&o.PluginLogLevel)},
		{"native-nftables", "rule backend: true (nftables over netlink), false (iptables) or auto (nftables when the host has no iptables)", "false", func(v string) error {
			if strings.EqualFold(v, "auto") {
				o.NftablesAuto = true
				return nil
			}
			b, err := strconv.ParseBool(v)
			o.NativeNftables = b
			return err
		}},
		{"host-root", "the host's root file system, for native-nftables=auto", "/host/proc/1/root", str(&o.HostRoot)},
		{"ambient-enabled", "ambient mode flag passed to the plugin", "false", boolean(&o.AmbientEnabled)},
		{"disable-safe-upgrade", "remove the plugin on every termination, even during a rollout", "false", boolean(&o.DisableSafeUpgrade)},
		{"daemonset-name", "the agent's DaemonSet, checked on termination", "istio-cni-node", str(&o.DaemonSetName)},
		{"kubernetes-node-name", "this node", "", str(&o.NodeName)},
		{"kubeconfig", "kubeconfig for the agent itself (default: in-cluster)", "", str(&o.Kubeconfig)},
		{"conflict-window", "window for detecting a component that reverts us", "10s", func(v string) error {
			d, err := time.ParseDuration(v)
			o.ConflictWindow = d
			return err
		}},
		{"conflict-limit", "rewrites within the window before backing off", "5", integer(&o.ConflictLimit)},
		{"repair-enabled", "run the repair controller", "true", boolean(&o.RepairEnabled)},
		{"repair-repair-pods", "repair broken pods in place", "true", boolean(&o.RepairPods)},
		{"repair-delete-pods", "delete broken pods (when not repairing)", "false", boolean(&o.RepairDeletePods)},
		{"repair-label-pods", "label broken pods (when not repairing or deleting)", "false", boolean(&o.RepairLabelPods)},
		{"repair-broken-pod-label-key", "label key for broken pods", "cni.istio.io/uninitialized", str(&o.RepairLabelKey)},
		{"repair-broken-pod-label-value", "label value for broken pods", "true", str(&o.RepairLabelValue)},
		{"repair-init-container-name", "the validation init container", "istio-validation", str(&o.RepairInitContainer)},
		{"repair-init-container-exit-code", "its exit code when the rules are missing", "126", integer(&o.RepairExitCode)},
		{"repair-init-container-termination-message", "its termination message (empty: any)", "", str(&o.RepairTermMessage)},
		{"repair-sidecar-annotation", "annotation that marks pods with a sidecar", "sidecar.istio.io/status", str(&o.RepairSidecarAnno)},
		{"repair-host-proc", "the host's /proc, to find pod network namespaces", "/host/proc", str(&o.HostProcDir)},
	}
	fs := flag.NewFlagSet("install-cni", flag.ContinueOnError)
	values := map[string]*rawFlag{}
	for _, d := range defs {
		values[d.name] = &rawFlag{isBool: (d.def == "true" || d.def == "false") && d.name != "native-nftables"}
		fs.Var(values[d.name], d.name, fmt.Sprintf("%s (env %s, default %q)", d.help, envName(d.name), d.def))
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
		if e := getenv(envName(d.name)); e != "" {
			v, src = e, "env "+envName(d.name)
		}
		if setFlags[d.name] {
			v, src = values[d.name].v, "flag --"+d.name
		}
		if err := d.set(v); err != nil {
			return nil, fmt.Errorf("invalid %s value %q: %w", src, v, err)
		}
	}
	for _, k := range []string{"REPAIR_NODE_NAME", "NODE_NAME"} {
		if o.NodeName == "" {
			o.NodeName = getenv(k)
		}
	}
	if o.NodeName == "" {
		o.NodeName, _ = os.Hostname()
	}
	if o.KubeconfigMode&^0o777 != 0 {
		return nil, fmt.Errorf("invalid kubeconfig-mode %o", o.KubeconfigMode)
	}
	return o, nil
}

func envName(flagName string) string {
	return strings.ToUpper(strings.ReplaceAll(flagName, "-", "_"))
}
