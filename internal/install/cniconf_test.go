package install

import (
	"bytes"
	"encoding/json"
	"os"
	"path/filepath"
	"reflect"
	"slices"
	"strings"
	"testing"

	"github.com/containernetworking/cni/libcni"

	"github.com/istio-cni-go/istio-cni/internal/testutil"
)

var testEntry = Entry(EntrySettings{RunDir: "/var/run/istio-cni", ExcludeNamespaces: []string{"kube-system"}, PodNamespace: "istio-system"})

func decode(t *testing.T, b []byte) map[string]any {
	t.Helper()
	d := json.NewDecoder(bytes.NewReader(b))
	d.UseNumber()
	var m map[string]any
	if err := d.Decode(&m); err != nil {
		t.Fatalf("%v in %s", err, b)
	}
	return m
}

func pluginsOf(t *testing.T, b []byte) []any {
	t.Helper()
	m := decode(t, b)
	if p, ok := m["plugins"].([]any); ok {
		return p
	}
	delete(m, "cniVersion")
	return []any{m}
}

// TestInsertRealConfigs merges our entry into real primary configs and
// checks the result against goldens, libcni, and the originals.
func TestInsertRealConfigs(t *testing.T) {
	files, err := filepath.Glob("testdata/primary/*")
	if err != nil || len(files) == 0 {
		t.Fatal("no primary configs", err)
	}
	for _, f := range files {
		name := filepath.Base(f)
		t.Run(name, func(t *testing.T) {
			orig, err := os.ReadFile(f)
			if err != nil {
				t.Fatal(err)
			}
			merged, err := Insert(orig, testEntry)
			if err != nil {
				t.Fatal(err)
			}
			testutil.CompareGolden(t, filepath.Join("merged", name+".golden"), string(merged))

			list, err := libcni.ConfListFromBytes(merged)
			if err != nil {
				t.Fatalf("libcni rejects the merged config: %v", err)
			}
			last := list.Plugins[len(list.Plugins)-1]
			if last.Network.Type != PluginType {
				t.Fatalf("last plugin is %q", last.Network.Type)
			}
			// Every other plugin survives with every field and value.
			var want []any
			for _, p := range pluginsOf(t, orig) {
				if p.(map[string]any)["type"] != PluginType {
					want = append(want, p)
				}
			}
			got := pluginsOf(t, merged)
			if !reflect.DeepEqual(got[:len(got)-1], want) {
				t.Fatalf("other plugins changed:\n got %v\nwant %v", got[:len(got)-1], want)
			}
			// Top-level fields other than plugins survive too.
			om, mm := decode(t, orig), decode(t, merged)
			if _, single := om["type"]; !single {
				for k, v := range om {
					if k != "plugins" && !reflect.DeepEqual(mm[k], v) {
						t.Fatalf("top-level %q changed: %v -> %v", k, v, mm[k])
					}
				}
			} else if mm["name"] != om["name"] {
				t.Fatalf("wrapped list lost the network name %v", om["name"])
			}
			if st, err := Inspect(merged, testEntry); err != nil || st != EntryOK {
				t.Fatalf("Inspect = %v, %v", st, err)
			}
			again, err := Insert(merged, testEntry)
			if err != nil || !bytes.Equal(again, merged) {
				t.Fatalf("second insert changed the file:\n%s", again)
			}
			removed, had, err := Remove(merged)
			if err != nil || !had {
				t.Fatalf("Remove: %v %v", had, err)
			}
			if strings.Contains(string(removed), PluginType) {
				t.Fatalf("entry left after Remove:\n%s", removed)
			}
			if !reflect.DeepEqual(pluginsOf(t, removed), want) {
				t.Fatalf("Remove changed other plugins")
			}
		})
	}
}

func TestInspect(t *testing.T) {
	orig, _ := os.ReadFile("testdata/primary/10-calico.conflist")
	if st, _ := Inspect(orig, testEntry); st != EntryMissing {
		t.Fatalf("fresh config: %v", st)
	}
	other := Entry(EntrySettings{RunDir: "/other"})
	merged, _ := Insert(orig, other)
	if st, _ := Inspect(merged, testEntry); st != EntryStale {
		t.Fatalf("entry with other settings: %v", st)
	}
	old, _ := os.ReadFile("testdata/primary/10-with-old-istio.conflist")
	if st, _ := Inspect(old, testEntry); st != EntryStale {
		t.Fatalf("entry not last: %v", st)
	}
}

func TestInsertRejectsGarbage(t *testing.T) {
	for _, bad := range []string{``, `[]`, `{"name":"x"}`, `{"plugins":{}}`, `{"type":"a"} {}`, `{"a":1,"a":2,"type":"x"}`} {
		if _, err := Insert([]byte(bad), testEntry); err == nil {
			t.Errorf("Insert accepted %q", bad)
		}
	}
}

func TestFindPrimary(t *testing.T) {
	dir := t.TempDir()
	write := func(name, content string) {
		if err := os.WriteFile(filepath.Join(dir, name), []byte(content), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	if _, _, err := FindPrimary(dir, ""); err == nil {
		t.Fatal("empty dir has a primary")
	}
	write("00-broken.conflist", `{"cniVersion":"0.3.1","plugins":[`)
	write("01-noname.conflist", `{"cniVersion":"0.3.1","plugins":[{"type":"calico"}]}`)
	write("02-noplugins.conflist", `{"cniVersion":"0.3.1","name":"x","plugins":[]}`)
	write("03-list-as-conf.conf", `{"cniVersion":"0.3.1","name":"x","plugins":[{"type":"calico"}]}`)
	write("04-list.json", `{"cniVersion":"0.3.1","name":"x","plugins":[{"type":"calico"}]}`)
	write("05-empty.conflist", ``)
	write("10-calico.conflist", `{"cniVersion":"0.3.1","name":"k8s","plugins":[{"type":"calico"}]}`)
	write("20-bridge.conf", `{"cniVersion":"0.3.1","name":"b","type":"bridge"}`)
	p, skipped, err := FindPrimary(dir, "")
	if err != nil || filepath.Base(p) != "10-calico.conflist" {
		t.Fatalf("primary %s, %v", p, err)
	}
	var partial []string
	for _, s := range skipped {
		if s.Partial {
			partial = append(partial, filepath.Base(s.File))
		}
	}
	if len(skipped) != 6 || !slices.Equal(partial, []string{"00-broken.conflist", "05-empty.conflist"}) {
		t.Fatalf("want 6 skipped invalid files, 2 of them partial, got %+v", skipped)
	}
	// A .json is one plugin's config to containerd and CRI-O, which load
	// it before a later .conflist.
	write("07-bridge.json", `{"cniVersion":"0.3.1","name":"j","type":"bridge"}`)
	if p, _, err := FindPrimary(dir, ""); err != nil || filepath.Base(p) != "07-bridge.json" {
		t.Fatalf("a valid .json first: primary %s, %v", p, err)
	}
	if p, _, err := FindPrimary(dir, "07-bridge.conflist"); err != nil || filepath.Base(p) != "07-bridge.json" {
		t.Fatalf("a .json named by its list's name: %s %v", p, err)
	}
	if p, _, err := FindPrimary(dir, "20-bridge.conflist"); err != nil || filepath.Base(p) != "20-bridge.conf" {
		t.Fatalf("named with the other extension: %s %v", p, err)
	}
	if _, _, err := FindPrimary(dir, "99-missing.conf"); err == nil {
		t.Fatal("missing named file found")
	}
}
