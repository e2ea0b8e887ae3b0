package testenv

import (
	"bufio"
	"errors"
	"fmt"
	"net"
	"net/netip"
	"os"
	"os/exec"
	"strconv"
	"strings"
	"syscall"
	"time"

	"github.com/containernetworking/plugins/pkg/ns"

	"github.com/istio-cni-go/istio-cni/internal/origdst"
	"golang.org/x/sys/unix"
)

// OriginalDst reads SO_ORIGINAL_DST of a redirected TCP connection.
func OriginalDst(c net.Conn) (netip.AddrPort, error) { return origdst.Get(c) }

// Listen opens a listener inside the pod (or the node when pod is nil).
func Listen(pod *Pod, network, addr string, transparent bool) (net.Listener, error) {
	var l net.Listener
	f := func() error {
		lc := net.ListenConfig{}
		if transparent {
			lc.Control = func(_, _ string, c syscall.RawConn) error {
				var serr error
				err := c.Control(func(fd uintptr) {
					if strings.HasSuffix(network, "6") {
						serr = unix.SetsockoptInt(int(fd), unix.SOL_IPV6, unix.IPV6_TRANSPARENT, 1)
					} else {
						serr = unix.SetsockoptInt(int(fd), unix.SOL_IP, unix.IP_TRANSPARENT, 1)
					}
				})
				return errors.Join(err, serr)
			}
		}
		var err error
		l, err = lc.Listen(nil, network, addr) //nolint:staticcheck // nil context is fine for a listen
		return err
	}
	if pod == nil {
		return l, f()
	}
	return l, pod.InPod(f)
}

// ListenUDP opens a UDP socket inside the pod (or node when pod is nil).
func ListenUDP(pod *Pod, network, addr string) (*net.UDPConn, error) {
	var c *net.UDPConn
	f := func() error {
		ua, err := net.ResolveUDPAddr(network, addr)
		if err != nil {
			return err
		}
		c, err = net.ListenUDP(network, ua)
		return err
	}
	if pod == nil {
		return c, f()
	}
	return c, pod.InPod(f)
}

// Dial connects from inside the pod (or node when pod is nil).
func Dial(pod *Pod, network, addr string) (net.Conn, error) {
	var c net.Conn
	f := func() error {
		var err error
		c, err = net.DialTimeout(network, addr, 3*time.Second)
		return err
	}
	if pod == nil {
		return c, f()
	}
	return c, pod.InPod(f)
}

// Accept waits for one connection, bounded by timeout.
func Accept(l net.Listener, timeout time.Duration) (net.Conn, error) {
	type deadliner interface{ SetDeadline(time.Time) error }
	if d, ok := l.(deadliner); ok {
		_ = d.SetDeadline(time.Now().Add(timeout))
	}
	return l.Accept()
}

const helperEnv = "ISTIO_CNI_TEST_HELPER"

// DialAs connects from inside a namespace as the given uid and gid, in a
// helper process (credentials are per process). It returns the local
// address the helper used.
func DialAs(netnsPath string, uid, gid int, network, addr string) (string, error) {
	cmd := exec.Command(os.Args[0])
	cmd.Env = append(os.Environ(), helperEnv+"=dial",
		"HELPER_NETNS="+netnsPath, "HELPER_UID="+strconv.Itoa(uid), "HELPER_GID="+strconv.Itoa(gid),
		"HELPER_NETWORK="+network, "HELPER_ADDR="+addr)
	out, err := cmd.CombinedOutput()
	if err != nil {
		return "", fmt.Errorf("dial helper: %w: %s", err, out)
	}
	s := strings.TrimSpace(string(out))
	if !strings.HasPrefix(s, "OK ") {
		return "", fmt.Errorf("dial helper: %s", s)
	}
	return strings.TrimPrefix(s, "OK "), nil
}

// Ping writes a line and waits up to 3 s for the peer's line back: the
// connection reached a listener that serves it, not just a SYN-ACK.
func Ping(c net.Conn) error {
	if _, err := c.Write([]byte("ping\n")); err != nil {
		return err
	}
	_ = c.SetReadDeadline(time.Now().Add(3 * time.Second))
	if _, err := bufio.NewReader(c).ReadString('\n'); err != nil {
		return fmt.Errorf("reading reply: %w", err)
	}
	return nil
}

// RunHelperIfRequested runs the helper role when the binary was started
// as a helper, and exits. Call it first in TestMain.
func RunHelperIfRequested() {
	if os.Getenv(helperEnv) != "dial" {
		return
	}
	err := ns.WithNetNSPath(os.Getenv("HELPER_NETNS"), func(ns.NetNS) error {
		uid, _ := strconv.Atoi(os.Getenv("HELPER_UID"))
		gid, _ := strconv.Atoi(os.Getenv("HELPER_GID"))
		if err := syscall.Setgroups([]int{gid}); err != nil {
			return err
		}
		if err := syscall.Setgid(gid); err != nil {
			return err
		}
		if err := syscall.Setuid(uid); err != nil {
			return err
		}
		c, err := net.DialTimeout(os.Getenv("HELPER_NETWORK"), os.Getenv("HELPER_ADDR"), 3*time.Second)
		if err != nil {
			return err
		}
		defer c.Close()
		if err := Ping(c); err != nil {
			return err
		}
		fmt.Println("OK", c.LocalAddr().String())
		return nil
	})
	if err != nil {
		fmt.Println("ERR", err)
		os.Exit(1)
	}
	os.Exit(0)
}
