// Package testutil has helpers shared by the project's tests.
package testutil

import (
	"os"
	"path/filepath"
	"testing"
)

// RefreshEnv, set to "true", rewrites golden files instead of comparing.
const RefreshEnv = "REFRESH_GOLDEN"

// CompareGolden compares got with testdata/<name>, or rewrites the file
// when REFRESH_GOLDEN=true.
func CompareGolden(t *testing.T, name, got string) {
	t.Helper()
	path := filepath.Join("testdata", name)
	if os.Getenv(RefreshEnv) == "true" {
		if err := os.MkdirAll(filepath.Dir(path), 0o755); err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(path, []byte(got), 0o644); err != nil {
			t.Fatal(err)
		}
		return
	}
	want, err := os.ReadFile(path)
	if err != nil {
		t.Fatalf("reading golden %s (regenerate with %s=true): %v", path, RefreshEnv, err)
	}
	if string(want) != got {
		t.Errorf("%s differs from golden (regenerate with %s=true if intended)\n--- want\n%s\n--- got\n%s", path, RefreshEnv, want, got)
	}
}
