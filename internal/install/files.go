package install

import (
	"bytes"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"os"
	"path/filepath"
	"strings"
	"syscall"

	"golang.org/x/sys/unix"
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
	tmp, err := writeTemp(path, data, mode, uid, gid)
	if err != nil {
		return err
	}
	if err := os.Rename(tmp, path); err != nil {
		_ = os.Remove(tmp)
		return fmt.Errorf("writing %s: %w", path, err)
	}
	return syncDir(filepath.Dir(path))
}

// writeTemp writes data into a new temp file beside path, synced, with
// the given mode and (uid >= 0) owner, and returns its name.
func writeTemp(path string, data []byte, mode os.FileMode, uid, gid int) (string, error) {
	tmp := tempName(path)
	var err error
	if mode&0o111 != 0 {
		err = writeExecutable(tmp, data, mode)
	} else {
		var f *os.File
		if f, err = openFile(tmp, os.O_WRONLY|os.O_CREATE|os.O_EXCL, mode); err != nil {
			return "", fmt.Errorf("creating temp file for %s: %w", path, err)
		}
		err = writeSyncClose(f, bytes.NewReader(data))
	}
	if err == nil {
		err = os.Chmod(tmp, mode)
	}
	if err == nil && uid >= 0 {
		// Without CAP_CHOWN (the chart does not grant it, as Istio's
		// does not) a file of another owner cannot be given back to it:
		// it is then ours, as Istio's installer always leaves it, rather
		// than never written.
		if cerr := os.Chown(tmp, uid, gid); cerr != nil && !errors.Is(cerr, fs.ErrPermission) {
			err = cerr
		}
	}
	if err != nil {
		_ = os.Remove(tmp)
		return "", fmt.Errorf("writing %s: %w", path, err)
	}
	return tmp, nil
}

// ErrChanged means another writer changed the file between our read and
// our write; nothing of theirs was lost, and the caller reads it again.
var ErrChanged = errors.New("changed by another writer while being rewritten")

// exchangeUnsupported: the file system cannot swap two names atomically.
func exchangeUnsupported(err error) bool {
	return errors.Is(err, unix.EINVAL) || errors.Is(err, unix.ENOSYS) || errors.Is(err, unix.EOPNOTSUPP)
}

// ReplaceIfUnchanged replaces path, whose content was base when the
// caller read it, with data (mode, and owner when uid >= 0), as a
// compare-and-swap: when another writer replaced or rewrote the file since
// (a CNI agent putting its own config back), ErrChanged is returned and
// that writer's file is what path holds.
//
// The new file is swapped in with RENAME_EXCHANGE, so the file it
// displaced is in our hands afterwards and can be compared with base: a
// write that landed between our read and the swap is put back, never
// lost. Where the file system cannot exchange, the file is compared just
// before a plain rename instead. Either way a reader of path always finds
// a complete file, old or new.
func ReplaceIfUnchanged(path string, base, data []byte, mode os.FileMode, uid, gid int) error {
	tmp, err := writeTemp(path, data, mode, uid, gid)
	if err != nil {
		return err
	}
	defer os.Remove(tmp)
	err = unix.Renameat2(unix.AT_FDCWD, tmp, unix.AT_FDCWD, path, unix.RENAME_EXCHANGE)
	switch {
	case errors.Is(err, unix.ENOENT):
		return ErrChanged
	case err != nil && exchangeUnsupported(err):
		if cur, err := readFile(path); err != nil || !bytes.Equal(cur, base) {
			return ErrChanged
		}
		if err := os.Rename(tmp, path); err != nil {
			return fmt.Errorf("writing %s: %w", path, err)
		}
		return syncDir(filepath.Dir(path))
	case err != nil:
		return fmt.Errorf("writing %s: %w", path, err)
	}
	if displaced, err := readFile(tmp); err == nil && bytes.Equal(displaced, base) {
		if err := os.Remove(tmp); err != nil {
			return fmt.Errorf("removing the old %s: %w", path, err)
		}
		return syncDir(filepath.Dir(path))
	}
	// Another writer got in between: its file is newer than the one ours
	// was made from. Swap it back.
	if err := unix.Renameat2(unix.AT_FDCWD, tmp, unix.AT_FDCWD, path, unix.RENAME_EXCHANGE); err != nil {
		// The file was deleted meanwhile: that is the newest word.
		return ErrChanged
	}
	// A write newer still may have landed between the two swaps; it
	// supersedes the one just put back, so it goes back in its place.
	if back, err := readFile(tmp); err == nil && !bytes.Equal(back, data) {
		_ = unix.Renameat2(unix.AT_FDCWD, tmp, unix.AT_FDCWD, path, unix.RENAME_EXCHANGE)
	}
	_ = syncDir(filepath.Dir(path))
	return ErrChanged
}

