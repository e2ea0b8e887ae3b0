package e2e

import (
	"errors"
	"fmt"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/istio-cni-go/istio-cni/internal/prepared"
	"github.com/istio-cni-go/istio-cni/internal/testenv"
)

func runDiag(t *testing.T, e *env, args ...string) (int, string) {
	t.Helper()
	return runDiagIn(t, e.node.RunDir, args...)
}

// runDiagIn runs the diagnostics command against the agent of runDir.
func runDiagIn(t *testing.T, runDir string, args ...string) (int, string) {
	t.Helper()
	cmd := exec.Command(diagBin, append([]string{"--run-dir", runDir}, args...)...)
	out, err := cmd.CombinedOutput()
	var ee *exec.ExitError
	if errors.As(err, &ee) {
		return ee.ExitCode(), string(out)
	}
	if err != nil {
		t.Fatal(err)
	}
	return 0, string(out)
}

// iptablesInPod runs iptables-nft in the pod's namespace with each set of
// arguments in turn, as another writer of its rules would.
func iptablesInPod(t *testing.T, pod *testenv.Pod, commands ...[]string) {
	t.Helper()
	if err := pod.InPod(func() error {
		for _, args := range commands {
			if out, err := exec.Command("iptables-nft", args...).CombinedOutput(); err != nil {
				return fmt.Errorf("iptables-nft %v: %w: %s", args, err, out)
			}
		}
		return nil
	}); err != nil {
		t.Fatal(err)
	}
}

func TestDiag(t *testing.T) {
	for _, backend := range []string{"iptables", "nftables"} {
		t.Run(backend, func(t *testing.T) {
			e := newEnv(t, map[string]any{"native_nftables": backend == "nftables"})
			sb := e.add(&testenv.PodSpec{Sidecar: true})
			code, out := runDiag(t, e, "--pod", testNS+"/"+sb.pod.Name, "--netns", sb.pod.NetNS.Path())
			if code != 0 || !strings.Contains(out, "VERDICT: OK") || !strings.Contains(out, backend+" rules") {
				t.Fatalf("redirected pod: exit %d:\n%s", code, out)
			}
			if backend != "nftables" {
				return
			}
			// iptables rules beside the plugin's nftables ones: traffic goes
			// through both, whichever checks out.
			iptablesInPod(t, sb.pod, []string{"-t", "nat", "-N", "ISTIO_REDIRECT"},
				[]string{"-t", "nat", "-A", "ISTIO_REDIRECT", "-p", "tcp", "-j", "REDIRECT", "--to-ports", "15001"})
			code, out = runDiag(t, e, "--pod", testNS+"/"+sb.pod.Name, "--netns", sb.pod.NetNS.Path())
			if code != 1 || !strings.Contains(out, "both iptables and nftables") {
				t.Fatalf("a pod with both backends' rules: exit %d:\n%s", code, out)
			}
		})
	}
	e := newEnv(t, nil)
	t.Run("tampered", func(t *testing.T) {
		sb := e.add(&testenv.PodSpec{Sidecar: true})
		if err := sb.pod.InPod(func() error {
			return exec.Command("iptables-nft", "-t", "nat", "-D", "ISTIO_OUTPUT", "-j", "ISTIO_REDIRECT").Run()
		}); err != nil {
			t.Fatal(err)
		}
		code, out := runDiag(t, e, "--pod", testNS+"/"+sb.pod.Name, "--netns", sb.pod.NetNS.Path())
		if code != 1 || !strings.Contains(out, "VERDICT: MISMATCH") || !strings.Contains(out, "ISTIO_OUTPUT") {
			t.Fatalf("tampered pod: exit %d:\n%s", code, out)
		}
	})
	t.Run("not-injected", func(t *testing.T) {
		sb := e.add(&testenv.PodSpec{})
		code, out := runDiag(t, e, "--pod", testNS+"/"+sb.pod.Name, "--netns", sb.pod.NetNS.Path())
		if code != 0 || !strings.Contains(out, "not redirected") {
			t.Fatalf("plain pod: exit %d:\n%s", code, out)
		}
	})
	t.Run("istio-init", func(t *testing.T) {
		// A pod Istio's own init container programs, as in a cluster
		// partly moved to the CNI plugin: the plugin leaves it alone,
		// and its rules are no mismatch.
		sb := e.add(&testenv.PodSpec{Sidecar: true, InitNames: []string{"istio-init"}})
		code, out := runDiag(t, e, "--pod", testNS+"/"+sb.pod.Name, "--netns", sb.pod.NetNS.Path())
		if code != 1 || !strings.Contains(out, "istio-init container but no redirect rules") {
			t.Fatalf("istio-init pod before istio-init ran: exit %d:\n%s", code, out)
		}
		iptablesInPod(t, sb.pod, []string{"-t", "nat", "-N", "ISTIO_REDIRECT"},
			[]string{"-t", "nat", "-A", "ISTIO_REDIRECT", "-p", "tcp", "-j", "REDIRECT", "--to-ports", "15001"},
			[]string{"-t", "nat", "-A", "OUTPUT", "-p", "tcp", "-j", "ISTIO_REDIRECT"})
		code, out = runDiag(t, e, "--pod", testNS+"/"+sb.pod.Name, "--netns", sb.pod.NetNS.Path())
		if code != 0 || !strings.Contains(out, "VERDICT: OK") || !strings.Contains(out, "istio-init") {
			t.Fatalf("istio-init pod: exit %d:\n%s", code, out)
		}
	})
	t.Run("raced-found-through-proc", func(t *testing.T) {
		pod, ip := racedPod(t, e, testenv.PodSpec{Sidecar: true})
		setPodIP(t, pod.Name, ip)
		code, out := runDiag(t, e, "--pod", testNS+"/"+pod.Name)
		if code != 1 || !strings.Contains(out, "has no rules") || !strings.Contains(out, "/proc/") {
			t.Fatalf("raced pod: exit %d:\n%s", code, out)
		}
	})
	t.Run("usage", func(t *testing.T) {
		if code, out := runDiag(t, e); code != 2 || !strings.Contains(out, "--pod") {
			t.Fatalf("no arguments: exit %d:\n%s", code, out)
		}
	})
}

