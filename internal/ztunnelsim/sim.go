// Package ztunnelsim is a stand-in for ztunnel's in-pod mode, for tests:
// it connects to the agent's ZDS socket, speaks the protocol with
// ztunnel's strictness (what ztunnel treats as a protocol error, it
// records and closes on), checks that each descriptor it is handed is a
// network namespace, and can bind ztunnel's listeners inside each pod and
// dial out of it with ztunnel's socket mark. Tests script it to refuse,
// stall or drop, and wait on what it has seen.
package ztunnelsim

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"maps"
	"net"
	"net/netip"
	"os"
	"slices"
	"sync"
	"time"

	"golang.org/x/sys/unix"

	"github.com/istio-cni-go/istio-cni/internal/zds"
)

// AnyUID, given to Nack, refuses every add.
const AnyUID = "*"

// readSize is what ztunnel reads of one packet; a longer one is a
// truncated message to it.
const readSize = 1024

// Config of a stand-in.
type Config struct {
	// Path of the agent's ZDS socket.
	Path string
	// Version sent in the hello; zero sends V1.
	Version zds.Version
	// Listeners binds ztunnel's listeners in each added pod (root only).
	Listeners bool
	// Reconnect redials, with back-off, whenever a connection ends or
	// cannot be made, as ztunnel does, except after a protocol error of
	// the kind that stops ztunnel's in-pod manager for good.
	Reconnect bool
	// The script from the start (before the first request can arrive);
	// see Nack, Stall and DropAt, which change it later.
	Nacks  map[string]string
	Stall  bool
	DropAt int
	Log    *slog.Logger
}

// Event is one request the stand-in received.
type Event struct {
	// Conn is which connection of this stand-in (from 1), Seq the
	// request's place on it (from 1).
	Conn, Seq int
	Req       zds.Request
	// FDs is how many descriptors came with it; Inode is the namespace's
	// inode for an add that carried one.
	FDs   int
	Inode uint64
	// Answered is false for a request stalled or dropped; Nack is the
	// refusal sent, empty for an ack.
	Answered bool
	Nack     string
	// NoOp: an add for a workload already running in the same namespace.
	NoOp bool
	// ProtocolError is set when the request broke the protocol.
	ProtocolError string
}

// Workload is a pod the stand-in runs a proxy for.
type Workload struct {
	UID   string
	Info  zds.WorkloadInfo
	Inode uint64
	// Listening lists the listeners bound in the pod, "tcp4 0.0.0.0:15001"
	// and the like; empty without Config.Listeners.
	Listening []string
}

// State is what the stand-in has seen, copied.
type State struct {
	// Connected: a connection is up and has said hello.
	Connected bool
	// Conns counts the connections made; Snapshots the snapshot_sent
	// received, one per connection at most.
	Conns, Snapshots int
	Events           []Event
	Workloads        map[string]Workload
	ProtocolErrors   []string
	// Stopped: a protocol error ended the stand-in, as it ends ztunnel's
	// in-pod manager (which then drains every proxy).
	Stopped bool
}

// Sim is a stand-in ztunnel.
type Sim struct {
	cfg Config
	log *slog.Logger

	mu      sync.Mutex
	changed chan struct{}
	st      State
	proxies map[string]*proxy
	nacks   map[string]string
	stall   bool
	// dropAt counts down to the request the connection is dropped on;
	// zero: never.
	dropAt int
	uc     *net.UnixConn
	closed bool

	stop chan struct{}
	done chan struct{}
}

// Start connects to the agent and serves the connection (and, with
// Reconnect, the next ones) until Close. Without Reconnect, a failure to
// connect is returned.
func Start(cfg Config) (*Sim, error) {
	if cfg.Version == 0 {
		cfg.Version = zds.V1
	}
	log := cfg.Log
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	nacks := map[string]string{}
	maps.Copy(nacks, cfg.Nacks)
	s := &Sim{cfg: cfg, log: log, changed: make(chan struct{}), proxies: map[string]*proxy{},
		nacks: nacks, stall: cfg.Stall, dropAt: cfg.DropAt, stop: make(chan struct{}), done: make(chan struct{}),
		st: State{Workloads: map[string]Workload{}}}
	var first *net.UnixConn
	if !cfg.Reconnect {
		uc, err := s.dial()
		if err != nil {
			return nil, err
		}
		first = uc
	}
	go s.run(first)
	return s, nil
}

func (s *Sim) dial() (*net.UnixConn, error) {
	uc, err := net.DialUnix("unixpacket", nil, &net.UnixAddr{Name: s.cfg.Path, Net: "unixpacket"})
	if err != nil {
		return nil, fmt.Errorf("ztunnelsim: connecting to %s: %w", s.cfg.Path, err)
	}
	return uc, nil
}

