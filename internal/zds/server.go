package zds

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"os"
	"path/filepath"
	"sync"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"golang.org/x/sys/unix"

	"github.com/istio-cni-go/istio-cni/internal/sockpath"
)

const (
	// DefaultAckTimeout bounds each exchange with ztunnel (hello, and each
	// request's answer), as the reference's few seconds do.
	DefaultAckTimeout = 5 * time.Second
	// DefaultAcceptInterval spaces accepts as the reference does (five a
	// second): a ztunnel reconnecting in a loop must not cost the agent
	// its memory.
	DefaultAcceptInterval = 200 * time.Millisecond
	// maxResponseSize is generous: a nack's text is ztunnel's error
	// chain, and a cut one would be a protocol error for nothing.
	maxResponseSize = 64 << 10
)

// ErrNotConnected is AddWorkload's answer when no ztunnel is connected.
var ErrNotConnected = errors.New("no ztunnel connection")

// NackError is ztunnel's refusal of a request, with its text.
type NackError struct {
	Kind   Kind
	UID    string
	Reason string
}

func (e *NackError) Error() string {
	return fmt.Sprintf("ztunnel refused %s of workload %s: %s", e.Kind, e.UID, e.Reason)
}

// Pod is an enrolled pod as the snapshot and AddWorkload hand it to
// ztunnel.
type Pod struct {
	UID  string
	Info WorkloadInfo
	// Netns is the pod's network namespace, sent with the add. In a
	// snapshot, nil means the agent does not hold it (after a restart,
	// say): ztunnel is told to keep the pod as it is. The server never
	// closes it; the caller keeps it open until the call returns.
	Netns *os.File
}

// Snapshotter lists the enrolled pods a new ztunnel connection is told
// about, in the order they are sent.
type Snapshotter interface {
	Snapshot() []Pod
}

// SnapshotObserver, when the Snapshotter implements it, hears of each
// pod a new connection's ztunnel acknowledged or refused in its snapshot
// (with the namespace handed over, nil for a keep), then of the
// snapshot's end: what was acknowledged there need not be sent again,
// and what was refused must be, whatever an earlier ztunnel said of it.
type SnapshotObserver interface {
	SnapshotAcked(uid string, netns *os.File)
	SnapshotRefused(uid string, netns *os.File)
	SnapshotDone()
}

// SnapshotFunc makes a function a Snapshotter.
type SnapshotFunc func() []Pod

func (f SnapshotFunc) Snapshot() []Pod { return f() }

// Config of a Server.
type Config struct {
	// Path of the socket (ZTUNNEL_UDS_ADDRESS); its directory is created.
	Path        string
	Snapshotter Snapshotter
	// AckTimeout bounds the hello's arrival and each request's answer;
	// zero means DefaultAckTimeout. A connection that misses it is closed:
	// a late answer could otherwise be taken for the next request's.
	AckTimeout time.Duration
	// AcceptInterval is the least time between two accepts; zero means
	// DefaultAcceptInterval.
	AcceptInterval time.Duration
	// Registerer receives the server's metrics; nil leaves them
	// unregistered.
	Registerer prometheus.Registerer
	Log        *slog.Logger
	// Listener, when set, is the socket bound ahead (Listen), which the
	// server takes over; else New binds Path itself.
	Listener *Listener
}

// Server is the agent's ZDS socket. Each ztunnel connection is served by
// one goroutine that owns its writes, so requests on a connection go one
// at a time, each answered before the next (the protocol matches answers
// to requests by order alone), and a second goroutine that reads, so a
// ztunnel that goes away is noticed at once even when nothing is sent.
type Server struct {
	cfg     Config
	log     *slog.Logger
	l       *Listener
	metrics metrics

	mu sync.Mutex
	// conns are the connections that have said hello, oldest first.
	conns []*conn
	// open is every connection, said hello or not, for Close.
	open    map[*conn]struct{}
	changed chan struct{}
	closed  bool
	nextID  uint64

	stop chan struct{}
	wg   sync.WaitGroup
}

