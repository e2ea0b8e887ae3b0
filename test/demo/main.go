// Command demo shows the whole product on one machine, with no cluster: a
// simulated node (temp CNI conf and bin dirs with a ptp primary config), a
// real kube-apiserver and etcd, the real install-cni agent, pods started
// through the CNI chain as a runtime does, the validation command, repair,
// real connections, metrics and uninstall. Every step checks what it
// claims and the demo fails loudly when one does not hold.
package main

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net"
	"net/netip"
	"os"
	"os/exec"
	"os/signal"
	"path/filepath"
	"strings"
	"syscall"
	"time"

	"github.com/containernetworking/cni/libcni"
	current "github.com/containernetworking/cni/pkg/types/100"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/istio-cni-go/istio-cni/internal/install"
	"github.com/istio-cni-go/istio-cni/internal/testenv"
)

func main() {
	testenv.RunHelperIfRequested()
	testenv.EnterNodeNamespace()
	// A signal cancels the run instead of killing the process, so its
	// clean-ups stop the agent and the cluster and remove what it made.
	// Never stopped: the process ends with the run.
	ctx, _ := signal.NotifyContext(context.Background(), syscall.SIGINT, syscall.SIGTERM)
	start := time.Now()
	if err := run(ctx); err != nil {
		if ctx.Err() != nil {
			fmt.Fprintln(os.Stderr, "\nDEMO INTERRUPTED; cleaned up.")
			os.Exit(130)
		}
		fmt.Fprintln(os.Stderr, "\nDEMO FAILED:", err)
		os.Exit(1)
	}
	say("\nDone in %s: every step did what it said.", time.Since(start).Round(100*time.Millisecond))
}

func say(format string, args ...any) { fmt.Printf(format+"\n", args...) }

var stepN int

func step(title string) {
	stepN++
	say("\n%d. %s", stepN, title)
}

const ns = "demo"

type demo struct {
	ctx      context.Context
	dir      string
	cluster  *testenv.Cluster
	host     *testenv.AgentHost
	cni      *libcni.CNIConfig
	validate string
	agent    string
	cleanups []func()
}

