package plugin

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"io"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/containernetworking/cni/pkg/skel"
	"github.com/containernetworking/cni/pkg/types"
	"github.com/containernetworking/cni/pkg/version"

	"github.com/istio-cni-go/istio-cni/internal/logging"
	"github.com/istio-cni-go/istio-cni/internal/podinfo"
	"github.com/istio-cni-go/istio-cni/internal/podnet"
	"github.com/istio-cni-go/istio-cni/internal/redirect"
)

// istioConf is the entry Istio's installer writes into a conflist today.
const istioConf = `{
  "ambient_enabled": false,
  "cni_agent_run_dir": "/var/run/istio-cni",
  "dns": {},
  "enable_ambient_detection_retry": false,
  "enablement_selectors": [],
  "exclude_namespaces": ["kube-system"],
  "ipam": {},
  "name": "istio-cni",
  "native_nftables": false,
  "plugin_log_level": "info",
  "pod_namespace": "istio-system",
  "type": "istio-cni",
  "cniVersion": "1.0.0",
  "some_future_key": {"x": 1}
}`

func TestParseIstioConfig(t *testing.T) {
	c, err := ParseConfig([]byte(istioConf))
	if err != nil {
		t.Fatal(err)
	}
	if c.PodNamespace != "istio-system" || c.ExcludeNamespaces[0] != "kube-system" || c.KubeconfigPath() != "/var/run/istio-cni/istio-cni-kubeconfig" {
		t.Fatalf("parsed %+v", c)
	}
	if c.requestTimeout != DefaultRequestTimeout || c.retryBudget != DefaultRetryBudget {
		t.Fatalf("defaults not applied: %v %v", c.requestTimeout, c.retryBudget)
	}
}

func TestConfigErrorsNameTheKey(t *testing.T) {
	cases := []struct{ json, key string }{
		{`{"type":"istio-cni","exclude_namespaces":"kube-system"}`, "exclude_namespaces"},
		{`{"type":"istio-cni","plugin_log_level":5}`, "plugin_log_level"},
		{`{"type":"istio-cni","cni_agent_run_dir":"relative/dir"}`, "cni_agent_run_dir"},
		{`{"type":"istio-cni","ambient_enabled":"yes"}`, "ambient_enabled"},
		{`{"type":"istio-cni","k8s_retry_budget":"forever"}`, "k8s_retry_budget"},
		{`{"type":"istio-cni","k8s_request_timeout":"-1s"}`, "k8s_request_timeout"},
		{`{"type":"istio-cni","cniVersion":"1.0.0","prevResult":{"ips":"nope"}}`, "prevResult"},
	}
	for _, c := range cases {
		_, err := ParseConfig([]byte(c.json))
		var ce *ConfigError
		if !errors.As(err, &ce) || ce.Key != c.key {
			t.Errorf("%s: want ConfigError for %q, got %v", c.json, c.key, err)
		}
	}
	if _, err := ParseConfig([]byte(`{"type":`)); err == nil {
		t.Error("malformed JSON accepted")
	}
}

// TestBlankExcludedNamespaces: Istio's older installers wrote [""] for an
// empty list; blank entries are dropped, not refused.
func TestBlankExcludedNamespaces(t *testing.T) {
	c, err := ParseConfig([]byte(`{"type":"istio-cni","exclude_namespaces":["", "kube-system", " "]}`))
	if err != nil || !slices.Equal(c.ExcludeNamespaces, []string{"kube-system"}) {
		t.Fatalf("%+v, %v", c, err)
	}
}

