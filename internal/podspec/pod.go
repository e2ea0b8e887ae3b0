// Package podspec holds the facts about a pod that the plugin decides on.
// It is a leaf: the relay links it (through the redirect parameters) to
// commit rules, and must not link the API clients of package podinfo,
// whose HTTP and TLS code would cost every relay's start-up.
package podspec

import (
	"encoding/json"
	"fmt"
)

// Pod is the part of a Kubernetes pod that sidecar redirection depends on.
// It is deliberately small: the plugin runs once per pod start, and decoding
// only these fields keeps it fast and its binary small.
type Pod struct {
	Namespace      string
	Name           string
	UID            string
	Labels         map[string]string
	Annotations    map[string]string
	InitContainers []Container
	Containers     []Container
	PodIPs         []string
	// HostNetwork: the pod shares the node's network namespace (never in
	// the ambient mesh).
	HostNetwork bool
}

// Container is one container of a pod, reduced to what the decision needs.
type Container struct {
	Name string
	Args []string
	// Env holds the literal values only; values from references
	// (valueFrom) cannot be known at sandbox creation and are left out,
	// as the reference implementation does.
	Env        map[string]string
	RunAsUser  *int64
	RunAsGroup *int64
}

// FindContainer returns the first container or init container with the
// given name, looking at init containers first so that a native sidecar
// (an init container with restartPolicy Always) counts.
func (p *Pod) FindContainer(name string) (*Container, bool) {
	for i := range p.InitContainers {
		if p.InitContainers[i].Name == name {
			return &p.InitContainers[i], true
		}
	}
	for i := range p.Containers {
		if p.Containers[i].Name == name {
			return &p.Containers[i], true
		}
	}
	return nil, false
}

// ContainerNames lists every init container and container name.
func (p *Pod) ContainerNames() []string {
	names := make([]string, 0, len(p.InitContainers)+len(p.Containers))
	for _, c := range p.InitContainers {
		names = append(names, c.Name)
	}
	for _, c := range p.Containers {
		names = append(names, c.Name)
	}
	return names
}

// The wire types mirror the Kubernetes JSON of a Pod, for the fields used.
type wirePod struct {
	Metadata struct {
		Namespace   string            `json:"namespace"`
		Name        string            `json:"name"`
		UID         string            `json:"uid"`
		Labels      map[string]string `json:"labels"`
		Annotations map[string]string `json:"annotations"`
	} `json:"metadata"`
	Spec struct {
		HostNetwork    bool            `json:"hostNetwork"`
		InitContainers []wireContainer `json:"initContainers"`
		Containers     []wireContainer `json:"containers"`
	} `json:"spec"`
	Status struct {
		PodIPs []struct {
			IP string `json:"ip"`
		} `json:"podIPs"`
	} `json:"status"`
}

type wireContainer struct {
	Name string   `json:"name"`
	Args []string `json:"args"`
	Env  []struct {
		Name  string  `json:"name"`
		Value *string `json:"value"`
	} `json:"env"`
	SecurityContext *struct {
		RunAsUser  *int64 `json:"runAsUser"`
		RunAsGroup *int64 `json:"runAsGroup"`
	} `json:"securityContext"`
}

// DecodeJSON reads a pod from its Kubernetes JSON representation.
func DecodeJSON(data []byte) (*Pod, error) {
	var w wirePod
	if err := json.Unmarshal(data, &w); err != nil {
		return nil, fmt.Errorf("decoding pod: %w", err)
	}
	p := &Pod{
		Namespace:   w.Metadata.Namespace,
		Name:        w.Metadata.Name,
		UID:         w.Metadata.UID,
		Labels:      w.Metadata.Labels,
		Annotations: w.Metadata.Annotations,
		HostNetwork: w.Spec.HostNetwork,
	}
	p.InitContainers = convertContainers(w.Spec.InitContainers)
	p.Containers = convertContainers(w.Spec.Containers)
	for _, ip := range w.Status.PodIPs {
		p.PodIPs = append(p.PodIPs, ip.IP)
	}
	return p, nil
}

func convertContainers(in []wireContainer) []Container {
	out := make([]Container, 0, len(in))
	for _, wc := range in {
		c := Container{Name: wc.Name, Args: wc.Args}
		for _, e := range wc.Env {
			if e.Value == nil {
				continue
			}
			if c.Env == nil {
				c.Env = map[string]string{}
			}
			c.Env[e.Name] = *e.Value
		}
		if wc.SecurityContext != nil {
			c.RunAsUser = wc.SecurityContext.RunAsUser
			c.RunAsGroup = wc.SecurityContext.RunAsGroup
		}
		out = append(out, c)
	}
	return out
}
