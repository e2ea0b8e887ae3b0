package ztunnelsim

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"io"
	"maps"
	"net"
	"net/netip"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/containernetworking/plugins/pkg/ns"
	"golang.org/x/sys/unix"

	"github.com/istio-cni-go/istio-cni/internal/testutil"
	"github.com/istio-cni-go/istio-cni/internal/zds"
)

// fakeAgent is the agent's end of one connection, driven by hand so a
// test can send what no correct agent would.
type fakeAgent struct {
	t  *testing.T
	uc *net.UnixConn
}

// connect starts a stand-in against a listener of the test's own and
// returns both ends, the hello already checked.
func connect(t *testing.T, cfg Config) (*Sim, *fakeAgent) {
	t.Helper()
	path := filepath.Join(t.TempDir(), "ztunnel.sock")
	l, err := net.ListenUnix("unixpacket", &net.UnixAddr{Name: path, Net: "unixpacket"})
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	cfg.Path = path
	sim, err := Start(cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(sim.Close)
	_ = l.SetDeadline(time.Now().Add(10 * time.Second))
	uc, err := l.AcceptUnix()
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = uc.Close() })
	a := &fakeAgent{t: t, uc: uc}
	h, err := zds.UnmarshalHello(a.read())
	if err != nil || h.Version != zds.V1 {
		t.Fatalf("hello: %+v, %v; want V1", h, err)
	}
	return sim, a
}

func (a *fakeAgent) read() []byte {
	a.t.Helper()
	buf := make([]byte, 4096)
	_ = a.uc.SetReadDeadline(time.Now().Add(10 * time.Second))
	n, err := a.uc.Read(buf)
	if err != nil {
		a.t.Fatalf("reading from the stand-in: %v", err)
	}
	return buf[:n]
}

func (a *fakeAgent) sendRaw(b []byte, fds ...int) {
	a.t.Helper()
	var oob []byte
	if len(fds) > 0 {
		oob = unix.UnixRights(fds...)
	}
	if _, _, err := a.uc.WriteMsgUnix(b, oob, nil); err != nil {
		a.t.Fatalf("sending: %v", err)
	}
}

func (a *fakeAgent) send(req zds.Request, fds ...int) {
	a.t.Helper()
	b, err := req.Marshal()
	if err != nil {
		a.t.Fatal(err)
	}
	a.sendRaw(b, fds...)
}

// answer returns the refusal text of the answer to the last request,
// "" for an ack.
func (a *fakeAgent) answer() string {
	a.t.Helper()
	r, err := zds.UnmarshalResponse(a.read())
	if err != nil || r.Ack == nil {
		a.t.Fatalf("answer: %+v, %v; want an ack", r, err)
	}
	return r.Ack.Error
}

func (a *fakeAgent) expectClosed() {
	a.t.Helper()
	buf := make([]byte, 64)
	_ = a.uc.SetReadDeadline(time.Now().Add(10 * time.Second))
	n, err := a.uc.Read(buf)
	if n != 0 || (err != nil && !errors.Is(err, io.EOF)) {
		a.t.Fatalf("want the stand-in to close the connection; read %d bytes, %v", n, err)
	}
}

func openSelfNetns(t *testing.T) *os.File {
	t.Helper()
	f, err := os.Open("/proc/self/ns/net")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = f.Close() })
	return f
}

func inode(t *testing.T, path string) uint64 {
	t.Helper()
	var st unix.Stat_t
	if err := unix.Stat(path, &st); err != nil {
		t.Fatal(err)
	}
	return st.Ino
}

func wait(t *testing.T, sim *Sim, what string, cond func(State) bool) State {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	st, err := sim.Wait(ctx, cond)
	if err != nil {
		t.Fatalf("%s: %v; state %+v", what, err, st)
	}
	return st
}

var info = &zds.WorkloadInfo{Name: "web", Namespace: "shop", ServiceAccount: "web-sa"}

