// Package chart renders the Helm chart with the Helm SDK for a matrix of
// values (Istio values files among them), checks what each renders, compares
// a few with goldens, lints them, and has the real kube-apiserver validate
// every object with a server-side dry run. It also checks that each value
// of Istio's istio-cni chart works here, is accepted without effect for a
// stated reason, or fails the render naming the value.
package chart

import (
	"context"
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"
	"reflect"
	"sort"
	"strings"
	"testing"
	"time"

	"helm.sh/helm/v3/pkg/chartutil"
	"helm.sh/helm/v3/pkg/lint"
	"helm.sh/helm/v3/pkg/lint/support"
	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"
	networkingv1 "k8s.io/api/networking/v1"
	rbacv1 "k8s.io/api/rbac/v1"
	apiextv1 "k8s.io/apiextensions-apiserver/pkg/apis/apiextensions/v1"
	apiextclient "k8s.io/apiextensions-apiserver/pkg/client/clientset/clientset"
	"k8s.io/apimachinery/pkg/api/meta"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/client-go/discovery"
	"k8s.io/client-go/dynamic"
	"k8s.io/client-go/rest"
	"k8s.io/client-go/restmapper"
	"sigs.k8s.io/yaml"

	"github.com/istio-cni-go/istio-cni/internal/ambient"
	"github.com/istio-cni-go/istio-cni/internal/enablement"
	"github.com/istio-cni-go/istio-cni/internal/testenv"
	"github.com/istio-cni-go/istio-cni/internal/testutil"
)

const chartDir = "../../deployments/helm/istio-cni"

var cluster *testenv.Cluster

func TestMain(m *testing.M) {
	testenv.EnterNodeNamespace()
	dir, err := os.MkdirTemp("", "istio-cni-chart-")
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(2)
	}
	cluster, err = testenv.StartCluster(filepath.Join(dir, "cluster"))
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(2)
	}
	code := m.Run()
	cluster.Stop()
	_ = os.RemoveAll(dir)
	os.Exit(code)
}

// rendered is one render of the chart.
type rendered struct {
	files map[string]string
	objs  map[string]string // "Kind/name" -> YAML document
}

func renderSet(t *testing.T, values, kube string, over ...string) *rendered {
	t.Helper()
	files, err := testenv.RenderChart(values, kube, over...)
	if err != nil {
		t.Fatalf("render: %v", err)
	}
	objs, err := testenv.RenderedObjects(files)
	if err != nil {
		t.Fatal(err)
	}
	return &rendered{files: files, objs: objs}
}

// text is every rendered file, in the goldens' form.
func (r *rendered) text() string {
	keys := make([]string, 0, len(r.files))
	for k := range r.files {
		keys = append(keys, k)
	}
	sort.Strings(keys)
	var all strings.Builder
	for _, k := range keys {
		if strings.TrimSpace(r.files[k]) == "" || strings.HasSuffix(k, ".tpl") {
			continue
		}
		fmt.Fprintf(&all, "# %s\n%s\n", filepath.Base(k), strings.TrimSpace(r.files[k]))
	}
	return all.String()
}

func (r *rendered) kinds() []string {
	var out []string
	for k := range r.objs {
		out = append(out, k)
	}
	sort.Strings(out)
	return out
}

func (r *rendered) has(key string) bool { _, ok := r.objs[key]; return ok }

// decode fills into from the object, rejecting fields its type lacks.
func (r *rendered) decode(t *testing.T, key string, into any) {
	t.Helper()
	doc, ok := r.objs[key]
	if !ok {
		t.Fatalf("%s not rendered; rendered: %v", key, r.kinds())
	}
	if err := yaml.UnmarshalStrict([]byte(doc), into); err != nil {
		t.Fatalf("%s: %v", key, err)
	}
}

func (r *rendered) daemonSet(t *testing.T) *appsv1.DaemonSet {
	t.Helper()
	var ds appsv1.DaemonSet
	r.decode(t, "DaemonSet/istio-cni-node", &ds)
	return &ds
}

func (r *rendered) container(t *testing.T) corev1.Container {
	t.Helper()
	ds := r.daemonSet(t)
	if n := len(ds.Spec.Template.Spec.Containers); n != 1 {
		t.Fatalf("%d containers", n)
	}
	return ds.Spec.Template.Spec.Containers[0]
}

func (r *rendered) config(t *testing.T) map[string]string {
	t.Helper()
	var cm corev1.ConfigMap
	r.decode(t, "ConfigMap/istio-cni-config", &cm)
	return cm.Data
}

func (r *rendered) hostPath(t *testing.T, volume string) string {
	t.Helper()
	vols := r.daemonSet(t).Spec.Template.Spec.Volumes
	for i := range vols {
		if v := &vols[i]; v.Name == volume && v.HostPath != nil {
			return v.HostPath.Path
		}
	}
	return ""
}

func (r *rendered) rules(t *testing.T, role string) []rbacv1.PolicyRule {
	t.Helper()
	var cr rbacv1.ClusterRole
	r.decode(t, "ClusterRole/"+role, &cr)
	return cr.Rules
}

func (r *rendered) envVar(t *testing.T, name string) (corev1.EnvVar, bool) {
	t.Helper()
	for _, e := range r.container(t).Env {
		if e.Name == name {
			return e, true
		}
	}
	return corev1.EnvVar{}, false
}

func eq[T any](t *testing.T, what string, got, want T) {
	t.Helper()
	if !reflect.DeepEqual(got, want) {
		t.Errorf("%s = %#v, want %#v", what, got, want)
	}
}

func wantArgs(want ...string) func(*testing.T, *rendered) {
	return func(t *testing.T, r *rendered) {
		c := r.container(t)
		eq(t, "command", c.Command, []string{"install-cni"})
		if len(want) == 0 {
			want = nil
		}
		eq(t, "args", c.Args, want)
	}
}

func wantConfig(kv ...string) func(*testing.T, *rendered) {
	return func(t *testing.T, r *rendered) {
		data := r.config(t)
		for i := 0; i+1 < len(kv); i += 2 {
			got, ok := data[kv[i]]
			switch {
			case kv[i+1] == "<absent>":
				if ok {
					t.Errorf("ConfigMap has %s=%q, want none", kv[i], got)
				}
			case !ok || got != kv[i+1]:
				t.Errorf("ConfigMap %s = %q (present %v), want %q", kv[i], got, ok, kv[i+1])
			}
		}
	}
}

func wantDirs(bin, conf string) func(*testing.T, *rendered) {
	return func(t *testing.T, r *rendered) {
		eq(t, "cni-bin-dir", r.hostPath(t, "cni-bin-dir"), bin)
		eq(t, "cni-net-dir", r.hostPath(t, "cni-net-dir"), conf)
	}
}

func wantObjects(keys ...string) func(*testing.T, *rendered) {
	return func(t *testing.T, r *rendered) {
		sort.Strings(keys)
		eq(t, "objects", r.kinds(), keys)
	}
}

func wantImage(image, policy string) func(*testing.T, *rendered) {
	return func(t *testing.T, r *rendered) {
		c := r.container(t)
		eq(t, "image", c.Image, image)
		eq(t, "imagePullPolicy", string(c.ImagePullPolicy), policy)
	}
}

func wantRequests(cpu, memory string) func(*testing.T, *rendered) {
	return func(t *testing.T, r *rendered) {
		req := r.container(t).Resources.Requests
		eq(t, "cpu request", req.Cpu().String(), cpu)
		eq(t, "memory request", req.Memory().String(), memory)
	}
}

// wantResources checks the container's requests and limits, entry by
// entry, and that no null reached the rendered DaemonSet.
func wantResources(requests, limits map[string]string) func(*testing.T, *rendered) {
	return func(t *testing.T, r *rendered) {
		res := r.container(t).Resources
		for _, part := range []struct {
			name string
			got  corev1.ResourceList
			want map[string]string
		}{{"requests", res.Requests, requests}, {"limits", res.Limits, limits}} {
			got := map[string]string{}
			for k, q := range part.got {
				got[string(k)] = q.String()
			}
			if len(part.want) == 0 {
				part.want = map[string]string{}
			}
			eq(t, part.name, got, part.want)
		}
		if ds := r.objs["DaemonSet/istio-cni-node"]; strings.Contains(ds, ": null") {
			t.Errorf("the DaemonSet renders a null:\n%s", ds)
		}
	}
}

// wantAppArmor checks which of the two forms of "unconfined" is rendered.
func wantAppArmor(annotation bool) func(*testing.T, *rendered) {
	return func(t *testing.T, r *rendered) {
		ds := r.daemonSet(t)
		got := ds.Spec.Template.Annotations["container.apparmor.security.beta.kubernetes.io/install-cni"]
		field := ds.Spec.Template.Spec.Containers[0].SecurityContext.AppArmorProfile
		if annotation {
			eq(t, "AppArmor annotation", got, "unconfined")
			if field != nil {
				t.Errorf("appArmorProfile %+v set with the annotation", field)
			}
		} else {
			if got != "" {
				t.Errorf("AppArmor annotation %q set, want the field only", got)
			}
			if field == nil || field.Type != corev1.AppArmorProfileTypeUnconfined {
				t.Errorf("appArmorProfile = %+v, want Unconfined", field)
			}
		}
	}
}

func wantSELinux(want *corev1.SELinuxOptions) func(*testing.T, *rendered) {
	return func(t *testing.T, r *rendered) {
		eq(t, "seLinuxOptions", r.container(t).SecurityContext.SELinuxOptions, want)
	}
}

func wantQuota(pods int64) func(*testing.T, *rendered) {
	return func(t *testing.T, r *rendered) {
		if pods == 0 {
			if r.has("ResourceQuota/istio-cni-resource-quota") {
				t.Error("ResourceQuota rendered")
			}
			return
		}
		var q corev1.ResourceQuota
		r.decode(t, "ResourceQuota/istio-cni-resource-quota", &q)
		eq(t, "quota pods", q.Spec.Hard.Pods().Value(), pods)
		eq(t, "quota scope", q.Spec.ScopeSelector.MatchExpressions, []corev1.ScopedResourceSelectorRequirement{
			{ScopeName: corev1.ResourceQuotaScopePriorityClass, Operator: corev1.ScopeSelectorOpIn, Values: []string{"system-node-critical"}}})
	}
}

