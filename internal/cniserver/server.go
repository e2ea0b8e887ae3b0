// Package cniserver runs the plugin's CNI commands inside the node agent
// for the relay (the istio-cni binary) on the CNI socket (cni.sock): the
// pod comes from the node's pod cache and the rules are programmed
// in-process, so a pod start costs one small process instead of a complete
// plugin, an API request and a firewall binary.
//
// The decisions are the plugin's own code (internal/plugin); this package
// only frames the relay's requests, looks pods up and serialises commands
// per network namespace. It does not install anything or watch files.
package cniserver

import (
	"bytes"
	"context"
	"encoding/binary"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"os"
	"runtime/debug"
	"strings"
	"sync"
	"syscall"
	"time"

	"github.com/containernetworking/cni/pkg/skel"
	"github.com/containernetworking/cni/pkg/types"
	"github.com/prometheus/client_golang/prometheus"
	"golang.org/x/sys/unix"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/istio-cni-go/istio-cni/internal/cnirelay"
	"github.com/istio-cni-go/istio-cni/internal/iptables"
	"github.com/istio-cni-go/istio-cni/internal/kubeclient"
	"github.com/istio-cni-go/istio-cni/internal/logging"
	"github.com/istio-cni-go/istio-cni/internal/nlsteps"
	"github.com/istio-cni-go/istio-cni/internal/nslock"
	"github.com/istio-cni-go/istio-cni/internal/plugin"
	"github.com/istio-cni-go/istio-cni/internal/podcache"
	"github.com/istio-cni-go/istio-cni/internal/podinfo"
	"github.com/istio-cni-go/istio-cni/internal/sockserve"
)

// Server runs the plugin's commands for the relay.
type Server struct {
	// Log receives the plugin's lines (scope cni-plugin); SocketLog, when
	// set, the socket's own (refused peers, accept errors).
	Log       *slog.Logger
	SocketLog *slog.Logger
	Rules     plugin.Rules
	NFTables  plugin.Rules
	// Pods may be nil (no API access): every pod is then read from the
	// API with the plugin's kubeconfig, as the fallback plugin does.
	Pods      *podcache.Cache
	Clientset kubeclient.Interface
	// ReadyReason, when set, answers STATUS: not "" means the agent cannot
	// serve ADD. Unset, STATUS succeeds whenever the agent answers.
	ReadyReason func() string
	// Locker serialises ADD and CHECK per network namespace, with the
	// repair controller's rule writes; nil means a locker of its own.
	Locker *nslock.Locker
	// Committer is who writes a redirected pod's rules on ADD:
	// CommitterPlugin (the default) or CommitterAgent.
	Committer string
	// Send sends prepared rules from this process when it commits them
	// itself; nil means nlsteps.RunIn.
	Send func(netns *os.File, txn *nlsteps.Txn) (time.Duration, error)
	// ForceIPTables is the agent's FORCE_IPTABLES_BINARY; when empty, a
	// relay's own (the runtime's environment, which the fallback plugin
	// reads) picks the variant of its pod's rules.
	ForceIPTables string
	// Ambient, when set (ambient mode), decides each ADD first and enrols
	// the pods it selects; the others take the sidecar path.
	Ambient Ambient
	// PreparedDir is where the agent keeps, when Prepare is set, the
	// ADDs of the node's pods prepared before their sandboxes exist
	// (internal/prepared), for relays to serve without asking it. They
	// need Pods, and are not kept in ambient mode or when the agent
	// commits; the directory is then emptied, so that no relay serves a
	// pod from an earlier agent's records.
	PreparedDir string
	Prepare     bool
	// AgentWait, with Prepare, is how long a relay that finds no record
	// for its pod waits for this agent's answer before it runs the
	// fallback instead (cnirelay.Request.MayLeave); 0: as long as the
	// agent takes.
	AgentWait time.Duration

	Commands *prometheus.CounterVec
	// Requests is Istio's istio_cni_plugin_requests_total{response_code}:
	// the answers to the plugin, by the HTTP status Istio's server would
	// have sent (responseCode).
	Requests *prometheus.CounterVec
	Latency  *prometheus.HistogramVec
	// Lookups counts where pods were read from: "cache" or "api".
	Lookups *prometheus.CounterVec
	// PreparedAdds counts the ADDs relays served from prepared records,
	// by result.
	PreparedAdds *prometheus.CounterVec
	// Panics counts commands that panicked, by component ("cni").
	Panics  *prometheus.CounterVec
	Sockets *sockserve.Metrics

	wg       sync.WaitGroup
	mu       sync.Mutex
	draining bool
	srv      *sockserve.Server
	api      apiClients
	lockOnce sync.Once
	prep     *preparer
}

