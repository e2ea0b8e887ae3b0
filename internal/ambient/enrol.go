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
	"slices"
	"strconv"
	"strings"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/labels"
	"sigs.k8s.io/yaml"

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

	annotationSidecarStatus = redirect.AnnotationStatus
)

// DefaultSelectorsYAML is Istio's default AMBIENT_ENABLEMENT_SELECTOR (the
// chart's ambient.enablementSelectors): the pod's label enrols it, or the
// namespace's label does unless the pod's says none.
const DefaultSelectorsYAML = `
- podSelector:
    matchLabels: {istio.io/dataplane-mode: ambient}
- podSelector:
    matchExpressions:
      - {key: istio.io/dataplane-mode, operator: NotIn, values: [none]}
  namespaceSelector:
    matchLabels: {istio.io/dataplane-mode: ambient}
`

// Selector is one entry of the enablement selectors: a pod matches when
// its labels match PodSelector and its namespace's match
// NamespaceSelector; an empty selector matches everything.
type Selector struct {
	PodSelector       metav1.LabelSelector `json:"podSelector"`
	NamespaceSelector metav1.LabelSelector `json:"namespaceSelector"`
}

// Selectors are compiled enablement selectors; a pod is enrolled when
// any entry matches it.
type Selectors struct {
	source   []Selector
	pod, nss []labels.Selector
}

// ParseSelectors reads the enablement selectors in Istio's YAML (or JSON)
// form, a list of Selector. Empty text means Istio's default; an empty
// list enrols no pod. Unknown keys are refused: a misspelt
// "namespaceSelecter" would otherwise silently widen the selection to
// every namespace.
func ParseSelectors(text string) (*Selectors, error) {
	if strings.TrimSpace(text) == "" {
		text = DefaultSelectorsYAML
	}
	var src []Selector
	if err := yaml.UnmarshalStrict([]byte(text), &src); err != nil {
		return nil, fmt.Errorf("ambient enablement selectors: %w", err)
	}
	s := &Selectors{source: src}
	for i := range src {
		ps, err := compile(&src[i].PodSelector)
		if err != nil {
			return nil, fmt.Errorf("ambient enablement selector %d: podSelector: %w", i+1, err)
		}
		ns, err := compile(&src[i].NamespaceSelector)
		if err != nil {
			return nil, fmt.Errorf("ambient enablement selector %d: namespaceSelector: %w", i+1, err)
		}
		s.pod, s.nss = append(s.pod, ps), append(s.nss, ns)
	}
	return s, nil
}

// DefaultSelectors is Istio's default.
func DefaultSelectors() *Selectors {
	s, err := ParseSelectors(DefaultSelectorsYAML)
	if err != nil {
		panic(err)
	}
	return s
}

func compile(ls *metav1.LabelSelector) (labels.Selector, error) {
	if len(ls.MatchLabels) == 0 && len(ls.MatchExpressions) == 0 {
		return labels.Everything(), nil
	}
	return metav1.LabelSelectorAsSelector(ls)
}

// Match reports whether a pod with podLabels in a namespace with
// nsLabels is selected.
func (s *Selectors) Match(podLabels, nsLabels map[string]string) bool {
	pl, nl := labels.Set(podLabels), labels.Set(nsLabels)
	for i := range s.pod {
		if s.pod[i].Matches(pl) && s.nss[i].Matches(nl) {
			return true
		}
	}
	return false
}

// Source returns the selectors as parsed.
func (s *Selectors) Source() []Selector { return slices.Clone(s.source) }

// Policy is what, beyond the selectors, keeps a pod out of the mesh.
type Policy struct {
	// Selectors; nil means Istio's default.
	Selectors *Selectors
	// ExcludeNamespaces are never enrolled (exclude_namespaces).
	ExcludeNamespaces []string
	// SystemNamespace is the agent's own namespace (POD_NAMESPACE): its
	// own pods there (istio-cni-node-*) and ztunnel's (app=ztunnel) are
	// never enrolled, since they are what makes the mesh work.
	SystemNamespace string
}

// Decision says whether a pod is enrolled, and why (for logs and Events).
type Decision struct {
	Enrol  bool
	Reason string
}

// agentPodPrefix names the agent's own pods, as the DaemonSet names them.
const agentPodPrefix = "istio-cni-node-"

// Decide applies Istio's checks in Istio's order to a pod and its
// namespace's labels.
func (p Policy) Decide(pod *corev1.Pod, nsLabels map[string]string) Decision {
	switch {
	case pod.Spec.HostNetwork:
		return Decision{false, "the pod uses the node's network namespace (hostNetwork)"}
	case hasKey(pod.Annotations, annotationSidecarStatus):
		return Decision{false, "the pod has a sidecar (" + annotationSidecarStatus + ")"}
	case slices.Contains(p.ExcludeNamespaces, pod.Namespace):
		return Decision{false, "namespace " + pod.Namespace + " is excluded"}
	case p.SystemNamespace != "" && pod.Namespace == p.SystemNamespace && strings.HasPrefix(pod.Name, agentPodPrefix):
		return Decision{false, "the pod is the CNI node agent's"}
	case p.SystemNamespace != "" && pod.Namespace == p.SystemNamespace && pod.Labels["app"] == "ztunnel":
		return Decision{false, "the pod is ztunnel's"}
	}
	sel := p.Selectors
	if sel == nil {
		sel = DefaultSelectors()
	}
	if !sel.Match(pod.Labels, nsLabels) {
		return Decision{false, "no enablement selector matches the pod and its namespace"}
	}
	return Decision{true, "an enablement selector matches"}
}

func hasKey(m map[string]string, k string) bool {
	_, ok := m[k]
	return ok
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
		if !slices.Contains(out, s) {
			out = append(out, s)
		}
	}
	return out, nil
}

// IsInvalidAnnotation reports whether err is a pod's annotation refused by
// PodParams: retrying cannot help until the pod changes.
func IsInvalidAnnotation(err error) bool {
	var ia *redirect.InvalidAnnotationError
	return errors.As(err, &ia)
}
