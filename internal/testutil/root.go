package testutil

import (
	"os"
	"os/exec"
	"testing"
)

// RequireRoot fails the test (never skips it) when it cannot touch the
// kernel: these tests are the proof that rules really work.
func RequireRoot(t testing.TB) {
	t.Helper()
	if os.Geteuid() != 0 {
		t.Fatal("this test needs root (network namespaces and netfilter); run it as root, as CI does")
	}
}

// RequireTools fails the test when a binary it drives is missing.
func RequireTools(t testing.TB, names ...string) {
	t.Helper()
	for _, n := range names {
		if _, err := exec.LookPath(n); err != nil {
			t.Fatalf("%s is required (install the Debian packages with hack/setup.sh): %v", n, err)
		}
	}
}