// Ambient enrols pods in the ambient mesh on ADD (ambient.Controller).
type Ambient interface {
	// EnrolOnAdd decides the pod and enrols it with its network
	// namespace; false means it is not enrolled and nothing was done.
	EnrolOnAdd(ctx context.Context, namespace, name, uid string, netns *os.File) (bool, error)
	// CheckOnCNI decides the pod and, when it is enrolled, checks its
	// redirection in netns; false means it is not enrolled.
	CheckOnCNI(ctx context.Context, namespace, name, uid string, netns *os.File) (bool, error)
}

// ambientTimeout bounds an ambient enrolment on ADD, within the relay's
// own bound (cnirelay.Timeout): the enrolment waits for ztunnel a few
// seconds at most.
const ambientTimeout = time.Minute

// Who commits a redirected pod's rules on ADD (CNI_RULES_COMMITTER).
const (
	// CommitterPlugin: the agent decides and prepares; the relay, which
	// the runtime started in its own cgroup, plans and applies. A burst's
	// rule work is then weighted as the runtime's own per-pod work, not as
	// the agent container's small CPU request.
	CommitterPlugin = "plugin"
	// CommitterAgent: the agent applies the rules itself. It sends the
	// requests it prepared from its own process, which is warm: the send
	// takes it 0.15-0.2 ms, where a relay process just started takes
	// 0.5-0.9 ms for the same requests. A namespace it cannot prepare for
	// (legacy iptables) gets the rules applied in place, as for a relay
	// too old to commit.
	CommitterAgent = "agent"
)

// sendHere sends a pod's prepared requests from this process into its
// namespace (through s.Send when set), reporting as a relay reports.
func (s *Server) sendHere(netns *os.File, txn *nlsteps.Txn) nlsteps.Outcome {
	send := s.Send
	if send == nil {
		send = nlsteps.RunIn
	}
	took, err := send(netns, txn)
	o := nlsteps.Outcome{Took: took}
	if err != nil {
		o.Error = err.Error()
	}
	return o
}

// NewRequestsMetric is Istio's istio_cni_plugin_requests_total
// {response_code}.
func NewRequestsMetric() *prometheus.CounterVec {
	return prometheus.NewCounterVec(prometheus.CounterOpts{Name: "istio_cni_plugin_requests_total",
		Help: "ADDs the agent answered for the istio-cni plugin, or the plugin served from the agent's prepared records, by the HTTP status Istio's CNI server would have answered (200 served, 400 bad request or config, 500 failed, 503 handed to the fallback)."},
		[]string{"response_code"})
}

// NewMetrics returns the command counter, latency histogram and
// lookup counter.
func NewMetrics() (*prometheus.CounterVec, *prometheus.HistogramVec, *prometheus.CounterVec) {
	return prometheus.NewCounterVec(prometheus.CounterOpts{Name: "istio_cni_plugin_commands_total",
			Help: "CNI commands the agent ran for the istio-cni plugin, by command and result (ok, the CNI error code, unavailable: handed to the fallback, left: the plugin process stopped waiting and ran the fallback)."},
			[]string{"command", "result"}),
		prometheus.NewHistogramVec(prometheus.HistogramOpts{Name: "istio_cni_plugin_command_seconds",
			Help:    "Time the agent spent on one CNI command for the plugin.",
			Buckets: []float64{.0005, .001, .002, .005, .01, .025, .05, .1, .25, 1, 5}}, []string{"command"}),
		prometheus.NewCounterVec(prometheus.CounterOpts{Name: "istio_cni_plugin_pod_lookups_total",
			Help: "Pods read for the plugin, by source: the node's pod cache, or the API server when the cache did not hold the pod."},
			[]string{"source"})
}

// NewPreparedMetric is istio_cni_plugin_prepared_adds_total{result}.
func NewPreparedMetric() *prometheus.CounterVec {
	return prometheus.NewCounterVec(prometheus.CounterOpts{Name: "istio_cni_plugin_prepared_adds_total",
		Help: "ADDs the plugin process served from what the agent prepared when the pod was bound to the node, without asking the agent, by result (ok or the CNI error code); they are counted in istio_cni_plugin_commands_total too."},
		[]string{"result"})
}

// NewPanicMetric is istio_cni_agent_panics_total{component}.
func NewPanicMetric() *prometheus.CounterVec {
	return prometheus.NewCounterVec(prometheus.CounterOpts{Name: "istio_cni_agent_panics_total",
		Help: "Panics recovered while handling one CNI command (component cni) or one pod (component repair); each failed only that command or pod."},
		[]string{"component"})
}

