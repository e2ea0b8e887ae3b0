package podinfo

import (
	"context"
	"encoding/base64"
	"encoding/pem"
	"errors"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"
)

// apiServer is an HTTPS stand-in for the API server answering by path,
// recording the requests it got.
type apiServer struct {
	srv *httptest.Server
	mu  sync.Mutex
	got []*http.Request
	// answers maps a path to its status and body.
	answers map[string]struct {
		status int
		body   string
	}
}

func newAPIServer(t *testing.T) *apiServer {
	t.Helper()
	a := &apiServer{answers: map[string]struct {
		status int
		body   string
	}{}}
	a.srv = httptest.NewTLSServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		a.mu.Lock()
		a.got = append(a.got, r.Clone(context.Background()))
		ans, ok := a.answers[r.URL.EscapedPath()]
		a.mu.Unlock()
		if !ok {
			http.Error(w, `{"kind":"Status","code":404}`, http.StatusNotFound)
			return
		}
		w.Header().Set("Content-Type", "application/json")
		w.WriteHeader(ans.status)
		_, _ = w.Write([]byte(ans.body))
	}))
	t.Cleanup(a.srv.Close)
	return a
}

func (a *apiServer) answer(path string, status int, body string) {
	a.mu.Lock()
	defer a.mu.Unlock()
	a.answers[path] = struct {
		status int
		body   string
	}{status, body}
}

func (a *apiServer) requests() []*http.Request {
	a.mu.Lock()
	defer a.mu.Unlock()
	return append([]*http.Request(nil), a.got...)
}

// client is an APIClient with a kubeconfig as the agent writes it: the
// server's CA as data and a bearer token.
func (a *apiServer) client(t *testing.T) *APIClient {
	t.Helper()
	ca := pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: a.srv.Certificate().Raw})
	return a.clientWith(t, "\n    certificate-authority-data: "+base64.StdEncoding.EncodeToString(ca))
}

// clientWith is client with the cluster's CA settings given as YAML.
func (a *apiServer) clientWith(t *testing.T, caYAML string) *APIClient {
	t.Helper()
	kc := "apiVersion: v1\nkind: Config\nclusters:\n- name: local\n  cluster:\n    server: " + a.srv.URL + caYAML +
		"\nusers:\n- name: istio-cni\n  user:\n    token: tok-123\ncontexts:\n- name: c\n  context:\n    cluster: local\n    user: istio-cni\ncurrent-context: c\n"
	path := filepath.Join(t.TempDir(), "kubeconfig")
	if err := os.WriteFile(path, []byte(kc), 0o600); err != nil {
		t.Fatal(err)
	}
	c, err := NewAPIClient(path, "")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(c.CloseIdleConnections)
	return c
}