// TestDiagExcludedNamespace: a sidecar pod in a namespace the agent's
// plugin config excludes (kube-system by default) has no rules by design;
// diag says so from the config the agent learnt, instead of "it raced
// the agent, a restart fixes it", which no restart would.
func TestDiagExcludedNamespace(t *testing.T) {
	h := ptpHost(t, "10.247.0.0/24")
	h.start("--kubernetes-node-name", testenv.NodeName)
	h.waitReadyz(200, 20*time.Second)
	// The learnt config is written once the agent prepares pods.
	deadline := time.Now().Add(10 * time.Second)
	for {
		if configs := prepared.Dir(filepath.Join(h.RunDir, prepared.DirName)).LoadConfigs(); len(configs) > 0 {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("the agent kept no learnt config:\n%s", h.LogText())
		}
		time.Sleep(20 * time.Millisecond) // polling a file another process writes, bounded
	}
	spec := testenv.PodSpec{Namespace: "kube-system", Name: "excluded-sidecar", Sidecar: true}
	k8sPod, err := createPod(t, spec)
	if err != nil {
		t.Fatal(err)
	}
	pod, err := testenv.NewPod(spec.Namespace, spec.Name, string(k8sPod.UID), "cexcluded")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(pod.Close)
	code, out := runDiagIn(t, h.RunDir, "--pod", "kube-system/excluded-sidecar", "--netns", pod.NetNS.Path())
	if code != 0 || !strings.Contains(out, "exclude_namespaces") {
		t.Fatalf("an excluded namespace's pod: exit %d:\n%s", code, out)
	}
}
