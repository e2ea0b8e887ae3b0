// Package prepared carries a pod's ADD, decided and prepared by the node
// agent before the pod's sandbox exists, to the relay that serves the ADD.
//
// The agent's informer sees a pod when it is bound to the node, a
// sandbox's creation before its ADD. The agent then decides the pod as
// the ADD would and prepares its rules as netlink requests, and leaves
// them in a record in the run directory, named by the pod's UID. The
// relay, which the runtime starts in its own cgroup, finds the record,
// checks that it was made for this pod and this plugin config, and
// serves the ADD from it with no round trip to the agent: on a busy node
// the agent's container, weighted by its small CPU request, no longer
// sits on any pod's start. Without a record (an agent that has not seen
// the pod yet, a config it has not learnt, a namespace that holds rules
// already) the relay asks the agent as before.
//
// The package is the record's form, the config's canonical form both
// sides compare, and the directory; it imports nothing a relay process
// would not start anyway.
package prepared

import (
	"bytes"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"os"
	"path/filepath"
	"strings"
	"syscall"
)

// DirName is the records' directory in the plugin's run directory.
const DirName = "prepared"

// MaxRecord bounds a record, for the reader and the writer: a pod with
// thousands of excluded ranges prepares to a few hundred KiB.
const MaxRecord = 4 << 20

// Record is what the agent prepared for one pod: an entry per plugin
// config it has learnt.
type Record struct {
	Namespace, Name, UID string
	Entries              []Entry
}

// Entry is a pod's ADD under one plugin config.
type Entry struct {
	// Config is the config's canonical form (Canonical).
	Config []byte
	// Skip, when set, says why the pod gets no rules; the ADD then only
	// passes the previous result on.
	Skip string
	// Mode is the pod's interception mode, for the log.
	Mode string
	// Kind is what wrote the requests (nsfacts.KindIPTablesNFT or
	// KindNFTables): what of a namespace's contents keeps them out.
	Kind string
	// IPSets says the requests make ipsets.
	IPSets bool
	// DualStack is the pod's ISTIO_DUAL_STACK, for nsfacts.NeedsIPv6.
	DualStack bool
	// Txn4 and Txn46 are the requests (nlsteps.Txn, binary) for a pod
	// with IPv4 rules only and with IPv6 rules as well.
	Txn4, Txn46 []byte
}

// magic starts a record; the number is its form's version.
const magic = "istio-cni prepared 1\n"

// MarshalBinary writes the record: magic, then each field as a 4-byte
// big-endian length and its bytes (flags as one byte), entries counted.
func (r *Record) MarshalBinary() ([]byte, error) {
	b := []byte(magic)
	field := func(s []byte) { b = append(binary.BigEndian.AppendUint32(b, uint32(len(s))), s...) }
	flag := func(v bool) {
		if v {
			b = append(b, 1)
		} else {
			b = append(b, 0)
		}
	}
	field([]byte(r.Namespace))
	field([]byte(r.Name))
	field([]byte(r.UID))
	b = binary.BigEndian.AppendUint32(b, uint32(len(r.Entries)))
	for i := range r.Entries {
		e := &r.Entries[i]
		field(e.Config)
		field([]byte(e.Skip))
		field([]byte(e.Mode))
		field([]byte(e.Kind))
		flag(e.IPSets)
		flag(e.DualStack)
		field(e.Txn4)
		field(e.Txn46)
	}
	if len(b) > MaxRecord {
		return nil, fmt.Errorf("a record of %d bytes, over %d", len(b), MaxRecord)
	}
	return b, nil
}

// UnmarshalBinary reads a record MarshalBinary wrote; its byte fields
// share data's memory.
func (r *Record) UnmarshalBinary(data []byte) error {
	if !strings.HasPrefix(string(data), magic) {
		return errors.New("not a prepared record of this version")
	}
	rest := data[len(magic):]
	short := false
	field := func() []byte {
		if short || len(rest) < 4 || uint64(binary.BigEndian.Uint32(rest)) > uint64(len(rest)-4) {
			short = true
			return nil
		}
		n := binary.BigEndian.Uint32(rest)
		f := rest[4 : 4+n : 4+n]
		rest = rest[4+n:]
		if n == 0 {
			return nil
		}
		return f
	}
	flag := func() bool {
		if short || len(rest) < 1 || rest[0] > 1 {
			short = true
			return false
		}
		v := rest[0] == 1
		rest = rest[1:]
		return v
	}
	*r = Record{Namespace: string(field()), Name: string(field()), UID: string(field())}
	if short || len(rest) < 4 {
		return errors.New("a prepared record cut short")
	}
	n := binary.BigEndian.Uint32(rest)
	rest = rest[4:]
	// Each entry takes at least its six lengths and two flags.
	if uint64(n)*26 > uint64(len(rest)) {
		return errors.New("a prepared record cut short")
	}
	r.Entries = make([]Entry, n)
	for i := range r.Entries {
		e := &r.Entries[i]
		e.Config = field()
		e.Skip, e.Mode, e.Kind = string(field()), string(field()), string(field())
		e.IPSets, e.DualStack = flag(), flag()
		e.Txn4, e.Txn46 = field(), field()
	}
	switch {
	case short:
		return errors.New("a prepared record cut short")
	case len(rest) > 0:
		return fmt.Errorf("%d bytes after a prepared record", len(rest))
	}
	return nil
}

