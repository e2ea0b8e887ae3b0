// Command istio-cni is the chained CNI plugin that sets up a pod's traffic
// redirection to its Istio sidecar. It hands each command to the node
// agent, commits the rules the agent prepares for a redirected pod, and
// runs istio-cni-fallback when no agent answers.
package main

import (
	"os"

	"github.com/istio-cni-go/istio-cni/internal/cnirelay"
	"github.com/istio-cni-go/istio-cni/internal/podrules"
)

func main() {
	os.Exit(cnirelay.Main("istio-cni: sidecar traffic redirection for Istio", podrules.CommitJSON))
}
