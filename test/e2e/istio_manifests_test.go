package e2e

import (
	"context"
	"encoding/json"
	"os"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/containernetworking/cni/libcni"

	"github.com/istio-cni-go/istio-cni/internal/install"
	"github.com/istio-cni-go/istio-cni/internal/testenv"
)

// ptpHost is an agent host whose node has a ptp primary config and the
// reference plugins in its bin dir, so pods can run through the chain.
func ptpHost(t *testing.T, subnet string) *host {
	t.Helper()
	h := newHost(t)
	ptp := `{"cniVersion":"1.0.0","name":"k8s-pod-network","plugins":[{"type":"ptp","ipMasq":false,` +
		`"ipam":{"type":"host-local","dataDir":"` + filepath.Join(h.RunDir, "..", "ipam") + `","ranges":[[{"subnet":"` + subnet + `"}]],"routes":[{"dst":"0.0.0.0/0"}]}}]}`
	if err := os.WriteFile(filepath.Join(h.NetDir, "10-ptp.conflist"), []byte(ptp), 0o644); err != nil {
		t.Fatal(err)
	}
	for _, p := range []string{"ptp", "host-local"} {
		if err := os.Symlink(filepath.Join(testenv.ReferencePluginDir, p), filepath.Join(h.BinDir, p)); err != nil {
			t.Fatal(err)
		}
	}
	return h
}

