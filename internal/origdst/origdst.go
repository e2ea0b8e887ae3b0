// Package origdst reads the destination a redirected TCP connection had
// before netfilter sent it to a local listener (SO_ORIGINAL_DST).
package origdst

import (
	"encoding/binary"
	"errors"
	"net"
	"net/netip"

	"golang.org/x/sys/unix"
)

// soOriginalDst is SO_ORIGINAL_DST (IPv4) and IP6T_SO_ORIGINAL_DST.
const soOriginalDst = 80

// Get returns the original destination of an accepted connection.
func Get(c net.Conn) (netip.AddrPort, error) {
	tc, ok := c.(*net.TCPConn)
	if !ok {
		return netip.AddrPort{}, errors.New("not a TCP connection")
	}
	raw, err := tc.SyscallConn()
	if err != nil {
		return netip.AddrPort{}, err
	}
	v6 := tc.LocalAddr().(*net.TCPAddr).IP.To4() == nil
	var out netip.AddrPort
	var serr error
	err = raw.Control(func(fd uintptr) { out, serr = get(int(fd), v6) })
	if err != nil {
		return out, err
	}
	return out, serr
}

// get asks the kernel for fd's original destination. x/sys has no
// getsockopt for a bare sockaddr, so it borrows the two whose results are
// large enough to hold one: struct ipv6_mreq for
// sockaddr_in, struct ip6_mtuinfo (which starts with one) for sockaddr_in6.
func get(fd int, v6 bool) (netip.AddrPort, error) {
	if v6 {
		info, err := unix.GetsockoptIPv6MTUInfo(fd, unix.SOL_IPV6, soOriginalDst)
		if err != nil {
			return netip.AddrPort{}, err
		}
		// Port holds the bytes of a network-order port, read in host order.
		var port [2]byte
		binary.NativeEndian.PutUint16(port[:], info.Addr.Port)
		return netip.AddrPortFrom(netip.AddrFrom16(info.Addr.Addr), binary.BigEndian.Uint16(port[:])), nil
	}
	mreq, err := unix.GetsockoptIPv6Mreq(fd, unix.SOL_IP, soOriginalDst)
	if err != nil {
		return netip.AddrPort{}, err
	}
	// sockaddr_in: family (2 bytes), port (2, network order), address (4).
	sin := mreq.Multiaddr
	return netip.AddrPortFrom(netip.AddrFrom4([4]byte(sin[4:8])), binary.BigEndian.Uint16(sin[2:4])), nil
}