func run(ctx context.Context) (err error) {
	d := &demo{ctx: ctx}
	defer func() {
		for i := len(d.cleanups) - 1; i >= 0; i-- {
			d.cleanups[i]()
		}
	}()
	if d.dir, err = os.MkdirTemp("", "istio-cni-demo-"); err != nil {
		return err
	}
	d.cleanups = append(d.cleanups, func() {
		// The logs a failure points to (agent.log, cluster.log) are in
		// there; an interrupted run leaves nothing behind.
		if err != nil && ctx.Err() == nil {
			err = fmt.Errorf("%w\n(the demo's files are kept in %s)", err, d.dir)
			return
		}
		_ = os.RemoveAll(d.dir)
	}, testenv.RemoveSandboxCgroups)
	_ = os.Chmod(d.dir, 0o755)

	say("== istio-cni on one machine ==")
	say("A simulated node: a private network namespace with no way out, its CNI config and bin dirs in %s.", d.dir)
	say("Building the plugin, the agent and the validation command, starting etcd and kube-apiserver on loopback...")
	plugin, err := testenv.BuildPlugin(d.dir)
	if err != nil {
		return err
	}
	if d.agent, err = testenv.BuildCommand(d.dir, "install-cni"); err != nil {
		return err
	}
	if d.validate, err = testenv.BuildCommand(d.dir, "istio-cni-validate"); err != nil {
		return err
	}
	if d.cluster, err = testenv.StartCluster(filepath.Join(d.dir, "cluster")); err != nil {
		return err
	}
	d.cleanups = append(d.cleanups, d.cluster.Stop)
	if err := testenv.EnsureNamespace(d.ctx, d.cluster.Client, ns); err != nil {
		return err
	}
	if d.host, err = testenv.NewAgentHost(d.ctx, filepath.Join(d.dir, "node"), d.cluster, plugin); err != nil {
		return err
	}
	for _, p := range []string{"ptp", "host-local"} {
		if err := os.Symlink(filepath.Join(testenv.ReferencePluginDir, p), filepath.Join(d.host.BinDir, p)); err != nil {
			return err
		}
	}
	d.cni = libcni.NewCNIConfigWithCacheDir([]string{d.host.BinDir}, filepath.Join(d.dir, "cni-cache"), nil)
	primary := filepath.Join(d.host.NetDir, "10-ptp.conflist")
	// A subnet of its own: the repair controller looks up pod IPs in every
	// namespace of the machine's /proc, and the end-to-end tests may run
	// pods at the same time.
	orig := []byte(`{"cniVersion":"1.0.0","name":"k8s-pod-network","plugins":[{"type":"ptp","ipMasq":false,` +
		`"ipam":{"type":"host-local","dataDir":"` + filepath.Join(d.dir, "ipam") + `","ranges":[[{"subnet":"10.248.0.0/24"}]],"routes":[{"dst":"0.0.0.0/0"}]}}]}` + "\n")
	if err := os.WriteFile(primary, orig, 0o644); err != nil {
		return err
	}

	step("The node's primary CNI config, before the agent runs:")
	printConf(orig)

	step("The start-up race: pod demo/early is scheduled before the agent is ready.")
	early, earlyIP, err := d.sandbox("early")
	if err != nil {
		return err
	}
	code, out, err := d.runValidation(early)
	if err != nil {
		return err
	}
	if code != 126 {
		return fmt.Errorf("validation of the raced pod exited %d, want 126:\n%s", code, out)
	}
	say("   The runtime ran only ptp: the plugin was not in the chain yet. The validation command,")
	say("   run in the pod as uid 1337, exits 126: %s", firstLine(out, "validation timeout"))
	if err := d.reportValidationFailed("early", earlyIP); err != nil {
		return err
	}
	say("   The kubelet reports the failed istio-validation container (exit 126) in the pod status.")

	step("The agent starts: it installs the plugin and inserts it into the node's CNI config.")
	if err := d.host.Start(d.agent, "--plugin-log-level", "warn", "--kubernetes-node-name", testenv.NodeName, "--repair-host-proc", "/proc", "--repair-repair-pods"); err != nil {
		return err
	}
	d.cleanups = append(d.cleanups, func() { _, _ = d.host.Stop(10 * time.Second) })
	if err := d.host.WaitReady(30 * time.Second); err != nil {
		return err
	}
	after, err := os.ReadFile(primary)
	if err != nil {
		return err
	}
	if st, err := install.Inspect(after, nil); err != nil || st == install.EntryMissing {
		return fmt.Errorf("the agent is ready but the config has no istio-cni entry")
	}
	say("   Ready (/readyz 200). The config now ends with the istio-cni entry; ptp is untouched:")
	printConf(after)

	step("The repair controller finds demo/early and fixes it in place.")
	ev, err := d.waitEvent("early", "RepairedPod")
	if err != nil {
		return err
	}
	say("   Event on the pod: %s: %s", ev.Reason, ev.Message)
	if code, out, err = d.runValidation(early); err != nil {
		return err
	}
	if code != 0 {
		return fmt.Errorf("validation after repair exited %d:\n%s", code, out)
	}
	say("   The validation command now passes in that pod.")

	step("Pod demo/web is created after the agent: the runtime runs the chain [ptp, istio-cni].")
	web, webIP, err := d.sandbox("web")
	if err != nil {
		return err
	}
	say("   Sandbox ready; the pod's address is %s.", webIP)
	// The agent counts the ADD when the relay reports its commit, a
	// moment after the ADD returned.
	var served []string
	for deadline := time.Now().Add(10 * time.Second); len(served) == 0 && time.Now().Before(deadline); {
		if served, err = d.host.Metrics(`istio_cni_plugin_commands_total{command="ADD",result="ok"}`); err != nil {
			return err
		}
		if len(served) == 0 {
			time.Sleep(20 * time.Millisecond) // polling the agent's metrics, bounded
		}
	}
	if len(served) == 0 {
		return fmt.Errorf("the agent ran no ADD: the runtime's istio-cni did not hand it over")
	}
	say("   The runtime's istio-cni (a small relay) handed the ADD to the agent, which looked the pod")
	say("   up in its cache and prepared the rules; the relay committed them: %s", served[0])

	step("Connections from and to the app go through a stand-in proxy, which prints what it sees.")
	if err := d.proxied(web, "0.0.0.0:15001", "the app", web, netip.AddrPortFrom(netip.MustParseAddr(testenv.RemoteV4), 80)); err != nil {
		return err
	}
	if err := d.proxied(web, "0.0.0.0:15006", "a client on the node", nil, netip.AddrPortFrom(webIP, 8080)); err != nil {
		return err
	}
	if code, out, err = d.runValidation(web); err != nil {
		return err
	}
	if code != 0 {
		return fmt.Errorf("validation of demo/web exited %d:\n%s", code, out)
	}
	say("   The validation command passes in demo/web too.")

	step("The agent's metrics:")
	lines, err := d.host.Metrics("istio_cni_")
	if err != nil {
		return err
	}
	for _, l := range lines {
		if !strings.Contains(l, "_bucket") && !strings.Contains(l, "_sum") && !strings.Contains(l, "_count") {
			say("   %s", l)
		}
	}

	step("Uninstall: the agent gets SIGTERM and no DaemonSet exists, so it removes itself.")
	for _, p := range []*testenv.Pod{early, web} {
		_ = d.cni.DelNetworkList(d.ctx, mustList(primary), p.RT)
	}
	code, err = d.host.Stop(10 * time.Second)
	if err != nil || code != 0 {
		return fmt.Errorf("agent exit %d: %w", code, err)
	}
	final, err := os.ReadFile(primary)
	if err != nil {
		return err
	}
	if !sameJSON(final, orig) {
		return fmt.Errorf("uninstall did not restore the primary config:\n%s", final)
	}
	for _, p := range []string{filepath.Join(d.host.BinDir, "istio-cni"), filepath.Join(d.host.RunDir, "istio-cni-kubeconfig")} {
		if _, err := os.Stat(p); !os.IsNotExist(err) {
			return fmt.Errorf("%s left after uninstall", p)
		}
	}
	say("   The primary config is back as it was; the plugin binary and its kubeconfig are gone.")
	return nil
}

