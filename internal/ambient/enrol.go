// Package ambient is the node agent's ambient-mode controller: it decides
// which pods of the node are enrolled in the ambient mesh, programs their
// network namespaces (ambientnet.InPod), hands them to ztunnel over ZDS
// (package zds), keeps the node's probe SNAT and its set of enrolled
// addresses in step (ambientnet.Host), and says how each pod stands in
// its ambient.istio.io/redirection annotation.
//
// The decision functions here are pure; the Controller is the part with
// informers, a work queue and the kernel.
package ambient

import (
	"errors"
	"fmt"
	"strconv"
	"strings"

	corev1 "k8s.io/api/core/v1"

	"github.com/istio-cni-go/istio-cni/internal/enablement"
	"github.com/istio-cni-go/istio-cni/internal/redirect"
	"github.com/istio-cni-go/istio-cni/internal/ruleset"
)

// The labels and annotations of ambient mode, as Istio names them.
const (
	// LabelDataplaneMode enrols a pod or a namespace (ModeAmbient) or
	// keeps a pod out (ModeNone).
	LabelDataplaneMode = "istio.io/dataplane-mode"
	ModeAmbient        = "ambient"
	ModeNone           = "none"

	// AnnotationRedirection is written by the agent only: RedirectionEnabled
	// once the pod's rules are in place and ztunnel has acknowledged it,
	// RedirectionPending while the rules are in place and ztunnel has not.
	AnnotationRedirection = "ambient.istio.io/redirection"
	RedirectionEnabled    = "enabled"
	RedirectionPending    = "pending"

	// AnnotationBypassInbound leaves the pod's inbound traffic to the app.
	AnnotationBypassInbound = "ambient.istio.io/bypass-inbound-capture" //nolint:gosec // G101: an annotation's name, no credential
	// AnnotationDNSCapture overrides the node's DNS capture default.
	AnnotationDNSCapture = "ambient.istio.io/dns-capture"
	// AnnotationRerouteVirtualInterfaces lists interfaces whose inbound
	// TCP is the pod's own outbound.
	AnnotationRerouteVirtualInterfaces = redirect.AnnotationRerouteVirtualIfaces
)

// DefaultSelectorsYAML is Istio's default AMBIENT_ENABLEMENT_SELECTOR.
const DefaultSelectorsYAML = enablement.DefaultYAML

// Selector is one entry of the enablement selectors; Selectors are them
// compiled.
type (
	Selector  = enablement.Selector
	Selectors = enablement.Selectors
)

// ParseSelectors reads the enablement selectors in Istio's YAML (or JSON)
// form (enablement.Parse): empty text means Istio's default, unknown keys
// are refused.
func ParseSelectors(text string) (*Selectors, error) { return enablement.Parse(text) }

// DefaultSelectors is Istio's default.
func DefaultSelectors() *Selectors { return enablement.Default() }

// Policy is what, beyond the selectors, keeps a pod out of the mesh
// (enablement.Policy); Decision is its answer.
type (
	Policy   = enablement.Policy
	Decision = enablement.Decision
)

// decide applies the policy to a pod and its namespace's labels.
func decide(p Policy, pod *corev1.Pod, nsLabels map[string]string) Decision {
	return p.Decide(enablementPod(pod), nsLabels)
}

func enablementPod(pod *corev1.Pod) enablement.Pod {
	return enablement.Pod{Namespace: pod.Namespace, Name: pod.Name, Labels: pod.Labels,
		Annotations: pod.Annotations, HostNetwork: pod.Spec.HostNetwork}
}

// Defaults are the node's settings a pod's annotations can override.
type Defaults struct {
	// DNSCapture is AMBIENT_DNS_CAPTURE.
	DNSCapture bool
	// IPv6 is AMBIENT_IPV6: the pods' IPv6 rules.
	IPv6 bool
}

// PodParams derives a pod's rule parameters from the node's defaults and
// the pod's annotations. A value that does not parse is an error naming
// the annotation and the value: the reference ignores it with a warning,
// which would quietly give the pod capture it asked not to have (or the
// reverse).
func PodParams(pod *corev1.Pod, d Defaults) (ruleset.AmbientParams, error) {
	p := ruleset.AmbientParams{DNSCapture: d.DNSCapture, IPv6: d.IPv6}
	var err error
	if v, ok := pod.Annotations[AnnotationBypassInbound]; ok {
		if p.BypassInbound, err = parseBool(AnnotationBypassInbound, v); err != nil {
			return p, err
		}
	}
	if v, ok := pod.Annotations[AnnotationDNSCapture]; ok {
		if p.DNSCapture, err = parseBool(AnnotationDNSCapture, v); err != nil {
			return p, err
		}
	}
	if v, ok := pod.Annotations[AnnotationRerouteVirtualInterfaces]; ok {
		if p.RerouteInterfaces, err = parseInterfaces(AnnotationRerouteVirtualInterfaces, v); err != nil {
			return p, err
		}
	}
	return p, nil
}

// parseBool takes what Go's (and so Istio's) boolean parsing takes.
func parseBool(key, v string) (bool, error) {
	b, err := strconv.ParseBool(strings.TrimSpace(v))
	if err != nil {
		return false, &redirect.InvalidAnnotationError{Key: key, Value: v, Reason: "must be true or false"}
	}
	return b, nil
}

// parseInterfaces reads a comma-separated list of interface names (empty
// items skipped, as the reference does), each a Linux interface name or
// a prefix with iptables' trailing "+"; anything iptables could read as
// an option, or "+" alone (every interface), is refused.
func parseInterfaces(key, v string) ([]string, error) {
	var out []string
	seen := map[string]bool{}
	for item := range strings.SplitSeq(v, ",") {
		s := strings.TrimSpace(item)
		if s == "" {
			continue
		}
		if s == "+" {
			return nil, &redirect.InvalidAnnotationError{Key: key, Value: v, Reason: `"+" would match every interface`}
		}
		if !redirect.ValidInterfaceName(s) {
			return nil, &redirect.InvalidAnnotationError{Key: key, Value: v, Reason: fmt.Sprintf("%q is not a valid interface name", s)}
		}
		if !seen[s] {
			seen[s] = true
			out = append(out, s)
		}
	}
	if len(out) > redirect.MaxInterfaces {
		return nil, &redirect.InvalidAnnotationError{Key: key, Value: v,
			Reason: fmt.Sprintf("%d interfaces, more than the %d a list may name", len(out), redirect.MaxInterfaces)}
	}
	return out, nil
}

// IsInvalidAnnotation reports whether err is a pod's annotation refused by
// PodParams: retrying cannot help until the pod changes.
func IsInvalidAnnotation(err error) bool {
	var ia *redirect.InvalidAnnotationError
	return errors.As(err, &ia)
}
