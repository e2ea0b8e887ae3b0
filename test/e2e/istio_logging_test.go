package e2e

import (
	"context"
	"encoding/json"
	"errors"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/containernetworking/cni/libcni"

	"github.com/istio-cni-go/istio-cni/internal/install"
	"github.com/istio-cni-go/istio-cni/internal/testenv"
)

// TestIstioLoggingFlags runs the agent with every logging flag Istio's
// install-cni takes, in Istio's console format: it starts, logs at the
// levels asked for (warn for its own lines, debug for the plugin's), the
// plugin's debug lines appear in its output both for the commands it runs
// itself and for those the fallback plugin forwards over log.sock, and the
// flags it has no use for are named at start-up.
func TestIstioLoggingFlags(t *testing.T) {
	ensureDaemonSet(t, false)
	h := ptpHost(t, "10.246.0.0/24")
	logDir := t.TempDir()
	h.start("--kubernetes-node-name", testenv.NodeName, "--log_as_json=false",
		"--log_output_level=default:warn,cni-plugin:debug", "--log_caller=cni-plugin", "--log_stacktrace_level=default:none",
		"--log_target=stdout", "--log_target="+filepath.Join(logDir, "target.log"),
		"--log_rotate="+filepath.Join(logDir, "rotating.log"), "--log_rotate_max_age=1", "--log_rotate_max_backups=2", "--log_rotate_max_size=5",
		"--ctrlz_port=9876", "--ctrlz_address=127.0.0.1")
	h.waitReadyz(200, 20*time.Second)

	primary, _, err := install.FindPrimary(h.NetDir, "")
	if err != nil {
		t.Fatal(err)
	}
	b, _ := os.ReadFile(primary)
	if !strings.Contains(string(b), `"plugin_log_level":"debug"`) && !strings.Contains(string(b), `"plugin_log_level": "debug"`) {
		t.Fatalf("the plugin's level must follow cni-plugin:debug; entry:\n%s", b)
	}
	list, err := libcni.ConfListFromBytes(b)
	if err != nil {
		t.Fatal(err)
	}
	// The same chain with the fallback plugin in istio-cni's place: it runs
	// in its own process and forwards its lines over log.sock.
	var raw map[string]any
	if err := json.Unmarshal(b, &raw); err != nil {
		t.Fatal(err)
	}
	plugins := raw["plugins"].([]any)
	plugins[len(plugins)-1].(map[string]any)["type"] = "istio-cni-fallback"
	fb, _ := json.Marshal(raw)
	fallbackList, err := libcni.ConfListFromBytes(fb)
	if err != nil {
		t.Fatal(err)
	}
	cni := libcni.NewCNIConfigWithCacheDir([]string{h.BinDir}, t.TempDir(), nil)
	for _, c := range []struct {
		name string
		list *libcni.NetworkConfigList
	}{{"via-agent", list}, {"via-fallback", fallbackList}} {
		k8sPod, err := createPod(t, testenv.PodSpec{Namespace: testNS, Name: "logging-" + c.name, Sidecar: true})
		if err != nil {
			t.Fatal(err)
		}
		pod, err := testenv.NewPod(testNS, k8sPod.Name, string(k8sPod.UID), "clog"+strings.ReplaceAll(c.name, "-", ""))
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(pod.Close)
		if _, err := cni.AddNetworkList(context.Background(), c.list, pod.RT); err != nil {
			t.Fatalf("%s: ADD: %v", c.name, err)
		}
		if err := cni.DelNetworkList(context.Background(), c.list, pod.RT); err != nil {
			t.Fatalf("%s: DEL: %v", c.name, err)
		}
	}

	// The fallback forwards its lines without waiting for the agent to
	// log them, the last (its DEL's) while ptp's DEL runs: wait for all.
	logs := h.WaitLog(10*time.Second, func(log string) bool {
		for _, c := range []string{"via-agent", "via-fallback"} {
			for _, msg := range []string{"redirect rules programmed", "pod deleted"} {
				if !testenv.LogLine(msg, testNS+"/logging-"+c)(log) {
					return false
				}
			}
		}
		return true
	})
	lines := strings.Split(logs, "\n")
	has := func(level, scope, msg, pod string) bool {
		for _, l := range lines {
			f := strings.Split(l, "\t")
			if len(f) >= 4 && f[1] == level && f[2] == scope && strings.Contains(l, msg) && strings.Contains(l, pod) {
				return true
			}
		}
		return false
	}
	for _, c := range []string{"via-agent", "via-fallback"} {
		if !has("debug", "cni-plugin", "pod deleted", testNS+"/logging-"+c) {
			t.Errorf("%s: the plugin's DEL debug line is missing from the agent's output", c)
		}
		if !has("info", "cni-plugin", "redirect rules programmed", testNS+"/logging-"+c) {
			t.Errorf("%s: the plugin's ADD line is missing", c)
		}
	}
	for _, l := range lines {
		f := strings.Split(l, "\t")
		if len(f) >= 3 && f[2] == "cni-agent" && (f[1] == "info" || f[1] == "debug") {
			t.Errorf("an agent line below warn passed --log_output_level=default:warn: %q", l)
		}
		if strings.HasPrefix(l, "{") {
			t.Errorf("a JSON line without --log_as_json: %q", l)
		}
	}
	for _, want := range []string{"--ctrlz_port", "--ctrlz_address"} {
		if !has("warn", "cni-agent", want, "ignored") {
			t.Errorf("the start-up log does not say %s is ignored", want)
		}
	}
	// The plugin's own lines name their source (--log_caller=cni-plugin),
	// whichever process served the command.
	plugin := 0
	for _, l := range lines {
		if f := strings.Split(l, "\t"); len(f) >= 4 && f[2] == "cni-plugin" {
			plugin++
			if file, line, ok := strings.Cut(f[3], ".go:"); !ok || file == "" || strings.Trim(line, "0123456789") != "" || line == "" {
				t.Errorf("--log_caller=cni-plugin: no caller on the plugin's line %q", l)
			}
		}
	}
	if plugin == 0 {
		t.Error("no line of the plugin's scope")
	}
	for _, f := range []string{"target.log", "rotating.log"} {
		b, err := os.ReadFile(filepath.Join(logDir, f))
		if err != nil || !strings.Contains(string(b), "redirect rules programmed") {
			t.Errorf("%s does not hold the log: %v", f, err)
		}
	}
}