func (s *Sim) run(uc *net.UnixConn) {
	defer close(s.done)
	backoff := 5 * time.Millisecond
	for {
		if uc == nil {
			var err error
			if uc, err = s.dial(); err != nil {
				s.log.Debug("cannot connect; retrying", "error", err.Error(), "retry_in", backoff)
				if !s.pause(backoff) {
					return
				}
				backoff = min(2*backoff, 500*time.Millisecond)
				continue
			}
		}
		terminal := s.serve(uc)
		uc = nil
		if terminal || !s.cfg.Reconnect {
			return
		}
		backoff = 5 * time.Millisecond
		if !s.pause(backoff) {
			return
		}
	}
}

func (s *Sim) pause(d time.Duration) bool {
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-t.C:
		return true
	case <-s.stop:
		return false
	}
}

// Close disconnects, stops every proxy and waits for every goroutine.
func (s *Sim) Close() {
	s.mu.Lock()
	if !s.closed {
		s.closed = true
		close(s.stop)
		if s.uc != nil {
			_ = s.uc.Close()
		}
	}
	s.mu.Unlock()
	<-s.done
	s.mu.Lock()
	proxies := s.proxies
	s.proxies = map[string]*proxy{}
	s.mu.Unlock()
	for _, p := range proxies {
		p.close()
	}
	s.mu.Lock()
	s.st.Workloads = map[string]Workload{}
	s.notifyLocked()
	s.mu.Unlock()
}

// Disconnect closes the current connection, as a ztunnel that restarts
// does; with Reconnect the stand-in then connects again.
func (s *Sim) Disconnect() {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.uc != nil {
		_ = s.uc.Close()
	}
}

// Nack makes the stand-in refuse adds of uid (AnyUID: of every pod) with
// reason; an empty reason stops refusing them.
func (s *Sim) Nack(uid, reason string) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if reason == "" {
		delete(s.nacks, uid)
		return
	}
	s.nacks[uid] = reason
}

// Stall makes the stand-in read requests without answering them (on),
// as a hung ztunnel does, or answer again (off).
func (s *Sim) Stall(on bool) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.stall = on
}

// DropAt makes the stand-in close the connection on receiving the nth
// request from now (from 1), unanswered and unprocessed; once. Zero
// cancels it.
func (s *Sim) DropAt(n int) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.dropAt = n
}

// State returns a copy of what the stand-in has seen.
func (s *Sim) State() State {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.stateLocked()
}

func (s *Sim) stateLocked() State {
	st := s.st
	st.Events = slices.Clone(s.st.Events)
	st.ProtocolErrors = slices.Clone(s.st.ProtocolErrors)
	st.Workloads = maps.Clone(s.st.Workloads)
	return st
}

// Wait returns the state once cond holds for it, or ctx's error with the
// last state seen.
func (s *Sim) Wait(ctx context.Context, cond func(State) bool) (State, error) {
	for {
		s.mu.Lock()
		st := s.stateLocked()
		ch := s.changed
		s.mu.Unlock()
		if cond(st) {
			return st, nil
		}
		select {
		case <-ch:
		case <-ctx.Done():
			return st, fmt.Errorf("ztunnelsim: waiting: %w", ctx.Err())
		}
	}
}

// Dial connects to addr from inside the pod's network namespace, with
// ztunnel's socket mark, as ztunnel's own upstream connections go.
func (s *Sim) Dial(ctx context.Context, uid, network, addr string) (net.Conn, error) {
	p, err := s.proxy(uid)
	if err != nil {
		return nil, err
	}
	return p.dial(ctx, network, addr, netip.Addr{})
}

// DialFrom is Dial over TCP from src, an address the pod need not have
// (IP_TRANSPARENT), as ztunnel reaches an app on behalf of a client.
func (s *Sim) DialFrom(ctx context.Context, uid string, src netip.Addr, addr string) (net.Conn, error) {
	if !src.IsValid() {
		return nil, errors.New("ztunnelsim: DialFrom needs a source address")
	}
	p, err := s.proxy(uid)
	if err != nil {
		return nil, err
	}
	return p.dial(ctx, "tcp", addr, src)
}

func (s *Sim) proxy(uid string) (*proxy, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	p, ok := s.proxies[uid]
	if !ok {
		return nil, fmt.Errorf("ztunnelsim: no workload %s", uid)
	}
	return p, nil
}

func (s *Sim) notifyLocked() {
	close(s.changed)
	s.changed = make(chan struct{})
}

// session is one connection's protocol state, as ztunnel keeps it.
type session struct {
	conn, seq        int
	snapshotReceived bool
	// named are the uids the snapshot has named so far: after
	// snapshot_sent, every other workload is drained.
	named map[string]bool
}