type conn struct {
	id   uint64
	uc   *net.UnixConn
	log  *slog.Logger
	reqs chan *call
	// frames carries what the reader got, one packet (or its error) at a time.
	frames chan frame
	// done is closed once the connection is closed and deregistered.
	done chan struct{}
}

type frame struct {
	b   []byte
	err error
}

type call struct {
	req    Request
	data   []byte
	netns  *os.File
	result chan callResult
}

type callResult struct {
	nack string
	err  error
}

type metrics struct {
	connected prometheus.Gauge
	addTime   prometheus.Histogram
}

func newMetrics(reg prometheus.Registerer) (metrics, error) {
	m := metrics{
		// The reference's name and meaning: the number of connections,
		// 1 when ztunnel is up, 2 while a new ztunnel replaces the old.
		connected: prometheus.NewGauge(prometheus.GaugeOpts{Name: "ztunnel_connected",
			Help: "Number of ztunnel connections to the node agent (0: pods cannot be enrolled)."}),
		addTime: prometheus.NewHistogram(prometheus.HistogramOpts{Name: "istio_cni_ztunnel_add_duration_seconds",
			Help:    "Time from sending a pod to ztunnel to its answer (ack or refusal), including the snapshot's adds.",
			Buckets: []float64{.001, .0025, .005, .01, .025, .05, .1, .25, .5, 1, 2.5, 5}}),
	}
	if reg == nil {
		return m, nil
	}
	var err error
	if m.connected, err = register(reg, m.connected); err != nil {
		return m, err
	}
	m.addTime, err = register(reg, m.addTime)
	return m, err
}

// register registers c, or returns the collector a previous server of
// the same process registered, so that a restarted server keeps counting.
func register[C prometheus.Collector](reg prometheus.Registerer, c C) (C, error) {
	err := reg.Register(c)
	var are prometheus.AlreadyRegisteredError
	if errors.As(err, &are) {
		if existing, ok := are.ExistingCollector.(C); ok {
			return existing, nil
		}
	}
	return c, err
}

// New listens on cfg.Path and serves ztunnel connections until Close.
func New(cfg Config) (*Server, error) {
	if cfg.Path == "" {
		return nil, errors.New("zds: no socket path")
	}
	if cfg.Snapshotter == nil {
		return nil, errors.New("zds: no snapshotter")
	}
	if cfg.AckTimeout <= 0 {
		cfg.AckTimeout = DefaultAckTimeout
	}
	if cfg.AcceptInterval <= 0 {
		cfg.AcceptInterval = DefaultAcceptInterval
	}
	log := cfg.Log
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	m, err := newMetrics(cfg.Registerer)
	if err != nil {
		return nil, fmt.Errorf("zds: registering metrics: %w", err)
	}
	l := cfg.Listener
	if l == nil {
		if l, err = Listen(cfg.Path, log); err != nil {
			return nil, err
		}
	}
	s := &Server{cfg: cfg, log: log, l: l, metrics: m, open: map[*conn]struct{}{},
		changed: make(chan struct{}), stop: make(chan struct{})}
	s.metrics.connected.Set(0)
	s.wg.Add(1)
	go s.acceptLoop()
	return s, nil
}