// TestAddKeepDel: a well-formed sequence is acknowledged and tracked,
// with the namespace's inode; a repeated add is a no-op; del stops it.
func TestAddKeepDel(t *testing.T) {
	sim, a := connect(t, Config{})
	netns := openSelfNetns(t)
	want := inode(t, "/proc/self/ns/net")

	a.send(zds.Request{Kind: zds.KindAdd, UID: "u1", Info: info}, int(netns.Fd()))
	if got := a.answer(); got != "" {
		t.Fatalf("add: refused: %s", got)
	}
	a.send(zds.Request{Kind: zds.KindKeep, UID: "u2"})
	if got := a.answer(); got != "" {
		t.Fatalf("keep: refused: %s", got)
	}
	a.send(zds.Request{Kind: zds.KindSnapshotSent})
	if got := a.answer(); got != "" {
		t.Fatalf("snapshot_sent: refused: %s", got)
	}
	st := sim.State()
	w, ok := st.Workloads["u1"]
	if !ok || w.Inode != want || w.Info != *info {
		t.Fatalf("workload u1: %+v (present %v); want inode %d and info %+v", w, ok, want, *info)
	}
	if st.Snapshots != 1 || len(st.Events) != 3 || st.Events[0].FDs != 1 || st.Events[0].Inode != want {
		t.Fatalf("state after the snapshot: %+v", st)
	}

	a.send(zds.Request{Kind: zds.KindAdd, UID: "u1", Info: info}, int(netns.Fd()))
	if got := a.answer(); got != "" {
		t.Fatalf("repeated add: refused: %s", got)
	}
	if st := sim.State(); !st.Events[3].NoOp {
		t.Errorf("a repeated add in the same namespace: want a no-op, got %+v", st.Events[3])
	}

	a.send(zds.Request{Kind: zds.KindDel, UID: "u1"})
	if got := a.answer(); got != "" {
		t.Fatalf("del: refused: %s", got)
	}
	if st := sim.State(); len(st.Workloads) != 0 || len(st.ProtocolErrors) != 0 {
		t.Fatalf("after del: %+v", st)
	}
}

// TestReconcileAcrossConnections: one stand-in, two connections (it
// reconnects, as after an agent restart): the second snapshot decides
// what survives, keeps included, and a del before its end unnames a pod.
func TestReconcileAcrossConnections(t *testing.T) {
	path := filepath.Join(t.TempDir(), "ztunnel.sock")
	l, err := net.ListenUnix("unixpacket", &net.UnixAddr{Name: path, Net: "unixpacket"})
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	_ = l.SetDeadline(time.Now().Add(10 * time.Second))
	sim, err := Start(Config{Path: path, Reconnect: true})
	if err != nil {
		t.Fatal(err)
	}
	defer sim.Close()
	accept := func() *fakeAgent {
		uc, err := l.AcceptUnix()
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { _ = uc.Close() })
		a := &fakeAgent{t: t, uc: uc}
		a.read() // hello
		return a
	}
	netns := openSelfNetns(t)
	a := accept()
	for _, uid := range []string{"stays", "kept", "goes", "deleted-early"} {
		a.send(zds.Request{Kind: zds.KindAdd, UID: uid, Info: info}, int(netns.Fd()))
		a.answer()
	}
	a.send(zds.Request{Kind: zds.KindSnapshotSent})
	a.answer()
	a.uc.Close()

	b := accept()
	for _, uid := range []string{"stays", "deleted-early"} {
		b.send(zds.Request{Kind: zds.KindAdd, UID: uid, Info: info}, int(netns.Fd()))
		b.answer()
	}
	// A del before snapshot_sent only unnames the pod.
	b.send(zds.Request{Kind: zds.KindDel, UID: "deleted-early"})
	b.answer()
	b.send(zds.Request{Kind: zds.KindKeep, UID: "kept"})
	b.answer()
	if got := len(sim.State().Workloads); got != 4 {
		t.Fatalf("before snapshot_sent, nothing is stopped: %d workloads, want 4", got)
	}
	b.send(zds.Request{Kind: zds.KindSnapshotSent})
	b.answer()
	st := sim.State()
	if got := slices.Sorted(maps.Keys(st.Workloads)); !slices.Equal(got, []string{"kept", "stays"}) {
		t.Errorf("after the second snapshot: %v, want [kept stays]", got)
	}
	if st.Conns != 2 || st.Snapshots != 2 {
		t.Errorf("conns %d, snapshots %d; want 2 and 2", st.Conns, st.Snapshots)
	}
}

