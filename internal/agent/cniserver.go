package agent

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
	"sync"
	"syscall"
	"time"

	"github.com/containernetworking/cni/pkg/skel"
	"github.com/containernetworking/cni/pkg/types"
	"github.com/prometheus/client_golang/prometheus"
	"golang.org/x/sys/unix"
	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes"

	"github.com/istio-cni-go/istio-cni/internal/cnirelay"
	"github.com/istio-cni-go/istio-cni/internal/logging"
	"github.com/istio-cni-go/istio-cni/internal/plugin"
	"github.com/istio-cni-go/istio-cni/internal/podinfo"
)

// CNIServer runs the plugin's commands inside the agent for the relay
// (the istio-cni binary): the pod comes from the node's pod cache and the
// rules are programmed in-process, so a pod start costs one small process
// instead of a complete plugin, an API request and a firewall binary.
type CNIServer struct {
	// Log receives the plugin's lines (scope cni-plugin).
	Log      *slog.Logger
	Rules    plugin.Rules
	NFTables plugin.Rules
	// Pods may be nil (no API access): every pod is then read from the
	// API with the plugin's kubeconfig, as the fallback plugin does.
	Pods      *PodCache
	Clientset kubernetes.Interface
	// ReadyReason answers STATUS: "" when the node is ready.
	ReadyReason func() string

	Commands *prometheus.CounterVec
	Latency  *prometheus.HistogramVec
	// Lookups counts where pods were read from: "cache" or "api".
	Lookups *prometheus.CounterVec

	wg       sync.WaitGroup
	mu       sync.Mutex
	draining bool
}

// NewCNIMetrics returns the command counter, latency histogram and
// lookup counter.
func NewCNIMetrics() (*prometheus.CounterVec, *prometheus.HistogramVec, *prometheus.CounterVec) {
	return prometheus.NewCounterVec(prometheus.CounterOpts{Name: "istio_cni_plugin_commands_total",
			Help: "CNI commands the agent ran for the istio-cni plugin, by command and result (ok or the CNI error code)."},
			[]string{"command", "result"}),
		prometheus.NewHistogramVec(prometheus.HistogramOpts{Name: "istio_cni_plugin_command_seconds",
			Help:    "Time the agent spent on one CNI command for the plugin.",
			Buckets: []float64{.0005, .001, .002, .005, .01, .025, .05, .1, .25, 1, 5}}, []string{"command"}),
		prometheus.NewCounterVec(prometheus.CounterOpts{Name: "istio_cni_plugin_pod_lookups_total",
			Help: "Pods read for the plugin, by source: the node's pod cache, or the API server when the cache did not hold the pod."},
			[]string{"source"})
}

// Serve listens on path until ctx ends; then it stops taking commands,
// removes the socket (so relays run the fallback) and waits up to grace
// for the commands under way.
func (s *CNIServer) Serve(ctx context.Context, path string, grace time.Duration) (done <-chan struct{}, err error) {
	// Whoever can connect can have rules programmed in a namespace it
	// holds open: root only.
	l, err := listenSocket(path, 0o600)
	if err != nil {
		return nil, err
	}
	// The socket goes before the listener closes, so no relay connects to
	// a closing agent.
	l.SetUnlinkOnClose(false)
	finished := make(chan struct{})
	go func() {
		<-ctx.Done()
		s.mu.Lock()
		s.draining = true
		s.mu.Unlock()
		_ = os.Remove(path)
		_ = l.Close()
		waited := make(chan struct{})
		go func() { s.wg.Wait(); close(waited) }()
		select {
		case <-waited:
		case <-time.After(grace):
			s.Log.Warn("CNI commands still running at shutdown; their relays will retry with the fallback plugin")
		}
		close(finished)
	}()
	go func() {
		for {
			conn, err := l.AcceptUnix()
			if err != nil {
				return
			}
			s.mu.Lock()
			if s.draining {
				s.mu.Unlock()
				_ = conn.Close()
				continue
			}
			s.wg.Add(1)
			s.mu.Unlock()
			go func() {
				defer s.wg.Done()
				s.serveConn(conn)
			}()
		}
	}()
	return finished, nil
}

func (s *CNIServer) serveConn(conn *net.UnixConn) {
	defer conn.Close()
	_ = conn.SetDeadline(time.Now().Add(cnirelay.Timeout))
	req, netns, err := readRequest(conn)
	if netns != nil {
		defer netns.Close()
	}
	var resp *cnirelay.Response
	if err != nil {
		s.Log.Warn("bad request on the CNI socket", "error", err.Error())
		resp = &cnirelay.Response{Error: types.NewError(types.ErrInternal, "istio-cni node agent: "+err.Error(), "")}
	} else {
		resp = s.Handle(req, netns)
	}
	out, err := json.Marshal(resp)
	if err != nil {
		return
	}
	_, _ = conn.Write(out)
}

// readRequest reads one request and the namespace descriptor that came
// with it, after checking that the peer is root (or the agent's own user).
func readRequest(conn *net.UnixConn) (*cnirelay.Request, *os.File, error) {
	if err := checkPeer(conn); err != nil {
		return nil, nil, err
	}
	var hdr [4]byte
	oob := make([]byte, syscall.CmsgSpace(4*4))
	n, oobn, _, _, err := conn.ReadMsgUnix(hdr[:], oob)
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
		return fmt.Errorf("peer uid %d (pid %d) may not run CNI commands", cred.Uid, cred.Pid)
	}
	return nil
}

