// Package validate is the pod-side check that the redirect rules are in
// place before the app starts (Istio's istio-validation init container):
// a connection to 127.0.0.6:15002 made as the proxy uid must come back to
// the proxy's inbound port with its original destination intact.
package validate

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"net/netip"
	"strconv"
	"sync"
	"syscall"
	"time"

	"golang.org/x/sys/unix"

	"github.com/istio-cni-go/istio-cni/internal/origdst"
)

// ExitValidationFailed is the exit code Istio's repair controller watches
// for on the validation init container.
const ExitValidationFailed = 126

// DefaultProbePort is the port the probe connects to unless
// --iptables-probe-port says otherwise; nothing listens there.
const DefaultProbePort = 15002

// DefaultTimeout is how long the probe tries, as Istio's --probe-timeout.
const DefaultTimeout = 5 * time.Second

// Config is what the probe needs.
type Config struct {
	// IPv6 probes [::1]/[::6] instead of 127.0.0.1/127.0.0.6.
	IPv6 bool
	// ListenPorts are the proxy's outbound and inbound capture ports.
	ListenPorts []int
	// ProbePort is the port connected to (DefaultProbePort when 0).
	ProbePort int
	Timeout   time.Duration
	// Interval between connection attempts.
	Interval time.Duration
	Log      io.Writer
}

// ErrTimeout means no probe connection came back redirected in time.
var ErrTimeout = errors.New("validation timeout")

// ErrNoListener means none of the proxy ports could be listened on.
var ErrNoListener = errors.New("no listener available")

func reuse(_, _ string, c syscall.RawConn) error {
	var serr error
	err := c.Control(func(fd uintptr) {
		serr = errors.Join(unix.SetsockoptInt(int(fd), unix.SOL_SOCKET, unix.SO_REUSEADDR, 1),
			unix.SetsockoptInt(int(fd), unix.SOL_SOCKET, unix.SO_REUSEPORT, 1))
	})
	return errors.Join(err, serr)
}

// lockedWriter lets the accepting goroutines and the probe loop share a log.
type lockedWriter struct {
	mu sync.Mutex
	w  io.Writer
}

func (l *lockedWriter) printf(format string, a ...any) {
	if l.w == nil {
		return
	}
	l.mu.Lock()
	defer l.mu.Unlock()
	fmt.Fprintf(l.w, format, a...)
}

// Run probes until a connection arrives redirected with the probe port as
// its original destination, or the timeout passes.
func Run(ctx context.Context, cfg Config) error {
	probePort := uint16(DefaultProbePort)
	if cfg.ProbePort > 0 {
		probePort = uint16(cfg.ProbePort) //nolint:gosec // G115: a port, checked by the caller
	}
	listenHost, target := "127.0.0.1", netip.AddrPortFrom(netip.MustParseAddr("127.0.0.6"), probePort)
	if cfg.IPv6 {
		listenHost, target = "::1", netip.AddrPortFrom(netip.MustParseAddr("::6"), probePort)
	}
	log := &lockedWriter{w: cfg.Log}
	ctx, cancel := context.WithTimeout(ctx, cfg.Timeout)
	defer cancel()
	success := make(chan netip.AddrPort, 1)
	lc := net.ListenConfig{Control: reuse}
	// Every port listens until Run returns.
	var listeners []net.Listener
	defer func() {
		for _, l := range listeners {
			_ = l.Close()
		}
	}()
	// As Istio's validator, a port that cannot be listened on is only
	// logged: with the rules in place the probe arrives on the inbound
	// port alone, and the outbound one may be held by another process or
	// be below 1024 for a uid that may not bind it.
	var listenErrs []error
	for _, port := range cfg.ListenPorts {
		l, err := lc.Listen(ctx, "tcp", net.JoinHostPort(listenHost, strconv.Itoa(port)))
		if err != nil {
			log.printf("listening on %d: %v\n", port, err)
			listenErrs = append(listenErrs, fmt.Errorf("listening on %d: %w", port, err))
			continue
		}
		listeners = append(listeners, l)
		go serve(l, probePort, success, log)
	}
	if len(listeners) == 0 {
		return fmt.Errorf("%w: %w", ErrNoListener, errors.Join(listenErrs...))
	}
	// The probe leaves from the loopback address, not from the target's
	// own address: traffic from 127.0.0.6/::6 is the proxy's passthrough
	// and is never redirected.
	dialer := net.Dialer{Timeout: cfg.Interval, LocalAddr: &net.TCPAddr{IP: net.ParseIP(listenHost)}}
	ticker := time.NewTicker(cfg.Interval)
	defer ticker.Stop()
	for {
		c, err := dialer.DialContext(ctx, "tcp", target.String())
		if err == nil {
			_ = c.Close()
		} else if ctx.Err() == nil {
			log.printf("probe connection to %s: %v\n", target, err)
		}
		select {
		case orig := <-success:
			log.printf("validation passed: a connection to %s came back to the proxy port with original destination %s; the redirect rules are in place\n", target, orig)
			return nil
		case <-ctx.Done():
			return fmt.Errorf("%w: no connection to %s was redirected to the proxy's ports %v within %s", ErrTimeout, target, listening(listeners), cfg.Timeout)
		case <-ticker.C:
		}
	}
}

func listening(ls []net.Listener) []string {
	out := make([]string, 0, len(ls))
	for _, l := range ls {
		out = append(out, l.Addr().String())
	}
	return out
}

func serve(l net.Listener, probePort uint16, success chan<- netip.AddrPort, log *lockedWriter) {
	for {
		c, err := l.Accept()
		if err != nil {
			return
		}
		orig, err := origdst.Get(c)
		from := c.RemoteAddr()
		_ = c.Close()
		switch {
		case err != nil:
			log.printf("connection from %s to %s: no original destination: %v\n", from, l.Addr(), err)
		case orig.Port() != probePort:
			log.printf("connection from %s to %s had original destination %s, not the probe's port %d\n", from, l.Addr(), orig, probePort)
		default:
			select {
			case success <- orig:
			default:
			}
		}
	}
}
