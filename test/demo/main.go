// Command demo shows istio-cni at work on one machine: a simulated node
// (a private network namespace with no uplink), a real kube-apiserver, a
// pod started through the CNI chain [ptp, istio-cni] exactly as a runtime
// does, and real connections whose destinations are shown.
package main

import (
	"bufio"
	"context"
	"fmt"
	"net"
	"net/netip"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"time"

	current "github.com/containernetworking/cni/pkg/types/100"

	"github.com/istio-cni-go/istio-cni/internal/testenv"
)

func main() {
	testenv.RunHelperIfRequested()
	testenv.EnterNodeNamespace()
	if err := run(); err != nil {
		fmt.Fprintln(os.Stderr, "demo failed:", err)
		os.Exit(1)
	}
}

func say(format string, args ...any) { fmt.Printf(format+"\n", args...) }

func run() error {
	ctx := context.Background()
	dir, err := os.MkdirTemp("", "istio-cni-demo-")
	if err != nil {
		return err
	}
	defer os.RemoveAll(dir)
	_ = os.Chmod(dir, 0o755)
	say("== istio-cni demo ==")
	say("Node: a private network namespace with no way out; the 'remote' service %s lives on it.", testenv.RemoteV4)
	bin, err := testenv.BuildPlugin(dir)
	if err != nil {
		return err
	}
	say("Starting etcd and kube-apiserver on loopback...")
	cluster, err := testenv.StartCluster(filepath.Join(dir, "cluster"))
	if err != nil {
		return err
	}
	defer cluster.Stop()
	if err := testenv.EnsureNamespace(ctx, cluster.Client, "demo"); err != nil {
		return err
	}
	node, err := testenv.NewNode(filepath.Join(dir, "node"), bin, map[string]any{"plugin_log_level": "warn"})
	if err != nil {
		return err
	}
	if err := cluster.PluginKubeconfig(ctx, filepath.Join(node.RunDir, "istio-cni-kubeconfig")); err != nil {
		return err
	}

	say("\nCreating pod demo/web with an injected istio-proxy sidecar, then running the CNI chain [ptp, istio-cni]...")
	k8sPod, err := testenv.CreatePod(ctx, cluster.Client, testenv.PodSpec{Namespace: "demo", Name: "web", Sidecar: true})
	if err != nil {
		return err
	}
	pod, err := testenv.NewPod("demo", "web", string(k8sPod.UID), "demo0000000000000000000000000000000000000000000000000000000001")
	if err != nil {
		return err
	}
	defer pod.Close()
	start := time.Now()
	res, err := node.Add(ctx, node.Chained, pod)
	if err != nil {
		return err
	}
	took := time.Since(start)
	defer func() { _ = node.Del(ctx, node.Chained, pod) }()
	r, err := current.NewResultFromResult(res)
	if err != nil {
		return err
	}
	var podIP netip.Addr
	for _, ip := range r.IPs {
		if a, ok := netip.AddrFromSlice(ip.Address.IP.To4()); ok && ip.Address.IP.To4() != nil {
			podIP = a
		}
	}
	say("  pod sandbox ready in %s; the pod's address is %s", took.Round(time.Millisecond), podIP)
	say("  istio-cni programmed these chains in the pod's namespace (iptables-save, nat table):")
	if err := pod.InPod(func() error {
		out, err := exec.Command("iptables-save", "-t", "nat").Output()
		for _, l := range strings.Split(string(out), "\n") {
			if strings.HasPrefix(l, "-A") {
				say("    %s", l)
			}
		}
		return err
	}); err != nil {
		return err
	}

	say("\n1. The app connects to %s:80.", testenv.RemoteV4)
	if err := showRedirect(pod, "0.0.0.0:15001", func() (net.Conn, error) {
		return testenv.Dial(pod, "tcp4", testenv.RemoteV4+":80")
	}); err != nil {
		return err
	}

	say("\n2. The sidecar itself (uid 1337) connects to %s:80.", testenv.RemoteV4)
	l, err := testenv.Listen(nil, "tcp4", testenv.RemoteV4+":80", false)
	if err != nil {
		return err
	}
	from := make(chan string, 1)
	go func() {
		defer close(from)
		c, err := testenv.Accept(l, 5*time.Second)
		if err != nil {
			return
		}
		defer c.Close()
		_, _ = bufio.NewReader(c).ReadString('\n')
		_, _ = c.Write([]byte("hello from the remote service\n"))
		from <- c.RemoteAddr().String()
	}()
	if _, err := testenv.DialAs(pod.NetNS.Path(), 1337, 1337, "tcp4", testenv.RemoteV4+":80"); err != nil {
		return err
	}
	src, ok := <-from
	l.Close()
	if !ok {
		return fmt.Errorf("the proxy's connection did not reach the remote service")
	}
	say("   -> it reached the remote service directly, from %s: the proxy's own traffic is never captured.", src)

	target := netip.AddrPortFrom(podIP, 8080)
	say("\n3. A client on the node connects to the pod at %s.", target)
	if err := showRedirect(pod, "0.0.0.0:15006", func() (net.Conn, error) {
		return testenv.Dial(nil, "tcp4", target.String())
	}); err != nil {
		return err
	}

	say("\n4. CHECK: the runtime asks istio-cni whether the pod's rules are intact.")
	if err := node.Check(ctx, node.Chained, pod); err != nil {
		return err
	}
	say("   -> all rules in place.")
	say("\n5. DEL: the pod stops.")
	if err := node.Del(ctx, node.Chained, pod); err != nil {
		return err
	}
	var left string
	_ = pod.InPod(func() error {
		out, _ := exec.Command("iptables-save", "-t", "nat").Output()
		left = string(out)
		return nil
	})
	if strings.Contains(left, "ISTIO_") {
		return fmt.Errorf("rules left after DEL")
	}
	say("   -> its rules are gone.")
	say("\nDone: traffic of a meshed pod went through its sidecar, set up by istio-cni during the pod's network set-up.")
	return nil
}

func showRedirect(pod *testenv.Pod, listen string, dial func() (net.Conn, error)) error {
	l, err := testenv.Listen(pod, "tcp4", listen, false)
	if err != nil {
		return err
	}
	defer l.Close()
	got := make(chan net.Conn, 1)
	go func() {
		c, err := testenv.Accept(l, 5*time.Second)
		if err == nil {
			got <- c
		}
		close(got)
	}()
	c, err := dial()
	if err != nil {
		return err
	}
	defer c.Close()
	conn, ok := <-got
	if !ok {
		return fmt.Errorf("the connection did not reach %s", listen)
	}
	defer conn.Close()
	orig, err := testenv.OriginalDst(conn)
	if err != nil {
		return err
	}
	say("   -> it arrived at the sidecar's port %s instead; the sidecar reads the original destination %s (SO_ORIGINAL_DST).",
		strings.TrimPrefix(listen, "0.0.0.0:"), orig)
	return nil
}
