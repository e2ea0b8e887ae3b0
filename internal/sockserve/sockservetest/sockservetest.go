// Package sockservetest has what the tests of the agent's sockets share:
// a raw exchange with a socket and a buffer safe for a logger's writes
// from the server's goroutines.
package sockservetest

import (
	"bytes"
	"io"
	"net"
	"strings"
	"sync"
	"testing"
	"time"
)

// Exchange writes req on a new connection to the socket at path and reads
// whatever comes back until the server closes or its timeouts pass; an
// answer, if any, must be HTTP.
func Exchange(t *testing.T, path string, req []byte) {
	t.Helper()
	c, err := net.Dial("unix", path)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	_ = c.SetDeadline(time.Now().Add(30 * time.Second))
	_, _ = c.Write(req)
	_ = c.(*net.UnixConn).CloseWrite()
	resp, err := io.ReadAll(c)
	if err != nil && !IsReset(err) {
		t.Fatalf("no answer nor close within the server's timeouts: %v", err)
	}
	if len(resp) > 0 && !bytes.HasPrefix(resp, []byte("HTTP/1.")) {
		t.Fatalf("not an HTTP answer: %q", resp)
	}
}

// IsReset: the server closed with our request unread, which is an answer.
func IsReset(err error) bool {
	return strings.Contains(err.Error(), "connection reset")
}

// Buffer is a bytes.Buffer that loggers on several goroutines can share.
type Buffer struct {
	mu  sync.Mutex
	buf bytes.Buffer
}

func (b *Buffer) Write(p []byte) (int, error) {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.buf.Write(p)
}

// Reset empties the buffer.
func (b *Buffer) Reset() {
	b.mu.Lock()
	defer b.mu.Unlock()
	b.buf.Reset()
}

// Bytes is a copy of what was written.
func (b *Buffer) Bytes() []byte {
	b.mu.Lock()
	defer b.mu.Unlock()
	return append([]byte(nil), b.buf.Bytes()...)
}

// String is what was written.
func (b *Buffer) String() string { return string(b.Bytes()) }