// TestNamespaceLabels: one authenticated GET of /api/v1/namespaces/NAME
// over verified TLS; the labels on 200, ErrNotFound on 404, a permanent
// error on 401 and 403, a retryable one on other statuses, and invalid
// names refused without a request.
func TestNamespaceLabels(t *testing.T) {
	a := newAPIServer(t)
	a.answer("/api/v1/namespaces/apps", 200, `{"kind":"Namespace","apiVersion":"v1","metadata":{"name":"apps","uid":"x",
		"labels":{"istio.io/dataplane-mode":"ambient","kubernetes.io/metadata.name":"apps"}},"spec":{"finalizers":["kubernetes"]},"status":{"phase":"Active"}}`)
	a.answer("/api/v1/namespaces/bare", 200, `{"kind":"Namespace","metadata":{"name":"bare"}}`)
	a.answer("/api/v1/namespaces/denied", 403, `{"kind":"Status","message":"namespaces \"denied\" is forbidden: User \"system:serviceaccount:istio-system:istio-cni\" cannot get resource \"namespaces\""}`)
	a.answer("/api/v1/namespaces/unauth", 401, `{"kind":"Status","message":"Unauthorized"}`)
	a.answer("/api/v1/namespaces/busy", 503, `the server is currently unable to handle the request`)
	a.answer("/api/v1/namespaces/garbled", 200, `<html>not json</html>`)
	c := a.client(t)
	ctx := context.Background()

	for _, tc := range []struct {
		ns        string
		want      map[string]string
		notFound  bool
		permanent bool
		errSays   []string
	}{
		{ns: "apps", want: map[string]string{"istio.io/dataplane-mode": "ambient", "kubernetes.io/metadata.name": "apps"}},
		{ns: "bare", want: map[string]string{}},
		{ns: "gone", notFound: true},
		{ns: "denied", permanent: true, errSays: []string{"403", "cannot get resource"}},
		{ns: "unauth", permanent: true, errSays: []string{"401", "Unauthorized", "istio-cni-node being replaced"}},
		{ns: "busy", errSays: []string{"503", "unable to handle"}},
		{ns: "garbled", errSays: []string{"namespace garbled"}},
	} {
		before := len(a.requests())
		labels, err := c.NamespaceLabels(ctx, tc.ns)
		reqs := a.requests()
		if len(reqs) != before+1 {
			t.Errorf("%s: %d requests, want 1", tc.ns, len(reqs)-before)
			continue
		}
		r := reqs[len(reqs)-1]
		if r.Method != http.MethodGet || r.URL.Path != "/api/v1/namespaces/"+tc.ns || r.URL.RawQuery != "" ||
			r.Header.Get("Authorization") != "Bearer tok-123" || r.Header.Get("Accept") != "application/json" {
			t.Errorf("%s: request %s %s, Authorization %q, Accept %q", tc.ns, r.Method, r.URL, r.Header.Get("Authorization"), r.Header.Get("Accept"))
		}
		var perm *PermanentError
		switch {
		case tc.want != nil:
			if err != nil {
				t.Errorf("%s: %v", tc.ns, err)
				continue
			}
			if len(labels) != len(tc.want) {
				t.Errorf("%s: labels %v, want %v", tc.ns, labels, tc.want)
			}
			for k, v := range tc.want {
				if labels[k] != v {
					t.Errorf("%s: labels %v, want %v", tc.ns, labels, tc.want)
				}
			}
		case tc.notFound:
			if !errors.Is(err, ErrNotFound) || errors.As(err, &perm) {
				t.Errorf("%s: %v, want ErrNotFound", tc.ns, err)
			}
		default:
			if err == nil {
				t.Errorf("%s: no error, labels %v", tc.ns, labels)
				continue
			}
			if errors.As(err, &perm) != tc.permanent {
				t.Errorf("%s: permanent=%v, want %v: %v", tc.ns, !tc.permanent, tc.permanent, err)
			}
			if errors.Is(err, ErrNotFound) {
				t.Errorf("%s: not found: %v", tc.ns, err)
			}
			for _, w := range tc.errSays {
				if !strings.Contains(err.Error(), w) {
					t.Errorf("%s: error %q does not say %q", tc.ns, err, w)
				}
			}
		}
	}

	// Names that are not namespaces never reach a URL.
	before := len(a.requests())
	for _, bad := range []string{"", "Apps", "a/b", "../pods", "apps?watch=1", "a.b", "-x", strings.Repeat("a", 64), "apps%2Fx"} {
		_, err := c.NamespaceLabels(ctx, bad)
		var perm *PermanentError
		if !errors.As(err, &perm) || !strings.Contains(err.Error(), "invalid namespace") {
			t.Errorf("namespace %q: %v, want a permanent invalid-namespace error", bad, err)
		}
	}
	if n := len(a.requests()) - before; n != 0 {
		t.Errorf("invalid names made %d requests", n)
	}
	if _, err := c.NamespaceLabels(ctx, strings.Repeat("a", 63)); !errors.Is(err, ErrNotFound) {
		t.Errorf("a 63-character name is valid: %v", err)
	}

	// The caller's context bounds the request.
	cancelled, cancel := context.WithCancel(ctx)
	cancel()
	if _, err := c.NamespaceLabels(cancelled, "apps"); !errors.Is(err, context.Canceled) {
		t.Errorf("cancelled context: %v", err)
	}
}

