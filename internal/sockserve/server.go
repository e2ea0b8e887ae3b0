// Package sockserve is what the agent's Unix sockets share: listening
// with mode 0600 and a peer check, connection limits with eviction of
// silent clients, accept retries that survive descriptor exhaustion, and
// serving HTTP on a socket or a TCP port until a context ends, with a
// channel that says when the server has stopped.
//
// It knows nothing of what is served: the CNI commands, the pod cache and
// the plugin's log lines each live in a package of their own.
package sockserve

import (
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"os"
	"path/filepath"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"golang.org/x/sys/unix"

	"github.com/istio-cni-go/istio-cni/internal/sockpath"
)

// Metrics count what the agent's sockets refuse and fail at.
type Metrics struct {
	Rejected     *prometheus.CounterVec
	AcceptErrors *prometheus.CounterVec
}

// NewMetrics returns unregistered socket metrics.
func NewMetrics() *Metrics {
	return &Metrics{
		Rejected: prometheus.NewCounterVec(prometheus.CounterOpts{Name: "istio_cni_socket_connections_rejected_total",
			Help: "Connections to the agent's sockets closed without being served, by socket and reason: peer (not root nor the agent's user), " +
				"limit (too many open and none idle), evicted (an idle one closed to make room), timeout (no complete request in time), " +
				"exhausted (closed at once while the agent had no file descriptor to spare)."},
			[]string{"socket", "reason"}),
		AcceptErrors: prometheus.NewCounterVec(prometheus.CounterOpts{Name: "istio_cni_socket_accept_errors_total",
			Help: "Errors accepting connections on the agent's sockets (each retried with back-off)."}, []string{"socket"}),
	}
}

// Limits of one socket.
type Limits struct {
	// MaxConns bounds the connections open at once.
	MaxConns int
	// ReadTimeout bounds the wait for a complete request.
	ReadTimeout time.Duration
}

// Server is one of the agent's Unix sockets. Every socket is mode
// 0600 and, besides, serves only peers whose uid is root or the agent's:
// a mode can be loosened by a runtime's umask or an operator, the peer
// check cannot. A bad client costs its own connection and never the
// server: a silent one is evicted when room is needed or timed out, accept
// errors are retried with back-off (and reported through Health), and
// while the process has no descriptor to spare, pending clients get their
// connection closed at once so a relay runs the fallback instead of
// waiting for its deadline.
type Server struct {
	name    string
	path    string
	log     *slog.Logger
	metrics *Metrics
	limits  Limits
	l       *net.UnixListener
	// keeper puts the path back when another process unlinks it, and on
	// stop removes it only while it is still ours, not a newer agent's.
	keeper *sockpath.Keeper

	mu      sync.Mutex
	conns   map[*Conn]struct{}
	stopped bool
	// reserve holds one descriptor to give up when the process has none
	// left: /dev/null at first, then a shut-down connection.
	reserve  io.Closer
	failErr  error
	failFrom time.Time
	// lastReject rate-limits the log lines about refused peers.
	lastReject time.Time
	suppressed int
}

// Conn is an admitted connection; it frees its slot when closed.
type Conn struct {
	*net.UnixConn
	s        *Server
	accepted time.Time
	// busy: a request is being served, so the connection is not evicted.
	busy atomic.Bool
	once sync.Once
}

// SetBusy marks a request as being served (true) or the connection as
// idle again: a busy connection is never evicted to make room.
func (c *Conn) SetBusy(busy bool) { c.busy.Store(busy) }

// Claim marks the connection busy once its request has been read, unless
// it was evicted first (false): between the read and SetBusy it would
// look silent, and its client, closed on, has turned elsewhere (a relay
// runs the fallback), so its request must not be served as well.
func (c *Conn) Claim() bool {
	c.s.mu.Lock()
	defer c.s.mu.Unlock()
	if _, ok := c.s.conns[c]; !ok {
		return false
	}
	c.busy.Store(true)
	return true
}

// TimedOut counts the connection as closed for not sending its request
// in time.
func (c *Conn) TimedOut() { c.s.TimedOut() }

func (c *Conn) Close() error {
	c.once.Do(func() {
		c.s.mu.Lock()
		delete(c.s.conns, c)
		c.s.mu.Unlock()
	})
	return c.UnixConn.Close()
}

// listenSocket listens on path, replacing a socket a previous agent left
// there. The socket is made under a temporary name, given its mode, and
// only then renamed into place, so there is no instant at which the
// umask's mode lets anyone else connect.
func listenSocket(path string, mode os.FileMode) (*net.UnixListener, [2]uint64, error) {
	tmp := filepath.Join(filepath.Dir(path), "."+filepath.Base(path)+".new")
	if err := os.Remove(tmp); err != nil && !errors.Is(err, os.ErrNotExist) {
		return nil, [2]uint64{}, err
	}
	l, err := net.ListenUnix("unix", &net.UnixAddr{Name: tmp, Net: "unix"})
	if err != nil {
		return nil, [2]uint64{}, err
	}
	l.SetUnlinkOnClose(false)
	fail := func(err error) (*net.UnixListener, [2]uint64, error) {
		_ = l.Close()
		_ = os.Remove(tmp)
		return nil, [2]uint64{}, err
	}
	if err := os.Chmod(tmp, mode); err != nil {
		return fail(err)
	}
	if err := os.Rename(tmp, path); err != nil {
		return fail(err)
	}
	id, err := sockpath.Identity(path)
	if err != nil {
		return fail(err)
	}
	return l, id, nil
}

