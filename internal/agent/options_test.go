package agent

import (
	"os"
	"path/filepath"
	"strings"
	"testing"
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
