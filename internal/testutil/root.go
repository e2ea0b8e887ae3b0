package testutil

import (
	"os"
	"os/exec"
	"testing"
)

// UnitOnlyEnv, set to 1 by `make unit`, skips the tests that need root or
// the tools `make setup` installs. Nothing else sets it: `make test` (and
// so CI) runs every test, and there a missing root fails loudly.
const UnitOnlyEnv = "ISTIO_CNI_UNIT_ONLY"

// RequireRoot fails the test (never skips it) when it cannot touch the
// kernel: these tests are the proof that rules really work.
func RequireRoot(t testing.TB) {
	t.Helper()
	if os.Getenv(UnitOnlyEnv) == "1" {
		t.Skip("needs root; `make test` runs it")
	}
	if os.Geteuid() != 0 {
		t.Fatal("this test needs root (network namespaces and netfilter); run it as root, as CI does")
	}
}

// RequireTools fails the test when a binary it drives is missing.
func RequireTools(t testing.TB, names ...string) {
	t.Helper()
	if os.Getenv(UnitOnlyEnv) == "1" {
		t.Skip("needs tools from make setup; `make test` runs it")
	}
	for _, n := range names {
		if _, err := exec.LookPath(n); err != nil {
			t.Fatalf("%s is required (install the Debian packages with hack/setup.sh): %v", n, err)
		}
	}
}
