package zds_test

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/containernetworking/plugins/pkg/ns"
	"github.com/prometheus/client_golang/prometheus"
	"golang.org/x/sys/unix"

	"github.com/istio-cni-go/istio-cni/internal/testutil"
	"github.com/istio-cni-go/istio-cni/internal/zds"
	"github.com/istio-cni-go/istio-cni/internal/ztunnelsim"
)

// pods is a Snapshotter a test can change.
type pods struct {
	mu   sync.Mutex
	list []zds.Pod
}

func (p *pods) Snapshot() []zds.Pod {
	p.mu.Lock()
	defer p.mu.Unlock()
	return slices.Clone(p.list)
}

func (p *pods) set(list ...zds.Pod) {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.list = list
}

type fixture struct {
	t    *testing.T
	srv  *zds.Server
	path string
	reg  *prometheus.Registry
	pods *pods
}

func newFixture(t *testing.T, mod func(*zds.Config)) *fixture {
	t.Helper()
	f := &fixture{t: t, path: filepath.Join(t.TempDir(), "run", "ztunnel", "ztunnel.sock"), reg: prometheus.NewRegistry(), pods: &pods{}}
	cfg := zds.Config{Path: f.path, Snapshotter: f.pods, AckTimeout: 5 * time.Second, AcceptInterval: time.Millisecond, Registerer: f.reg}
	if mod != nil {
		mod(&cfg)
	}
	srv, err := zds.New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	f.srv = srv
	t.Cleanup(func() { _ = srv.Close() })
	return f
}

func (f *fixture) sim(cfg ztunnelsim.Config) *ztunnelsim.Sim {
	f.t.Helper()
	cfg.Path = f.path
	s, err := ztunnelsim.Start(cfg)
	if err != nil {
		f.t.Fatal(err)
	}
	f.t.Cleanup(s.Close)
	return s
}

// waitConns waits until exactly n ztunnels are connected.
func (f *fixture) waitConns(n int) {
	f.t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	for {
		got, changed := f.srv.Connections()
		if got == n {
			return
		}
		select {
		case <-changed:
		case <-ctx.Done():
			f.t.Fatalf("waiting for %d ztunnel connections: %d", n, got)
		}
	}
}

func (f *fixture) gauge() float64 {
	f.t.Helper()
	return metricValue(f.t, f.reg, "ztunnel_connected")
}

func metricValue(t *testing.T, reg *prometheus.Registry, name string) float64 {
	t.Helper()
	mfs, err := reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	for _, mf := range mfs {
		if mf.GetName() != name {
			continue
		}
		m := mf.GetMetric()[0]
		if m.GetHistogram() != nil {
			return float64(m.GetHistogram().GetSampleCount())
		}
		return m.GetGauge().GetValue()
	}
	t.Fatalf("no metric %s", name)
	return 0
}

func wait(t *testing.T, s *ztunnelsim.Sim, what string, cond func(ztunnelsim.State) bool) ztunnelsim.State {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	st, err := s.Wait(ctx, cond)
	if err != nil {
		t.Fatalf("%s: %v; state %+v", what, err, st)
	}
	return st
}

func snapshotDone(st ztunnelsim.State) bool { return st.Snapshots > 0 }

func ctx(t *testing.T) context.Context {
	c, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	t.Cleanup(cancel)
	return c
}

// selfNetns opens this process's network namespace: a real namespace
// descriptor that needs no root, for the tests about the protocol alone.
func selfNetns(t *testing.T) *os.File {
	t.Helper()
	f, err := os.Open("/proc/self/ns/net")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = f.Close() })
	return f
}

func inodeOf(t *testing.T, path string) uint64 {
	t.Helper()
	var st unix.Stat_t
	if err := unix.Stat(path, &st); err != nil {
		t.Fatal(err)
	}
	return st.Ino
}

func pod(uid string, netns *os.File) zds.Pod {
	return zds.Pod{UID: uid, Info: zds.WorkloadInfo{Name: "pod-" + uid, Namespace: "ns", ServiceAccount: "sa"}, Netns: netns}
}

func kinds(evs []ztunnelsim.Event) string {
	var out []string
	for _, e := range evs {
		s := e.Req.Kind.String()
		if e.Req.UID != "" {
			s += " " + e.Req.UID
		}
		out = append(out, s)
	}
	return strings.Join(out, ", ")
}

