package agent

import (
	"os"
	"path/filepath"
	"strings"
	"testing"
)

func TestParseOptions(t *testing.T) {
	env := map[string]string{"CHAINED_CNI_PLUGIN": "false", "EXCLUDE_NAMESPACES": "kube-system, istio-system ,", "CNI_CONF_NAME": "10-x.conflist", "KUBECONFIG_MODE": "0640"}
	o, err := ParseOptions([]string{"--cni-conf-name", "20-y.conflist", "--disable-safe-upgrade"}, func(k string) string { return env[k] })
	if err != nil {
		t.Fatal(err)
	}
	if o.Chained || o.CNIConfName != "20-y.conflist" || !o.DisableSafeUpgrade || o.KubeconfigMode != 0o640 {
		t.Fatalf("flags/env precedence wrong: %+v", o)
	}
	if strings.Join(o.ExcludeNamespaces, ",") != "kube-system,istio-system" {
		t.Fatalf("exclude namespaces %q", o.ExcludeNamespaces)
	}
	if o.CNINetDir != "/host/etc/cni/net.d" || o.RunDir != "/var/run/istio-cni" || o.MonitoringPort != 15014 || o.ReadinessPort != 8000 {
		t.Fatalf("defaults: %+v", o)
	}
	for _, bad := range [][]string{{"--monitoring-port", "x"}, {"--kubeconfig-mode", "01777"}, {"--chained-cni-plugin=maybe"}, {"--nope"}} {
		if _, err := ParseOptions(bad, func(string) string { return "" }); err == nil {
			t.Errorf("%v accepted", bad)
		}
	}
	if _, err := ParseOptions(nil, func(k string) string { return map[string]string{"REPAIR_ENABLED": "x", "MONITORING_PORT": "abc"}[k] }); err == nil || !strings.Contains(err.Error(), "MONITORING_PORT") {
		t.Errorf("bad env value must name the variable: %v", err)
	}
}

func TestNftablesAuto(t *testing.T) {
	o, err := ParseOptions([]string{"--native-nftables", "auto"}, func(string) string { return "" })
	if err != nil || !o.NftablesAuto || o.NativeNftables {
		t.Fatalf("auto: %+v %v", o, err)
	}
	if _, err := ParseOptions([]string{"--native-nftables", "sometimes"}, func(string) string { return "" }); err == nil {
		t.Fatal("bad backend accepted")
	}
	bare := t.TempDir()
	if has, err := HostHasIPTables(bare); err != nil || has {
		t.Fatalf("empty root: %v %v", has, err)
	}
	withIPT := t.TempDir()
	if err := os.MkdirAll(filepath.Join(withIPT, "usr/sbin"), 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.Symlink("xtables-nft-multi", filepath.Join(withIPT, "usr/sbin/iptables-nft-restore")); err != nil {
		t.Fatal(err)
	}
	if has, err := HostHasIPTables(withIPT); err != nil || !has {
		t.Fatalf("root with iptables-nft-restore: %v %v", has, err)
	}
	if _, err := HostHasIPTables(filepath.Join(bare, "missing")); err == nil {
		t.Fatal("missing root not reported")
	}
}
