// Package podinfo holds the facts about a pod that the plugin decides on, and
// the ways of getting them: the node agent's cache and the Kubernetes API.
package podinfo

import "github.com/istio-cni-go/istio-cni/internal/podspec"

// Pod and Container are podspec's, which has no client in it.
type (
	Pod       = podspec.Pod
	Container = podspec.Container
)

// DecodeJSON reads a pod from its Kubernetes JSON representation.
func DecodeJSON(data []byte) (*Pod, error) { return podspec.DecodeJSON(data) }
