package install

import (
	"bytes"
	"os"
	"path/filepath"
	"testing"
)

// TestSameContent compares files a block at a time: equal at every
// length around the block size, unequal in the last byte or length, a
// missing dst is not the same, a missing src is an error.
func TestSameContent(t *testing.T) {
	dir := t.TempDir()
	src, dst := filepath.Join(dir, "src"), filepath.Join(dir, "dst")
	write := func(p string, b []byte) {
		t.Helper()
		if err := os.WriteFile(p, b, 0o644); err != nil {
			t.Fatal(err)
		}
	}
	block := 64 << 10
	for _, n := range []int{0, 1, block - 1, block, block + 1, 3 * block} {
		data := bytes.Repeat([]byte{'x'}, n)
		write(src, data)
		write(dst, data)
		if same, err := sameContent(src, dst); err != nil || !same {
			t.Errorf("%d equal bytes: same %v, err %v", n, same, err)
		}
		if n > 0 {
			other := bytes.Clone(data)
			other[n-1] = 'y'
			write(dst, other)
			if same, _ := sameContent(src, dst); same {
				t.Errorf("%d bytes differing in the last: same", n)
			}
		}
		write(dst, append(bytes.Clone(data), 'x'))
		if same, _ := sameContent(src, dst); same {
			t.Errorf("dst one byte longer than %d: same", n)
		}
		if n > 0 {
			write(dst, data[:n-1])
			if same, _ := sameContent(src, dst); same {
				t.Errorf("dst one byte shorter than %d: same", n)
			}
		}
	}
	if same, err := sameContent(src, filepath.Join(dir, "none")); same || err != nil {
		t.Errorf("missing dst: same %v, err %v", same, err)
	}
	if _, err := sameContent(filepath.Join(dir, "none"), dst); err == nil {
		t.Error("missing src: no error")
	}
}