// TestSocketFile: the directory is made, the socket is 0600 and replaces
// what a previous agent left, and Close removes it only while it is this
// server's.
func TestSocketFile(t *testing.T) {
	path := filepath.Join(t.TempDir(), "a", "b", "ztunnel.sock")
	if err := os.MkdirAll(filepath.Dir(path), 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(path, []byte("stale"), 0o644); err != nil {
		t.Fatal(err)
	}
	srv, err := zds.New(zds.Config{Path: path, Snapshotter: &pods{}})
	if err != nil {
		t.Fatal(err)
	}
	fi, err := os.Lstat(path)
	if err != nil {
		t.Fatal(err)
	}
	if fi.Mode().Type() != os.ModeSocket || fi.Mode().Perm() != 0o600 {
		t.Errorf("socket file mode %v, want a socket with 0600", fi.Mode())
	}
	// A newer agent's socket in its place is left alone.
	srv2, err := zds.New(zds.Config{Path: path, Snapshotter: &pods{}})
	if err != nil {
		t.Fatal(err)
	}
	if err := srv.Close(); err != nil {
		t.Fatal(err)
	}
	if _, err := os.Lstat(path); err != nil {
		t.Fatalf("the first server's Close removed the second's socket: %v", err)
	}
	if err := srv2.Close(); err != nil {
		t.Fatal(err)
	}
	if _, err := os.Lstat(path); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("socket left after Close: %v", err)
	}

	if _, err := zds.New(zds.Config{Snapshotter: &pods{}}); err == nil {
		t.Error("no path: want an error")
	}
	if _, err := zds.New(zds.Config{Path: path}); err == nil {
		t.Error("no snapshotter: want an error")
	}
}

// TestConnectAndDisconnect: hello, an empty snapshot, the gauge and the
// change channel; a ztunnel that goes away while nothing is sent is
// noticed by itself.
func TestConnectAndDisconnect(t *testing.T) {
	f := newFixture(t, nil)
	if f.srv.Connected() || f.gauge() != 0 {
		t.Fatalf("connected before any ztunnel: %v, gauge %v", f.srv.Connected(), f.gauge())
	}
	_, changed := f.srv.Connections()
	sim := f.sim(ztunnelsim.Config{})
	st := wait(t, sim, "snapshot", snapshotDone)
	if kinds(st.Events) != "snapshot_sent" || len(st.ProtocolErrors) != 0 {
		t.Errorf("events %q, protocol errors %q; want snapshot_sent alone", kinds(st.Events), st.ProtocolErrors)
	}
	select {
	case <-changed:
	default:
		t.Error("the change channel was not closed when ztunnel connected")
	}
	if !f.srv.Connected() || f.gauge() != 1 {
		t.Errorf("after connecting: connected %v, gauge %v; want true, 1", f.srv.Connected(), f.gauge())
	}
	sim.Close()
	f.waitConns(0)
	if f.gauge() != 0 {
		t.Errorf("gauge %v after ztunnel left, want 0", f.gauge())
	}
}

// TestSnapshot: a new connection gets an add, with the namespace as its
// one descriptor, for each pod whose namespace the agent holds, a keep
// for the others, in the snapshotter's order, then snapshot_sent once.
func TestSnapshot(t *testing.T) {
	f := newFixture(t, nil)
	netns := selfNetns(t)
	f.pods.set(pod("a", netns), pod("b", nil), pod("c", netns))
	sim := f.sim(ztunnelsim.Config{})
	st := wait(t, sim, "snapshot", snapshotDone)
	if got, want := kinds(st.Events), "add a, keep b, add c, snapshot_sent"; got != want {
		t.Fatalf("snapshot %q, want %q", got, want)
	}
	self := inodeOf(t, "/proc/self/ns/net")
	for _, i := range []int{0, 2} {
		ev := st.Events[i]
		if ev.FDs != 1 || ev.Inode != self || ev.Req.Info == nil || ev.Req.Info.Name != "pod-"+ev.Req.UID {
			t.Errorf("add %d: %+v; want one descriptor of inode %d and the workload info", i, ev, self)
		}
	}
	if st.Events[1].FDs != 0 || st.Events[3].FDs != 0 {
		t.Errorf("descriptors with keep or snapshot_sent: %+v", st.Events)
	}
	if st.Snapshots != 1 || len(st.ProtocolErrors) != 0 {
		t.Errorf("snapshots %d, protocol errors %q", st.Snapshots, st.ProtocolErrors)
	}
	if got := slices.Sorted(mapKeys(st.Workloads)); !slices.Equal(got, []string{"a", "c"}) {
		t.Errorf("workloads %v, want [a c]", got)
	}
	if got := metricValue(t, f.reg, "istio_cni_ztunnel_add_duration_seconds"); got != 2 {
		t.Errorf("add latencies observed: %v, want 2", got)
	}
}

