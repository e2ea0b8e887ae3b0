package nlsteps

import (
	"encoding/binary"
	"errors"
	"fmt"
	"strings"

	"golang.org/x/sys/unix"
)

// Conn is a blocking netlink socket for one request at a time, in the
// calling thread's network namespace (the socket is bound to it when
// made). A caller in a pod's namespace holds its OS thread locked; a
// socket on Go's poller would park that thread and have another wake it
// for every answer, which costs more than the kernel's work for small
// requests. Blocking in the read costs nothing of the kind.
type Conn struct {
	fd  int
	seq uint32
	buf []byte
}

// Dial opens a socket of the netlink protocol (unix.NETLINK_NETFILTER,
// unix.NETLINK_ROUTE).
func Dial(proto int) (*Conn, error) {
	fd, err := unix.Socket(unix.AF_NETLINK, unix.SOCK_RAW|unix.SOCK_CLOEXEC, proto)
	if err != nil {
		return nil, fmt.Errorf("opening netlink socket (protocol %d): %w", proto, err)
	}
	// The kernel's own words for a refusal, and no copy of the request
	// in the reply (a set's elements can be a large message).
	_ = unix.SetsockoptInt(fd, unix.SOL_NETLINK, unix.NETLINK_EXT_ACK, 1)
	_ = unix.SetsockoptInt(fd, unix.SOL_NETLINK, unix.NETLINK_CAP_ACK, 1)
	_ = unix.SetsockoptTimeval(fd, unix.SOL_SOCKET, unix.SO_RCVTIMEO, &unix.Timeval{Sec: replyTimeout})
	return &Conn{fd: fd}, nil
}

// Send sends one step on the socket, of the step's protocol, and waits
// for its answers, as Run does on a socket of its own; its messages are
// numbered on from the socket's last request. After an error the socket
// may hold answers not read: close it.
func (c *Conn) Send(s *Step) error {
	next, err := send(c.fd, s, c.seq+1)
	c.seq = next - 1
	return err
}

// Close closes the socket.
func (c *Conn) Close() error { return unix.Close(c.fd) }

// Refusal is the kernel's answer that it did not do a request.
type Refusal struct {
	Errno unix.Errno
	// Msg is the kernel's extended words, "" when it gave none.
	Msg string
	// IPSet says the request was ipset's, whose own error numbers (4096
	// and up) mean nothing to the C library.
	IPSet bool
}

func (r *Refusal) Error() string {
	s := r.Errno.Error()
	if r.IPSet && r.Errno > ipsetErrPrivate {
		s = "ipset: " + ipsetWords(r.Errno)
	}
	if r.Msg != "" {
		s += " (" + r.Msg + ")"
	}
	return s
}

// Unwrap lets errors.Is match the errno.
func (r *Refusal) Unwrap() error { return r.Errno }

// ipset's own error numbers (linux/netfilter/ipset/ip_set.h): the
// generic ones follow ipsetErrPrivate in order; those of one set type
// start at ipsetErrTypeSpecific.
const (
	ipsetErrPrivate      = 4096
	ipsetErrTypeSpecific = 4352
)

var ipsetErrors = []string{
	"the kernel speaks another ipset protocol",
	"the kernel has no such set type",
	"the namespace holds as many sets as it may",
	"the set is in use",
	"the second set exists",
	"the sets are of different types",
	"a set of that name exists",
	"invalid prefix length",
	"invalid netmask",
	"invalid address family",
	"the set has no timeouts",
	"the set is referenced",
	"an IPv4 address was expected",
	"an IPv6 address was expected",
	"the set has no counters",
	"the set has no comments",
	"invalid mark mask",
	"the set has no skbinfo",
	"a bitmask and a netmask together",
}

func ipsetWords(e unix.Errno) string {
	switch i := int(e) - ipsetErrPrivate - 1; {
	case int(e) >= ipsetErrTypeSpecific:
		return fmt.Sprintf("error %d of the set's type (a hash set full, an entry outside a bitmap's range)", int(e))
	case i >= 0 && i < len(ipsetErrors):
		return ipsetErrors[i]
	}
	return fmt.Sprintf("error %d", int(e))
}