// wantMaxUnavailable: the DaemonSet's rolling update lets want pods be
// unavailable at once.
func wantMaxUnavailable(want string) func(*testing.T, *rendered) {
	return func(t *testing.T, r *rendered) {
		s := r.daemonSet(t).Spec.UpdateStrategy
		if s.Type != appsv1.RollingUpdateDaemonSetStrategyType || s.RollingUpdate == nil || s.RollingUpdate.MaxUnavailable == nil ||
			s.RollingUpdate.MaxUnavailable.String() != want {
			t.Errorf("update strategy %+v, want RollingUpdate with maxUnavailable %s", s, want)
		}
	}
}

// wantSameAs: the render equals another value set's (a value without effect).
func wantSameAs(values string) func(*testing.T, *rendered) {
	return func(t *testing.T, r *rendered) {
		if other := renderSet(t, values, "").text(); r.text() != other {
			t.Errorf("render differs from that of %q", values)
		}
	}
}

func all(checks ...func(*testing.T, *rendered)) func(*testing.T, *rendered) {
	return func(t *testing.T, r *rendered) {
		for _, c := range checks {
			c(t, r)
		}
	}
}

type valueSet struct {
	values string
	// kube is the cluster version the templates see; empty is Helm's default.
	kube string
	// over is merged on top of values, as an operator's --set is.
	over string
	// golden: the whole render is compared with testdata/<name>.golden.yaml.
	golden bool
	check  func(*testing.T, *rendered)
}

var defaultObjects = []string{"ConfigMap/istio-cni-config", "DaemonSet/istio-cni-node", "ServiceAccount/istio-cni",
	"ClusterRole/istio-cni", "ClusterRoleBinding/istio-cni", "ClusterRole/istio-cni-repair-role", "ClusterRoleBinding/istio-cni-repair-rolebinding"}

// ambientObjects: the default objects and ambient mode's role and binding.
func ambientObjects(more ...string) []string {
	return append(append(append([]string{}, defaultObjects...), "ClusterRole/istio-cni-ambient", "ClusterRoleBinding/istio-cni-ambient"), more...)
}

// istioValuesFile is what an operator of Istio's chart runs today: the
// legacy cni.* layout, a revision, scoped log levels, JSON logs.
const istioValuesFile = `revision: canary
ownerName: istio-cni-canary
cni:
  hub: docker.io/istio
  tag: 1.30.1
  logging:
    level: "cni:debug,default:warn"
  excludeNamespaces: [istio-system, kube-system]
  cniBinDir: /opt/cni/bin
  cniConfDir: /etc/cni/net.d
  repair:
    enabled: true
    repairPods: true
    hub: ""
    tag: ""
  seccompProfile:
    type: RuntimeDefault
  resourceQuotas:
    enabled: true
    pods: 100
  env:
    CNI_CONF_GROUP_READ: "true"
global:
  variant: distroless
  logAsJson: true
  imagePullSecrets: [pull-secret]
  networkPolicy:
    enabled: true
  logging:
    level: "default:info"
`

// ourHub is what an operator with istioValuesFile sets on top: the hub of
// this project's image, in the file's cni.* layout, which wins over hub.
const ourHub = "cni:\n  hub: " + testenv.TestHub + "\n"