// TestNamespaceLabelsVerifiesTheServer: a server whose certificate the
// kubeconfig's CA did not sign is refused, unless the kubeconfig says
// to skip verification.
func TestNamespaceLabelsVerifiesTheServer(t *testing.T) {
	a := newAPIServer(t)
	a.answer("/api/v1/namespaces/apps", 200, `{"metadata":{"labels":{"a":"b"}}}`)
	if _, err := a.clientWith(t, "").NamespaceLabels(context.Background(), "apps"); err == nil || !strings.Contains(err.Error(), "certificate") {
		t.Fatalf("a server whose certificate no trusted CA signed: %v", err)
	}
	if len(a.requests()) != 0 {
		t.Fatal("the request reached an unverified server")
	}
	labels, err := a.clientWith(t, "\n    insecure-skip-tls-verify: true").NamespaceLabels(context.Background(), "apps")
	if err != nil || labels["a"] != "b" {
		t.Fatalf("insecure-skip-tls-verify: %v %v", labels, err)
	}
}

// TestGetPodThroughTheSharedGET: GetPod on the same helper: the pod
// (with hostNetwork) on 200, the same error classes otherwise.
func TestGetPodThroughTheSharedGET(t *testing.T) {
	a := newAPIServer(t)
	a.answer("/api/v1/namespaces/apps/pods/web-0", 200, `{"metadata":{"namespace":"apps","name":"web-0","uid":"u1","labels":{"istio.io/dataplane-mode":"ambient"}},
		"spec":{"hostNetwork":true,"containers":[{"name":"app"}]}}`)
	a.answer("/api/v1/namespaces/apps/pods/secret", 403, `forbidden`)
	a.answer("/api/v1/namespaces/apps/pods/flaky", 500, `etcdserver: leader changed`)
	c := a.client(t)
	ctx := context.Background()
	p, err := c.GetPod(ctx, "apps", "web-0")
	if err != nil {
		t.Fatal(err)
	}
	if p.Name != "web-0" || p.UID != "u1" || !p.HostNetwork || p.Labels["istio.io/dataplane-mode"] != "ambient" {
		t.Fatalf("pod %+v", p)
	}
	r := a.requests()[0]
	if r.Header.Get("Authorization") != "Bearer tok-123" || r.URL.Path != "/api/v1/namespaces/apps/pods/web-0" {
		t.Fatalf("request %s with %q", r.URL, r.Header.Get("Authorization"))
	}
	if _, err := c.GetPod(ctx, "apps", "missing"); !errors.Is(err, ErrNotFound) {
		t.Errorf("missing pod: %v", err)
	}
	var perm *PermanentError
	if _, err := c.GetPod(ctx, "apps", "secret"); !errors.As(err, &perm) || !strings.Contains(err.Error(), "403") {
		t.Errorf("forbidden pod: %v", err)
	}
	if _, err := c.GetPod(ctx, "apps", "flaky"); err == nil || errors.As(err, &perm) || !strings.Contains(err.Error(), "leader changed") {
		t.Errorf("server error: %v", err)
	}
	n := len(a.requests())
	if _, err := c.GetPod(ctx, "apps", "a/b"); !errors.As(err, &perm) {
		t.Errorf("invalid pod name: %v", err)
	}
	if len(a.requests()) != n {
		t.Error("an invalid pod name made a request")
	}
}

// TestDecodeHostNetwork: spec.hostNetwork is decoded, false when absent.
func TestDecodeHostNetwork(t *testing.T) {
	for _, c := range []struct {
		spec string
		want bool
	}{
		{`{"hostNetwork":true,"containers":[{"name":"a"}]}`, true},
		{`{"hostNetwork":false,"containers":[{"name":"a"}]}`, false},
		{`{"containers":[{"name":"a"}]}`, false},
	} {
		p, err := DecodeJSON([]byte(`{"metadata":{"namespace":"n","name":"p"},"spec":` + c.spec + `}`))
		if err != nil {
			t.Fatal(err)
		}
		if p.HostNetwork != c.want {
			t.Errorf("%s: HostNetwork %v, want %v", c.spec, p.HostNetwork, c.want)
		}
	}
}
