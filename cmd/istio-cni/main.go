// Command istio-cni is the chained CNI plugin that sets up a pod's traffic
// redirection to its Istio sidecar. It hands each command to the node
// agent, sends the rules the agent prepares for a redirected pod from
// inside the pod's network namespace, and runs istio-cni-fallback when no
// agent answers.
package main

import (
	"os"

	"github.com/istio-cni-go/istio-cni/internal/cnirelay"
)

func main() {
	os.Exit(cnirelay.Main("istio-cni: sidecar traffic redirection for Istio"))
}
