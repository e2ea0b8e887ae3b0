package cniserver

import (
	"context"
	"encoding/binary"
	"encoding/json"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/netip"
	"os"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/containernetworking/cni/pkg/skel"
	promtest "github.com/prometheus/client_golang/prometheus/testutil"
	"golang.org/x/sys/unix"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes/fake"

	"github.com/istio-cni-go/istio-cni/internal/cnirelay"
	"github.com/istio-cni-go/istio-cni/internal/kubeclient/clientset"
	"github.com/istio-cni-go/istio-cni/internal/logging"
	"github.com/istio-cni-go/istio-cni/internal/podcache"
	"github.com/istio-cni-go/istio-cni/internal/podnet"
	"github.com/istio-cni-go/istio-cni/internal/ruleset"
	"github.com/istio-cni-go/istio-cni/internal/sockserve/sockservetest"
)

var quiet = slog.New(slog.NewTextHandler(io.Discard, nil))

// nopConnState stands for the socket's bookkeeping of a connection that
// was not accepted through a sockserve.Server: there is none to keep, and
// closing it closes the connection.
type nopConnState struct{ conn *net.UnixConn }

func (nopConnState) Claim() bool    { return true }
func (nopConnState) TimedOut()      {}
func (n nopConnState) Close() error { return n.conn.Close() }

// noRules is a backend that refuses every namespace: the fuzzers drive the
// socket framing, not the kernel.
type noRules struct{}

func (noRules) Apply(string, *ruleset.Plan) (podnet.Report, error) {
	return podnet.Report{}, fmt.Errorf("no kernel here")
}
func (noRules) Check(string, *ruleset.Plan) error     { return fmt.Errorf("no kernel here") }
func (noRules) PodAddrs(string) ([]netip.Addr, error) { return nil, fmt.Errorf("no kernel here") }

// withFrame is body as the relay sends it: a 4-byte length first.
func withFrame(body []byte) []byte {
	return append(binary.BigEndian.AppendUint32(nil, uint32(len(body))), body...)
}

// socketPair is a connected pair of real Unix stream sockets.
func socketPair(t *testing.T) (client, server *net.UnixConn) {
	t.Helper()
	fds, err := unix.Socketpair(unix.AF_UNIX, unix.SOCK_STREAM|unix.SOCK_CLOEXEC, 0)
	if err != nil {
		t.Fatal(err)
	}
	conn := func(fd int) *net.UnixConn {
		f := os.NewFile(uintptr(fd), "socketpair")
		defer f.Close()
		c, err := net.FileConn(f)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { c.Close() })
		return c.(*net.UnixConn)
	}
	return conn(fds[0]), conn(fds[1])
}

func unixRights(f *os.File) []byte { return syscall.UnixRights(int(f.Fd())) }

// fuzzPods is a synced pod cache holding one pod, ns/p, without a sidecar.
func fuzzPods(ctx context.Context, t testing.TB) *podcache.Cache {
	cs := fake.NewClientset(&corev1.Pod{ObjectMeta: metav1.ObjectMeta{Namespace: "ns", Name: "p", UID: "u"},
		Spec: corev1.PodSpec{NodeName: "n", Containers: []corev1.Container{{Name: "app"}}}})
	pc := podcache.Start(ctx, clientset.Of(cs), "n")
	if err := pc.WaitSynced(ctx); err != nil {
		t.Fatal(err)
	}
	return pc
}

