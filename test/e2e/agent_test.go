package e2e

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/containernetworking/cni/libcni"
	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/istio-cni-go/istio-cni/internal/cnirelay"
	"github.com/istio-cni-go/istio-cni/internal/install"
	"github.com/istio-cni-go/istio-cni/internal/prepared"
	"github.com/istio-cni-go/istio-cni/internal/testenv"
)

// host is a simulated node file system for the agent (testenv.AgentHost)
// with test-failing helpers.
type host struct {
	*testenv.AgentHost
	t *testing.T
}

func newHost(t *testing.T) *host {
	t.Helper()
	ah, err := testenv.NewAgentHost(context.Background(), t.TempDir(), cluster, pluginBin)
	if err != nil {
		t.Fatal(err)
	}
	return &host{AgentHost: ah, t: t}
}

func (h *host) rotateToken() string {
	h.t.Helper()
	tok, err := h.RotateToken(context.Background())
	if err != nil {
		h.t.Fatal(err)
	}
	return tok
}

func (h *host) start(extraArgs ...string) {
	h.t.Helper()
	if err := h.Start(agentBin, extraArgs...); err != nil {
		h.t.Fatal(err)
	}
	h.t.Cleanup(func() {
		h.Kill()
		if h.t.Failed() {
			h.t.Logf("agent log:\n%s", h.LogText())
		}
	})
}

// stop sends a signal and returns the exit code.
func (h *host) stop(sig syscall.Signal) int {
	h.t.Helper()
	h.Signal(sig)
	select {
	case <-h.Done():
	case <-time.After(20 * time.Second):
		h.t.Fatalf("agent did not exit after %v", sig)
	}
	return h.ExitCode()
}

// waitReadyz polls the agent's readiness endpoint (an outside process's
// state; there is nothing to subscribe to) until it answers want.
func (h *host) waitReadyz(want int, timeout time.Duration) string {
	h.t.Helper()
	deadline := time.Now().Add(timeout)
	var body string
	var code int
	for time.Now().Before(deadline) {
		if code, body = h.ReadyZ(); code == want {
			return body
		}
		select {
		case <-h.Done():
			h.t.Fatalf("agent exited while waiting for readiness %d; log:\n%s", want, h.LogText())
		case <-time.After(20 * time.Millisecond):
		}
	}
	h.t.Fatalf("readyz is %d (%q), want %d after %s", code, body, want, timeout)
	return ""
}

func (h *host) metric(name string) string {
	h.t.Helper()
	lines, err := h.Metrics(name)
	if err != nil {
		h.t.Fatal(err)
	}
	for _, l := range lines {
		if strings.HasPrefix(l, name+" ") || strings.HasPrefix(l, name+"{") {
			return l
		}
	}
	return ""
}

// metricCount is the value of the counter series name (0 before its
// first count); a line that does not end in an integer fails t.
func (h *host) metricCount(t *testing.T, name string) int {
	t.Helper()
	m := h.metric(name)
	if m == "" {
		return 0
	}
	n, err := strconv.Atoi(m[strings.LastIndex(m, " ")+1:])
	if err != nil {
		t.Fatalf("metric line %q: %v", m, err)
	}
	return n
}

// waitMetric polls the agent's metrics (an outside process) until name
// has the value want.
func (h *host) waitMetric(name, want string, timeout time.Duration) {
	h.t.Helper()
	deadline := time.Now().Add(timeout)
	for {
		m := h.metric(name)
		if strings.HasSuffix(m, " "+want) {
			return
		}
		if time.Now().After(deadline) {
			h.t.Fatalf("metric %q, want %s", m, want)
		}
		time.Sleep(10 * time.Millisecond) // polling an outside process
	}
}

// waitDir waits, on file events rather than sleeps, until cond holds for
// the directory.
func waitDir(t *testing.T, dir string, timeout time.Duration, cond func() bool) {
	t.Helper()
	if !waitDirFor(t, dir, timeout, cond) {
		t.Fatalf("condition on %s not met within %s", dir, timeout)
	}
}

