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
			l := uint32(unsafe.Sizeof(sa))
			if _, _, e := unix.Syscall6(unix.SYS_GETSOCKOPT, fd, unix.SOL_IPV6, soOriginalDst,
				uintptr(unsafe.Pointer(&sa)), uintptr(unsafe.Pointer(&l)), 0); e != 0 {
				serr = e
				return
			}
			port := binary.BigEndian.Uint16((*[2]byte)(unsafe.Pointer(&sa.Port))[:])
			out = netip.AddrPortFrom(netip.AddrFrom16(sa.Addr), port)
			return
		}
		var sa unix.RawSockaddrInet4
		l := uint32(unsafe.Sizeof(sa))
		if _, _, e := unix.Syscall6(unix.SYS_GETSOCKOPT, fd, unix.SOL_IP, soOriginalDst,
			uintptr(unsafe.Pointer(&sa)), uintptr(unsafe.Pointer(&l)), 0); e != 0 {
			serr = e
			return
		}
		port := binary.BigEndian.Uint16((*[2]byte)(unsafe.Pointer(&sa.Port))[:])
		out = netip.AddrPortFrom(netip.AddrFrom4(sa.Addr), port)
	})
	if err != nil {
		return out, err
	}
	return out, serr
}