// Find is the entry for a canonical config, nil when there is none.
func (r *Record) Find(config []byte) *Entry {
	for i := range r.Entries {
		if bytes.Equal(r.Entries[i].Config, config) {
			return &r.Entries[i]
		}
	}
	return nil
}

// ValidUID reports whether uid can name a record: a Kubernetes UID's
// characters, so that no CNI_ARGS value names a path elsewhere.
func ValidUID(uid string) bool {
	if uid == "" || len(uid) > 64 {
		return false
	}
	for i := 0; i < len(uid); i++ {
		switch c := uid[i]; {
		case c >= '0' && c <= '9', c >= 'a' && c <= 'z', c >= 'A' && c <= 'Z', c == '-':
		default:
			return false
		}
	}
	return true
}

// Path is the record of the pod with uid in the records' directory dir.
func Path(dir, uid string) string { return filepath.Join(dir, uid) }

// Read reads the record of uid in dir; a missing record is an error that
// errors.Is(err, fs.ErrNotExist).
func Read(dir, uid string) (*Record, error) {
	return read(dir, uid, readFile)
}

// ReadMapped is Read for a process that reads one record and exits (the
// relay): the record is mapped, not copied, so that only the pages of the
// entry it sends are ever touched. A record holds both families'
// transactions for every config the agent learnt, 200 KB with two
// configs and lists of 1,000 entries, of which a pod's ADD sends a
// quarter; each page a process touches is a fault the kernel serves and
// a page its exit tears down. The mapping is never unmapped: the
// record's fields share it. The agent replaces a record by renaming a
// new file over it and removes it by unlinking, so a mapped record never
// changes under its reader.
func ReadMapped(dir, uid string) (*Record, error) {
	return read(dir, uid, mapFile)
}

func read(dir, uid string, readFile func(path string, limit int64, what string) ([]byte, error)) (*Record, error) {
	if !ValidUID(uid) {
		return nil, fmt.Errorf("pod UID %q cannot name a record", uid)
	}
	path := Path(dir, uid)
	data, err := readFile(path, MaxRecord, "a prepared record")
	if err != nil {
		return nil, err
	}
	r := &Record{}
	if err := r.UnmarshalBinary(data); err != nil {
		return nil, fmt.Errorf("%s: %w", path, err)
	}
	if r.UID != uid {
		return nil, fmt.Errorf("%s holds the record of pod UID %q", path, r.UID)
	}
	return r, nil
}

// mapFile maps the file at path read-only, when openRegular takes it; an
// empty file is no bytes.
func mapFile(path string, limit int64, what string) ([]byte, error) {
	f, size, err := openRegular(path, limit, what)
	if err != nil {
		return nil, err
	}
	defer f.Close()
	if size == 0 {
		return nil, nil
	}
	data, err := syscall.Mmap(int(f.Fd()), 0, int(size), syscall.PROT_READ, syscall.MAP_SHARED)
	if err != nil {
		return nil, &fs.PathError{Op: "mmap", Path: path, Err: err}
	}
	return data, nil
}

// readFile reads the file at path whole, when openRegular takes it.
func readFile(path string, limit int64, what string) ([]byte, error) {
	f, size, err := openRegular(path, limit, what)
	if err != nil {
		return nil, err
	}
	defer f.Close()
	data := make([]byte, size)
	if _, err := io.ReadFull(f, data); err != nil {
		return nil, err
	}
	return data, nil
}

// openRegular opens the file at path for reading, with its size, when it
// is a regular file of at most limit bytes (what names what it should
// be, for the error). Not through a link, and not stuck on a FIFO: root
// alone writes the directory, but its files are only ever regular ones.
func openRegular(path string, limit int64, what string) (*os.File, int64, error) {
	f, err := os.OpenFile(path, os.O_RDONLY|syscall.O_NOFOLLOW|syscall.O_NONBLOCK, 0) //nolint:gosec // G304: a file in the run dir the plugin's config names
	if err != nil {
		return nil, 0, err
	}
	fi, err := f.Stat()
	if err == nil && (!fi.Mode().IsRegular() || fi.Size() > limit) {
		err = fmt.Errorf("%s is not %s", path, what)
	}
	// What a record says decides a pod's rules: only the agent's own
	// files (it runs as the relay's user, root) are taken, and none that
	// another user could have written into.
	if err == nil {
		if st, ok := fi.Sys().(*syscall.Stat_t); ok && (st.Uid != uint32(os.Geteuid()) || fi.Mode().Perm()&0o022 != 0) { //nolint:gosec // G115: a uid
			err = fmt.Errorf("%s is not %s: owned by uid %d with mode %v", path, what, st.Uid, fi.Mode().Perm())
		}
	}
	if err != nil {
		_ = f.Close()
		return nil, 0, err
	}
	return f, fi.Size(), nil
}
