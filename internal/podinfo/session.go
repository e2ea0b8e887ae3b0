package podinfo

import (
	"bytes"
	"crypto/tls"
	"encoding/binary"
	"errors"
	"os"
	"path/filepath"
)

// fileSessionCache keeps one TLS session with the API server in a file,
// so that each plugin process (one per pod) resumes the session instead of
// doing a full handshake: no certificate verification, no server
// signature, a fraction of the CPU on both sides. The file is as secret as
// the kubeconfig next to it and gets the same 0600 mode. Any problem with
// it just means a full handshake.
type fileSessionCache struct {
	path string
}

const sessionMagic = "icni-tls1"

func (c *fileSessionCache) Get(key string) (*tls.ClientSessionState, bool) {
	data, err := readSmallFile(c.path)
	if err != nil {
		return nil, false
	}
	fields, ok := splitFields(data, 4)
	if !ok || string(fields[0]) != sessionMagic || string(fields[1]) != key {
		return nil, false
	}
	state, err := tls.ParseSessionState(fields[3])
	if err != nil {
		return nil, false
	}
	cs, err := tls.NewResumptionState(fields[2], state)
	if err != nil {
		return nil, false
	}
	return cs, true
}

func (c *fileSessionCache) Put(key string, cs *tls.ClientSessionState) {
	if cs == nil {
		return
	}
	ticket, state, err := cs.ResumptionState()
	if err != nil || state == nil {
		return
	}
	stateBytes, err := state.Bytes()
	if err != nil {
		return
	}
	_ = writeFileAtomic(c.path, joinFields([]byte(sessionMagic), []byte(key), ticket, stateBytes), 0o600)
}

// joinFields frames fields as splitFields reads them: each a 4-byte
// big-endian length, then its bytes.
func joinFields(fields ...[]byte) []byte {
	var buf bytes.Buffer
	for _, f := range fields {
		_ = binary.Write(&buf, binary.BigEndian, uint32(len(f)))
		buf.Write(f)
	}
	return buf.Bytes()
}

func splitFields(data []byte, n int) ([][]byte, bool) {
	out := make([][]byte, 0, n)
	for i := 0; i < n; i++ {
		if len(data) < 4 {
			return nil, false
		}
		l := binary.BigEndian.Uint32(data)
		data = data[4:]
		if uint64(l) > uint64(len(data)) {
			return nil, false
		}
		out = append(out, data[:l])
		data = data[l:]
	}
	return out, len(data) == 0
}

// writeFileAtomic replaces path so that concurrent readers (other plugin
// processes) see the old or the new content, never a partial one.
func writeFileAtomic(path string, data []byte, mode os.FileMode) error {
	f, err := os.CreateTemp(filepath.Dir(path), "."+filepath.Base(path)+".tmp-*")
	if err != nil {
		return err
	}
	tmp := f.Name()
	_, werr := f.Write(data)
	cerr := f.Close()
	if err := errors.Join(werr, cerr, os.Chmod(tmp, mode)); err != nil {
		_ = os.Remove(tmp)
		return err
	}
	if err := os.Rename(tmp, path); err != nil {
		_ = os.Remove(tmp)
		return err
	}
	return nil
}