// serve runs one connection; terminal says whether a protocol error
// should stop the stand-in.
func (s *Sim) serve(uc *net.UnixConn) (terminal bool) {
	defer uc.Close()
	s.mu.Lock()
	if s.closed {
		s.mu.Unlock()
		return true
	}
	s.uc = uc
	s.mu.Unlock()
	defer func() {
		s.mu.Lock()
		s.uc = nil
		s.st.Connected = false
		s.notifyLocked()
		s.mu.Unlock()
	}()

	if _, err := uc.Write(zds.Hello{Version: s.cfg.Version}.Marshal()); err != nil {
		s.log.Debug("sending hello failed", "error", err.Error())
		return false
	}
	s.mu.Lock()
	s.st.Conns++
	s.st.Connected = true
	ss := &session{conn: s.st.Conns, named: map[string]bool{}}
	s.notifyLocked()
	s.mu.Unlock()

	buf := make([]byte, readSize)
	// Room for more descriptors than allowed, so that "several" is seen
	// as such rather than as a truncation.
	oob := make([]byte, unix.CmsgSpace(8*4))
	for {
		n, oobn, flags, _, err := uc.ReadMsgUnix(buf, oob)
		if err != nil || (n == 0 && oobn == 0) {
			return false
		}
		ss.seq++
		ev := Event{Conn: ss.conn, Seq: ss.seq}
		fds, ferr := takeRights(oob[:oobn])
		ev.FDs = len(fds)
		req, perr := s.parse(buf[:n], flags, fds, ferr)
		ev.Req = req
		if perr != nil {
			// A message ztunnel cannot read: it answers with a refusal and
			// ends the connection, then connects again.
			closeAll(fds)
			s.violation(uc, &ev, perr.Error())
			return false
		}
		var netns *os.File
		if len(fds) == 1 {
			netns = os.NewFile(uintptr(fds[0]), "netns")
		}
		switch s.admit(ev) {
		case stalled:
			closeFile(netns)
			continue
		case dropped:
			closeFile(netns)
			return false
		}
		if stop := s.process(uc, ss, &ev, netns); stop {
			return true
		}
	}
}

// takeRights returns the descriptors passed with a message.
func takeRights(oob []byte) ([]int, error) {
	if len(oob) == 0 {
		return nil, nil
	}
	msgs, err := unix.ParseSocketControlMessage(oob)
	if err != nil {
		return nil, fmt.Errorf("bad control message: %w", err)
	}
	var fds []int
	for i := range msgs {
		got, err := unix.ParseUnixRights(&msgs[i])
		if err != nil {
			return fds, fmt.Errorf("unexpected control message (level %d, type %d)", msgs[i].Header.Level, msgs[i].Header.Type)
		}
		fds = append(fds, got...)
	}
	return fds, nil
}

// parse applies ztunnel's reading rules, in its order.
func (s *Sim) parse(b []byte, flags int, fds []int, ferr error) (zds.Request, error) {
	if ferr != nil {
		return zds.Request{}, ferr
	}
	if len(fds) > 1 {
		return zds.Request{}, fmt.Errorf("expected 1 descriptor, got %d", len(fds))
	}
	if flags&(unix.MSG_TRUNC|unix.MSG_CTRUNC) != 0 {
		return zds.Request{}, errors.New("received a truncated message")
	}
	req, err := zds.UnmarshalRequest(b)
	if err != nil {
		return req, err
	}
	switch {
	case req.Kind == zds.KindNone:
		return req, errors.New("request without a payload")
	case req.Kind == zds.KindAdd && len(fds) == 0:
		return req, errors.New("add without a network namespace descriptor")
	case req.Kind != zds.KindAdd && len(fds) > 0:
		return req, fmt.Errorf("a descriptor came with %s, which takes none", req.Kind)
	}
	return req, nil
}

type verdict int

const (
	processed verdict = iota
	stalled
	dropped
)

// admit applies the script: a stalled request, and the one the
// connection is dropped on, are recorded unanswered and not processed.
func (s *Sim) admit(ev Event) verdict {
	s.mu.Lock()
	defer s.mu.Unlock()
	v := processed
	switch {
	case s.dropAt == 1:
		v = dropped
	case s.stall:
		v = stalled
	}
	if s.dropAt > 0 {
		s.dropAt--
	}
	if v != processed {
		s.st.Events = append(s.st.Events, ev)
		s.notifyLocked()
	}
	return v
}