func entryCount(t *testing.T, path string) (int, bool) {
	data, err := os.ReadFile(path)
	if err != nil {
		return 0, false
	}
	var l struct {
		Plugins []map[string]any `json:"plugins"`
	}
	if json.Unmarshal(data, &l) != nil {
		return 0, false
	}
	n := 0
	for _, p := range l.Plugins {
		if p["type"] == "istio-cni" {
			n++
		}
	}
	last := len(l.Plugins) > 0 && l.Plugins[len(l.Plugins)-1]["type"] == "istio-cni"
	return n, last
}

func copyFile(t *testing.T, src, dst string) {
	t.Helper()
	b, err := os.ReadFile(src)
	if err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(dst, b, 0o644); err != nil {
		t.Fatal(err)
	}
}

const primaryDir = "../../internal/install/testdata/primary"

func ensureDaemonSet(t *testing.T, present bool) {
	t.Helper()
	if present {
		ensureDaemonSetSelecting(t, nil)
		return
	}
	_ = cluster.Client.AppsV1().DaemonSets("istio-system").Delete(context.Background(), "istio-cni-node", metav1.DeleteOptions{})
}

// ensureDaemonSetSelecting makes the agent's DaemonSet, with nodeSelector
// (nil: every node).
func ensureDaemonSetSelecting(t *testing.T, nodeSelector map[string]string) {
	t.Helper()
	ctx := context.Background()
	dss := cluster.Client.AppsV1().DaemonSets("istio-system")
	_ = dss.Delete(ctx, "istio-cni-node", metav1.DeleteOptions{})
	labels := map[string]string{"k8s-app": "istio-cni-node"}
	ds := &appsv1.DaemonSet{ObjectMeta: metav1.ObjectMeta{Name: "istio-cni-node"},
		Spec: appsv1.DaemonSetSpec{Selector: &metav1.LabelSelector{MatchLabels: labels},
			Template: corev1.PodTemplateSpec{ObjectMeta: metav1.ObjectMeta{Labels: labels},
				Spec: corev1.PodSpec{NodeSelector: nodeSelector, Containers: []corev1.Container{{Name: "install-cni", Image: "install-cni:test"}}}}}}
	if _, err := dss.Create(ctx, ds, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = dss.Delete(context.Background(), "istio-cni-node", metav1.DeleteOptions{}) })
}