// listen makes the socket under a temporary name, gives it mode 0600
// and only then renames it into place: no instant exists at which the
// umask's mode lets anyone else connect, and a stale socket of a previous
// agent is replaced in one step.
func listen(path string) (*net.UnixListener, [2]uint64, error) {
	dir := filepath.Dir(path)
	// ztunnel, the only other user of the directory, runs as root.
	if err := os.MkdirAll(dir, 0o750); err != nil {
		return nil, [2]uint64{}, fmt.Errorf("zds: creating the socket's directory: %w", err)
	}
	tmp := filepath.Join(dir, "."+filepath.Base(path)+".new")
	if err := os.Remove(tmp); err != nil && !errors.Is(err, os.ErrNotExist) {
		return nil, [2]uint64{}, fmt.Errorf("zds: removing a leftover temporary socket: %w", err)
	}
	l, err := net.ListenUnix("unixpacket", &net.UnixAddr{Name: tmp, Net: "unixpacket"})
	if err != nil {
		return nil, [2]uint64{}, fmt.Errorf("zds: listening: %w", err)
	}
	l.SetUnlinkOnClose(false)
	fail := func(what string, err error) (*net.UnixListener, [2]uint64, error) {
		_ = l.Close()
		_ = os.Remove(tmp)
		return nil, [2]uint64{}, fmt.Errorf("zds: %s: %w", what, err)
	}
	if err := os.Chmod(tmp, 0o600); err != nil {
		return fail("setting the socket's mode", err)
	}
	if err := os.Rename(tmp, path); err != nil {
		return fail("putting the socket in place", err)
	}
	id, err := sockpath.Identity(path)
	if err != nil {
		return fail("reading the socket's identity", err)
	}
	return l, id, nil
}

// Listener is the ztunnel socket, bound. The agent binds it before its
// informers sync and serves it after: ztunnel, which redials with a
// back-off growing to 15 s, gets its connection into the backlog at its
// first try after the old agent went, and its hello waits there until the
// agent can send a complete snapshot.
type Listener struct {
	l      *net.UnixListener
	keeper *sockpath.Keeper
}

// Listen binds the ztunnel socket at path, mode 0600, replacing a socket a
// previous agent left there, and keeps the path while it lives
// (sockpath).
func Listen(path string, log *slog.Logger) (*Listener, error) {
	if path == "" {
		return nil, errors.New("zds: no socket path")
	}
	l, id, err := listen(path)
	if err != nil {
		return nil, err
	}
	k, err := sockpath.Keep(path, id, 0, log)
	if err != nil {
		_ = l.Close()
		sockpath.RemoveIfSame(path, id)
		return nil, fmt.Errorf("zds: %w", err)
	}
	return &Listener{l: l, keeper: k}, nil
}

// Close removes the path while it is ours, then closes the socket: the
// connections ztunnel made meanwhile end, and it redials.
func (l *Listener) Close() error {
	l.keeper.Close()
	return l.l.Close()
}

// Close stops accepting, closes every connection, waits for every
// goroutine, and removes the socket while it is still this server's (not
// a newer agent's that replaced it).
func (s *Server) Close() error {
	s.mu.Lock()
	if s.closed {
		s.mu.Unlock()
		return nil
	}
	s.closed = true
	close(s.stop)
	for c := range s.open {
		_ = c.uc.Close()
	}
	s.mu.Unlock()
	err := s.l.Close()
	s.wg.Wait()
	return err
}

// Health is nil while ztunnel can reach the socket by its path, else why
// not and since when (see sockpath.Keeper.Orphaned).
func (s *Server) Health() (time.Time, error) {
	if why, since := s.l.keeper.Orphaned(); why != "" {
		return since, errors.New(why + " (a restart binds it again)")
	}
	return time.Time{}, nil
}

// Connections returns how many ztunnels are connected (said hello), and
// a channel closed at the next change of that number: the agent retries
// its pending pods when it rises.
func (s *Server) Connections() (int, <-chan struct{}) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return len(s.conns), s.changed
}

// Connected says whether a ztunnel is connected.
func (s *Server) Connected() bool {
	n, _ := s.Connections()
	return n > 0
}

// WaitConnected returns once a ztunnel is connected, or ctx's error.
func (s *Server) WaitConnected(ctx context.Context) error {
	for {
		n, changed := s.Connections()
		if n > 0 {
			return nil
		}
		select {
		case <-changed:
		case <-ctx.Done():
			return fmt.Errorf("waiting for ztunnel to connect: %w", ctx.Err())
		}
	}
}

