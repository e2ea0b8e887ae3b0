package install

import (
	"bytes"
	"encoding/json"
	"os"
	"testing"

	"github.com/containernetworking/cni/libcni"

	"github.com/istio-cni-go/istio-cni/internal/enablement"
	"github.com/istio-cni-go/istio-cni/internal/plugin"
)

// istioKeys are the keys Istio's installer writes into its entry.
var istioKeys = []string{"type", "name", "ipam", "dns", "plugin_log_level", "cni_agent_run_dir", "ambient_enabled",
	"enablement_selectors", "exclude_namespaces", "pod_namespace", "native_nftables", "enable_ambient_detection_retry"}

func defaultSelectorsJSON(t *testing.T) json.RawMessage {
	t.Helper()
	js, err := json.Marshal(enablement.Default().Source())
	if err != nil {
		t.Fatal(err)
	}
	return js
}

// TestEntryAmbientKeys: the entry always has Istio's keys; with ambient
// off it says [] and false as Istio's does; with ambient on it carries
// the selectors as given and the retry setting.
func TestEntryAmbientKeys(t *testing.T) {
	custom := json.RawMessage(`[{"podSelector":{"matchLabels":{"app":"web"}},"namespaceSelector":{}}]`)
	for _, c := range []struct {
		name           string
		s              EntrySettings
		ambient, retry bool
		selectors      string
	}{
		{"ambient off", EntrySettings{RunDir: "/var/run/istio-cni"}, false, false, `[]`},
		{"ambient on, default selectors", EntrySettings{RunDir: "/r", AmbientEnabled: true, EnablementSelectors: defaultSelectorsJSON(t)},
			true, false, string(defaultSelectorsJSON(t))},
		{"custom selectors and retry", EntrySettings{RunDir: "/r", AmbientEnabled: true, EnablementSelectors: custom, AmbientDetectionRetry: true},
			true, true, string(custom)},
		{"no selectors", EntrySettings{RunDir: "/r", AmbientEnabled: true, EnablementSelectors: json.RawMessage(`[]`)}, true, false, `[]`},
	} {
		for _, form := range []struct {
			name string
			b    []byte
		}{{"entry", Entry(c.s)}, {"standalone", StandaloneConf(c.s)}} {
			var m map[string]json.RawMessage
			if err := json.Unmarshal(form.b, &m); err != nil {
				t.Fatalf("%s %s: %v in %s", c.name, form.name, err, form.b)
			}
			for _, k := range istioKeys {
				if _, ok := m[k]; !ok {
					t.Errorf("%s %s: key %s missing in %s", c.name, form.name, k, form.b)
				}
			}
			if extra := len(m) - len(istioKeys); (form.name == "entry" && extra != 0) || (form.name == "standalone" && extra != 1) {
				t.Errorf("%s %s: keys beyond Istio's in %s", c.name, form.name, form.b)
			}
			if !SameJSON(m["enablement_selectors"], []byte(c.selectors)) {
				t.Errorf("%s %s: enablement_selectors %s, want %s", c.name, form.name, m["enablement_selectors"], c.selectors)
			}
			var ambient, retry bool
			if json.Unmarshal(m["ambient_enabled"], &ambient) != nil || ambient != c.ambient {
				t.Errorf("%s %s: ambient_enabled %s, want %v", c.name, form.name, m["ambient_enabled"], c.ambient)
			}
			if json.Unmarshal(m["enable_ambient_detection_retry"], &retry) != nil || retry != c.retry {
				t.Errorf("%s %s: enable_ambient_detection_retry %s, want %v", c.name, form.name, m["enable_ambient_detection_retry"], c.retry)
			}
		}
		if !bytes.Equal(Entry(c.s), Entry(c.s)) {
			t.Errorf("%s: the entry is not the same bytes twice", c.name)
		}
	}
}

