package main

import (
	"os"
	"os/exec"
	"slices"
	"strings"
	"testing"

	"github.com/istio-cni-go/istio-cni/internal/testenv"
)

func TestMain(m *testing.M) {
	testenv.RunHelperIfRequested()
	testenv.EnterNodeNamespace()
	os.Exit(m.Run())
}

// TestDemo runs the README's first command in the test suite, so the demo
// keeps doing what it says.
func TestDemo(t *testing.T) {
	if os.Getenv(testenv.NoIPv6Env) == "1" && testenv.IPv6Usable() {
		t.Fatal("the node was to have no IPv6")
	}
	if err := run(t.Context()); err != nil {
		t.Fatal(err)
	}
}

// TestDemoWithoutIPv6: the demo on a machine whose IPv6 is off (a kernel
// booted with ipv6.disable=1, or disable_ipv6 set), which it met on its
// first IPv6 step though it needs none. The test binary runs TestDemo
// again in a node namespace of its own that turns IPv6 off first.
func TestDemoWithoutIPv6(t *testing.T) {
	if os.Getenv(testenv.NoIPv6Env) == "1" {
		return
	}
	cmd := exec.CommandContext(t.Context(), os.Args[0], "-test.run=^TestDemo$", "-test.count=1", "-test.v")
	// A fresh node namespace, not this one's: the child enters its own.
	cmd.Env = slices.DeleteFunc(os.Environ(), func(kv string) bool { return strings.HasPrefix(kv, testenv.NodeNSEnv+"=") })
	cmd.Env = append(cmd.Env, testenv.NoIPv6Env+"=1")
	out, err := cmd.CombinedOutput()
	if err != nil || !strings.Contains(string(out), "--- PASS: TestDemo") {
		t.Fatalf("the demo without IPv6: %v\n%s", err, out)
	}
}