// Limits of the CNI socket: a burst of pod starts on a node is tens of
// relays at once, and each sends its request as soon as it connects.
var socketLimits = sockserve.Limits{MaxConns: 128, ReadTimeout: 5 * time.Second}

// Serve listens on path until ctx ends; then it stops taking commands,
// removes the socket (so relays run the fallback) and waits up to grace
// for the commands under way.
func (s *Server) Serve(ctx context.Context, path string, grace time.Duration) (done <-chan struct{}, err error) {
	log := s.SocketLog
	if log == nil {
		log = s.Log
	}
	// Whoever can connect can have rules programmed in a namespace it
	// holds open: root only, as on every agent socket.
	srv, err := sockserve.Listen(path, socketLimits, log, s.Sockets)
	if err != nil {
		return nil, err
	}
	if s.PreparedDir != "" {
		prepare := s.Prepare && s.Pods != nil && s.Ambient == nil && s.Committer != CommitterAgent
		if prepare {
			// Plans that cost an iptables-restore to prepare are left for
			// the fallback too, which then runs none.
			if st, ok := s.Rules.(interface{ StorePlansIn(dir string) }); ok {
				st.StorePlansIn(s.PreparedDir)
			}
			if err := s.startPreparing(ctx, s.PreparedDir); err != nil {
				// Every relay then asks the agent, as before.
				log.Warn("cannot prepare pods' ADDs ahead", "dir", s.PreparedDir, "error", err.Error())
				prepare = false
			}
		}
		// Records an agent of other settings left (sidecar mode, before
		// ambient mode was turned on) must not serve any pod.
		if !prepare {
			if err := os.RemoveAll(s.PreparedDir); err != nil {
				_ = srv.Close()
				return nil, fmt.Errorf("removing the prepared ADDs an earlier agent left: %w", err)
			}
		}
	}
	s.mu.Lock()
	s.srv = srv
	s.mu.Unlock()
	finished := make(chan struct{})
	accepting := make(chan struct{})
	go func() {
		defer close(accepting)
		for {
			c, err := srv.Accept()
			if err != nil {
				return
			}
			s.mu.Lock()
			if s.draining {
				s.mu.Unlock()
				_ = c.Close()
				continue
			}
			s.wg.Add(1)
			s.mu.Unlock()
			go func() {
				defer s.wg.Done()
				sc := c.(*sockserve.Conn)
				s.serveConn(sc.UnixConn, sc)
			}()
		}
	}()
	go func() {
		<-ctx.Done()
		s.mu.Lock()
		s.draining = true
		s.mu.Unlock()
		if s.prep != nil && !srv.Displaced() {
			// Relays must not leave whatever agent serves next (an
			// older one, say, that would apply in place) before it says
			// they may. A newer agent that took the socket over has
			// said so already.
			_ = s.prep.dir.SetAgentWait(0)
		}
		_ = srv.Close()
		<-accepting
		waited := make(chan struct{})
		go func() { s.wg.Wait(); close(waited) }()
		select {
		case <-waited:
		case <-time.After(grace):
			s.Log.Warn("CNI commands still running at shutdown; their relays will retry with the fallback plugin")
			srv.CloseConns()
		}
		if s.prep != nil {
			// Its queue is shut with ctx, and a record being prepared
			// is not written; a plan being compiled may take a moment.
			select {
			case <-s.prep.done:
			case <-time.After(grace):
			}
		}
		close(finished)
	}()
	return finished, nil
}

// Displaced says whether another agent's socket took the CNI socket's
// path: a newer agent serves the node, and this one must leave the
// node's files to it.
func (s *Server) Displaced() bool {
	s.mu.Lock()
	srv := s.srv
	s.mu.Unlock()
	return srv != nil && srv.Displaced()
}

// Health is nil while the CNI socket accepts connections and relays can
// reach it by its path, else why not and since when.
func (s *Server) Health() (time.Time, error) {
	s.mu.Lock()
	srv := s.srv
	s.mu.Unlock()
	if srv == nil {
		return time.Time{}, nil
	}
	return srv.Health()
}

// connState is what the socket tracks of a connection: whether a request
// is being served (so it is not evicted), timeouts, for the metrics, and
// its end.
type connState interface {
	// Claim marks the request read and being served; false when the
	// connection was evicted before (the relay has gone elsewhere).
	Claim() bool
	TimedOut()
	// Close closes the connection and gives its slot back: a connection
	// closed any other way stays counted, busy, and once the limit's
	// worth of commands had gone by every relay was refused and ran the
	// fallback.
	Close() error
}

