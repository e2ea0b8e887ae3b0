// Command istio-cni-validate checks, from inside a pod as the proxy's
// uid, that the pod's traffic is redirected; it stands in for the
// istio-validation init container's command and exits 126 when not.
package main

import (
	"os"

	"github.com/istio-cni-go/istio-cni/internal/validate"
)

func main() { os.Exit(validate.Main(os.Args[1:], os.Stdout, os.Stderr)) }
