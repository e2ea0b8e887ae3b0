package testenv

import (
	"fmt"
	"path/filepath"
	"sort"
	"strings"

	"helm.sh/helm/v3/pkg/chart/loader"
	"helm.sh/helm/v3/pkg/chartutil"
	"helm.sh/helm/v3/pkg/engine"
	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"
	"sigs.k8s.io/yaml"
)

// ChartDir is the repository's chart, relative to the module root.
const ChartDir = "deployments/helm/istio-cni"

// RenderChart renders the repository's chart as `helm template istio-cni
// -n istio-system` would: valuesYAML is a values file's text, kubeVersion
// the cluster version the templates see (e.g. "v1.33.2-gke.1111"; empty
// means Helm's default). It returns template file name -> manifest text;
// a render failure (such as a value the chart rejects) is the error.
// Each of over is a values text merged on top, as a later -f or --set is
// (an operator's values file, then the hub of this project's image), and
// values that name no registry for the image get TestHub (WithTestHub).
func RenderChart(valuesYAML string, kubeVersion string, over ...string) (map[string]string, error) {
	root, err := RepoRoot()
	if err != nil {
		return nil, err
	}
	ch, err := loader.Load(filepath.Join(root, ChartDir))
	if err != nil {
		return nil, err
	}
	vals, err := ChartValues(valuesYAML, over...)
	if err != nil {
		return nil, err
	}
	var caps *chartutil.Capabilities
	if kubeVersion != "" {
		kv, err := chartutil.ParseKubeVersion(kubeVersion)
		if err != nil {
			return nil, fmt.Errorf("kube version %q: %w", kubeVersion, err)
		}
		caps = chartutil.DefaultCapabilities.Copy()
		caps.KubeVersion = *kv
	}
	rv, err := chartutil.ToRenderValues(ch, vals, chartutil.ReleaseOptions{Name: "istio-cni", Namespace: "istio-system", IsInstall: true}, caps)
	if err != nil {
		return nil, err
	}
	return engine.Render(ch, rv)
}

// ChartValues are the values RenderChart renders with: valuesYAML, each of
// over merged on top, and TestHub when they name no registry.
func ChartValues(valuesYAML string, over ...string) (chartutil.Values, error) {
	vals, err := chartutil.ReadValues([]byte(valuesYAML))
	if err != nil {
		return nil, fmt.Errorf("values: %w", err)
	}
	for _, o := range over {
		ov, err := chartutil.ReadValues([]byte(o))
		if err != nil {
			return nil, fmt.Errorf("values: %w", err)
		}
		// Helm's own merge of a later values file: ov wins, tables
		// merged key by key.
		vals = chartutil.MergeTables(ov, vals)
	}
	WithTestHub(vals)
	return vals, nil
}

// TestHub is the registry the tests name for the agent's image when their
// values name none: the chart has no default (Istio's registries hold
// Istio's agent), so an operator always names one.
const TestHub = "example.com/mesh"

// WithTestHub gives vals TestHub as global.hub when they name no registry for the
// agent's image (hub, global.hub or cni.hub, even empty, or an image
// reference with a "/"), so that a test of another value renders as the
// operator's install would.
func WithTestHub(vals map[string]any) {
	names := func(m map[string]any) bool {
		if m == nil {
			return false
		}
		_, hub := m["hub"]
		image, _ := m["image"].(string)
		return hub || strings.Contains(image, "/")
	}
	sub := func(key string) map[string]any {
		m, _ := vals[key].(map[string]any)
		return m
	}
	if names(vals) || names(sub("global")) || names(sub("cni")) {
		return
	}
	// global.hub, the weakest of the keys: anything the values or a named
	// value set give still wins.
	if g := sub("global"); g != nil {
		g["hub"] = TestHub
	} else {
		vals["global"] = map[string]any{"hub": TestHub}
	}
}