func mustList(path string) *libcni.NetworkConfigList {
	l, _ := libcni.ConfListFromFile(path)
	return l
}

// printConf shows a conflist one plugin per line.
func printConf(b []byte) {
	var l struct {
		Name    string            `json:"name"`
		Plugins []json.RawMessage `json:"plugins"`
	}
	_ = json.Unmarshal(b, &l)
	say("   network %q, plugins in order:", l.Name)
	for i, p := range l.Plugins {
		var compact bytes.Buffer
		_ = json.Compact(&compact, p)
		say("     %d: %s", i+1, compact.String())
	}
}

func sameJSON(a, b []byte) bool {
	var x, y any
	_ = json.Unmarshal(a, &x)
	_ = json.Unmarshal(b, &y)
	xa, _ := json.Marshal(x)
	ya, _ := json.Marshal(y)
	return bytes.Equal(xa, ya)
}

func firstLine(s, containing string) string {
	for _, l := range strings.Split(s, "\n") {
		if strings.Contains(l, containing) {
			return strings.TrimSpace(l)
		}
	}
	return strings.TrimSpace(s)
}

// sandbox creates the pod object and runs the node's current CNI config
// for a new sandbox, with a process living in it, as a runtime does.
func (d *demo) sandbox(name string) (*testenv.Pod, netip.Addr, error) {
	k8sPod, err := testenv.CreatePod(d.ctx, d.cluster.Client, testenv.PodSpec{Namespace: ns, Name: name, Sidecar: true,
		InitNames: []string{"istio-validation"}})
	if err != nil {
		return nil, netip.Addr{}, err
	}
	pod, err := testenv.NewPod(ns, name, string(k8sPod.UID), "demo-"+name)
	if err != nil {
		return nil, netip.Addr{}, err
	}
	d.cleanups = append(d.cleanups, pod.Close)
	primary, _, err := install.FindPrimary(d.host.NetDir, "")
	if err != nil {
		return nil, netip.Addr{}, err
	}
	res, err := d.cni.AddNetworkList(d.ctx, mustList(primary), pod.RT)
	if err != nil {
		return nil, netip.Addr{}, err
	}
	r, err := current.NewResultFromResult(res)
	if err != nil || len(r.IPs) == 0 {
		return nil, netip.Addr{}, fmt.Errorf("no IP for %s: %w", name, err)
	}
	ip, _ := netip.AddrFromSlice(r.IPs[0].Address.IP.To4())
	stop, err := pod.StartSandboxProcess()
	if err != nil {
		return nil, netip.Addr{}, err
	}
	d.cleanups = append(d.cleanups, stop)
	return pod, ip, nil
}