func (s *Server) serveConn(conn *net.UnixConn, st connState) {
	defer st.Close()
	_ = conn.SetReadDeadline(time.Now().Add(socketLimits.ReadTimeout))
	req, netns, err := readRequest(conn)
	if netns != nil {
		defer netns.Close()
	}
	var ne net.Error
	if errors.As(err, &ne) && ne.Timeout() {
		st.TimedOut()
		return
	}
	if !st.Claim() && (err != nil || req.Done == nil) {
		// Evicted as its request was read: the relay, closed on, runs
		// the fallback, and serving the command too would do it twice.
		// An account of an ADD the relay served is still taken.
		s.Log.Debug("a relay's connection was evicted as its request was read; the relay runs the fallback")
		return
	}
	_ = conn.SetReadDeadline(time.Time{})
	otherForm := err == nil && req.Steps && req.TxnForm != nlsteps.BinaryForm
	if otherForm && !req.MayLeave {
		// A relay of another release: this agent writes the rules itself,
		// as for a relay that does not send them.
		req.Steps = false
	}
	var resp *cnirelay.Response
	switch {
	case errors.Is(err, errNoDescriptor):
		// The kernel could not give us the namespace: we are out of
		// descriptors, and the fallback is not.
		resp = &cnirelay.Response{Unavailable: "the node agent is out of file descriptors"}
		// The request was not read, so its command is not known.
		s.countRequest(resultUnavailable)
	case err != nil:
		s.Log.Warn("bad request on the CNI socket", "error", err.Error())
		resp = &cnirelay.Response{Error: cnirelay.NewError(types.ErrInternal, "istio-cni node agent: "+err.Error(), "")}
		// readRequest returns no request with an error: its command is
		// not known.
		s.countRequest(resultBadRequest)
	case req.Done != nil:
		s.noteDone(req)
		return
	case otherForm && req.MayLeave:
		// It may leave, so this agent must not write to the namespace.
		resp = &cnirelay.Response{Unavailable: fmt.Sprintf("the relay reads rule transactions in form %q, and this agent writes %q (an upgrade under way)", req.TxnForm, nlsteps.BinaryForm)}
		s.count(req.Command, resultUnavailable)
	case req.MayLeave && (s.prep == nil || s.Ambient != nil || s.Committer == CommitterAgent):
		// A relay that read an earlier agent's records: this agent would
		// write to the namespace itself, which a relay that may leave
		// does not allow.
		resp = &cnirelay.Response{Unavailable: "the node agent does not prepare ADDs, and the relay may leave it"}
		s.count(req.Command, resultUnavailable)
	case req.MayLeave && req.Steps && req.Command == "ADD" && hungUp(conn):
		// The relay waited out the agent's wait and runs the fallback.
		s.Log.Debug("the relay stopped waiting before the agent read its ADD; the fallback serves the pod",
			"pod", cnirelay.PodOf(req.Args), "containerID", req.ContainerID)
		// An agent always behind still learns the config, and prepares
		// pods from then on.
		if s.prep != nil && checkAsSkel(req) == nil {
			s.prep.learn(req.Stdin)
		}
		s.count(req.Command, resultLeft)
		return
	case req.Steps && req.Command == "ADD" && netns != nil && s.Committer != CommitterAgent:
		rc := &relayCommit{conn: conn, framed: req.Framed, mayLeave: req.MayLeave}
		resp = s.handle(req, netns, rc.commit)
		if rc.sent {
			return
		}
	case req.Command == "ADD" && netns != nil && s.Committer == CommitterAgent:
		// The result a relay would print once it had sent the rules is
		// this answer's.
		var result []byte
		resp = s.handle(req, netns, func(txn *nlsteps.Txn, res []byte) (nlsteps.Outcome, error) {
			o := s.sendHere(netns, txn)
			if o.Error == "" {
				result = res
			}
			return o, nil
		})
		if resp.Error == nil && resp.Unavailable == "" && len(resp.Stdout) == 0 {
			resp.Stdout = result
		}
	default:
		resp = s.Handle(req, netns)
	}
	out, err := encodeAnswer(resp, req != nil && req.Framed)
	if err != nil {
		return
	}
	_ = conn.SetWriteDeadline(time.Now().Add(10 * time.Second))
	_, _ = conn.Write(out)
}

// encodeAnswer is an answer as the relay reads it: framed for a relay
// that asked (cnirelay.AppendFramed), else JSON.
func encodeAnswer(resp *cnirelay.Response, framed bool) ([]byte, error) {
	if framed {
		return cnirelay.AppendFramed(nil, resp), nil
	}
	return json.Marshal(resp)
}