func mapKeys(m map[string]ztunnelsim.Workload) func(func(string) bool) {
	return func(yield func(string) bool) {
		for k := range m {
			if !yield(k) {
				return
			}
		}
	}
}

// TestAddNewestDelAll: with two ztunnels (one replacing the other), an
// add goes to the newest only and a delete to both; when the newest
// leaves, adds go to the one left.
func TestAddNewestDelAll(t *testing.T) {
	f := newFixture(t, nil)
	netns := selfNetns(t)
	old := f.sim(ztunnelsim.Config{})
	wait(t, old, "first snapshot", snapshotDone)
	f.waitConns(1)
	newer := f.sim(ztunnelsim.Config{})
	wait(t, newer, "second snapshot", snapshotDone)
	f.waitConns(2)
	if f.gauge() != 2 {
		t.Errorf("gauge %v with two ztunnels, want 2", f.gauge())
	}

	if err := f.srv.AddWorkload(ctx(t), pod("p1", netns)); err != nil {
		t.Fatal(err)
	}
	if got := kinds(newer.State().Events); got != "snapshot_sent, add p1" {
		t.Errorf("newest ztunnel saw %q", got)
	}
	if got := kinds(old.State().Events); got != "snapshot_sent" {
		t.Errorf("older ztunnel saw %q; adds go to the newest only", got)
	}
	if err := f.srv.DelWorkload(ctx(t), "p1"); err != nil {
		t.Fatal(err)
	}
	if got := kinds(newer.State().Events); got != "snapshot_sent, add p1, del p1" {
		t.Errorf("newest ztunnel saw %q", got)
	}
	if got := kinds(old.State().Events); got != "snapshot_sent, del p1" {
		t.Errorf("older ztunnel saw %q; deletes go to all", got)
	}

	newer.Close()
	f.waitConns(1)
	if err := f.srv.AddWorkload(ctx(t), pod("p2", netns)); err != nil {
		t.Fatal(err)
	}
	if got := kinds(old.State().Events); got != "snapshot_sent, del p1, add p2" {
		t.Errorf("the remaining ztunnel saw %q", got)
	}
}

// TestNotConnected: without ztunnel an add fails at once with
// ErrNotConnected, a delete is nothing to do, and WaitConnected returns
// when one connects.
func TestNotConnected(t *testing.T) {
	f := newFixture(t, nil)
	netns := selfNetns(t)
	if err := f.srv.AddWorkload(ctx(t), pod("p", netns)); !errors.Is(err, zds.ErrNotConnected) {
		t.Errorf("add without ztunnel: %v, want ErrNotConnected", err)
	}
	if err := f.srv.DelWorkload(ctx(t), "p"); err != nil {
		t.Errorf("delete without ztunnel: %v", err)
	}
	short, cancel := context.WithTimeout(context.Background(), 20*time.Millisecond)
	defer cancel()
	if err := f.srv.WaitConnected(short); !errors.Is(err, context.DeadlineExceeded) {
		t.Errorf("WaitConnected without ztunnel: %v, want the deadline", err)
	}
	done := make(chan error, 1)
	go func() { done <- f.srv.WaitConnected(ctx(t)) }()
	f.sim(ztunnelsim.Config{})
	if err := <-done; err != nil {
		t.Fatal(err)
	}
	if err := f.srv.AddWorkload(ctx(t), pod("p", netns)); err != nil {
		t.Errorf("add once connected: %v", err)
	}
}