// TestEntrySelectorsReachThePlugin: the entry, inserted into a primary
// conflist as a runtime reads it, parses with the plugin's own parser,
// and the selectors it holds select what the agent's select.
func TestEntrySelectorsReachThePlugin(t *testing.T) {
	orig, err := os.ReadFile("testdata/primary/10-calico.conflist")
	if err != nil {
		t.Fatal(err)
	}
	custom := `[{"podSelector":{"matchExpressions":[{"key":"app","operator":"In","values":["web","api"]}]},"namespaceSelector":{"matchLabels":{"mesh":"on"}}}]`
	type pn struct {
		pod, ns map[string]string
	}
	pods := []pn{
		{map[string]string{"istio.io/dataplane-mode": "ambient"}, nil},
		{nil, map[string]string{"istio.io/dataplane-mode": "ambient"}},
		{map[string]string{"istio.io/dataplane-mode": "none"}, map[string]string{"istio.io/dataplane-mode": "ambient"}},
		{map[string]string{"app": "api"}, map[string]string{"mesh": "on"}},
		{map[string]string{"app": "db"}, map[string]string{"mesh": "on"}},
	}
	for _, text := range []string{"", custom, "[]"} {
		agent, err := enablement.Parse(text)
		if err != nil {
			t.Fatal(err)
		}
		sel, err := json.Marshal(agent.Source())
		if err != nil {
			t.Fatal(err)
		}
		s := EntrySettings{RunDir: "/var/run/istio-cni", PodNamespace: "istio-system", AmbientEnabled: true, EnablementSelectors: sel, AmbientDetectionRetry: true}
		merged, err := Insert(orig, Entry(s))
		if err != nil {
			t.Fatal(err)
		}
		list, err := libcni.ConfListFromBytes(merged)
		if err != nil {
			t.Fatalf("libcni: %v", err)
		}
		for _, form := range []struct {
			name string
			b    []byte
		}{{"in the conflist", list.Plugins[len(list.Plugins)-1].Bytes}, {"standalone", StandaloneConf(s)}} {
			conf, err := plugin.ParseConfig(form.b)
			if err != nil {
				t.Fatalf("selectors %q %s: the plugin refuses its entry: %v", text, form.name, err)
			}
			if !conf.AmbientEnabled || !conf.EnableAmbientDetectionRetry || conf.PodNamespace != "istio-system" {
				t.Fatalf("selectors %q %s: parsed %+v", text, form.name, conf)
			}
			read, err := enablement.Parse(string(conf.EnablementSelectors))
			if err != nil {
				t.Fatalf("selectors %q %s: %s: %v", text, form.name, conf.EnablementSelectors, err)
			}
			for i, p := range pods {
				if a, b := agent.Match(p.pod, p.ns), read.Match(p.pod, p.ns); a != b {
					t.Errorf("selectors %q %s: pod %d: the agent's match %v, the plugin's %v", text, form.name, i, a, b)
				}
			}
		}
	}
}

// TestEntryWithOtherSelectorsIsStale: a change of selectors or of the
// retry setting makes the installed entry stale, so the agent rewrites
// it; the same settings are in place.
func TestEntryWithOtherSelectorsIsStale(t *testing.T) {
	orig, err := os.ReadFile("testdata/primary/10-calico.conflist")
	if err != nil {
		t.Fatal(err)
	}
	base := EntrySettings{RunDir: "/var/run/istio-cni", AmbientEnabled: true, EnablementSelectors: defaultSelectorsJSON(t)}
	merged, err := Insert(orig, Entry(base))
	if err != nil {
		t.Fatal(err)
	}
	if st, err := Inspect(merged, Entry(base)); err != nil || st != EntryOK {
		t.Fatalf("same settings: %v %v", st, err)
	}
	// The same selectors spaced differently are the same entry.
	spaced := base
	spaced.EnablementSelectors = json.RawMessage(" " + string(defaultSelectorsJSON(t)) + "\n")
	if st, err := Inspect(merged, Entry(spaced)); err != nil || st != EntryOK {
		t.Fatalf("same selectors, other spacing: %v %v", st, err)
	}
	for name, mut := range map[string]func(*EntrySettings){
		"other selectors": func(s *EntrySettings) { s.EnablementSelectors = json.RawMessage(`[]`) },
		"retry":           func(s *EntrySettings) { s.AmbientDetectionRetry = true },
		"ambient off":     func(s *EntrySettings) { s.AmbientEnabled = false },
	} {
		s := base
		mut(&s)
		if st, err := Inspect(merged, Entry(s)); err != nil || st != EntryStale {
			t.Errorf("%s: %v %v, want stale", name, st, err)
		}
	}
}
