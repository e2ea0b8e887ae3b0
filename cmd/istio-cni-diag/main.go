// Command istio-cni-diag explains a pod's traffic redirection: the rules in
// place, the backend, and whether they match what the pod asks for.
package main

import (
	"os"

	"github.com/istio-cni-go/istio-cni/internal/diag"
)

func main() { os.Exit(diag.Main(os.Args[1:], os.Stdout, os.Stderr)) }
