package nlsteps_test

import (
	"errors"
	"os"
	"path/filepath"
	"slices"
	"testing"

	"github.com/containernetworking/plugins/pkg/ns"
	"github.com/vishvananda/netlink"
	"golang.org/x/sys/unix"

	"github.com/istio-cni-go/istio-cni/internal/nlsteps"
	"github.com/istio-cni-go/istio-cni/internal/testutil"
)

// TestKept: the kept socket is made once in the namespace its path names
// and used again by later calls, made anew when the path comes to name
// another namespace (a node's namespace file made again) and after a
// call fails with it; requests on it reach its namespace, not the
// caller's.
func TestKept(t *testing.T) {
	testutil.RequireRoot(t)
	var paths []string
	for _, name := range []string{"kept-a", "kept-b"} {
		n := testutil.NewNS(t)
		if err := n.Do(func(ns.NetNS) error {
			return netlink.LinkAdd(&netlink.Veth{LinkAttrs: netlink.LinkAttrs{Name: name}, PeerName: name + "p"})
		}); err != nil {
			t.Fatal(err)
		}
		paths = append(paths, n.Path())
	}
	link := filepath.Join(t.TempDir(), "node")
	point := func(target string) {
		t.Helper()
		_ = os.Remove(link)
		if err := os.Symlink(target, link); err != nil {
			t.Fatal(err)
		}
	}
	var k nlsteps.Kept
	defer k.Close()
	// do dumps the links seen through the kept socket, and returns the
	// socket it was given.
	do := func(want string) *nlsteps.Conn {
		t.Helper()
		var got *nlsteps.Conn
		if err := k.Do(link, unix.NETLINK_ROUTE, func(c *nlsteps.Conn) error {
			got = c
			msgs, err := c.Request(unix.RTM_GETLINK, unix.NLM_F_DUMP, ifinfo(0))
			if err != nil {
				return err
			}
			if names := linkNames(t, msgs); !slices.Contains(names, want) {
				t.Errorf("links through the kept socket: %v, want %s among them", names, want)
			}
			return nil
		}); err != nil {
			t.Fatal(err)
		}
		return got
	}

	point(paths[0])
	first := do("kept-a")
	if again := do("kept-a"); again != first {
		t.Error("a second call made a new socket")
	}
	point(paths[1])
	second := do("kept-b")
	if second == first {
		t.Error("the path names another namespace, and the old socket was used")
	}
	failed := errors.New("refused")
	if err := k.Do(link, unix.NETLINK_ROUTE, func(*nlsteps.Conn) error { return failed }); !errors.Is(err, failed) {
		t.Fatalf("the call's error: %v", err)
	}
	if after := do("kept-b"); after == second {
		t.Error("the socket a call failed with was kept")
	}
	if err := k.Do(filepath.Join(t.TempDir(), "none"), unix.NETLINK_ROUTE, func(*nlsteps.Conn) error { return nil }); err == nil {
		t.Error("a path that names nothing gave no error")
	}

	// Another protocol is another socket.
	var nf *nlsteps.Conn
	if err := k.Do(link, unix.NETLINK_NETFILTER, func(c *nlsteps.Conn) error { nf = c; return nil }); err != nil {
		t.Fatal(err)
	}
	if nf == nil || nf == second {
		t.Error("a netfilter request was given the routing socket")
	}
	// A caller on a thread in a third namespace still reaches the kept
	// socket's.
	third := testutil.NewNS(t)
	var msgs []nlsteps.Message
	if err := third.Do(func(ns.NetNS) error {
		return k.Do(link, unix.NETLINK_ROUTE, func(c *nlsteps.Conn) (err error) {
			msgs, err = c.Request(unix.RTM_GETLINK, unix.NLM_F_DUMP, ifinfo(0))
			return err
		})
	}); err != nil {
		t.Fatal(err)
	}
	if names := linkNames(t, msgs); !slices.Contains(names, "kept-b") {
		t.Errorf("links through the kept socket from a third namespace: %v", names)
	}
}