// TestIstioManifestsRunTheAgent renders the chart with each platform
// profile and with values files as operators write them for Istio's
// istio-cni chart (with the registry of this project's image, which the
// chart has no default for: testenv.WithTestHub), then runs the rendered
// DaemonSet's container: its
// command line and environment exactly (the ConfigMap through envFrom, the
// container's env, the downward API's values), with only what the
// container's mounts would provide added. The agent must start, become
// ready, insert the plugin with the level the values asked for, and a
// sidecar pod's ADD through the node's chain must succeed.
func TestIstioManifestsRunTheAgent(t *testing.T) {
	ensureDaemonSet(t, false)
	cases := []struct {
		name, values, kubeVersion string
		pluginLevel               string // in the plugin's entry
		jsonLogs                  bool
		logWants                  string // in the agent's output
	}{
		{name: "defaults", pluginLevel: "info", logWants: "ready: plugin binary, kubeconfig and CNI config entry in place"},
		{name: "gke", values: "global:\n  platform: gke\n", kubeVersion: "v1.33.2-gke.1111", pluginLevel: "info"},
		{name: "gke-detected", kubeVersion: "v1.33.2-gke.1111", pluginLevel: "info"},
		{name: "openshift", values: "platform: openshift\n", pluginLevel: "info"},
		{name: "k3s", values: "platform: k3s\n", pluginLevel: "info"},
		{name: "k3d", values: "global:\n  platform: k3d\n", pluginLevel: "info"},
		{name: "microk8s", values: "platform: microk8s\n", pluginLevel: "info"},
		{name: "minikube", values: "platform: minikube\n", pluginLevel: "info"},
		{name: "istiod-default-level", values: "global:\n  logging:\n    level: default:info\n", pluginLevel: "info"},
		{name: "scoped-cni-debug", values: "global:\n  logging:\n    level: cni:debug,default:warn\n", pluginLevel: "debug"},
		{name: "scoped-cni-plugin-debug", values: "logging:\n  level: default:warn,cni-plugin:debug\n", pluginLevel: "debug"},
		{name: "all-warn", values: "logging:\n  level: all:warn\n", pluginLevel: "warn"},
		{name: "old-docs-panic", values: "logging:\n  level: panic\n", pluginLevel: "error"},
		{name: "none", values: "logging:\n  level: none\n", pluginLevel: "none"},
		{name: "unknown-level", values: "logging:\n  level: loud\n", pluginLevel: "info", logWants: `unknown level \"loud\"`},
		// cni.logLevel (debug in Istio's 1.2x default values) is never read
		// by Istio's DaemonSet: the level stays global.logging.level's.
		{name: "legacy-cni-layout", values: "cni:\n  excludeNamespaces: [kube-system, istio-system]\n  logLevel: debug\n  repair:\n    repairPods: false\n    labelPods: true\n", pluginLevel: "info"},
		{name: "log-as-json", values: "global:\n  logAsJson: true\n  logging:\n    level: default:debug\n", pluginLevel: "debug", jsonLogs: true},
		{name: "apparmor-field-selinux", values: "useAppArmorAnnotation: false\nseLinuxOptions:\n  level: s0\nseccompProfile:\n  type: RuntimeDefault\n", kubeVersion: "v1.30.0", pluginLevel: "info"},
		{name: "revision-netpol-quota", values: "revision: canary\nglobal:\n  networkPolicy:\n    enabled: true\nresourceQuotas:\n  enabled: true\n", pluginLevel: "info"},
		{name: "nftables", values: "global:\n  nativeNftables: true\n", pluginLevel: "info"},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			rendered, err := testenv.RenderChart(c.values, c.kubeVersion)
			if err != nil {
				t.Fatal(err)
			}
			args, env, err := testenv.AgentInvocation(rendered)
			if err != nil {
				t.Fatal(err)
			}
			if len(args) == 0 || args[0] != "install-cni" {
				t.Fatalf("rendered command %q", args)
			}
			// What the downward API gives the container.
			for k, v := range map[string]string{"REPAIR_NODE_NAME": testenv.NodeName, "NODE_NAME": testenv.NodeName,
				"POD_NAME": "istio-cni-node-" + c.name, "POD_NAMESPACE": "istio-system"} {
				env[k] = v
			}
			h := ptpHost(t, "10.247.0.0/24")
			if err := h.StartAsContainer(agentBin, args[1:], env); err != nil {
				t.Fatal(err)
			}
			t.Cleanup(func() {
				h.Kill()
				if t.Failed() {
					t.Logf("command line %q\nenvironment %v\nagent log:\n%s", args, env, h.LogText())
				}
			})
			h.waitReadyz(200, 20*time.Second)

			cni := libcni.NewCNIConfigWithCacheDir([]string{h.BinDir}, t.TempDir(), nil)
			primary, _, err := install.FindPrimary(h.NetDir, "")
			if err != nil {
				t.Fatal(err)
			}
			list, err := libcni.ConfListFromFile(primary)
			if err != nil {
				t.Fatal(err)
			}
			entry := list.Plugins[len(list.Plugins)-1].Bytes
			var standalone *libcni.NetworkConfig
			if env["CHAINED_CNI_PLUGIN"] == "false" {
				// Multus calls the standalone config after the primary.
				if list.Plugins[len(list.Plugins)-1].Network.Type == "istio-cni" {
					t.Fatal("not chained, yet the plugin went into the primary config")
				}
				if standalone, err = readPluginConf(filepath.Join(h.NetDir, env["CNI_CONF_NAME"])); err != nil {
					t.Fatalf("standalone config %s: %v", env["CNI_CONF_NAME"], err)
				}
				entry = standalone.Bytes
			} else if list.Plugins[len(list.Plugins)-1].Network.Type != "istio-cni" {
				t.Fatalf("plugin not inserted last into %s", primary)
			}
			var e map[string]any
			if err := json.Unmarshal(entry, &e); err != nil {
				t.Fatal(err)
			}
			if e["plugin_log_level"] != c.pluginLevel {
				t.Errorf("plugin_log_level %v, want %s", e["plugin_log_level"], c.pluginLevel)
			}

			name := "manifest-" + c.name
			k8sPod, err := createPod(t, testenv.PodSpec{Namespace: testNS, Name: name, Sidecar: true})
			if err != nil {
				t.Fatal(err)
			}
			pod, err := testenv.NewPod(testNS, name, string(k8sPod.UID), "cmanifest"+strings.ReplaceAll(c.name, "-", ""))
			if err != nil {
				t.Fatal(err)
			}
			defer pod.Close()
			ctx := context.Background()
			if _, err := cni.AddNetworkList(ctx, list, pod.RT); err != nil {
				t.Fatalf("ADD: %v", err)
			}
			defer func() { _ = cni.DelNetworkList(ctx, list, pod.RT) }()
			if standalone != nil {
				if _, err := cni.AddNetwork(ctx, standalone, pod.RT); err != nil {
					t.Fatalf("ADD of the standalone config: %v", err)
				}
				defer func() { _ = cni.DelNetwork(ctx, standalone, pod.RT) }()
			}
			logs := h.LogText()
			if c.pluginLevel != "none" && c.pluginLevel != "error" && c.pluginLevel != "warn" {
				logs = h.WaitLog(10*time.Second, testenv.LogLine("redirect rules programmed"))
			}
			if c.logWants != "" && !strings.Contains(logs, c.logWants) {
				t.Errorf("agent output lacks %q", c.logWants)
			}
			if c.pluginLevel != "none" && c.pluginLevel != "error" && c.pluginLevel != "warn" && !strings.Contains(logs, "redirect rules programmed") {
				t.Error("the plugin's ADD line is not in the agent's output")
			}
			for _, l := range strings.Split(strings.TrimSpace(logs), "\n") {
				if isJSON := strings.HasPrefix(l, "{"); isJSON != c.jsonLogs && !strings.HasPrefix(l, "\t") && !strings.HasPrefix(l, "goroutine") {
					t.Errorf("log line in the wrong format (JSON wanted: %v): %q", c.jsonLogs, l)
					break
				}
			}
			// The pod goes before the agent uninstalls, as on a node: after
			// it, the chain's DEL finds no istio-cni, never reaches ptp, and
			// the next case's pod gets the same address beside a stale route.
			if standalone != nil {
				if err := cni.DelNetwork(ctx, standalone, pod.RT); err != nil {
					t.Errorf("DEL of the standalone config: %v", err)
				}
			}
			if err := cni.DelNetworkList(ctx, list, pod.RT); err != nil {
				t.Errorf("DEL: %v", err)
			}
			if code := h.stop(syscall.SIGTERM); code != 0 {
				t.Fatalf("exit code %d on SIGTERM", code)
			}
		})
	}
}
