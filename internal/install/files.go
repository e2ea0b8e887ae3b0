package install

import (
	"bytes"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"strings"
	"syscall"
)

// tempMarker is in the name of every temp file we create, so that stale
// ones (left by a crash) can be found and removed. The names start with a
// dot and end in .tmp: runtimes only load .conf, .conflist and .json.
const tempMarker = ".istio-cni-tmp-"

func tempName(path string) string {
	var b [6]byte
	_, _ = rand.Read(b[:])
	return filepath.Join(filepath.Dir(path), "."+filepath.Base(path)+tempMarker+hex.EncodeToString(b[:])+".tmp")
}

// WriteFileAtomic replaces path with data so that a crash at any instant
// leaves either the old or the new complete file: temp file in the same
// directory, fsync, rename, directory fsync. The mode is mode, or the
// existing file's mode and owner when keep is set and the file exists.
func WriteFileAtomic(path string, data []byte, mode os.FileMode, keep bool) error {
	uid, gid := -1, -1
	if keep {
		if fi, err := os.Stat(path); err == nil {
			mode = fi.Mode().Perm()
			if st, ok := fi.Sys().(*syscall.Stat_t); ok {
				uid, gid = int(st.Uid), int(st.Gid)
			}
		}
	}
	tmp := tempName(path)
	f, err := os.OpenFile(tmp, os.O_WRONLY|os.O_CREATE|os.O_EXCL, mode)
	if err != nil {
		return fmt.Errorf("creating temp file for %s: %w", path, err)
	}
	err = writeSyncClose(f, bytes.NewReader(data))
	if err == nil {
		err = os.Chmod(tmp, mode)
	}
	if err == nil && uid >= 0 {
		err = os.Chown(tmp, uid, gid)
	}
	if err == nil {
		err = os.Rename(tmp, path)
	}
	if err != nil {
		_ = os.Remove(tmp)
		return fmt.Errorf("writing %s: %w", path, err)
	}
	return syncDir(filepath.Dir(path))
}

func writeSyncClose(f *os.File, r io.Reader) error {
	_, err := io.Copy(f, r)
	if err == nil {
		err = f.Sync()
	}
	return errors.Join(err, f.Close())
}

func syncDir(dir string) error {
	d, err := os.Open(dir)
	if err != nil {
		return err
	}
	defer d.Close()
	if err := d.Sync(); err != nil && !errors.Is(err, syscall.EINVAL) {
		return fmt.Errorf("syncing %s: %w", dir, err)
	}
	return nil
}

// RemoveStaleTemps deletes temp files a crashed run left in dir.
func RemoveStaleTemps(dir string) ([]string, error) {
	entries, err := os.ReadDir(dir)
	if err != nil {
		return nil, err
	}
	var removed []string
	for _, e := range entries {
		if strings.Contains(e.Name(), tempMarker) {
			p := filepath.Join(dir, e.Name())
			if err := os.Remove(p); err != nil && !os.IsNotExist(err) {
				return removed, err
			}
			removed = append(removed, p)
		}
	}
	return removed, nil
}

// CopyFileAtomic installs src at dst (mode 0755 for binaries): the new
// binary appears under its name only once complete, so a runtime never
// executes a half-written file. An identical dst is left alone.
func CopyFileAtomic(src, dst string, mode os.FileMode) (bool, error) {
	data, err := os.ReadFile(src)
	if err != nil {
		return false, fmt.Errorf("reading %s: %w", src, err)
	}
	if cur, err := os.ReadFile(dst); err == nil && bytes.Equal(cur, data) {
		if fi, err := os.Stat(dst); err == nil && fi.Mode().Perm() == mode {
			return false, nil
		}
	}
	if err := WriteFileAtomic(dst, data, mode, false); err != nil {
		return false, err
	}
	return true, nil
}