// AddWorkload hands the pod to the newest ztunnel connection and waits
// for its answer: nil for an ack, a *NackError for a refusal,
// ErrNotConnected with no ztunnel, another error when the connection
// failed (it is then closed). The add itself cannot be cancelled once
// sent; ctx ending only stops the wait.
func (s *Server) AddWorkload(ctx context.Context, p Pod) error {
	if p.Netns == nil {
		return fmt.Errorf("zds: add of workload %s without its network namespace", p.UID)
	}
	info := p.Info
	req := Request{Kind: KindAdd, UID: p.UID, Info: &info}
	data, err := encode(req)
	if err != nil {
		return err
	}
	for {
		c := s.newest()
		if c == nil {
			return ErrNotConnected
		}
		res, sent := c.do(ctx, &call{req: req, data: data, netns: p.Netns})
		if !sent && res.err == nil {
			// The connection went away before taking the add: nothing
			// was sent, so the next newest one may take it.
			continue
		}
		return res.asError(req)
	}
}

// DelWorkload tells every connected ztunnel that the pod is gone: an
// older ztunnel still draining must not keep a proxy for it either. With
// none connected it does nothing, since the next connection's snapshot
// will not name the pod.
func (s *Server) DelWorkload(ctx context.Context, uid string) error {
	req := Request{Kind: KindDel, UID: uid}
	data, err := encode(req)
	if err != nil {
		return err
	}
	s.mu.Lock()
	conns := append([]*conn(nil), s.conns...)
	s.mu.Unlock()
	var errs []error
	for _, c := range conns {
		res, _ := c.do(ctx, &call{req: req, data: data})
		if err := res.asError(req); err != nil {
			errs = append(errs, fmt.Errorf("ztunnel connection %d: %w", c.id, err))
		}
	}
	return errors.Join(errs...)
}

func encode(req Request) ([]byte, error) {
	data, err := req.Marshal()
	if err != nil {
		return nil, err
	}
	if len(data) > MaxRequestSize {
		return nil, fmt.Errorf("zds: %s of workload %s is %d bytes, more than the %d ztunnel reads", req.Kind, req.UID, len(data), MaxRequestSize)
	}
	return data, nil
}

func (r callResult) asError(req Request) error {
	if r.err != nil {
		return r.err
	}
	if r.nack != "" {
		return &NackError{Kind: req.Kind, UID: req.UID, Reason: r.nack}
	}
	return nil
}

func (s *Server) newest() *conn {
	s.mu.Lock()
	defer s.mu.Unlock()
	if len(s.conns) == 0 {
		return nil
	}
	return s.conns[len(s.conns)-1]
}

// do queues cl on the connection and waits for its result. sent is false
// when the connection closed before taking it (result empty then) or ctx
// ended first.
func (c *conn) do(ctx context.Context, cl *call) (res callResult, sent bool) {
	cl.result = make(chan callResult, 1)
	select {
	case c.reqs <- cl:
	case <-c.done:
		return callResult{}, false
	case <-ctx.Done():
		return callResult{err: fmt.Errorf("waiting for ztunnel connection %d to take the %s: %w", c.id, cl.req.Kind, ctx.Err())}, false
	}
	select {
	case res := <-cl.result:
		return res, true
	case <-ctx.Done():
		return callResult{err: fmt.Errorf("waiting for ztunnel's answer to the %s: %w", cl.req.Kind, ctx.Err())}, true
	}
}

func (s *Server) acceptLoop() {
	defer s.wg.Done()
	backoff := time.Duration(0)
	for {
		uc, err := s.l.l.AcceptUnix()
		if err != nil {
			if s.stopping() {
				return
			}
			backoff = min(max(2*backoff, 5*time.Millisecond), time.Second)
			s.log.Warn("accepting a ztunnel connection failed; retrying", "error", err.Error(), "retry_in", backoff)
			if !s.pause(backoff) {
				return
			}
			continue
		}
		backoff = 0
		if err := checkPeer(uc); err != nil {
			s.log.Warn("refused a connection on the ztunnel socket", "error", err.Error())
			_ = uc.Close()
		} else {
			s.start(uc)
		}
		if !s.pause(s.cfg.AcceptInterval) {
			return
		}
	}
}

