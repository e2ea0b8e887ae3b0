package prepared

import (
	"bytes"
	"encoding/json"
	"errors"
	"io/fs"
	"os"
	"path/filepath"
	"reflect"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/istio-cni-go/istio-cni/internal/testutil"
)

func sample() *Record {
	return &Record{Namespace: "ns", Name: "p", UID: "3d1c-ab", Entries: []Entry{
		{Config: []byte(`{"a":1}`), Skip: "no istio-proxy container"},
		{Config: []byte(`{"b":2}`), Mode: "TPROXY", Kind: "nftables", IPSets: true, DualStack: true, Txn4: []byte("four"), Txn46: []byte("four and six")},
	}}
}

// TestRecordRoundTrip: a record reads back as written; one cut short,
// with bytes after it, or of another version is refused whole.
func TestRecordRoundTrip(t *testing.T) {
	r := sample()
	b, err := r.MarshalBinary()
	if err != nil {
		t.Fatal(err)
	}
	var got Record
	if err := got.UnmarshalBinary(b); err != nil || !reflect.DeepEqual(&got, r) {
		t.Fatalf("read back %+v, %v; want %+v", got, err, r)
	}
	if e := got.Find([]byte(`{"b":2}`)); e == nil || e.Mode != "TPROXY" {
		t.Fatalf("Find: %+v", e)
	}
	if got.Find([]byte(`{"c":3}`)) != nil {
		t.Fatal("Find matched a config the record has no entry for")
	}
	for i := 0; i < len(b); i++ {
		if err := new(Record).UnmarshalBinary(b[:i]); err == nil {
			t.Fatalf("a record cut to %d of %d bytes was read", i, len(b))
		}
	}
	if err := new(Record).UnmarshalBinary(append(bytes.Clone(b), 0)); err == nil {
		t.Fatal("a record with a byte after it was read")
	}
	if err := new(Record).UnmarshalBinary(bytes.Replace(b, []byte("prepared 1"), []byte("prepared 9"), 1)); err == nil {
		t.Fatal("a record of another version was read")
	}
}

// FuzzRecord: whatever bytes are in a record's place, reading them never
// panics, and what reads writes back to the same bytes.
func FuzzRecord(f *testing.F) {
	b, _ := sample().MarshalBinary()
	f.Add(b)
	f.Add([]byte(magic + "\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\xff\xff\xff\xff"))
	f.Fuzz(func(t *testing.T, data []byte) {
		var r Record
		if r.UnmarshalBinary(data) != nil {
			return
		}
		again, err := r.MarshalBinary()
		if err != nil || !bytes.Equal(again, data) {
			t.Fatalf("%q read as %+v, written back as %q (%v)", data, r, again, err)
		}
	})
}

// sampleDir is a fresh records' directory holding sample()'s record.
func sampleDir(t *testing.T) (string, Dir, *Record) {
	t.Helper()
	dir := filepath.Join(t.TempDir(), DirName)
	d := Dir(dir)
	if err := d.Reset(); err != nil {
		t.Fatal(err)
	}
	r := sample()
	if err := d.Put(r); err != nil {
		t.Fatal(err)
	}
	return dir, d, r
}

// TestDir: records are written whole and read by UID; a UID that could
// name a path elsewhere names no record; Reset empties the directory.
func TestDir(t *testing.T) {
	dir, d, r := sampleDir(t)
	fi, err := os.Stat(Path(dir, r.UID))
	if err != nil || fi.Mode().Perm() != 0o600 {
		t.Fatalf("record %v, %v; want mode 0600", fi, err)
	}
	if got, err := Read(dir, r.UID); err != nil || !reflect.DeepEqual(got, r) {
		t.Fatalf("Read: %+v, %v", got, err)
	}
	entries, _ := os.ReadDir(dir)
	if len(entries) != 1 {
		t.Fatalf("the directory holds %d files after one Put, want the record alone", len(entries))
	}
	for _, uid := range []string{"", "../x", "a/b", "a.b"} {
		if _, err := Read(dir, uid); err == nil || errors.Is(err, fs.ErrNotExist) {
			t.Fatalf("Read(%q): %v, want the UID refused", uid, err)
		}
		if err := d.Put(&Record{UID: uid}); err == nil {
			t.Fatalf("Put with UID %q succeeded", uid)
		}
	}
	// A record under another pod's UID is not that pod's.
	if err := os.Rename(Path(dir, r.UID), Path(dir, "other")); err != nil {
		t.Fatal(err)
	}
	if _, err := Read(dir, "other"); err == nil {
		t.Fatal("a record was read under another UID")
	}
	if err := d.Remove("other"); err != nil || d.Remove("missing") != nil {
		t.Fatal("Remove failed")
	}
	if err := d.Put(r); err != nil {
		t.Fatal(err)
	}
	if err := d.Reset(); err != nil {
		t.Fatal(err)
	}
	if _, err := Read(dir, r.UID); !errors.Is(err, fs.ErrNotExist) {
		t.Fatalf("after Reset: %v", err)
	}
}

