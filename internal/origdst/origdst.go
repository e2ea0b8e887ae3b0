// Package origdst reads the destination a redirected TCP connection had
// before netfilter sent it to a local listener (SO_ORIGINAL_DST).
package origdst

import (
	"encoding/binary"
	"errors"
	"net"
	"net/netip"
	"unsafe"

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
	err = raw.Control(func(fd uintptr) {
		if v6 {
			var sa unix.RawSockaddrInet6
			if serr = getsockopt(fd, unix.SOL_IPV6, unsafe.Pointer(&sa), unsafe.Sizeof(sa)); serr == nil {
				out = netip.AddrPortFrom(netip.AddrFrom16(sa.Addr), netPort(&sa.Port))
			}
			return
		}
		var sa unix.RawSockaddrInet4
		if serr = getsockopt(fd, unix.SOL_IP, unsafe.Pointer(&sa), unsafe.Sizeof(sa)); serr == nil {
			out = netip.AddrPortFrom(netip.AddrFrom4(sa.Addr), netPort(&sa.Port))
		}
	})
	if err != nil {
		return out, err
	}
	return out, serr
}

// getsockopt reads SO_ORIGINAL_DST at level into the sockaddr at p.
func getsockopt(fd uintptr, level int, p unsafe.Pointer, size uintptr) error {
	l := uint32(size)
	if _, _, e := unix.Syscall6(unix.SYS_GETSOCKOPT, fd, uintptr(level), soOriginalDst,
		uintptr(p), uintptr(unsafe.Pointer(&l)), 0); e != 0 {
		return e
	}
	return nil
}

// netPort reads a sockaddr's port, which is in network byte order.
func netPort(p *uint16) uint16 {
	return binary.BigEndian.Uint16((*[2]byte)(unsafe.Pointer(p))[:])
}
