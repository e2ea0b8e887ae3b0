package e2e

import (
	"bufio"
	"context"
	"fmt"
	"log/slog"
	"net"
	"net/netip"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/containernetworking/cni/pkg/types"
	current "github.com/containernetworking/cni/pkg/types/100"

	"github.com/prometheus/client_golang/prometheus"
	dto "github.com/prometheus/client_model/go"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	k8stypes "k8s.io/apimachinery/pkg/types"

	"github.com/istio-cni-go/istio-cni/internal/cnirelay"
	"github.com/istio-cni-go/istio-cni/internal/cniserver"
	"github.com/istio-cni-go/istio-cni/internal/iptables"
	"github.com/istio-cni-go/istio-cni/internal/kubeclient"
	"github.com/istio-cni-go/istio-cni/internal/nftables"
	"github.com/istio-cni-go/istio-cni/internal/nlsteps"
	"github.com/istio-cni-go/istio-cni/internal/podcache"
	"github.com/istio-cni-go/istio-cni/internal/prepared"
	"github.com/istio-cni-go/istio-cni/internal/redirect"
	"github.com/istio-cni-go/istio-cni/internal/ruleset"
	"github.com/istio-cni-go/istio-cni/internal/testenv"
)

var podSeq atomic.Int64

// env is one node with the plugin's kubeconfig in place.
type env struct {
	t    *testing.T
	node *testenv.Node
	// agentSends counts the transactions an agent that commits the rules
	// itself sent from its own process.
	agentSends atomic.Int64
	// prepare makes serveCNI's agent prepare pods' ADDs ahead; add then
	// waits for each pod's record, as a kubelet's sandbox comes after
	// the binding, and asserts the relay served the ADD from it.
	prepare bool
	// lookups and preparedAdds are the agent's metrics of the pods it
	// looked up and the ADDs relays served from records; commands and
	// latency those of the commands it counted and those it served.
	lookups, preparedAdds, commands *prometheus.CounterVec
	latency                         *prometheus.HistogramVec
	// server is serveCNI's agent.
	server *cniserver.Server
}

func newEnv(t *testing.T, pluginConf map[string]any) *env {
	t.Helper()
	dir := t.TempDir()
	node, err := testenv.NewNode(dir, pluginBin, pluginConf)
	if err != nil {
		t.Fatal(err)
	}
	if err := cluster.PluginKubeconfig(context.Background(), filepath.Join(node.RunDir, "istio-cni-kubeconfig")); err != nil {
		t.Fatal(err)
	}
	return &env{t: t, node: node}
}

// sandbox creates the pod object (when spec is not nil) and its network
// namespace, and runs the chained ADD.
type sandbox struct {
	pod    *testenv.Pod
	result *current.Result
	v4, v6 netip.Addr
}

func (e *env) newPod(spec *testenv.PodSpec) *testenv.Pod {
	e.t.Helper()
	return e.newPodIn(testenv.NewPod, spec)
}

// newPodIn is newPod with the sandbox made by mk.
func (e *env) newPodIn(mk func(namespace, name, uid, containerID string) (*testenv.Pod, error), spec *testenv.PodSpec) *testenv.Pod {
	e.t.Helper()
	n := podSeq.Add(1)
	name := fmt.Sprintf("pod-%d", n)
	uid := ""
	if spec != nil {
		spec.Namespace, spec.Name = testNS, name
		p, err := createPod(e.t, *spec)
		if err != nil {
			e.t.Fatal(err)
		}
		uid = string(p.UID)
	}
	pod, err := mk(testNS, name, uid, fmt.Sprintf("c%060d", n))
	if err != nil {
		e.t.Fatal(err)
	}
	e.t.Cleanup(pod.Close)
	return pod
}

func (e *env) add(spec *testenv.PodSpec) *sandbox {
	e.t.Helper()
	return e.addWith(testenv.NewPod, spec, e.prepare && spec != nil)
}

// addIn is add with the sandbox made by mk, served however the relay
// finds best.
func (e *env) addIn(mk func(namespace, name, uid, containerID string) (*testenv.Pod, error), spec *testenv.PodSpec) *sandbox {
	e.t.Helper()
	return e.addWith(mk, spec, false)
}