func Listen(path string, limits Limits, log *slog.Logger, m *Metrics) (*Server, error) {
	l, id, err := listenSocket(path, 0o600)
	if err != nil {
		return nil, err
	}
	k, err := sockpath.Keep(path, id, 0, log)
	if err != nil {
		_ = l.Close()
		sockpath.RemoveIfSame(path, id)
		return nil, err
	}
	s := &Server{name: filepath.Base(path), path: path, log: log, metrics: m, limits: limits, l: l, keeper: k,
		conns: map[*Conn]struct{}{}}
	if f, err := os.Open(os.DevNull); err == nil {
		s.reserve = f
	}
	return s, nil
}

// exhausted: the process or the system is out of descriptors or memory.
func exhausted(err error) bool {
	return errors.Is(err, syscall.EMFILE) || errors.Is(err, syscall.ENFILE) ||
		errors.Is(err, syscall.ENOBUFS) || errors.Is(err, syscall.ENOMEM)
}

// Accept returns the next connection to serve. It retries accept errors
// with back-off rather than returning them, so neither the CNI server nor
// an HTTP server on the socket stops on one; it returns an error only
// once the socket is stopped.
func (s *Server) Accept() (net.Conn, error) {
	backoff := time.Duration(0)
	for {
		c, err := s.l.AcceptUnix()
		if err != nil {
			if s.isStopped() || errors.Is(err, net.ErrClosed) {
				return nil, net.ErrClosed
			}
			s.acceptFailed(err)
			backoff = min(max(2*backoff, 5*time.Millisecond), time.Second)
			time.Sleep(backoff) // back-off between retries of a failing accept
			continue
		}
		backoff = 0
		s.acceptOK()
		if err := checkPeer(c); err != nil {
			s.reject(c, "peer", err)
			continue
		}
		if sc := s.admit(c); sc != nil {
			return sc, nil
		}
	}
}

func (s *Server) isStopped() bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.stopped
}

func (s *Server) acceptFailed(err error) {
	if s.metrics != nil {
		s.metrics.AcceptErrors.WithLabelValues(s.name).Inc()
	}
	if !exhausted(err) {
		// A connection that went away before it was accepted, and the
		// like: the socket itself is fine.
		s.log.Debug("accept failed; retrying", "socket", s.name, "error", err.Error())
		return
	}
	s.mu.Lock()
	first := s.failFrom.IsZero()
	if first {
		s.failFrom = time.Now()
	}
	s.failErr = err
	s.mu.Unlock()
	if first {
		s.log.Error("cannot accept connections; retrying, and closing pending ones so relays run the fallback", "socket", s.name, "error", err.Error())
	}
	s.shed()
}

func (s *Server) acceptOK() {
	s.mu.Lock()
	recovered := !s.failFrom.IsZero()
	s.failFrom, s.failErr = time.Time{}, nil
	s.mu.Unlock()
	if recovered {
		s.log.Info("accepting connections again", "socket", s.name)
	}
}

// shed gives up the reserve descriptor for a moment to accept one pending
// connection and end it: its client learns at once that nobody serves it,
// instead of waiting for its deadline. The connection, shut down, becomes
// the next reserve, so the slot just freed is never lost to another
// thread of the process.
func (s *Server) shed() {
	s.mu.Lock()
	r := s.reserve
	s.reserve = nil
	s.mu.Unlock()
	if r == nil {
		if f, err := os.Open(os.DevNull); err == nil {
			s.setReserve(f)
		}
		return
	}
	_ = r.Close()
	_ = s.l.SetDeadline(time.Now().Add(10 * time.Millisecond))
	c, err := s.l.AcceptUnix()
	_ = s.l.SetDeadline(time.Time{})
	if err != nil {
		if f, err := os.Open(os.DevNull); err == nil {
			s.setReserve(f)
		}
		return
	}
	if s.metrics != nil {
		s.metrics.Rejected.WithLabelValues(s.name, "exhausted").Inc()
	}
	// Shut down, not closed: the client sees the end, the descriptor stays.
	if raw, err := c.SyscallConn(); err == nil {
		_ = raw.Control(func(fd uintptr) { _ = unix.Shutdown(int(fd), unix.SHUT_RDWR) })
	}
	s.setReserve(c)
}

func (s *Server) setReserve(f io.Closer) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.stopped || s.reserve != nil {
		_ = f.Close()
		return
	}
	s.reserve = f
}

