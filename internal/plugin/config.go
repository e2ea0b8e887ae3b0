// Package plugin implements the istio-cni CNI commands: it decides whether
// a pod gets sidecar redirection and has its rules programmed.
package plugin

import (
	"bytes"
	"cmp"
	"encoding/json"
	"errors"
	"fmt"
	"path/filepath"
	"slices"
	"strings"
	"time"

	"github.com/containernetworking/cni/pkg/types"
	"github.com/containernetworking/cni/pkg/types/create"
	"github.com/containernetworking/cni/pkg/version"

	"github.com/istio-cni-go/istio-cni/internal/cnirelay"
	"github.com/istio-cni-go/istio-cni/internal/enablement"
	"github.com/istio-cni-go/istio-cni/internal/logging"
	"github.com/istio-cni-go/istio-cni/internal/podinfo"
)

// Defaults of the plugin configuration.
const (
	DefaultRunDir         = cnirelay.DefaultRunDir
	KubeconfigName        = "istio-cni-kubeconfig"
	DefaultRequestTimeout = 5 * time.Second
	DefaultRetryBudget    = 30 * time.Second
)

// Config is the plugin's entry in the node's CNI config. The keys are the
// ones Istio's installer writes, so an existing conflist works unchanged;
// the k8s_* keys are this plugin's own.
type Config struct {
	types.NetConf

	PluginLogLevel              string          `json:"plugin_log_level"`
	CNIAgentRunDir              string          `json:"cni_agent_run_dir"`
	AmbientEnabled              bool            `json:"ambient_enabled"`
	EnablementSelectors         json.RawMessage `json:"enablement_selectors"`
	ExcludeNamespaces           []string        `json:"exclude_namespaces"`
	PodNamespace                string          `json:"pod_namespace"`
	NativeNftables              bool            `json:"native_nftables"`
	EnableAmbientDetectionRetry bool            `json:"enable_ambient_detection_retry"`

	// RawPrevResult shadows NetConf's (a map, which the CNI library
	// decodes, encodes and decodes again): the bytes are decoded once,
	// as the library would (parsePrevResult).
	RawPrevResult json.RawMessage `json:"prevResult,omitempty"`

	// K8sRequestTimeout bounds one API request ("5s" by default).
	K8sRequestTimeout string `json:"k8s_request_timeout,omitempty"`
	// K8sRetryBudget bounds all attempts to read the pod ("30s").
	K8sRetryBudget string `json:"k8s_retry_budget,omitempty"`

	requestTimeout time.Duration
	retryBudget    time.Duration
	// selectors are enablement_selectors parsed, with ambient_enabled.
	selectors *enablement.Selectors
}

// ConfigError names the configuration key that was wrong.
type ConfigError struct {
	Key, Msg string
}

func (e *ConfigError) Error() string {
	return fmt.Sprintf("invalid istio-cni config key %q: %s", e.Key, e.Msg)
}

// ParseConfig reads and validates the stdin config, including prevResult.
func ParseConfig(stdin []byte) (*Config, error) {
	conf := &Config{}
	if err := json.Unmarshal(stdin, conf); err != nil {
		var te *json.UnmarshalTypeError
		if errors.As(err, &te) && te.Field != "" {
			return nil, &ConfigError{Key: te.Field, Msg: fmt.Sprintf("expected %s, got JSON %s", goTypeName(te.Type.String()), te.Value)}
		}
		return nil, fmt.Errorf("parsing istio-cni config: %w", err)
	}
	if conf.CNIAgentRunDir == "" {
		conf.CNIAgentRunDir = DefaultRunDir
	}
	if !filepath.IsAbs(conf.CNIAgentRunDir) {
		return nil, &ConfigError{Key: "cni_agent_run_dir", Msg: fmt.Sprintf("%q is not an absolute path", conf.CNIAgentRunDir)}
	}
	// Istio's older installers wrote [""] for an empty list (a split of
	// ""); a blank entry matches no namespace, there or here.
	conf.ExcludeNamespaces = slices.DeleteFunc(conf.ExcludeNamespaces, func(ns string) bool {
		return strings.TrimSpace(ns) == ""
	})
	var err error
	if conf.requestTimeout, err = parseDuration("k8s_request_timeout", conf.K8sRequestTimeout, DefaultRequestTimeout); err != nil {
		return nil, err
	}
	if conf.retryBudget, err = parseDuration("k8s_retry_budget", conf.K8sRetryBudget, DefaultRetryBudget); err != nil {
		return nil, err
	}
	if conf.AmbientEnabled {
		// Absent or null is Istio's default; [] enrols no pod.
		if conf.selectors, err = enablement.Parse(string(conf.EnablementSelectors)); err != nil {
			return nil, &ConfigError{Key: "enablement_selectors", Msg: err.Error()}
		}
	}
	if conf.PrevResult, err = parsePrevResult(conf.CNIVersion, conf.RawPrevResult); err != nil {
		return nil, &ConfigError{Key: "prevResult", Msg: err.Error()}
	}
	return conf, nil
}

