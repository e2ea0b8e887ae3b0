package agent

import (
	"encoding/json"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/istio-cni-go/istio-cni/internal/ambient"
	"github.com/istio-cni-go/istio-cni/internal/enablement"
	"github.com/istio-cni-go/istio-cni/internal/install"
	"github.com/istio-cni-go/istio-cni/internal/plugin"
)

func TestParseOptions(t *testing.T) {
	env := map[string]string{"CHAINED_CNI_PLUGIN": "false", "EXCLUDE_NAMESPACES": "kube-system, istio-system ,", "CNI_CONF_NAME": "10-x.conflist", "KUBECONFIG_MODE": "0640"}
	o, err := ParseOptions([]string{"--cni-conf-name", "20-y.conflist", "--disable-safe-upgrade"}, envOf(env))
	if err != nil {
		t.Fatal(err)
	}
	if o.Loop.Install.Chained || o.Loop.Install.CNIConfName != "20-y.conflist" || !o.DisableSafeUpgrade || o.Loop.Install.KubeconfigMode != 0o640 {
		t.Fatalf("flags/env precedence wrong: %+v", o)
	}
	if strings.Join(o.Loop.Install.Entry.ExcludeNamespaces, ",") != "kube-system,istio-system" {
		t.Fatalf("exclude namespaces %q", o.Loop.Install.Entry.ExcludeNamespaces)
	}
	if o.Loop.Install.MountedCNINetDir != "/host/etc/cni/net.d" || o.Loop.Install.RunDir != "/var/run/istio-cni" || o.MonitoringPort != 15014 || o.ReadinessPort != 8000 {
		t.Fatalf("defaults: %+v", o)
	}
	for _, bad := range [][]string{{"--monitoring-port", "x"}, {"--kubeconfig-mode", "01777"}, {"--chained-cni-plugin=maybe"}, {"--nope"}} {
		if _, err := ParseOptions(bad, envOf(nil)); err == nil {
			t.Errorf("%v accepted", bad)
		}
	}
	if _, err := ParseOptions(nil, envOf(map[string]string{"REPAIR_ENABLED": "x", "MONITORING_PORT": "abc"})); err == nil || !strings.Contains(err.Error(), "MONITORING_PORT") {
		t.Errorf("bad env value must name the variable: %v", err)
	}
}

func envOf(m map[string]string) func(string) (string, bool) {
	return func(k string) (string, bool) { v, ok := m[k]; return v, ok }
}

// Istio's DaemonSet passes its logging flags; the agent must start with
// every one of them, with Istio's meaning where it applies.
func TestIstioLoggingFlags(t *testing.T) {
	dir := t.TempDir()
	args := []string{"--log_output_level=default:warn,cni-plugin:debug", "--log_as_json", "--log_caller=cni-agent",
		"--log_stacktrace_level=default:none", "--log_rotate=" + filepath.Join(dir, "rot.log"), "--log_rotate_max_age=3",
		"--log_rotate_max_backups=2", "--log_rotate_max_size=10", "--log_target=stdout", "--log_target=" + filepath.Join(dir, "t.log"),
		"--ctrlz_port=9876", "--ctrlz_address=127.0.0.1", "--logtostderr", "-v=2"}
	o, err := ParseOptions(args, envOf(nil))
	if err != nil {
		t.Fatal(err)
	}
	l := o.Log
	if l.OutputLevel != "default:warn,cni-plugin:debug" || !l.AsJSON || l.Caller != "cni-agent" || l.RotateMaxAgeDays != 3 ||
		l.RotateMaxBackups != 2 || l.RotateMaxSizeMB != 10 || strings.Join(l.Targets, ",") != "stdout,"+filepath.Join(dir, "t.log") {
		t.Fatalf("logging options: %+v", l)
	}
	notes := strings.Join(o.Notes, "\n")
	for _, want := range []string{"--ctrlz_port", "--ctrlz_address", "--logtostderr", "flag --v"} {
		if !strings.Contains(notes, want) {
			t.Errorf("start-up notes do not say %s is ignored:\n%s", want, notes)
		}
	}
	if o.PluginLogLevelSet {
		t.Error("plugin level must follow --log_output_level unless plugin-log-level is given")
	}
	d, err := ParseOptions(nil, envOf(nil))
	if err != nil {
		t.Fatal(err)
	}
	if d.Log.AsJSON || strings.Join(d.Log.Targets, ",") != "stdout" || d.Log.OutputLevel != "default:info" || len(d.Notes) != 0 {
		t.Fatalf("Istio's logging defaults: %+v, notes %q", d.Log, d.Notes)
	}
}