// TestCheckFailsOnlyOnWrongRules: CHECK fails when a redirected pod's
// rules differ, and otherwise succeeds where it cannot tell, as Istio's
// does: CRI-O fails the sandbox on a failed CHECK. A pod that gets no
// rules is not looked at (its istio-init's chains would fail a look), nor
// is one that cannot be read again.
func TestCheckFailsOnlyOnWrongRules(t *testing.T) {
	drifted := &podnet.MismatchError{Diffs: []string{"nat/ISTIO_OUTPUT: chain missing"}}
	cases := []struct {
		name      string
		pod       *podinfo.Pod
		readErr   error
		checkErr  error
		wantErr   bool
		ruleCheck int
	}{
		{name: "redirected pod, rules differ", pod: injected(nil), checkErr: drifted, wantErr: true, ruleCheck: 1},
		// The host's iptables tools missing: the rules cannot be read,
		// which says nothing of them (the ADD may have sent them without
		// those tools).
		{name: "redirected pod, rules unreadable", pod: injected(nil), checkErr: errors.New("no usable iptables found on the node: iptables-save not found"), ruleCheck: 1},
		{name: "pod with istio-init", pod: injected(func(p *podinfo.Pod) { p.InitContainers = []podinfo.Container{{Name: "istio-init"}} })},
		{name: "pod without a sidecar", pod: &podinfo.Pod{Namespace: "default", Name: "web", Containers: []podinfo.Container{{Name: "app"}}}},
		{name: "pod unreadable", readErr: errors.New("connection refused")},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			rules := &checkRules{err: c.checkErr}
			p := &Plugin{Log: logging.New(io.Discard), Stdout: io.Discard, Rules: rules,
				NewSource: func(*Config, string) (podinfo.Source, error) { return &fakeSource{pod: c.pod, err: c.readErr}, nil }}
			args := &skel.CmdArgs{ContainerID: "c1", Netns: "/x", IfName: "eth0", Args: cniArgs("default", "web"),
				StdinData: []byte(`{"type":"istio-cni","cniVersion":"1.0.0","k8s_retry_budget":"1ms","prevResult":` + prevResultFor("1.0.0") + `}`)}
			err := p.Check(args)
			if (err != nil) != c.wantErr || rules.checks != c.ruleCheck {
				t.Fatalf("CHECK: %v (want an error: %v); backend checks %d, want %d", err, c.wantErr, rules.checks, c.ruleCheck)
			}
			if c.wantErr && (cniCode(err) != uint(types.ErrInternal) || !strings.Contains(err.Error(), "chain missing")) {
				t.Fatalf("CHECK: %v", err)
			}
		})
	}
}

// TestDelAndGCTakeAnyConfig: a config an ADD refuses, naming the key,
// neither fails DEL (the pod would stay Terminating; Istio's DEL reads
// nothing) nor GC.
func TestDelAndGCTakeAnyConfig(t *testing.T) {
	conf := []byte(`{"type":"istio-cni","cniVersion":"1.1.0","k8s_retry_budget":"forever"}`)
	p := &Plugin{Log: logging.New(io.Discard), Stdout: io.Discard, Rules: &fakeRules{}}
	args := &skel.CmdArgs{ContainerID: "c1", Netns: "/x", IfName: "eth0", Args: cniArgs("default", "web"), StdinData: conf}
	if err := p.Add(args); err == nil || !strings.Contains(err.Error(), "k8s_retry_budget") {
		t.Fatalf("ADD: %v, want the key named", err)
	}
	if err := p.Del(args); err != nil {
		t.Fatalf("DEL: %v", err)
	}
	args.Args = "garbage"
	if err := p.Del(args); err != nil {
		t.Fatalf("DEL with CNI_ARGS it cannot read: %v", err)
	}
	if err := p.GC(args); err != nil {
		t.Fatalf("GC: %v", err)
	}
}

// Istio's tooling writes levels in many spellings, scoped lists among
// them; none may fail a pod (an unknown one is logged and taken as info).
func TestAnyLogLevelIsAccepted(t *testing.T) {
	for _, lv := range []string{"", "debug", "info", "warn", "error", "none", "fatal", "panic", "default:info",
		"cni:debug,default:warn", "default:info,cni-plugin:debug", "loud", "a:b:c"} {
		if _, err := ParseConfig([]byte(`{"type":"istio-cni","plugin_log_level":"` + lv + `"}`)); err != nil {
			t.Errorf("plugin_log_level %q: %v", lv, err)
		}
	}
}

