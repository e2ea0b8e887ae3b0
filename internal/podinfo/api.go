package podinfo

import (
	"context"
	"crypto/tls"
	"crypto/x509"
	"encoding/base64"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"net/url"
	"path/filepath"
	"regexp"
	"strings"
	"time"

	"sigs.k8s.io/yaml"
)

// Source finds a pod by namespace and name.
type Source interface {
	GetPod(ctx context.Context, namespace, name string) (*Pod, error)
}

// ErrNotFound is returned when the API server says the pod does not exist.
var ErrNotFound = errors.New("pod not found")

// PermanentError marks failures that retrying cannot fix (bad credentials,
// forbidden): the caller stops retrying at once.
type PermanentError struct {
	Err error
	// TokenRefused is an HTTP 401: new credentials may help where a
	// retry cannot.
	TokenRefused bool
}

func (e *PermanentError) Error() string { return e.Err.Error() }
func (e *PermanentError) Unwrap() error { return e.Err }

// APIClient reads pods from the Kubernetes API with the plugin's
// kubeconfig. It is a plain HTTPS GET decoding only the fields the plugin
// needs: a full client library would triple the binary and its start-up.
type APIClient struct {
	server string
	token  string
	client *http.Client
}

type kubeconfig struct {
	CurrentContext string `json:"current-context"`
	Clusters       []struct {
		Name    string `json:"name"`
		Cluster struct {
			Server                   string `json:"server"`
			CertificateAuthority     string `json:"certificate-authority"`
			CertificateAuthorityData string `json:"certificate-authority-data"`
			InsecureSkipTLSVerify    bool   `json:"insecure-skip-tls-verify"`
		} `json:"cluster"`
	} `json:"clusters"`
	Users []struct {
		Name string `json:"name"`
		User struct {
			Token                 string `json:"token"`
			TokenFile             string `json:"tokenFile"`
			ClientCertificateData string `json:"client-certificate-data"`
			ClientKeyData         string `json:"client-key-data"`
		} `json:"user"`
	} `json:"users"`
	Contexts []struct {
		Name    string `json:"name"`
		Context struct {
			Cluster string `json:"cluster"`
			User    string `json:"user"`
		} `json:"context"`
	} `json:"contexts"`
}

// NewAPIClient loads a kubeconfig file. Only what the agent writes (and
// what an operator is likely to hand-write) is supported: token or client
// certificate auth, CA data or file, or insecure-skip-tls-verify. When
// sessionCacheDir is set, TLS sessions are resumed across processes
// through a file there.
func NewAPIClient(path, sessionCacheDir string) (*APIClient, error) {
	data, err := readSmallFile(path)
	if err != nil {
		return nil, fmt.Errorf("reading kubeconfig: %w", err)
	}
	var kc kubeconfig
	if err := yaml.Unmarshal(data, &kc); err != nil {
		return nil, fmt.Errorf("parsing kubeconfig %s: %w", path, err)
	}
	ctxCluster, ctxUser := "", ""
	for _, c := range kc.Contexts {
		if c.Name == kc.CurrentContext {
			ctxCluster, ctxUser = c.Context.Cluster, c.Context.User
		}
	}
	if ctxCluster == "" && len(kc.Clusters) == 1 {
		ctxCluster = kc.Clusters[0].Name
	}
	if ctxUser == "" && len(kc.Users) == 1 {
		ctxUser = kc.Users[0].Name
	}
	c := &APIClient{}
	tlsConf := &tls.Config{MinVersion: tls.VersionTLS12}
	found := false
	for _, cl := range kc.Clusters {
		if cl.Name != ctxCluster {
			continue
		}
		found = true
		u, err := url.Parse(cl.Cluster.Server)
		if err != nil || u.Host == "" {
			return nil, fmt.Errorf("kubeconfig %s: invalid server %q", path, cl.Cluster.Server)
		}
		c.server = strings.TrimRight(cl.Cluster.Server, "/")
		tlsConf.InsecureSkipVerify = cl.Cluster.InsecureSkipTLSVerify
		var caPEM []byte
		switch {
		case cl.Cluster.CertificateAuthorityData != "":
			if caPEM, err = base64.StdEncoding.DecodeString(cl.Cluster.CertificateAuthorityData); err != nil {
				return nil, fmt.Errorf("kubeconfig %s: certificate-authority-data: %w", path, err)
			}
		case cl.Cluster.CertificateAuthority != "":
			if caPEM, err = readSmallFile(cl.Cluster.CertificateAuthority); err != nil {
				return nil, fmt.Errorf("kubeconfig %s: %w", path, err)
			}
		}
		if len(caPEM) > 0 {
			pool := x509.NewCertPool()
			if !pool.AppendCertsFromPEM(caPEM) {
				return nil, fmt.Errorf("kubeconfig %s: no certificate in the CA data", path)
			}
			tlsConf.RootCAs = pool
		}
	}
	if !found {
		return nil, fmt.Errorf("kubeconfig %s: no cluster for the current context %q", path, kc.CurrentContext)
	}
	for _, u := range kc.Users {
		if u.Name != ctxUser {
			continue
		}
		c.token = u.User.Token
		if c.token == "" && u.User.TokenFile != "" {
			tok, err := readSmallFile(u.User.TokenFile)
			if err != nil {
				return nil, fmt.Errorf("kubeconfig %s: %w", path, err)
			}
			c.token = strings.TrimSpace(string(tok))
		}
		if u.User.ClientCertificateData != "" {
			certPEM, err1 := base64.StdEncoding.DecodeString(u.User.ClientCertificateData)
			keyPEM, err2 := base64.StdEncoding.DecodeString(u.User.ClientKeyData)
			if err := errors.Join(err1, err2); err != nil {
				return nil, fmt.Errorf("kubeconfig %s: client certificate: %w", path, err)
			}
			cert, err := tls.X509KeyPair(certPEM, keyPEM)
			if err != nil {
				return nil, fmt.Errorf("kubeconfig %s: client certificate: %w", path, err)
			}
			tlsConf.Certificates = []tls.Certificate{cert}
		}
	}
	if sessionCacheDir != "" {
		tlsConf.ClientSessionCache = &fileSessionCache{path: filepath.Join(sessionCacheDir, SessionCacheName)}
	}
	// Idle connections are closed after a while: a long-lived user (the
	// agent without API access of its own) must not keep them forever.
	c.client = &http.Client{Transport: &http.Transport{TLSClientConfig: tlsConf, ForceAttemptHTTP2: false, Proxy: nil,
		MaxIdleConnsPerHost: 2, IdleConnTimeout: 90 * time.Second}}
	return c, nil
}