func TestAgentInstallGuardRemove(t *testing.T) {
	ensureDaemonSet(t, false)
	h := newHost(t)
	calico := filepath.Join(h.NetDir, "10-calico.conflist")
	copyFile(t, filepath.Join(primaryDir, "10-calico.conflist"), calico)
	if err := os.Chmod(calico, 0o640); err != nil {
		t.Fatal(err)
	}
	orig, _ := os.ReadFile(calico)
	// Rewrites here come from the test, not a fight: no back-off.
	h.start("--conflict-limit", "1000")
	h.waitReadyz(200, 20*time.Second)

	if n, last := entryCount(t, calico); n != 1 || !last {
		t.Fatalf("entry count %d, last %v", n, last)
	}
	if _, err := libcni.ConfListFromFile(calico); err != nil {
		t.Fatalf("libcni rejects the installed config: %v", err)
	}
	if fi, _ := os.Stat(calico); fi.Mode().Perm() != 0o640 {
		t.Fatalf("config mode changed to %v", fi.Mode().Perm())
	}
	if fi, err := os.Stat(filepath.Join(h.BinDir, "istio-cni")); err != nil || fi.Mode().Perm() != 0o755 {
		t.Fatalf("binary not installed executable: %v %v", fi, err)
	}
	kc := filepath.Join(h.RunDir, "istio-cni-kubeconfig")
	if fi, err := os.Stat(kc); err != nil || fi.Mode().Perm() != 0o600 {
		t.Fatalf("kubeconfig not 0600: %v %v", fi, err)
	}
	if m := h.metric("istio_cni_install_ready"); !strings.HasSuffix(m, " 1") {
		t.Fatalf("install_ready metric: %q", m)
	}
	if m := h.metric(`istio_cni_installs_total{result="SUCCESS"}`); !strings.HasSuffix(m, " 1") {
		t.Fatalf("installs_total after the first install: %q", m)
	}
	// The Go runtime and process collectors, as Istio's agent exposes.
	for _, name := range []string{"go_goroutines", "go_memstats_heap_alloc_bytes", "process_open_fds", "process_resident_memory_bytes"} {
		if h.metric(name) == "" {
			t.Errorf("metric %s missing", name)
		}
	}

	t.Run("reinsert-after-primary-rewrites-100-times", func(t *testing.T) {
		var worst time.Duration
		for i := 0; i < 100; i++ {
			// Half the rewrites in place, half by rename, as CNI agents do.
			start := time.Now()
			if i%2 == 0 {
				copyFile(t, filepath.Join(primaryDir, "10-calico.conflist"), calico)
			} else {
				tmp := filepath.Join(h.NetDir, ".calico-tmp")
				copyFile(t, filepath.Join(primaryDir, "10-calico.conflist"), tmp)
				if err := os.Rename(tmp, calico); err != nil {
					t.Fatal(err)
				}
			}
			waitDir(t, h.NetDir, 10*time.Second, func() bool {
				n, last := entryCount(t, calico)
				return n == 1 && last
			})
			worst = max(worst, time.Since(start))
			if n, _ := entryCount(t, calico); n != 1 {
				t.Fatalf("rewrite %d: %d entries", i, n)
			}
		}
		t.Logf("worst re-insertion time over 100 rewrites: %s", worst)
		// The counter is bumped just after the write the loop above saw.
		h.waitMetric("istio_cni_config_reinsertions_total", "100", 5*time.Second)
		// Istio counts a successful install pass for each re-insertion too.
		h.waitMetric(`istio_cni_installs_total{result="SUCCESS"}`, "101", 5*time.Second)
	})

	t.Run("token-rotation-rewrites-kubeconfig", func(t *testing.T) {
		tok := h.rotateToken()
		waitDir(t, h.RunDir, 10*time.Second, func() bool {
			b, _ := os.ReadFile(kc)
			return strings.Contains(string(b), tok)
		})
	})

	t.Run("uninstall-removes-entry-then-kubeconfig-then-binary", func(t *testing.T) {
		h.waitReadyz(200, 20*time.Second)
		// The agent prepares ahead (the default): its directory is there
		// to be removed.
		records := filepath.Join(h.RunDir, prepared.DirName)
		if _, err := os.Stat(records); err != nil {
			t.Fatalf("before uninstall: %v", err)
		}
		if code := h.stop(syscall.SIGTERM); code != 0 {
			t.Fatalf("exit code %d", code)
		}
		after, _ := os.ReadFile(calico)
		var a, o map[string]any
		_ = json.Unmarshal(after, &a)
		_ = json.Unmarshal(orig, &o)
		ab, _ := json.Marshal(a)
		ob, _ := json.Marshal(o)
		if !bytes.Equal(ab, ob) {
			t.Fatalf("primary config not restored:\n%s", after)
		}
		for _, p := range []string{kc, filepath.Join(h.BinDir, "istio-cni"), records} {
			if _, err := os.Stat(p); !os.IsNotExist(err) {
				t.Fatalf("%s left after uninstall", p)
			}
		}
	})
}

// TestAgentConflictBackoff: a component that keeps reverting the config
// is named in a warning (with the Cilium hint), counted, and still loses.
func TestAgentConflictBackoff(t *testing.T) {
	ensureDaemonSet(t, false)
	h := newHost(t)
	cilium := filepath.Join(h.NetDir, "05-cilium.conflist")
	copyFile(t, filepath.Join(primaryDir, "05-cilium.conflist"), cilium)
	h.start("--conflict-limit", "2", "--conflict-window", "30s")
	h.waitReadyz(200, 20*time.Second)
	for i := 0; i < 4; i++ {
		copyFile(t, filepath.Join(primaryDir, "05-cilium.conflist"), cilium)
		waitDir(t, h.NetDir, 20*time.Second, func() bool {
			n, last := entryCount(t, cilium)
			return n == 1 && last
		})
	}
	logs := h.LogText()
	if !strings.Contains(logs, "keeps rewriting the CNI config") || !strings.Contains(logs, "cni.exclusive=false") || !strings.Contains(logs, "05-cilium.conflist") {
		t.Fatalf("no conflict warning naming the file with the Cilium hint:\n%s", logs)
	}
	if m := h.metric("istio_cni_config_conflicts_total"); m == "" || strings.HasSuffix(m, " 0") {
		t.Fatalf("conflicts metric: %q", m)
	}
}

