package install

import (
	"encoding/json"
)

// EntrySettings are the values the agent writes into the plugin entry;
// the keys are Istio's, so its plugin and ours read the same entry.
type EntrySettings struct {
	LogLevel          string
	RunDir            string
	ExcludeNamespaces []string
	PodNamespace      string
	NativeNftables    bool
	AmbientEnabled    bool
	// EnablementSelectors are the ambient selectors as JSON (nil: none
	// written, "[]" as Istio writes with ambient off).
	EnablementSelectors   json.RawMessage
	AmbientDetectionRetry bool
}

// Entry renders our plugin entry as it goes into a conflist: no
// cniVersion (the list's applies), keys sorted as Istio writes them.
func Entry(s EntrySettings) []byte {
	m := s.fields()
	b, _ := json.Marshal(m)
	return b
}

// StandaloneConf renders the plugin as a config file of its own, for a
// meta plugin such as Multus to call.
func StandaloneConf(s EntrySettings) []byte {
	m := s.fields()
	m["cniVersion"] = "0.3.1"
	b, _ := json.MarshalIndent(m, "", "  ")
	return append(b, '\n')
}

func (s EntrySettings) fields() map[string]any {
	excl := s.ExcludeNamespaces
	if excl == nil {
		excl = []string{}
	}
	var sel any = []any{}
	if len(s.EnablementSelectors) != 0 {
		sel = s.EnablementSelectors
	}
	level := s.LogLevel
	if level == "" {
		level = "info"
	}
	return map[string]any{
		"type":                           PluginType,
		"name":                           PluginType,
		"ipam":                           map[string]any{},
		"dns":                            map[string]any{},
		"plugin_log_level":               level,
		"cni_agent_run_dir":              s.RunDir,
		"ambient_enabled":                s.AmbientEnabled,
		"enablement_selectors":           sel,
		"exclude_namespaces":             excl,
		"pod_namespace":                  s.PodNamespace,
		"native_nftables":                s.NativeNftables,
		"enable_ambient_detection_retry": s.AmbientDetectionRetry,
	}
}