// CloseIdleConnections closes the client's kept-alive connections, for a
// client being replaced.
func (c *APIClient) CloseIdleConnections() { c.client.CloseIdleConnections() }

// SessionCacheName is the file in the run directory that holds the TLS
// session shared by plugin processes.
const SessionCacheName = "istio-cni-tls-session"

var (
	dns1123Label     = regexp.MustCompile(`^[a-z0-9]([-a-z0-9]*[a-z0-9])?$`)
	dns1123Subdomain = regexp.MustCompile(`^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$`)
)

// ValidateName checks a namespace and pod name as Kubernetes does, so
// that nothing else reaches a URL.
func ValidateName(namespace, name string) error {
	if !validNamespace(namespace) {
		return fmt.Errorf("invalid pod namespace %q", namespace)
	}
	if len(name) > 253 || !dns1123Subdomain.MatchString(name) {
		return fmt.Errorf("invalid pod name %q", name)
	}
	return nil
}

func validNamespace(namespace string) bool {
	return len(namespace) <= 63 && dns1123Label.MatchString(namespace)
}

// GetPod does one consistent GET (never from a possibly stale cache: an
// annotation changed just before the sandbox starts must be seen). The
// caller bounds it with ctx.
func (c *APIClient) GetPod(ctx context.Context, namespace, name string) (*Pod, error) {
	if err := ValidateName(namespace, name); err != nil {
		return nil, &PermanentError{Err: err}
	}
	body, err := c.get(ctx, fmt.Sprintf("%s/api/v1/namespaces/%s/pods/%s", c.server, url.PathEscape(namespace), url.PathEscape(name)))
	if err != nil {
		return nil, err
	}
	return DecodeJSON(body)
}

