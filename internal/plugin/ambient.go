package plugin

import (
	"context"
	"errors"
	"fmt"

	"github.com/istio-cni-go/istio-cni/internal/enablement"
	"github.com/istio-cni-go/istio-cni/internal/podinfo"
)

// NamespaceReader reads a namespace's labels.
type NamespaceReader interface {
	NamespaceLabels(ctx context.Context, namespace string) (map[string]string, error)
}

// ambientDecision decides, in this process, whether the ambient
// selectors enrol the pod (the fallback's own decision; the agent's is
// Plugin.Ambient). A pod the policy keeps out needs no API request; a
// namespace that cannot be read is an error, never a "no".
func (p *Plugin) ambientDecision(ctx context.Context, conf *Config, pod *podinfo.Pod) (enablement.Decision, error) {
	policy := enablement.Policy{Selectors: conf.selectors, ExcludeNamespaces: conf.ExcludeNamespaces, SystemNamespace: conf.PodNamespace}
	facts := enablement.Pod{Namespace: pod.Namespace, Name: pod.Name, Labels: pod.Labels, Annotations: pod.Annotations, HostNetwork: pod.HostNetwork}
	if reason := policy.Exclusion(facts); reason != "" {
		return enablement.Decision{Reason: reason}, nil
	}
	if conf.selectors != nil && conf.selectors.Empty() {
		return enablement.Decision{Reason: "no enablement selector is configured"}, nil
	}
	nsLabels, err := p.namespaceLabels(ctx, conf, pod.Namespace)
	if err != nil {
		return enablement.Decision{}, fmt.Errorf("ambient mode: cannot read namespace %s to tell whether pod %s/%s is enrolled: %w",
			pod.Namespace, pod.Namespace, pod.Name, err)
	}
	return policy.Decide(facts, nsLabels), nil
}

// refuseAmbient fails the ADD of a pod the ambient selectors enrol when
// no node agent serves it (this process is the fallback): only the agent
// can hand a pod's namespace to ztunnel, and the reference's way, to
// start the pod outside the mesh, is what this plugin never does.
//
// In a rollout of the agent (a token renewed, or an agent stopped leaving
// the plugin within renewWithin), it waits within k8s_retry_budget for the
// next agent's socket instead, and returns errAgentStarted once it is
// there: the relay then asks that agent, which enrols the pod.
func (p *Plugin) refuseAmbient(ctx context.Context, conf *Config, pod *podinfo.Pod, rw *rolloutWatch) error {
	d, err := p.ambientDecision(ctx, conf, pod)
	if err != nil || !d.Enrol {
		return err
	}
	if rw != nil {
		if recent, _ := rolloutRecent(conf.CNIAgentRunDir); rw.renewed || recent {
			wctx, cancel := context.WithDeadline(ctx, rw.start.Add(conf.retryBudget))
			err := rw.waitAgent(wctx)
			cancel()
			if errors.Is(err, errAgentStarted) {
				return fmt.Errorf("pod %s/%s is enrolled in the ambient mesh (%s): %w", pod.Namespace, pod.Name, d.Reason, err)
			}
		}
	}
	reason := p.FallbackReason
	if reason == "" {
		reason = "it did not answer"
	}
	return fmt.Errorf("pod %s/%s is enrolled in the ambient mesh (%s), and only the istio-cni node agent can enrol it "+
		"(it hands the pod's network namespace to ztunnel); the node agent is not serving this node (%s). "+
		"The pod is not started outside the mesh; its sandbox is retried", pod.Namespace, pod.Name, d.Reason, reason)
}

func (p *Plugin) namespaceLabels(ctx context.Context, conf *Config, namespace string) (map[string]string, error) {
	var r NamespaceReader
	if p.Namespaces != nil {
		r = p.Namespaces
	} else {
		c, err := podinfo.NewAPIClient(conf.KubeconfigPath(), conf.CNIAgentRunDir)
		if err != nil {
			return nil, err
		}
		defer c.CloseIdleConnections()
		r = c
	}
	ctx, cancel := context.WithTimeout(ctx, conf.requestTimeout)
	defer cancel()
	return r.NamespaceLabels(ctx, namespace)
}