func (s *Server) reject(c *net.UnixConn, reason string, err error) {
	_ = c.Close()
	if s.metrics != nil {
		s.metrics.Rejected.WithLabelValues(s.name, reason).Inc()
	}
	// Anyone who can reach the socket can make these happen: one line,
	// then at most one every ten seconds, saying how many were not logged.
	s.mu.Lock()
	now := time.Now()
	if now.Sub(s.lastReject) < 10*time.Second {
		s.suppressed++
		s.mu.Unlock()
		return
	}
	n := s.suppressed
	s.lastReject, s.suppressed = now, 0
	s.mu.Unlock()
	s.log.Warn("connection refused", "socket", s.name, "reason", reason, "error", err.Error(), "notLoggedSinceLast", n)
}

// admit makes room for c: past the limit the oldest connection that has
// not sent a complete request is evicted, so silent clients cannot keep
// working ones out; when every connection is busy, c is refused. A
// connection whose request is there but not yet read is not silent: a
// process short of CPU accepts a queue of them at once (the fallback's
// log lines, posted without waiting, behind an agent starved on a busy
// node).
func (s *Server) admit(c *net.UnixConn) *Conn {
	sc := &Conn{UnixConn: c, s: s, accepted: time.Now()}
	s.mu.Lock()
	var victim *Conn
	if len(s.conns) >= s.limits.MaxConns {
		for o := range s.conns {
			if !o.busy.Load() && (victim == nil || o.accepted.Before(victim.accepted)) && !unread(o.UnixConn) {
				victim = o
			}
		}
		if victim == nil {
			s.mu.Unlock()
			s.reject(c, "limit", fmt.Errorf("%d connections open, all busy", s.limits.MaxConns))
			return nil
		}
		delete(s.conns, victim)
	}
	s.conns[sc] = struct{}{}
	s.mu.Unlock()
	if victim != nil {
		_ = victim.UnixConn.Close()
		if s.metrics != nil {
			s.metrics.Rejected.WithLabelValues(s.name, "evicted").Inc()
		}
	}
	return sc
}

// unread says bytes have arrived on c that nobody has read yet.
func unread(c *net.UnixConn) bool {
	rc, err := c.SyscallConn()
	if err != nil {
		return false
	}
	n := 0
	_ = rc.Control(func(fd uintptr) { n, _ = unix.IoctlGetInt(int(fd), unix.SIOCINQ) })
	return n > 0
}

// TimedOut counts a connection closed for not sending its request in time.
func (s *Server) TimedOut() {
	if s.metrics != nil {
		s.metrics.Rejected.WithLabelValues(s.name, "timeout").Inc()
	}
}

// Close stops the socket: the path goes first (while it is still ours),
// so no client connects to a closing server; then the listener closes.
func (s *Server) Close() error {
	s.mu.Lock()
	if s.stopped {
		s.mu.Unlock()
		return nil
	}
	s.stopped = true
	r := s.reserve
	s.reserve = nil
	s.mu.Unlock()
	s.keeper.Close()
	if r != nil {
		_ = r.Close()
	}
	return s.l.Close()
}

// Displaced says whether another process's socket took this one's path
// (a newer agent's), now or at any check since the start: the node is
// that agent's to keep.
func (s *Server) Displaced() bool { return s.keeper.Displaced() }

// CloseConns closes every open connection.
func (s *Server) CloseConns() {
	s.mu.Lock()
	conns := make([]*Conn, 0, len(s.conns))
	for c := range s.conns {
		conns = append(conns, c)
	}
	s.mu.Unlock()
	for _, c := range conns {
		_ = c.Close()
	}
}

// Addr implements net.Listener.
func (s *Server) Addr() net.Addr { return &net.UnixAddr{Name: s.path, Net: "unix"} }

// Health is nil while the socket accepts, else why it cannot and since
// when. Running out of descriptors ends when one can be had again, even
// before the next client connects.
func (s *Server) Health() (time.Time, error) {
	if why, since := s.keeper.Orphaned(); why != "" {
		return since, errors.New(why + " (a restart binds it again)")
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.failFrom.IsZero() {
		return time.Time{}, nil
	}
	if f, err := os.Open(os.DevNull); err == nil {
		_ = f.Close()
		s.failFrom, s.failErr = time.Time{}, nil
		return time.Time{}, nil
	}
	return s.failFrom, fmt.Errorf("%s cannot accept connections since %s: %w", s.name, s.failFrom.UTC().Format(time.RFC3339), s.failErr)
}

// checkPeer lets root and the agent's own user in.
func checkPeer(conn *net.UnixConn) error {
	raw, err := conn.SyscallConn()
	if err != nil {
		return err
	}
	var cred *unix.Ucred
	var credErr error
	if err := raw.Control(func(fd uintptr) {
		cred, credErr = unix.GetsockoptUcred(int(fd), unix.SOL_SOCKET, unix.SO_PEERCRED)
	}); err != nil {
		return err
	}
	if credErr != nil {
		return fmt.Errorf("reading peer credentials: %w", credErr)
	}
	if cred.Uid != 0 && int(cred.Uid) != os.Getuid() {
		return fmt.Errorf("peer uid %d (pid %d) is neither root nor the agent's user", cred.Uid, cred.Pid)
	}
	return nil
}