// FuzzCNISocketFraming sends arbitrary bytes (with or without a
// descriptor) over a real socket to the CNI server's connection handler:
// it answers with one JSON response or closes, always within its
// deadlines, and never panics.
func FuzzCNISocketFraming(f *testing.F) {
	ok := []byte(`{"command":"DEL","containerID":"c","ifName":"eth0","args":"K8S_POD_NAMESPACE=ns;K8S_POD_NAME=p","stdin":` +
		`"eyJjbmlWZXJzaW9uIjoiMS4wLjAiLCJuYW1lIjoibiIsInR5cGUiOiJpc3Rpby1jbmkifQ=="}`)
	f.Add(withFrame(ok), false)
	f.Add(withFrame([]byte(`{"command":"ADD","hasNetnsFD":true}`)), true)
	f.Add(withFrame([]byte(`{"command":"STATUS","stdin":"e30="}`)), false)
	f.Add(withFrame([]byte(`{"command":"ADD"}`)), true)
	f.Add([]byte{0xff, 0xff, 0xff, 0xff}, false)
	f.Add([]byte{0, 0, 0, 10, '{'}, false)
	f.Add([]byte{0, 0}, true)
	f.Add([]byte{}, false)
	ctx, cancel := context.WithCancel(context.Background())
	f.Cleanup(cancel)
	s := &Server{Log: quiet, Rules: noRules{}, NFTables: noRules{}, Pods: fuzzPods(ctx, f), Clientset: clientset.Of(fake.NewClientset())}
	self, err := os.Open(os.DevNull)
	if err != nil {
		f.Fatal(err)
	}
	f.Cleanup(func() { _ = self.Close() })
	f.Fuzz(func(t *testing.T, data []byte, withFD bool) {
		client, server := socketPair(t)
		done := make(chan struct{})
		go func() {
			defer close(done)
			s.serveConn(server, nopConnState{server})
		}()
		var oob []byte
		if withFD {
			oob = unixRights(self)
		}
		n := min(len(data), 4)
		_, _, _ = client.WriteMsgUnix(data[:n], oob, nil)
		_, _ = client.Write(data[n:])
		_ = client.CloseWrite()
		_ = client.SetReadDeadline(time.Now().Add(socketLimits.ReadTimeout + 20*time.Second))
		out, err := io.ReadAll(client)
		if err != nil && !sockservetest.IsReset(err) {
			t.Fatalf("no answer nor close within the deadlines: %v", err)
		}
		<-done
		if len(out) == 0 {
			return
		}
		var resp cnirelay.Response
		if err := json.Unmarshal(out, &resp); err != nil {
			t.Fatalf("answer is not one JSON response: %q", out)
		}
	})
}

// panickyRules panics for one pod's namespace path, as a bug would.
type panickyRules struct{}

func (panickyRules) Apply(string, *ruleset.Plan) (podnet.Report, error) {
	return podnet.Report{}, nil
}
func (panickyRules) Check(string, *ruleset.Plan) error { return nil }
func (panickyRules) PodAddrs(string) ([]netip.Addr, error) {
	panic("a bug in the rule backend")
}

