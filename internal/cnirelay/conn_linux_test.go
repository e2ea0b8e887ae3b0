package cnirelay

import (
	"errors"
	"runtime"
	"testing"
	"time"

	"golang.org/x/sys/unix"
)

// TestSignalsDoNotStretchTheFirstWait: a signal cuts a read with a receive
// timeout short (EINTR), and the read that follows starts the kernel's
// timeout again. Signals that keep coming must not stretch the relay's
// first wait for the agent: it ends at its bound, while they still come.
func TestSignalsDoNotStretchTheFirstWait(t *testing.T) {
	fds, err := unix.Socketpair(unix.AF_UNIX, unix.SOCK_STREAM|unix.SOCK_CLOEXEC, 0)
	if err != nil {
		t.Fatal(err)
	}
	defer unix.Close(fds[1]) // the agent's end: open, and silent
	c := &agentConn{fd: fds[0]}
	defer c.close()

	// Long enough for a few signals even when a loaded machine delays
	// the ticker that sends them.
	const first = time.Second
	const signalling = 10 * time.Second
	tid := make(chan int)
	type answer struct {
		err  error
		took time.Duration
	}
	got := make(chan answer)
	go func() {
		// The thread the signals go to stays this goroutine's.
		runtime.LockOSThread()
		defer runtime.UnlockOSThread()
		tid <- unix.Gettid()
		start := time.Now()
		_, err := c.readAll(1<<10, first, time.Second)
		got <- answer{err, time.Since(start)}
	}()
	thread := <-tid
	deadline := time.Now().Add(signalling)
	tick := time.NewTicker(20 * time.Millisecond)
	defer tick.Stop()
	interrupted := 0
	for {
		select {
		case a := <-got:
			if !errors.Is(a.err, errWaitedFirst) {
				t.Fatalf("readAll: %v, want the first wait's end", a.err)
			}
			if interrupted < 5 {
				t.Fatalf("only %d signals sent during the wait; the test proves nothing", interrupted)
			}
			if a.took < first {
				t.Fatalf("the first wait ended after %s, before its %s", a.took, first)
			}
			return
		case <-tick.C:
			if time.Now().After(deadline) {
				t.Fatalf("the first wait of %s outlasted %s of signals", first, signalling)
			}
			// SIGURG is the Go runtime's own preemption signal: handled,
			// and harmless to any thread.
			if err := unix.Tgkill(unix.Getpid(), thread, unix.SIGURG); err != nil {
				t.Fatal(err)
			}
			interrupted++
		}
	}
}
