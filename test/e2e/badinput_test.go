package e2e

import (
	"bytes"
	"context"
	"encoding/json"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/istio-cni-go/istio-cni/internal/testenv"
)

// execPlugin runs the plugin binary as a runtime would, returning the CNI
// error it printed (nil on success).
func execPlugin(t *testing.T, command, netns, args string, stdin []byte) (map[string]any, string) {
	t.Helper()
	return execPluginAt(t, pluginBin, command, netns, args, stdin)
}

// execPluginAt does the same with the binary at bin.
func execPluginAt(t *testing.T, bin, command, netns, args string, stdin []byte) (map[string]any, string) {
	t.Helper()
	cmd := exec.Command(bin)
	cmd.Env = []string{"CNI_COMMAND=" + command, "CNI_CONTAINERID=cbad", "CNI_NETNS=" + netns,
		"CNI_IFNAME=eth0", "CNI_PATH=/usr/lib/cni", "CNI_ARGS=" + args}
	cmd.Stdin = bytes.NewReader(stdin)
	var stdout, stderr bytes.Buffer
	cmd.Stdout, cmd.Stderr = &stdout, &stderr
	err := cmd.Run()
	if err == nil {
		return nil, stderr.String()
	}
	var res map[string]any
	if jerr := json.Unmarshal(stdout.Bytes(), &res); jerr != nil {
		t.Fatalf("plugin failed (%v) without a CNI error on stdout: %q (stderr %s)", err, stdout.String(), stderr.String())
	}
	if cmd.ProcessState.ExitCode() != 1 {
		t.Fatalf("exit code %d, want 1", cmd.ProcessState.ExitCode())
	}
	return res, stderr.String()
}

func wantErr(t *testing.T, res map[string]any, parts ...string) {
	t.Helper()
	if res == nil {
		t.Fatalf("plugin succeeded, want an error containing %q", parts)
	}
	msg, _ := res["msg"].(string)
	for _, p := range parts {
		if !strings.Contains(msg, p) {
			t.Fatalf("error %q does not mention %q", msg, p)
		}
	}
}