// addWith is addIn; with fromRecord, it waits for the pod's prepared
// record first and fails unless the relay served the ADD from it: the
// agent looked nothing up for it, and heard how it went.
func (e *env) addWith(mk func(namespace, name, uid, containerID string) (*testenv.Pod, error), spec *testenv.PodSpec, fromRecord bool) *sandbox {
	e.t.Helper()
	pod := e.newPodIn(mk, spec)
	var lookups, served float64
	if fromRecord {
		e.waitRecord(pod)
		lookups, served = counted(e.lookups), counted(e.preparedAdds)
	}
	res, err := e.node.Add(context.Background(), e.node.Chained, pod)
	if err != nil {
		e.t.Fatalf("chained ADD: %v", err)
	}
	if fromRecord {
		if n := counted(e.lookups); n != lookups {
			e.t.Fatalf("the agent looked %v pods up during an ADD its record should have served", n-lookups)
		}
		// The relay tells the agent without waiting for it.
		deadline := time.Now().Add(10 * time.Second)
		for counted(e.preparedAdds) == served {
			if time.Now().After(deadline) {
				e.t.Fatal("the agent never heard of the ADD served from the pod's record")
			}
			time.Sleep(time.Millisecond) // polling another goroutine's counter, bounded
		}
	}
	e.t.Cleanup(func() { _ = e.node.Del(context.Background(), e.node.Chained, pod) })
	r, err := current.NewResultFromResult(res)
	if err != nil {
		e.t.Fatal(err)
	}
	sb := &sandbox{pod: pod, result: r}
	for _, ip := range r.IPs {
		a, _ := netip.AddrFromSlice(ip.Address.IP)
		if a.Unmap().Is4() {
			sb.v4 = a.Unmap()
		} else {
			sb.v6 = a
		}
	}
	if !sb.v4.IsValid() || !sb.v6.IsValid() {
		e.t.Fatalf("chained ADD result lost the primary plugin's addresses: %+v", r)
	}
	return sb
}

func resultIPs(t *testing.T, res types.Result) []netip.Addr {
	t.Helper()
	r, err := current.NewResultFromResult(res)
	if err != nil {
		t.Fatal(err)
	}
	var out []netip.Addr
	for _, ip := range r.IPs {
		if a, ok := netip.AddrFromSlice(ip.Address.IP); ok {
			out = append(out, a.Unmap())
		}
	}
	return out
}

// createPod creates a pod object that is gone with the test: the API
// server is the suite's, and every agent a later test starts would
// otherwise hold, prepare and (in repair mode) retry every pod of the
// tests before it.
func createPod(t testing.TB, spec testenv.PodSpec) (*corev1.Pod, error) {
	t.Helper()
	p, err := testenv.CreatePod(context.Background(), cluster.Client, spec)
	if err == nil {
		t.Cleanup(func() {
			_ = cluster.Client.CoreV1().Pods(spec.Namespace).Delete(context.Background(), spec.Name, metav1.DeleteOptions{GracePeriodSeconds: new(int64)})
		})
	}
	return p, err
}

// saveNoise is what differs between two dumps of the same rules: the
// comment lines carry the time of the dump, and the counters move.
var saveNoise = regexp.MustCompile(`(?m)^#.*\n|\[\d+:\d+\]`)

// sameRulesIn is the pod's rules in a form two dumps of the same rules
// agree on.
func sameRulesIn(t *testing.T, pod *testenv.Pod) string {
	t.Helper()
	return saveNoise.ReplaceAllString(rulesIn(t, pod), "")
}

