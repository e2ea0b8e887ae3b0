// Package chart renders the Helm chart with the Helm SDK for a matrix of
// values, compares the output with goldens, lints it, and has the real
// kube-apiserver validate every object with a server-side dry run.
package chart

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"sort"
	"strings"
	"testing"
	"time"

	"helm.sh/helm/v3/pkg/chart/loader"
	"helm.sh/helm/v3/pkg/chartutil"
	"helm.sh/helm/v3/pkg/engine"
	"helm.sh/helm/v3/pkg/lint"
	"helm.sh/helm/v3/pkg/lint/support"
	apiextv1 "k8s.io/apiextensions-apiserver/pkg/apis/apiextensions/v1"
	apiextclient "k8s.io/apiextensions-apiserver/pkg/client/clientset/clientset"
	"k8s.io/apimachinery/pkg/api/meta"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/client-go/discovery"
	"k8s.io/client-go/dynamic"
	"k8s.io/client-go/restmapper"
	"sigs.k8s.io/yaml"

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

// valueSets are the configurations users run today.
var valueSets = map[string]string{
	"default":         ``,
	"istio-layout":    "cni:\n  excludeNamespaces: [kube-system, istio-system]\n  logLevel: debug\n  cniBinDir: /opt/custom/bin\n",
	"image":           "hub: example.com/mesh\ntag: 1.2.3\nvariant: distroless\npullPolicy: Always\n",
	"logging-level":   "logging:\n  level: warn\n",
	"repair-delete":   "repair:\n  repairPods: false\n  deletePods: true\n",
	"repair-label":    "repair:\n  repairPods: false\n  labelPods: true\n",
	"repair-off":      "repair:\n  enabled: false\n",
	"nftables":        "global:\n  nativeNftables: true\n",
	"nftables-auto":   "nativeNftables: auto\nrepair:\n  enabled: false\n",
	"gke":             "global:\n  platform: gke\n",
	"openshift":       "platform: openshift\n",
	"k3s":             "platform: k3s\n",
	"k3d":             "platform: k3d\n",
	"microk8s":        "platform: microk8s\n",
	"minikube":        "platform: minikube\n",
	"standalone-conf": "chained: false\ncniConfFileName: 99-istio.conf\n",
	"multus":          "provider: multus\n",
	"extras":          "seLinuxOptions:\n  level: s0\npsp_cluster_role: psp-privileged\npodAnnotations:\n  team: mesh\nresources:\n  requests:\n    cpu: 50m\ntolerations: []\nenv:\n  GOMAXPROCS: \"2\"\n",
}

func render(t *testing.T, valuesYAML string) map[string]string {
	t.Helper()
	ch, err := loader.Load(chartDir)
	if err != nil {
		t.Fatal(err)
	}
	vals, err := chartutil.ReadValues([]byte(valuesYAML))
	if err != nil {
		t.Fatal(err)
	}
	rv, err := chartutil.ToRenderValues(ch, vals, chartutil.ReleaseOptions{Name: "istio-cni", Namespace: "istio-system", IsInstall: true}, nil)
	if err != nil {
		t.Fatal(err)
	}
	out, err := engine.Render(ch, rv)
	if err != nil {
		t.Fatal(err)
	}
	return out
}

func TestRenderGoldenAndDryRun(t *testing.T) {
	ctx := context.Background()
	ensureTestCluster(t, ctx)
	dyn, err := dynamic.NewForConfig(cluster.Config)
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
	names := make([]string, 0, len(valueSets))
	for n := range valueSets {
		names = append(names, n)
	}
	sort.Strings(names)
	for _, name := range names {
		t.Run(name, func(t *testing.T) {
			files := render(t, valueSets[name])
			keys := make([]string, 0, len(files))
			for k := range files {
				keys = append(keys, k)
			}
			sort.Strings(keys)
			var all strings.Builder
			for _, k := range keys {
				if strings.TrimSpace(files[k]) == "" || strings.HasSuffix(k, ".tpl") {
					continue
				}
				fmt.Fprintf(&all, "# %s\n%s\n", filepath.Base(k), strings.TrimSpace(files[k]))
				for _, doc := range strings.Split(files[k], "\n---") {
					if strings.TrimSpace(doc) == "" || strings.TrimSpace(strings.TrimLeft(doc, "-")) == "" {
						continue
					}
					obj := &unstructured.Unstructured{}
					if err := yaml.Unmarshal([]byte(doc), &obj.Object); err != nil {
						t.Fatalf("%s: %v\n%s", k, err, doc)
					}
					if len(obj.Object) == 0 {
						continue
					}
					dryRun(t, ctx, dyn, mapper, obj)
				}
			}
			testutil.CompareGolden(t, name+".golden.yaml", all.String())
		})
	}
}

// dryRun has the API server validate and admit the object without storing
// it (server-side dry run).
func dryRun(t *testing.T, ctx context.Context, dyn dynamic.Interface, mapper meta.RESTMapper, obj *unstructured.Unstructured) {
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
func ensureTestCluster(t *testing.T, ctx context.Context) {
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
	deadline := time.Now().Add(30 * time.Second)
	for {
		got, err := ext.ApiextensionsV1().CustomResourceDefinitions().Get(ctx, crd.Name, metav1.GetOptions{})
		if err == nil {
			for _, c := range got.Status.Conditions {
				if c.Type == apiextv1.Established && c.Status == apiextv1.ConditionTrue {
					return
				}
			}
		}
		if time.Now().After(deadline) {
			t.Fatal("NetworkAttachmentDefinition CRD not established")
		}
		time.Sleep(50 * time.Millisecond) // polling the API server, bounded
	}
}

func TestLint(t *testing.T) {
	for name, vals := range valueSets {
		v, err := chartutil.ReadValues([]byte(vals))
		if err != nil {
			t.Fatal(err)
		}
		res := lint.AllWithKubeVersion(chartDir, v, "istio-system", nil)
		for _, m := range res.Messages {
			if m.Severity >= support.WarningSev {
				t.Errorf("%s: lint: %s", name, m.Error())
			}
		}
	}
}