// TestAddRefusals: a nack comes back as a NackError with ztunnel's
// text and keeps the connection; a pod without a namespace, or too large
// for ztunnel's read, never leaves the agent.
func TestAddRefusals(t *testing.T) {
	f := newFixture(t, nil)
	netns := selfNetns(t)
	sim := f.sim(ztunnelsim.Config{})
	wait(t, sim, "snapshot", snapshotDone)
	sim.Nack("p", "failure to start proxy: address in use")
	err := f.srv.AddWorkload(ctx(t), pod("p", netns))
	var nack *zds.NackError
	if !errors.As(err, &nack) || nack.Reason != "failure to start proxy: address in use" || nack.UID != "p" {
		t.Fatalf("refused add: %v, want a NackError with ztunnel's text", err)
	}
	if !strings.Contains(err.Error(), "address in use") {
		t.Errorf("error text %q does not carry ztunnel's", err)
	}
	if err := f.srv.AddWorkload(ctx(t), pod("q", netns)); err != nil || !f.srv.Connected() {
		t.Errorf("after a refusal the connection goes on: %v, connected %v", err, f.srv.Connected())
	}
	if err := f.srv.AddWorkload(ctx(t), pod("n", nil)); err == nil || !strings.Contains(err.Error(), "network namespace") {
		t.Errorf("add without a namespace: %v", err)
	}
	big := pod("big", netns)
	big.Info.Name = strings.Repeat("x", 1100)
	if err := f.srv.AddWorkload(ctx(t), big); err == nil || !strings.Contains(err.Error(), "1024") {
		t.Errorf("add larger than ztunnel reads: %v", err)
	}
	if got := kinds(sim.State().Events); got != "snapshot_sent, add p, add q" {
		t.Errorf("ztunnel saw %q", got)
	}
}

// TestConcurrentAdds: adds from many goroutines are serialised on the
// connection and each caller gets its own answer (half are refused, by
// uid), which a mix-up of answers would break.
func TestConcurrentAdds(t *testing.T) {
	f := newFixture(t, nil)
	netns := selfNetns(t)
	sim := f.sim(ztunnelsim.Config{})
	wait(t, sim, "snapshot", snapshotDone)
	const n = 40
	for i := 0; i < n; i += 2 {
		sim.Nack(fmt.Sprint("p", i), fmt.Sprint("no p", i))
	}
	var wg sync.WaitGroup
	errs := make([]error, n)
	for i := range n {
		wg.Add(1)
		go func() {
			defer wg.Done()
			errs[i] = f.srv.AddWorkload(ctx(t), pod(fmt.Sprint("p", i), netns))
		}()
	}
	wg.Wait()
	for i, err := range errs {
		var nack *zds.NackError
		switch {
		case i%2 == 1 && err != nil:
			t.Errorf("p%d: %v, want an ack", i, err)
		case i%2 == 0 && (!errors.As(err, &nack) || nack.Reason != fmt.Sprint("no p", i)):
			t.Errorf("p%d: %v, want its own refusal", i, err)
		}
	}
	if st := sim.State(); len(st.Workloads) != n/2 || len(st.ProtocolErrors) != 0 {
		t.Errorf("workloads %d, protocol errors %q", len(st.Workloads), st.ProtocolErrors)
	}
}

// TestStall: a ztunnel that does not answer within the deadline fails
// the add, and its connection is closed and dropped: a late answer could
// otherwise be taken for the next request's.
func TestStall(t *testing.T) {
	// The deadline bounds the hello and the snapshot's answers too: long
	// enough that a loaded machine does not miss those.
	f := newFixture(t, func(c *zds.Config) { c.AckTimeout = time.Second })
	netns := selfNetns(t)
	sim := f.sim(ztunnelsim.Config{})
	wait(t, sim, "snapshot", snapshotDone)
	sim.Stall(true)
	start := time.Now()
	err := f.srv.AddWorkload(ctx(t), pod("p", netns))
	if err == nil || !strings.Contains(err.Error(), "within 1s") {
		t.Fatalf("stalled add: %v, want a deadline error", err)
	}
	if d := time.Since(start); d < time.Second {
		t.Errorf("gave up after %v, before the deadline", d)
	}
	f.waitConns(0)
	wait(t, sim, "the agent closing the connection", func(st ztunnelsim.State) bool { return !st.Connected })
	if err := f.srv.AddWorkload(ctx(t), pod("p", netns)); !errors.Is(err, zds.ErrNotConnected) {
		t.Errorf("add after the drop: %v, want ErrNotConnected", err)
	}
}