// relayCommit hands a pod's prepared requests to the relay on conn and
// reads its account of sending them.
type relayCommit struct {
	conn *net.UnixConn
	// mayLeave: the relay may stop waiting (cnirelay.Request.MayLeave);
	// an answer it did not take is then plugin.ErrCommitterLeft.
	mayLeave bool
	// sent: the answer went out with the prepared requests.
	sent bool
	// framed: the relay reads the framed form (cnirelay.AppendFramed).
	framed bool
}

func (rc *relayCommit) commit(txn *nlsteps.Txn, result []byte) (nlsteps.Outcome, error) {
	var a nlsteps.Outcome
	prepared, err := txn.MarshalBinary()
	if err != nil {
		return a, err
	}
	out, err := encodeAnswer(&cnirelay.Response{Txn: prepared, Stdout: result}, rc.framed)
	if err != nil {
		return a, err
	}
	rc.sent = true
	_ = rc.conn.SetWriteDeadline(time.Now().Add(10 * time.Second))
	if _, err := rc.conn.Write(out); err != nil {
		return a, rc.left(fmt.Errorf("sending the prepared rules to the relay: %w", err))
	}
	// The relay reads the answer to its end; the connection stays open
	// for its account, and the namespace's lock stays held until then.
	if err := rc.conn.CloseWrite(); err != nil {
		return a, rc.left(fmt.Errorf("sending the prepared rules to the relay: %w", err))
	}
	_ = rc.conn.SetReadDeadline(time.Now().Add(cnirelay.Timeout))
	var hdr [4]byte
	if _, err := io.ReadFull(rc.conn, hdr[:]); err != nil {
		// A relay that took the answer gives its account; one that
		// closed without it left before the answer came.
		return a, rc.left(fmt.Errorf("reading the relay's account of the rules it sent: %w", err))
	}
	size := binary.BigEndian.Uint32(hdr[:])
	if size > cnirelay.MaxMessage {
		return a, fmt.Errorf("the relay's account of the rules it sent is %d bytes", size)
	}
	body := make([]byte, size)
	if _, err := io.ReadFull(rc.conn, body); err != nil {
		return a, fmt.Errorf("reading the relay's account of the rules it sent: %w", err)
	}
	if err := json.Unmarshal(body, &a); err != nil {
		return a, fmt.Errorf("decoding the relay's account of the rules it sent: %w", err)
	}
	return a, nil
}

// left is err as plugin.ErrCommitterLeft when the relay may have left
// and the connection says it did without reading the answer: closed
// before it was written (EPIPE) or with it unread (ECONNRESET). A plain
// end (EOF) is a relay that read the rules and died, which may have sent
// them: that stays an error.
func (rc *relayCommit) left(err error) error {
	if rc.mayLeave && (errors.Is(err, syscall.EPIPE) || errors.Is(err, syscall.ECONNRESET)) {
		return fmt.Errorf("%w: %w", plugin.ErrCommitterLeft, err)
	}
	return err
}

// resultLeft is istio_cni_plugin_commands_total's result for an ADD whose
// relay stopped waiting and ran the fallback, which served it.
const resultLeft = "left"

// resultUnavailable is istio_cni_plugin_commands_total's result for a
// command handed to the fallback; resultBadRequest marks, for the
// requests counter only, a request that did not decode.
const (
	resultUnavailable = "unavailable"
	resultBadRequest  = "bad-request"
)

// count counts a command's outcome, and an ADD's in Istio's requests
// counter too: Istio's server is asked ADDs alone, and the runtime's
// periodic STATUS would swamp a dashboard's rate of pod starts.
func (s *Server) count(command, result string) {
	if s.Commands != nil {
		s.Commands.WithLabelValues(command, result).Inc()
	}
	if command == "ADD" {
		s.countRequest(result)
	}
}

// countRequest counts an answer in Istio's requests counter. An ADD the
// relay stopped waiting for got no answer, as a request whose client
// hung up, and is not counted.
func (s *Server) countRequest(result string) {
	if s.Requests != nil && result != resultLeft {
		s.Requests.WithLabelValues(responseCode(result)).Inc()
	}
}

