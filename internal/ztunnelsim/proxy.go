package ztunnelsim

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"net/netip"
	"os"
	"strconv"
	"sync"
	"syscall"
	"time"

	"golang.org/x/sys/unix"

	"github.com/istio-cni-go/istio-cni/internal/origdst"
)

// The ports ztunnel listens on inside each pod, and the mark of the
// sockets it opens itself (0x539), which the pod's rules let through.
const (
	PortOutbound = 15001
	PortInbound  = 15006
	PortHBONE    = 15008
	PortDNS      = 15053
	Mark         = 1337
)

// proxy is what the stand-in runs for one workload: the namespace it was
// handed and, when asked for, listeners inside it.
type proxy struct {
	netns     *os.File
	inode     uint64
	closers   []io.Closer
	listening []string
	wg        sync.WaitGroup
}

// startProxy binds ztunnel's listeners in the namespace, for IPv4 and,
// where the kernel has it, IPv6, with IP_TRANSPARENT on the outbound and
// inbound ports as ztunnel sets it.
func startProxy(netns *os.File, inode uint64, listen bool) (*proxy, error) {
	p := &proxy{netns: netns, inode: inode}
	if !listen {
		return p, nil
	}
	err := withNetns(netns, func() error {
		for _, fam := range []string{"4", "6"} {
			for _, l := range []struct {
				port        int
				transparent bool
				udp         bool
			}{
				{PortOutbound, true, false}, {PortInbound, true, false}, {PortHBONE, false, false},
				{PortDNS, false, false}, {PortDNS, false, true},
			} {
				err := p.listen(fam, l.port, l.transparent, l.udp)
				if fam == "6" && errors.Is(err, unix.EAFNOSUPPORT) {
					// A kernel without IPv6: ztunnel binds IPv4 only there too.
					break
				}
				if err != nil {
					return err
				}
			}
		}
		return nil
	})
	if err != nil {
		p.close()
		return nil, err
	}
	return p, nil
}

func (p *proxy) listen(fam string, port int, transparent, udp bool) error {
	lc := net.ListenConfig{}
	if transparent {
		lc.Control = func(_, _ string, rc syscall.RawConn) error {
			var serr error
			err := rc.Control(func(fd uintptr) {
				if fam == "6" {
					serr = unix.SetsockoptInt(int(fd), unix.SOL_IPV6, unix.IPV6_TRANSPARENT, 1)
				} else {
					serr = unix.SetsockoptInt(int(fd), unix.SOL_IP, unix.IP_TRANSPARENT, 1)
				}
			})
			if err != nil {
				return err
			}
			if serr != nil {
				return fmt.Errorf("IP_TRANSPARENT: %w", serr)
			}
			return nil
		}
	}
	addr := ":" + strconv.Itoa(port)
	if udp {
		pc, err := lc.ListenPacket(context.Background(), "udp"+fam, addr)
		if err != nil {
			return fmt.Errorf("listening on udp%s %s in the pod: %w", fam, addr, err)
		}
		p.closers = append(p.closers, pc)
		p.listening = append(p.listening, "udp"+fam+" "+pc.LocalAddr().String())
		p.wg.Add(1)
		go p.serveUDP(pc, port)
		return nil
	}
	l, err := lc.Listen(context.Background(), "tcp"+fam, addr)
	if err != nil {
		return fmt.Errorf("listening on tcp%s %s in the pod: %w", fam, addr, err)
	}
	p.closers = append(p.closers, l)
	p.listening = append(p.listening, "tcp"+fam+" "+l.Addr().String())
	p.wg.Add(1)
	go p.serveTCP(l, port)
	return nil
}

// serveTCP answers each connection with one line, "<port> <destination>",
// and closes it: the destination is where the client meant to go (the
// original destination of a redirected connection, otherwise the local
// address), which is what a traffic test needs to see.
func (p *proxy) serveTCP(l net.Listener, port int) {
	defer p.wg.Done()
	for {
		c, err := l.Accept()
		if err != nil {
			return
		}
		p.wg.Add(1)
		go func() {
			defer p.wg.Done()
			defer c.Close()
			_ = c.SetDeadline(time.Now().Add(5 * time.Second))
			_, _ = fmt.Fprintf(c, "%d %s\n", port, destination(c))
		}()
	}
}

func destination(c net.Conn) string {
	if d, err := origdst.Get(c); err == nil {
		return d.String()
	}
	// No conntrack entry (nothing redirected it): the local address is
	// where the client went.
	if a, ok := c.LocalAddr().(*net.TCPAddr); ok {
		return a.AddrPort().String()
	}
	return c.LocalAddr().String()
}

// serveUDP answers each datagram with "<port> " and the datagram.
func (p *proxy) serveUDP(pc net.PacketConn, port int) {
	defer p.wg.Done()
	buf := make([]byte, 64<<10)
	prefix := []byte(strconv.Itoa(port) + " ")
	for {
		n, from, err := pc.ReadFrom(buf)
		if err != nil {
			return
		}
		_, _ = pc.WriteTo(append(append([]byte(nil), prefix...), buf[:n]...), from)
	}
}

// close stops the listeners, waits for their goroutines, and lets go of
// the namespace.
func (p *proxy) close() {
	for _, c := range p.closers {
		_ = c.Close()
	}
	p.wg.Wait()
	_ = p.netns.Close()
}

// dial connects from inside the pod's namespace, with the socket marked
// as ztunnel marks its own, and from src when valid (a non-local address,
// hence IP_TRANSPARENT, as ztunnel dials an app on the client's behalf).
func (p *proxy) dial(ctx context.Context, network, addr string, src netip.Addr) (net.Conn, error) {
	d := net.Dialer{Control: func(_, _ string, rc syscall.RawConn) error {
		var serr error
		err := rc.Control(func(fd uintptr) {
			serr = unix.SetsockoptInt(int(fd), unix.SOL_SOCKET, unix.SO_MARK, Mark)
			if serr != nil || !src.IsValid() {
				return
			}
			if src.Is4() {
				serr = unix.SetsockoptInt(int(fd), unix.SOL_IP, unix.IP_TRANSPARENT, 1)
			} else {
				serr = unix.SetsockoptInt(int(fd), unix.SOL_IPV6, unix.IPV6_TRANSPARENT, 1)
			}
		})
		if err != nil {
			return err
		}
		return serr
	}}
	if src.IsValid() {
		d.LocalAddr = &net.TCPAddr{IP: src.AsSlice()}
	}
	var c net.Conn
	err := withNetns(p.netns, func() error {
		var err error
		c, err = d.DialContext(ctx, network, addr)
		return err
	})
	return c, err
}