// TestProtocolViolations sends what ztunnel refuses; each is answered
// with a refusal, recorded, and ends the connection. The last three stop
// ztunnel's in-pod manager for good, and the stand-in with it.
func TestProtocolViolations(t *testing.T) {
	devnull, err := os.Open(os.DevNull)
	if err != nil {
		t.Fatal(err)
	}
	defer devnull.Close()
	for _, tc := range []struct {
		name     string
		setup    func(a *fakeAgent, netns int)
		send     func(a *fakeAgent, netns int)
		wantErr  string
		terminal bool
	}{
		{name: "add without a descriptor", send: func(a *fakeAgent, _ int) {
			a.send(zds.Request{Kind: zds.KindAdd, UID: "u", Info: info})
		}, wantErr: "add without a network namespace descriptor"},
		{name: "add with two descriptors", send: func(a *fakeAgent, fd int) {
			a.send(zds.Request{Kind: zds.KindAdd, UID: "u", Info: info}, fd, fd)
		}, wantErr: "expected 1 descriptor, got 2"},
		{name: "keep with a descriptor", send: func(a *fakeAgent, fd int) {
			a.send(zds.Request{Kind: zds.KindKeep, UID: "u"}, fd)
		}, wantErr: "a descriptor came with keep"},
		{name: "snapshot_sent with a descriptor", send: func(a *fakeAgent, fd int) {
			a.send(zds.Request{Kind: zds.KindSnapshotSent}, fd)
		}, wantErr: "a descriptor came with snapshot_sent"},
		{name: "garbage", send: func(a *fakeAgent, _ int) { a.sendRaw([]byte{0x0a, 0x7f, 0x01}) }, wantErr: "WorkloadRequest"},
		{name: "no payload", send: func(a *fakeAgent, _ int) { a.sendRaw([]byte{0x50, 0x01}) }, wantErr: "without a payload"},
		{name: "longer than ztunnel reads", send: func(a *fakeAgent, _ int) {
			a.send(zds.Request{Kind: zds.KindKeep, UID: strings.Repeat("x", 1100)})
		}, wantErr: "truncated"},
		{name: "add without workload_info", send: func(a *fakeAgent, fd int) {
			a.send(zds.Request{Kind: zds.KindAdd, UID: "u"}, fd)
		}, wantErr: "workload_info is required", terminal: true},
		{name: "keep after snapshot_sent", setup: func(a *fakeAgent, _ int) {
			a.send(zds.Request{Kind: zds.KindSnapshotSent})
			a.answer()
		}, send: func(a *fakeAgent, _ int) {
			a.send(zds.Request{Kind: zds.KindKeep, UID: "u"})
		}, wantErr: "pod keep received after snapshot", terminal: true},
		{name: "second snapshot_sent", setup: func(a *fakeAgent, _ int) {
			a.send(zds.Request{Kind: zds.KindSnapshotSent})
			a.answer()
		}, send: func(a *fakeAgent, _ int) {
			a.send(zds.Request{Kind: zds.KindSnapshotSent})
		}, wantErr: "pod snapshot received already", terminal: true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			sim, a := connect(t, Config{})
			netns := openSelfNetns(t)
			// A running workload shows whether the error drains them all.
			a.send(zds.Request{Kind: zds.KindAdd, UID: "running", Info: info}, int(netns.Fd()))
			if got := a.answer(); got != "" {
				t.Fatalf("add: refused: %s", got)
			}
			if tc.setup != nil {
				tc.setup(a, int(netns.Fd()))
			}
			tc.send(a, int(netns.Fd()))
			if got := a.answer(); !strings.Contains(got, tc.wantErr) {
				t.Errorf("refusal %q, want one naming %q", got, tc.wantErr)
			}
			a.expectClosed()
			st := wait(t, sim, "disconnect", func(st State) bool { return !st.Connected })
			if len(st.ProtocolErrors) != 1 || !strings.Contains(st.ProtocolErrors[0], tc.wantErr) {
				t.Errorf("protocol errors %q, want one naming %q", st.ProtocolErrors, tc.wantErr)
			}
			if st.Stopped != tc.terminal {
				t.Errorf("stopped %v, want %v", st.Stopped, tc.terminal)
			}
			if _, running := st.Workloads["running"]; running == tc.terminal {
				t.Errorf("workload still running: %v; a terminal error drains every workload, others none", running)
			}
		})
	}

	// Not a namespace: ztunnel cannot start the proxy, refuses the add,
	// and goes on.
	t.Run("add of a descriptor that is not a network namespace", func(t *testing.T) {
		sim, a := connect(t, Config{})
		a.send(zds.Request{Kind: zds.KindAdd, UID: "u", Info: info}, int(devnull.Fd()))
		if got := a.answer(); !strings.Contains(got, "not a namespace") {
			t.Errorf("refusal %q, want one naming the descriptor's kind", got)
		}
		a.send(zds.Request{Kind: zds.KindSnapshotSent})
		if got := a.answer(); got != "" {
			t.Errorf("the connection goes on: snapshot_sent refused with %q", got)
		}
		if st := sim.State(); len(st.ProtocolErrors) != 0 || len(st.Workloads) != 0 {
			t.Errorf("state %+v: want no protocol error and no workload", st)
		}
	})
	t.Run("add of another kind of namespace", func(t *testing.T) {
		_, a := connect(t, Config{})
		uts, err := os.Open("/proc/self/ns/uts")
		if err != nil {
			t.Fatal(err)
		}
		defer uts.Close()
		a.send(zds.Request{Kind: zds.KindAdd, UID: "u", Info: info}, int(uts.Fd()))
		if got := a.answer(); !strings.Contains(got, "not a network namespace") {
			t.Errorf("refusal %q, want one saying it is not a network namespace", got)
		}
	})
}

