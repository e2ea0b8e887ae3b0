package prepared

import (
	"os"
	"path/filepath"
	"testing"
)

// TestForcedVariantFile: what the agent says is read back; saying nothing
// removes it; a file another user could have written, a link, or a
// value that is no variant is taken as nothing said.
func TestForcedVariantFile(t *testing.T) {
	dir := t.TempDir()
	path := filepath.Join(dir, VariantName)
	if got := ReadForcedVariant(dir); got != "" {
		t.Fatalf("nothing said: %q", got)
	}
	for _, v := range []string{"legacy", "nft"} {
		if err := WriteForcedVariant(dir, v); err != nil {
			t.Fatal(err)
		}
		if got := ReadForcedVariant(dir); got != v {
			t.Fatalf("said %q, read %q", v, got)
		}
	}
	if fi, err := os.Stat(path); err != nil || fi.Mode().Perm() != 0o644 {
		t.Fatalf("the file: %v, %v", fi, err)
	}
	if err := os.Chmod(path, 0o666); err != nil {
		t.Fatal(err)
	}
	if got := ReadForcedVariant(dir); got != "" {
		t.Fatalf("a world-writable file read as %q", got)
	}
	if err := WriteForcedVariant(dir, ""); err != nil {
		t.Fatal(err)
	}
	if _, err := os.Lstat(path); !os.IsNotExist(err) {
		t.Fatalf("after saying nothing: %v", err)
	}
	if err := WriteForcedVariant(dir, ""); err != nil {
		t.Fatalf("saying nothing twice: %v", err)
	}
	other := filepath.Join(t.TempDir(), "v")
	if err := os.WriteFile(other, []byte("legacy\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	if err := os.Symlink(other, path); err != nil {
		t.Fatal(err)
	}
	if got := ReadForcedVariant(dir); got != "" {
		t.Fatalf("a link read as %q", got)
	}
	if err := os.Remove(path); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(path, []byte("iptables\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	if got := ReadForcedVariant(dir); got != "" {
		t.Fatalf("no variant read as %q", got)
	}
	entries, _ := os.ReadDir(dir)
	if len(entries) != 1 {
		t.Fatalf("left in the run dir: %v", entries)
	}
}