// ErrDumpInterrupted is a dump the kernel marked inconsistent: what it
// read changed meanwhile. Asking again reads it whole.
var ErrDumpInterrupted = errors.New("the kernel's dump was interrupted by a change; read it again")

// Request sends one message of type typ and flags (FlagRequest is added)
// and returns the kernel's answers to it: a dump's messages up to its
// end; a request's replies up to its acknowledgement, which is always
// asked for, so an answer that is only a reply is not mistaken for the
// last. A refusal is a *Refusal. The bodies are the caller's to keep.
func (c *Conn) Request(typ, flags uint16, body []byte) ([]Message, error) {
	c.seq++
	dump := flags&unix.NLM_F_DUMP == unix.NLM_F_DUMP
	if !dump {
		flags |= FlagAck
	}
	req := binary.NativeEndian.AppendUint32(make([]byte, 0, HeaderLen+len(body)+3), uint32(HeaderLen+len(body)))
	req = binary.NativeEndian.AppendUint16(req, typ)
	req = binary.NativeEndian.AppendUint16(req, flags|FlagRequest)
	req = binary.NativeEndian.AppendUint32(req, c.seq)
	req = binary.NativeEndian.AppendUint32(req, 0)
	req = append(req, body...)
	if err := unix.Sendto(c.fd, req, 0, &unix.SockaddrNetlink{Family: unix.AF_NETLINK}); err != nil {
		return nil, err
	}
	var out []Message
	for {
		b, err := c.receive()
		if err != nil {
			return nil, err
		}
		msgs, err := ParseMessages(b)
		if err != nil {
			return nil, err
		}
		for _, m := range msgs {
			if m.Seq != c.seq {
				continue
			}
			if m.Flags&unix.NLM_F_DUMP_INTR != 0 {
				// The dumped object changed while it was read: its parts
				// need not agree.
				return nil, ErrDumpInterrupted
			}
			switch m.Type {
			case unix.NLMSG_ERROR, unix.NLMSG_DONE:
				if len(m.Body) < 4 {
					return out, nil
				}
				if errno := -int32(binary.NativeEndian.Uint32(m.Body)); errno != 0 {
					return nil, refusal(m, errno)
				}
				if m.Type == unix.NLMSG_DONE || !dump {
					return out, nil
				}
			default:
				m.Body = append([]byte(nil), m.Body...)
				out = append(out, m)
			}
		}
	}
}

// receive reads one datagram whole, growing the buffer for it: a dump's
// part can be larger than the last one.
func (c *Conn) receive() ([]byte, error) {
	if c.buf == nil {
		// Made on the first read: a socket that only sends steps (the
		// relay's, through Run) reads into collect's buffer instead.
		c.buf = make([]byte, 32<<10)
	}
	for {
		n, _, err := unix.Recvfrom(c.fd, c.buf, unix.MSG_PEEK|unix.MSG_TRUNC)
		if errors.Is(err, unix.EINTR) {
			continue
		}
		if errors.Is(err, unix.EAGAIN) {
			return nil, fmt.Errorf("no answer from the kernel within %d s", replyTimeout)
		}
		if err != nil {
			return nil, err
		}
		if n > len(c.buf) {
			c.buf = make([]byte, n)
		}
		n, _, err = unix.Recvfrom(c.fd, c.buf, 0)
		if errors.Is(err, unix.EINTR) {
			continue
		}
		if err != nil {
			return nil, err
		}
		return c.buf[:n], nil
	}
}

// refusal reads an error answer: its errno and, in an NLMSG_ERROR, the
// kernel's extended words.
func refusal(m Message, errno int32) *Refusal {
	r := &Refusal{Errno: unix.Errno(errno)}
	// nlmsgerr: errno, then the request's header (the payload capped:
	// NETLINK_CAP_ACK), then the extended attributes.
	if m.Type != unix.NLMSG_ERROR || len(m.Body) < 4+HeaderLen {
		return r
	}
	r.IPSet = binary.NativeEndian.Uint16(m.Body[4+4:])>>8 == unix.NFNL_SUBSYS_IPSET
	attrs, _ := ParseAttrs(m.Body[4+HeaderLen:])
	for _, a := range attrs {
		if a.Type == unix.NLMSGERR_ATTR_MSG {
			r.Msg = strings.TrimRight(string(a.Data), "\x00")
		}
	}
	return r
}