// TestScript: refusals by uid and for all, a stall, a drop.
func TestScript(t *testing.T) {
	sim, a := connect(t, Config{})
	netns := openSelfNetns(t)
	add := func(uid string) string {
		a.send(zds.Request{Kind: zds.KindAdd, UID: uid, Info: info}, int(netns.Fd()))
		return a.answer()
	}
	sim.Nack("bad", "no room")
	if got := add("bad"); got != "no room" {
		t.Errorf("scripted refusal: %q, want %q", got, "no room")
	}
	if got := add("good"); got != "" {
		t.Errorf("another uid: refused with %q", got)
	}
	sim.Nack(AnyUID, "all full")
	if got := add("other"); got != "all full" {
		t.Errorf("refusal of every add: %q", got)
	}
	sim.Nack(AnyUID, "")
	sim.Nack("bad", "")
	if got := add("bad"); got != "" {
		t.Errorf("refusal cleared: still refused with %q", got)
	}

	sim.Stall(true)
	a.send(zds.Request{Kind: zds.KindDel, UID: "good"})
	st := wait(t, sim, "the stalled request", func(st State) bool { return len(st.Events) == 5 })
	if ev := st.Events[4]; ev.Answered || ev.Req.Kind != zds.KindDel {
		t.Errorf("stalled request recorded as %+v; want an unanswered del", ev)
	}
	if _, ok := st.Workloads["good"]; !ok {
		t.Error("a stalled del was carried out")
	}
	sim.Stall(false)

	sim.DropAt(2)
	if got := add("one-more"); got != "" {
		t.Fatalf("the request before the drop: refused with %q", got)
	}
	a.send(zds.Request{Kind: zds.KindSnapshotSent})
	a.expectClosed()
	st = wait(t, sim, "the drop", func(st State) bool { return !st.Connected })
	if ev := st.Events[len(st.Events)-1]; ev.Answered || ev.Req.Kind != zds.KindSnapshotSent || st.Snapshots != 0 {
		t.Errorf("dropped request recorded as %+v (snapshots %d); want an unprocessed snapshot_sent", ev, st.Snapshots)
	}
}

