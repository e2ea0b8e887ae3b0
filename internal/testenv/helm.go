package testenv

import (
	"fmt"
	"path/filepath"
	"strconv"

	"helm.sh/helm/v3/pkg/action"
	"helm.sh/helm/v3/pkg/chart"
	"helm.sh/helm/v3/pkg/chart/loader"
	"k8s.io/cli-runtime/pkg/genericclioptions"
)

// AgentImage is the tag the tests give the project's agent image.
const AgentImage = "istio-cni-go/install-cni:test"

// Release is the chart installed into a test cluster.
type Release struct {
	Config *action.Configuration
	Chart  *chart.Chart
	Values map[string]any
}

// NodeChartValues are the values that fit the chart to a KubeNode: the
// project's image from containerd, the node's CNI dirs, and the API
// server's own address (there is no kube-proxy for the Service).
func NodeChartValues(c *Cluster, n *KubeNode, nftables bool) map[string]any {
	return map[string]any{
		"nativeNftables": nftables,
		"hub":            "istio-cni-go", "image": "install-cni", "tag": "test", "pullPolicy": "Never",
		"cniBinDir": n.BinDir, "cniConfDir": n.ConfDir,
		"env": map[string]any{"KUBERNETES_SERVICE_HOST": RemoteV4, "KUBERNETES_SERVICE_PORT": strconv.Itoa(c.Port)},
	}
}

// InstallChart installs the repository's chart into istio-system with the
// Helm SDK, as `helm install istio-cni` would.
func InstallChart(c *Cluster, values map[string]any) (*Release, error) {
	root, err := RepoRoot()
	if err != nil {
		return nil, err
	}
	kc := filepath.Join(c.dir, "helm.kubeconfig")
	if err := c.AdminKubeconfig(kc); err != nil {
		return nil, err
	}
	flags := genericclioptions.NewConfigFlags(false)
	ns := "istio-system"
	flags.KubeConfig, flags.Namespace = &kc, &ns
	cfg := new(action.Configuration)
	if err := cfg.Init(flags, ns, "secret", func(string, ...any) {}); err != nil {
		return nil, err
	}
	ch, err := loader.Load(filepath.Join(root, "deployments", "helm", "istio-cni"))
	if err != nil {
		return nil, err
	}
	inst := action.NewInstall(cfg)
	inst.ReleaseName, inst.Namespace = "istio-cni", ns
	if _, err := inst.Run(ch, values); err != nil {
		return nil, fmt.Errorf("helm install: %w", err)
	}
	return &Release{Config: cfg, Chart: ch, Values: values}, nil
}

// Uninstall runs `helm uninstall istio-cni`.
func (r *Release) Uninstall() error {
	_, err := action.NewUninstall(r.Config).Run("istio-cni")
	return err
}
