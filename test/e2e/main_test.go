// Package e2e drives the plugin exactly as a container runtime does:
// libcni runs the chain [ptp, istio-cni] for pods in fresh network
// namespaces, inside a node namespace with no uplink, against a real
// kube-apiserver and etcd. Traffic is then sent and its arrival asserted.
package e2e

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"testing"

	"github.com/istio-cni-go/istio-cni/internal/testenv"
)

var (
	cluster   *testenv.Cluster
	pluginBin string
	agentBin  string
	validBin  string
	diagBin   string
	workDir   string
)

const testNS = "e2e"

func TestMain(m *testing.M) {
	testenv.RunHelperIfRequested()
	testenv.EnterNodeNamespace()
	os.Exit(run(m))
}

func run(m *testing.M) int {
	var err error
	workDir, err = os.MkdirTemp("", "istio-cni-e2e-")
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 2
	}
	defer os.RemoveAll(workDir)
	defer testenv.RemoveSandboxCgroups()
	// Built binaries must be executable by the uid-1337 helper too.
	_ = os.Chmod(workDir, 0o755)
	if pluginBin, err = testenv.BuildPlugin(workDir); err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 2
	}
	if agentBin, err = testenv.BuildCommand(workDir, "install-cni"); err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 2
	}
	if validBin, err = testenv.BuildCommand(workDir, "istio-cni-validate"); err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 2
	}
	if diagBin, err = testenv.BuildCommand(workDir, "istio-cni-diag"); err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 2
	}
	if cluster, err = testenv.StartCluster(filepath.Join(workDir, "cluster")); err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 2
	}
	defer cluster.Stop()
	ctx := context.Background()
	for _, ns := range []string{testNS, "kube-system", "istio-system"} {
		if err := testenv.EnsureNamespace(ctx, cluster.Client, ns); err != nil {
			fmt.Fprintln(os.Stderr, err)
			return 2
		}
	}
	return m.Run()
}