// CreateExclusive writes a new file at path, complete before it appears;
// ErrChanged when path exists (someone else created it first).
func CreateExclusive(path string, data []byte, mode os.FileMode, uid, gid int) error {
	tmp, err := writeTemp(path, data, mode, uid, gid)
	if err != nil {
		return err
	}
	defer os.Remove(tmp)
	err = unix.Renameat2(unix.AT_FDCWD, tmp, unix.AT_FDCWD, path, unix.RENAME_NOREPLACE)
	if err != nil && exchangeUnsupported(err) {
		err = os.Link(tmp, path)
	}
	switch {
	case errors.Is(err, fs.ErrExist):
		return ErrChanged
	case err != nil:
		return fmt.Errorf("creating %s: %w", path, err)
	}
	return syncDir(filepath.Dir(path))
}

// RemoveIfUnchanged deletes path if it still holds base: it is moved
// aside first (atomically), compared, and put back when another writer
// changed it since the caller read it (ErrChanged).
func RemoveIfUnchanged(path string, base []byte) error {
	aside := tempName(path)
	if err := os.Rename(path, aside); err != nil {
		if errors.Is(err, fs.ErrNotExist) {
			return ErrChanged
		}
		return fmt.Errorf("removing %s: %w", path, err)
	}
	if cur, err := readFile(aside); err == nil && bytes.Equal(cur, base) {
		if err := os.Remove(aside); err != nil {
			return fmt.Errorf("removing %s: %w", path, err)
		}
		return syncDir(filepath.Dir(path))
	}
	// Put the newer content back, unless an even newer file took the name.
	err := unix.Renameat2(unix.AT_FDCWD, aside, unix.AT_FDCWD, path, unix.RENAME_NOREPLACE)
	if err != nil && exchangeUnsupported(err) {
		if err = os.Link(aside, path); err == nil {
			err = os.Remove(aside)
		}
	}
	if err != nil {
		_ = os.Remove(aside)
	}
	return ErrChanged
}

// LinkError says why a config file that is a symbolic link is not
// written through.
type LinkError struct {
	Path, Target, Why string
}

func (e *LinkError) Error() string {
	return fmt.Sprintf("%s is a symbolic link to %s, which %s: the agent writes only through a relative link to a file in the same "+
		"config dir (an absolute link is resolved in the agent's container, where the host's paths differ); "+
		"make the link relative and inside the dir, or replace it with the file", e.Path, e.Target, e.Why)
}

