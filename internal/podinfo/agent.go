package podinfo

import (
	"context"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/url"
	"time"
)

// AgentSocketName is the node agent's socket in the run directory: pod
// lookups from its node-local cache, and its readiness.
const AgentSocketName = "agent.sock"

// AgentClient asks the node agent.
type AgentClient struct {
	client *http.Client
	UID    string
}

// NewAgentClient talks to the agent socket at path.
func NewAgentClient(path string, timeout time.Duration) *AgentClient {
	return &AgentClient{client: &http.Client{
		Timeout: timeout,
		Transport: &http.Transport{DialContext: func(ctx context.Context, _, _ string) (net.Conn, error) {
			var d net.Dialer
			return d.DialContext(ctx, "unix", path)
		}},
	}}
}

// GetPod returns the pod from the agent's cache; ErrNotFound when the
// agent does not know it (yet).
func (a *AgentClient) GetPod(ctx context.Context, namespace, name string) (*Pod, error) {
	q := url.Values{"namespace": {namespace}, "name": {name}}
	if a.UID != "" {
		q.Set("uid", a.UID)
	}
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, "http://agent/pod?"+q.Encode(), http.NoBody)
	if err != nil {
		return nil, err
	}
	resp, err := a.client.Do(req)
	if err != nil {
		return nil, err
	}
	defer resp.Body.Close()
	body, err := io.ReadAll(io.LimitReader(resp.Body, 8<<20))
	if err != nil {
		return nil, err
	}
	switch resp.StatusCode {
	case http.StatusOK:
		return DecodeJSON(body)
	case http.StatusNotFound:
		return nil, ErrNotFound
	}
	return nil, fmt.Errorf("agent answered HTTP %d: %s", resp.StatusCode, snippet(body))
}

// Ready asks the agent whether the node is ready (binary, kubeconfig and
// config entry in place).
func (a *AgentClient) Ready(ctx context.Context) error {
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, "http://agent/readyz", http.NoBody)
	if err != nil {
		return err
	}
	resp, err := a.client.Do(req)
	if err != nil {
		return err
	}
	defer resp.Body.Close()
	body, _ := io.ReadAll(io.LimitReader(resp.Body, 4096))
	if resp.StatusCode != http.StatusOK {
		return fmt.Errorf("%s", snippet(body))
	}
	return nil
}

// Fallback asks the agent first and the API server when the agent is
// absent, not synced, or does not know the pod.
type Fallback struct {
	Agent   Source
	API     func() (Source, error)
	OnAgent func(hit bool, err error)
}

// GetPod implements Source.
func (f *Fallback) GetPod(ctx context.Context, namespace, name string) (*Pod, error) {
	if f.Agent != nil {
		pod, err := f.Agent.GetPod(ctx, namespace, name)
		if f.OnAgent != nil {
			f.OnAgent(err == nil, err)
		}
		if err == nil {
			return pod, nil
		}
	}
	api, err := f.API()
	if err != nil {
		return nil, err
	}
	return api.GetPod(ctx, namespace, name)
}