// TestReadMapped: a mapped record reads as Read reads it; the agent's
// next Put of the pod (a rename over it) and its removal leave the mapped
// one as it was; what is missing, not a regular file or empty is refused
// as Read refuses it.
func TestReadMapped(t *testing.T) {
	dir, d, r := sampleDir(t)
	got, err := ReadMapped(dir, r.UID)
	if err != nil || !reflect.DeepEqual(got, r) {
		t.Fatalf("ReadMapped: %+v, %v; want %+v", got, err, r)
	}
	next := sample()
	next.Entries[1].Txn4 = []byte("FOUR, prepared again")
	if err := d.Put(next); err != nil {
		t.Fatal(err)
	}
	if again, err := ReadMapped(dir, r.UID); err != nil || !reflect.DeepEqual(again, next) {
		t.Fatalf("after the next Put: %+v, %v", again, err)
	}
	if err := d.Remove(r.UID); err != nil {
		t.Fatal(err)
	}
	if !reflect.DeepEqual(got, r) {
		t.Fatalf("the mapped record changed under its reader: %+v", got)
	}
	if _, err := ReadMapped(dir, r.UID); !errors.Is(err, fs.ErrNotExist) {
		t.Fatalf("a removed record: %v", err)
	}
	if err := os.Mkdir(Path(dir, "a-dir"), 0o700); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(Path(dir, "empty"), nil, 0o600); err != nil {
		t.Fatal(err)
	}
	for _, uid := range []string{"a-dir", "empty", "../x"} {
		if _, err := ReadMapped(dir, uid); err == nil || errors.Is(err, fs.ErrNotExist) {
			t.Fatalf("ReadMapped(%q): %v, want it refused", uid, err)
		}
		if _, err := Read(dir, uid); err == nil || errors.Is(err, fs.ErrNotExist) {
			t.Fatalf("Read(%q): %v, want it refused", uid, err)
		}
	}
}