func TestParseArgs(t *testing.T) {
	a, err := ParseArgs("IgnoreUnknown=1;K8S_POD_NAMESPACE=default;K8S_POD_NAME=web-0;K8S_POD_INFRA_CONTAINER_ID=abc;K8S_POD_UID=u1;OTHER=x")
	if err != nil || a.K8S_POD_NAME != "web-0" || a.K8S_POD_NAMESPACE != "default" {
		t.Fatal(a, err)
	}
	for _, bad := range []string{"garbage", "K8S_POD_NAME", "UNKNOWN_KEY=1"} {
		if _, err := ParseArgs(bad); err == nil {
			t.Errorf("CNI_ARGS %q accepted", bad)
		}
	}
}

type fakeSource struct {
	pod   *podinfo.Pod
	err   error
	calls int
}

func (f *fakeSource) GetPod(context.Context, string, string) (*podinfo.Pod, error) {
	f.calls++
	return f.pod, f.err
}

func injected(mut func(p *podinfo.Pod)) *podinfo.Pod {
	p := &podinfo.Pod{Namespace: "default", Name: "web",
		Annotations: map[string]string{redirect.AnnotationStatus: "{}"},
		Containers:  []podinfo.Container{{Name: "app"}, {Name: "istio-proxy", Args: []string{"proxy", "sidecar"}}}}
	if mut != nil {
		mut(p)
	}
	return p
}

func decide(t *testing.T, ns, name string, src *fakeSource) (*Decision, error) {
	t.Helper()
	conf, err := ParseConfig([]byte(istioConf))
	if err != nil {
		t.Fatal(err)
	}
	a := &K8sArgs{}
	if err := a.K8S_POD_NAMESPACE.UnmarshalText([]byte(ns)); err != nil {
		t.Fatal(err)
	}
	if err := a.K8S_POD_NAME.UnmarshalText([]byte(name)); err != nil {
		t.Fatal(err)
	}
	return Decide(context.Background(), conf, a, func(*Config, string) (podinfo.Source, error) { return src, nil })
}

func TestDecideOrder(t *testing.T) {
	// The agent's own pod and excluded namespaces never reach the API.
	for _, c := range []struct{ ns, name string }{
		{"istio-system", "istio-cni-node-x7k2p"}, {"kube-system", "coredns"}, {"", ""}, {"default", ""},
	} {
		src := &fakeSource{err: errors.New("must not be called")}
		d, err := decide(t, c.ns, c.name, src)
		if err != nil || d.Skip == "" || src.calls != 0 {
			t.Errorf("%s/%s: skip=%q err=%v calls=%d", c.ns, c.name, d.Skip, err, src.calls)
		}
	}
	// A pod named like the agent outside the agent's namespace is looked up.
	src := &fakeSource{pod: injected(nil)}
	if d, err := decide(t, "default", "istio-cni-node-fake", src); err != nil || d.Skip != "" || src.calls != 1 {
		t.Errorf("impostor agent pod: skip=%q err=%v", d.Skip, err)
	}
}

func TestDecideFailsClosed(t *testing.T) {
	_, err := decide(t, "default", "web", &fakeSource{err: podinfo.ErrNotFound})
	if err == nil || !strings.Contains(err.Error(), "default/web") {
		t.Fatalf("lookup failure must fail the pod and name it: %v", err)
	}
	_, err = decide(t, "default", "web", &fakeSource{pod: injected(func(p *podinfo.Pod) {
		p.Annotations[redirect.AnnotationIncludeInboundPorts] = "70000"
	})})
	if err == nil || !strings.Contains(err.Error(), redirect.AnnotationIncludeInboundPorts) || !strings.Contains(err.Error(), "70000") {
		t.Fatalf("bad annotation must fail naming it: %v", err)
	}
}