var valueSets = map[string]valueSet{
	"default": {golden: true, check: all(
		wantObjects(defaultObjects...),
		wantBaseRBAC,
		wantNoAmbient,
		wantConfig(ambientDefaultConfig...),
		wantSelectors(defaultSelectors),
		wantArgs("--log_output_level=info"),
		wantDirs("/opt/cni/bin", "/etc/cni/net.d"),
		wantAppArmor(true),
		wantImage(testenv.TestHub+"/install-cni:latest", ""),
		wantRequests("100m", "100Mi"),
		wantConfig("REPAIR_REPAIR_PODS", "true", "PLUGIN_LOG_LEVEL", "<absent>", "CHAINED_CNI_PLUGIN", "true", "EXCLUDE_NAMESPACES", "kube-system"),
		func(t *testing.T, r *rendered) {
			ds := r.daemonSet(t)
			for k, v := range map[string]string{"istio.io/rev": "default", "install.operator.istio.io/owning-resource": "unknown",
				"operator.istio.io/component": "Cni", "release": "istio-cni", "app.kubernetes.io/part-of": "istio"} {
				eq(t, "DaemonSet label "+k, ds.Labels[k], v)
			}
			eq(t, "terminationGracePeriodSeconds", *ds.Spec.Template.Spec.TerminationGracePeriodSeconds, int64(30))
			for _, name := range []string{"NODE_NAME", "REPAIR_NODE_NAME", "POD_NAME", "POD_NAMESPACE"} {
				if e, ok := r.envVar(t, name); !ok || e.ValueFrom == nil || e.ValueFrom.FieldRef == nil {
					t.Errorf("env %s: %+v", name, e)
				}
			}
			for name, res := range map[string]string{"GOMEMLIMIT": "limits.memory", "GOMAXPROCS": "limits.cpu"} {
				if e, ok := r.envVar(t, name); !ok || e.ValueFrom == nil || e.ValueFrom.ResourceFieldRef == nil || e.ValueFrom.ResourceFieldRef.Resource != res {
					t.Errorf("env %s: %+v", name, e)
				}
			}
		})},
	// With the hub of this project's image on top: the file's is Istio's.
	"istio-values-file": {values: istioValuesFile, over: ourHub, golden: true, check: all(
		wantArgs("--log_output_level=cni:debug,default:warn", "--log_as_json"),
		wantImage(testenv.TestHub+"/install-cni:1.30.1-distroless", ""),
		wantConfig("EXCLUDE_NAMESPACES", "istio-system,kube-system", "CNI_CONF_GROUP_READ", "true"),
		wantQuota(100),
		func(t *testing.T, r *rendered) {
			var sa corev1.ServiceAccount
			r.decode(t, "ServiceAccount/istio-cni", &sa)
			eq(t, "imagePullSecrets", sa.ImagePullSecrets, []corev1.LocalObjectReference{{Name: "pull-secret"}})
			if !r.has("NetworkPolicy/istio-cni-canary") {
				t.Errorf("no NetworkPolicy istio-cni-canary: %v", r.kinds())
			}
			if e, _ := r.envVar(t, "CNI_CONF_GROUP_READ"); e.Value != "true" {
				t.Errorf("env CNI_CONF_GROUP_READ = %+v", e)
			}
			eq(t, "seccompProfile", r.container(t).SecurityContext.SeccompProfile, &corev1.SeccompProfile{Type: corev1.SeccompProfileTypeRuntimeDefault})
		})},
	// Our own chart's values and extensions.
	"extras": {golden: true, values: `nativeNftables: auto
psp_cluster_role: psp-privileged
seLinuxOptions:
  level: s0
useAppArmorAnnotation: false
podAnnotations:
  team: mesh
  prometheus.io/scrape: "false"
podLabels:
  tier: node
daemonSetLabels:
  tier: node
affinity:
  nodeAffinity:
    requiredDuringSchedulingIgnoredDuringExecution:
      nodeSelectorTerms:
        - matchExpressions:
            - {key: mesh, operator: In, values: ["on"]}
resources:
  requests:
    cpu: 50m
tolerations: []
updateStrategy:
  type: OnDelete
terminationGracePeriodSeconds: 10
cniConfFileName: 10-calico.conflist
istioOwnedCNIConfig: true
istioOwnedCNIConfigFileName: 02-mesh.conflist
repair:
  repairPods: false
  labelPods: true
env:
  GOMAXPROCS: "2"
  REPAIR_ENABLED: "true"
`, check: all(
		wantAppArmor(false),
		wantSELinux(&corev1.SELinuxOptions{Level: "s0", Type: "spc_t"}),
		wantConfig("NATIVE_NFTABLES", "auto", "REPAIR_LABEL_PODS", "true", "REPAIR_REPAIR_PODS", "false",
			"CNI_CONF_NAME", "10-calico.conflist", "ISTIO_OWNED_CNI_CONFIG", "true",
			"ISTIO_OWNED_CNI_CONF_FILENAME", "02-mesh.conflist", "ISTIO_OWNED_CNI_CONFIG_FILENAME", "02-mesh.conflist", "GOMAXPROCS", "2"),
		func(t *testing.T, r *rendered) {
			ds := r.daemonSet(t)
			eq(t, "scrape annotation", ds.Spec.Template.Annotations["prometheus.io/scrape"], "false")
			eq(t, "pod label", ds.Spec.Template.Labels["tier"], "node")
			eq(t, "tolerations", ds.Spec.Template.Spec.Tolerations, []corev1.Toleration(nil))
			if e, _ := r.envVar(t, "GOMAXPROCS"); e.Value != "2" || e.ValueFrom != nil {
				t.Errorf("env GOMAXPROCS = %+v, want the value given", e)
			}
			if !r.has("RoleBinding/istio-cni-psp") {
				t.Error("no psp RoleBinding")
			}
			// nativeNftables=auto looks at the host through /proc, with repair off too.
			eq(t, "host proc", r.hostPath(t, "cni-host-procfs"), "/proc")
		})},

	"istio-layout": {values: "cni:\n  excludeNamespaces: [kube-system, istio-system]\n  logging:\n    level: debug\n  cniBinDir: /opt/custom/bin\n", check: all(
		wantArgs("--log_output_level=debug"),
		wantDirs("/opt/custom/bin", "/etc/cni/net.d"),
		wantConfig("EXCLUDE_NAMESPACES", "kube-system,istio-system"))},
	// cni.* wins over the same key at the top level, as in Istio.
	"istio-layout-precedence": {values: "cniConfDir: /top\ncni:\n  cniConfDir: /legacy\n", check: wantDirs("/opt/cni/bin", "/legacy")},
	// CURRENT_AGENT_VERSION is the tag, as Istio's chart writes it.
	"image": {values: "hub: example.com/mesh\ntag: 1.2.3\nvariant: distroless\npullPolicy: Always\n",
		check: all(wantImage("example.com/mesh/install-cni:1.2.3-distroless", "Always"), wantConfig("CURRENT_AGENT_VERSION", "1.2.3"))},
	"image-global": {values: "global:\n  hub: example.org/istio\n  tag: 1.29.0\n  variant: debug\n  imagePullPolicy: IfNotPresent\n",
		check: all(wantImage("example.org/istio/install-cni:1.29.0-debug", "IfNotPresent"), wantConfig("CURRENT_AGENT_VERSION", "1.29.0"))},
	"image-reference": {values: "image: mirror.example/cni/agent:v7\ntag: ignored\n", check: wantImage("mirror.example/cni/agent:v7", "")},
	// Only Istio's own registries are refused: a mirror's path may say istio.
	"image-mirror-istio": {values: "hub: quay.io/istio\ntag: \"1.30\"\n", check: wantImage("quay.io/istio/install-cni:1.30", "")},
	"image-mirror-port":  {values: "image: localhost:5000/istio/install-cni:dev\n", check: wantImage("localhost:5000/istio/install-cni:dev", "")},

	"logging-level":          {values: "logging:\n  level: warn\n", check: wantArgs("--log_output_level=warn")},
	"logging-default-scoped": {values: "cni:\n  logging:\n    level: default:info\n", check: wantArgs("--log_output_level=default:info")},
	"logging-global-scoped":  {values: "global:\n  logging:\n    level: cni:debug,default:warn\n", check: wantArgs("--log_output_level=cni:debug,default:warn")},
	"logging-plugin":         {values: "cni:\n  logging:\n    level: cni-plugin:debug\n", check: all(wantArgs("--log_output_level=cni-plugin:debug"), wantConfig("PLUGIN_LOG_LEVEL", "<absent>"))},
	"logging-precedence":     {values: "logging:\n  level: warn\nlogLevel: error\nglobal:\n  logging:\n    level: debug\n", check: wantArgs("--log_output_level=warn")},
	// Istio's 1.2x defaults carried cni.logLevel: debug, which its
	// DaemonSet never read.
	"loglevel-istio-default":         {values: "cni:\n  logLevel: debug\nglobal:\n  logging:\n    level: \"default:warn\"\n", check: wantArgs("--log_output_level=default:warn")},
	"rolling-max-unavailable":        {values: "cni:\n  rollingMaxUnavailable: \"20%\"\n", check: wantMaxUnavailable("20%")},
	"rolling-max-unavailable-number": {values: "rollingMaxUnavailable: 3\n", check: wantMaxUnavailable("3")},
	"update-strategy-default":        {values: "", check: wantMaxUnavailable("1")},
	// Istio passes no level when both are empty; the agent's default applies.
	"logging-none":      {values: "global:\n  logging:\n    level: \"\"\n", check: wantArgs()},
	"logging-json":      {values: "global:\n  logAsJson: true\n", check: wantArgs("--log_output_level=info", "--log_as_json")},
	"repair-delete":     {values: "repair:\n  repairPods: false\n  deletePods: true\n", check: all(wantConfig("REPAIR_DELETE_PODS", "true", "REPAIR_REPAIR_PODS", "false"), repairRule("pods", "delete"))},
	"repair-label":      {values: "repair:\n  repairPods: false\n  labelPods: true\n", check: all(wantConfig("REPAIR_LABEL_PODS", "true", "REPAIR_REPAIR_PODS", "false"), repairRule("pods/status", "patch"))},
	"repair-precedence": {values: "repair:\n  repairPods: true\n  deletePods: true\n  labelPods: true\n", check: all(wantConfig("REPAIR_REPAIR_PODS", "true", "REPAIR_DELETE_PODS", "false", "REPAIR_LABEL_PODS", "false"), repairRule("", ""))},
	"repair-off": {values: "repair:\n  enabled: false\n", check: all(
		wantConfig("REPAIR_ENABLED", "false", "REPAIR_REPAIR_PODS", "false"),
		wantObjects("ConfigMap/istio-cni-config", "DaemonSet/istio-cni-node", "ServiceAccount/istio-cni", "ClusterRole/istio-cni", "ClusterRoleBinding/istio-cni"),
		func(t *testing.T, r *rendered) { eq(t, "host proc", r.hostPath(t, "cni-host-procfs"), "") })},
	"nftables":      {values: "global:\n  nativeNftables: true\n", check: wantConfig("NATIVE_NFTABLES", "true")},
	"nftables-auto": {values: "nativeNftables: auto\nrepair:\n  enabled: false\n", check: all(wantConfig("NATIVE_NFTABLES", "auto"), func(t *testing.T, r *rendered) { eq(t, "host proc", r.hostPath(t, "cni-host-procfs"), "/proc") })},

	// Platforms.
	"gke":            {values: "global:\n  platform: gke\n", golden: true, check: all(wantDirs("/home/kubernetes/bin", "/etc/cni/net.d"), wantQuota(5000))},
	"gke-quota-pods": {values: "platform: gke\nresourceQuotas:\n  pods: 200\n", check: wantQuota(200)},
	// Istio's own detection: an empty cniBinDir on a cluster whose version says GKE.
	"gke-version-detect":  {values: "cniBinDir: \"\"\n", kube: "v1.33.2-gke.1111", check: all(wantDirs("/home/kubernetes/bin", "/etc/cni/net.d"), wantQuota(0))},
	"gke-version-dir-set": {kube: "v1.33.2-gke.1111", check: wantDirs("/opt/cni/bin", "/etc/cni/net.d")},
	"no-gke-version":      {values: "cniBinDir: \"\"\n", kube: "v1.33.2", check: wantDirs("/opt/cni/bin", "/etc/cni/net.d")},
	"openshift": {values: "platform: openshift\n", golden: true, check: all(
		wantDirs("/var/lib/cni/bin", "/etc/cni/multus/net.d"),
		wantConfig("CHAINED_CNI_PLUGIN", "false", "CNI_CONF_NAME", "istio-cni.conf"),
		wantSELinux(&corev1.SELinuxOptions{Type: "spc_t"}),
		sccRule(true),
		func(t *testing.T, r *rendered) {
			if !r.has("NetworkAttachmentDefinition/istio-cni") {
				t.Error("no NetworkAttachmentDefinition")
			}
		})},
	// The user's values win over the platform's.
	"openshift-overrides": {values: "global:\n  platform: openshift\nchained: true\ncniBinDir: /opt/cni/bin\nseLinuxOptions:\n  level: s0\n", check: all(
		wantDirs("/opt/cni/bin", "/etc/cni/multus/net.d"),
		wantConfig("CHAINED_CNI_PLUGIN", "true"),
		wantSELinux(&corev1.SELinuxOptions{Type: "spc_t", Level: "s0"}))},
	// Istio adds type spc_t to any SELinux options that name no type.
	"selinux-own-type": {values: "seLinuxOptions:\n  type: container_runtime_t\n  level: s0:c1\n", check: wantSELinux(&corev1.SELinuxOptions{Type: "container_runtime_t", Level: "s0:c1"})},
	// An empty dir (this chart's older default, in copied values files) keeps the platform's.
	"k3s-empty-dirs": {values: "platform: k3s\ncniBinDir: \"\"\ncni:\n  cniConfDir: \"\"\n", check: wantDirs("/var/lib/rancher/k3s/data/cni", "/var/lib/rancher/k3s/agent/etc/cni/net.d")},
	"k3s":            {values: "platform: k3s\n", check: wantDirs("/var/lib/rancher/k3s/data/cni", "/var/lib/rancher/k3s/agent/etc/cni/net.d")},
	"k3d":            {values: "platform: k3d\n", check: wantDirs("/bin", "/var/lib/rancher/k3s/agent/etc/cni/net.d")},
	"microk8s":       {values: "platform: microk8s\n", check: wantDirs("/var/snap/microk8s/current/opt/cni/bin", "/var/snap/microk8s/current/args/cni-network")},
	// minikube's only setting is the netns dir, which this chart never
	// mounts (ambient-netns-dir: not in ambient mode either).
	"minikube":        {values: "platform: minikube\n", check: wantSameAs("")},
	"standalone-conf": {values: "chained: false\ncniConfFileName: 99-istio.conf\n", check: wantConfig("CHAINED_CNI_PLUGIN", "false", "CNI_CONF_NAME", "99-istio.conf")},
	"multus": {values: "provider: multus\n", check: func(t *testing.T, r *rendered) {
		if !r.has("NetworkAttachmentDefinition/istio-cni") {
			t.Error("no NetworkAttachmentDefinition")
		}
	}},

	// AppArmor: the value alone decides, whatever the cluster's version, as
	// in Istio (the field needs Kubernetes 1.30; the annotation is deprecated
	// there but still honoured).
	"apparmor-annotation-k129": {kube: "v1.29.8", check: wantAppArmor(true)},
	"apparmor-field-k129":      {values: "useAppArmorAnnotation: false\n", kube: "v1.29.8", check: wantAppArmor(false)},
	"apparmor-annotation-k134": {kube: "v1.34.4", check: wantAppArmor(true)},
	"apparmor-field-k134":      {values: "useAppArmorAnnotation: false\n", kube: "v1.34.4", check: wantAppArmor(false)},

	"revision": {values: "revision: canary\nownerName: mesh-operator\nglobal:\n  networkPolicy:\n    enabled: true\n", check: func(t *testing.T, r *rendered) {
		for key, doc := range r.objs {
			var obj metav1.PartialObjectMetadata
			if err := yaml.Unmarshal([]byte(doc), &obj); err != nil {
				t.Fatal(err)
			}
			eq(t, key+" istio.io/rev", obj.Labels["istio.io/rev"], "canary")
			eq(t, key+" owning-resource", obj.Labels["install.operator.istio.io/owning-resource"], "mesh-operator")
			eq(t, key+" component", obj.Labels["operator.istio.io/component"], "Cni")
		}
		if !r.has("NetworkPolicy/istio-cni-canary") {
			t.Errorf("no NetworkPolicy istio-cni-canary: %v", r.kinds())
		}
	}},
	"network-policy": {values: "global:\n  networkPolicy:\n    enabled: true\n", check: func(t *testing.T, r *rendered) {
		var np networkingv1.NetworkPolicy
		r.decode(t, "NetworkPolicy/istio-cni", &np)
		eq(t, "pod selector", np.Spec.PodSelector.MatchLabels, map[string]string{"k8s-app": "istio-cni-node"})
		var ports []string
		for _, in := range np.Spec.Ingress {
			for _, p := range in.Ports {
				ports = append(ports, fmt.Sprintf("%s/%s", *p.Protocol, p.Port.String()))
			}
			if len(in.From) != 0 {
				t.Errorf("ingress from %v, want anyone", in.From)
			}
		}
		eq(t, "ingress ports", ports, []string{"TCP/15014", "TCP/8000"})
		eq(t, "egress", np.Spec.Egress, []networkingv1.NetworkPolicyEgressRule{{}})
	}},
	"scope-cluster": {values: "global:\n  resourceScope: cluster\n  networkPolicy:\n    enabled: true\npsp_cluster_role: psp\nprovider: multus\nresourceQuotas:\n  enabled: true\n",
		check: wantObjects("ClusterRole/istio-cni", "ClusterRoleBinding/istio-cni", "ClusterRole/istio-cni-repair-role", "ClusterRoleBinding/istio-cni-repair-rolebinding")},
	"scope-namespace": {values: "global:\n  resourceScope: namespace\n  networkPolicy:\n    enabled: true\npsp_cluster_role: psp\nprovider: multus\nresourceQuotas:\n  enabled: true\n",
		check: wantObjects("ConfigMap/istio-cni-config", "DaemonSet/istio-cni-node", "ServiceAccount/istio-cni", "NetworkPolicy/istio-cni",
			"RoleBinding/istio-cni-psp", "NetworkAttachmentDefinition/istio-cni", "ResourceQuota/istio-cni-resource-quota")},
	// global.defaultResources applies when resources is empty, as in Istio.
	"default-resources":        {values: "resources: null\nglobal:\n  defaultResources:\n    requests:\n      cpu: 250m\n      memory: 64Mi\n", check: wantRequests("250m", "64Mi")},
	"default-resources-unused": {values: "global:\n  defaultResources:\n    requests:\n      cpu: 250m\n", check: wantRequests("100m", "100Mi")},
	// A null entry removes the default's, as Helm's null does elsewhere,
	// rather than render "cpu: null"; a section left empty goes.
	"resources-null": {values: "resources:\n  requests:\n    cpu: null\n  limits:\n    memory: null\n",
		check: wantResources(map[string]string{"memory": "100Mi"}, nil)},
	"resources-null-limit": {values: "resources:\n  limits:\n    cpu: null\n    memory: 1Gi\n",
		check: wantResources(map[string]string{"cpu": "100m", "memory": "100Mi"}, map[string]string{"memory": "1Gi"})},
	"image-pull-secrets-object": {values: "global:\n  imagePullSecrets: [a, {name: b}]\n", check: func(t *testing.T, r *rendered) {
		var sa corev1.ServiceAccount
		r.decode(t, "ServiceAccount/istio-cni", &sa)
		eq(t, "imagePullSecrets", sa.ImagePullSecrets, []corev1.LocalObjectReference{{Name: "a"}, {Name: "b"}})
	}},

	// Profiles and compatibility versions. Only demo, openshift and the
	// ambient ones change this chart; the rest configure istiod. The
	// compatibility versions restore older ambient defaults.
	"profile-demo":        {values: "profile: demo\n", check: wantRequests("10m", "40Mi")},
	"global-profile-demo": {values: "global:\n  profile: demo\n", check: wantRequests("10m", "40Mi")},
	"profile-demo-user":   {values: "profile: demo\nresources:\n  requests:\n    cpu: 500m\n", check: wantRequests("500m", "40Mi")},
	"profile-default":     {values: "profile: default\n", check: wantSameAs("")},
	"profile-stable":      {values: "profile: stable\n", check: wantSameAs("")},
	"profile-preview":     {values: "profile: preview\n", check: wantSameAs("")},
	"profile-remote":      {values: "profile: remote\n", check: wantSameAs("")},
	"profile-openshift": {values: "profile: openshift\n", check: all(
		wantDirs("/var/lib/cni/bin", "/etc/cni/multus/net.d"), sccRule(true), wantSELinux(nil))},
	"profile-ambient-sidecar": {values: "profile: ambient\nambient:\n  enabled: false\n", check: wantImage(testenv.TestHub+"/install-cni:latest-distroless", "")},
	"compat-1.28": {values: "compatibilityVersion: \"1.28\"\n", check: all(wantNoAmbient,
		wantConfig("AMBIENT_ENABLED", "false", "AMBIENT_RECONCILE_POD_RULES_ON_STARTUP", "false", "AMBIENT_DNS_CAPTURE", "true"))},
	"compat-unquoted": {values: "compatibilityVersion: 1.30\nprofile: demo\n", check: wantSameAs("profile: demo\n")},
	// 1.24's shareHostNetworkNamespace=true needs ambient mode on.
	"global-compat": {values: "global:\n  compatibilityVersion: \"1.24\"\n  platform: k3s\n", check: all(wantNoAmbient,
		wantDirs("/var/lib/rancher/k3s/data/cni", "/var/lib/rancher/k3s/agent/etc/cni/net.d"),
		wantConfig("AMBIENT_DNS_CAPTURE", "false", "AMBIENT_RECONCILE_POD_RULES_ON_STARTUP", "false"))},

	// Ambient mode.
	"ambient": {values: "ambient:\n  enabled: true\n", golden: true, check: all(
		wantObjects(ambientObjects()...),
		wantAmbientPod(false), wantAmbientRBAC,
		wantConfig(append([]string{"AMBIENT_ENABLED", "true"}, ambientDefaultConfig[2:]...)...),
		wantSelectors(defaultSelectors),
		wantImage(testenv.TestHub+"/install-cni:latest", ""))},
	// Istio's chart: the agent in the node's network namespace.
	"profile-ambient-host-network": {values: "profile: ambient\nambient:\n  shareHostNetworkNamespace: true\n", golden: true, check: all(
		wantObjects(ambientObjects()...),
		wantAmbientPod(true), wantAmbientRBAC,
		wantConfig("AMBIENT_ENABLED", "true"),
		wantSelectors(defaultSelectors),
		wantImage(testenv.TestHub+"/install-cni:latest-distroless", ""))},
	"ambient-legacy-layout": {values: "cni:\n  ambient:\n    enabled: true\n", check: wantSameAs("ambient:\n  enabled: true\n")},
	// Every ambient value, from an Istio values file.
	"ambient-settings": {values: `ambient:
  enabled: true
  enablementSelectors:
    - podSelector:
        matchLabels: {mesh: ambient}
    - namespaceSelector:
        matchExpressions:
          - {key: mesh, operator: In, values: [ambient, all]}
  configDir: /etc/ambient
  dnsCapture: false
  ipv6: false
  reconcileIptablesOnStartup: false
  enableAmbientDetectionRetry: true
`, check: all(wantAmbientPod(false), wantAmbientRBAC,
		wantConfig("AMBIENT_ENABLED", "true", "AMBIENT_DNS_CAPTURE", "false", "AMBIENT_IPV6", "false",
			"AMBIENT_RECONCILE_POD_RULES_ON_STARTUP", "false", "ENABLE_AMBIENT_DETECTION_RETRY", "true"),
		wantSelectors([]enablementSelector{
			{PodSelector: &metav1.LabelSelector{MatchLabels: map[string]string{"mesh": "ambient"}}},
			{NamespaceSelector: &metav1.LabelSelector{MatchExpressions: []metav1.LabelSelectorRequirement{
				{Key: "mesh", Operator: metav1.LabelSelectorOpIn, Values: []string{"ambient", "all"}}}}},
		}))},
	// configDir is unused, as in Istio; cniNetnsDir is not needed (the agent
	// keeps the pod's namespace from the ADD and finds older pods' through
	// /proc), so neither changes the render.
	"ambient-config-dir": {values: "ambient:\n  enabled: true\n  configDir: /etc/ambient\n", check: wantSameAs("ambient:\n  enabled: true\n")},
	"ambient-netns-dir":  {values: "ambient:\n  enabled: true\ncniNetnsDir: /var/run/docker/netns\n", check: wantSameAs("ambient:\n  enabled: true\n")},
	"ambient-minikube":   {values: "platform: minikube\nambient:\n  enabled: true\n", check: wantSameAs("ambient:\n  enabled: true\n")},
	// /host/proc for ambient alone, and once with repair and nftables auto.
	"ambient-repair-off": {values: "ambient:\n  enabled: true\nrepair:\n  enabled: false\n", check: all(
		wantObjects("ConfigMap/istio-cni-config", "DaemonSet/istio-cni-node", "ServiceAccount/istio-cni", "ClusterRole/istio-cni", "ClusterRoleBinding/istio-cni",
			"ClusterRole/istio-cni-ambient", "ClusterRoleBinding/istio-cni-ambient"),
		wantConfig("REPAIR_ENABLED", "false"), wantAmbientPod(false), wantAmbientRBAC)},
	"ambient-nftables-auto": {values: "ambient:\n  enabled: true\nnativeNftables: auto\n", check: all(wantConfig("NATIVE_NFTABLES", "auto"), wantAmbientPod(false))},
	// env wins over the chart's settings, in the ConfigMap and the container.
	"ambient-env": {values: "ambient:\n  enabled: true\nenv:\n  ALLOW_SWITCH_TO_HOST_NS: \"false\"\n  AMBIENT_DNS_CAPTURE: \"false\"\n", check: all(
		wantConfig("AMBIENT_DNS_CAPTURE", "false", "ALLOW_SWITCH_TO_HOST_NS", "false"),
		func(t *testing.T, r *rendered) {
			var got []corev1.EnvVar
			for _, e := range r.container(t).Env {
				if e.Name == "ALLOW_SWITCH_TO_HOST_NS" {
					got = append(got, e)
				}
			}
			eq(t, "env ALLOW_SWITCH_TO_HOST_NS", got, []corev1.EnvVar{{Name: "ALLOW_SWITCH_TO_HOST_NS", Value: "false"}})
		})},
	// shareHostNetworkNamespace counts only with ambient on, as in Istio.
	"ambient-off-host-network": {values: "ambient:\n  shareHostNetworkNamespace: true\n", check: all(wantNoAmbient, wantSameAs(""))},
	// 1.24's defaults put the ambient agent in the node's network namespace.
	"profile-ambient-compat-1.24": {values: "profile: ambient\ncompatibilityVersion: \"1.24\"\n", check: all(
		wantAmbientPod(true), wantConfig("AMBIENT_DNS_CAPTURE", "false", "AMBIENT_RECONCILE_POD_RULES_ON_STARTUP", "false"))},
	"profile-openshift-ambient": {values: "profile: openshift-ambient\n", check: all(
		wantObjects(ambientObjects("NetworkAttachmentDefinition/istio-cni")...),
		wantAmbientPod(false), wantAmbientRBAC, sccRule(true),
		wantDirs("/var/lib/cni/bin", "/etc/cni/multus/net.d"),
		wantSELinux(&corev1.SELinuxOptions{Type: "spc_t"}),
		wantImage(testenv.TestHub+"/install-cni:latest-distroless", ""))},
	"global-profile-ambient-windows": {values: "global:\n  profile: ambient-windows\n", check: all(wantAmbientPod(false), wantAmbientRBAC)},
	// The role is cluster-scoped: resourceScope decides, as for the others.
	"ambient-scope-namespace": {values: "ambient:\n  enabled: true\nglobal:\n  resourceScope: namespace\n", check: all(
		wantObjects("ConfigMap/istio-cni-config", "DaemonSet/istio-cni-node", "ServiceAccount/istio-cni"), wantAmbientPod(false))},
	"ambient-scope-cluster": {values: "ambient:\n  enabled: true\nglobal:\n  resourceScope: cluster\n", check: all(
		wantObjects("ClusterRole/istio-cni", "ClusterRoleBinding/istio-cni", "ClusterRole/istio-cni-repair-role", "ClusterRoleBinding/istio-cni-repair-rolebinding",
			"ClusterRole/istio-cni-ambient", "ClusterRoleBinding/istio-cni-ambient"), wantAmbientRBAC)},
}