func TestAgentUpgradeKeepsPlugin(t *testing.T) {
	ensureDaemonSet(t, true)
	h := newHost(t)
	calico := filepath.Join(h.NetDir, "10-calico.conflist")
	copyFile(t, filepath.Join(primaryDir, "10-calico.conflist"), calico)
	h.start()
	h.waitReadyz(200, 20*time.Second)
	if code := h.stop(syscall.SIGTERM); code != 0 {
		t.Fatalf("exit code %d", code)
	}
	if n, last := entryCount(t, calico); n != 1 || !last {
		t.Fatal("entry removed during an upgrade")
	}
	// The prepared records too: the relay serves pods from them until the
	// new agent starts.
	for _, p := range []string{filepath.Join(h.RunDir, "istio-cni-kubeconfig"), filepath.Join(h.BinDir, "istio-cni"), filepath.Join(h.RunDir, prepared.DirName)} {
		if _, err := os.Stat(p); err != nil {
			t.Fatalf("%s removed during an upgrade", p)
		}
	}
	if !strings.Contains(h.LogText(), "leaving the plugin in place") {
		t.Fatal("no log line explaining why the plugin stayed")
	}
	// The fallback's ADDs wait for the next agent's token in a while of
	// this.
	if fi, err := os.Stat(filepath.Join(h.RunDir, cnirelay.StoppedName)); err != nil || time.Since(fi.ModTime()) > time.Minute {
		t.Fatalf("the agent did not record its stop for the fallback: %v", err)
	}
}

// TestAgentLeavesANodeItsDaemonSetNoLongerTargets: a helm upgrade that
// narrows the DaemonSet's nodeSelector takes the agent off this node for
// good. Its termination removes the plugin, which would otherwise fail
// every later pod here with the credentials of the agent's deleted pod;
// with the selector still matching the node, it is a rollout and the
// plugin stays.
func TestAgentLeavesANodeItsDaemonSetNoLongerTargets(t *testing.T) {
	ctx := context.Background()
	node := &corev1.Node{ObjectMeta: metav1.ObjectMeta{Name: testenv.NodeName, Labels: map[string]string{"pool": "mesh"}}}
	if _, err := cluster.Client.CoreV1().Nodes().Create(ctx, node, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		_ = cluster.Client.CoreV1().Nodes().Delete(context.Background(), testenv.NodeName, metav1.DeleteOptions{})
	})
	for _, c := range []struct {
		pool string
		kept bool
	}{{"mesh", true}, {"elsewhere", false}} {
		t.Run(c.pool, func(t *testing.T) {
			ensureDaemonSetSelecting(t, map[string]string{"pool": c.pool})
			h := newHost(t)
			calico := filepath.Join(h.NetDir, "10-calico.conflist")
			copyFile(t, filepath.Join(primaryDir, "10-calico.conflist"), calico)
			h.start("--kubernetes-node-name", testenv.NodeName)
			h.waitReadyz(200, 20*time.Second)
			if code := h.stop(syscall.SIGTERM); code != 0 {
				t.Fatalf("exit code %d", code)
			}
			n, _ := entryCount(t, calico)
			_, binErr := os.Stat(filepath.Join(h.BinDir, "istio-cni"))
			if kept := n == 1 && binErr == nil; kept != c.kept {
				t.Fatalf("DaemonSet selecting pool=%s on a node of pool=mesh: entries %d, relay %v; want kept %v\n%s", c.pool, n, binErr, c.kept, h.LogText())
			}
			if !c.kept && !strings.Contains(h.LogText(), "no longer targets this node") {
				t.Fatalf("the removal's reason is not logged:\n%s", h.LogText())
			}
			// Only a rollout makes the fallback wait for a new token.
			if _, err := os.Stat(filepath.Join(h.RunDir, cnirelay.StoppedName)); (err == nil) != c.kept {
				t.Fatalf("%s after a stop that kept the plugin %v: %v", cnirelay.StoppedName, c.kept, err)
			}
		})
	}
}

