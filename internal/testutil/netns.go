package testutil

import (
	"os/exec"
	"testing"

	"github.com/containernetworking/plugins/pkg/ns"
	"github.com/containernetworking/plugins/pkg/testutils"
)

// NewNS creates a network namespace with lo up (as a runtime leaves a pod
// namespace), removed when the test ends.
func NewNS(t *testing.T) ns.NetNS {
	t.Helper()
	RequireRoot(t)
	RequireTools(t, "ip")
	n, err := testutils.NewNS()
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		_ = n.Close()
		_ = testutils.UnmountNS(n)
	})
	if err := n.Do(func(ns.NetNS) error { return exec.Command("ip", "link", "set", "lo", "up").Run() }); err != nil {
		t.Fatal(err)
	}
	return n
}