func repairRule(resource, verb string) func(*testing.T, *rendered) {
	return func(t *testing.T, r *rendered) {
		var extra []rbacv1.PolicyRule
		for _, rule := range r.rules(t, "istio-cni-repair-role") {
			if !reflect.DeepEqual(rule.Resources, []string{"events"}) {
				extra = append(extra, rule)
			}
		}
		if resource == "" {
			eq(t, "repair rules beyond events", extra, []rbacv1.PolicyRule(nil))
			return
		}
		if len(extra) != 1 || !reflect.DeepEqual(extra[0].Resources, []string{resource}) || !reflect.DeepEqual(extra[0].Verbs, []string{verb}) {
			t.Errorf("repair rules beyond events = %+v, want exactly %s %s", extra, verb, resource)
		}
	}
}

func sccRule(want bool) func(*testing.T, *rendered) {
	return func(t *testing.T, r *rendered) {
		got := false
		for _, rule := range r.rules(t, "istio-cni") {
			got = got || reflect.DeepEqual(rule.Resources, []string{"securitycontextconstraints"})
		}
		eq(t, "SCC rule", got, want)
	}
}

// ambientDefaultConfig: the ConfigMap's ambient keys with Istio's
// defaults, written with ambient mode off too, as Istio does.
var ambientDefaultConfig = []string{"AMBIENT_ENABLED", "false",
	"AMBIENT_DNS_CAPTURE", "true", "AMBIENT_IPV6", "true", "AMBIENT_RECONCILE_POD_RULES_ON_STARTUP", "true",
	"ENABLE_AMBIENT_DETECTION_RETRY", "false"}