// parsePrevResult is the CNI library's version.ParsePrevResult without
// its round trip through a map: the config's version is put first as a
// "CNIVersion" key, which the result's own cniVersion, later, overrides
// when it has one (the library's map encodes sorted, with the same
// effect), and the result is read as the config's version reads it.
// FuzzParseConfig holds the two to the same results.
func parsePrevResult(confVersion string, raw json.RawMessage) (types.Result, error) {
	trimmed := bytes.TrimLeft(raw, " \t\r\n")
	if len(trimmed) == 0 || string(trimmed) == "null" {
		return nil, nil
	}
	if trimmed[0] != '{' {
		// As the library's map would have refused it.
		kind := map[byte]string{'[': "array", '"': "string", 't': "bool", 'f': "bool"}[trimmed[0]]
		return nil, fmt.Errorf("expected an object, got JSON %s", cmp.Or(kind, "number"))
	}
	// The way the runtimes write it: one "cniVersion" (or none) and whole
	// numbers. Anything else (the key in other cases or twice, numbers
	// the library's map would make whole) goes through the library,
	// which decides it. (Other keys given twice, which no runtime writes,
	// are merged here where the library keeps the last.)
	if n := foldCount(trimmed, `"cniversion"`); n <= 1 && n == bytes.Count(trimmed, []byte(`"cniVersion"`)) {
		version, err := json.Marshal(confVersion)
		if err != nil {
			return nil, err
		}
		b := make([]byte, 0, len(trimmed)+len(version)+16)
		b = append(append(b, `{"CNIVersion":`...), version...)
		rest := bytes.TrimLeft(trimmed[1:], " \t\r\n")
		if len(rest) > 0 && rest[0] != '}' {
			b = append(b, ',')
		}
		b = append(b, rest...)
		if res, err := create.Create(confVersion, b); err == nil {
			return res, nil
		}
	}
	lib := types.NetConf{CNIVersion: confVersion}
	if err := json.Unmarshal(trimmed, &lib.RawPrevResult); err != nil {
		return nil, err
	}
	if err := version.ParsePrevResult(&lib); err != nil {
		return nil, err
	}
	return lib.PrevResult, nil
}

// foldCount counts the ASCII-case-insensitive occurrences of a lower-case
// key in b.
func foldCount(b []byte, key string) int {
	n := 0
	for i := 0; i+len(key) <= len(b); i++ {
		if b[i] == key[0] && bytes.EqualFold(b[i:i+len(key)], []byte(key)) {
			n++
		}
	}
	return n
}

func parseDuration(key, v string, def time.Duration) (time.Duration, error) {
	if v == "" {
		return def, nil
	}
	d, err := time.ParseDuration(v)
	if err != nil || d <= 0 {
		return 0, &ConfigError{Key: key, Msg: fmt.Sprintf("%q is not a positive duration such as \"5s\"", v)}
	}
	return d, nil
}

func goTypeName(t string) string {
	switch {
	case strings.HasPrefix(t, "[]"):
		return "a list"
	case t == "string":
		return "a string"
	case t == "bool":
		return "true or false"
	case strings.HasPrefix(t, "map") || strings.HasPrefix(t, "struct"):
		return "an object"
	}
	return t
}

// KubeconfigPath is where the node agent writes the plugin's kubeconfig.
func (c *Config) KubeconfigPath() string { return filepath.Join(c.CNIAgentRunDir, KubeconfigName) }

// AgentSocketPath is the node agent's pod-cache and readiness socket.
func (c *Config) AgentSocketPath() string {
	return filepath.Join(c.CNIAgentRunDir, podinfo.AgentSocketName)
}

// LogSocketPath is the agent's log socket.
func (c *Config) LogSocketPath() string { return filepath.Join(c.CNIAgentRunDir, logging.SocketName) }

// K8sArgs are the CNI_ARGS a Kubernetes runtime passes.
type K8sArgs struct {
	types.CommonArgs
	K8S_POD_NAME               types.UnmarshallableString //nolint:revive,stylecheck // CNI_ARGS key
	K8S_POD_NAMESPACE          types.UnmarshallableString //nolint:revive,stylecheck // CNI_ARGS key
	K8S_POD_INFRA_CONTAINER_ID types.UnmarshallableString //nolint:revive,stylecheck // CNI_ARGS key
	K8S_POD_UID                types.UnmarshallableString //nolint:revive,stylecheck // CNI_ARGS key
}

// ParseArgs reads CNI_ARGS.
func ParseArgs(s string) (*K8sArgs, error) {
	a := &K8sArgs{}
	if err := types.LoadArgs(s, a); err != nil {
		return nil, fmt.Errorf("invalid CNI_ARGS %q: %w", s, err)
	}
	return a, nil
}

// Bounded wraps an API source of pods in the config's bounds: each
// request within k8s_request_timeout, all attempts within k8s_retry_budget.
func (c *Config) Bounded(api podinfo.Source) *podinfo.Retrying {
	return &podinfo.Retrying{Source: api, RequestTimeout: c.requestTimeout, Budget: c.retryBudget}
}