// responseCode is the HTTP status Istio's CNI event server answers with
// for a command's result: 200 when served, 400 for a request or config
// the plugin cannot take (CNI codes 1-7 but 3 and 5), 503 when handed to
// the fallback, 500 for any other failure.
func responseCode(result string) string {
	switch result {
	case "ok":
		return "200"
	case resultUnavailable:
		return "503"
	case resultBadRequest, fmt.Sprint(types.ErrIncompatibleCNIVersion), fmt.Sprint(types.ErrUnsupportedField),
		fmt.Sprint(types.ErrInvalidEnvironmentVariables), fmt.Sprint(types.ErrDecodingFailure), fmt.Sprint(types.ErrInvalidNetworkConfig):
		return "400"
	}
	return "500"
}

// hungUp says the peer of conn has closed it (or shut its writing side,
// which a relay that sends rules does not do before it leaves).
func hungUp(conn *net.UnixConn) bool {
	rc, err := conn.SyscallConn()
	if err != nil {
		return false
	}
	gone := false
	_ = rc.Control(func(fd uintptr) {
		fds := []unix.PollFd{{Fd: int32(fd), Events: unix.POLLIN | unix.POLLRDHUP}}
		if n, err := unix.Poll(fds, 0); err == nil && n == 1 {
			gone = fds[0].Revents&(unix.POLLRDHUP|unix.POLLHUP|unix.POLLERR) != 0
		}
	})
	return gone
}

// errNoDescriptor: a descriptor sent with the request was dropped by the
// kernel because this process had none to spare.
var errNoDescriptor = errors.New("the namespace descriptor was dropped: no file descriptor to spare")

// readRequest reads one request and the namespace descriptor that came
// with it: a 4-byte big-endian length, then that much JSON, the
// descriptor riding on the first bytes.
func readRequest(conn *net.UnixConn) (*cnirelay.Request, *os.File, error) {
	var hdr [4]byte
	oob := make([]byte, syscall.CmsgSpace(4*4))
	n, oobn, flags, _, err := conn.ReadMsgUnix(hdr[:], oob)
	if err != nil {
		return nil, nil, fmt.Errorf("reading request: %w", err)
	}
	var netns *os.File
	if oobn > 0 {
		fds, err := parseRights(oob[:oobn])
		if err != nil {
			return nil, nil, err
		}
		for i, fd := range fds {
			if i == 0 {
				netns = os.NewFile(uintptr(fd), "netns")
			} else {
				_ = syscall.Close(fd)
			}
		}
	}
	if flags&syscall.MSG_CTRUNC != 0 && netns == nil {
		return nil, nil, errNoDescriptor
	}
	if n < len(hdr) {
		if _, err := io.ReadFull(conn, hdr[n:]); err != nil {
			return nil, netns, fmt.Errorf("reading request: %w", err)
		}
	}
	size := binary.BigEndian.Uint32(hdr[:])
	if size > cnirelay.MaxMessage {
		return nil, netns, fmt.Errorf("request of %d bytes is too large", size)
	}
	body := make([]byte, size)
	if _, err := io.ReadFull(conn, body); err != nil {
		return nil, netns, fmt.Errorf("reading request: %w", err)
	}
	req := &cnirelay.Request{}
	if err := json.Unmarshal(body, req); err != nil {
		return nil, netns, fmt.Errorf("decoding request: %w", err)
	}
	if req.HasNetnsFD != (netns != nil) {
		return nil, netns, fmt.Errorf("request and namespace descriptor do not match")
	}
	return req, netns, nil
}

func parseRights(oob []byte) ([]int, error) {
	msgs, err := syscall.ParseSocketControlMessage(oob)
	if err != nil {
		return nil, fmt.Errorf("reading control message: %w", err)
	}
	var fds []int
	for _, m := range msgs {
		got, err := syscall.ParseUnixRights(&m)
		if err != nil {
			continue
		}
		fds = append(fds, got...)
	}
	return fds, nil
}

func (s *Server) locker() *nslock.Locker {
	s.lockOnce.Do(func() {
		if s.Locker == nil {
			s.Locker = nslock.New()
		}
	})
	return s.Locker
}

// Handle runs one command with the plugin's own code, as the plugin
// process would, and returns what it would have printed. ADD and CHECK
// hold their namespace's lock; a panic fails this command only.
func (s *Server) Handle(req *cnirelay.Request, netns *os.File) (resp *cnirelay.Response) {
	return s.handle(req, netns, nil)
}

