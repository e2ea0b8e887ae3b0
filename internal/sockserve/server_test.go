package sockserve

import (
	"errors"
	"io"
	"log/slog"
	"net"
	"os"
	"path/filepath"
	"testing"
	"time"

	promtest "github.com/prometheus/client_golang/prometheus/testutil"
)

var quiet = slog.New(slog.NewTextHandler(io.Discard, nil))

// clientOf dials the socket at path, closing the client with the test.
func clientOf(t *testing.T, path string) func() net.Conn {
	return func() net.Conn {
		t.Helper()
		c, err := net.Dial("unix", path)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { c.Close() })
		return c
	}
}

// acceptorOf accepts the next connection s admits.
func acceptorOf(t *testing.T, s *Server) func() *Conn {
	return func() *Conn {
		t.Helper()
		c, err := s.Accept()
		if err != nil {
			t.Fatal(err)
		}
		return c.(*Conn)
	}
}

// TestSocketEvictsSilentClients: at the connection limit the oldest client
// that has not sent a request makes room; busy ones are never evicted.
func TestSocketEvictsSilentClients(t *testing.T) {
	path := filepath.Join(t.TempDir(), "s.sock")
	m := NewMetrics()
	s, err := Listen(path, Limits{MaxConns: 2, ReadTimeout: time.Second}, quiet, m)
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	if fi, err := os.Stat(path); err != nil || fi.Mode().Perm() != 0o600 {
		t.Fatalf("socket mode: %v %v", fi, err)
	}
	dial, accept := clientOf(t, path), acceptorOf(t, s)
	// The oldest has sent its request, which the server has not read
	// yet: it is not silent.
	sent, first, second := dial(), dial(), dial()
	if _, err := sent.Write([]byte("a request")); err != nil {
		t.Fatal(err)
	}
	accept()
	accept()
	// Past the limit already (the sender's request unread): the oldest
	// silent one makes room.
	s2 := accept()
	dial()
	accept()
	_ = first.SetReadDeadline(time.Now().Add(5 * time.Second))
	if _, err := first.Read(make([]byte, 1)); !errors.Is(err, io.EOF) {
		t.Fatalf("the oldest silent client is still connected: %v", err)
	}
	_ = sent.SetReadDeadline(time.Now().Add(100 * time.Millisecond))
	if _, err := sent.Read(make([]byte, 1)); !errors.Is(err, os.ErrDeadlineExceeded) {
		t.Fatalf("a client whose request waits to be read was evicted: %v", err)
	}
	if got := promtest.ToFloat64(m.Rejected.WithLabelValues("s.sock", "evicted")); got != 2 {
		t.Fatalf("evictions counted: %v", got)
	}
	// With every connection busy, a new one is refused, not served.
	s.mu.Lock()
	for c := range s.conns {
		c.SetBusy(true)
	}
	s.mu.Unlock()
	late := dial()
	go func() { _, _ = s.Accept() }()
	_ = late.SetReadDeadline(time.Now().Add(5 * time.Second))
	if _, err := late.Read(make([]byte, 1)); !errors.Is(err, io.EOF) {
		t.Fatalf("a client past the limit was not refused: %v", err)
	}
	_ = second
	_ = s2
}

// TestClaimRacesEviction: a connection whose request has been read looks
// silent until it is claimed. Evicted before, its claim fails (its client
// saw the connection closed and went elsewhere); claimed before, it is
// never evicted.
func TestClaimRacesEviction(t *testing.T) {
	path := filepath.Join(t.TempDir(), "s.sock")
	s, err := Listen(path, Limits{MaxConns: 1, ReadTimeout: time.Second}, quiet, NewMetrics())
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	dial, accept := clientOf(t, path), acceptorOf(t, s)
	read := func(c *Conn) {
		if _, err := io.ReadFull(c, make([]byte, 3)); err != nil {
			t.Fatal(err)
		}
	}
	// Read, not yet claimed: the next connection evicts it.
	a := dial()
	if _, err := a.Write([]byte("req")); err != nil {
		t.Fatal(err)
	}
	ac := accept()
	read(ac)
	b := dial()
	bc := accept()
	if ac.Claim() {
		t.Fatal("an evicted connection was claimed")
	}
	_ = a.SetReadDeadline(time.Now().Add(5 * time.Second))
	if _, err := a.Read(make([]byte, 1)); !errors.Is(err, io.EOF) {
		t.Fatalf("the evicted client is still connected: %v", err)
	}
	// Read and claimed: the next connection is refused instead.
	if _, err := b.Write([]byte("req")); err != nil {
		t.Fatal(err)
	}
	read(bc)
	if !bc.Claim() {
		t.Fatal("a connection was not claimed")
	}
	late := dial()
	go func() { _, _ = s.Accept() }()
	_ = late.SetReadDeadline(time.Now().Add(5 * time.Second))
	if _, err := late.Read(make([]byte, 1)); !errors.Is(err, io.EOF) {
		t.Fatalf("a client past the limit was not refused: %v", err)
	}
	_ = b.SetReadDeadline(time.Now().Add(100 * time.Millisecond))
	if _, err := b.Read(make([]byte, 1)); !errors.Is(err, os.ErrDeadlineExceeded) {
		t.Fatalf("a claimed connection was closed: %v", err)
	}
}

// TestPathRemovedByAnotherAgent: an Istio agent stopping after ours
// started unlinks the path its listener had (log.sock has the same name);
// the path is put back to the same socket, and Close then removes both of
// its names. A newer agent's socket at the path is left to it.
func TestPathRemovedByAnotherAgent(t *testing.T) {
	path := filepath.Join(t.TempDir(), "log.sock")
	s, err := Listen(path, Limits{MaxConns: 4, ReadTimeout: time.Second}, quiet, nil)
	if err != nil {
		t.Fatal(err)
	}
	if err := os.Remove(path); err != nil {
		t.Fatal(err)
	}
	deadline := time.Now().Add(10 * time.Second)
	var c net.Conn
	for c == nil {
		if c, err = net.Dial("unix", path); err != nil && time.Now().After(deadline) {
			t.Fatalf("the path was not put back within 10 s: %v", err)
		}
		time.Sleep(10 * time.Millisecond) // polling the condition, not synchronising
	}
	defer c.Close()
	if _, err := s.Accept(); err != nil {
		t.Fatal(err)
	}
	if s.Displaced() {
		t.Fatal("a path put back counts as displaced")
	}
	newer, err := net.ListenUnix("unix", &net.UnixAddr{Name: path + ".newer", Net: "unix"})
	if err != nil {
		t.Fatal(err)
	}
	newer.SetUnlinkOnClose(false)
	defer newer.Close()
	if err := os.Rename(path+".newer", path); err != nil {
		t.Fatal(err)
	}
	if !s.Displaced() {
		t.Fatal("a newer agent's socket at the path: not displaced")
	}
	if err := s.Close(); err != nil {
		t.Fatal(err)
	}
	if _, err := os.Lstat(path); err != nil {
		t.Fatalf("Close removed the newer agent's socket: %v", err)
	}
	if _, err := os.Lstat(filepath.Join(filepath.Dir(path), ".log.sock.keep")); !os.IsNotExist(err) {
		t.Fatalf("the second name was left: %v", err)
	}
}