// TestParseConfig: the canonical form is the config without its
// prevResult, the same whatever the previous result, and different for
// any other difference; the fields the relay needs are read; what is not
// a JSON object is refused.
func TestParseConfig(t *testing.T) {
	a := `{"cniVersion":"1.0.0","name":"k8s-pod-network","prevResult":{"cniVersion":"1.0.0","ips":[{"address":"10.0.0.2/24"}]},"type":"istio-cni","cni_agent_run_dir":"/run/x"}`
	b := `{"cniVersion":"1.0.0","name":"k8s-pod-network","prevResult":{"cniVersion":"1.0.0","ips":[{"address":"10.0.0.3/24","gateway":"10.0.0.1"}],"dns":{}},"type":"istio-cni","cni_agent_run_dir":"/run/x"}`
	ca, err := ParseConfig([]byte(a))
	if err != nil {
		t.Fatal(err)
	}
	cb, err := ParseConfig([]byte(b))
	if err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(ca.Canonical, cb.Canonical) {
		t.Fatalf("canonical forms differ with the previous result only:\n%s\n%s", ca.Canonical, cb.Canonical)
	}
	if ca.CNIVersion != "1.0.0" || ca.PrevCNIVersion != "1.0.0" || ca.RunDir != "/run/x" ||
		string(ca.PrevResult) != `{"cniVersion":"1.0.0","ips":[{"address":"10.0.0.2/24"}]}` {
		t.Fatalf("read %+v", ca)
	}
	other, err := ParseConfig([]byte(`{"cniVersion":"1.0.0","name":"k8s-pod-network","type":"istio-cni","cni_agent_run_dir":"/run/y"}`))
	if err != nil || bytes.Equal(other.Canonical, ca.Canonical) || other.PrevResult != nil {
		t.Fatalf("another config: %+v, %v", other, err)
	}
	for _, bad := range []string{"", "[]", "{", `{"a":1`, `{"a":1,}`, `{"a" 1}`, `{"a":1}x`, `{"a":"x}`, `{"prevResult":{"x":}}`,
		`{"a":{"b":[1,2}}`, `{"cniVersion":1}`} {
		if c, err := ParseConfig([]byte(bad)); err == nil {
			t.Errorf("%q read as %+v", bad, c)
		}
	}
	// What encoding/json would read otherwise (a key's last value, keys
	// in any case) is left to the plugin.
	for _, odd := range []string{`{"prevResult":{"cniVersion":"1.0.0"},"prevResult":{"ips":[]}}`,
		`{"cniVersion":"1.0.0","CNIVersion":"0.4.0"}`, `{"PrevResult":{}}`, `{"a":1,"A":2}`} {
		if c, err := ParseConfig([]byte(odd)); err == nil {
			t.Errorf("%q read as %+v", odd, c)
		}
	}
	if c, err := ParseConfig([]byte(`{"cniVersion":"1.0.0","prevResult":null}`)); err != nil || c.PrevResult != nil {
		t.Errorf("a null prevResult: %+v, %v", c, err)
	}
	// Escapes in what the relay reads are left to the plugin.
	if _, err := ParseConfig([]byte(`{"cni_agent_run_dir":"/run/\u0078"}`)); err == nil {
		t.Error("an escaped run dir was read")
	}
}

// FuzzParseConfig: a config read is, without its prevResult, the JSON
// value encoding/json reads; and the canonical form does not depend on
// the previous result.
func FuzzParseConfig(f *testing.F) {
	f.Add([]byte(`{"cniVersion":"1.0.0","name":"n","prevResult":{"cniVersion":"1.0.0"},"type":"istio-cni","exclude_namespaces":["a","b"]}`))
	f.Add([]byte(` { "a" : [ {"b":"}"} ] , "prevResult" : null } `))
	f.Fuzz(func(t *testing.T, data []byte) {
		c, err := ParseConfig(data)
		if err != nil || !json.Valid(data) {
			return
		}
		var whole, canon map[string]any
		if json.Unmarshal(data, &whole) != nil {
			return
		}
		delete(whole, "prevResult")
		if err := json.Unmarshal(c.Canonical, &canon); err != nil {
			t.Fatalf("%q: canonical form %q is not JSON: %v", data, c.Canonical, err)
		}
		if !reflect.DeepEqual(whole, canon) && (len(whole) != 0 || len(canon) != 0) {
			t.Fatalf("%q: canonical form %q reads as %v, want %v", data, c.Canonical, canon, whole)
		}
		swapped := bytes.Replace(data, c.PrevResult, []byte(`{"cniVersion":"0.4.0"}`), 1)
		if c.PrevResult != nil && bytes.Count(data, c.PrevResult) == 1 {
			c2, err := ParseConfig(swapped)
			if err != nil || !bytes.Equal(c2.Canonical, c.Canonical) {
				t.Fatalf("%q: another prevResult changed the canonical form: %q vs %q (%v)", data, c2.Canonical, c.Canonical, err)
			}
		}
	})
}