// TestAgentWritesKubeconfigFirst: a starting agent writes the plugin
// kubeconfig before it serves a relay, and whatever its install pass
// meets: a relay that leaves it for the fallback must not find the
// previous agent's credentials, which the API server refuses once that
// agent's pod is gone. Here the pass fails on every round (the bin dir is
// a file), so the kubeconfig is written ahead of it or never.
func TestAgentWritesKubeconfigFirst(t *testing.T) {
	ensureDaemonSet(t, false)
	h := newHost(t)
	copyFile(t, filepath.Join(primaryDir, "10-calico.conflist"), filepath.Join(h.NetDir, "10-calico.conflist"))
	if err := os.MkdirAll(h.RunDir, 0o755); err != nil {
		t.Fatal(err)
	}
	kubeconfig := filepath.Join(h.RunDir, "istio-cni-kubeconfig")
	if err := os.WriteFile(kubeconfig, []byte("the previous agent's"), 0o600); err != nil {
		t.Fatal(err)
	}
	if err := os.RemoveAll(h.BinDir); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(h.BinDir, nil, 0o644); err != nil {
		t.Fatal(err)
	}
	h.start()
	h.waitLog("not a directory", 20*time.Second)
	for deadline := time.Now().Add(20 * time.Second); ; {
		_, sockErr := os.Stat(filepath.Join(h.RunDir, cnirelay.SocketName))
		b, err := os.ReadFile(kubeconfig)
		if err != nil {
			t.Fatal(err)
		}
		if sockErr == nil {
			if string(b) == "the previous agent's" || !strings.Contains(string(b), "token") {
				t.Fatalf("the agent serves relays while the kubeconfig is %q", b)
			}
			break
		}
		if time.Now().After(deadline) {
			t.Fatal("the agent never served relays")
		}
		time.Sleep(20 * time.Millisecond) // polling files the agent writes
	}
	h.waitReadyz(503, 10*time.Second)
}

func TestAgentWaitsForPrimaryAndWrapsConf(t *testing.T) {
	ensureDaemonSet(t, false)
	h := newHost(t)
	if err := os.WriteFile(filepath.Join(h.NetDir, "00-broken.conflist"), []byte(`{"plugins":[`), 0o644); err != nil {
		t.Fatal(err)
	}
	h.start()
	body := h.waitReadyz(503, 10*time.Second)
	for !strings.Contains(body, "waiting for the primary") {
		body = h.waitReadyz(503, 10*time.Second)
	}
	bridge := filepath.Join(h.NetDir, "10-bridge.conf")
	copyFile(t, filepath.Join(primaryDir, "10-bridge.conf"), bridge)
	h.waitReadyz(200, 20*time.Second)
	if _, err := os.Stat(bridge); !os.IsNotExist(err) {
		t.Fatal("the wrapped .conf is still there")
	}
	if n, last := entryCount(t, bridge+"list"); n != 1 || !last {
		t.Fatal("no entry in the wrapped .conflist")
	}
	if !strings.Contains(h.LogText(), "00-broken.conflist") {
		t.Fatal("the invalid config was not named in a warning")
	}
}

func TestAgentStandalone(t *testing.T) {
	ensureDaemonSet(t, false)
	h := newHost(t)
	h.start("--chained-cni-plugin=false")
	h.waitReadyz(200, 20*time.Second)
	p := filepath.Join(h.NetDir, install.StandaloneConfName)
	conf, err := readPluginConf(p)
	if err != nil || conf.Network.Type != "istio-cni" {
		t.Fatalf("standalone config: %v %v", conf, err)
	}
	if code := h.stop(syscall.SIGTERM); code != 0 {
		t.Fatalf("exit %d", code)
	}
	if _, err := os.Stat(p); !os.IsNotExist(err) {
		t.Fatal("standalone config left after uninstall")
	}
}