// TestStallInSnapshot: a ztunnel that stops answering during the
// snapshot is dropped too, and never counted as a connection that can
// take adds once dropped.
func TestStallInSnapshot(t *testing.T) {
	// The hello is bound by the same deadline: long enough that a loaded
	// machine does not miss it.
	f := newFixture(t, func(c *zds.Config) { c.AckTimeout = time.Second })
	netns := selfNetns(t)
	f.pods.set(pod("a", netns))
	sim := f.sim(ztunnelsim.Config{Stall: true})
	st := wait(t, sim, "the agent closing the connection", func(st ztunnelsim.State) bool { return st.Conns == 1 && !st.Connected })
	if got := kinds(st.Events); got != "add a" {
		t.Errorf("ztunnel saw %q, want the one stalled add", got)
	}
	f.waitConns(0)
}

// TestDropMidSnapshot: ztunnel gone after two answers of a snapshot; it
// reconnects and the new connection gets the whole snapshot afresh.
func TestDropMidSnapshot(t *testing.T) {
	f := newFixture(t, nil)
	netns := selfNetns(t)
	f.pods.set(pod("a", netns), pod("b", nil), pod("c", netns))
	sim := f.sim(ztunnelsim.Config{Reconnect: true, DropAt: 3})
	st := wait(t, sim, "second snapshot", snapshotDone)
	var first, second []ztunnelsim.Event
	for _, ev := range st.Events {
		if ev.Conn == 1 {
			first = append(first, ev)
		} else {
			second = append(second, ev)
		}
	}
	if got := kinds(first); got != "add a, keep b, add c" || first[2].Answered {
		t.Errorf("first connection: %q (last answered %v); want the drop on add c", got, first[len(first)-1].Answered)
	}
	if got := kinds(second); got != "add a, keep b, add c, snapshot_sent" {
		t.Errorf("second connection: %q, want the whole snapshot", got)
	}
	if st.Conns != 2 || st.Snapshots != 1 || len(st.ProtocolErrors) != 0 {
		t.Errorf("conns %d, snapshots %d, protocol errors %q", st.Conns, st.Snapshots, st.ProtocolErrors)
	}
	f.waitConns(1)
	if err := f.srv.AddWorkload(ctx(t), pod("d", netns)); err != nil {
		t.Errorf("add after the recovery: %v", err)
	}
}

// TestSnapshotRefusal: an add of the snapshot that ztunnel refuses is
// logged and the snapshot goes on; so does the connection.
func TestSnapshotRefusal(t *testing.T) {
	f := newFixture(t, nil)
	netns := selfNetns(t)
	f.pods.set(pod("a", netns), pod("b", netns))
	sim := f.sim(ztunnelsim.Config{Nacks: map[string]string{"a": "no"}})
	st := wait(t, sim, "snapshot", snapshotDone)
	if got := kinds(st.Events); got != "add a, add b, snapshot_sent" || st.Events[0].Nack != "no" {
		t.Errorf("snapshot %q, first answer %q", got, st.Events[0].Nack)
	}
	if got := slices.Sorted(mapKeys(st.Workloads)); !slices.Equal(got, []string{"b"}) {
		t.Errorf("workloads %v, want [b]", got)
	}
	f.waitConns(1)
}

// TestReconnectGetsSnapshot: a ztunnel that restarts (disconnects and
// comes back) gets the snapshot of the moment it returns.
func TestReconnectGetsSnapshot(t *testing.T) {
	f := newFixture(t, nil)
	netns := selfNetns(t)
	f.pods.set(pod("a", netns))
	sim := f.sim(ztunnelsim.Config{Reconnect: true})
	wait(t, sim, "first snapshot", snapshotDone)
	f.pods.set(pod("b", netns), pod("c", nil))
	sim.Disconnect()
	st := wait(t, sim, "second snapshot", func(st ztunnelsim.State) bool { return st.Snapshots == 2 })
	var second []ztunnelsim.Event
	for _, ev := range st.Events {
		if ev.Conn == 2 {
			second = append(second, ev)
		}
	}
	if got := kinds(second); got != "add b, keep c, snapshot_sent" {
		t.Errorf("second connection: %q", got)
	}
	// a was not in the new snapshot: ztunnel drained it.
	if got := slices.Sorted(mapKeys(st.Workloads)); !slices.Equal(got, []string{"b"}) {
		t.Errorf("workloads %v, want [b]", got)
	}
	f.waitConns(1)
}

