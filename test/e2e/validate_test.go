package e2e

import (
	"bytes"
	"context"
	"os/exec"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/istio-cni-go/istio-cni/internal/testenv"
)

// runValidation runs the validation command in the pod's namespace as the
// proxy uid, with the arguments Istio's injector gives istio-validation.
func runValidation(t *testing.T, pod *testenv.Pod) (int, string, time.Duration) {
	t.Helper()
	var out bytes.Buffer
	var code int
	start := time.Now()
	err := pod.InPod(func() error {
		cmd := exec.Command(validBin, "-p", "15001", "-z", "15006", "-u", "1337", "-m", "REDIRECT", "-i", "*", "-x", "",
			"-b", "*", "-d", "15090,15021,15020", "--log_output_level=default:info", "--run-validation", "--skip-rule-apply",
			"--probe-timeout", "2s")
		cmd.Stdout, cmd.Stderr = &out, &out
		cmd.SysProcAttr = &syscall.SysProcAttr{Credential: &syscall.Credential{Uid: 1337, Gid: 1337}}
		err := cmd.Run()
		if ee, ok := err.(*exec.ExitError); ok {
			code = ee.ExitCode()
			return nil
		}
		return err
	})
	if err != nil {
		t.Fatal(err)
	}
	return code, out.String(), time.Since(start)
}

func TestValidation(t *testing.T) {
	for _, backend := range []string{"iptables", "nftables"} {
		t.Run(backend+"/rules-in-place", func(t *testing.T) {
			e := newEnv(t, map[string]any{"native_nftables": backend == "nftables"})
			sb := e.add(&testenv.PodSpec{Sidecar: true})
			code, out, _ := runValidation(t, sb.pod)
			if code != 0 || !strings.Contains(out, "validation passed") {
				t.Fatalf("exit %d, want 0:\n%s", code, out)
			}
		})
	}
	t.Run("race-no-rules", func(t *testing.T) {
		e := newEnv(t, nil)
		pod := e.newPod(&testenv.PodSpec{Sidecar: true})
		if _, err := e.node.Add(context.Background(), e.node.Primary, pod); err != nil {
			t.Fatal(err)
		}
		defer func() { _ = e.node.Del(context.Background(), e.node.Primary, pod) }()
		code, out, took := runValidation(t, pod)
		if code != 126 || !strings.Contains(out, "validation timeout") || !strings.Contains(out, "istio-cni") {
			t.Fatalf("exit %d, want 126 with an explanation:\n%s", code, out)
		}
		if took > 6*time.Second {
			t.Fatalf("a 2s probe timeout took %s", took)
		}
	})
	t.Run("refuses-rule-mode", func(t *testing.T) {
		out, err := exec.Command(validBin, "-p", "15001").CombinedOutput()
		if ee, ok := err.(*exec.ExitError); !ok || ee.ExitCode() != 2 || !strings.Contains(string(out), "--run-validation") {
			t.Fatalf("want exit 2 explaining --run-validation: %v %s", err, out)
		}
	})
}