// Istio reads its settings with viper's AllowEmptyEnv: a variable that
// is set but empty counts as "", false or 0. Our own keys treat empty as
// unset, and the two directories the agent cannot work without are refused.
func TestEmptyEnvironmentValues(t *testing.T) {
	o, err := ParseOptions(nil, envOf(map[string]string{"REPAIR_ENABLED": "", "MONITORING_PORT": "", "CNI_CONF_NAME": "",
		"CHAINED_CNI_PLUGIN": "", "READINESS_PORT": "", "REPAIR_INIT_CONTAINER_NAME": "", "NATIVE_NFTABLES": ""}))
	if err != nil {
		t.Fatal(err)
	}
	if o.RepairEnabled || o.MonitoringPort != 0 || o.Loop.Install.Chained || o.ReadinessPort != 8000 || o.Repair.InitContainerName != "" || o.Loop.Install.Entry.NativeNftables {
		t.Fatalf("empty values: %+v", o)
	}
	if o.Repair.RepairPods {
		t.Fatal("REPAIR_REPAIR_PODS must default to false, as Istio's binary does (its chart sets true)")
	}
	for _, k := range []string{"MOUNTED_CNI_NET_DIR", "CNI_AGENT_RUN_DIR"} {
		if _, err := ParseOptions(nil, envOf(map[string]string{k: ""})); err == nil || !strings.Contains(err.Error(), k) {
			t.Errorf("empty %s: %v", k, err)
		}
	}
	o, err = ParseOptions(nil, envOf(map[string]string{"EXCLUDED_NAMESPACES": "a,b", "REPAIR_NODE_NAME": "n1"}))
	if err != nil || strings.Join(o.Loop.Install.Entry.ExcludeNamespaces, ",") != "a,b" || o.NodeName != "n1" {
		t.Fatalf("older chart's names: %+v %v", o, err)
	}
}

func TestRepairSelectors(t *testing.T) {
	o, err := ParseOptions([]string{"--repair-label-selectors=app=web,tier!=db"}, envOf(map[string]string{"REPAIR_FIELD_SELECTORS": "status.phase=Running"}))
	if err != nil || o.Repair.LabelSelectors != "app=web,tier!=db" || o.Repair.FieldSelectors != "status.phase=Running" {
		t.Fatalf("selectors: %+v %v", o, err)
	}
	for _, bad := range []map[string]string{{"REPAIR_LABEL_SELECTORS": "app in (a"}, {"REPAIR_FIELD_SELECTORS": "status.phase~Running"}} {
		_, err := ParseOptions(nil, envOf(bad))
		for k := range bad {
			if err == nil || !strings.Contains(err.Error(), k) {
				t.Errorf("%v: error must name %s: %v", bad, k, err)
			}
		}
	}
}

// The committer defaults to the plugin process; the agent can be told to
// do the work; anything else is refused, naming the variable.
func TestRulesCommitter(t *testing.T) {
	for _, c := range []struct {
		args []string
		env  map[string]string
		want string
	}{
		{want: "plugin"},
		{env: map[string]string{"CNI_RULES_COMMITTER": "agent"}, want: "agent"},
		{args: []string{"--cni-rules-committer", "plugin"}, env: map[string]string{"CNI_RULES_COMMITTER": "agent"}, want: "plugin"},
	} {
		o, err := ParseOptions(c.args, envOf(c.env))
		if err != nil || o.RulesCommitter != c.want {
			t.Errorf("%v %v: committer %q (%v), want %q", c.args, c.env, o.RulesCommitter, err, c.want)
		}
	}
	_, err := ParseOptions(nil, envOf(map[string]string{"CNI_RULES_COMMITTER": "runtime"}))
	if err == nil || !strings.Contains(err.Error(), "CNI_RULES_COMMITTER") {
		t.Fatalf("an unknown committer: %v", err)
	}
}

