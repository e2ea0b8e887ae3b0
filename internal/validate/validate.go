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
	"syscall"
	"time"

	"golang.org/x/sys/unix"

	"github.com/istio-cni-go/istio-cni/internal/origdst"
)

// ExitValidationFailed is the exit code Istio's repair controller watches
// for on the validation init container.
const ExitValidationFailed = 126

// ProbePort is the port the probe connects to; nothing listens there.
const ProbePort = 15002

// Config is what the probe needs.
type Config struct {
	// IPv6 probes [::1]/[::6] instead of 127.0.0.1/127.0.0.6.
	IPv6 bool
	// ListenPorts are the proxy's outbound and inbound capture ports.
	ListenPorts []int
	Timeout     time.Duration
	// Interval between connection attempts.
	Interval time.Duration
	Log      io.Writer
}

// ErrTimeout means no probe connection came back redirected in time.
var ErrTimeout = errors.New("validation timeout")

func reuse(_, _ string, c syscall.RawConn) error {
	var serr error
	err := c.Control(func(fd uintptr) {
		serr = errors.Join(unix.SetsockoptInt(int(fd), unix.SOL_SOCKET, unix.SO_REUSEADDR, 1),
			unix.SetsockoptInt(int(fd), unix.SOL_SOCKET, unix.SO_REUSEPORT, 1))
	})
	return errors.Join(err, serr)
}

// Run probes until a connection arrives redirected with the probe port as
// its original destination, or the timeout passes.
func Run(ctx context.Context, cfg Config) error {
	listenHost, target := "127.0.0.1", netip.AddrPortFrom(netip.MustParseAddr("127.0.0.6"), ProbePort)
	if cfg.IPv6 {
		listenHost, target = "::1", netip.AddrPortFrom(netip.MustParseAddr("::6"), ProbePort)
	}
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
	for _, port := range cfg.ListenPorts {
		l, err := lc.Listen(ctx, "tcp", net.JoinHostPort(listenHost, strconv.Itoa(port)))
		if err != nil {
			return fmt.Errorf("listening on %d: %w", port, err)
		}
		listeners = append(listeners, l)
		go serve(l, success)
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
		} else if cfg.Log != nil && ctx.Err() == nil {
			fmt.Fprintf(cfg.Log, "probe connection to %s: %v\n", target, err)
		}
		select {
		case orig := <-success:
			if cfg.Log != nil {
				fmt.Fprintf(cfg.Log, "validation passed: a connection to %s came back to the proxy port with original destination %s; the redirect rules are in place\n", target, orig)
			}
			return nil
		case <-ctx.Done():
			return fmt.Errorf("%w: no connection to %s was redirected to ports %v within %s", ErrTimeout, target, cfg.ListenPorts, cfg.Timeout)
		case <-ticker.C:
		}
	}
}

func serve(l net.Listener, success chan<- netip.AddrPort) {
	for {
		c, err := l.Accept()
		if err != nil {
			return
		}
		orig, err := origdst.Get(c)
		_ = c.Close()
		if err == nil && orig.Port() == ProbePort {
			select {
			case success <- orig:
			default:
			}
		}
	}
}
