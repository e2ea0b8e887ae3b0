package testutil

import (
	"errors"
	"fmt"
	"io/fs"
	"os"
	"os/exec"
	"strings"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/containernetworking/plugins/pkg/ns"
	"github.com/containernetworking/plugins/pkg/testutils"
)

// NewNS creates a network namespace with lo up (as a runtime leaves a pod
// namespace), removed when the test ends.
func NewNS(t testing.TB) ns.NetNS {
	t.Helper()
	RequireRoot(t)
	RequireTools(t, "ip")
	n, err := testutils.NewNS()
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = RemoveNS(n) })
	if err := n.Do(func(ns.NetNS) error { return exec.Command("ip", "link", "set", "lo", "up").Run() }); err != nil {
		t.Fatal(err)
	}
	return n
}

// RemoveNS closes a namespace made by testutils.NewNS and removes its
// mount. The mount is detached, as runtimes remove a pod's: the node agent
// may still hold the namespace open for a moment after the plugin that
// handed it over has exited, and a plain unmount then fails with EBUSY,
// leaving the mount behind (thousands of them over a few test runs, which
// every Go process then reads at start through /proc/self/mountinfo).
func RemoveNS(n ns.NetNS) error {
	_ = n.Close()
	if err := unix.Unmount(n.Path(), unix.MNT_DETACH); err != nil && !errors.Is(err, unix.EINVAL) {
		return fmt.Errorf("unmounting %s: %w", n.Path(), err)
	}
	if err := os.Remove(n.Path()); err != nil && !errors.Is(err, fs.ErrNotExist) {
		return err
	}
	return nil
}

// RunIn runs a command inside n and returns its combined output; a
// failure fails the test with the command and its output.
func RunIn(t *testing.T, n ns.NetNS, args ...string) string {
	t.Helper()
	out, err := TryRunIn(n, args...)
	if err != nil {
		t.Fatal(err)
	}
	return out
}

// TryRunIn is RunIn returning the failure, which names the command and
// carries its output.
func TryRunIn(n ns.NetNS, args ...string) (string, error) {
	var out []byte
	err := n.Do(func(ns.NetNS) error {
		var err error
		out, err = exec.Command(args[0], args[1:]...).CombinedOutput()
		return err
	})
	if err != nil {
		return "", fmt.Errorf("%s: %w: %s", strings.Join(args, " "), err, out)
	}
	return string(out), nil
}

// WaitLocalRoutes waits until every IPv6 address on lo has its local
// route: the kernel adds that route from its DAD worker, even on lo,
// where DAD itself is skipped, so a listing right after the address was
// added may lack it. A listing of a namespace to compare with another waits
// for it first.
func WaitLocalRoutes(t *testing.T, n ns.NetNS) {
	t.Helper()
	deadline := time.Now().Add(5 * time.Second)
	for {
		var missing []string
		routes := RunIn(t, n, "ip", "-6", "route", "show", "table", "local")
		for _, f := range strings.Fields(RunIn(t, n, "ip", "-6", "-o", "addr", "show", "dev", "lo")) {
			addr, _, ok := strings.Cut(f, "/")
			if !ok || !strings.Contains(addr, ":") {
				continue
			}
			if !strings.Contains("\n"+routes, "\nlocal "+addr+" ") {
				missing = append(missing, addr)
			}
		}
		if len(missing) == 0 {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("no local route for %v on lo after 5s:\n%s", missing, routes)
		}
		time.Sleep(time.Millisecond) // polling the kernel's worker, untimed
	}
}