// pause waits d; false when the server is stopping.
func (s *Server) pause(d time.Duration) bool {
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-t.C:
		return true
	case <-s.stop:
		return false
	}
}

func (s *Server) stopping() bool {
	select {
	case <-s.stop:
		return true
	default:
		return false
	}
}

// checkPeer admits root (ztunnel runs as root) and the agent's own user:
// a socket's mode can be loosened by an operator, its peer's uid cannot.
func checkPeer(uc *net.UnixConn) error {
	rc, err := uc.SyscallConn()
	if err != nil {
		return err
	}
	var cred *unix.Ucred
	var cerr error
	if err := rc.Control(func(fd uintptr) { cred, cerr = unix.GetsockoptUcred(int(fd), unix.SOL_SOCKET, unix.SO_PEERCRED) }); err != nil {
		return err
	}
	if cerr != nil {
		return fmt.Errorf("reading the peer's credentials: %w", cerr)
	}
	if cred.Uid != 0 && int(cred.Uid) != os.Geteuid() {
		return fmt.Errorf("peer pid %d runs as uid %d, neither root nor the agent's", cred.Pid, cred.Uid)
	}
	return nil
}

func (s *Server) start(uc *net.UnixConn) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.closed {
		_ = uc.Close()
		return
	}
	s.nextID++
	c := &conn{id: s.nextID, uc: uc, log: s.log.With("ztunnel_conn", s.nextID),
		reqs: make(chan *call), frames: make(chan frame), done: make(chan struct{})}
	s.open[c] = struct{}{}
	s.wg.Add(2)
	go s.read(c)
	go s.serve(c)
}

// read passes each packet ztunnel sends to serve, until an error (EOF
// included) or the connection's end.
func (s *Server) read(c *conn) {
	defer s.wg.Done()
	buf := make([]byte, maxResponseSize)
	oob := make([]byte, unix.CmsgSpace(8*4))
	for {
		n, oobn, flags, _, err := c.uc.ReadMsgUnix(buf, oob)
		f := frame{err: err}
		if err == nil {
			f = checkFrame(buf[:n], oob[:oobn], flags)
		}
		select {
		case c.frames <- f:
		case <-c.done:
			return
		}
		if f.err != nil {
			return
		}
	}
}

func checkFrame(b, oob []byte, flags int) frame {
	if len(oob) > 0 {
		closeRights(oob)
		return frame{err: errors.New("ztunnel sent ancillary data (file descriptors), which it never should")}
	}
	if len(b) == 0 {
		// A zero-length read on a packet socket is its end.
		return frame{err: errEOF}
	}
	if flags&unix.MSG_TRUNC != 0 {
		return frame{err: fmt.Errorf("ztunnel sent a message longer than %d bytes", maxResponseSize)}
	}
	return frame{b: append([]byte(nil), b...)}
}

var errEOF = errors.New("ztunnel closed the connection")

// closeRights closes the descriptors a peer passed, so that a
// misbehaving one cannot make the agent leak them.
func closeRights(oob []byte) {
	msgs, err := unix.ParseSocketControlMessage(oob)
	if err != nil {
		return
	}
	for i := range msgs {
		fds, err := unix.ParseUnixRights(&msgs[i])
		if err != nil {
			continue
		}
		for _, fd := range fds {
			_ = unix.Close(fd)
		}
	}
}