// enablementSelector is one entry of AMBIENT_ENABLEMENT_SELECTOR.
type enablementSelector struct {
	PodSelector       *metav1.LabelSelector `json:"podSelector,omitempty"`
	NamespaceSelector *metav1.LabelSelector `json:"namespaceSelector,omitempty"`
}

// defaultSelectors: Istio's default ambient.enablementSelectors, a pod
// labelled ambient, or a pod not labelled none in a namespace labelled
// ambient.
var defaultSelectors = []enablementSelector{
	{PodSelector: &metav1.LabelSelector{MatchLabels: map[string]string{"istio.io/dataplane-mode": "ambient"}}},
	{
		PodSelector: &metav1.LabelSelector{MatchExpressions: []metav1.LabelSelectorRequirement{
			{Key: "istio.io/dataplane-mode", Operator: metav1.LabelSelectorOpNotIn, Values: []string{"none"}}}},
		NamespaceSelector: &metav1.LabelSelector{MatchLabels: map[string]string{"istio.io/dataplane-mode": "ambient"}},
	},
}

// wantSelectors: AMBIENT_ENABLEMENT_SELECTOR is YAML holding these
// selectors, and the agent's parser reads the same from it.
func wantSelectors(want []enablementSelector) func(*testing.T, *rendered) {
	return func(t *testing.T, r *rendered) {
		text, ok := r.config(t)["AMBIENT_ENABLEMENT_SELECTOR"]
		if !ok {
			t.Fatal("ConfigMap has no AMBIENT_ENABLEMENT_SELECTOR")
		}
		var got []enablementSelector
		if err := yaml.UnmarshalStrict([]byte(text), &got); err != nil {
			t.Fatalf("AMBIENT_ENABLEMENT_SELECTOR %q: %v", text, err)
		}
		eq(t, "AMBIENT_ENABLEMENT_SELECTOR", got, want)
		sel, err := ambient.ParseSelectors(text)
		if err != nil {
			t.Fatalf("the agent rejects AMBIENT_ENABLEMENT_SELECTOR %q: %v", text, err)
		}
		var wantSrc []ambient.Selector
		for _, w := range want {
			var e ambient.Selector
			if w.PodSelector != nil {
				e.PodSelector = asSelector(t, w.PodSelector)
			}
			if w.NamespaceSelector != nil {
				e.NamespaceSelector = asSelector(t, w.NamespaceSelector)
			}
			wantSrc = append(wantSrc, e)
		}
		eq(t, "the agent's selectors", sel.Source(), wantSrc)
	}
}

func (r *rendered) volumeMounts(t *testing.T, path string) []corev1.VolumeMount {
	t.Helper()
	var out []corev1.VolumeMount
	for _, m := range r.container(t).VolumeMounts {
		if m.MountPath == path {
			out = append(out, m)
		}
	}
	return out
}

func (r *rendered) volume(t *testing.T, name string) *corev1.Volume {
	t.Helper()
	vols := r.daemonSet(t).Spec.Template.Spec.Volumes
	for i := range vols {
		if vols[i].Name == name {
			return &vols[i]
		}
	}
	return nil
}

// wantNoAmbient: sidecar mode's pod and RBAC, nothing of ambient mode's.
func wantNoAmbient(t *testing.T, r *rendered) {
	t.Helper()
	wantConfig("AMBIENT_ENABLED", "false")(t, r)
	spec := r.daemonSet(t).Spec.Template.Spec
	eq(t, "hostNetwork", spec.HostNetwork, false)
	eq(t, "dnsPolicy", spec.DNSPolicy, corev1.DNSPolicy(""))
	if e, ok := r.envVar(t, "ALLOW_SWITCH_TO_HOST_NS"); ok {
		t.Errorf("env %+v without ambient mode", e)
	}
	for _, path := range []string{"/var/run/ztunnel", "/host/var/run/netns", "/run/xtables.lock"} {
		if m := r.volumeMounts(t, path); m != nil {
			t.Errorf("%s mounted without ambient mode: %+v", path, m)
		}
	}
	if v := r.volume(t, "cni-ztunnel-sock-dir"); v != nil {
		t.Errorf("volume %+v without ambient mode", v)
	}
	if r.has("ClusterRole/istio-cni-ambient") || r.has("ClusterRoleBinding/istio-cni-ambient") {
		t.Error("ambient RBAC rendered without ambient mode")
	}
}

