// Package enablement reads and applies ambient mode's enablement
// selectors (Istio's AMBIENT_ENABLEMENT_SELECTOR, the plugin entry's
// enablement_selectors): which pods, by their labels and their
// namespace's, are enrolled in the ambient mesh.
//
// It links no Kubernetes client or API types, only the label selector
// library, so the fallback plugin can apply the agent's selectors to the
// pod it reads itself.
package enablement

import (
	"fmt"
	"slices"
	"strings"

	"k8s.io/apimachinery/pkg/labels"
	"k8s.io/apimachinery/pkg/selection"
	"sigs.k8s.io/yaml"

	"github.com/istio-cni-go/istio-cni/internal/redirect"
)

// DefaultYAML is Istio's default (its chart's ambient.enablementSelectors):
// the pod's label enrols it, or the namespace's label does unless the
// pod's says none.
const DefaultYAML = `
- podSelector:
    matchLabels: {istio.io/dataplane-mode: ambient}
- podSelector:
    matchExpressions:
      - {key: istio.io/dataplane-mode, operator: NotIn, values: [none]}
  namespaceSelector:
    matchLabels: {istio.io/dataplane-mode: ambient}
`

// Selector is one entry: a pod matches when its labels match PodSelector
// and its namespace's match NamespaceSelector; an empty selector matches
// everything.
type Selector struct {
	PodSelector       LabelSelector `json:"podSelector"`
	NamespaceSelector LabelSelector `json:"namespaceSelector"`
}

// LabelSelector is Kubernetes' label selector, as written in YAML.
type LabelSelector struct {
	MatchLabels      map[string]string `json:"matchLabels,omitempty"`
	MatchExpressions []Requirement     `json:"matchExpressions,omitempty"`
}

// Requirement is one of a LabelSelector's expressions.
type Requirement struct {
	Key      string   `json:"key"`
	Operator string   `json:"operator"`
	Values   []string `json:"values,omitempty"`
}

// Selectors are compiled selectors; a pod is enrolled when any entry
// matches it.
type Selectors struct {
	source   []Selector
	pod, nss []labels.Selector
}

// Parse reads selectors in Istio's YAML (or JSON) form, a list of
// Selector. Empty text means Istio's default; an empty list enrols no
// pod. Unknown keys are refused: a misspelt "namespaceSelecter" would
// otherwise silently widen the selection to every namespace.
func Parse(text string) (*Selectors, error) {
	if strings.TrimSpace(text) == "" || strings.TrimSpace(text) == "null" {
		text = DefaultYAML
	}
	var src []Selector
	if err := yaml.UnmarshalStrict([]byte(text), &src); err != nil {
		return nil, fmt.Errorf("ambient enablement selectors: %w", err)
	}
	if src == nil {
		// YAML's null in any spelling ("~", a comment alone) is no list:
		// the default, as empty text is. Only [] enrols no pod.
		return Parse(DefaultYAML)
	}
	s := &Selectors{source: src}
	for i := range src {
		ps, err := src[i].PodSelector.compile()
		if err != nil {
			return nil, fmt.Errorf("ambient enablement selector %d: podSelector: %w", i+1, err)
		}
		ns, err := src[i].NamespaceSelector.compile()
		if err != nil {
			return nil, fmt.Errorf("ambient enablement selector %d: namespaceSelector: %w", i+1, err)
		}
		s.pod, s.nss = append(s.pod, ps), append(s.nss, ns)
	}
	return s, nil
}

// Default is Istio's default.
func Default() *Selectors {
	s, err := Parse(DefaultYAML)
	if err != nil {
		panic(err)
	}
	return s
}

var operators = map[string]selection.Operator{
	"In": selection.In, "NotIn": selection.NotIn, "Exists": selection.Exists, "DoesNotExist": selection.DoesNotExist,
}

// compile builds the selector as Kubernetes reads a LabelSelector; the
// library checks keys, values and each operator's values.
func (ls *LabelSelector) compile() (labels.Selector, error) {
	sel := labels.NewSelector()
	keys := make([]string, 0, len(ls.MatchLabels))
	for k := range ls.MatchLabels {
		keys = append(keys, k)
	}
	slices.Sort(keys)
	for _, k := range keys {
		r, err := labels.NewRequirement(k, selection.Equals, []string{ls.MatchLabels[k]})
		if err != nil {
			return nil, err
		}
		sel = sel.Add(*r)
	}
	for _, e := range ls.MatchExpressions {
		op, ok := operators[e.Operator]
		if !ok {
			return nil, fmt.Errorf("%q is not a valid label selector operator (In, NotIn, Exists, DoesNotExist)", e.Operator)
		}
		r, err := labels.NewRequirement(e.Key, op, e.Values)
		if err != nil {
			return nil, err
		}
		sel = sel.Add(*r)
	}
	return sel, nil
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

// Empty reports whether no pod can match (the list is []).
func (s *Selectors) Empty() bool { return len(s.pod) == 0 }

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

// Pod is what the decision reads of a pod.
type Pod struct {
	Namespace, Name     string
	Labels, Annotations map[string]string
	HostNetwork         bool
}

// Decision says whether a pod is enrolled, and why (for logs and Events).
type Decision struct {
	Enrol  bool
	Reason string
}

// agentPodPrefix names the agent's own pods, as the DaemonSet names them.
const agentPodPrefix = "istio-cni-node-"

// annotationSidecarStatus marks a pod with an injected sidecar.
const annotationSidecarStatus = redirect.AnnotationStatus

// Exclusion says why the pod is never enrolled, whatever the selectors
// and its namespace ("" when they decide).
func (p Policy) Exclusion(pod Pod) string {
	_, sidecar := pod.Annotations[annotationSidecarStatus]
	switch {
	case pod.HostNetwork:
		return "the pod uses the node's network namespace (hostNetwork)"
	case sidecar:
		return "the pod has a sidecar (" + annotationSidecarStatus + ")"
	case slices.Contains(p.ExcludeNamespaces, pod.Namespace):
		return "namespace " + pod.Namespace + " is excluded"
	case p.SystemNamespace != "" && pod.Namespace == p.SystemNamespace && strings.HasPrefix(pod.Name, agentPodPrefix):
		return "the pod is the CNI node agent's"
	case p.SystemNamespace != "" && pod.Namespace == p.SystemNamespace && pod.Labels["app"] == "ztunnel":
		return "the pod is ztunnel's"
	}
	return ""
}

// Decide applies Istio's checks in Istio's order to a pod and its
// namespace's labels.
func (p Policy) Decide(pod Pod, nsLabels map[string]string) Decision {
	if reason := p.Exclusion(pod); reason != "" {
		return Decision{false, reason}
	}
	sel := p.Selectors
	if sel == nil {
		sel = Default()
	}
	if !sel.Match(pod.Labels, nsLabels) {
		return Decision{false, "no enablement selector matches the pod and its namespace"}
	}
	return Decision{true, "an enablement selector matches"}
}
