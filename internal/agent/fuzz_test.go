package agent

import (
	"bufio"
	"bytes"
	"context"
	"encoding/binary"
	"encoding/json"
	"fmt"
	"io"
	"net"
	"net/netip"
	"os"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes/fake"

	"github.com/istio-cni-go/istio-cni/internal/cnirelay"
	"github.com/istio-cni-go/istio-cni/internal/logging"
	"github.com/istio-cni-go/istio-cni/internal/podinfo"
	"github.com/istio-cni-go/istio-cni/internal/podnet"
	"github.com/istio-cni-go/istio-cni/internal/ruleset"
)

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
func fuzzPods(t testing.TB, ctx context.Context) *PodCache {
	cs := fake.NewClientset(&corev1.Pod{ObjectMeta: metav1.ObjectMeta{Namespace: "ns", Name: "p", UID: "u"},
		Spec: corev1.PodSpec{NodeName: "n", Containers: []corev1.Container{{Name: "app"}}}})
	pc := StartPodCache(ctx, cs, "n")
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
	s := &CNIServer{Log: quiet, Rules: noRules{}, NFTables: noRules{}, Pods: fuzzPods(f, ctx), Clientset: fake.NewClientset()}
	self, err := os.Open(os.DevNull)
	if err != nil {
		f.Fatal(err)
	}
	f.Cleanup(func() { _ = self.Close() })
	f.Fuzz(func(t *testing.T, data []byte, withFD bool) {
		client, server := socketPair(t)
		srvConn := &sockConn{UnixConn: server, s: &sockServer{conns: map[*sockConn]struct{}{}}}
		done := make(chan struct{})
		go func() {
			defer close(done)
			s.serveConn(srvConn)
		}()
		var oob []byte
		if withFD {
			oob = unixRights(self)
		}
		n := min(len(data), 4)
		_, _, _ = client.WriteMsgUnix(data[:n], oob, nil)
		_, _ = client.Write(data[n:])
		_ = client.CloseWrite()
		_ = client.SetReadDeadline(time.Now().Add(cniSocketLimits.readTimeout + 20*time.Second))
		out, err := io.ReadAll(client)
		if err != nil && !isReset(err) {
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

// FuzzAgentSocket sends arbitrary bytes as an HTTP request to the agent
// socket: the server answers or closes, never panics, and keeps serving a
// good request after each.
func FuzzAgentSocket(f *testing.F) {
	for _, s := range []string{
		"GET /pod?namespace=ns&name=p&uid=u HTTP/1.1\r\nHost: a\r\n\r\n",
		"GET /pod?namespace=..&name=%00 HTTP/1.1\r\nHost: a\r\n\r\n",
		"GET /readyz HTTP/1.1\r\nHost: a\r\n\r\n",
		"POST /pod HTTP/1.1\r\nHost: a\r\nContent-Length: 99999999\r\n\r\n",
		"GET /" + strings.Repeat("a", 70000) + " HTTP/1.1\r\n\r\n",
		"\x00\x01\x02", "",
	} {
		f.Add([]byte(s))
	}
	ctx, cancel := context.WithCancel(context.Background())
	f.Cleanup(cancel)
	dir := f.TempDir()
	srv, err := fuzzPods(f, ctx).Serve(dir, func() string { return "" }, quiet, nil)
	if err != nil {
		f.Fatal(err)
	}
	f.Cleanup(func() { _ = srv.Close() })
	path := filepath.Join(dir, podinfo.AgentSocketName)
	good := podinfo.NewAgentClient(path, 10*time.Second)
	f.Fuzz(func(t *testing.T, data []byte) {
		exchange(t, path, data)
		if _, err := good.GetPod(context.Background(), "ns", "p"); err != nil {
			t.Fatalf("the agent socket stopped serving: %v", err)
		}
	})
}

// FuzzLogSocket posts arbitrary bodies (and raw bytes) to the log socket:
// never a panic, and every line logged is one line of the agent's output
// in the plugin's scope.
func FuzzLogSocket(f *testing.F) {
	for _, s := range []string{
		`["{\"level\":\"info\",\"msg\":\"redirect rules programmed\",\"pod\":\"ns/p\"}"]`,
		`["{\"msg\":\"a\\nb\",\"scope\":\"cni-agent\"}", "plain text\r\nline"]`,
		`[1, {"a":1}]`, `{}`, `[`, "",
	} {
		f.Add([]byte(s), true)
	}
	f.Add([]byte("GET /log HTTP/1.1\r\n\r\n"), false)
	dir := f.TempDir()
	var out lockedBuffer
	root, err := logging.Open(logging.Options{OutputLevel: "default:debug", Targets: []string{"stdout"}}, &out, io.Discard)
	if err != nil {
		f.Fatal(err)
	}
	srv, err := serveLogSocket(dir, root.Logger(logging.ScopePlugin), nil)
	if err != nil {
		f.Fatal(err)
	}
	f.Cleanup(func() { _ = srv.Close() })
	path := filepath.Join(dir, LogSocketName)
	f.Fuzz(func(t *testing.T, data []byte, asBody bool) {
		out.Reset()
		req := data
		if asBody {
			req = append([]byte(fmt.Sprintf("POST /log HTTP/1.1\r\nHost: unix\r\nContent-Length: %d\r\nConnection: close\r\n\r\n", len(data))), data...)
		}
		exchange(t, path, req)
		sc := bufio.NewScanner(bytes.NewReader(out.Bytes()))
		sc.Buffer(make([]byte, 1<<20), 1<<20)
		for sc.Scan() {
			if f := strings.Split(sc.Text(), "\t"); len(f) < 4 || f[2] != logging.ScopePlugin {
				t.Fatalf("a line outside the plugin's scope: %q", sc.Text())
			}
		}
	})
}

// FuzzPluginLogLine: any line a plugin sends is exactly one line of the
// agent's output, in the plugin's scope, in both formats.
func FuzzPluginLogLine(f *testing.F) {
	for _, s := range []string{
		`{"level":"info","msg":"redirect rules programmed","pod":"ns/p","time":"t"}`,
		`{"msg":"a\nb\u2028c","scope":"cni-agent","a b=c":"d\"e","level":"error"}`,
		`{"msg":1,"pod":{"x":[1,2]},"n":1e999}`, `{"msg":"x"} {"msg":"y"}`, "\xff\xfe plain", "", `null`, `[]`,
	} {
		f.Add(s)
	}
	var text, js lockedBuffer
	tr, err := logging.Open(logging.Options{OutputLevel: "default:debug", Targets: []string{"stdout"}}, &text, io.Discard)
	if err != nil {
		f.Fatal(err)
	}
	jr, err := logging.Open(logging.Options{OutputLevel: "default:debug", AsJSON: true, Targets: []string{"stdout"}}, &js, io.Discard)
	if err != nil {
		f.Fatal(err)
	}
	f.Fuzz(func(t *testing.T, line string) {
		text.Reset()
		js.Reset()
		emitPluginLine(tr.Logger(logging.ScopePlugin), line)
		emitPluginLine(jr.Logger(logging.ScopePlugin), line)
		checkOneLine(t, text.Bytes(), false)
		checkOneLine(t, js.Bytes(), true)
	})
}

type lockedBuffer struct {
	syncWriter
	buf bytes.Buffer
}

func (b *lockedBuffer) Write(p []byte) (int, error) {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.buf.Write(p)
}

func (b *lockedBuffer) Reset() {
	b.mu.Lock()
	defer b.mu.Unlock()
	b.buf.Reset()
}

func (b *lockedBuffer) Bytes() []byte {
	b.mu.Lock()
	defer b.mu.Unlock()
	return append([]byte(nil), b.buf.Bytes()...)
}

// exchange writes req on a new connection to the socket at path and
// reads whatever comes back until the server closes or its timeouts pass.
func exchange(t *testing.T, path string, req []byte) {
	t.Helper()
	c, err := net.Dial("unix", path)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	_ = c.SetDeadline(time.Now().Add(30 * time.Second))
	_, _ = c.Write(req)
	_ = c.(*net.UnixConn).CloseWrite()
	resp, err := io.ReadAll(c)
	if err != nil && !isReset(err) {
		t.Fatalf("no answer nor close within the server's timeouts: %v", err)
	}
	if len(resp) > 0 && !bytes.HasPrefix(resp, []byte("HTTP/1.")) {
		t.Fatalf("not an HTTP answer: %q", resp)
	}
}

func isReset(err error) bool {
	return strings.Contains(err.Error(), "connection reset")
}