// readPluginConf reads a single-plugin config file, the format of the
// standalone config (Istio writes one for Multus). libcni deprecates its
// reader for that format, not the format's use by runtimes.
func readPluginConf(path string) (*libcni.PluginConfig, error) {
	b, err := os.ReadFile(path)
	if err != nil {
		return nil, err
	}
	return libcni.NetworkPluginConfFromBytes(b)
}

func TestAgentBadInput(t *testing.T) {
	ensureDaemonSet(t, false)
	t.Run("missing-token", func(t *testing.T) {
		h := newHost(t)
		copyFile(t, filepath.Join(primaryDir, "10-calico.conflist"), filepath.Join(h.NetDir, "10-calico.conflist"))
		if err := os.Remove(filepath.Join(h.SADir, "token")); err != nil {
			t.Fatal(err)
		}
		h.start()
		body := h.waitReadyz(503, 10*time.Second)
		for !strings.Contains(body, "token") {
			body = h.waitReadyz(503, 10*time.Second)
		}
		if n, _ := entryCount(t, filepath.Join(h.NetDir, "10-calico.conflist")); n != 0 {
			t.Fatal("config written although the kubeconfig could not be")
		}
	})
	t.Run("read-only-conf-dir", func(t *testing.T) {
		h := newHost(t)
		calico := filepath.Join(h.NetDir, "10-calico.conflist")
		copyFile(t, filepath.Join(primaryDir, "10-calico.conflist"), calico)
		orig, _ := os.ReadFile(calico)
		if err := syscall.Mount(h.NetDir, h.NetDir, "", syscall.MS_BIND, ""); err != nil {
			t.Fatal(err)
		}
		defer func() {
			if err := syscall.Unmount(h.NetDir, syscall.MNT_DETACH); err != nil {
				t.Errorf("unmounting the read-only bind of %s: %v", h.NetDir, err)
			}
		}()
		if err := syscall.Mount("", h.NetDir, "", syscall.MS_BIND|syscall.MS_REMOUNT|syscall.MS_RDONLY, ""); err != nil {
			t.Fatal(err)
		}
		h.start()
		body := h.waitReadyz(503, 10*time.Second)
		for !strings.Contains(body, "read-only") {
			body = h.waitReadyz(503, 10*time.Second)
		}
		if now, _ := os.ReadFile(calico); !bytes.Equal(now, orig) {
			t.Fatal("config changed in a read-only dir")
		}
	})
	t.Run("bad-flag", func(t *testing.T) {
		out, err := exec.Command(agentBin, "--kubeconfig-mode", "rw").CombinedOutput()
		var ee *exec.ExitError
		if !errors.As(err, &ee) || ee.ExitCode() != 2 || !strings.Contains(string(out), "kubeconfig-mode") {
			t.Fatalf("want exit 2 naming the flag, got %v: %s", err, out)
		}
	})
}

// TestAgentPicksNftablesWithoutIPTables: with --native-nftables=auto the
// agent looks at the host once and writes its choice into the plugin entry.
func TestAgentPicksNftablesWithoutIPTables(t *testing.T) {
	ensureDaemonSet(t, false)
	for _, hostHasIPT := range []bool{false, true} {
		h := newHost(t)
		root := t.TempDir()
		if hostHasIPT {
			if err := os.MkdirAll(filepath.Join(root, "usr", "sbin"), 0o755); err != nil {
				t.Fatal(err)
			}
			if err := os.Symlink("/usr/sbin/iptables-nft-restore", filepath.Join(root, "usr", "sbin", "iptables-restore")); err != nil {
				t.Fatal(err)
			}
		}
		calico := filepath.Join(h.NetDir, "10-calico.conflist")
		copyFile(t, filepath.Join(primaryDir, "10-calico.conflist"), calico)
		h.start("--native-nftables", "auto", "--host-root", root)
		h.waitReadyz(200, 20*time.Second)
		data, _ := os.ReadFile(calico)
		want := `"native_nftables": ` + strconv.FormatBool(!hostHasIPT)
		if !strings.Contains(string(data), want) {
			t.Fatalf("host has iptables=%v: entry lacks %s:\n%s", hostHasIPT, want, data)
		}
	}
}