func TestBadInput(t *testing.T) {
	e := newEnv(t, nil)
	pod := e.newPod(&testenv.PodSpec{Sidecar: true})
	if _, err := e.node.Add(context.Background(), e.node.Primary, pod); err != nil {
		t.Fatal(err)
	}
	base := func(extra string) []byte {
		return []byte(`{"cniVersion":"1.0.0","name":"k8s-pod-network","type":"istio-cni","cni_agent_run_dir":"` + e.node.RunDir + `"` + extra + `}`)
	}
	args := "IgnoreUnknown=1;K8S_POD_NAMESPACE=" + testNS + ";K8S_POD_NAME=" + pod.Name

	t.Run("malformed-json", func(t *testing.T) {
		res, _ := execPlugin(t, "ADD", pod.NetNS.Path(), args, []byte(`{"cniVersion":"1.0.0",`))
		wantErr(t, res, "network config")
	})
	t.Run("bad-value-names-key", func(t *testing.T) {
		res, _ := execPlugin(t, "ADD", pod.NetNS.Path(), args, base(`,"exclude_namespaces":"kube-system"`))
		wantErr(t, res, "exclude_namespaces")
	})
	t.Run("del-takes-bad-config", func(t *testing.T) {
		// Istio's DEL reads nothing; a DEL failing here keeps the pod
		// Terminating.
		if res, _ := execPlugin(t, "DEL", pod.NetNS.Path(), args, base(`,"exclude_namespaces":"kube-system"`)); res != nil {
			t.Fatalf("DEL under a config an ADD refuses: %v", res)
		}
		if res, _ := execPlugin(t, "DEL", pod.NetNS.Path(), "K8S_POD_NAME", base("")); res != nil {
			t.Fatalf("DEL with CNI_ARGS an ADD refuses: %v", res)
		}
	})
	t.Run("check-without-prevResult", func(t *testing.T) {
		res, _ := execPlugin(t, "CHECK", pod.NetNS.Path(), args, base(""))
		wantErr(t, res, "prevResult")
	})
	t.Run("bad-cni-args", func(t *testing.T) {
		res, _ := execPlugin(t, "ADD", pod.NetNS.Path(), "K8S_POD_NAME", base(""))
		wantErr(t, res, "CNI_ARGS")
	})
	t.Run("version", func(t *testing.T) {
		cmd := exec.Command(pluginBin)
		cmd.Env = []string{"CNI_COMMAND=VERSION"}
		cmd.Stdin = strings.NewReader(`{"cniVersion":"1.1.0"}`)
		v, err := cmd.Output()
		if err != nil || !strings.Contains(string(v), `"1.1.0"`) || !strings.Contains(string(v), `"0.1.0"`) {
			t.Fatalf("VERSION: %s %v", v, err)
		}
	})
	t.Run("status", func(t *testing.T) {
		// No agent, but a kubeconfig: the plugin can serve ADD.
		res, _ := execPlugin(t, "STATUS", "", "", []byte(`{"cniVersion":"1.1.0","name":"n","type":"istio-cni","cni_agent_run_dir":"`+e.node.RunDir+`"}`))
		if res != nil {
			t.Fatalf("STATUS: %v", res)
		}
		// An empty run dir (a reboot emptied it; no agent yet): the agent's
		// own pod needs no lookup and must be able to start.
		empty := []byte(`{"cniVersion":"1.1.0","name":"n","type":"istio-cni","cni_agent_run_dir":"` + t.TempDir() + `"}`)
		if res, _ = execPlugin(t, "STATUS", "", "", empty); res != nil {
			t.Fatalf("STATUS with an empty run dir: %v", res)
		}
		// The relay alone, no agent: nothing can serve an ADD (code 50).
		relay := filepath.Join(t.TempDir(), "istio-cni")
		copyFile(t, pluginBin, relay)
		if err := os.Chmod(relay, 0o755); err != nil {
			t.Fatal(err)
		}
		res, _ = execPluginAt(t, relay, "STATUS", "", "", empty)
		if res == nil || res["code"] != float64(50) {
			t.Fatalf("STATUS with neither agent nor fallback: %v, want code 50", res)
		}
	})

	annotations := []struct{ key, value string }{
		{"traffic.sidecar.istio.io/includeOutboundIPRanges", "10.0.0.0/33"},
		{"traffic.sidecar.istio.io/excludeOutboundIPRanges", "10.0.0.0/8,,"},
		{"traffic.sidecar.istio.io/includeInboundPorts", "70000"},
		{"traffic.sidecar.istio.io/excludeInboundPorts", "80,,81"},
		{"traffic.sidecar.istio.io/includeOutboundPorts", "http"},
		{"traffic.sidecar.istio.io/excludeOutboundPorts", "65536"},
		{"sidecar.istio.io/interceptionMode", "SPLICE"},
		{"traffic.sidecar.istio.io/excludeInterfaces", "eth0 -j ACCEPT"},
		{"istio.io/reroute-virtual-interfaces", "--bad"},
	}
	for _, a := range annotations {
		t.Run("annotation/"+a.key+"="+a.value, func(t *testing.T) {
			bad := e.newPod(&testenv.PodSpec{Sidecar: true, Annotations: map[string]string{a.key: a.value}})
			_, err := e.node.Add(context.Background(), e.node.Chained, bad)
			t.Cleanup(func() { _ = e.node.Del(context.Background(), e.node.Chained, bad) })
			if err == nil || !strings.Contains(err.Error(), a.key) || !strings.Contains(err.Error(), a.value) {
				t.Fatalf("ADD: %v; want an error naming %s and %q", err, a.key, a.value)
			}
			if rules := rulesIn(t, bad); strings.Contains(rules, "ISTIO_") {
				t.Fatalf("rules applied despite the error:\n%s", rules)
			}
		})
	}

	t.Run("missing-kubeconfig", func(t *testing.T) {
		bare := newEnv(t, nil)
		if err := os.Remove(filepath.Join(bare.node.RunDir, "istio-cni-kubeconfig")); err != nil {
			t.Fatal(err)
		}
		p := bare.newPod(&testenv.PodSpec{Sidecar: true})
		_, err := bare.node.Add(context.Background(), bare.node.Chained, p)
		_ = bare.node.Del(context.Background(), bare.node.Primary, p)
		if err == nil || !strings.Contains(err.Error(), "istio-cni-kubeconfig") {
			t.Fatalf("want an error naming the missing kubeconfig, got %v", err)
		}
	})

	t.Run("api-unreachable-within-budget", func(t *testing.T) {
		dead := newEnv(t, map[string]any{"k8s_retry_budget": "2s", "k8s_request_timeout": "500ms"})
		kc := filepath.Join(dead.node.RunDir, "istio-cni-kubeconfig")
		if err := testenv.WriteKubeconfig(kc, "https://127.0.0.1:1", cluster.CAFile, "token"); err != nil {
			t.Fatal(err)
		}
		p := dead.newPod(&testenv.PodSpec{Sidecar: true})
		start := time.Now()
		_, err := dead.node.Add(context.Background(), dead.node.Chained, p)
		took := time.Since(start)
		_ = dead.node.Del(context.Background(), dead.node.Primary, p)
		if err == nil || !strings.Contains(err.Error(), "connection refused") || !strings.Contains(err.Error(), p.Namespace+"/"+p.Name) {
			t.Fatalf("want a connection error naming the pod, got %v", err)
		}
		if took > 6*time.Second {
			t.Fatalf("ADD took %s with a 2s budget", took)
		}
	})

	t.Run("pod-not-found", func(t *testing.T) {
		short := newEnv(t, map[string]any{"k8s_retry_budget": "1s"})
		p := short.newPod(nil)
		_, err := short.node.Add(context.Background(), short.node.Chained, p)
		_ = short.node.Del(context.Background(), short.node.Primary, p)
		if err == nil || !strings.Contains(err.Error(), "not found") {
			t.Fatalf("want pod not found, got %v", err)
		}
	})
}
