package prepared

import (
	"bytes"
	"encoding/binary"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"strings"
	"syscall"
	"time"
)

// Dir is the records' directory as the agent keeps it. Only root reads
// or writes there: a record decides what rules a pod gets.
type Dir string

// Reset empties the directory of records (an earlier agent's may be of
// pods it decided under other settings), making it when missing; the
// configs an agent learnt (SaveConfigs) stay.
//
// Anything else of that name (a link, a file, a directory another user
// owns, who could plant records in it) is removed first, not followed.
func (d Dir) Reset() error {
	if fi, err := os.Lstat(string(d)); err == nil {
		st, ok := fi.Sys().(*syscall.Stat_t)
		if !fi.IsDir() || !ok || st.Uid != uint32(os.Geteuid()) { //nolint:gosec // G115: a uid
			if err := os.RemoveAll(string(d)); err != nil {
				return err
			}
		}
	}
	entries, err := os.ReadDir(string(d))
	if errors.Is(err, fs.ErrNotExist) {
		return os.Mkdir(string(d), 0o700)
	}
	if err != nil {
		return err
	}
	for _, e := range entries {
		if e.Name() != configsName {
			if err := os.RemoveAll(filepath.Join(string(d), e.Name())); err != nil {
				return err
			}
		}
	}
	return os.Chmod(string(d), 0o700) //nolint:gosec // G302: a directory, which root alone enters
}

// configsName is the file of the learnt configs; no UID names it.
const configsName = ".configs"

// waitName is the file of the agent's wait (SetAgentWait); no UID names it.
const waitName = ".agent-wait"

// maxWait bounds the wait a relay reads: beyond it the relay waits as long
// as the agent takes.
const maxWait = time.Minute

// SetAgentWait tells relays how long to wait for the agent's answer to an
// ADD they have no record for before they run the fallback instead
// (cnirelay.Request.MayLeave); 0 removes it, and relays then wait as long
// as the agent takes.
func (d Dir) SetAgentWait(w time.Duration) error {
	if w <= 0 || w > maxWait {
		err := os.Remove(filepath.Join(string(d), waitName))
		if errors.Is(err, fs.ErrNotExist) {
			return nil
		}
		return err
	}
	return d.write(waitName, []byte(w.String()))
}

// AgentWait is the wait SetAgentWait left in dir, 0 when there is none or
// it does not read.
func AgentWait(dir string) time.Duration {
	// At most 31 bytes: longer than any duration SetAgentWait writes.
	b, err := readFile(filepath.Join(dir, waitName), 31, "the agent's wait")
	if err != nil {
		return 0
	}
	w, err := time.ParseDuration(string(b))
	if err != nil || w <= 0 || w > maxWait {
		return 0
	}
	return w
}

// aliveName is the file a running agent renews (Beat); no UID names it.
const aliveName = ".agent-alive"

// A running agent renews the file every BeatEvery; relays use its records
// until AliveFor after the last renewal. Records stay when an agent stops
// (a rollout: pods starting before the next agent still find theirs), but
// only an agent keeps them up to date with their pods: one stopped for
// longer, or crashed, may have missed an annotation's change, and the
// fallback reads the pod as it is now.
const (
	BeatEvery = 10 * time.Second
	AliveFor  = time.Minute
)

// Beat tells relays that the agent keeping the records is running.
func (d Dir) Beat() error { return d.write(aliveName, nil) }

// AgentSeen says how long ago the agent last renewed its file (Beat), at
// now; false when there is none. A renewal after now (the clock set back)
// gives a negative duration.
func AgentSeen(dir string, now time.Time) (time.Duration, bool) {
	fi, err := os.Lstat(filepath.Join(dir, aliveName))
	if err != nil || !fi.Mode().IsRegular() {
		return 0, false
	}
	return now.Sub(fi.ModTime()), true
}

// configsMagic starts the configs file; the number is its form's version.
const configsMagic = "istio-cni prepared configs 1\n"

// SaveConfigs keeps the canonical configs an agent learnt, for the next
// agent on the node to prepare pods under from its start, instead of
// after the first ADDs it serves (an agent restarted by an upgrade, with
// pods waiting).
func (d Dir) SaveConfigs(configs [][]byte) error {
	b := []byte(configsMagic)
	for _, c := range configs {
		b = append(binary.BigEndian.AppendUint32(b, uint32(len(c))), c...)
	}
	return d.write(configsName, b)
}

// LoadConfigs returns the configs SaveConfigs kept, none when there are
// none or they do not read. Relays read them too (Knows), so not through a
// link and not from anything but a regular file.
func (d Dir) LoadConfigs() [][]byte {
	b, err := readFile(filepath.Join(string(d), configsName), MaxRecord, "the learnt configs")
	if err != nil || !strings.HasPrefix(string(b), configsMagic) {
		return nil
	}
	b = b[len(configsMagic):]
	var out [][]byte
	for len(b) > 0 {
		if len(b) < 4 || uint64(binary.BigEndian.Uint32(b)) > uint64(len(b)-4) {
			return nil
		}
		n := binary.BigEndian.Uint32(b)
		out = append(out, b[4:4+n:4+n])
		b = b[4+n:]
	}
	return out
}

// Knows reports whether canonical is one of the configs the agent keeps
// (SaveConfigs): a config that passed the checks the plugin puts its
// config to, in sidecar mode (the agent keeps no ambient config).
func (d Dir) Knows(canonical []byte) bool {
	for _, c := range d.LoadConfigs() {
		if bytes.Equal(c, canonical) {
			return true
		}
	}
	return false
}

// Put writes a record whole or not at all: a relay reads either the
// previous record or the new one, never part of one.
func (d Dir) Put(r *Record) error {
	data, err := r.MarshalBinary()
	if err != nil {
		return err
	}
	return d.PutData(r.UID, data)
}

// PutData is Put of a record already marshalled, for pod uid.
func (d Dir) PutData(uid string, data []byte) error {
	if !ValidUID(uid) {
		return fmt.Errorf("pod UID %q cannot name a record", uid)
	}
	return d.write(uid, data)
}

// write replaces the file name in the directory with data, whole, mode
// 0600.
func (d Dir) write(name string, data []byte) error { return d.writeMode(name, data, 0o600) }

// writeMode is write with the file's mode.
func (d Dir) writeMode(name string, data []byte, mode os.FileMode) error {
	f, err := os.CreateTemp(string(d), ".new-")
	if err != nil {
		return err
	}
	// The run directory is a tmpfs: a record lost to a crash only sends
	// its pod the slow way, so it is not synced.
	_, werr := f.Write(data)
	var merr error
	if mode != 0o600 { // CreateTemp's own
		merr = f.Chmod(mode)
	}
	cerr := f.Close()
	if err := errors.Join(werr, merr, cerr); err != nil {
		_ = os.Remove(f.Name())
		return err
	}
	if err := os.Rename(f.Name(), filepath.Join(string(d), name)); err != nil {
		_ = os.Remove(f.Name())
		return err
	}
	return nil
}

// Remove removes uid's record; a missing one is no error.
func (d Dir) Remove(uid string) error {
	if !ValidUID(uid) {
		return nil
	}
	err := os.Remove(Path(string(d), uid))
	if errors.Is(err, fs.ErrNotExist) {
		return nil
	}
	return err
}