// handle is Handle with commit, when not nil, committing an ADD's rules
// (the relay's, through relayCommit).
func (s *Server) handle(req *cnirelay.Request, netns *os.File,
	commit func(*nlsteps.Txn, []byte) (nlsteps.Outcome, error)) (resp *cnirelay.Response) {
	s.mu.Lock()
	draining := s.draining
	s.mu.Unlock()
	if draining {
		s.count(req.Command, resultUnavailable)
		return &cnirelay.Response{Unavailable: "shutting down"}
	}
	start := time.Now()
	result := "ok"
	defer func() {
		if r := recover(); r != nil {
			s.Log.Error("panic while handling a CNI command; the command fails", "cmd", req.Command, "pod", cnirelay.PodOf(req.Args),
				"containerID", req.ContainerID, "panic", fmt.Sprint(r), "stack", string(debug.Stack()))
			if s.Panics != nil {
				s.Panics.WithLabelValues("cni").Inc()
			}
			resp = &cnirelay.Response{Error: cnirelay.NewError(types.ErrInternal,
				fmt.Sprintf("istio-cni node agent: internal error handling %s: %v", req.Command, r), "")}
			result = fmt.Sprint(types.ErrInternal)
		}
		s.count(req.Command, result)
		if s.Latency != nil {
			s.Latency.WithLabelValues(req.Command).Observe(time.Since(start).Seconds())
		}
	}()
	args := &skel.CmdArgs{ContainerID: req.ContainerID, IfName: req.IfName, Args: req.Args, Path: req.Path, StdinData: req.Stdin}
	if netns != nil {
		// A path that names our descriptor: it opens the same namespace
		// in this process and, as the xtables lock file, in the iptables
		// processes we start, so the lock is the pod's namespace as with
		// the fallback plugin.
		args.Netns = fmt.Sprintf("/proc/%d/fd/%d", os.Getpid(), netns.Fd())
		if req.Command == "ADD" || req.Command == "CHECK" {
			if key, err := nslock.KeyOfFile(netns); err == nil {
				defer s.locker().Lock(key)()
			}
		}
	}
	var out bytes.Buffer
	p := &plugin.Plugin{
		Log:       logging.Over(s.Log.Handler()),
		Stdout:    &out,
		Rules:     s.rulesFor(req),
		NFTables:  s.NFTables,
		NewSource: s.source,
		Commit:    commit,
		// Why the relay did not use the pod's record, in the ADD's lines.
		Unprepared: req.Unprepared,
		// The agent answers, so it can serve an ADD: STATUS succeeds
		// unless told otherwise.
		Ready: func() error {
			if s.ReadyReason != nil {
				if r := s.ReadyReason(); r != "" {
					return errors.New(r)
				}
			}
			return nil
		},
	}
	if s.Committer == CommitterAgent && commit != nil {
		// This agent sends the prepared rules itself (sendHere).
		p.CommittedBy = CommitterAgent
	} else if commit != nil && req.MayLeave {
		p.HandOverOnly = true
	}
	if s.Ambient != nil && netns != nil && req.Command == "ADD" {
		p.Ambient = func(ctx context.Context, a *plugin.K8sArgs) (bool, error) {
			ctx, cancel := context.WithTimeout(ctx, ambientTimeout)
			defer cancel()
			return s.Ambient.EnrolOnAdd(ctx, string(a.K8S_POD_NAMESPACE), string(a.K8S_POD_NAME), string(a.K8S_POD_UID), netns)
		}
	}
	if s.Ambient != nil && netns != nil && req.Command == "CHECK" {
		p.AmbientCheck = func(ctx context.Context, a *plugin.K8sArgs) (bool, error) {
			ctx, cancel := context.WithTimeout(ctx, ambientTimeout)
			defer cancel()
			return s.Ambient.CheckOnCNI(ctx, string(a.K8S_POD_NAMESPACE), string(a.K8S_POD_NAME), string(a.K8S_POD_UID), netns)
		}
	}
	var err error
	if serr := checkAsSkel(req); serr != nil {
		err = serr
	} else {
		switch req.Command {
		case "ADD":
			if s.prep != nil && req.Steps && netns != nil {
				// A config that passed the checks a plugin's config is
				// put to, from a relay that reads records.
				s.prep.learn(req.Stdin)
			}
			err = p.Add(args)
		case "DEL":
			err = p.Del(args)
		case "CHECK":
			err = p.Check(args)
		case "STATUS":
			err = p.Status(args)
		case "GC":
			err = p.GC(args)
		}
	}
	resp = &cnirelay.Response{}
	if err != nil {
		switch {
		case errors.Is(err, plugin.ErrCommitterLeft):
			result = resultLeft
			return resp
		case errors.Is(err, plugin.ErrInPlace):
			// The relay, if still there, runs the fallback.
			result = resultUnavailable
			return &cnirelay.Response{Unavailable: err.Error()}
		}
		if outOfDescriptors(err) {
			result = resultUnavailable
			return &cnirelay.Response{Unavailable: "the node agent is out of file descriptors"}
		}
		var te *types.Error
		if !errors.As(err, &te) {
			te = types.NewError(types.ErrInternal, err.Error(), "")
		}
		resp.Error = relayError(te)
		result = fmt.Sprint(te.Code)
	} else {
		resp.Stdout = out.Bytes()
	}
	return resp
}