// TestOtherHelloVersion: a ztunnel that says another protocol version is
// served as Istio's agent serves it, with version 1's messages: closed on,
// it would redial at once and never get a snapshot.
func TestOtherHelloVersion(t *testing.T) {
	f := newFixture(t, nil)
	sim := f.sim(ztunnelsim.Config{Version: 2})
	st := wait(t, sim, "the snapshot", snapshotDone)
	if st.Conns != 1 || len(st.ProtocolErrors) != 0 {
		t.Errorf("a ztunnel of version 2: %d connections, protocol errors %q", st.Conns, st.ProtocolErrors)
	}
	f.waitConns(1)
}

// TestBadHello: a ztunnel saying nothing is closed without a snapshot and
// never counted.
func TestBadHello(t *testing.T) {
	f := newFixture(t, func(c *zds.Config) { c.AckTimeout = 200 * time.Millisecond })

	uc, err := net.DialUnix("unixpacket", nil, &net.UnixAddr{Name: f.path, Net: "unixpacket"})
	if err != nil {
		t.Fatal(err)
	}
	defer uc.Close()
	expectClosed(t, uc)
	if n, _ := f.srv.Connections(); n != 0 {
		t.Errorf("%d connections counted", n)
	}
}

func expectClosed(t *testing.T, uc *net.UnixConn) {
	t.Helper()
	_ = uc.SetReadDeadline(time.Now().Add(10 * time.Second))
	buf := make([]byte, 64)
	n, err := uc.Read(buf)
	if n != 0 || (err != nil && !errors.Is(err, io.EOF)) {
		t.Fatalf("want the agent to close the connection: read %d bytes, %v", n, err)
	}
}

// TestUnaskedMessage: ztunnel speaks only when spoken to; anything else
// ends its connection.
func TestUnaskedMessage(t *testing.T) {
	f := newFixture(t, nil)
	uc, err := net.DialUnix("unixpacket", nil, &net.UnixAddr{Name: f.path, Net: "unixpacket"})
	if err != nil {
		t.Fatal(err)
	}
	defer uc.Close()
	if _, err := uc.Write(zds.Hello{Version: zds.V1}.Marshal()); err != nil {
		t.Fatal(err)
	}
	buf := make([]byte, 64)
	_ = uc.SetReadDeadline(time.Now().Add(10 * time.Second))
	n, err := uc.Read(buf)
	if err != nil {
		t.Fatal(err)
	}
	if req, err := zds.UnmarshalRequest(buf[:n]); err != nil || req.Kind != zds.KindSnapshotSent {
		t.Fatalf("first request %+v, %v; want snapshot_sent", req, err)
	}
	ack, _ := zds.Response{Ack: &zds.Ack{}}.Marshal()
	if _, err := uc.Write(ack); err != nil {
		t.Fatal(err)
	}
	f.waitConns(1)
	if _, err := uc.Write(ack); err != nil {
		t.Fatal(err)
	}
	expectClosed(t, uc)
	f.waitConns(0)
}

// TestDelRefused: a refused delete is reported with ztunnel's text.
func TestDelRefused(t *testing.T) {
	f := newFixture(t, nil)
	uc, err := net.DialUnix("unixpacket", nil, &net.UnixAddr{Name: f.path, Net: "unixpacket"})
	if err != nil {
		t.Fatal(err)
	}
	defer uc.Close()
	_, _ = uc.Write(zds.Hello{Version: zds.V1}.Marshal())
	buf := make([]byte, 64)
	_ = uc.SetReadDeadline(time.Now().Add(10 * time.Second))
	if _, err := uc.Read(buf); err != nil {
		t.Fatal(err)
	}
	ack, _ := zds.Response{Ack: &zds.Ack{}}.Marshal()
	_, _ = uc.Write(ack)
	f.waitConns(1)
	go func() {
		n, err := uc.Read(buf)
		if err != nil {
			return
		}
		if req, err := zds.UnmarshalRequest(buf[:n]); err == nil && req.Kind == zds.KindDel && req.UID == "p" {
			nack, _ := zds.Response{Ack: &zds.Ack{Error: "unknown workload"}}.Marshal()
			_, _ = uc.Write(nack)
		}
	}()
	err = f.srv.DelWorkload(ctx(t), "p")
	var nack *zds.NackError
	if !errors.As(err, &nack) || nack.Kind != zds.KindDel || nack.Reason != "unknown workload" {
		t.Errorf("refused delete: %v", err)
	}
}