// wantAmbientPod: the DaemonSet's pod in ambient mode, the agent in the
// node's network namespace (hostNetwork) or in a pod network of its own.
func wantAmbientPod(hostNetwork bool) func(*testing.T, *rendered) {
	return func(t *testing.T, r *rendered) {
		wantConfig("AMBIENT_ENABLED", "true")(t, r)
		spec := r.daemonSet(t).Spec.Template.Spec
		c := r.container(t)
		// ztunnel connects to the agent's ztunnel.sock here.
		eq(t, "/var/run/ztunnel mounts", r.volumeMounts(t, "/var/run/ztunnel"),
			[]corev1.VolumeMount{{Name: "cni-ztunnel-sock-dir", MountPath: "/var/run/ztunnel"}})
		dirOrCreate := corev1.HostPathDirectoryOrCreate
		eq(t, "ztunnel volume", r.volume(t, "cni-ztunnel-sock-dir"), &corev1.Volume{Name: "cni-ztunnel-sock-dir",
			VolumeSource: corev1.VolumeSource{HostPath: &corev1.HostPathVolumeSource{Path: "/var/run/ztunnel", Type: &dirOrCreate}}})
		// The node's xtables lock, for the probe SNAT on legacy nodes.
		eq(t, "/run/xtables.lock mounts", r.volumeMounts(t, "/run/xtables.lock"),
			[]corev1.VolumeMount{{Name: "xtables-lock", MountPath: "/run/xtables.lock"}})
		fileOrCreate := corev1.HostPathFileOrCreate
		eq(t, "xtables lock volume", r.volume(t, "xtables-lock"), &corev1.Volume{Name: "xtables-lock",
			VolumeSource: corev1.VolumeSource{HostPath: &corev1.HostPathVolumeSource{Path: "/run/xtables.lock", Type: &fileOrCreate}}})
		// The host's /proc, read-only, once whatever else wants it.
		eq(t, "/host/proc mounts", r.volumeMounts(t, "/host/proc"),
			[]corev1.VolumeMount{{Name: "cni-host-procfs", MountPath: "/host/proc", ReadOnly: true}})
		procVols := 0
		for i := range spec.Volumes {
			if v := &spec.Volumes[i]; v.HostPath != nil && v.HostPath.Path == "/proc" {
				procVols++
			}
		}
		eq(t, "volumes of the host's /proc", procVols, 1)
		// No netns dir: the agent keeps the pod's namespace from the ADD.
		if m := r.volumeMounts(t, "/host/var/run/netns"); m != nil {
			t.Errorf("netns dir mounted: %+v", m)
		}
		for i := range spec.Volumes {
			if v := &spec.Volumes[i]; v.HostPath != nil && strings.HasSuffix(v.HostPath.Path, "/netns") {
				t.Errorf("netns dir volume: %+v", *v)
			}
		}
		eq(t, "hostNetwork", spec.HostNetwork, hostNetwork)
		var switchEnv []corev1.EnvVar
		for _, e := range c.Env {
			if e.Name == "ALLOW_SWITCH_TO_HOST_NS" {
				switchEnv = append(switchEnv, e)
			}
		}
		if hostNetwork {
			eq(t, "dnsPolicy", spec.DNSPolicy, corev1.DNSClusterFirstWithHostNet)
			eq(t, "env ALLOW_SWITCH_TO_HOST_NS", switchEnv, []corev1.EnvVar(nil))
		} else {
			eq(t, "dnsPolicy", spec.DNSPolicy, corev1.DNSPolicy(""))
			eq(t, "env ALLOW_SWITCH_TO_HOST_NS", switchEnv, []corev1.EnvVar{{Name: "ALLOW_SWITCH_TO_HOST_NS", Value: "true"}})
		}
		// Istio's capabilities, unprivileged: SYS_ADMIN enters other
		// network namespaces, SYS_PTRACE reads other processes' ones.
		sc := c.SecurityContext
		eq(t, "privileged", *sc.Privileged, false)
		eq(t, "capabilities", sc.Capabilities, &corev1.Capabilities{Drop: []corev1.Capability{"ALL"},
			Add: []corev1.Capability{"NET_ADMIN", "NET_RAW", "SYS_PTRACE", "SYS_ADMIN", "DAC_OVERRIDE"}})
	}
}

// wantAmbientRBAC: ambient mode's role, exactly, bound to the agent, and
// the base role's DaemonSet rule kept.
func wantAmbientRBAC(t *testing.T, r *rendered) {
	t.Helper()
	eq(t, "istio-cni-ambient rules", r.rules(t, "istio-cni-ambient"), []rbacv1.PolicyRule{
		{APIGroups: []string{""}, Resources: []string{"pods/status"}, Verbs: []string{"patch"}},
		{APIGroups: []string{""}, Resources: []string{"namespaces"}, Verbs: []string{"get", "list", "watch"}},
		{APIGroups: []string{""}, Resources: []string{"events"}, Verbs: []string{"create", "patch"}},
	})
	var b rbacv1.ClusterRoleBinding
	r.decode(t, "ClusterRoleBinding/istio-cni-ambient", &b)
	eq(t, "istio-cni-ambient roleRef", b.RoleRef, rbacv1.RoleRef{APIGroup: "rbac.authorization.k8s.io", Kind: "ClusterRole", Name: "istio-cni-ambient"})
	eq(t, "istio-cni-ambient subjects", b.Subjects, []rbacv1.Subject{{Kind: "ServiceAccount", Name: "istio-cni", Namespace: "istio-system"}})
	found := false
	for _, rule := range r.rules(t, "istio-cni") {
		found = found || reflect.DeepEqual(rule, rbacv1.PolicyRule{APIGroups: []string{"apps"}, Resources: []string{"daemonsets"},
			ResourceNames: []string{"istio-cni-node"}, Verbs: []string{"get", "watch"}})
	}
	if !found {
		t.Errorf("istio-cni rules %+v lack apps/daemonsets get, watch on istio-cni-node", r.rules(t, "istio-cni"))
	}
}

// wantBaseRBAC: the agent's base role, exactly: its node's pods, its own
// DaemonSet by name, and nodes read (its own, at termination).
func wantBaseRBAC(t *testing.T, r *rendered) {
	t.Helper()
	eq(t, "istio-cni rules", r.rules(t, "istio-cni"), []rbacv1.PolicyRule{
		{APIGroups: []string{""}, Resources: []string{"pods"}, Verbs: []string{"get", "list", "watch"}},
		{APIGroups: []string{"apps"}, Resources: []string{"daemonsets"}, ResourceNames: []string{"istio-cni-node"}, Verbs: []string{"get", "watch"}},
		{APIGroups: []string{""}, Resources: []string{"nodes"}, Verbs: []string{"get"}},
	})
}

func sortedSets() []string {
	names := make([]string, 0, len(valueSets))
	for n := range valueSets {
		names = append(names, n)
	}
	sort.Strings(names)
	return names
}

func TestRenderGoldenAndDryRun(t *testing.T) {
	ctx := context.Background()
	ensureTestCluster(ctx, t)
	// The API server's deprecation warnings (the AppArmor annotation) are
	// expected here: Istio's default keeps the annotation.
	cfg := rest.CopyConfig(cluster.Config)
	cfg.WarningHandler = rest.NoWarnings{}
	dyn, err := dynamic.NewForConfig(cfg)
	if err != nil {
		t.Fatal(err)
	}
	disc, err := discovery.NewDiscoveryClientForConfig(cluster.Config)
	if err != nil {
		t.Fatal(err)
	}
	groups, err := restmapper.GetAPIGroupResources(disc)
	if err != nil {
		t.Fatal(err)
	}
	mapper := restmapper.NewDiscoveryRESTMapper(groups)
	goldens := map[string]bool{}
	for _, name := range sortedSets() {
		set := valueSets[name]
		t.Run(name, func(t *testing.T) {
			r := renderSet(t, set.values, set.kube, set.over)
			for _, key := range r.kinds() {
				obj := &unstructured.Unstructured{}
				if err := yaml.Unmarshal([]byte(r.objs[key]), &obj.Object); err != nil {
					t.Fatalf("%s: %v", key, err)
				}
				dryRun(ctx, t, dyn, mapper, obj)
			}
			if set.golden {
				goldens[name+".golden.yaml"] = true
				testutil.CompareGolden(t, name+".golden.yaml", r.text())
			}
			if set.check != nil {
				set.check(t, r)
			}
		})
	}
	// A golden no value set writes any more is stale.
	files, _ := filepath.Glob("testdata/*.golden.yaml")
	for _, f := range files {
		if !goldens[filepath.Base(f)] {
			t.Errorf("%s belongs to no golden value set; remove it", f)
		}
	}
}

// TestRenderFailures: the values Istio's chart fails on fail here, naming
// the value.
func TestRenderFailures(t *testing.T) {
	for _, tc := range []struct{ values, want string }{
		{"platform: eks\n", "platform=eks: unknown platform"},
		{"global:\n  platform: kind\n", "global.platform=kind: unknown platform"},
		// Istio's charts ship no minimal or empty profile (those are istioctl's).
		{"profile: minimal\n", "profile=minimal: unknown profile"},
		{"profile: empty\n", "profile=empty: unknown profile"},
		{"global:\n  profile: nope\n", "global.profile=nope: unknown profile"},
		{"compatibilityVersion: \"1.19\"\n", "compatibilityVersion=1.19: unknown compatibility version"},
		{"compatibilityVersion: \"2.0\"\n", "compatibilityVersion=2.0: unknown compatibility version"},
		{"global:\n  compatibilityVersion: \"1.10\"\n", "global.compatibilityVersion=1.10: unknown compatibility version"},
		{"defaults:\n  hub: x\n", "defaults="},
		{"global:\n  resourceScope: everything\n", "global.resourceScope=everything"},
		// No registry, or one of Istio's, whose install-cni is Istio's agent.
		{"hub: \"\"\n", "hub: no registry for the agent's image"},
		{"hub: docker.io/istio\n", "hub=docker.io/istio: docker.io/istio/install-cni:latest is Istio's own install-cni image"},
		{"cni:\n  hub: registry.istio.io/release\n  tag: 1.30.1\n", "cni.hub=registry.istio.io/release: registry.istio.io/release/install-cni:1.30.1 is Istio's own"},
		{"hub: ours.example/mesh\ncni:\n  hub: docker.io/istio\n", "cni.hub=docker.io/istio: docker.io/istio/install-cni:latest is Istio's own"},
		{"hub: Docker.io/Istio\n", "hub=Docker.io/Istio: Docker.io/Istio/install-cni:latest is Istio's own"},
		{"hub: registry-1.docker.io/istio\n", "hub=registry-1.docker.io/istio"},
		{"cni:\n  image: gcr.io/istio-testing/install-cni:1.31-dev\n", "cni.image=gcr.io/istio-testing/install-cni:1.31-dev"},
		{"global:\n  hub: gcr.io/istio-release\n  variant: distroless\n", "global.hub=gcr.io/istio-release: gcr.io/istio-release/install-cni:latest-distroless is Istio's own"},
		{"image: istio/install-cni:1.30.1\n", "image=istio/install-cni:1.30.1: istio/install-cni:1.30.1 is Istio's own"},
		{"image: docker.io/istio/install-cni@sha256:0123\n", "image=docker.io/istio/install-cni@sha256:0123"},
	} {
		t.Run(strings.TrimSpace(strings.ReplaceAll(tc.values, "\n", " ")), func(t *testing.T) {
			_, err := testenv.RenderChart(tc.values, "")
			if err == nil || !strings.Contains(err.Error(), tc.want) {
				t.Fatalf("render error = %v, want one containing %q", err, tc.want)
			}
		})
	}
}