// TestListeners runs ztunnel's listeners in a real pod namespace: each
// accepts inside it and names the listener and where the client meant
// to go (SO_ORIGINAL_DST through a redirect), the stand-in's own
// connections carry mark 1337 and so escape a rule that skips them, a
// new namespace for the same pod moves the listeners, and del closes them.
func TestListeners(t *testing.T) {
	testutil.RequireRoot(t)
	testutil.RequireTools(t, "iptables")
	pod := testutil.NewNS(t)
	sim, a := connect(t, Config{Listeners: true})
	f, err := os.Open(pod.Path())
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	a.send(zds.Request{Kind: zds.KindAdd, UID: "pod", Info: info}, int(f.Fd()))
	if got := a.answer(); got != "" {
		t.Fatalf("add refused: %s", got)
	}
	// Past the snapshot, so that del stops the proxy (before it, a del
	// only unnames the pod).
	a.send(zds.Request{Kind: zds.KindSnapshotSent})
	if got := a.answer(); got != "" {
		t.Fatalf("snapshot_sent refused: %s", got)
	}
	w := sim.State().Workloads["pod"]
	if w.Inode != inode(t, pod.Path()) {
		t.Errorf("inode %d, want the pod namespace's %d", w.Inode, inode(t, pod.Path()))
	}
	for _, want := range []string{"tcp4 0.0.0.0:15001", "tcp4 0.0.0.0:15006", "tcp4 0.0.0.0:15008", "tcp4 0.0.0.0:15053",
		"udp4 0.0.0.0:15053", "tcp6 [::]:15001", "udp6 [::]:15053"} {
		if !slices.Contains(w.Listening, want) {
			t.Errorf("listening on %v; want %s among them", w.Listening, want)
		}
	}

	err = pod.Do(func(ns.NetNS) error {
		for _, tc := range []struct{ addr, want string }{
			{"127.0.0.1:15001", "15001 127.0.0.1:15001"},
			{"127.0.0.1:15006", "15006 127.0.0.1:15006"},
			{"127.0.0.1:15008", "15008 127.0.0.1:15008"},
			{"127.0.0.1:15053", "15053 127.0.0.1:15053"},
			{"[::1]:15001", "15001 [::1]:15001"},
		} {
			if got := readLine(t, tc.addr); got != tc.want {
				t.Errorf("%s answered %q, want %q", tc.addr, got, tc.want)
			}
		}
		c, err := net.Dial("udp", "127.0.0.1:15053")
		if err != nil {
			return err
		}
		defer c.Close()
		_ = c.SetDeadline(time.Now().Add(5 * time.Second))
		if _, err := c.Write([]byte("q")); err != nil {
			return err
		}
		buf := make([]byte, 64)
		n, err := c.Read(buf)
		if err != nil || string(buf[:n]) != "15053 q" {
			t.Errorf("udp 15053 answered %q, %v; want %q", buf[:n], err, "15053 q")
		}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}

	// An app in the pod, and a rule that sends the pod's unmarked
	// connections to it to 15001 instead, as the in-pod rules do.
	var app net.Listener
	err = pod.Do(func(ns.NetNS) error {
		var err error
		if app, err = net.Listen("tcp", "127.0.0.1:8000"); err != nil {
			return err
		}
		out, err := exec.Command("iptables", "-t", "nat", "-A", "OUTPUT", "-p", "tcp", "--dport", "8000",
			"-m", "mark", "!", "--mark", "1337", "-j", "REDIRECT", "--to-ports", "15001").CombinedOutput()
		if err != nil {
			return errors.New(string(out))
		}
		if got := readLine(t, "127.0.0.1:8000"); got != "15001 127.0.0.1:8000" {
			t.Errorf("the app's port, redirected: answered %q, want the outbound listener with the original destination", got)
		}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	defer app.Close()
	go func() {
		c, err := app.Accept()
		if err == nil {
			_, _ = c.Write([]byte("app\n"))
			_ = c.Close()
		}
	}()
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	c, err := sim.Dial(ctx, "pod", "tcp", "127.0.0.1:8000")
	if err != nil {
		t.Fatal(err)
	}
	mark := sockMark(t, c)
	line, _ := bufio.NewReader(c).ReadString('\n')
	c.Close()
	if mark != Mark || line != "app\n" {
		t.Errorf("the stand-in's own connection: mark %d, answer %q; want mark %d and the app itself", mark, line, Mark)
	}

	// ztunnel reaching the app on a client's behalf: from the client's
	// address, which the pod does not have. Table 100 routes it back to
	// the pod's own stack, as the connmark route does for the real path.
	err = pod.Do(func(ns.NetNS) error {
		for _, args := range [][]string{
			{"route", "add", "local", "10.9.9.9/32", "dev", "lo", "table", "100"},
			{"rule", "add", "to", "10.9.9.9", "lookup", "100", "pref", "100"},
		} {
			if out, err := exec.Command("ip", args...).CombinedOutput(); err != nil {
				return fmt.Errorf("ip %s: %w: %s", strings.Join(args, " "), err, out)
			}
		}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	peer := make(chan string, 1)
	go func() {
		c, err := app.Accept()
		if err != nil {
			peer <- err.Error()
			return
		}
		peer <- c.RemoteAddr().(*net.TCPAddr).IP.String()
		_, _ = c.Write([]byte("app\n"))
		_ = c.Close()
	}()
	c, err = sim.DialFrom(ctx, "pod", netip.MustParseAddr("10.9.9.9"), "127.0.0.1:8000")
	if err != nil {
		t.Fatal(err)
	}
	mark = sockMark(t, c)
	line, _ = bufio.NewReader(c).ReadString('\n')
	c.Close()
	if got := <-peer; got != "10.9.9.9" || mark != Mark || line != "app\n" {
		t.Errorf("transparent dial: the app saw %s, mark %d, answer %q; want 10.9.9.9, %d, the app", got, mark, line, Mark)
	}
	if _, err := sim.DialFrom(ctx, "nobody", netip.MustParseAddr("10.9.9.9"), "127.0.0.1:8000"); err == nil {
		t.Error("dial from an unknown workload: want an error")
	}

	// The same pod in a new namespace (its sandbox recreated).
	pod2 := testutil.NewNS(t)
	f2, err := os.Open(pod2.Path())
	if err != nil {
		t.Fatal(err)
	}
	defer f2.Close()
	a.send(zds.Request{Kind: zds.KindAdd, UID: "pod", Info: info}, int(f2.Fd()))
	if got := a.answer(); got != "" {
		t.Fatalf("add in a new namespace refused: %s", got)
	}
	if got := sim.State().Workloads["pod"].Inode; got != inode(t, pod2.Path()) {
		t.Errorf("inode after the new add: %d, want the new namespace's %d", got, inode(t, pod2.Path()))
	}
	expectRefused(t, pod, "127.0.0.1:15001")
	if got := dialIn(t, pod2, "127.0.0.1:15006"); got != "15006 127.0.0.1:15006" {
		t.Errorf("new namespace's 15006 answered %q", got)
	}

	a.send(zds.Request{Kind: zds.KindDel, UID: "pod"})
	if got := a.answer(); got != "" {
		t.Fatalf("del refused: %s", got)
	}
	expectRefused(t, pod2, "127.0.0.1:15001")
}

func readLine(t *testing.T, addr string) string {
	t.Helper()
	c, err := net.DialTimeout("tcp", addr, 5*time.Second)
	if err != nil {
		t.Errorf("dialing %s: %v", addr, err)
		return ""
	}
	defer c.Close()
	_ = c.SetDeadline(time.Now().Add(5 * time.Second))
	line, err := bufio.NewReader(c).ReadString('\n')
	if err != nil {
		t.Errorf("reading from %s: %v", addr, err)
	}
	return strings.TrimSuffix(line, "\n")
}

func dialIn(t *testing.T, n ns.NetNS, addr string) string {
	t.Helper()
	var line string
	if err := n.Do(func(ns.NetNS) error { line = readLine(t, addr); return nil }); err != nil {
		t.Fatal(err)
	}
	return line
}

func expectRefused(t *testing.T, n ns.NetNS, addr string) {
	t.Helper()
	err := n.Do(func(ns.NetNS) error {
		c, err := net.DialTimeout("tcp", addr, 5*time.Second)
		if err == nil {
			defer c.Close()
			_ = c.SetDeadline(time.Now().Add(2 * time.Second))
			b, _ := io.ReadAll(c)
			return fmt.Errorf("connected %s -> %s, which answered %q", c.LocalAddr(), c.RemoteAddr(), b)
		}
		if !errors.Is(err, unix.ECONNREFUSED) {
			return err
		}
		return nil
	})
	if err != nil {
		t.Errorf("%s: want the connection refused (listener closed): %v", addr, err)
	}
}

func sockMark(t *testing.T, c net.Conn) int {
	t.Helper()
	rc, err := c.(*net.TCPConn).SyscallConn()
	if err != nil {
		t.Fatal(err)
	}
	var mark int
	var merr error
	if err := rc.Control(func(fd uintptr) { mark, merr = unix.GetsockoptInt(int(fd), unix.SOL_SOCKET, unix.SO_MARK) }); err != nil {
		t.Fatal(err)
	}
	if merr != nil {
		t.Fatal(merr)
	}
	return mark
}
