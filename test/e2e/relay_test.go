package e2e

import (
	"context"
	"fmt"
	"net"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"golang.org/x/sys/unix"
	authv1 "k8s.io/api/authentication/v1"
	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/rest"

	"github.com/istio-cni-go/istio-cni/internal/cnirelay"
	"github.com/istio-cni-go/istio-cni/internal/testenv"
)

// TestRelay covers the runtime-facing binary's choices: the agent when it
// answers, the fallback plugin when it does not (no socket, a dead agent's
// socket, an agent gone mid-command), and a clear error when neither can
// serve. Each time the pod ends up with the same rules.
func TestRelay(t *testing.T) {
	sock := func(e *env) string { return filepath.Join(e.node.RunDir, cnirelay.SocketName) }
	addAndCheck := func(t *testing.T, e *env) {
		t.Helper()
		sb := e.add(&testenv.PodSpec{Sidecar: true})
		if rules := rulesIn(t, sb.pod); !strings.Contains(rules, "-A ISTIO_OUTPUT") {
			t.Fatalf("no redirect rules after ADD:\n%s", rules)
		}
		if err := e.node.Check(context.Background(), e.node.Chained, sb.pod); err != nil {
			t.Fatalf("CHECK: %v", err)
		}
	}

	t.Run("dead-agent-socket", func(t *testing.T) {
		e := newEnv(t, nil)
		// A socket file nobody listens on, as a killed agent leaves it.
		l, err := net.ListenUnix("unix", &net.UnixAddr{Name: sock(e), Net: "unix"})
		if err != nil {
			t.Fatal(err)
		}
		l.SetUnlinkOnClose(false)
		l.Close()
		if _, err := os.Stat(sock(e)); err != nil {
			t.Fatal(err)
		}
		addAndCheck(t, e)
	})

	t.Run("agent-gone-mid-command", func(t *testing.T) {
		e := newEnv(t, nil)
		l, err := net.ListenUnix("unix", &net.UnixAddr{Name: sock(e), Net: "unix"})
		if err != nil {
			t.Fatal(err)
		}
		defer l.Close()
		go func() {
			for {
				c, err := l.Accept()
				if err != nil {
					return
				}
				c.Close() // takes the command, dies before answering
			}
		}()
		addAndCheck(t, e)
	})

	t.Run("agent-answers", func(t *testing.T) {
		e := newEnv(t, nil)
		e.serveCNI("")
		// The plugin's kubeconfig is useless: only the agent can serve.
		if err := os.Remove(filepath.Join(e.node.RunDir, "istio-cni-kubeconfig")); err != nil {
			t.Fatal(err)
		}
		addAndCheck(t, e)

		// Errors come back as the plugin's own, naming the annotation.
		pod := e.newPod(&testenv.PodSpec{Sidecar: true, Annotations: map[string]string{
			"traffic.sidecar.istio.io/excludeOutboundPorts": "70000"}})
		_, err := e.node.Add(context.Background(), e.node.Chained, pod)
		if err == nil || !strings.Contains(err.Error(), "traffic.sidecar.istio.io/excludeOutboundPorts") || !strings.Contains(err.Error(), "70000") {
			t.Fatalf("ADD with a bad annotation through the agent: %v", err)
		}
		if rules := rulesIn(t, pod); strings.Contains(rules, "ISTIO_") {
			t.Fatalf("rules applied despite the bad annotation:\n%s", rules)
		}
	})

	t.Run("no-agent-no-fallback", func(t *testing.T) {
		e := newEnv(t, nil)
		// A bin dir with the relay alone.
		dir := t.TempDir()
		relay := filepath.Join(dir, "istio-cni")
		copyFile(t, pluginBin, relay)
		if err := os.Chmod(relay, 0o755); err != nil {
			t.Fatal(err)
		}
		pod := e.newPod(&testenv.PodSpec{Sidecar: true})
		if _, err := e.node.Add(context.Background(), e.node.Primary, pod); err != nil {
			t.Fatal(err)
		}
		conf := []byte(`{"cniVersion":"1.0.0","name":"k8s-pod-network","type":"istio-cni","cni_agent_run_dir":"` + e.node.RunDir + `"}`)
		res, _ := execPluginAt(t, relay, "ADD", pod.NetNS.Path(), "K8S_POD_NAMESPACE="+testNS+";K8S_POD_NAME="+pod.Name, conf)
		wantErr(t, res, "no node agent", cnirelay.FallbackBinary)
	})
}