// serve runs one connection: hello, snapshot, then requests, each
// answered before the next; anything ztunnel says unasked, and any error,
// ends it.
func (s *Server) serve(c *conn) {
	defer s.wg.Done()
	defer s.drop(c)
	h, err := s.readHello(c)
	if err != nil {
		c.log.Warn("closing ztunnel connection before its snapshot", "reason", err.Error())
		return
	}
	c.log.Info("ztunnel connected", "version", h.Version.String())
	// Registered before the snapshot is read, so that a pod added
	// meanwhile is queued behind the snapshot rather than missed by both:
	// at worst ztunnel gets the same add twice, which it ignores.
	s.register(c)
	if err := s.sendSnapshot(c); err != nil {
		c.log.Warn("closing ztunnel connection: snapshot failed", "reason", err.Error())
		return
	}
	for {
		select {
		case cl := <-c.reqs:
			res := s.roundTrip(c, cl.req, cl.data, cl.netns)
			cl.result <- res
			if res.err != nil {
				c.log.Warn("closing ztunnel connection", "request", cl.req.Kind.String(), "uid", cl.req.UID, "reason", res.err.Error())
				return
			}
			if res.nack != "" {
				c.log.Warn("ztunnel refused a request", "request", cl.req.Kind.String(), "uid", cl.req.UID, "reason", res.nack)
			}
		case f := <-c.frames:
			if errors.Is(f.err, errEOF) {
				c.log.Info("ztunnel disconnected")
			} else {
				c.log.Warn("closing ztunnel connection", "reason", unasked(f).Error())
			}
			return
		case <-s.stop:
			return
		}
	}
}

// unasked describes a frame that arrived with no request outstanding.
func unasked(f frame) error {
	if f.err != nil {
		return f.err
	}
	return fmt.Errorf("ztunnel sent a %d-byte message nobody asked for", len(f.b))
}

func (s *Server) readHello(c *conn) (Hello, error) {
	f, err := s.next(c, "hello")
	if err != nil {
		return Hello{}, err
	}
	h, err := UnmarshalHello(f)
	if err != nil {
		return Hello{}, fmt.Errorf("reading the hello: %w", err)
	}
	if h.Version != V1 {
		// As Istio's agent: a later ztunnel that says a later version
		// still takes version 1's messages, and closing on it would have
		// it redial at once, never enrolling a pod.
		c.log.Warn("ztunnel says another ZDS version; going on with version 1's messages, as Istio's agent does", "version", h.Version.String(), "agent_version", V1.String())
	}
	return h, nil
}

// next waits for the next packet, at most AckTimeout.
func (s *Server) next(c *conn, what string) ([]byte, error) {
	t := time.NewTimer(s.cfg.AckTimeout)
	defer t.Stop()
	select {
	case f := <-c.frames:
		if f.err != nil {
			select {
			case <-s.stop:
				// Close closed the connection under the read: say why.
				return nil, errors.New("the agent's ZDS server is stopping")
			default:
			}
			return nil, fmt.Errorf("waiting for the %s: %w", what, f.err)
		}
		return f.b, nil
	case <-t.C:
		return nil, fmt.Errorf("no %s from ztunnel within %s", what, s.cfg.AckTimeout)
	case <-s.stop:
		return nil, errors.New("the agent's ZDS server is stopping")
	}
}

func (s *Server) sendSnapshot(c *conn) error {
	pods := s.cfg.Snapshotter.Snapshot()
	obs, observed := s.cfg.Snapshotter.(SnapshotObserver)
	adds, keeps := 0, 0
	for _, p := range pods {
		req := Request{Kind: KindKeep, UID: p.UID}
		if p.Netns != nil {
			info := p.Info
			req = Request{Kind: KindAdd, UID: p.UID, Info: &info}
		}
		data, err := encode(req)
		if err != nil {
			// Such a pod can never reach ztunnel: leaving it out of the
			// snapshot is the truth, and the others must still go.
			c.log.Error("leaving a pod out of the snapshot", "uid", p.UID, "error", err.Error())
			continue
		}
		res := s.roundTrip(c, req, data, p.Netns)
		if errors.Is(res.err, errNetnsReleased) {
			// A new sandbox of the pod replaced this one since the list
			// was taken (nothing was sent): the new one goes to ztunnel by
			// its own ADD, or by the retry after the snapshot. Dropping
			// the connection would restart the snapshot, again and again
			// while pods restart.
			c.log.Info("leaving a pod out of the snapshot: its network namespace was released meanwhile", "uid", p.UID)
			continue
		}
		if res.err != nil {
			return fmt.Errorf("%s of workload %s: %w", req.Kind, p.UID, res.err)
		}
		switch {
		case res.nack != "":
			c.log.Warn("ztunnel refused a pod of the snapshot", "request", req.Kind.String(), "uid", p.UID, "reason", res.nack)
			if observed {
				obs.SnapshotRefused(p.UID, p.Netns)
			}
		case observed:
			obs.SnapshotAcked(p.UID, p.Netns)
		}
		if req.Kind == KindAdd {
			adds++
		} else {
			keeps++
		}
	}
	req := Request{Kind: KindSnapshotSent}
	data, _ := encode(req)
	res := s.roundTrip(c, req, data, nil)
	if res.err != nil {
		return fmt.Errorf("snapshot_sent: %w", res.err)
	}
	if res.nack != "" {
		c.log.Warn("ztunnel refused the end of the snapshot", "reason", res.nack)
	}
	c.log.Info("snapshot sent to ztunnel", "adds", adds, "keeps", keeps)
	if observed {
		obs.SnapshotDone()
	}
	return nil
}

