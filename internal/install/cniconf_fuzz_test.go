package install

import (
	"bytes"
	"encoding/json"
	"os"
	"path/filepath"
	"testing"
)

// FuzzConflistMerge feeds arbitrary documents to the merge: whatever it
// accepts, insertion puts exactly one entry last (and is stable), keeps
// every byte outside the plugins array and every other plugin's bytes, and
// removal takes exactly that entry out again.
func FuzzConflistMerge(f *testing.F) {
	files, _ := filepath.Glob("testdata/primary/*")
	for _, p := range files {
		if b, err := os.ReadFile(p); err == nil {
			f.Add(b)
		}
	}
	for _, s := range []string{
		`{"plugins":[]}`, `{"plugins":[ ]}`, `{"name":"a","plugins":[{"type":"istio-cni"}]}`,
		`{"name":"a","plugins":[{"type":"istio-cni"},{"type":"x"},{"type":"istio-cni"}]}`,
		"{\r\n\t\"plugins\" :\r\n\t[\r\n\t\t{\"type\":\"x\"}\r\n\t]\r\n}\r\n",
		`{"type":"bridge"}`, `{"cniVersion":"1.0.0"  ,  "type":"bridge","x":[1,2]}`, `  {"type":"a","cniVersion":"0.4.0"}  `,
		`{"plugins":[1,"a",null,{"type":7}]}`, `{"a":"\u0000\"\\","plugins":[{"type":"x","n":1e999}]}`,
	} {
		f.Add([]byte(s))
	}
	entry := testEntry
	f.Fuzz(func(t *testing.T, data []byte) {
		merged, err := Insert(data, entry)
		if err != nil {
			if _, _, rerr := Remove(data); rerr == nil && json.Valid(data) {
				// Remove accepts what Insert refuses only when there is nothing to remove.
				if st, _ := Inspect(data, entry); st != EntryMissing {
					t.Fatalf("Insert refused (%v) a config Inspect reads as %v", err, st)
				}
			}
			return
		}
		if !json.Valid(merged) {
			t.Fatalf("invalid JSON out of valid input:\n%q\n->\n%q", data, merged)
		}
		if st, err := Inspect(merged, entry); err != nil || st != EntryOK {
			t.Fatalf("Inspect after Insert: %v %v\n%q", st, err, merged)
		}
		if again, err := Insert(merged, entry); err != nil || !bytes.Equal(again, merged) {
			t.Fatalf("a second Insert changed the file (%v):\n%q\n->\n%q", err, merged, again)
		}
		removed, had, err := Remove(merged)
		if err != nil || !had {
			t.Fatalf("Remove after Insert: %v %v", had, err)
		}
		if st, _ := Inspect(removed, entry); st != EntryMissing {
			t.Fatalf("an entry is left after Remove:\n%q", removed)
		}
		in, _ := parseObject(data)
		if _, single := in.field("type"); single {
			return // a wrapped .conf is a new file
		}
		out, err := parseObject(merged)
		if err != nil {
			t.Fatal(err)
		}
		fi, elemsIn, _ := in.plugins()
		fo, elemsOut, err := out.plugins()
		if err != nil {
			t.Fatal(err)
		}
		if !bytes.Equal(data[:fi.start], merged[:fo.start]) || !bytes.Equal(data[fi.end:], merged[fo.end:]) {
			t.Fatalf("bytes outside the plugins array changed:\n%q\n->\n%q", data, merged)
		}
		var others [][]byte
		for _, e := range elemsIn {
			if pluginType(e.raw) != PluginType {
				others = append(others, e.raw)
			}
		}
		if len(elemsOut) != len(others)+1 {
			t.Fatalf("%d plugins out of %d others", len(elemsOut), len(others))
		}
		for i, o := range others {
			if !bytes.Equal(elemsOut[i].raw, o) {
				t.Fatalf("plugin %d changed: %q -> %q", i, o, elemsOut[i].raw)
			}
		}
		if len(others) == len(elemsIn) && len(elemsIn) > 0 && !bytes.Equal(removed, data) {
			t.Fatalf("insert then remove is not the original:\n%q\n->\n%q", data, removed)
		}
	})
}