// TestFallbackTakesTheNextAgentsToken: in a rollout of istio-cni-node the
// plugin's kubeconfig holds the old agent's token, which is bound to the
// old agent's pod, and the API server refuses it (HTTP 401) once that pod
// is deleted. A pod whose sandbox starts then, with no agent serving,
// gets the fallback, which waits within k8s_retry_budget for the next
// agent: its kubeconfig, with which the fallback starts the pod; or its
// socket (an agent that wrote no kubeconfig), and the relay asks that
// agent. The real API server refuses the token of a deleted pod, and the
// next agent comes only once the plugin has read the refused kubeconfig.
func TestFallbackTakesTheNextAgentsToken(t *testing.T) {
	t.Run("its kubeconfig", func(t *testing.T) {
		e := newEnv(t, nil)
		kubeconfig := refusedKubeconfig(t, e)
		read := readOf(t, kubeconfig)
		wrote := make(chan error, 1)
		go func() {
			if err := <-read; err != nil {
				wrote <- err
				return
			}
			// Written as the agent writes it: a rename.
			tmp := kubeconfig + ".next"
			if err := cluster.PluginKubeconfig(context.Background(), tmp); err != nil {
				wrote <- err
				return
			}
			wrote <- os.Rename(tmp, kubeconfig)
		}()
		sb := e.add(&testenv.PodSpec{Sidecar: true})
		if err := <-wrote; err != nil {
			t.Fatal(err)
		}
		if rules := rulesIn(t, sb.pod); !strings.Contains(rules, "-A ISTIO_OUTPUT") {
			t.Fatalf("no redirect rules after ADD:\n%s", rules)
		}
	})

	t.Run("its socket", func(t *testing.T) {
		e := newEnv(t, nil)
		read := readOf(t, refusedKubeconfig(t, e))
		pod := e.newPod(&testenv.PodSpec{Sidecar: true})
		added := make(chan error, 1)
		go func() {
			_, err := e.node.Add(context.Background(), e.node.Chained, pod)
			added <- err
		}()
		if err := <-read; err != nil {
			t.Fatal(err)
		}
		e.serveCNI("")
		if err := <-added; err != nil {
			t.Fatalf("chained ADD: %v", err)
		}
		t.Cleanup(func() { _ = e.node.Del(context.Background(), e.node.Chained, pod) })
		// The agent counts the ADD once the relay reports how its send
		// went, which the relay does without waiting.
		for deadline := time.Now().Add(10 * time.Second); counted(e.commands) < 1; {
			if time.Now().After(deadline) {
				t.Fatal("the new agent served no command: the ADD was not asked of it")
			}
			time.Sleep(time.Millisecond) // polling another goroutine's counter, bounded
		}
		if rules := rulesIn(t, pod); !strings.Contains(rules, "-A ISTIO_OUTPUT") {
			t.Fatalf("no redirect rules after ADD:\n%s", rules)
		}
	})
}

// refusedKubeconfig writes the plugin's kubeconfig with a token bound to
// an agent pod that is then deleted, and returns its path once the API
// server refuses the token.
func refusedKubeconfig(t *testing.T, e *env) string {
	t.Helper()
	ctx := context.Background()
	kubeconfig := filepath.Join(e.node.RunDir, "istio-cni-kubeconfig")
	if _, err := cluster.PluginToken(ctx); err != nil {
		t.Fatal(err)
	}
	// The old agent's pod and its bound token, as the kubelet projects it.
	old, err := cluster.Client.CoreV1().Pods("kube-system").Create(ctx, &corev1.Pod{
		ObjectMeta: metav1.ObjectMeta{Name: fmt.Sprintf("istio-cni-node-old-%d", podSeq.Add(1))},
		Spec: corev1.PodSpec{ServiceAccountName: "istio-cni", NodeName: "another-node", AutomountServiceAccountToken: new(bool),
			Containers: []corev1.Container{{Name: "install-cni", Image: "istio-cni"}}},
	}, metav1.CreateOptions{})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		_ = cluster.Client.CoreV1().Pods("kube-system").Delete(ctx, old.Name, metav1.DeleteOptions{GracePeriodSeconds: new(int64)})
	})
	exp := int64(3600)
	tr, err := cluster.Client.CoreV1().ServiceAccounts("kube-system").CreateToken(ctx, "istio-cni", &authv1.TokenRequest{Spec: authv1.TokenRequestSpec{
		ExpirationSeconds: &exp,
		BoundObjectRef:    &authv1.BoundObjectReference{Kind: "Pod", APIVersion: "v1", Name: old.Name, UID: old.UID},
	}}, metav1.CreateOptions{})
	if err != nil {
		t.Fatal(err)
	}
	if err := testenv.WriteKubeconfig(kubeconfig, cluster.URL, cluster.CAFile, tr.Status.Token); err != nil {
		t.Fatal(err)
	}
	// The old agent stops, leaving the plugin, as in a rollout.
	if err := os.WriteFile(filepath.Join(e.node.RunDir, cnirelay.StoppedName), nil, 0o644); err != nil {
		t.Fatal(err)
	}
	if err := cluster.Client.CoreV1().Pods("kube-system").Delete(ctx, old.Name, metav1.DeleteOptions{GracePeriodSeconds: new(int64)}); err != nil {
		t.Fatal(err)
	}
	oldClient, err := kubernetes.NewForConfig(&rest.Config{Host: cluster.URL, BearerToken: tr.Status.Token,
		TLSClientConfig: rest.TLSClientConfig{CAFile: cluster.CAFile}})
	if err != nil {
		t.Fatal(err)
	}
	deadline := time.Now().Add(30 * time.Second)
	for {
		_, err := oldClient.CoreV1().Pods(testNS).Get(ctx, "any", metav1.GetOptions{})
		if apierrors.IsUnauthorized(err) {
			return kubeconfig
		}
		if time.Now().After(deadline) {
			t.Fatalf("the API server still takes the token of a deleted pod: %v", err)
		}
		time.Sleep(50 * time.Millisecond) // polling the API server's view, bounded
	}
}

// readOf reports on the channel when a process has read path (closed it
// after reading), or an error after two minutes.
func readOf(t *testing.T, path string) <-chan error {
	t.Helper()
	fd, err := unix.InotifyInit1(unix.IN_CLOEXEC | unix.IN_NONBLOCK)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := unix.InotifyAddWatch(fd, path, unix.IN_CLOSE_NOWRITE); err != nil {
		unix.Close(fd)
		t.Fatal(err)
	}
	events := os.NewFile(uintptr(fd), "inotify")
	t.Cleanup(func() { events.Close() })
	read := make(chan error, 1)
	go func() {
		_ = events.SetReadDeadline(time.Now().Add(2 * time.Minute))
		buf := make([]byte, 4096)
		if _, err := events.Read(buf); err != nil {
			read <- fmt.Errorf("the plugin never read %s: %w", path, err)
			return
		}
		read <- nil
	}()
	return read
}