// roundTrip sends one request (with netns, for an add, as its one
// descriptor) and waits for its answer. An error means the connection
// can no longer be trusted to pair answers with requests.
func (s *Server) roundTrip(c *conn, req Request, data []byte, netns *os.File) callResult {
	started := time.Now()
	if err := c.uc.SetWriteDeadline(started.Add(s.cfg.AckTimeout)); err != nil {
		return callResult{err: err}
	}
	if err := send(c.uc, data, netns); err != nil {
		return callResult{err: fmt.Errorf("sending the %s: %w", req.Kind, err)}
	}
	b, err := s.next(c, "answer to the "+req.Kind.String())
	if err != nil {
		return callResult{err: err}
	}
	resp, err := UnmarshalResponse(b)
	if err != nil {
		return callResult{err: fmt.Errorf("reading the answer to the %s: %w", req.Kind, err)}
	}
	if resp.Ack == nil {
		return callResult{err: fmt.Errorf("ztunnel answered the %s without an ack", req.Kind)}
	}
	if req.Kind == KindAdd {
		s.metrics.addTime.Observe(time.Since(started).Seconds())
	}
	return callResult{nack: resp.Ack.Error}
}

// send writes one packet, with netns's descriptor when given. The
// descriptor is used inside the file's Control, so that a caller closing
// the file meanwhile cannot make another file's number be sent.
func send(uc *net.UnixConn, data []byte, netns *os.File) error {
	if netns == nil {
		_, _, err := uc.WriteMsgUnix(data, nil, nil)
		return err
	}
	rc, err := netns.SyscallConn()
	if err != nil {
		return released(err)
	}
	var werr error
	if err := rc.Control(func(fd uintptr) {
		_, _, werr = uc.WriteMsgUnix(data, unix.UnixRights(int(fd)), nil)
	}); err != nil {
		return released(err)
	}
	return werr
}

// errNetnsReleased: the namespace file was closed before it could be
// sent (a file's Control fails only so), and nothing was sent.
var errNetnsReleased = errors.New("the pod's network namespace was released")

func released(err error) error {
	return fmt.Errorf("%w: %w", errNetnsReleased, err)
}

func (s *Server) register(c *conn) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.closed {
		return
	}
	s.conns = append(s.conns, c)
	s.metrics.connected.Set(float64(len(s.conns)))
	s.notifyLocked()
}

// drop closes and forgets the connection; its callers waiting to queue a
// request learn it through done.
func (s *Server) drop(c *conn) {
	_ = c.uc.Close()
	s.mu.Lock()
	delete(s.open, c)
	for i, x := range s.conns {
		if x == c {
			s.conns = append(s.conns[:i], s.conns[i+1:]...)
			s.metrics.connected.Set(float64(len(s.conns)))
			s.notifyLocked()
			break
		}
	}
	s.mu.Unlock()
	close(c.done)
}

func (s *Server) notifyLocked() {
	close(s.changed)
	s.changed = make(chan struct{})
}