// Handle runs one command with the plugin's own code, as the plugin
// process would, and returns what it would have printed.
func (s *CNIServer) Handle(req *cnirelay.Request, netns *os.File) *cnirelay.Response {
	s.mu.Lock()
	draining := s.draining
	s.mu.Unlock()
	if draining {
		return &cnirelay.Response{Unavailable: "shutting down"}
	}
	start := time.Now()
	args := &skel.CmdArgs{ContainerID: req.ContainerID, IfName: req.IfName, Args: req.Args, Path: req.Path, StdinData: req.Stdin}
	if netns != nil {
		// A path that names our descriptor: it opens the same namespace
		// in this process and, as the xtables lock file, in the iptables
		// processes we start, so the lock is the pod's namespace as with
		// the fallback plugin.
		args.Netns = fmt.Sprintf("/proc/%d/fd/%d", os.Getpid(), netns.Fd())
	}
	var out bytes.Buffer
	p := &plugin.Plugin{
		Log:       logging.Over(s.Log.Handler()),
		Stdout:    &out,
		Rules:     s.Rules,
		NFTables:  s.NFTables,
		NewSource: s.source,
		Ready: func() error {
			if r := s.ReadyReason(); r != "" {
				return errors.New(r)
			}
			return nil
		},
	}
	var err error
	switch req.Command {
	case "ADD":
		err = p.Add(args)
	case "DEL":
		err = p.Del(args)
	case "CHECK":
		err = p.Check(args)
	case "STATUS":
		err = p.Status(args)
	case "GC":
		err = p.GC(args)
	default:
		err = types.NewError(types.ErrInvalidEnvironmentVariables, fmt.Sprintf("unknown CNI_COMMAND: %v", req.Command), "")
	}
	result := "ok"
	resp := &cnirelay.Response{}
	if err != nil {
		var te *types.Error
		if !errors.As(err, &te) {
			te = types.NewError(types.ErrInternal, err.Error(), "")
		}
		resp.Error = te
		result = fmt.Sprint(te.Code)
	} else {
		resp.Stdout = out.Bytes()
	}
	if s.Commands != nil {
		s.Commands.WithLabelValues(req.Command, result).Inc()
		s.Latency.WithLabelValues(req.Command).Observe(time.Since(start).Seconds())
	}
	return resp
}

// source reads the pod from the node's cache (checking the UID, so a
// recreated pod of the same name is not mistaken for the old one), then
// from the API server within the config's timeout and budget.
func (s *CNIServer) source(conf *plugin.Config, uid string) (podinfo.Source, error) {
	f := &podinfo.Fallback{API: func() (podinfo.Source, error) {
		if s.Lookups != nil {
			s.Lookups.WithLabelValues("api").Inc()
		}
		var src podinfo.Source
		if s.Clientset != nil {
			src = apiSource{s.Clientset}
		} else {
			c, err := podinfo.NewAPIClient(conf.KubeconfigPath(), conf.CNIAgentRunDir)
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
	pc  *PodCache
	uid string
}

func (c cacheSource) GetPod(_ context.Context, namespace, name string) (*podinfo.Pod, error) {
	if !c.pc.synced() {
		return nil, errors.New("pod cache not synced")
	}
	pod, err := c.pc.lister.Pods(namespace).Get(name)
	if err != nil {
		return nil, podinfo.ErrNotFound
	}
	if c.uid != "" && string(pod.UID) != c.uid {
		return nil, podinfo.ErrNotFound
	}
	return PodFromCore(pod), nil
}

type apiSource struct{ cs kubernetes.Interface }

func (a apiSource) GetPod(ctx context.Context, namespace, name string) (*podinfo.Pod, error) {
	pod, err := a.cs.CoreV1().Pods(namespace).Get(ctx, name, metav1.GetOptions{})
	switch {
	case apierrors.IsNotFound(err):
		return nil, podinfo.ErrNotFound
	case apierrors.IsUnauthorized(err) || apierrors.IsForbidden(err):
		return nil, &podinfo.PermanentError{Err: fmt.Errorf("API server refused the agent's credentials: %w", err)}
	case err != nil:
		return nil, err
	}
	return PodFromCore(pod), nil
}

// PodFromCore reduces a pod to what selection reads, with the same result
// as decoding its JSON (podinfo.DecodeJSON): an env var with an empty or
// referenced value is left out, as the JSON omits empty values.
func PodFromCore(p *corev1.Pod) *podinfo.Pod {
	out := &podinfo.Pod{
		Namespace: p.Namespace, Name: p.Name, UID: string(p.UID),
		Labels: p.Labels, Annotations: p.Annotations,
		InitContainers: containersFromCore(p.Spec.InitContainers),
		Containers:     containersFromCore(p.Spec.Containers),
	}
	for _, ip := range p.Status.PodIPs {
		out.PodIPs = append(out.PodIPs, ip.IP)
	}
	return out
}

func containersFromCore(in []corev1.Container) []podinfo.Container {
	out := make([]podinfo.Container, 0, len(in))
	for _, c := range in {
		pc := podinfo.Container{Name: c.Name, Args: c.Args}
		for _, e := range c.Env {
			if e.Value == "" {
				continue
			}
			if pc.Env == nil {
				pc.Env = map[string]string{}
			}
			pc.Env[e.Name] = e.Value
		}
		if sc := c.SecurityContext; sc != nil {
			pc.RunAsUser, pc.RunAsGroup = sc.RunAsUser, sc.RunAsGroup
		}
		out = append(out, pc)
	}
	return out
}
