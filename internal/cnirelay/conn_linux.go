package cnirelay

import (
	"errors"
	"fmt"
	"time"

	"golang.org/x/sys/unix"
)

// agentConn is the relay's connection to the agent, in plain blocking
// socket calls with the kernel's timeouts: the relay does one exchange,
// and the net package's poller is more to start than it saves.
type agentConn struct{ fd int }

// dialAgent connects within connectWait (when set and shorter than
// timeout), after which the connection's calls have timeout. A connect
// blocks only while the agent's queue of connections it has not accepted
// is full: an agent that stopped (frozen, or wedged before its accept),
// whose queue the kernel goes on filling, would otherwise hold every
// later command for all of timeout. The error is then EAGAIN.
func dialAgent(path string, connectWait, timeout time.Duration) (*agentConn, error) {
	fd, err := unix.Socket(unix.AF_UNIX, unix.SOCK_STREAM|unix.SOCK_CLOEXEC, 0)
	if err != nil {
		return nil, fmt.Errorf("socket: %w", err)
	}
	if connectWait <= 0 || (timeout > 0 && connectWait > timeout) {
		connectWait = timeout
	}
	if timeout > 0 {
		tv := unix.NsecToTimeval(timeout.Nanoseconds())
		_ = unix.SetsockoptTimeval(fd, unix.SOL_SOCKET, unix.SO_RCVTIMEO, &tv)
	}
	if connectWait > 0 {
		tv := unix.NsecToTimeval(connectWait.Nanoseconds())
		_ = unix.SetsockoptTimeval(fd, unix.SOL_SOCKET, unix.SO_SNDTIMEO, &tv)
	}
	for {
		err = unix.Connect(fd, &unix.SockaddrUnix{Name: path})
		if !errors.Is(err, unix.EINTR) {
			break
		}
	}
	if err != nil {
		_ = unix.Close(fd)
		return nil, fmt.Errorf("connect: %w", err)
	}
	if timeout > 0 && connectWait != timeout {
		tv := unix.NsecToTimeval(timeout.Nanoseconds())
		_ = unix.SetsockoptTimeval(fd, unix.SOL_SOCKET, unix.SO_SNDTIMEO, &tv)
	}
	return &agentConn{fd: fd}, nil
}

// write writes b whole; rights, when set, ride on its first bytes.
func (c *agentConn) write(b, rights []byte) error {
	for len(b) > 0 || rights != nil {
		n, err := unix.SendmsgN(c.fd, b, rights, nil, unix.MSG_NOSIGNAL)
		if errors.Is(err, unix.EINTR) {
			continue
		}
		if err != nil {
			return fmt.Errorf("write: %w", err)
		}
		b, rights = b[n:], nil
	}
	return nil
}

func (c *agentConn) closeWrite() { _ = unix.Shutdown(c.fd, unix.SHUT_WR) }

func (c *agentConn) close() { _ = unix.Close(c.fd) }

// errTooLarge is an answer longer than any the agent sends.
var errTooLarge = fmt.Errorf("an answer over %d bytes", MaxMessage)

// errWaitedFirst: no byte of the answer came within the first wait.
var errWaitedFirst = errors.New("no answer within the first wait")

// readAll reads to the end of the agent's answer, at most limit bytes.
// With first set, the first byte must come within it (errWaitedFirst);
// the rest then has timeout, as the connection was dialled with.
func (c *agentConn) readAll(limit int, first, timeout time.Duration) ([]byte, error) {
	buf := make([]byte, 0, 16<<10)
	var firstBy time.Time
	if first > 0 {
		firstBy = time.Now().Add(first)
		tv := unix.NsecToTimeval(first.Nanoseconds())
		_ = unix.SetsockoptTimeval(c.fd, unix.SOL_SOCKET, unix.SO_RCVTIMEO, &tv)
	}
	for {
		if len(buf) == cap(buf) {
			buf = append(buf, 0)[:len(buf)]
		}
		n, err := unix.Read(c.fd, buf[len(buf):cap(buf)])
		if errors.Is(err, unix.EINTR) {
			if first > 0 {
				// A read a signal cut short starts its timeout again:
				// the first wait goes on for what is left of it only.
				left := time.Until(firstBy)
				if left <= 0 {
					return nil, errWaitedFirst
				}
				tv := unix.NsecToTimeval(left.Nanoseconds())
				_ = unix.SetsockoptTimeval(c.fd, unix.SOL_SOCKET, unix.SO_RCVTIMEO, &tv)
			}
			continue
		}
		if first > 0 && errors.Is(err, unix.EAGAIN) && len(buf) == 0 {
			return nil, errWaitedFirst
		}
		if first > 0 && err == nil {
			first = 0
			tv := unix.NsecToTimeval(timeout.Nanoseconds())
			_ = unix.SetsockoptTimeval(c.fd, unix.SOL_SOCKET, unix.SO_RCVTIMEO, &tv)
		}
		if err != nil {
			return buf, fmt.Errorf("read: %w", err)
		}
		if n == 0 {
			return buf, nil
		}
		buf = buf[:len(buf)+n]
		if len(buf) > limit {
			return buf, errTooLarge
		}
	}
}