// RenderedObjects splits rendered manifests into YAML documents, keyed by
// "<Kind>/<name>" (names are unique per kind in this chart).
func RenderedObjects(rendered map[string]string) (map[string]string, error) {
	out := map[string]string{}
	files := make([]string, 0, len(rendered))
	for f := range rendered {
		files = append(files, f)
	}
	sort.Strings(files)
	for _, f := range files {
		if strings.HasSuffix(f, ".tpl") {
			continue
		}
		for _, doc := range strings.Split(rendered[f], "\n---") {
			var meta struct {
				Kind     string `json:"kind"`
				Metadata struct {
					Name string `json:"name"`
				} `json:"metadata"`
			}
			if err := yaml.Unmarshal([]byte(doc), &meta); err != nil {
				return nil, fmt.Errorf("%s: %w", f, err)
			}
			if meta.Kind == "" {
				continue
			}
			key := meta.Kind + "/" + meta.Metadata.Name
			if _, dup := out[key]; dup {
				return nil, fmt.Errorf("%s rendered twice", key)
			}
			out[key] = doc
		}
	}
	return out, nil
}

// AgentInvocation returns the command line and environment the kubelet
// would start the rendered DaemonSet's install-cni container with: args is
// the command followed by the container's args; env is the ConfigMap's data
// (envFrom) overlaid by the container's env, with $(VAR) references
// expanded as the kubelet expands them. Variables whose value comes from
// valueFrom (the node and pod names, the namespace, GOMEMLIMIT and
// GOMAXPROCS from the container's limits) have no value before the pod
// exists and are left out: the caller sets the ones it needs.
func AgentInvocation(rendered map[string]string) (args []string, env map[string]string, err error) {
	objs, err := RenderedObjects(rendered)
	if err != nil {
		return nil, nil, err
	}
	doc, ok := objs["DaemonSet/istio-cni-node"]
	if !ok {
		return nil, nil, fmt.Errorf("no DaemonSet istio-cni-node rendered")
	}
	var ds appsv1.DaemonSet
	if err := yaml.UnmarshalStrict([]byte(doc), &ds); err != nil {
		return nil, nil, fmt.Errorf("DaemonSet: %w", err)
	}
	var c *corev1.Container
	for i := range ds.Spec.Template.Spec.Containers {
		if ds.Spec.Template.Spec.Containers[i].Name == "install-cni" {
			c = &ds.Spec.Template.Spec.Containers[i]
		}
	}
	if c == nil {
		return nil, nil, fmt.Errorf("DaemonSet has no install-cni container")
	}
	env = map[string]string{}
	for _, src := range c.EnvFrom {
		if src.ConfigMapRef == nil {
			return nil, nil, fmt.Errorf("envFrom other than a ConfigMap is not supported")
		}
		cmDoc, ok := objs["ConfigMap/"+src.ConfigMapRef.Name]
		if !ok {
			if src.ConfigMapRef.Optional != nil && *src.ConfigMapRef.Optional {
				continue
			}
			return nil, nil, fmt.Errorf("envFrom names ConfigMap %s, which is not rendered", src.ConfigMapRef.Name)
		}
		var cm corev1.ConfigMap
		if err := yaml.UnmarshalStrict([]byte(cmDoc), &cm); err != nil {
			return nil, nil, fmt.Errorf("ConfigMap %s: %w", src.ConfigMapRef.Name, err)
		}
		for k, v := range cm.Data {
			// The kubelet skips keys that cannot be variable names.
			if k == "" || strings.Contains(k, "=") {
				continue
			}
			env[src.Prefix+k] = v
		}
	}
	for _, e := range c.Env {
		if e.ValueFrom != nil {
			delete(env, e.Name)
			continue
		}
		env[e.Name] = expandKubeVars(e.Value, env)
	}
	for _, a := range append(append([]string{}, c.Command...), c.Args...) {
		args = append(args, expandKubeVars(a, env))
	}
	return args, env, nil
}

// expandKubeVars expands $(NAME) from vars, leaves unknown references as
// they are and turns $$ into $, as the kubelet does for env and args.
func expandKubeVars(s string, vars map[string]string) string {
	var b strings.Builder
	for i := 0; i < len(s); i++ {
		if s[i] != '$' || i+1 >= len(s) {
			b.WriteByte(s[i])
			continue
		}
		switch s[i+1] {
		case '$':
			b.WriteByte('$')
			i++
		case '(':
			end := strings.IndexByte(s[i+2:], ')')
			if end < 0 {
				b.WriteString(s[i:])
				return b.String()
			}
			name := s[i+2 : i+2+end]
			if v, ok := vars[name]; ok {
				b.WriteString(v)
			} else {
				b.WriteString(s[i : i+3+end])
			}
			i += 2 + end
		default:
			b.WriteByte(s[i])
		}
	}
	return b.String()
}