// How each value of Istio's istio-cni chart (its newest values.yaml, plus
// the profile selectors of its zzz_profile.yaml) is handled here.
const (
	works    = "works"    // the render changes, as in Istio
	noEffect = "noEffect" // accepted; the render is the default's (why says why)
	fails    = "fails"    // the render fails naming the value
)

// istioValue is one value of Istio's chart, a values file setting it, and
// how this chart handles it.
type istioValue struct{ key, values, handling, why string }

var istioValues = []istioValue{
	{"hub", "hub: example.com/x\n", works, ""},
	{"tag", "tag: 1.2.3\n", works, ""},
	{"variant", "variant: distroless\n", works, ""},
	{"image", "image: example.com/x/install-cni:1\n", works, ""},
	{"pullPolicy", "pullPolicy: Always\n", works, ""},
	{"logging.level", "logging:\n  level: debug\n", works, ""},
	{"cniBinDir", "cniBinDir: /x\n", works, ""},
	{"cniConfDir", "cniConfDir: /x\n", works, ""},
	{"cniConfFileName", "cniConfFileName: 10-x.conflist\n", works, ""},
	{"cniNetnsDir", "cniNetnsDir: /x\n", noEffect, "not needed: the agent keeps the pod's namespace from the ADD and finds older pods' through /proc (Istio mounts it in ambient mode only; see istioAmbientValues)"},
	{"istioOwnedCNIConfig", "istioOwnedCNIConfig: true\n", works, ""},
	{"istioOwnedCNIConfigFileName", "istioOwnedCNIConfigFileName: 03-x.conflist\n", works, ""},
	{"excludeNamespaces", "excludeNamespaces: [a]\n", works, ""},
	{"affinity", "affinity:\n  nodeAffinity: {}\n", works, ""},
	{"daemonSetLabels", "daemonSetLabels: {a: b}\n", works, ""},
	{"podAnnotations", "podAnnotations: {a: b}\n", works, ""},
	{"podLabels", "podLabels: {a: b}\n", works, ""},
	{"chained", "chained: false\n", works, ""},
	{"provider", "provider: multus\n", works, ""},
	{"ambient.enabled", "ambient:\n  enabled: true\n", works, ""},
	// The ConfigMap carries these with ambient off too, as Istio's does.
	{"ambient.enablementSelectors", "ambient:\n  enablementSelectors: []\n", works, ""},
	{"ambient.configDir", "ambient:\n  configDir: /x\n", noEffect, "unused in Istio too"},
	{"ambient.dnsCapture", "ambient:\n  dnsCapture: false\n", works, ""},
	{"ambient.ipv6", "ambient:\n  ipv6: false\n", works, ""},
	{"ambient.reconcileIptablesOnStartup", "ambient:\n  reconcileIptablesOnStartup: false\n", works, ""},
	{"ambient.shareHostNetworkNamespace", "ambient:\n  shareHostNetworkNamespace: true\n", noEffect, "only with ambient.enabled, as in Istio (see istioAmbientValues)"},
	{"ambient.enableAmbientDetectionRetry", "ambient:\n  enableAmbientDetectionRetry: true\n", works, ""},
	{"repair.enabled", "repair:\n  enabled: false\n", works, ""},
	{"repair.repairPods", "repair:\n  repairPods: false\n", works, ""},
	{"repair.deletePods", "repair:\n  repairPods: false\n  deletePods: true\n", works, ""},
	{"repair.labelPods", "repair:\n  repairPods: false\n  labelPods: true\n", works, ""},
	{"repair.initContainerName", "repair:\n  initContainerName: x\n", works, ""},
	{"repair.brokenPodLabelKey", "repair:\n  brokenPodLabelKey: x\n", works, ""},
	{"repair.brokenPodLabelValue", "repair:\n  brokenPodLabelValue: x\n", works, ""},
	{"repair.hub", "repair:\n  hub: x\n", noEffect, "unused in Istio too"},
	{"repair.tag", "repair:\n  tag: x\n", noEffect, "unused in Istio too"},
	{"seccompProfile", "seccompProfile: {type: RuntimeDefault}\n", works, ""},
	{"seLinuxOptions", "seLinuxOptions: {level: s0}\n", works, ""},
	{"useAppArmorAnnotation", "useAppArmorAnnotation: false\n", works, ""},
	{"resources", "resources: {requests: {cpu: 1}}\n", works, ""},
	{"resourceQuotas.enabled", "resourceQuotas:\n  enabled: true\n", works, ""},
	{"resourceQuotas.pods", "resourceQuotas:\n  enabled: true\n  pods: 9\n", works, ""},
	{"tolerations", "tolerations: []\n", works, ""},
	{"updateStrategy", "updateStrategy: {type: OnDelete}\n", works, ""},
	{"terminationGracePeriodSeconds", "terminationGracePeriodSeconds: 5\n", works, ""},
	{"revision", "revision: x\n", works, ""},
	{"ownerName", "ownerName: x\n", works, ""},
	{"env", "env: {A: b}\n", works, ""},
	{"profile", "profile: demo\n", works, ""},
	{"compatibilityVersion", "compatibilityVersion: \"1.28\"\n", works, ""},
	{"platform", "platform: k3s\n", works, ""},
	{"global.hub", "global:\n  hub: example.com/x\n", works, ""},
	{"global.tag", "global:\n  tag: x\n", works, ""},
	{"global.variant", "global:\n  variant: debug\n", works, ""},
	{"global.imagePullPolicy", "global:\n  imagePullPolicy: Always\n", works, ""},
	{"global.logging.level", "global:\n  logging:\n    level: debug\n", works, ""},
	{"global.logAsJson", "global:\n  logAsJson: true\n", works, ""},
	{"global.imagePullSecrets", "global:\n  imagePullSecrets: [x]\n", works, ""},
	{"global.defaultResources", "resources: null\nglobal:\n  defaultResources: {requests: {cpu: 1}}\n", works, ""},
	{"global.defaultResources (resources set)", "global:\n  defaultResources: {requests: {cpu: 1}}\n", noEffect, "it applies only when resources is empty, as in Istio"},
	{"global.networkPolicy.enabled", "global:\n  networkPolicy:\n    enabled: true\n", works, ""},
	{"global.nativeNftables", "global:\n  nativeNftables: true\n", works, ""},
	{"global.resourceScope", "global:\n  resourceScope: cluster\n", works, ""},
	{"global.platform", "global:\n  platform: k3s\n", works, ""},
	{"global.profile", "global:\n  profile: demo\n", works, ""},
	{"global.compatibilityVersion", "global:\n  compatibilityVersion: \"1.28\"\n", works, ""},
	{"defaults", "defaults:\n  hub: x\n", fails, ""},
	// Older releases' keys that Istio's newest chart no longer reads.
	{"privileged", "privileged: true\n", noEffect, "Istio's chart no longer reads it; the agent runs unprivileged with capabilities, as Istio's"},
	// This chart's own values.
	{"logLevel", "logLevel: debug\n", noEffect, "in Istio's 1.2x default values (debug) and never read by its DaemonSet; global.logging.level or logging.level set the level"},
	{"rollingMaxUnavailable", "rollingMaxUnavailable: 2\n", works, ""},
	{"nativeNftables", "nativeNftables: auto\n", works, ""},
	{"psp_cluster_role", "psp_cluster_role: x\n", works, ""},
	{"cni.*", "cni:\n  tag: x\n", works, ""},
}

// istioAmbientValues: the values whose effect depends on ambient mode,
// compared with ambient mode's render (each values text follows ambientOn).
const ambientOn = "ambient:\n  enabled: true\n"

var istioAmbientValues = []istioValue{
	{"ambient.shareHostNetworkNamespace", "  shareHostNetworkNamespace: true\n", works, ""},
	{"ambient.configDir", "  configDir: /x\n", noEffect, "unused in Istio too"},
	{"cniNetnsDir", "cniNetnsDir: /x\n", noEffect, "not needed: the agent keeps the pod's namespace from the ADD and finds older pods' through /proc"},
}

func TestIstioValues(t *testing.T) {
	t.Run("ambient-off", func(t *testing.T) { checkIstioValues(t, "", istioValues) })
	t.Run("ambient-on", func(t *testing.T) { checkIstioValues(t, ambientOn, istioAmbientValues) })
}

func checkIstioValues(t *testing.T, base string, table []istioValue) {
	baseFiles, err := testenv.RenderChart(base, "")
	if err != nil {
		t.Fatal(err)
	}
	baseText := (&rendered{files: baseFiles}).text()
	for _, v := range table {
		t.Run(v.key, func(t *testing.T) {
			files, err := testenv.RenderChart(base+v.values, "")
			switch v.handling {
			case fails:
				name := strings.TrimSuffix(v.key, ".*")
				if err == nil || !strings.Contains(err.Error(), name) {
					t.Fatalf("render error = %v, want one naming %s", err, name)
				}
				return
			case noEffect:
				if v.why == "" {
					t.Fatal("a value without effect needs a reason")
				}
			}
			if err != nil {
				t.Fatal(err)
			}
			changed := (&rendered{files: files}).text() != baseText
			if changed != (v.handling == works) {
				t.Errorf("%s: render changed = %v, want %v", v.handling, changed, v.handling == works)
			}
		})
	}
}