func TestNftablesAuto(t *testing.T) {
	o, err := ParseOptions([]string{"--native-nftables", "auto"}, envOf(nil))
	if err != nil || !o.NftablesAuto || o.Loop.Install.Entry.NativeNftables {
		t.Fatalf("auto: %+v %v", o, err)
	}
	if _, err := ParseOptions([]string{"--native-nftables", "sometimes"}, envOf(nil)); err == nil {
		t.Fatal("bad backend accepted")
	}
	bare := t.TempDir()
	if has, err := HostHasIPTables(bare); err != nil || has {
		t.Fatalf("empty root: %v %v", has, err)
	}
	withIPT := t.TempDir()
	if err := os.MkdirAll(filepath.Join(withIPT, "usr", "sbin"), 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.Symlink("xtables-nft-multi", filepath.Join(withIPT, "usr", "sbin", "iptables-nft-restore")); err != nil {
		t.Fatal(err)
	}
	if has, err := HostHasIPTables(withIPT); err != nil || !has {
		t.Fatalf("root with iptables-nft-restore: %v %v", has, err)
	}
	if _, err := HostHasIPTables(filepath.Join(bare, "missing")); err == nil {
		t.Fatal("missing root not reported")
	}
}

// TestAmbientOptionDefaults: with nothing set, ambient mode is off, its
// settings have Istio's binary defaults and our waits, and nothing goes
// into the plugin entry (the installer then writes Istio's [] and false).
func TestAmbientOptionDefaults(t *testing.T) {
	o, err := ParseOptions(nil, envOf(nil))
	if err != nil {
		t.Fatal(err)
	}
	am, e := o.Ambient, o.Loop.Install.Entry
	if e.AmbientEnabled || e.EnablementSelectors != nil || e.AmbientDetectionRetry || am.Selectors != nil || am.SelectorsYAML != "" {
		t.Fatalf("ambient off by default: entry %+v, ambient %+v", e, am)
	}
	if am.DNSCapture || am.IPv6 || am.ReconcileOnStartup || am.SwitchToHostNS || o.DisableSafeUpgrade {
		t.Fatalf("boolean defaults (Istio's binary's, all false): %+v, DisableSafeUpgrade %v", am, o.DisableSafeUpgrade)
	}
	if am.ZtunnelSocket != "/var/run/ztunnel/ztunnel.sock" {
		t.Fatalf("ZTUNNEL_UDS_ADDRESS default %q", am.ZtunnelSocket)
	}
	if am.ZtunnelWait != ambient.DefaultZtunnelWait || am.VerifyInterval != ambient.DefaultVerifyInterval || am.HostInterval != ambient.DefaultHostInterval {
		t.Fatalf("waits %v %v %v", am.ZtunnelWait, am.VerifyInterval, am.HostInterval)
	}
	if len(o.Notes) != 0 {
		t.Fatalf("notes without ambient mode: %q", o.Notes)
	}
}

// TestAmbientOptions: each of ambient mode's settings, from the
// environment with Istio's name and from its flag.
func TestAmbientOptions(t *testing.T) {
	for _, c := range []struct {
		name  string
		args  []string
		env   map[string]string
		check func(o *Config) bool
	}{
		{"AMBIENT_ENABLED", nil, map[string]string{"AMBIENT_ENABLED": "true"}, func(o *Config) bool {
			return o.Loop.Install.Entry.AmbientEnabled && o.Ambient.Selectors != nil
		}},
		{"AMBIENT_DNS_CAPTURE", nil, map[string]string{"AMBIENT_DNS_CAPTURE": "true"}, func(o *Config) bool { return o.Ambient.DNSCapture }},
		{"--ambient-dns-capture", []string{"--ambient-dns-capture"}, nil, func(o *Config) bool { return o.Ambient.DNSCapture }},
		{"AMBIENT_IPV6", nil, map[string]string{"AMBIENT_IPV6": "true"}, func(o *Config) bool { return o.Ambient.IPv6 }},
		{"AMBIENT_IPV6 empty is false", nil, map[string]string{"AMBIENT_IPV6": ""}, func(o *Config) bool { return !o.Ambient.IPv6 }},
		{"AMBIENT_RECONCILE_POD_RULES_ON_STARTUP", nil, map[string]string{"AMBIENT_RECONCILE_POD_RULES_ON_STARTUP": "true"}, func(o *Config) bool {
			return o.Ambient.ReconcileOnStartup
		}},
		{"AMBIENT_DISABLE_SAFE_UPGRADE", nil, map[string]string{"AMBIENT_DISABLE_SAFE_UPGRADE": "true"}, func(o *Config) bool { return o.DisableSafeUpgrade }},
		{"--ambient-disable-safe-upgrade", []string{"--ambient-disable-safe-upgrade=true"}, nil, func(o *Config) bool { return o.DisableSafeUpgrade }},
		{"AMBIENT_DISABLE_SAFE_UPGRADE false keeps DISABLE_SAFE_UPGRADE", nil,
			map[string]string{"AMBIENT_DISABLE_SAFE_UPGRADE": "false", "DISABLE_SAFE_UPGRADE": "true"}, func(o *Config) bool { return o.DisableSafeUpgrade }},
		{"AMBIENT_DISABLE_SAFE_UPGRADE false", nil, map[string]string{"AMBIENT_DISABLE_SAFE_UPGRADE": "false"}, func(o *Config) bool { return !o.DisableSafeUpgrade }},
		{"ZTUNNEL_UDS_ADDRESS", nil, map[string]string{"ZTUNNEL_UDS_ADDRESS": "/run/zt/z.sock"}, func(o *Config) bool { return o.Ambient.ZtunnelSocket == "/run/zt/z.sock" }},
		{"--ztunnel-uds-address", []string{"--ztunnel-uds-address=/a.sock"}, map[string]string{"ZTUNNEL_UDS_ADDRESS": "/b.sock"}, func(o *Config) bool {
			return o.Ambient.ZtunnelSocket == "/a.sock"
		}},
		{"ENABLE_AMBIENT_DETECTION_RETRY goes into the entry", nil, map[string]string{"ENABLE_AMBIENT_DETECTION_RETRY": "true"}, func(o *Config) bool {
			return o.Loop.Install.Entry.AmbientDetectionRetry
		}},
		{"ALLOW_SWITCH_TO_HOST_NS", nil, map[string]string{"ALLOW_SWITCH_TO_HOST_NS": "true"}, func(o *Config) bool { return o.Ambient.SwitchToHostNS }},
		{"AMBIENT_ZTUNNEL_WAIT", nil, map[string]string{"AMBIENT_ZTUNNEL_WAIT": "1500ms"}, func(o *Config) bool { return o.Ambient.ZtunnelWait == 1500*time.Millisecond }},
		{"AMBIENT_ZTUNNEL_WAIT empty is the default", nil, map[string]string{"AMBIENT_ZTUNNEL_WAIT": ""}, func(o *Config) bool {
			return o.Ambient.ZtunnelWait == ambient.DefaultZtunnelWait
		}},
		{"AMBIENT_VERIFY_INTERVAL", nil, map[string]string{"AMBIENT_VERIFY_INTERVAL": "2m"}, func(o *Config) bool { return o.Ambient.VerifyInterval == 2*time.Minute }},
		{"AMBIENT_HOST_INTERVAL", nil, map[string]string{"AMBIENT_HOST_INTERVAL": "45s"}, func(o *Config) bool { return o.Ambient.HostInterval == 45*time.Second }},
		{"HOST_PROBE_SNAT_IP Istio's default", nil, map[string]string{"HOST_PROBE_SNAT_IP": "169.254.7.127"}, func(*Config) bool { return true }},
		{"HOST_PROBE_SNAT_IP empty", nil, map[string]string{"HOST_PROBE_SNAT_IP": ""}, func(*Config) bool { return true }},
		{"HOST_PROBE_SNAT_IPV6 Istio's default in another spelling", nil,
			map[string]string{"HOST_PROBE_SNAT_IPV6": "FD16:9254:7127:1337:FFFF:FFFF:FFFF:FFFF"}, func(*Config) bool { return true }},
	} {
		o, err := ParseOptions(c.args, envOf(c.env))
		if err != nil {
			t.Errorf("%s: %v", c.name, err)
			continue
		}
		if !c.check(o) {
			t.Errorf("%s: not taken: ambient %+v, entry %+v, DisableSafeUpgrade %v", c.name, o.Ambient, o.Loop.Install.Entry, o.DisableSafeUpgrade)
		}
	}
}

// TestAmbientOptionErrors: a value the agent cannot honour stops it,
// naming the variable.
func TestAmbientOptionErrors(t *testing.T) {
	on := func(kv ...string) map[string]string {
		m := map[string]string{"AMBIENT_ENABLED": "true"}
		for i := 0; i+1 < len(kv); i += 2 {
			m[kv[i]] = kv[i+1]
		}
		return m
	}
	for _, c := range []struct {
		env  map[string]string
		want string
	}{
		{on("HOST_PROBE_SNAT_IP", "10.0.0.1"), "HOST_PROBE_SNAT_IP"},
		{on("HOST_PROBE_SNAT_IP", "not-an-ip"), "HOST_PROBE_SNAT_IP"},
		{map[string]string{"HOST_PROBE_SNAT_IP": "169.254.7.1"}, "HOST_PROBE_SNAT_IP"},
		{on("HOST_PROBE_SNAT_IPV6", "fd16::1"), "HOST_PROBE_SNAT_IPV6"},
		{on("AMBIENT_ZTUNNEL_WAIT", "0s"), "AMBIENT_ZTUNNEL_WAIT"},
		{on("AMBIENT_ZTUNNEL_WAIT", "-1s"), "AMBIENT_ZTUNNEL_WAIT"},
		{on("AMBIENT_ZTUNNEL_WAIT", "soon"), "AMBIENT_ZTUNNEL_WAIT"},
		{on("AMBIENT_VERIFY_INTERVAL", "0"), "AMBIENT_VERIFY_INTERVAL"},
		{on("AMBIENT_HOST_INTERVAL", "-5m"), "AMBIENT_HOST_INTERVAL"},
		{on("AMBIENT_DNS_CAPTURE", "yes please"), "AMBIENT_DNS_CAPTURE"},
		{on("AMBIENT_ENABLED", "maybe"), "AMBIENT_ENABLED"},
		{on("ZTUNNEL_UDS_ADDRESS", ""), "ZTUNNEL_UDS_ADDRESS"},
		{on("AMBIENT_ENABLEMENT_SELECTOR", "- podSelecter: {matchLabels: {a: b}}"), "AMBIENT_ENABLEMENT_SELECTOR"},
		{on("AMBIENT_ENABLEMENT_SELECTOR", "- podSelector: {matchExpressions: [{key: a, operator: Equals, values: [b]}]}"), "AMBIENT_ENABLEMENT_SELECTOR"},
		{on("AMBIENT_ENABLEMENT_SELECTOR", "- podSelector: {matchLabels: ["), "AMBIENT_ENABLEMENT_SELECTOR"},
		{on("AMBIENT_ENABLEMENT_SELECTOR", "podSelector: {}"), "AMBIENT_ENABLEMENT_SELECTOR"},
	} {
		_, err := ParseOptions(nil, envOf(c.env))
		if err == nil || !strings.Contains(err.Error(), c.want) {
			t.Errorf("%v: %v, want an error naming %s", c.env, err, c.want)
		}
	}
	// The selectors are read only in ambient mode.
	if _, err := ParseOptions(nil, envOf(map[string]string{"AMBIENT_ENABLEMENT_SELECTOR": "- podSelecter: {}"})); err != nil {
		t.Errorf("selectors without ambient mode: %v", err)
	}
	if _, err := ParseOptions(nil, envOf(map[string]string{"ZTUNNEL_UDS_ADDRESS": ""})); err != nil {
		t.Errorf("an empty ztunnel socket without ambient mode: %v", err)
	}
}

// TestAmbientSelectorsIntoTheEntry: in ambient mode the selectors, as
// given or Istio's default, are parsed for the agent and written as JSON
// into the plugin's entry; both select the same pods, and the plugin's
// entry parses with the plugin's own parser.
func TestAmbientSelectorsIntoTheEntry(t *testing.T) {
	const custom = `
- podSelector:
    matchLabels: {app: web}
  namespaceSelector:
    matchExpressions: [{key: team, operator: In, values: [a]}]
`
	type pn struct{ pod, ns map[string]string }
	pods := map[string]pn{
		"pod label":       {map[string]string{"istio.io/dataplane-mode": "ambient"}, nil},
		"namespace label": {nil, map[string]string{"istio.io/dataplane-mode": "ambient"}},
		"opted out":       {map[string]string{"istio.io/dataplane-mode": "none"}, map[string]string{"istio.io/dataplane-mode": "ambient"}},
		"web in team a":   {map[string]string{"app": "web"}, map[string]string{"team": "a"}},
		"web in team b":   {map[string]string{"app": "web"}, map[string]string{"team": "b"}},
	}
	for _, c := range []struct {
		name     string
		args     []string
		env      map[string]string
		enrolled []string
	}{
		{"default", nil, nil, []string{"pod label", "namespace label"}},
		{"empty is the default", nil, map[string]string{"AMBIENT_ENABLEMENT_SELECTOR": "  "}, []string{"pod label", "namespace label"}},
		{"custom", nil, map[string]string{"AMBIENT_ENABLEMENT_SELECTOR": custom}, []string{"web in team a"}},
		{"flag wins", []string{"--ambient-enablement-selector=" + custom}, map[string]string{"AMBIENT_ENABLEMENT_SELECTOR": "[]"}, []string{"web in team a"}},
		{"none", nil, map[string]string{"AMBIENT_ENABLEMENT_SELECTOR": "[]"}, nil},
		// YAML's null is no list, as empty text: the default, for the
		// agent and, through the entry, for the plugin alike.
		{"yaml null", nil, map[string]string{"AMBIENT_ENABLEMENT_SELECTOR": "~"}, []string{"pod label", "namespace label"}},
		{"JSON", nil, map[string]string{"AMBIENT_ENABLEMENT_SELECTOR": `[{"podSelector":{"matchLabels":{"app":"web"}}}]`}, []string{"web in team a", "web in team b"}},
	} {
		env := map[string]string{"AMBIENT_ENABLED": "true"}
		for k, v := range c.env {
			env[k] = v
		}
		o, err := ParseOptions(c.args, envOf(env))
		if err != nil {
			t.Errorf("%s: %v", c.name, err)
			continue
		}
		raw := o.Loop.Install.Entry.EnablementSelectors
		if !json.Valid(raw) || len(raw) == 0 || raw[0] != '[' {
			t.Errorf("%s: entry's enablement_selectors %q is not a JSON list", c.name, raw)
			continue
		}
		fromEntry, err := enablement.Parse(string(raw))
		if err != nil {
			t.Errorf("%s: the entry's selectors %s do not parse: %v", c.name, raw, err)
			continue
		}
		conf := install.Entry(o.Loop.Install.Entry)
		if _, err := plugin.ParseConfig(conf); err != nil {
			t.Errorf("%s: the plugin refuses the entry %s: %v", c.name, conf, err)
		}
		for name, p := range pods {
			want := slices.Contains(c.enrolled, name)
			if got := o.Ambient.Selectors.Match(p.pod, p.ns); got != want {
				t.Errorf("%s: the agent's selectors match %s: %v, want %v", c.name, name, got, want)
			}
			if got := fromEntry.Match(p.pod, p.ns); got != want {
				t.Errorf("%s: the entry's selectors %s match %s: %v, want %v", c.name, raw, name, got, want)
			}
		}
	}
}

// TestReconcileOnStartupNote: false (Istio's binary default) is noted in
// ambient mode, since the agent always reconciles; true is not.
func TestReconcileOnStartupNote(t *testing.T) {
	o, err := ParseOptions(nil, envOf(map[string]string{"AMBIENT_ENABLED": "true"}))
	if err != nil {
		t.Fatal(err)
	}
	if notes := strings.Join(o.Notes, "\n"); !strings.Contains(notes, "AMBIENT_RECONCILE_POD_RULES_ON_STARTUP=false") {
		t.Fatalf("no note about AMBIENT_RECONCILE_POD_RULES_ON_STARTUP=false: %q", o.Notes)
	}
	o, err = ParseOptions(nil, envOf(map[string]string{"AMBIENT_ENABLED": "true", "AMBIENT_RECONCILE_POD_RULES_ON_STARTUP": "true"}))
	if err != nil {
		t.Fatal(err)
	}
	if notes := strings.Join(o.Notes, "\n"); strings.Contains(notes, "AMBIENT_RECONCILE_POD_RULES_ON_STARTUP") {
		t.Fatalf("a note about a setting that is obeyed: %q", o.Notes)
	}
}

func TestAmbientNodeNetns(t *testing.T) {
	for v, ok := range map[string]bool{"": true, "kubelet": true, "pid1": true, "/host/proc/1/ns/net": true, "host": false, "proc/1/ns/net": false} {
		o, err := ParseOptions(nil, envOf(map[string]string{"AMBIENT_ENABLED": "true", "AMBIENT_NODE_NETNS": v}))
		switch {
		case ok && err != nil:
			t.Errorf("AMBIENT_NODE_NETNS=%q: %v", v, err)
		case ok && o.Ambient.NodeNetns != v:
			t.Errorf("AMBIENT_NODE_NETNS=%q read as %q", v, o.Ambient.NodeNetns)
		case !ok && (err == nil || !strings.Contains(err.Error(), "AMBIENT_NODE_NETNS")):
			t.Errorf("AMBIENT_NODE_NETNS=%q: %v, want an error naming it", v, err)
		}
	}
}

// TestIstioStockSettingsQuiet: settings Istio's own chart and older
// releases pass start the agent without a misleading note or a usage
// error: REPAIR_RUN_AS_DAEMON (set by Istio's chart, unused there too)
// and the bare boolean form of older flags.
func TestIstioStockSettingsQuiet(t *testing.T) {
	cfg, err := ParseOptions([]string{"--update-cni-binaries", "--ebpf-enabled", "--repair-run-as-daemon"},
		envOf(map[string]string{"REPAIR_RUN_AS_DAEMON": "true"}))
	if err != nil {
		t.Fatal(err)
	}
	for _, n := range cfg.Notes {
		if strings.Contains(n, "REPAIR_RUN_AS_DAEMON") || strings.Contains(n, "repair-run-as-daemon") {
			t.Errorf("note %q", n)
		}
	}
}

// TestKubeconfigModeNamesTheValue: a mode written without its leading 0
// is refused naming the variable and the value as given.
func TestKubeconfigModeNamesTheValue(t *testing.T) {
	_, err := ParseOptions(nil, envOf(map[string]string{"KUBECONFIG_MODE": "600"}))
	if err == nil || !strings.Contains(err.Error(), "KUBECONFIG_MODE") || !strings.Contains(err.Error(), `"600"`) || !strings.Contains(err.Error(), "0600") {
		t.Fatalf("KUBECONFIG_MODE=600: %v", err)
	}
	cfg, err := ParseOptions(nil, envOf(map[string]string{"KUBECONFIG_MODE": "0640"}))
	if err != nil || cfg.Loop.Install.KubeconfigMode != 0o640 {
		t.Fatalf("KUBECONFIG_MODE=0640: %v", err)
	}
}

// TestForceIPTablesBinaryChecked: a variant name the plugin does not know
// would fail every ADD; the agent refuses it at start, naming it.
func TestForceIPTablesBinaryChecked(t *testing.T) {
	_, err := ParseOptions(nil, envOf(map[string]string{"FORCE_IPTABLES_BINARY": "iptables-legacy"}))
	if err == nil || !strings.Contains(err.Error(), `FORCE_IPTABLES_BINARY="iptables-legacy"`) {
		t.Fatalf("FORCE_IPTABLES_BINARY=iptables-legacy: %v", err)
	}
	for _, v := range []string{"legacy", "nft"} {
		if cfg, err := ParseOptions(nil, envOf(map[string]string{"FORCE_IPTABLES_BINARY": v})); err != nil || cfg.ForceIPTablesBinary != v {
			t.Fatalf("FORCE_IPTABLES_BINARY=%s: %v", v, err)
		}
	}
}

// TestServiceLinkIsNotAPort: a Service named "monitoring" in the agent's
// namespace makes the kubelet set MONITORING_PORT=tcp://...; the agent
// keeps its default port, with a note, instead of exiting 2 at every
// start (Istio reads 0 and serves no metrics).
func TestServiceLinkIsNotAPort(t *testing.T) {
	cfg, err := ParseOptions(nil, envOf(map[string]string{"MONITORING_PORT": "tcp://10.96.4.7:9090"}))
	if err != nil {
		t.Fatal(err)
	}
	if cfg.MonitoringPort != 15014 || !strings.Contains(strings.Join(cfg.Notes, "\n"), "MONITORING_PORT") {
		t.Fatalf("monitoring port %d, notes %q", cfg.MonitoringPort, cfg.Notes)
	}
	if _, err := ParseOptions(nil, envOf(map[string]string{"MONITORING_PORT": "metrics"})); err == nil {
		t.Fatal("MONITORING_PORT=metrics accepted")
	}
	// The flag wins, and then there is nothing to say.
	cfg, err = ParseOptions([]string{"--monitoring-port=9100"}, envOf(map[string]string{"MONITORING_PORT": "tcp://10.96.4.7:9090"}))
	if err != nil || cfg.MonitoringPort != 9100 || strings.Contains(strings.Join(cfg.Notes, "\n"), "MONITORING_PORT") {
		t.Fatalf("with the flag: port %d, notes %q, %v", cfg.MonitoringPort, cfg.Notes, err)
	}
}

// TestIstioOwnedConfigOption: ISTIO_OWNED_CNI_CONFIG takes effect in
// chained ambient mode only, as in Istio, and says so elsewhere; an empty
// name is Istio's default, and a name the runtime would not read as a
// list is refused.
func TestIstioOwnedConfigOption(t *testing.T) {
	cfg, err := ParseOptions(nil, envOf(map[string]string{"ISTIO_OWNED_CNI_CONFIG": "true", "AMBIENT_ENABLED": "true", "ISTIO_OWNED_CNI_CONFIG_FILENAME": ""}))
	if err != nil || !cfg.Loop.Install.IstioOwned || cfg.Loop.Install.IstioOwnedConfName != "02-istio-cni.conflist" {
		t.Fatalf("ambient: %+v %v", cfg, err)
	}
	cfg, err = ParseOptions(nil, envOf(map[string]string{"ISTIO_OWNED_CNI_CONFIG": "true"}))
	if err != nil || cfg.Loop.Install.IstioOwned || !slices.ContainsFunc(cfg.Notes, func(n string) bool { return strings.Contains(n, "ISTIO_OWNED_CNI_CONFIG=true takes effect only") }) {
		t.Fatalf("sidecar mode: %v, notes %q", err, cfg.Notes)
	}
	_, err = ParseOptions(nil, envOf(map[string]string{"ISTIO_OWNED_CNI_CONFIG": "true", "AMBIENT_ENABLED": "true", "ISTIO_OWNED_CNI_CONFIG_FILENAME": "02-istio-cni.conf"}))
	if err == nil || !strings.Contains(err.Error(), `"02-istio-cni.conf"`) {
		t.Fatalf("a .conf name: %v", err)
	}
	_, err = ParseOptions(nil, envOf(map[string]string{"ISTIO_OWNED_CNI_CONFIG": "true", "AMBIENT_ENABLED": "true", "CNI_CONF_NAME": "02-istio-cni.conflist"}))
	if err == nil || !strings.Contains(err.Error(), "CNI_CONF_NAME") {
		t.Fatalf("CNI_CONF_NAME naming the copy: %v", err)
	}
}
