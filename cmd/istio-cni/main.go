// Command istio-cni is the chained CNI plugin that sets up a pod's traffic
// redirection to its Istio sidecar.
package main

import (
	"os"

	"github.com/istio-cni-go/istio-cni/internal/plugin"
)

func main() { os.Exit(plugin.Main()) }