func TestExclusions(t *testing.T) {
	cases := []struct {
		name string
		mut  func(p *podinfo.Pod)
		skip string
	}{
		{"injected", nil, ""},
		{"native sidecar", func(p *podinfo.Pod) {
			p.InitContainers = []podinfo.Container{p.Containers[1]}
			p.Containers = p.Containers[:1]
		}, ""},
		{"istio-init", func(p *podinfo.Pod) { p.InitContainers = []podinfo.Container{{Name: "istio-init"}} }, "istio-init"},
		{"disable envoy", func(p *podinfo.Pod) { p.Containers[1].Env = map[string]string{"DISABLE_ENVOY": "true"} }, "DISABLE_ENVOY"},
		{"disable envoy false", func(p *podinfo.Pod) { p.Containers[1].Env = map[string]string{"DISABLE_ENVOY": "false"} }, ""},
		{"no proxy", func(p *podinfo.Pod) { p.Containers = p.Containers[:1] }, "no istio-proxy"},
		{"gateway", func(p *podinfo.Pod) { p.Containers[1].Args = []string{"proxy", "router"} }, "proxy type router"},
		{"inject annotation false", func(p *podinfo.Pod) { p.Annotations[redirect.AnnotationInject] = "false" }, "injection disabled"},
		{"inject label overrides annotation", func(p *podinfo.Pod) {
			p.Annotations[redirect.AnnotationInject] = "false"
			p.Labels = map[string]string{redirect.AnnotationInject: "true"}
		}, ""},
		{"inject unparseable ignored", func(p *podinfo.Pod) { p.Annotations[redirect.AnnotationInject] = "enabled" }, ""},
		{"no status", func(p *podinfo.Pod) { delete(p.Annotations, redirect.AnnotationStatus) }, "not injected"},
		{"interception NONE", func(p *podinfo.Pod) { p.Annotations[redirect.AnnotationInterceptionMode] = "NONE" }, "NONE"},
	}
	for _, c := range cases {
		d, err := decide(t, "default", "web", &fakeSource{pod: injected(c.mut)})
		if err != nil {
			t.Errorf("%s: %v", c.name, err)
			continue
		}
		if (c.skip == "") != (d.Skip == "") || !strings.Contains(d.Skip, c.skip) {
			t.Errorf("%s: skip=%q, want containing %q", c.name, d.Skip, c.skip)
		}
	}
}

func TestRetryingBudget(t *testing.T) {
	src := &fakeSource{err: errors.New("connection refused")}
	r := &podinfo.Retrying{Source: src, RequestTimeout: time.Second, Budget: 300 * time.Millisecond}
	start := time.Now()
	_, err := r.GetPod(context.Background(), "default", "web")
	if err == nil || !strings.Contains(err.Error(), "connection refused") || !strings.Contains(err.Error(), "attempts") {
		t.Fatalf("want a give-up error with the cause, got %v", err)
	}
	if took := time.Since(start); took > 2*time.Second {
		t.Fatalf("retry budget of 300ms took %s", took)
	}
	if src.calls < 2 {
		t.Fatalf("want retries, got %d calls", src.calls)
	}
	perm := &fakeSource{err: &podinfo.PermanentError{Err: errors.New("forbidden")}}
	r.Source = perm
	if _, err := r.GetPod(context.Background(), "default", "web"); err == nil || perm.calls != 1 {
		t.Fatalf("permanent errors must not be retried: %v, %d calls", err, perm.calls)
	}
}