// TestAgentVersionAndHelp: `install-cni version`, as Istio's, prints the
// build and exits 0; so does --help.
func TestAgentVersionAndHelp(t *testing.T) {
	out, err := exec.Command(agentBin, "version").CombinedOutput()
	if err != nil || !strings.Contains(string(out), "version.BuildInfo{Version:") {
		t.Fatalf("install-cni version: %v %q", err, out)
	}
	if out, err := exec.Command(agentBin, "version", "--short").CombinedOutput(); err != nil || strings.TrimSpace(string(out)) == "" {
		t.Fatalf("install-cni version --short: %v %q", err, out)
	}
	for _, help := range []string{"--help", "help"} {
		out, err = exec.Command(agentBin, help).CombinedOutput()
		if err != nil || !strings.Contains(string(out), "-log_output_level") || !strings.Contains(string(out), "-repair-label-selectors") {
			t.Fatalf("install-cni %s: %v %q", help, err, out)
		}
	}
	out, err = exec.Command(agentBin, "--no-such-flag").CombinedOutput()
	var ee *exec.ExitError
	if !errors.As(err, &ee) || ee.ExitCode() != 2 || !strings.Contains(string(out), "no-such-flag") {
		t.Fatalf("an unknown flag must exit 2 naming it: %v %q", err, out)
	}
}