// TestConfigsOutliveReset: the learnt configs read back as saved and stay
// through Reset, which removes every record; a configs file that does not
// read gives none.
func TestConfigsOutliveReset(t *testing.T) {
	dir := filepath.Join(t.TempDir(), DirName)
	d := Dir(dir)
	if err := d.Reset(); err != nil {
		t.Fatal(err)
	}
	if got := d.LoadConfigs(); got != nil {
		t.Fatalf("configs before any were saved: %q", got)
	}
	want := [][]byte{[]byte(`{"a":1}`), []byte(`{"b":2}`)}
	if err := d.SaveConfigs(want); err != nil {
		t.Fatal(err)
	}
	if err := d.Put(sample()); err != nil {
		t.Fatal(err)
	}
	if err := d.Reset(); err != nil {
		t.Fatal(err)
	}
	if got := d.LoadConfigs(); !reflect.DeepEqual(got, want) {
		t.Fatalf("configs after Reset: %q, want %q", got, want)
	}
	if _, err := Read(dir, sample().UID); !errors.Is(err, fs.ErrNotExist) {
		t.Fatalf("a record outlived Reset: %v", err)
	}
	if !d.Knows(want[1]) || d.Knows([]byte(`{"c":3}`)) || d.Knows(nil) {
		t.Fatal("Knows does not tell the saved configs from others")
	}
	if err := os.WriteFile(filepath.Join(dir, configsName), []byte(configsMagic+"\x00\x00\x00\x09{}"), 0o600); err != nil {
		t.Fatal(err)
	}
	if got := d.LoadConfigs(); got != nil || d.Knows([]byte("{}")) {
		t.Fatalf("a configs file cut short read as %q", got)
	}
	// Relays read the file too: never through a link.
	other := filepath.Join(t.TempDir(), "configs")
	if err := os.Rename(filepath.Join(dir, configsName), other); err != nil {
		t.Fatal(err)
	}
	if err := d.SaveConfigs(want); err != nil {
		t.Fatal(err)
	}
	if err := os.Rename(filepath.Join(dir, configsName), other); err != nil {
		t.Fatal(err)
	}
	if err := os.Symlink(other, filepath.Join(dir, configsName)); err != nil {
		t.Fatal(err)
	}
	if got := d.LoadConfigs(); got != nil || d.Knows(want[0]) {
		t.Fatalf("configs read through a link: %q", got)
	}
}

// TestAgentWait: the wait reads back as set, and not at all once set to
// 0, past a minute, emptied by Reset, or replaced by anything that is not
// a short duration in a regular file.
func TestAgentWait(t *testing.T) {
	dir := filepath.Join(t.TempDir(), "prepared")
	d := Dir(dir)
	if err := d.Reset(); err != nil {
		t.Fatal(err)
	}
	if w := AgentWait(dir); w != 0 {
		t.Fatalf("no wait set: %s", w)
	}
	if err := d.SetAgentWait(25 * time.Millisecond); err != nil {
		t.Fatal(err)
	}
	if w := AgentWait(dir); w != 25*time.Millisecond {
		t.Fatalf("wait %s, want 25ms", w)
	}
	for _, w := range []time.Duration{0, 2 * time.Minute} {
		if err := d.SetAgentWait(25 * time.Millisecond); err != nil {
			t.Fatal(err)
		}
		if err := d.SetAgentWait(w); err != nil {
			t.Fatal(err)
		}
		if got := AgentWait(dir); got != 0 {
			t.Fatalf("set to %s, read %s", w, got)
		}
	}
	if err := d.SetAgentWait(time.Second); err != nil {
		t.Fatal(err)
	}
	if err := d.Reset(); err != nil {
		t.Fatal(err)
	}
	if w := AgentWait(dir); w != 0 {
		t.Fatalf("a reset left the wait %s", w)
	}
	path := filepath.Join(dir, waitName)
	for name, write := range map[string]func() error{
		"not a duration": func() error { return os.WriteFile(path, []byte("soon"), 0o600) },
		"negative":       func() error { return os.WriteFile(path, []byte("-1s"), 0o600) },
		"too long":       func() error { return os.WriteFile(path, bytes.Repeat([]byte("1"), 40), 0o600) },
		"a link":         func() error { _ = os.WriteFile(path+".t", []byte("1s"), 0o600); return os.Symlink(path+".t", path) },
		"a directory":    func() error { return os.Mkdir(path, 0o700) },
	} {
		if err := os.RemoveAll(path); err != nil {
			t.Fatal(err)
		}
		if err := write(); err != nil {
			t.Fatal(err)
		}
		if w := AgentWait(dir); w != 0 {
			t.Fatalf("%s: read %s", name, w)
		}
	}
}

