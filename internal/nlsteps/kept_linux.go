package nlsteps

import (
	"fmt"
	"os"
	"sync"

	"golang.org/x/sys/unix"
)

// Kept is a socket made in one network namespace and kept there for
// requests made again and again (the node's probe sets): entering the
// namespace and opening a socket per request costs more than a small
// request, and closing a netfilter socket makes the kernel first finish
// releasing whatever a transaction in its namespace deleted: right after
// a deletion, that waits out an RCU grace period (11-12 ms on the test VM,
// kernel 6.18). The zero value is ready to use; one request runs at a
// time.
type Kept struct {
	mu    sync.Mutex
	ns    nsID
	proto int
	conn  *Conn
}

// nsID names a network namespace by its file's device and inode: a path
// may come to name another namespace (a node's namespace file made
// anew), and a socket stays in the one it was made in.
type nsID struct{ dev, ino uint64 }

// Do runs fn with the kept socket of protocol proto in the network
// namespace at netnsPath, made on first use (and again when the path
// names another namespace, or the protocol changes). fn runs on the
// calling thread in the thread's own namespace: the socket stays bound to
// the one it was made in. A socket fn fails with is closed, so the next
// call starts on a clean one.
func (k *Kept) Do(netnsPath string, proto int, fn func(*Conn) error) error {
	k.mu.Lock()
	defer k.mu.Unlock()
	f, err := os.Open(netnsPath) //nolint:gosec // G304: the node namespace's path, which the agent is configured with
	if err != nil {
		return fmt.Errorf("opening network namespace %s: %w", netnsPath, err)
	}
	defer f.Close()
	var st unix.Stat_t
	if err := unix.Fstat(int(f.Fd()), &st); err != nil {
		return fmt.Errorf("network namespace %s: %w", netnsPath, err)
	}
	id := nsID{st.Dev, st.Ino}
	if k.conn != nil && (k.ns != id || k.proto != proto) {
		_ = k.conn.Close()
		k.conn = nil
	}
	if k.conn == nil {
		var c *Conn
		if err := InNetNS(f, func() (err error) {
			c, err = Dial(proto)
			return err
		}); err != nil {
			if c != nil {
				_ = c.Close()
			}
			return err
		}
		k.conn, k.ns, k.proto = c, id, proto
	}
	err = fn(k.conn)
	if err != nil {
		_ = k.conn.Close()
		k.conn = nil
	}
	return err
}

// Close closes the kept socket, if any.
func (k *Kept) Close() error {
	k.mu.Lock()
	defer k.mu.Unlock()
	if k.conn == nil {
		return nil
	}
	err := k.conn.Close()
	k.conn = nil
	return err
}
