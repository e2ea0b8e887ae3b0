// Command install-cni is the istio-cni node agent (the istio-cni-node
// DaemonSet): it installs the plugin on the node, keeps it in the node's
// CNI config and removes it cleanly.
package main

import (
	"os"

	"github.com/istio-cni-go/istio-cni/internal/agent"
)

func main() { os.Exit(agent.Main(os.Args[1:])) }