// TestAgentSeen: Beat makes the file AgentSeen times; none, a link to
// one, or a directory in its place is no agent seen.
func TestAgentSeen(t *testing.T) {
	d := Dir(t.TempDir())
	if _, ok := AgentSeen(string(d), time.Now()); ok {
		t.Fatal("an agent seen before any beat")
	}
	if err := d.Beat(); err != nil {
		t.Fatal(err)
	}
	ago, ok := AgentSeen(string(d), time.Now().Add(time.Minute))
	if !ok || ago < time.Minute-time.Second || ago > time.Minute+time.Second {
		t.Fatalf("seen %s ago (%t) a minute after its beat", ago, ok)
	}
	p := filepath.Join(string(d), aliveName)
	other := filepath.Join(t.TempDir(), "beat")
	if err := os.Rename(p, other); err != nil {
		t.Fatal(err)
	}
	if err := os.Symlink(other, p); err != nil {
		t.Fatal(err)
	}
	if _, ok := AgentSeen(string(d), time.Now()); ok {
		t.Fatal("a link counted as the agent's beat")
	}
	if err := os.Remove(p); err != nil {
		t.Fatal(err)
	}
	if err := os.Mkdir(p, 0o700); err != nil {
		t.Fatal(err)
	}
	if _, ok := AgentSeen(string(d), time.Now()); ok {
		t.Fatal("a directory counted as the agent's beat")
	}
	// A rename does not replace a directory: the renewal fails, which
	// the agent logs.
	if err := d.Beat(); err == nil {
		t.Fatal("a beat over a directory succeeded")
	}
}

// TestOnlyOwnRecords: a record another user could have written (group- or
// world-writable, or another owner's) is refused, and Reset removes, not
// follows, a link or a file of the directory's name and a directory
// another user owns.
func TestOnlyOwnRecords(t *testing.T) {
	testutil.RequireRoot(t)
	dir, _, r := sampleDir(t)
	path := Path(dir, r.UID)
	if err := os.Chmod(path, 0o622); err != nil {
		t.Fatal(err)
	}
	if _, err := ReadMapped(dir, r.UID); err == nil || !strings.Contains(err.Error(), "mode") {
		t.Fatalf("a group-writable record: %v", err)
	}
	if err := os.Chmod(path, 0o600); err != nil {
		t.Fatal(err)
	}
	if err := os.Chown(path, 1000, 1000); err != nil {
		t.Fatal(err)
	}
	if _, err := ReadMapped(dir, r.UID); err == nil || !strings.Contains(err.Error(), "uid 1000") {
		t.Fatalf("another user's record: %v", err)
	}

	base := t.TempDir()
	target := filepath.Join(base, "elsewhere")
	if err := os.Mkdir(target, 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(target, "keep"), []byte("x"), 0o644); err != nil {
		t.Fatal(err)
	}
	d := Dir(filepath.Join(base, DirName))
	reset := func(what string) {
		t.Helper()
		if err := d.Reset(); err != nil {
			t.Fatalf("Reset over %s: %v", what, err)
		}
		fi, err := os.Lstat(string(d))
		if err != nil || !fi.IsDir() || fi.Mode().Perm() != 0o700 || fi.Sys().(*syscall.Stat_t).Uid != uint32(os.Geteuid()) {
			t.Fatalf("after Reset over %s: %v, %v", what, fi, err)
		}
	}
	if err := os.Symlink(target, string(d)); err != nil {
		t.Fatal(err)
	}
	reset("a link")
	if _, err := os.Stat(filepath.Join(target, "keep")); err != nil {
		t.Fatalf("Reset followed the link: %v", err)
	}
	if err := os.Chown(string(d), 1000, 1000); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(string(d), "planted"), nil, 0o644); err != nil {
		t.Fatal(err)
	}
	reset("another user's directory")
	if _, err := os.Stat(filepath.Join(string(d), "planted")); !errors.Is(err, fs.ErrNotExist) {
		t.Fatalf("a file in another user's directory outlived Reset: %v", err)
	}
	if err := os.RemoveAll(string(d)); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(string(d), nil, 0o600); err != nil {
		t.Fatal(err)
	}
	reset("a file")
}