func FuzzParseConfig(f *testing.F) {
	f.Add([]byte(istioConf))
	f.Add([]byte(`{"type":"istio-cni","cniVersion":"0.3.1","prevResult":{"cniVersion":"0.3.1","ips":[{"version":"4","address":"10.0.0.2/24"}]}}`))
	f.Add([]byte(`{"exclude_namespaces":[1]}`))
	f.Add([]byte(`{"cniVersion":"1.0.0","prevResult":{"ips":[{"address":"10.0.0.2/24","interface":0}],"interfaces":[{"name":"eth0"}]}}`))
	f.Add([]byte(`{"cniVersion":"0.4.0","prevResult":{"cniVersion":"0.3.1","ips":[{"version":"4","address":"10.0.0.2/24"}]}}`))
	f.Add([]byte(`{"cniVersion":"1.0.0","prevResult":{ }}`))
	f.Add([]byte(`{"cniVersion":"1.0.0","prevResult":[1]}`))
	f.Add([]byte(`{"cniVersion":"1.0.0","prevResult":null}`))
	f.Add([]byte(`{"cniVersion":"1.0.0","prevResult":{"ips":[{"address":"10.0.0.2/24","interface":0.0}],"interfaces":[{"name":"eth0","mtu":1e3}]}}`))
	f.Add([]byte(`{"cniVersion":"1.0.0","prevResult":{"CNIVersion":"","ips":[]}}`))
	f.Add([]byte(`{"cniVersion":"1.0.0","prevResult":{"CNIVersion":null}}`))
	f.Add([]byte(`{"cniVersion":"0.4.0","prevResult":{"cniVersion":"1.0.0","CNIVersion":"0.4.0"}}`))
	f.Fuzz(func(t *testing.T, data []byte) {
		c, err := ParseConfig(data)
		checkPrevResultAsLibrary(t, data, c, err)
		if err != nil {
			return
		}
		if !strings.HasPrefix(c.CNIAgentRunDir, "/") || c.requestTimeout <= 0 || c.retryBudget <= 0 {
			t.Fatalf("accepted an invalid config: %+v", c)
		}
	})
}

// checkPrevResultAsLibrary holds parsePrevResult to the CNI library's
// version.ParsePrevResult: for a config that otherwise parses, both read
// the same result, or both refuse it.
func checkPrevResultAsLibrary(t *testing.T, data []byte, c *Config, err error) {
	t.Helper()
	var lib types.NetConf
	if json.Unmarshal(data, &lib) != nil {
		return
	}
	var ce *ConfigError
	if err != nil && (!errors.As(err, &ce) || ce.Key != "prevResult") {
		return
	}
	libErr := version.ParsePrevResult(&lib)
	if (libErr == nil) != (err == nil) {
		t.Fatalf("%s: the library says %v, ParseConfig %v", data, libErr, err)
	}
	if err != nil {
		return
	}
	want, _ := json.Marshal(lib.PrevResult)
	got, _ := json.Marshal(c.PrevResult)
	if !bytes.Equal(want, got) {
		t.Fatalf("%s: prevResult read as\n %s, the library reads\n %s", data, got, want)
	}
}

// TestPrevResultAsLibrary: inputs a runtime does not write but a config
// could hold, read as the CNI library reads them.
func TestPrevResultAsLibrary(t *testing.T) {
	for _, data := range []string{
		`{"cniVersion":"1.0.0","prevResult":{"ips":[{"address":"10.0.0.2/24","interface":0.0}],"interfaces":[{"name":"eth0","mtu":1e3}]}}`,
		`{"cniVersion":"1.0.0","prevResult":{"CNIVersion":"","ips":[]}}`,
		`{"cniVersion":"1.0.0","prevResult":{"CNIVersion":null}}`,
		`{"cniVersion":"0.4.0","prevResult":{"cniVersion":"1.0.0","CNIVersion":"0.4.0"}}`,
		`{"cniVersion":"1.0.0","prevResult":{"cniVersion":"1.0.0","ips":[{"address":"10.0.0.2/24"}]}}`,
		`{"cniVersion":"0.3.1","prevResult":{"ips":[{"version":"4","address":"10.0.0.2/24"}]}}`,
	} {
		c, err := ParseConfig([]byte(data))
		checkPrevResultAsLibrary(t, []byte(data), c, err)
	}
}