func rulesIn(t *testing.T, pod *testenv.Pod) string {
	t.Helper()
	var out strings.Builder
	err := pod.InPod(func() error {
		for _, bin := range []string{"iptables-legacy-save", "iptables-nft-save", "ip6tables-legacy-save", "ip6tables-nft-save"} {
			b, err := exec.Command(bin).CombinedOutput()
			if err != nil {
				return fmt.Errorf("%s: %w: %s", bin, err, b)
			}
			out.Write(b)
		}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	return out.String()
}

// expectRedirect listens on port inside the pod, runs dial, and asserts
// that the connection arrives there with the original destination want.
func expectRedirect(t *testing.T, pod *testenv.Pod, network, listen string, want netip.AddrPort, dial func() (net.Conn, error)) {
	t.Helper()
	l, err := testenv.Listen(pod, network, listen, false)
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	accepted := make(chan net.Conn, 1)
	go func() {
		c, err := testenv.Accept(l, 5*time.Second)
		if err == nil {
			accepted <- c
		}
		close(accepted)
	}()
	c, err := dial()
	if err != nil {
		t.Fatalf("dial towards %s: %v", want, err)
	}
	defer c.Close()
	got, ok := <-accepted
	if !ok {
		t.Fatalf("connection towards %s did not arrive on %s", want, listen)
	}
	defer got.Close()
	orig, err := testenv.OriginalDst(got)
	if err != nil {
		t.Fatalf("SO_ORIGINAL_DST: %v", err)
	}
	if orig != want {
		t.Fatalf("SO_ORIGINAL_DST = %s, want %s", orig, want)
	}
}

// expectDirect asserts that a connection reaches a listener in the node
// (not the proxy): it was not redirected.
func expectDirect(t *testing.T, listenAddr string, dial func() error) {
	t.Helper()
	l, err := testenv.Listen(nil, "tcp", listenAddr, false)
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	done := make(chan error, 1)
	go func() {
		// The deadline also covers dial's start: DialAs starts a helper
		// process (this test binary, built with -race) first.
		c, err := testenv.Accept(l, 30*time.Second)
		if err != nil {
			done <- err
			return
		}
		defer c.Close()
		_, _ = bufio.NewReader(c).ReadString('\n')
		_, err = c.Write([]byte("pong\n"))
		done <- err
	}()
	if err := dial(); err != nil {
		t.Fatalf("direct connection to %s failed: %v", listenAddr, err)
	}
	if err := <-done; err != nil {
		t.Fatalf("direct connection to %s did not arrive: %v", listenAddr, err)
	}
}

func dialPing(pod *testenv.Pod, network, addr string) func() error {
	return func() error {
		c, err := testenv.Dial(pod, network, addr)
		if err != nil {
			return err
		}
		defer c.Close()
		return testenv.Ping(c)
	}
}

func ap(s string) netip.AddrPort { return netip.MustParseAddrPort(s) }

// udpQuery sends "query" from pod to dst and reads one datagram on listen
// in listenIn (nil: the node): what arrived, from where, and the address
// it was sent from.
func udpQuery(t *testing.T, pod, listenIn *testenv.Pod, listen, dst string) (got, from, sent string, err error) {
	t.Helper()
	u, err := testenv.ListenUDP(listenIn, "udp4", listen)
	if err != nil {
		t.Fatal(err)
	}
	defer u.Close()
	c, err := testenv.Dial(pod, "udp4", dst)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	if _, err := c.Write([]byte("query")); err != nil {
		t.Fatal(err)
	}
	buf := make([]byte, 64)
	_ = u.SetReadDeadline(time.Now().Add(5 * time.Second))
	n, addr, err := u.ReadFromUDP(buf)
	if addr != nil {
		from = addr.String()
	}
	return string(buf[:n]), from, c.LocalAddr().String(), err
}

// TestTraffic runs every traffic case on both iptables variants and on
// the native nftables backend, with the same assertions. "agent-commits"
// is the agent told to send the rules it prepared itself
// (CNI_RULES_COMMITTER=agent); legacy iptables, which it cannot prepare
// for, it applies in place as on the "agent" path. "prepared" is the
// agent keeping each pod's ADD prepared ahead: every ADD is served by the
// relay from the pod's record (asserted in add), but the user-namespaced
// pod's, whose namespace the prepared rules cannot go into.
func TestTraffic(t *testing.T) {
	for _, path := range []string{"agent", "agent-commits", "prepared", "fallback"} {
		for _, variant := range []string{"nft", "legacy", "nftables"} {
			if (path == "agent-commits" || path == "prepared") && variant == "legacy" {
				continue
			}
			t.Run(path+"/"+variant, func(t *testing.T) { trafficCases(t, path, variant) })
		}
	}
}

// trafficCases runs every redirect case through the chain, with the
// relay served by the node agent's CNI server ("agent") or, with no
// agent, by the fallback plugin it starts ("fallback").
func trafficCases(t *testing.T, path, variant string) {
	e := backendEnv(t, path, variant)
	remote := testenv.RemoteV4

	t.Run("outbound-to-15001", func(t *testing.T) {
		sb := e.add(&testenv.PodSpec{Sidecar: true})
		expectRedirect(t, sb.pod, "tcp4", "0.0.0.0:15001", ap(remote+":80"), func() (net.Conn, error) {
			return testenv.Dial(sb.pod, "tcp4", remote+":80")
		})
		if err := e.node.Check(context.Background(), e.node.Chained, sb.pod); err != nil {
			t.Fatalf("CHECK on a redirected pod: %v", err)
		}
		// The rules traffic just went through are the ones the agent
		// sent, on the path where it commits them.
		if n := e.agentSends.Load(); (path == "agent-commits") != (n > 0) {
			t.Fatalf("the agent sent %d transactions itself on the %s path", n, path)
		}
	})

	t.Run("proxy-uid-bypasses", func(t *testing.T) {
		sb := e.add(&testenv.PodSpec{Sidecar: true})
		expectDirect(t, remote+":81", func() error {
			_, err := testenv.DialAs(sb.pod.NetNS.Path(), 1337, 1337, "tcp4", remote+":81")
			return err
		})
		// And an ordinary uid is redirected on the same port.
		expectRedirect(t, sb.pod, "tcp4", "0.0.0.0:15001", ap(remote+":81"), func() (net.Conn, error) {
			return testenv.Dial(sb.pod, "tcp4", remote+":81")
		})
	})

	t.Run("custom-proxy-uid", func(t *testing.T) {
		uid, gid := int64(1000670000), int64(1000670001)
		sb := e.add(&testenv.PodSpec{Sidecar: true, ProxyUID: &uid, ProxyGID: &gid})
		expectDirect(t, remote+":82", func() error {
			_, err := testenv.DialAs(sb.pod.NetNS.Path(), int(uid), int(gid), "tcp4", remote+":82")
			return err
		})
	})

	t.Run("user-namespaced-pod", func(t *testing.T) {
		// hostUsers: false. The proxy runs as 1337 inside the pod's
		// user namespace, another uid on the host; the owner match
		// must mean the pod's 1337.
		sb := e.addIn(testenv.NewUserNSPod, &testenv.PodSpec{Sidecar: true})
		proxy := testenv.UserNSBase + 1337
		expectDirect(t, remote+":83", func() error {
			_, err := testenv.DialAs(sb.pod.NetNS.Path(), proxy, proxy, "tcp4", remote+":83")
			return err
		})
		expectRedirect(t, sb.pod, "tcp4", "0.0.0.0:15001", ap(remote+":83"), func() (net.Conn, error) {
			return testenv.Dial(sb.pod, "tcp4", remote+":83")
		})
		if err := e.node.Check(context.Background(), e.node.Chained, sb.pod); err != nil {
			t.Fatalf("CHECK on a user-namespaced pod: %v", err)
		}
	})

	t.Run("inbound-to-15006", func(t *testing.T) {
		sb := e.add(&testenv.PodSpec{Sidecar: true})
		target := netip.AddrPortFrom(sb.v4, 8080)
		expectRedirect(t, sb.pod, "tcp4", "0.0.0.0:15006", target, func() (net.Conn, error) {
			return testenv.Dial(nil, "tcp4", target.String())
		})
	})

	t.Run("excluded-inbound-port", func(t *testing.T) {
		sb := e.add(&testenv.PodSpec{Sidecar: true, Annotations: map[string]string{
			"traffic.sidecar.istio.io/excludeInboundPorts": "9000"}})
		l, err := testenv.Listen(sb.pod, "tcp4", "0.0.0.0:9000", false)
		if err != nil {
			t.Fatal(err)
		}
		defer l.Close()
		c, err := testenv.Dial(nil, "tcp4", netip.AddrPortFrom(sb.v4, 9000).String())
		if err != nil {
			t.Fatal(err)
		}
		defer c.Close()
		got, err := testenv.Accept(l, 5*time.Second)
		if err != nil {
			t.Fatalf("excluded inbound port did not reach the app: %v", err)
		}
		got.Close()
	})

	t.Run("excluded-outbound-port", func(t *testing.T) {
		sb := e.add(&testenv.PodSpec{Sidecar: true, Annotations: map[string]string{
			"traffic.sidecar.istio.io/excludeOutboundPorts": "9090"}})
		expectDirect(t, remote+":9090", dialPing(sb.pod, "tcp4", remote+":9090"))
	})

	t.Run("excluded-outbound-cidr", func(t *testing.T) {
		sb := e.add(&testenv.PodSpec{Sidecar: true, Annotations: map[string]string{
			"traffic.sidecar.istio.io/excludeOutboundIPRanges": "198.18.0.0/24"}})
		expectDirect(t, remote+":80", dialPing(sb.pod, "tcp4", remote+":80"))
	})

	t.Run("included-outbound-cidr-only", func(t *testing.T) {
		sb := e.add(&testenv.PodSpec{Sidecar: true, Annotations: map[string]string{
			"traffic.sidecar.istio.io/includeOutboundIPRanges": "10.96.0.0/12"}})
		expectDirect(t, remote+":83", dialPing(sb.pod, "tcp4", remote+":83"))
	})

	t.Run("tproxy-keeps-addresses", func(t *testing.T) {
		sb := e.add(&testenv.PodSpec{Sidecar: true, Annotations: map[string]string{
			"sidecar.istio.io/interceptionMode": "TPROXY"}})
		l, err := testenv.Listen(sb.pod, "tcp4", "0.0.0.0:15006", true)
		if err != nil {
			t.Fatal(err)
		}
		defer l.Close()
		target := netip.AddrPortFrom(sb.v4, 8080)
		c, err := testenv.Dial(nil, "tcp4", target.String())
		if err != nil {
			t.Fatalf("dial %s: %v", target, err)
		}
		defer c.Close()
		got, err := testenv.Accept(l, 5*time.Second)
		if err != nil {
			t.Fatalf("TPROXY connection did not reach 15006: %v", err)
		}
		defer got.Close()
		if got.LocalAddr().String() != target.String() {
			t.Fatalf("TPROXY local address %s, want the original %s", got.LocalAddr(), target)
		}
		if got.RemoteAddr().String() != c.LocalAddr().String() {
			t.Fatalf("TPROXY peer %s, want the client %s", got.RemoteAddr(), c.LocalAddr())
		}
	})

	t.Run("dns-capture", func(t *testing.T) {
		sb := e.add(&testenv.PodSpec{Sidecar: true, ProxyEnv: map[string]string{"ISTIO_META_DNS_CAPTURE": "true"}})
		if got, _, _, err := udpQuery(t, sb.pod, sb.pod, "0.0.0.0:15053", remote+":53"); err != nil || got != "query" {
			t.Fatalf("UDP DNS did not reach 15053: %v %q", err, got)
		}
		expectRedirect(t, sb.pod, "tcp4", "0.0.0.0:15053", ap(remote+":53"), func() (net.Conn, error) {
			return testenv.Dial(sb.pod, "tcp4", remote+":53")
		})
	})

	// A list long enough for a set keeps its UDP rule under DNS capture:
	// DNS to an excluded port 53 leaves the pod as sent.
	t.Run("dns-capture-long-exclusion", func(t *testing.T) {
		ports := []string{"53"}
		for p := 20001; len(ports) <= ruleset.SetThreshold; p++ {
			ports = append(ports, strconv.Itoa(p))
		}
		sb := e.add(&testenv.PodSpec{Sidecar: true, ProxyEnv: map[string]string{"ISTIO_META_DNS_CAPTURE": "true"},
			Annotations: map[string]string{redirect.AnnotationExcludeOutboundPorts: strings.Join(ports, ",")}})
		got, from, sent, err := udpQuery(t, sb.pod, nil, remote+":53", remote+":53")
		if err != nil || got != "query" || from != sent {
			t.Fatalf("UDP DNS to an excluded port 53 did not arrive as sent: %v %q from %v, sent from %v", err, got, from, sent)
		}
	})

	t.Run("ipv6-dual-stack", func(t *testing.T) {
		sb := e.add(&testenv.PodSpec{Sidecar: true, ProxyEnv: map[string]string{"ISTIO_DUAL_STACK": "true"}})
		want := netip.AddrPortFrom(netip.MustParseAddr(testenv.RemoteV6), 80)
		expectRedirect(t, sb.pod, "tcp6", "[::]:15001", want, func() (net.Conn, error) {
			return testenv.Dial(sb.pod, "tcp6", want.String())
		})
		inbound := netip.AddrPortFrom(sb.v6, 8080)
		expectRedirect(t, sb.pod, "tcp6", "[::]:15006", inbound, func() (net.Conn, error) {
			return testenv.Dial(nil, "tcp6", inbound.String())
		})
		expectDirect(t, "["+testenv.RemoteV6+"]:84", func() error {
			_, err := testenv.DialAs(sb.pod.NetNS.Path(), 1337, 1337, "tcp6", "["+testenv.RemoteV6+"]:84")
			return err
		})
	})

	t.Run("ipv6-not-captured-without-dual-stack", func(t *testing.T) {
		sb := e.add(&testenv.PodSpec{Sidecar: true})
		expectDirect(t, "["+testenv.RemoteV6+"]:85", dialPing(sb.pod, "tcp6", "["+testenv.RemoteV6+"]:85"))
	})

	t.Run("native-sidecar", func(t *testing.T) {
		sb := e.add(&testenv.PodSpec{NativeSidecar: true})
		expectRedirect(t, sb.pod, "tcp4", "0.0.0.0:15001", ap(remote+":80"), func() (net.Conn, error) {
			return testenv.Dial(sb.pod, "tcp4", remote+":80")
		})
	})
}

// serveCNI runs the node agent's CNI server for this node in the test
// process, as the agent does: the relay then hands it every command.
func (e *env) serveCNI(variant string) { e.serveCNIWith(variant, cniserver.CommitterPlugin) }

// waitRecord waits until the agent has a prepared record for the pod.
func (e *env) waitRecord(pod *testenv.Pod) {
	e.t.Helper()
	dir := filepath.Join(e.node.RunDir, prepared.DirName)
	deadline := time.Now().Add(10 * time.Second)
	for {
		if _, err := prepared.Read(dir, pod.UID); err == nil {
			return
		} else if time.Now().After(deadline) {
			e.t.Fatalf("the agent kept no record for pod %s/%s: %v", pod.Namespace, pod.Name, err)
		}
		time.Sleep(time.Millisecond) // polling the agent's directory, bounded
	}
}

// learnConfig has the agent learn the chain's plugin config, from the
// ADDs of two pods it serves itself; the pods after them get records.
func (e *env) learnConfig() {
	e.t.Helper()
	for i := 0; i < 2; i++ {
		e.addIn(testenv.NewPod, &testenv.PodSpec{Sidecar: true})
	}
}

// counted is the sum of a counter vector's series.
func counted(v *prometheus.CounterVec) float64 {
	ch := make(chan prometheus.Metric, 16)
	go func() { v.Collect(ch); close(ch) }()
	var sum float64
	for m := range ch {
		var d dto.Metric
		if err := m.Write(&d); err == nil {
			sum += d.GetCounter().GetValue()
		}
	}
	return sum
}

// serveCNIWith is serveCNI with the agent's CNI_RULES_COMMITTER.
func (e *env) serveCNIWith(variant, committer string) {
	e.t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	force := variant
	if variant == "nftables" {
		force = ""
	}
	// The agent's own client, against the real API server.
	api, err := kubeclient.New(cluster.Config)
	if err != nil {
		e.t.Fatal(err)
	}
	s := &cniserver.Server{
		Log:   slog.New(slog.NewJSONHandler(os.Stderr, nil)).With("scope", "cni-plugin"),
		Rules: &iptables.Applier{Force: force}, NFTables: &nftables.Applier{}, ForceIPTables: force,
		Pods: podcache.Start(ctx, api, testenv.NodeName), Clientset: api,
		ReadyReason: func() string { return "" }, Committer: committer,
		Send: func(netns *os.File, txn *nlsteps.Txn) (time.Duration, error) {
			e.agentSends.Add(1)
			return nlsteps.RunIn(netns, txn)
		},
		PreparedDir: filepath.Join(e.node.RunDir, prepared.DirName), Prepare: e.prepare,
	}
	e.commands, e.latency, e.lookups = cniserver.NewMetrics()
	e.preparedAdds = cniserver.NewPreparedMetric()
	s.Commands, s.Latency, s.Lookups, s.PreparedAdds = e.commands, e.latency, e.lookups, e.preparedAdds
	done, err := s.Serve(ctx, filepath.Join(e.node.RunDir, cnirelay.SocketName), 5*time.Second)
	if err != nil {
		cancel()
		e.t.Fatal(err)
	}
	e.server = s
	e.t.Cleanup(func() {
		cancel()
		<-done
	})
}

// TestSelection covers pods that must get no rules, CHECK and DEL, both
// through the agent and through the fallback.
func TestSelection(t *testing.T) {
	for _, path := range []string{"agent", "fallback"} {
		t.Run(path, func(t *testing.T) { selectionCases(t, path) })
	}
}

func selectionCases(t *testing.T, path string) {
	e := newEnv(t, nil)
	if path == "agent" {
		e.serveCNI("")
	}
	cases := []struct {
		name string
		spec testenv.PodSpec
	}{
		{"not-injected", testenv.PodSpec{}},
		{"inject-false-label", testenv.PodSpec{Sidecar: true, Labels: map[string]string{"sidecar.istio.io/inject": "false"}}},
		{"inject-false-annotation", testenv.PodSpec{Sidecar: true, Annotations: map[string]string{"sidecar.istio.io/inject": "false"}}},
		{"istio-init-present", testenv.PodSpec{Sidecar: true, InitNames: []string{"istio-init"}}},
		{"gateway", testenv.PodSpec{Sidecar: true, ProxyArgs: []string{"proxy", "router"}}},
		{"disable-envoy", testenv.PodSpec{Sidecar: true, ProxyEnv: map[string]string{"DISABLE_ENVOY": "true"}}},
		{"interception-none", testenv.PodSpec{Sidecar: true, Annotations: map[string]string{"sidecar.istio.io/interceptionMode": "NONE"}}},
	}
	for i := range cases {
		c := &cases[i]
		t.Run(c.name, func(t *testing.T) {
			spec := c.spec
			sb := e.add(&spec)
			if rules := rulesIn(t, sb.pod); strings.Contains(rules, "ISTIO_") {
				t.Fatalf("pod got rules:\n%s", rules)
			}
			if err := e.node.Check(context.Background(), e.node.Chained, sb.pod); err != nil {
				t.Fatalf("CHECK of an unredirected pod: %v", err)
			}
		})
	}

	t.Run("no-api-call-for-excluded-namespace", func(t *testing.T) {
		pod, err := testenv.NewPod("kube-system", "coredns-1", "", "cexcluded")
		if err != nil {
			t.Fatal(err)
		}
		defer pod.Close()
		if _, err := e.node.Add(context.Background(), e.node.Chained, pod); err != nil {
			t.Fatalf("ADD in an excluded namespace (pod not even in the API): %v", err)
		}
		_ = e.node.Del(context.Background(), e.node.Chained, pod)
	})

	t.Run("agent-pod-without-kubeconfig", func(t *testing.T) {
		bare := newEnv(t, nil)
		if err := os.Remove(filepath.Join(bare.node.RunDir, "istio-cni-kubeconfig")); err != nil {
			t.Fatal(err)
		}
		pod, err := testenv.NewPod("istio-system", "istio-cni-node-abcde", "", "cagent")
		if err != nil {
			t.Fatal(err)
		}
		defer pod.Close()
		if _, err := bare.node.Add(context.Background(), bare.node.Chained, pod); err != nil {
			t.Fatalf("the agent's own pod must start without a kubeconfig: %v", err)
		}
	})

	t.Run("check-detects-tampering", func(t *testing.T) {
		sb := e.add(&testenv.PodSpec{Sidecar: true})
		if err := sb.pod.InPod(func() error {
			return exec.Command("iptables-nft", "-t", "nat", "-D", "ISTIO_OUTPUT", "-j", "ISTIO_REDIRECT").Run()
		}); err != nil {
			t.Fatal(err)
		}
		err := e.node.Check(context.Background(), e.node.Chained, sb.pod)
		if err == nil || !strings.Contains(err.Error(), "ISTIO_OUTPUT") {
			t.Fatalf("CHECK after a rule was deleted: %v, want an error naming ISTIO_OUTPUT", err)
		}
	})

	t.Run("del-is-idempotent", func(t *testing.T) {
		pod := e.newPod(&testenv.PodSpec{Sidecar: true})
		if _, err := e.node.Add(context.Background(), e.node.Chained, pod); err != nil {
			t.Fatal(err)
		}
		for i := 0; i < 2; i++ {
			if err := e.node.Del(context.Background(), e.node.Chained, pod); err != nil {
				t.Fatalf("DEL #%d: %v", i+1, err)
			}
		}
	})

	t.Run("re-add-on-same-namespace-replaces", func(t *testing.T) {
		// A runtime may DEL and ADD again on the same namespace; the second
		// ADD, with other parameters, must leave exactly the new rules.
		pod := e.newPod(&testenv.PodSpec{Sidecar: true, Annotations: map[string]string{
			"sidecar.istio.io/interceptionMode": "TPROXY"}})
		if _, err := e.node.Add(context.Background(), e.node.Chained, pod); err != nil {
			t.Fatal(err)
		}
		if err := e.node.Del(context.Background(), e.node.Chained, pod); err != nil {
			t.Fatal(err)
		}
		patch := []byte(`{"metadata":{"annotations":{"sidecar.istio.io/interceptionMode":"REDIRECT"}}}`)
		if _, err := cluster.Client.CoreV1().Pods(testNS).Patch(context.Background(), pod.Name, k8stypes.MergePatchType, patch, metav1.PatchOptions{}); err != nil {
			t.Fatal(err)
		}
		// The agent reads pods from its informer's cache: a runtime's
		// re-ADD comes long after a change, this one at once.
		if e.server != nil && e.server.Pods != nil {
			for deadline := time.Now().Add(10 * time.Second); ; {
				p, err := e.server.Pods.Pod(testNS, pod.Name, pod.UID)
				if err == nil && p.Annotations["sidecar.istio.io/interceptionMode"] == "REDIRECT" {
					break
				}
				if time.Now().After(deadline) {
					t.Fatalf("the agent's pod cache did not see the patch within 10s: %v", err)
				}
				time.Sleep(10 * time.Millisecond) // polling the informer's cache, bounded
			}
		}
		if _, err := e.node.Add(context.Background(), e.node.Chained, pod); err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { _ = e.node.Del(context.Background(), e.node.Chained, pod) })
		rules := rulesIn(t, pod)
		if strings.Contains(rules, "ISTIO_TPROXY") || strings.Count(rules, "-A OUTPUT -j ISTIO_OUTPUT") != 1 {
			t.Fatalf("re-ADD did not replace the old rules:\n%s", rules)
		}
		if err := e.node.Check(context.Background(), e.node.Chained, pod); err != nil {
			t.Fatal(err)
		}
	})

	t.Run("del-after-namespace-gone", func(t *testing.T) {
		pod := e.newPod(&testenv.PodSpec{Sidecar: true})
		if _, err := e.node.Add(context.Background(), e.node.Chained, pod); err != nil {
			t.Fatal(err)
		}
		pod.Close()
		if err := e.node.Del(context.Background(), e.node.Chained, pod); err != nil {
			t.Fatalf("DEL with the namespace gone: %v", err)
		}
	})

	t.Run("del-of-never-redirected-pod", func(t *testing.T) {
		pod := e.newPod(&testenv.PodSpec{Sidecar: true})
		if _, err := e.node.Add(context.Background(), e.node.Primary, pod); err != nil {
			t.Fatal(err)
		}
		if err := e.node.Del(context.Background(), e.node.Chained, pod); err != nil {
			t.Fatalf("chained DEL of a pod istio-cni never saw: %v", err)
		}
	})
}
