// Command istio-cni-fallback is the complete istio-cni plugin in one
// process: it reads the pod from the API server and programs its rules
// itself. istio-cni runs it when the node agent does not answer.
package main

import (
	"os"

	"github.com/istio-cni-go/istio-cni/internal/plugin"
)

func main() { os.Exit(plugin.Main()) }