// get does one GET with the plugin's credentials and returns the body
// (at most 8 MiB) of a 200; any other answer is an error: ErrNotFound,
// a PermanentError for refused credentials (no retry can help), else
// one naming the status.
func (c *APIClient) get(ctx context.Context, u string) ([]byte, error) {
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, u, http.NoBody)
	if err != nil {
		return nil, err
	}
	req.Header.Set("Accept", "application/json")
	req.Header.Set("User-Agent", "istio-cni")
	if c.token != "" {
		req.Header.Set("Authorization", "Bearer "+c.token)
	}
	resp, err := c.client.Do(req)
	if err != nil {
		return nil, err
	}
	defer resp.Body.Close()
	body, err := io.ReadAll(io.LimitReader(resp.Body, 8<<20))
	if err != nil {
		return nil, fmt.Errorf("reading the API server's answer: %w", err)
	}
	switch status := resp.StatusCode; status {
	case http.StatusOK:
		return body, nil
	case http.StatusNotFound:
		return nil, ErrNotFound
	case http.StatusUnauthorized:
		// The kubeconfig carries the node agent's token, bound to the
		// agent's pod: the API server refuses it once that pod is gone.
		return nil, &PermanentError{Err: fmt.Errorf("API server refused the plugin's credentials (HTTP 401): %s; "+
			"the kubeconfig holds the node agent's token, which ends with the agent's pod: is istio-cni-node being replaced (a rollout), or gone from this node? "+
			"The next agent rewrites it when it starts", snippet(body)), TokenRefused: true}
	case http.StatusForbidden:
		return nil, &PermanentError{Err: fmt.Errorf("API server refused the plugin's credentials (HTTP 403): %s", snippet(body))}
	default:
		return nil, fmt.Errorf("API server answered HTTP %d: %s", status, snippet(body))
	}
}

// NamespaceLabels reads a namespace's labels (ambient mode's selectors
// read them), with one GET the caller bounds with ctx.
func (c *APIClient) NamespaceLabels(ctx context.Context, namespace string) (map[string]string, error) {
	if !validNamespace(namespace) {
		return nil, &PermanentError{Err: fmt.Errorf("invalid namespace %q", namespace)}
	}
	body, err := c.get(ctx, fmt.Sprintf("%s/api/v1/namespaces/%s", c.server, url.PathEscape(namespace)))
	if err != nil {
		return nil, err
	}
	var ns struct {
		Metadata struct {
			Labels map[string]string `json:"labels"`
		} `json:"metadata"`
	}
	if err := json.Unmarshal(body, &ns); err != nil {
		return nil, fmt.Errorf("decoding namespace %s: %w", namespace, err)
	}
	return ns.Metadata.Labels, nil
}

func snippet(b []byte) string {
	s := strings.TrimSpace(string(b))
	if len(s) > 300 {
		s = s[:300] + "..."
	}
	return s
}

// Retrying wraps a Source with a per-request timeout and an overall
// budget, backing off between attempts.
type Retrying struct {
	Source         Source
	RequestTimeout time.Duration
	Budget         time.Duration
	// Sleep waits between attempts; time.Sleep-like, but cancellable.
	Sleep func(ctx context.Context, d time.Duration) error
	// Renew, when set, is asked for a source with other credentials once
	// the API server refused these (HTTP 401), within the budget: the
	// token of a node agent being replaced dies with its pod, and the
	// next agent writes its own within seconds, where a failed ADD waits
	// for the kubelet's next try. It returns when it has one or ctx ends.
	Renew func(ctx context.Context) (Source, error)
}

// GetPod retries until the pod is read, a permanent error occurs, or the
// budget is spent; then it says how many attempts failed and why.
func (r *Retrying) GetPod(ctx context.Context, namespace, name string) (*Pod, error) {
	ctx, cancel := context.WithTimeout(ctx, r.Budget)
	defer cancel()
	sleep := r.Sleep
	if sleep == nil {
		sleep = sleepCtx
	}
	backoff := 50 * time.Millisecond
	src := r.Source
	renewed := 0
	var lastErr error
	for attempt := 1; ; attempt++ {
		reqCtx, reqCancel := context.WithTimeout(ctx, r.RequestTimeout)
		pod, err := src.GetPod(reqCtx, namespace, name)
		reqCancel()
		if err == nil {
			return pod, nil
		}
		lastErr = err
		var perm *PermanentError
		if errors.As(err, &perm) && perm.TokenRefused && r.Renew != nil {
			next, rerr := r.Renew(ctx)
			switch {
			case rerr != nil && ctx.Err() != nil && renewed == 0:
				return nil, fmt.Errorf("%w; no other credentials came within %s", err, r.Budget)
			case rerr != nil && ctx.Err() != nil:
				return nil, fmt.Errorf("%w; the other credentials that came within %s (%d) were refused as well", err, r.Budget, renewed)
			case rerr != nil:
				return nil, fmt.Errorf("%w; %w", err, rerr)
			}
			renewed++
			src = next
			continue
		}
		if errors.As(err, &perm) {
			return nil, err
		}
		if err := sleep(ctx, backoff); err != nil {
			return nil, fmt.Errorf("gave up after %d attempts within %s: %w", attempt, r.Budget, lastErr)
		}
		backoff = min(backoff*2, time.Second)
	}
}

func sleepCtx(ctx context.Context, d time.Duration) error {
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-ctx.Done():
		return ctx.Err()
	case <-t.C:
		return nil
	}
}
