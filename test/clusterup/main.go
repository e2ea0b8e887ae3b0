// Command clusterup brings up the test cluster for a person: etcd,
// kube-apiserver, kube-controller-manager, containerd and a kubelet in a
// private network and mount namespace, with the test images loaded (and,
// with -chart, the chart installed with the project's image). It prints how
// to get a shell in there and waits for Ctrl-C, then tears it all down.
package main

import (
	"context"
	"flag"
	"fmt"
	"os"
	"os/signal"
	"path/filepath"
	"syscall"

	"github.com/istio-cni-go/istio-cni/internal/testenv"
)

func main() {
	testenv.EnterNodeNamespace()
	chart := flag.Bool("chart", false, "also build the agent image and install the chart")
	flag.Parse()
	if err := run(*chart); err != nil {
		fmt.Fprintln(os.Stderr, "clusterup:", err)
		os.Exit(1)
	}
}

func run(withChart bool) error {
	// Installed before start-up, so a Ctrl-C during it tears down what
	// was started too, instead of killing this process and leaving it.
	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGINT, syscall.SIGTERM)
	defer stop()
	setup := testenv.NodeSetup{}
	if withChart {
		setup = testenv.NodeSetup{AgentImage: true, Namespaces: []string{"istio-system"}}
	}
	one, err := testenv.StartOneNodeIn(ctx, "istio-cni-clusterup-", setup)
	if err != nil {
		return err
	}
	defer one.Stop()
	cluster, node := one.Cluster, one.Node
	if withChart {
		rel, err := testenv.InstallChart(cluster, testenv.NodeChartValues(cluster, node, false))
		if err != nil {
			return err
		}
		defer func() { _ = rel.Uninstall() }()
	}
	// Interrupted during start-up: no banner for a cluster about to go.
	if err := ctx.Err(); err != nil {
		return err
	}
	kc := filepath.Join(one.Dir, "admin.kubeconfig")
	if err := cluster.AdminKubeconfig(kc); err != nil {
		return err
	}
	fmt.Printf(`The cluster is up (node %s Ready). In another terminal, as root:

  nsenter -t %d -n -m            # a shell in the node's network and mount namespace
  export KUBECONFIG=%s
  ctr --address %s -n k8s.io containers ls

Images loaded: %s, %s%s.
Ctrl-C here tears everything down.
`, testenv.NodeName, os.Getpid(), kc, node.Socket, testenv.PauseImage, testenv.AppImage, map[bool]string{true: ", " + testenv.AgentImage + " (chart installed)"}[withChart])
	<-ctx.Done()
	return nil
}