// TestCNICommandPanicFailsOnlyThatCommand: a command that panics fails
// with an error naming it, is logged with its pod and counted; the agent
// goes on serving.
func TestCNICommandPanicFailsOnlyThatCommand(t *testing.T) {
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	cs := fake.NewClientset(&corev1.Pod{ObjectMeta: metav1.ObjectMeta{Namespace: "ns", Name: "bad", UID: "u1",
		Annotations: map[string]string{"sidecar.istio.io/status": "{}"}},
		Spec: corev1.PodSpec{NodeName: "n", Containers: []corev1.Container{{Name: "istio-proxy", Args: []string{"proxy", "sidecar"}}}}})
	pods := podcache.Start(ctx, clientset.Of(cs), "n")
	if err := pods.WaitSynced(ctx); err != nil {
		t.Fatal(err)
	}
	var logs sockservetest.Buffer
	root, err := logging.Open(logging.Options{OutputLevel: "default:info", AsJSON: true, Targets: []string{"stdout"}}, &logs, io.Discard)
	if err != nil {
		t.Fatal(err)
	}
	panics, requests := NewPanicMetric(), NewRequestsMetric()
	commands, latency, _ := NewMetrics()
	s := &Server{Log: root.Logger(logging.ScopePlugin), Rules: panickyRules{}, NFTables: panickyRules{}, Pods: pods, Clientset: clientset.Of(cs),
		Panics: panics, Requests: requests, Commands: commands, Latency: latency}
	sock := filepath.Join(t.TempDir(), cnirelay.SocketName)
	done, err := s.Serve(ctx, sock, time.Second)
	if err != nil {
		t.Fatal(err)
	}
	defer func() { cancel(); <-done }()
	relay := &cnirelay.Relay{Fallback: "/nonexistent/fallback", Stdout: io.Discard, Stderr: io.Discard, Timeout: 10 * time.Second}
	conf := fmt.Sprintf(`{"cniVersion":"1.0.0","name":"n","type":"istio-cni","cni_agent_run_dir":%q,"prevResult":{"cniVersion":"1.0.0","ips":[{"address":"10.1.0.2/24"}]}}`, filepath.Dir(sock))
	add := &skel.CmdArgs{ContainerID: "c1", IfName: "eth0", Args: "K8S_POD_NAMESPACE=ns;K8S_POD_NAME=bad;K8S_POD_UID=u1", StdinData: []byte(conf)}
	err = runRelay(relay, "ADD", add)
	if err == nil || !strings.Contains(err.Error(), "internal error handling ADD") {
		t.Fatalf("ADD that panicked: %v", err)
	}
	if got := promtest.ToFloat64(panics.WithLabelValues("cni")); got != 1 {
		t.Fatalf("panics counted: %v", got)
	}
	if !strings.Contains(logs.String(), `"pod":"ns/bad"`) || !strings.Contains(logs.String(), "a bug in the rule backend") {
		t.Fatalf("the panic is not logged with its pod:\n%s", logs.String())
	}
	// The agent still serves.
	if err := runRelay(relay, "DEL", &skel.CmdArgs{ContainerID: "c1", IfName: "eth0", Args: add.Args, StdinData: []byte(conf)}); err != nil {
		t.Fatalf("DEL after the panic: %v", err)
	}
	// A config the plugin cannot take, as Istio's server's 400.
	bad := strings.Replace(conf, `"name":"n"`, `"name":"n","exclude_namespaces":"kube-system"`, 1)
	if err := runRelay(relay, "ADD", &skel.CmdArgs{ContainerID: "c2", IfName: "eth0", Args: add.Args, StdinData: []byte(bad)}); err == nil {
		t.Fatal("ADD with exclude_namespaces a string passed")
	}
	// Istio's istio_cni_plugin_requests_total{response_code}, beside ours.
	// ADDs only, as Istio's server is asked: the DEL is not counted.
	for code, want := range map[string]float64{"500": 1, "200": 0, "400": 1} {
		if got := promtest.ToFloat64(requests.WithLabelValues(code)); got != want {
			t.Errorf("requests with response_code %s: %v, want %v", code, got, want)
		}
	}
	if got := promtest.ToFloat64(commands.WithLabelValues("DEL", "ok")); got != 1 {
		t.Errorf("DELs counted ok: %v", got)
	}
}

func TestResponseCode(t *testing.T) {
	for result, want := range map[string]string{"ok": "200", "unavailable": "503", "bad-request": "400",
		"1": "400", "2": "400", "3": "500", "4": "400", "5": "500", "6": "400", "7": "400", "11": "500", "999": "500"} {
		if got := responseCode(result); got != want {
			t.Errorf("responseCode(%q) = %s, want %s", result, got, want)
		}
	}
}

// TestCNISocketServesPastItsConnectionLimit: every command's connection
// gives its slot back, so the agent serves more commands in a row than
// the socket holds connections at once (it used to refuse every relay
// after the 128th, and pods went through the fallback from then on).
func TestCNISocketServesPastItsConnectionLimit(t *testing.T) {
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	s := &Server{Log: quiet, Rules: noRules{}, NFTables: noRules{}, Clientset: clientset.Of(fake.NewClientset())}
	sock := filepath.Join(t.TempDir(), cnirelay.SocketName)
	done, err := s.Serve(ctx, sock, time.Second)
	if err != nil {
		t.Fatal(err)
	}
	defer func() { cancel(); <-done }()
	// No fallback to run: a relay refused by the agent fails.
	relay := &cnirelay.Relay{Fallback: "/nonexistent/fallback", Stdout: io.Discard, Stderr: io.Discard, Timeout: 10 * time.Second}
	conf := fmt.Sprintf(`{"cniVersion":"1.0.0","name":"n","type":"istio-cni","cni_agent_run_dir":%q}`, filepath.Dir(sock))
	del := &skel.CmdArgs{ContainerID: "c1", IfName: "eth0", Args: "K8S_POD_NAMESPACE=ns;K8S_POD_NAME=p", StdinData: []byte(conf)}
	for i := 0; i < socketLimits.MaxConns+2; i++ {
		if err := runRelay(relay, "DEL", del); err != nil {
			t.Fatalf("DEL %d: %v", i+1, err)
		}
	}
}