// TestCloseDuringAdd: Close ends an add waiting for a stalled ztunnel
// and returns once every goroutine has.
func TestCloseDuringAdd(t *testing.T) {
	f := newFixture(t, nil)
	netns := selfNetns(t)
	sim := f.sim(ztunnelsim.Config{})
	wait(t, sim, "snapshot", snapshotDone)
	sim.Stall(true)
	done := make(chan error, 1)
	go func() { done <- f.srv.AddWorkload(ctx(t), pod("p", netns)) }()
	wait(t, sim, "the stalled add", func(st ztunnelsim.State) bool { return len(st.Events) == 2 })
	if err := f.srv.Close(); err != nil {
		t.Fatal(err)
	}
	if err := <-done; err == nil || !strings.Contains(err.Error(), "stopping") {
		t.Errorf("add cut by Close: %v", err)
	}
}

// TestAcceptInterval: accepts are spaced, so a ztunnel in a reconnect
// loop cannot make the agent take connections faster.
func TestAcceptInterval(t *testing.T) {
	f := newFixture(t, func(c *zds.Config) { c.AcceptInterval = 300 * time.Millisecond })
	// Timed from before the first dial: the first accept comes after it,
	// the second at least the interval after that, however long either
	// handshake took on a loaded machine.
	start := time.Now()
	first := f.sim(ztunnelsim.Config{})
	wait(t, first, "first snapshot", snapshotDone)
	second := f.sim(ztunnelsim.Config{})
	wait(t, second, "second snapshot", snapshotDone)
	if d := time.Since(start); d < 300*time.Millisecond {
		t.Errorf("second connection served %v after the first, want the accept interval between them", d)
	}
}

// TestRealNamespaces hands real pod namespaces to the stand-in: the
// descriptor it gets is the pod's namespace (same inode), its listeners
// accept inside the pod, and a delete closes them.
func TestRealNamespaces(t *testing.T) {
	testutil.RequireRoot(t)
	f := newFixture(t, nil)
	nsA, nsB := testutil.NewNS(t), testutil.NewNS(t)
	fa, err := os.Open(nsA.Path())
	if err != nil {
		t.Fatal(err)
	}
	defer fa.Close()
	fb, err := os.Open(nsB.Path())
	if err != nil {
		t.Fatal(err)
	}
	defer fb.Close()
	f.pods.set(pod("a", fa))
	sim := f.sim(ztunnelsim.Config{Listeners: true})
	wait(t, sim, "snapshot", snapshotDone)
	if err := f.srv.AddWorkload(ctx(t), pod("b", fb)); err != nil {
		t.Fatal(err)
	}
	st := sim.State()
	if got, want := st.Workloads["a"].Inode, inodeOf(t, nsA.Path()); got != want {
		t.Errorf("pod a: ztunnel got namespace inode %d, want %d", got, want)
	}
	if got, want := st.Workloads["b"].Inode, inodeOf(t, nsB.Path()); got != want {
		t.Errorf("pod b: ztunnel got namespace inode %d, want %d", got, want)
	}
	for _, tc := range []struct {
		ns   string
		path string
	}{{"a", nsA.Path()}, {"b", nsB.Path()}} {
		line, err := dialIn(tc.path, "127.0.0.1:15008")
		if err != nil || line != "15008 127.0.0.1:15008" {
			t.Errorf("pod %s, 15008: %q, %v", tc.ns, line, err)
		}
	}
	if err := f.srv.DelWorkload(ctx(t), "b"); err != nil {
		t.Fatal(err)
	}
	if _, err := dialIn(nsB.Path(), "127.0.0.1:15008"); !errors.Is(err, unix.ECONNREFUSED) {
		t.Errorf("pod b after delete: %v, want the connection refused", err)
	}
	if line, err := dialIn(nsA.Path(), "127.0.0.1:15001"); err != nil || line != "15001 127.0.0.1:15001" {
		t.Errorf("pod a after b's delete: %q, %v", line, err)
	}
}