// rulesFor is the iptables backend for a request: the agent's, forced to
// the variant the relay's runtime names when the agent names none.
func (s *Server) rulesFor(req *cnirelay.Request) plugin.Rules {
	a, ok := s.Rules.(*iptables.Applier)
	if !ok || s.ForceIPTables != "" || a.Force != "" || req.ForceIPTables == "" {
		return s.Rules
	}
	forced := *a
	forced.Force = req.ForceIPTables
	return &forced
}

// outOfDescriptors: the command failed for want of a descriptor here,
// which the fallback, a process of its own, would not lack. The plugin's
// errors carry their cause as text only.
func outOfDescriptors(err error) bool {
	if errors.Is(err, syscall.EMFILE) || errors.Is(err, syscall.ENFILE) {
		return true
	}
	msg := err.Error()
	return strings.Contains(msg, syscall.EMFILE.Error()) || strings.Contains(msg, syscall.ENFILE.Error())
}

// apiClients keeps one API client for the plugin's kubeconfig, made again
// only when the file changes (a rotated token), so lookups share one
// transport and its connections instead of leaving one behind each.
type apiClients struct {
	mu   sync.Mutex
	path string
	id   [4]int64
	c    *podinfo.APIClient
}

func (a *apiClients) get(path, runDir string) (*podinfo.APIClient, error) {
	var id [4]int64
	if fi, err := os.Stat(path); err == nil {
		if st, ok := fi.Sys().(*syscall.Stat_t); ok {
			id = [4]int64{int64(st.Dev), int64(st.Ino), st.Size, st.Mtim.Nano()}
		}
	}
	a.mu.Lock()
	defer a.mu.Unlock()
	if a.c != nil && a.path == path && a.id == id {
		return a.c, nil
	}
	c, err := podinfo.NewAPIClient(path, runDir)
	if err != nil {
		return nil, err
	}
	if a.c != nil {
		a.c.CloseIdleConnections()
	}
	a.c, a.path, a.id = c, path, id
	return c, nil
}

// source reads the pod from the node's cache (checking the UID, so a
// recreated pod of the same name is not mistaken for the old one), then
// from the API server within the config's timeout and budget.
func (s *Server) source(conf *plugin.Config, uid string) (podinfo.Source, error) {
	f := &podinfo.Fallback{API: func() (podinfo.Source, error) {
		if s.Lookups != nil {
			s.Lookups.WithLabelValues("api").Inc()
		}
		var src podinfo.Source
		if s.Clientset != nil {
			src = apiSource{s.Clientset}
		} else {
			c, err := s.api.get(conf.KubeconfigPath(), conf.CNIAgentRunDir)
			if err != nil {
				return nil, err
			}
			src = c
		}
		return conf.Bounded(src), nil
	}}
	if s.Pods != nil {
		f.Agent = cacheSource{s.Pods, uid}
		f.OnAgent = func(hit bool, err error) {
			if hit && s.Lookups != nil {
				s.Lookups.WithLabelValues("cache").Inc()
			}
			if !hit {
				s.Log.Debug("pod not in the node's cache; asking the API server", "reason", err.Error())
			}
		}
	}
	return f, nil
}

type cacheSource struct {
	pc  *podcache.Cache
	uid string
}

func (c cacheSource) GetPod(_ context.Context, namespace, name string) (*podinfo.Pod, error) {
	if !c.pc.Synced() {
		return nil, errors.New("pod cache not synced")
	}
	pod, err := c.pc.Pod(namespace, name, c.uid)
	if err != nil {
		return nil, err
	}
	return podcache.PodFromCore(pod), nil
}

type apiSource struct{ cs kubeclient.Interface }

func (a apiSource) GetPod(ctx context.Context, namespace, name string) (*podinfo.Pod, error) {
	pod, err := a.cs.Pods(namespace).Get(ctx, name, metav1.GetOptions{})
	switch {
	case apierrors.IsNotFound(err):
		return nil, podinfo.ErrNotFound
	case apierrors.IsUnauthorized(err) || apierrors.IsForbidden(err):
		return nil, &podinfo.PermanentError{Err: fmt.Errorf("API server refused the agent's credentials: %w", err)}
	case err != nil:
		return nil, err
	}
	return podcache.PodFromCore(pod), nil
}