// runValidation runs the validation command in pod as the proxy's uid and
// returns its exit code and output; err is for a command that did not run.
func (d *demo) runValidation(pod *testenv.Pod) (code int, out string, err error) {
	var buf bytes.Buffer
	err = pod.InPod(func() error {
		cmd := exec.Command(d.validate, "-p", "15001", "-z", "15006", "-u", "1337", "-m", "REDIRECT",
			"--run-validation", "--skip-rule-apply", "--probe-timeout", "2s")
		cmd.Stdout, cmd.Stderr = &buf, &buf
		cmd.SysProcAttr = &syscall.SysProcAttr{Credential: &syscall.Credential{Uid: 1337, Gid: 1337}}
		err := cmd.Run()
		var ee *exec.ExitError
		if errors.As(err, &ee) {
			code = ee.ExitCode()
			return nil
		}
		return err
	})
	if err != nil {
		return -1, buf.String(), fmt.Errorf("running the validation command in pod %s/%s as uid 1337: %w", pod.Namespace, pod.Name, err)
	}
	return code, buf.String(), nil
}

func (d *demo) reportValidationFailed(name string, ip netip.Addr) error {
	p, err := d.cluster.Client.CoreV1().Pods(ns).Get(d.ctx, name, metav1.GetOptions{})
	if err != nil {
		return err
	}
	p.Status.PodIP, p.Status.PodIPs = ip.String(), []corev1.PodIP{{IP: ip.String()}}
	p.Status.InitContainerStatuses = []corev1.ContainerStatus{{Name: "istio-validation", Image: "proxyv2",
		State: corev1.ContainerState{Terminated: &corev1.ContainerStateTerminated{ExitCode: 126, Reason: "Error"}}}}
	_, err = d.cluster.Client.CoreV1().Pods(ns).UpdateStatus(d.ctx, p, metav1.UpdateOptions{})
	return err
}

func (d *demo) waitEvent(pod, reason string) (*corev1.Event, error) {
	deadline := time.Now().Add(20 * time.Second)
	for time.Now().Before(deadline) {
		evs, err := d.cluster.Client.CoreV1().Events(ns).List(d.ctx, metav1.ListOptions{})
		if err != nil {
			return nil, err
		}
		for i := range evs.Items {
			if ev := &evs.Items[i]; ev.InvolvedObject.Name == pod && ev.Reason == reason {
				return &evs.Items[i], nil
			}
		}
		time.Sleep(50 * time.Millisecond) // polling the API server, bounded
	}
	return nil, fmt.Errorf("no %s event for %s within 20s", reason, pod)
}

// proxied runs a stand-in proxy on listen in the pod, connects to dst from
// the pod from (nil: the node) and asserts that the connection arrives at
// the proxy with dst as its original destination.
func (d *demo) proxied(pod *testenv.Pod, listen, who string, from *testenv.Pod, dst netip.AddrPort) error {
	what := who + " connects to " + dst.String()
	l, err := testenv.Listen(pod, "tcp4", listen, false)
	if err != nil {
		return err
	}
	defer l.Close()
	got := make(chan net.Conn, 1)
	go func() {
		if c, err := testenv.Accept(l, 5*time.Second); err == nil {
			got <- c
		}
		close(got)
	}()
	c, err := testenv.Dial(from, "tcp4", dst.String())
	if err != nil {
		return err
	}
	defer c.Close()
	conn, ok := <-got
	if !ok {
		return fmt.Errorf("%s: the connection did not reach the proxy on %s", what, listen)
	}
	defer conn.Close()
	orig, err := testenv.OriginalDst(conn)
	if err != nil {
		return err
	}
	if orig != dst {
		return fmt.Errorf("%s: the proxy on %s got it with original destination %s, not %s", what, listen, orig, dst)
	}
	say("   %s -> the stand-in proxy on port %s got it; original destination %s (SO_ORIGINAL_DST)",
		what, strings.TrimPrefix(listen, "0.0.0.0:"), orig)
	return nil
}