// dialIn connects to addr from inside the namespace at path and returns
// the line the listener answers.
func dialIn(path, addr string) (string, error) {
	n, err := ns.GetNS(path)
	if err != nil {
		return "", err
	}
	defer n.Close()
	var line string
	err = n.Do(func(ns.NetNS) error {
		c, err := net.DialTimeout("tcp", addr, 5*time.Second)
		if err != nil {
			return err
		}
		defer c.Close()
		_ = c.SetDeadline(time.Now().Add(5 * time.Second))
		line, err = bufio.NewReader(c).ReadString('\n')
		line = strings.TrimSuffix(line, "\n")
		return err
	})
	return line, err
}

// closingPods closes a pod's namespace file when ztunnel acknowledges
// the pod before it in the snapshot: a new sandbox of that pod replacing
// its namespace while the snapshot is being sent.
type closingPods struct {
	*pods
	after  string
	closes *os.File
}

func (p *closingPods) SnapshotAcked(uid string, _ *os.File) {
	if uid == p.after {
		_ = p.closes.Close()
	}
}
func (*closingPods) SnapshotRefused(string, *os.File) {}
func (*closingPods) SnapshotDone()                    {}

// TestSnapshotPodReleasedMeanwhile: a pod whose namespace is released
// while the snapshot is sent is left out of it; the others and the end of
// the snapshot still go, on the same connection.
func TestSnapshotPodReleasedMeanwhile(t *testing.T) {
	p := &closingPods{pods: &pods{}, after: "a"}
	f := newFixture(t, func(c *zds.Config) { c.Snapshotter = p })
	b, err := os.Open("/proc/self/ns/net")
	if err != nil {
		t.Fatal(err)
	}
	p.closes = b
	t.Cleanup(func() { _ = b.Close() })
	netns := selfNetns(t)
	p.set(pod("a", netns), pod("b", b), pod("c", netns))
	sim := f.sim(ztunnelsim.Config{})
	st := wait(t, sim, "snapshot", snapshotDone)
	if got, want := kinds(st.Events), "add a, add c, snapshot_sent"; got != want {
		t.Fatalf("snapshot %q, want %q", got, want)
	}
	if st.Snapshots != 1 || st.Conns != 1 {
		t.Fatalf("%d snapshots over %d connections, want one of each", st.Snapshots, st.Conns)
	}
	f.waitConns(1)
}

// TestPathRemovedByAnotherAgent: an Istio agent that stops after ours
// started closes its listener on the same path, which unlinks it; the
// path is put back, and ztunnel, redialling, reaches our server and gets
// its snapshot.
func TestPathRemovedByAnotherAgent(t *testing.T) {
	f := newFixture(t, nil)
	first := f.sim(ztunnelsim.Config{})
	wait(t, first, "the first snapshot", snapshotDone)
	// What Go's listener close does to the path Istio's agent bound.
	if err := os.Remove(f.path); err != nil {
		t.Fatal(err)
	}
	deadline := time.Now().Add(10 * time.Second)
	for {
		if _, err := os.Lstat(f.path); err == nil {
			break
		}
		if time.Now().After(deadline) {
			t.Fatal("the ztunnel socket's path was not put back within 10 s")
		}
		time.Sleep(10 * time.Millisecond) // polling the condition, not synchronising
	}
	again := f.sim(ztunnelsim.Config{})
	wait(t, again, "the snapshot through the path put back", snapshotDone)
	f.waitConns(2)
}

// TestHelloQueuedBeforeServing: the socket bound ahead (Listen) takes
// ztunnel's connection and hello into its backlog before the server
// starts, and the server, once started with it, answers with the
// snapshot: ztunnel need not wait out its back-off while the agent syncs.
func TestHelloQueuedBeforeServing(t *testing.T) {
	path := filepath.Join(t.TempDir(), "ztunnel", "ztunnel.sock")
	l, err := zds.Listen(path, nil)
	if err != nil {
		t.Fatal(err)
	}
	// Without Reconnect, Start fails unless its first dial connects.
	sim, err := ztunnelsim.Start(ztunnelsim.Config{Path: path})
	if err != nil {
		t.Fatalf("ztunnel could not connect to the socket bound ahead: %v", err)
	}
	t.Cleanup(sim.Close)
	if st := sim.State(); st.Snapshots != 0 {
		t.Fatalf("a snapshot before the server started: %+v", st)
	}
	srv, err := zds.New(zds.Config{Path: path, Listener: l, Snapshotter: &pods{}, AcceptInterval: time.Millisecond})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = srv.Close() })
	wait(t, sim, "the snapshot", snapshotDone)
}