// process applies one valid request to the workloads and answers it; it
// returns true when a protocol error stops the stand-in.
func (s *Sim) process(uc *net.UnixConn, ss *session, ev *Event, netns *os.File) bool {
	req := ev.Req
	switch req.Kind {
	case zds.KindAdd:
		if req.Info == nil {
			closeFile(netns)
			return s.stopOn(uc, ev, "workload_info is required but not present")
		}
		if !ss.snapshotReceived {
			ss.named[req.UID] = true
		}
		s.add(ev, netns)
	case zds.KindKeep:
		if ss.snapshotReceived {
			return s.stopOn(uc, ev, "pod keep received after snapshot")
		}
		ss.named[req.UID] = true
	case zds.KindDel:
		if !ss.snapshotReceived {
			// Before the snapshot ends, a delete only unnames the pod; the
			// reconcile at snapshot_sent stops it.
			delete(ss.named, req.UID)
			break
		}
		s.remove(req.UID)
	case zds.KindSnapshotSent:
		if ss.snapshotReceived {
			return s.stopOn(uc, ev, "pod snapshot received already")
		}
		ss.snapshotReceived = true
		s.reconcile(ss.named)
	}
	s.answer(uc, ev)
	return false
}

// add starts (or keeps) the workload's proxy, setting ev's refusal when
// it cannot: a refusal, not a protocol error, as ztunnel answers a proxy
// it fails to start.
func (s *Sim) add(ev *Event, netns *os.File) {
	uid := ev.Req.UID
	s.mu.Lock()
	reason, nacked := s.nacks[uid]
	if !nacked {
		reason, nacked = s.nacks[AnyUID]
	}
	s.mu.Unlock()
	inode, err := netnsInode(int(netns.Fd()))
	ev.Inode = inode
	switch {
	case nacked:
		ev.Nack = reason
	case err != nil:
		ev.Nack = "failure to start proxy: " + err.Error()
	}
	if ev.Nack != "" {
		closeFile(netns)
		return
	}
	s.mu.Lock()
	old, exists := s.proxies[uid]
	s.mu.Unlock()
	if exists && old.inode == inode {
		ev.NoOp = true
		closeFile(netns)
		return
	}
	if exists {
		// A new namespace for the same pod (its sandbox was recreated):
		// the old proxy goes first, or its listeners' ports stay taken.
		s.remove(uid)
	}
	p, err := startProxy(netns, inode, s.cfg.Listeners)
	if err != nil {
		ev.Nack = "failure to start proxy: " + err.Error()
		return
	}
	s.mu.Lock()
	s.proxies[uid] = p
	s.st.Workloads[uid] = Workload{UID: uid, Info: *ev.Req.Info, Inode: inode, Listening: slices.Clone(p.listening)}
	s.notifyLocked()
	s.mu.Unlock()
}

func (s *Sim) remove(uid string) {
	s.mu.Lock()
	p := s.proxies[uid]
	delete(s.proxies, uid)
	s.mu.Unlock()
	// Closed before the state says so: whoever waits for the workload to
	// go finds its listeners gone.
	if p != nil {
		p.close()
	}
	s.mu.Lock()
	delete(s.st.Workloads, uid)
	s.notifyLocked()
	s.mu.Unlock()
}

func (s *Sim) reconcile(named map[string]bool) {
	s.mu.Lock()
	var gone []string
	for uid := range s.proxies {
		if !named[uid] {
			gone = append(gone, uid)
		}
	}
	s.mu.Unlock()
	for _, uid := range gone {
		s.remove(uid)
	}
}

// answer records the request, then answers it: recorded first, so that
// an agent that has its answer finds the request in the state.
func (s *Sim) answer(uc *net.UnixConn, ev *Event) {
	ev.Answered = true
	s.mu.Lock()
	s.st.Events = append(s.st.Events, *ev)
	if ev.Req.Kind == zds.KindSnapshotSent && ev.ProtocolError == "" {
		// Counted with its event, so a waiter that sees the count sees
		// the event too.
		s.st.Snapshots++
	}
	s.notifyLocked()
	s.mu.Unlock()
	b, err := zds.Response{Ack: &zds.Ack{Error: ev.Nack}}.Marshal()
	if err == nil {
		_, err = uc.Write(b)
	}
	if err != nil {
		s.log.Debug("answering failed", "error", err.Error())
	}
}

// violation records a protocol error and refuses the request; the caller
// then ends the connection.
func (s *Sim) violation(uc *net.UnixConn, ev *Event, msg string) {
	ev.ProtocolError = msg
	ev.Nack = "failure to process message: " + msg
	s.mu.Lock()
	s.st.ProtocolErrors = append(s.st.ProtocolErrors, msg)
	s.mu.Unlock()
	s.answer(uc, ev)
}

// stopOn records a protocol error after which ztunnel's in-pod manager
// stops for good: every proxy is drained.
func (s *Sim) stopOn(uc *net.UnixConn, ev *Event, msg string) bool {
	s.reconcile(nil)
	s.mu.Lock()
	s.st.Stopped = true
	s.mu.Unlock()
	s.violation(uc, ev, msg)
	return true
}

func closeAll(fds []int) {
	for _, fd := range fds {
		_ = unix.Close(fd)
	}
}

func closeFile(f *os.File) {
	if f != nil {
		_ = f.Close()
	}
}