// TestAgentInvocation: the command line and environment the kubelet would
// give the agent, for another package to run the agent with.
func TestAgentInvocation(t *testing.T) {
	files, err := testenv.RenderChart(istioValuesFile+"env:\n  CNI_CONF_GROUP_READ: \"false\"\n  EXTRA: \"$(EXCLUDE_NAMESPACES);$$(KEPT)\"\n  REPAIR_ENABLED: \"false\"\n", "", ourHub)
	if err != nil {
		t.Fatal(err)
	}
	args, env, err := testenv.AgentInvocation(files)
	if err != nil {
		t.Fatal(err)
	}
	eq(t, "args", args, []string{"install-cni", "--log_output_level=cni:debug,default:warn", "--log_as_json"})
	for k, want := range map[string]string{
		"EXCLUDE_NAMESPACES": "istio-system,kube-system", "REPAIR_REPAIR_PODS": "true", "REPAIR_SIDECAR_ANNOTATION": "sidecar.istio.io/status",
		// cni.env and env both apply; cni.* wins, as in Istio.
		"CNI_CONF_GROUP_READ": "true", "REPAIR_ENABLED": "false",
		"EXTRA": "istio-system,kube-system;$(KEPT)",
	} {
		eq(t, "env "+k, env[k], want)
	}
	for _, k := range []string{"NODE_NAME", "POD_NAME", "POD_NAMESPACE", "GOMEMLIMIT", "PLUGIN_LOG_LEVEL"} {
		if v, ok := env[k]; ok {
			t.Errorf("env %s=%q, want it left to the caller", k, v)
		}
	}
}

// istioAmbientValuesFile is Istio's ambient install as operators write
// it: the ambient profile, the legacy cni.* layout, selectors of their own.
const istioAmbientValuesFile = `profile: ambient
cni:
  hub: docker.io/istio
  tag: 1.30.1
  ambient:
    dnsCapture: false
    enablementSelectors:
      - podSelector:
          matchLabels: {mesh: ambient}
  env:
    ENABLE_AMBIENT_DETECTION_RETRY: "true"
global:
  platform: k3s
`

// TestAgentInvocationAmbient: ambient mode's settings from Istio's values
// reach the agent's environment under Istio's names.
func TestAgentInvocationAmbient(t *testing.T) {
	for _, tc := range []struct {
		name, values string
		want         map[string]string // "<absent>": not set
		selectors    []ambient.Selector
	}{
		{"istio-values-file", istioAmbientValuesFile, map[string]string{
			"AMBIENT_ENABLED": "true", "AMBIENT_DNS_CAPTURE": "false", "AMBIENT_IPV6": "true",
			"AMBIENT_RECONCILE_POD_RULES_ON_STARTUP": "true", "ALLOW_SWITCH_TO_HOST_NS": "true",
			// env wins over the chart's key, as in Istio.
			"ENABLE_AMBIENT_DETECTION_RETRY": "true",
			"REPAIR_REPAIR_PODS":             "true",
		}, []ambient.Selector{{PodSelector: enablement.LabelSelector{MatchLabels: map[string]string{"mesh": "ambient"}}}}},
		{"host-network", "ambient:\n  enabled: true\n  shareHostNetworkNamespace: true\n  reconcileIptablesOnStartup: false\n  ipv6: false\n", map[string]string{
			"AMBIENT_ENABLED": "true", "AMBIENT_DNS_CAPTURE": "true", "AMBIENT_IPV6": "false",
			"AMBIENT_RECONCILE_POD_RULES_ON_STARTUP": "false", "ENABLE_AMBIENT_DETECTION_RETRY": "false",
			"ALLOW_SWITCH_TO_HOST_NS": "<absent>",
		}, ambient.DefaultSelectors().Source()},
	} {
		t.Run(tc.name, func(t *testing.T) {
			// ourHub: the values file's hub is Istio's.
			files, err := testenv.RenderChart(tc.values, "", ourHub)
			if err != nil {
				t.Fatal(err)
			}
			args, env, err := testenv.AgentInvocation(files)
			if err != nil {
				t.Fatal(err)
			}
			eq(t, "args", args, []string{"install-cni", "--log_output_level=info"})
			for k, want := range tc.want {
				got, ok := env[k]
				if !ok {
					got = "<absent>"
				}
				eq(t, "env "+k, got, want)
			}
			sel, err := ambient.ParseSelectors(env["AMBIENT_ENABLEMENT_SELECTOR"])
			if err != nil {
				t.Fatalf("AMBIENT_ENABLEMENT_SELECTOR %q: %v", env["AMBIENT_ENABLEMENT_SELECTOR"], err)
			}
			eq(t, "the agent's selectors", sel.Source(), tc.selectors)
		})
	}
}

// dryRun has the API server validate and admit the object without storing
// it (server-side dry run).
func dryRun(ctx context.Context, t *testing.T, dyn dynamic.Interface, mapper meta.RESTMapper, obj *unstructured.Unstructured) {
	t.Helper()
	gvk := obj.GroupVersionKind()
	m, err := mapper.RESTMapping(gvk.GroupKind(), gvk.Version)
	if err != nil {
		t.Fatalf("%s %s: %v", gvk, obj.GetName(), err)
	}
	var ri dynamic.ResourceInterface = dyn.Resource(m.Resource)
	if m.Scope.Name() == meta.RESTScopeNameNamespace {
		ns := obj.GetNamespace()
		if ns == "" {
			ns = "istio-system"
		}
		ri = dyn.Resource(m.Resource).Namespace(ns)
	}
	if _, err := ri.Create(ctx, obj, metav1.CreateOptions{DryRun: []string{metav1.DryRunAll}, FieldValidation: "Strict"}); err != nil {
		t.Fatalf("API server rejects %s %s: %v", gvk.Kind, obj.GetName(), err)
	}
}

// ensureTestCluster creates the release namespace and the Multus
// NetworkAttachmentDefinition CRD, so every object has a home.
func ensureTestCluster(ctx context.Context, t *testing.T) {
	t.Helper()
	if err := testenv.EnsureNamespace(ctx, cluster.Client, "istio-system"); err != nil {
		t.Fatal(err)
	}
	ext, err := apiextclient.NewForConfig(cluster.Config)
	if err != nil {
		t.Fatal(err)
	}
	preserve := true
	crd := &apiextv1.CustomResourceDefinition{
		ObjectMeta: metav1.ObjectMeta{Name: "network-attachment-definitions.k8s.cni.cncf.io"},
		Spec: apiextv1.CustomResourceDefinitionSpec{
			Group: "k8s.cni.cncf.io", Scope: apiextv1.NamespaceScoped,
			Names: apiextv1.CustomResourceDefinitionNames{Plural: "network-attachment-definitions", Singular: "network-attachment-definition",
				Kind: "NetworkAttachmentDefinition", ShortNames: []string{"net-attach-def"}},
			Versions: []apiextv1.CustomResourceDefinitionVersion{{Name: "v1", Served: true, Storage: true,
				Schema: &apiextv1.CustomResourceValidation{OpenAPIV3Schema: &apiextv1.JSONSchemaProps{Type: "object", XPreserveUnknownFields: &preserve}}}},
		},
	}
	if _, err := ext.ApiextensionsV1().CustomResourceDefinitions().Create(ctx, crd, metav1.CreateOptions{}); err != nil && !strings.Contains(err.Error(), "already exists") {
		t.Fatal(err)
	}
	disc, err := discovery.NewDiscoveryClientForConfig(cluster.Config)
	if err != nil {
		t.Fatal(err)
	}
	// Established comes before discovery serves the kind, and the dry
	// runs map kinds through discovery (seen as "no matches for kind
	// NetworkAttachmentDefinition" in a run).
	served := func() bool {
		list, err := disc.ServerResourcesForGroupVersion("k8s.cni.cncf.io/v1")
		if err != nil {
			return false
		}
		for i := range list.APIResources {
			if list.APIResources[i].Kind == "NetworkAttachmentDefinition" {
				return true
			}
		}
		return false
	}
	deadline := time.Now().Add(30 * time.Second)
	for {
		got, err := ext.ApiextensionsV1().CustomResourceDefinitions().Get(ctx, crd.Name, metav1.GetOptions{})
		if err == nil {
			for _, c := range got.Status.Conditions {
				if c.Type == apiextv1.Established && c.Status == apiextv1.ConditionTrue && served() {
					return
				}
			}
		}
		if time.Now().After(deadline) {
			t.Fatal("NetworkAttachmentDefinition CRD not established and served")
		}
		time.Sleep(50 * time.Millisecond) // polling the API server, bounded
	}
}

func TestLint(t *testing.T) {
	for _, name := range sortedSets() {
		set := valueSets[name]
		v, err := testenv.ChartValues(set.values, set.over)
		if err != nil {
			t.Fatal(err)
		}
		var kv *chartutil.KubeVersion
		if set.kube != "" {
			if kv, err = chartutil.ParseKubeVersion(set.kube); err != nil {
				t.Fatal(err)
			}
		}
		res := lint.AllWithKubeVersion(chartDir, v, "istio-system", kv)
		for _, m := range res.Messages {
			if m.Severity >= support.WarningSev {
				t.Errorf("%s: lint: %s", name, m.Error())
			}
		}
	}
}

// asSelector is a Kubernetes label selector in the agent's own type,
// through their shared JSON form.
func asSelector(t *testing.T, ls *metav1.LabelSelector) enablement.LabelSelector {
	t.Helper()
	var out enablement.LabelSelector
	b, err := json.Marshal(ls)
	if err == nil {
		err = json.Unmarshal(b, &out)
	}
	if err != nil {
		t.Fatal(err)
	}
	return out
}
