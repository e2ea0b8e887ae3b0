package e2e

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"net"
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
	return runValidationAs(t, pod, 1337)
}

func runValidationAs(t *testing.T, pod *testenv.Pod, uid uint32) (int, string, time.Duration) {
	t.Helper()
	var out bytes.Buffer
	var code int
	start := time.Now()
	err := pod.InPod(func() error {
		cmd := exec.Command(validBin, append(testenv.InjectedValidationArgs(), "--probe-timeout", "2s")...)
		cmd.Stdout, cmd.Stderr = &out, &out
		cmd.SysProcAttr = &syscall.SysProcAttr{Credential: &syscall.Credential{Uid: uid, Gid: uid}}
		err := cmd.Run()
		var ee *exec.ExitError
		if errors.As(err, &ee) {
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
	// As Istio's validator, a proxy port that cannot be listened on is
	// only logged: the probe arrives on the inbound port.
	t.Run("outbound-port-held", func(t *testing.T) {
		e := newEnv(t, nil)
		sb := e.add(&testenv.PodSpec{Sidecar: true})
		var held net.Listener
		if err := sb.pod.InPod(func() (err error) {
			held, err = net.Listen("tcp", "127.0.0.1:15001")
			return err
		}); err != nil {
			t.Fatal(err)
		}
		defer held.Close()
		code, out, _ := runValidation(t, sb.pod)
		if code != 0 || !strings.Contains(out, "listening on 15001") || !strings.Contains(out, "validation passed") {
			t.Fatalf("exit %d, want 0 with the held port logged:\n%s", code, out)
		}
	})
	// Run as a uid the rules do not exclude, the probe is not redirected
	// although the rules are in place: the message says so.
	t.Run("wrong-uid", func(t *testing.T) {
		e := newEnv(t, nil)
		sb := e.add(&testenv.PodSpec{Sidecar: true})
		code, out, _ := runValidationAs(t, sb.pod, 1000)
		if code != 126 || !strings.Contains(out, "runs as uid 1000") || !strings.Contains(out, "uid 1337 (-u)") {
			t.Fatalf("exit %d, want 126 naming both uids:\n%s", code, out)
		}
	})
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
		var ee *exec.ExitError
		if !errors.As(err, &ee) || ee.ExitCode() != 2 || !strings.Contains(string(out), "--run-validation") {
			t.Fatalf("want exit 2 explaining --run-validation: %v %s", err, out)
		}
	})
}

// TestValidationIPv6: in a pod whose first address is IPv6 the probe uses
// [::1] and [::6], and passes once the plugin has programmed the pod.
func TestValidationIPv6(t *testing.T) {
	e := newEnv(t, nil)
	pod := e.newPod(&testenv.PodSpec{Sidecar: true})
	if err := pod.InPod(func() error {
		for _, c := range [][]string{
			{"link", "add", "v0", "type", "veth", "peer", "name", "v1"},
			{"link", "set", "v0", "up"}, {"link", "set", "v1", "up"},
			{"addr", "add", "fd00:77::5/64", "dev", "v0", "nodad"},
		} {
			if out, err := exec.Command("ip", c...).CombinedOutput(); err != nil {
				return fmt.Errorf("ip %v: %w %s", c, err, out)
			}
		}
		return nil
	}); err != nil {
		t.Fatal(err)
	}
	if code, out, _ := runValidation(t, pod); code != 126 || !strings.Contains(out, "[::6]:15002") {
		t.Fatalf("IPv6 probe before the rules: exit %d, want 126 naming [::6]:15002:\n%s", code, out)
	}
	conf := []byte(`{"cniVersion":"1.0.0","name":"k8s-pod-network","type":"istio-cni","cni_agent_run_dir":"` + e.node.RunDir + `"}`)
	if res, stderr := execPlugin(t, "ADD", pod.NetNS.Path(), "IgnoreUnknown=1;K8S_POD_NAMESPACE="+testNS+";K8S_POD_NAME="+pod.Name, conf); res != nil {
		t.Fatalf("ADD: %v\n%s", res, stderr)
	}
	if code, out, _ := runValidation(t, pod); code != 0 {
		t.Fatalf("IPv6 probe with the rules: exit %d, want 0:\n%s", code, out)
	}
}