// ResolveInDir returns the file that path stands for: path itself, or the
// regular file inside dir that the relative symbolic link path leads to.
// Other links are refused with a LinkError; a link that leads nowhere is
// reported as fs.ErrNotExist, as a runtime skips it.
func ResolveInDir(dir, path string) (string, error) {
	fi, err := os.Lstat(path)
	if err != nil {
		return "", err
	}
	if fi.Mode()&os.ModeSymlink == 0 {
		return path, nil
	}
	target, err := os.Readlink(path)
	if err != nil {
		return "", err
	}
	if filepath.IsAbs(target) {
		return "", &LinkError{Path: path, Target: target, Why: "is absolute"}
	}
	resolved, err := filepath.EvalSymlinks(path)
	if err != nil {
		return "", fmt.Errorf("%s: %w", path, fs.ErrNotExist)
	}
	realDir, err := filepath.EvalSymlinks(dir)
	if err != nil {
		return "", err
	}
	if rel, err := filepath.Rel(realDir, resolved); err != nil || rel == ".." || strings.HasPrefix(rel, ".."+string(filepath.Separator)) {
		return "", &LinkError{Path: path, Target: target, Why: "leads outside " + dir}
	}
	if fi, err := os.Stat(resolved); err != nil || !fi.Mode().IsRegular() {
		return "", &LinkError{Path: path, Target: target, Why: "is not a regular file"}
	}
	return resolved, nil
}

// writeExecutable writes a binary to the new file tmp. A child the agent
// forks (an iptables command) holds a copy of every descriptor until its
// own exec closes it; had it one open for writing to this file, a runtime
// running the binary just installed would fail with "text file busy", and
// the pod's ADD with it. So forking waits while the file is open for
// writing, and the file is synced through a read-only descriptor after,
// as the sync can take long on a busy disk.
func writeExecutable(tmp string, data []byte, mode os.FileMode) error {
	err := func() error {
		syscall.ForkLock.RLock()
		defer syscall.ForkLock.RUnlock()
		f, err := openFile(tmp, os.O_WRONLY|os.O_CREATE|os.O_EXCL, mode)
		if err != nil {
			return err
		}
		_, err = f.Write(data)
		return errors.Join(err, f.Close())
	}()
	if err != nil {
		return err
	}
	f, err := open(tmp)
	if err != nil {
		return err
	}
	return errors.Join(f.Sync(), f.Close())
}

func writeSyncClose(f *os.File, r io.Reader) error {
	_, err := io.Copy(f, r)
	if err == nil {
		err = f.Sync()
	}
	return errors.Join(err, f.Close())
}

func syncDir(dir string) error {
	d, err := open(dir)
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

// sameContent reports whether dst holds src's bytes, reading both a
// block at a time. Every install pass checks the binaries: reading them
// whole (about 12 MB each side) made each pass tens of MB of garbage, and
// the agent's resident memory jumped by as much after every resync. An
// error is src's; a dst that cannot be read is not the same.
func sameContent(src, dst string) (bool, error) {
	s, err := open(src)
	if err != nil {
		return false, err
	}
	defer s.Close()
	d, err := open(dst)
	if err != nil {
		return false, nil
	}
	defer d.Close()
	a, b := make([]byte, 64<<10), make([]byte, 64<<10)
	for {
		n, errS := io.ReadFull(s, a)
		if errS != nil && errS != io.EOF && errS != io.ErrUnexpectedEOF {
			return false, errS
		}
		m, errD := io.ReadFull(d, b)
		if errD != nil && errD != io.EOF && errD != io.ErrUnexpectedEOF {
			return false, nil
		}
		if n != m || !bytes.Equal(a[:n], b[:m]) {
			return false, nil
		}
		if errS != nil {
			// Both ended at the same length with the same bytes.
			return errD != nil, nil
		}
	}
}

// CopyFileAtomic installs src at dst (mode 0755 for binaries): the new
// binary appears under its name only once complete, so a runtime never
// executes a half-written file. An identical dst is left alone.
func CopyFileAtomic(src, dst string, mode os.FileMode) (bool, error) {
	same, err := sameContent(src, dst)
	if err != nil {
		return false, fmt.Errorf("reading %s: %w", src, err)
	}
	if same {
		if fi, err := os.Stat(dst); err == nil && fi.Mode().Perm() == mode {
			return false, nil
		}
	}
	data, err := readFile(src)
	if err != nil {
		return false, fmt.Errorf("reading %s: %w", src, err)
	}
	if err := WriteFileAtomic(dst, data, mode, false); err != nil {
		return false, err
	}
	return true, nil
}
