package plugin

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"io"
	"strings"
	"testing"
	"time"

	"github.com/containernetworking/cni/pkg/skel"
	"github.com/containernetworking/cni/pkg/types"

	"github.com/istio-cni-go/istio-cni/internal/logging"
	"github.com/istio-cni-go/istio-cni/internal/nlsteps"
	"github.com/istio-cni-go/istio-cni/internal/podinfo"
	"github.com/istio-cni-go/istio-cni/internal/ruleset"
)

const dataplaneMode = "istio.io/dataplane-mode"

// fakeNamespaces is a NamespaceReader over fixed labels, counting its
// calls; err, when set, is every call's answer.
type fakeNamespaces struct {
	labels map[string]map[string]string
	err    error
	calls  []string
	// deadline is how far off the last call's deadline was (0: none).
	deadline time.Duration
}

func (f *fakeNamespaces) NamespaceLabels(ctx context.Context, namespace string) (map[string]string, error) {
	f.calls = append(f.calls, namespace)
	f.deadline = 0
	if d, ok := ctx.Deadline(); ok {
		f.deadline = time.Until(d)
	}
	if f.err != nil {
		return nil, f.err
	}
	return f.labels[namespace], nil
}

// plainPod is a pod without a sidecar, with labels.
func plainPod(ns, name string, labels map[string]string) *podinfo.Pod {
	return &podinfo.Pod{Namespace: ns, Name: name, UID: "uid-" + name, Labels: labels,
		Containers: []podinfo.Container{{Name: "app"}}}
}

// ambientConf is a chained entry with ambient_enabled; extra is spliced
// in as more keys (such as enablement_selectors).
func ambientConf(ambient bool, extra string) []byte {
	a := "false"
	if ambient {
		a = "true"
	}
	if extra != "" {
		extra = "," + extra
	}
	return []byte(`{"cniVersion":"1.0.0","name":"k8s-pod-network","type":"istio-cni","ambient_enabled":` + a +
		`,"exclude_namespaces":["kube-system"],"pod_namespace":"istio-system","k8s_request_timeout":"2s"` + extra +
		`,"prevResult":` + prevResultFor("1.0.0") + `}`)
}

func cniArgs(ns, name string) string {
	if ns == "" && name == "" {
		return ""
	}
	return "IgnoreUnknown=1;K8S_POD_NAMESPACE=" + ns + ";K8S_POD_NAME=" + name + ";K8S_POD_UID=uid-" + name
}

// sameJSON fails unless out is the previous result, whatever the spacing.
func samePrevResult(t *testing.T, out []byte) {
	t.Helper()
	var got, want any
	if err := json.Unmarshal(out, &got); err != nil {
		t.Fatalf("output %q is not a result: %v", out, err)
	}
	_ = json.Unmarshal([]byte(prevResultFor("1.0.0")), &want)
	gj, _ := json.Marshal(got)
	wj, _ := json.Marshal(want)
	if !bytes.Equal(gj, wj) {
		t.Fatalf("result is not prevResult:\n got %s\nwant %s", gj, wj)
	}
}

// cniCode is the CNI error code of err (0 when it is not a *types.Error).
func cniCode(err error) uint {
	var te *types.Error
	if errors.As(err, &te) {
		return te.Code
	}
	return 0
}

// TestFallbackRefusesEnrolledPods runs ADD in the fallback plugin (no
// Ambient hook) with ambient_enabled: a pod the selectors enrol fails
// with a message naming it and the reason; any other pod takes the
// sidecar path; a pod the policy keeps out costs no namespace read.
func TestFallbackRefusesEnrolledPods(t *testing.T) {
	ambientNS := map[string]string{dataplaneMode: "ambient"}
	readFails := errors.New("namespace read must not happen")
	cases := []struct {
		name      string
		ambient   bool
		extra     string // more config keys
		ns, pod   string
		obj       *podinfo.Pod
		nsLabels  map[string]string
		nsErr     error
		reason    string // FallbackReason
		wantErr   []string
		nsReads   int
		podReads  int
		wantRules int
	}{
		{name: "pod label enrols", ambient: true, ns: "default", pod: "web",
			obj: plainPod("default", "web", map[string]string{dataplaneMode: "ambient"}), reason: "no agent socket at /var/run/istio-cni/cni.sock",
			wantErr: []string{"pod default/web", "enrolled in the ambient mesh", "not serving", "no agent socket at /var/run/istio-cni/cni.sock"},
			nsReads: 1, podReads: 1},
		{name: "namespace label enrols", ambient: true, ns: "default", pod: "web",
			obj: plainPod("default", "web", nil), nsLabels: ambientNS, reason: "the agent did not answer in 10s",
			wantErr: []string{"pod default/web", "enrolled in the ambient mesh", "the agent did not answer in 10s"},
			nsReads: 1, podReads: 1},
		{name: "no fallback reason given", ambient: true, ns: "default", pod: "web",
			obj: plainPod("default", "web", nil), nsLabels: ambientNS,
			wantErr: []string{"pod default/web", "enrolled in the ambient mesh", "it did not answer"}, nsReads: 1, podReads: 1},
		{name: "pod opts out of an ambient namespace", ambient: true, ns: "default", pod: "web",
			obj: plainPod("default", "web", map[string]string{dataplaneMode: "none"}), nsLabels: ambientNS, nsReads: 1, podReads: 1},
		{name: "not selected", ambient: true, ns: "default", pod: "web",
			obj: plainPod("default", "web", map[string]string{"app": "web"}), nsLabels: map[string]string{"team": "a"}, nsReads: 1, podReads: 1},
		{name: "injected pod in an ambient namespace takes the sidecar path", ambient: true, ns: "default", pod: "web",
			obj: injected(nil), nsErr: readFails, podReads: 1, wantRules: 1},
		{name: "namespace read fails the ADD", ambient: true, ns: "default", pod: "web",
			obj: plainPod("default", "web", nil), nsErr: errors.New("dial tcp 10.96.0.1:443: connection refused"),
			wantErr: []string{"cannot read namespace default", "pod default/web", "connection refused"}, nsReads: 1, podReads: 1},
		{name: "namespace not found fails the ADD", ambient: true, ns: "default", pod: "web",
			obj: plainPod("default", "web", nil), nsErr: podinfo.ErrNotFound,
			wantErr: []string{"cannot read namespace default"}, nsReads: 1, podReads: 1},
		{name: "hostNetwork pod needs no namespace read", ambient: true, ns: "default", pod: "web",
			obj: func() *podinfo.Pod {
				p := plainPod("default", "web", map[string]string{dataplaneMode: "ambient"})
				p.HostNetwork = true
				return p
			}(), nsErr: readFails, podReads: 1},
		{name: "ztunnel's pod needs no namespace read", ambient: true, ns: "istio-system", pod: "ztunnel-x7k2p",
			obj: plainPod("istio-system", "ztunnel-x7k2p", map[string]string{"app": "ztunnel", dataplaneMode: "ambient"}), nsErr: readFails, podReads: 1},
		{name: "a pod labelled app=ztunnel elsewhere is enrolled", ambient: true, ns: "default", pod: "fake-ztunnel",
			obj: plainPod("default", "fake-ztunnel", map[string]string{"app": "ztunnel"}), nsLabels: ambientNS,
			wantErr: []string{"pod default/fake-ztunnel", "enrolled"}, nsReads: 1, podReads: 1},
		{name: "excluded namespace: nothing read", ambient: true, ns: "kube-system", pod: "coredns", nsErr: readFails},
		{name: "the agent's own pod: nothing read", ambient: true, ns: "istio-system", pod: "istio-cni-node-abcde", nsErr: readFails},
		{name: "not a Kubernetes pod: nothing read", ambient: true, nsErr: readFails},
		{name: "enablement_selectors [] enrols no pod", ambient: true, extra: `"enablement_selectors":[]`, ns: "default", pod: "web",
			obj: plainPod("default", "web", map[string]string{dataplaneMode: "ambient"}), nsLabels: ambientNS, podReads: 1, nsReads: -1},
		{name: "enablement_selectors null is Istio's default", ambient: true, extra: `"enablement_selectors":null`, ns: "default", pod: "web",
			obj: plainPod("default", "web", nil), nsLabels: ambientNS, wantErr: []string{"enrolled"}, nsReads: 1, podReads: 1},
		{name: "custom selectors enrol", ambient: true, extra: `"enablement_selectors":[{"podSelector":{"matchLabels":{"app":"web"}},"namespaceSelector":{}}]`,
			ns: "default", pod: "web", obj: plainPod("default", "web", map[string]string{"app": "web"}),
			wantErr: []string{"pod default/web", "enrolled"}, nsReads: 1, podReads: 1},
		{name: "custom selectors ignore the default's labels", ambient: true, extra: `"enablement_selectors":[{"podSelector":{"matchLabels":{"app":"web"}}}]`,
			ns: "default", pod: "web", obj: plainPod("default", "web", map[string]string{dataplaneMode: "ambient"}), nsLabels: ambientNS, nsReads: 1, podReads: 1},
		{name: "ambient disabled: no namespace read", ambient: false, ns: "default", pod: "web",
			obj: plainPod("default", "web", map[string]string{dataplaneMode: "ambient"}), nsErr: readFails, podReads: 1},
		{name: "ambient disabled, injected pod", ambient: false, ns: "default", pod: "web", obj: injected(nil), nsErr: readFails, podReads: 1, wantRules: 1},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			nsr := &fakeNamespaces{labels: map[string]map[string]string{c.ns: c.nsLabels}, err: c.nsErr}
			src := &fakeSource{pod: c.obj}
			if c.obj == nil {
				src.err = errors.New("the pod must not be read")
			}
			rules := &fakeRules{}
			var out bytes.Buffer
			p := &Plugin{Log: logging.New(io.Discard), Stdout: &out, Rules: rules, Namespaces: nsr, FallbackReason: c.reason,
				NewSource: func(*Config, string) (podinfo.Source, error) { return src, nil }}
			err := p.Add(&skel.CmdArgs{ContainerID: "c1", Netns: "/var/run/netns/x", IfName: "eth0",
				Args: cniArgs(c.ns, c.pod), StdinData: ambientConf(c.ambient, c.extra)})
			checkAdd(t, err, &out, c.wantErr)
			if c.nsReads >= 0 && len(nsr.calls) != c.nsReads {
				t.Errorf("namespace read %d times (%v), want %d", len(nsr.calls), nsr.calls, c.nsReads)
			}
			for _, ns := range nsr.calls {
				if ns != c.ns {
					t.Errorf("read namespace %q for a pod in %q", ns, c.ns)
				}
			}
			if len(nsr.calls) > 0 && (nsr.deadline <= 0 || nsr.deadline > 2*time.Second) {
				t.Errorf("the namespace read is not bounded by k8s_request_timeout (2s): deadline in %v", nsr.deadline)
			}
			if src.calls != c.podReads {
				t.Errorf("pod read %d times, want %d", src.calls, c.podReads)
			}
			if rules.applied != c.wantRules {
				t.Errorf("rules applied %d times, want %d", rules.applied, c.wantRules)
			}
		})
	}
}

// TestFallbackReadsNamespacesWithTheKubeconfig: without a Namespaces
// reader the fallback asks the API server with the agent's kubeconfig;
// when there is none, the enrolment cannot be decided and the ADD fails.
func TestFallbackReadsNamespacesWithTheKubeconfig(t *testing.T) {
	run := t.TempDir()
	p := &Plugin{Log: logging.New(io.Discard), Stdout: io.Discard, Rules: &fakeRules{},
		NewSource: func(*Config, string) (podinfo.Source, error) {
			return &fakeSource{pod: plainPod("default", "web", nil)}, nil
		}}
	conf := ambientConf(true, `"cni_agent_run_dir":"`+run+`"`)
	err := p.Add(&skel.CmdArgs{ContainerID: "c1", Netns: "/x", IfName: "eth0", Args: cniArgs("default", "web"), StdinData: conf})
	if err == nil || cniCode(err) != uint(types.ErrTryAgainLater) || !strings.Contains(err.Error(), "cannot read namespace default") ||
		!strings.Contains(err.Error(), "kubeconfig") {
		t.Fatalf("ADD without a kubeconfig to read the namespace: %v", err)
	}
}

// TestBadSelectorsAreAConfigError: with ambient_enabled, selectors that
// do not parse fail every command with code 7 naming the key; with
// ambient off they are not read (Istio writes [] then, and nothing
// uses them).
func TestBadSelectorsAreAConfigError(t *testing.T) {
	for _, sel := range []string{
		`[{"podSelecter":{"matchLabels":{"a":"b"}}}]`,
		`[{"podSelector":{"matchExpressions":[{"key":"a","operator":"Equals","values":["b"]}]}}]`,
		`[{"namespaceSelector":{"matchExpressions":[{"key":"a","operator":"In"}]}}]`,
		`[{"podSelector":{"matchLabels":{"bad key!":"x"}}}]`,
		`{"podSelector":{}}`,
		`"everything"`,
		`5`,
	} {
		conf := ambientConf(true, `"enablement_selectors":`+sel)
		_, err := ParseConfig(conf)
		var ce *ConfigError
		if !errors.As(err, &ce) || ce.Key != "enablement_selectors" {
			t.Errorf("%s: want a ConfigError for enablement_selectors, got %v", sel, err)
		}
		src := &fakeSource{pod: plainPod("default", "web", nil)}
		nsr := &fakeNamespaces{}
		var out bytes.Buffer
		p := &Plugin{Log: logging.New(io.Discard), Stdout: &out, Rules: &fakeRules{}, Namespaces: nsr,
			NewSource: func(*Config, string) (podinfo.Source, error) { return src, nil }}
		err = p.Add(&skel.CmdArgs{ContainerID: "c1", Netns: "/x", IfName: "eth0", Args: cniArgs("default", "web"), StdinData: conf})
		if cniCode(err) != uint(types.ErrInvalidNetworkConfig) || !strings.Contains(err.Error(), "enablement_selectors") {
			t.Errorf("%s: ADD: want code %d naming enablement_selectors, got %v", sel, types.ErrInvalidNetworkConfig, err)
		}
		if src.calls != 0 || len(nsr.calls) != 0 || out.Len() != 0 {
			t.Errorf("%s: a bad config read the pod %d times, namespaces %v, printed %q", sel, src.calls, nsr.calls, out.String())
		}
		if _, err := ParseConfig(ambientConf(false, `"enablement_selectors":`+sel)); err != nil {
			t.Errorf("%s with ambient off: %v", sel, err)
		}
	}
}

// hookRecorder is an Ambient hook answering enrolled and err, recording
// the pods it was asked about.
type hookRecorder struct {
	enrolled bool
	err      error
	asked    []string // namespace/name/uid
}

func (h *hookRecorder) hook(_ context.Context, a *K8sArgs) (bool, error) {
	h.asked = append(h.asked, string(a.K8S_POD_NAMESPACE)+"/"+string(a.K8S_POD_NAME)+"/"+string(a.K8S_POD_UID))
	return h.enrolled, h.err
}

// TestAmbientHook: in the agent the hook decides first: an enrolled pod
// gets the previous result and nothing else (no pod read, no rules, no
// commit); false takes the sidecar path and no refusal; its error fails
// the ADD with code 11; the pods skipped by name never reach it.
func TestAmbientHook(t *testing.T) {
	ambientNS := map[string]string{dataplaneMode: "ambient"}
	cases := []struct {
		name      string
		hook      hookRecorder
		ns, pod   string
		obj       *podinfo.Pod
		commit    bool // the relay commits (Plugin.Commit set)
		wantErr   []string
		asked     bool
		podReads  int
		wantRules int
		commits   int
	}{
		{name: "enrolled", hook: hookRecorder{enrolled: true}, ns: "default", pod: "web", obj: injected(nil), asked: true},
		{name: "enrolled, relay would commit", hook: hookRecorder{enrolled: true}, ns: "default", pod: "web", obj: injected(nil), commit: true, asked: true},
		{name: "not enrolled: sidecar path", hook: hookRecorder{}, ns: "default", pod: "web", obj: injected(nil), asked: true, podReads: 1, wantRules: 1},
		{name: "not enrolled: sidecar path through the relay", hook: hookRecorder{}, ns: "default", pod: "web", obj: injected(nil), commit: true,
			asked: true, podReads: 1, commits: 1},
		{name: "not enrolled: the agent's word stands, no refusal", hook: hookRecorder{}, ns: "default", pod: "web",
			obj: plainPod("default", "web", map[string]string{dataplaneMode: "ambient"}), asked: true, podReads: 1},
		{name: "hook error fails the ADD", hook: hookRecorder{err: errors.New("ztunnel is not connected after 5s")}, ns: "default", pod: "web",
			obj: injected(nil), asked: true, wantErr: []string{"ztunnel is not connected after 5s"}},
		{name: "the agent's own pod is not asked", hook: hookRecorder{enrolled: true, err: errors.New("asked")}, ns: "istio-system", pod: "istio-cni-node-abcde"},
		{name: "an excluded namespace is not asked", hook: hookRecorder{enrolled: true, err: errors.New("asked")}, ns: "kube-system", pod: "coredns"},
		{name: "a non-Kubernetes sandbox is not asked", hook: hookRecorder{enrolled: true, err: errors.New("asked")}},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			h := c.hook
			src := &fakeSource{pod: c.obj}
			if c.obj == nil {
				src.err = errors.New("the pod must not be read")
			}
			nsr := &fakeNamespaces{labels: map[string]map[string]string{"default": ambientNS}}
			rules := &fakeRules{}
			commits := 0
			var out bytes.Buffer
			p := &Plugin{Log: logging.New(io.Discard), Stdout: &out, Rules: rules, Namespaces: nsr, Ambient: h.hook,
				NewSource: func(*Config, string) (podinfo.Source, error) { return src, nil }}
			if c.commit {
				p.Commit = func(_ *nlsteps.Txn, result []byte) (nlsteps.Outcome, error) {
					commits++
					_, err := out.Write(result)
					return nlsteps.Outcome{}, err
				}
			}
			err := p.Add(&skel.CmdArgs{ContainerID: "c1", Netns: "/var/run/netns/x", IfName: "eth0",
				Args: cniArgs(c.ns, c.pod), StdinData: ambientConf(true, "")})
			checkAdd(t, err, &out, c.wantErr)
			if c.asked {
				if want := c.ns + "/" + c.pod + "/uid-" + c.pod; len(h.asked) != 1 || h.asked[0] != want {
					t.Errorf("hook asked about %v, want once about %s", h.asked, want)
				}
			} else if len(h.asked) != 0 {
				t.Errorf("hook asked about %v", h.asked)
			}
			if src.calls != c.podReads {
				t.Errorf("pod read %d times, want %d", src.calls, c.podReads)
			}
			if len(nsr.calls) != 0 {
				t.Errorf("the agent's plugin read namespaces itself: %v", nsr.calls)
			}
			if rules.applied != c.wantRules {
				t.Errorf("rules applied %d times, want %d", rules.applied, c.wantRules)
			}
			if commits != c.commits {
				t.Errorf("committed %d times, want %d", commits, c.commits)
			}
		})
	}
}

// checkRules is fakeRules counting its checks, which fail with err.
type checkRules struct {
	fakeRules
	checks int
	err    error
}

func (c *checkRules) Check(string, *ruleset.Plan) error {
	c.checks++
	if c.err != nil {
		return c.err
	}
	return nil
}

// TestAmbientCheck: CHECK of an enrolled pod is not the sidecar backend's
// (the agent's AmbientCheck answers it, the fallback leaves it to the
// agent); any other pod is checked as before; the ADD hook is never
// asked on DEL or CHECK.
func TestAmbientCheck(t *testing.T) {
	ambientNS := map[string]map[string]string{"default": {dataplaneMode: "ambient"}}
	cases := []struct {
		name      string
		check     *hookRecorder // AmbientCheck; nil: the fallback
		ns, pod   string
		obj       *podinfo.Pod
		nsErr     error
		wantCode  uint // 0: success
		wantErr   []string
		checked   bool // the hook was asked
		podReads  int
		nsReads   int
		ruleCheck int
	}{
		// The fallback checks sidecar pods only, and never needs the
		// namespace: an enrolled pod's redirection is the agent's to
		// check, and a pod neither enrolled nor injected gets no rules.
		{name: "fallback: enrolled pod is the agent's to check", ns: "default", pod: "web", obj: plainPod("default", "web", nil),
			nsErr: errors.New("the namespace must not be read"), podReads: 1},
		{name: "fallback: pod not enrolled gets no rules", ns: "default", pod: "web",
			obj: plainPod("default", "web", map[string]string{dataplaneMode: "none"}), podReads: 1},
		{name: "fallback: injected pod needs no namespace read", ns: "default", pod: "web", obj: injected(nil), podReads: 1, ruleCheck: 1},
		{name: "agent: enrolled and as it should be", check: &hookRecorder{enrolled: true}, ns: "default", pod: "web", checked: true},
		{name: "agent: enrolled, redirection differs", check: &hookRecorder{enrolled: true, err: errors.New("ztunnel has not acknowledged the pod")},
			ns: "default", pod: "web", checked: true, wantCode: uint(types.ErrInternal), wantErr: []string{"pod default/web", "ztunnel has not acknowledged the pod"}},
		{name: "agent: pod undecided (unreadable), CHECK passes as Istio's", check: &hookRecorder{err: errors.New("ambient mode: cannot read pod default/web")},
			ns: "default", pod: "web", checked: true},
		{name: "agent: not enrolled, sidecar check", check: &hookRecorder{}, ns: "default", pod: "web", obj: injected(nil), checked: true, podReads: 1, ruleCheck: 1},
		{name: "agent: excluded namespace not asked", check: &hookRecorder{enrolled: true, err: errors.New("asked")}, ns: "kube-system", pod: "dns"},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			src := &fakeSource{pod: c.obj}
			if c.obj == nil {
				src.err = errors.New("the pod must not be read")
			}
			nsr := &fakeNamespaces{labels: ambientNS, err: c.nsErr}
			rules := &checkRules{}
			add := &hookRecorder{enrolled: true, err: errors.New("the ADD hook was asked")}
			p := &Plugin{Log: logging.New(io.Discard), Stdout: io.Discard, Rules: rules, Namespaces: nsr, Ambient: add.hook,
				NewSource: func(*Config, string) (podinfo.Source, error) { return src, nil }}
			if c.check != nil {
				p.AmbientCheck = c.check.hook
			} else {
				p.Ambient = nil
			}
			args := &skel.CmdArgs{ContainerID: "c1", Netns: "/x", IfName: "eth0", Args: cniArgs(c.ns, c.pod), StdinData: ambientConf(true, "")}
			err := p.Check(args)
			if c.wantCode == 0 && err != nil {
				t.Fatalf("CHECK: %v", err)
			}
			if c.wantCode != 0 {
				if cniCode(err) != c.wantCode {
					t.Fatalf("CHECK: %v, want code %d", err, c.wantCode)
				}
				for _, w := range c.wantErr {
					if !strings.Contains(err.Error(), w) {
						t.Errorf("error %q does not say %q", err, w)
					}
				}
			}
			if c.check != nil && (len(c.check.asked) == 1) != c.checked {
				t.Errorf("check hook asked about %v", c.check.asked)
			}
			if src.calls != c.podReads || len(nsr.calls) != c.nsReads || rules.checks != c.ruleCheck {
				t.Errorf("pod reads %d (want %d), namespace reads %d (want %d), backend checks %d (want %d)",
					src.calls, c.podReads, len(nsr.calls), c.nsReads, rules.checks, c.ruleCheck)
			}
			if err := p.Del(args); err != nil {
				t.Fatalf("DEL: %v", err)
			}
			if len(add.asked) != 0 {
				t.Fatalf("the ADD hook asked on CHECK or DEL: %v", add.asked)
			}
		})
	}
}

// checkAdd: with wantErr, the ADD failed with code 11 (try again later),
// saying each of wantErr, and printed nothing; else it succeeded and
// printed the previous result.
func checkAdd(t *testing.T, err error, out *bytes.Buffer, wantErr []string) {
	t.Helper()
	if wantErr == nil {
		if err != nil {
			t.Fatalf("ADD: %v", err)
		}
		samePrevResult(t, out.Bytes())
		return
	}
	if err == nil {
		t.Fatalf("ADD succeeded, printing %s", out.String())
	}
	if code := cniCode(err); code != uint(types.ErrTryAgainLater) {
		t.Fatalf("CNI code %d, want %d (try again later): %v", code, types.ErrTryAgainLater, err)
	}
	for _, w := range wantErr {
		if !strings.Contains(err.Error(), w) {
			t.Errorf("error %q does not say %q", err, w)
		}
	}
	if out.Len() != 0 {
		t.Errorf("a failed ADD printed %q", out.String())
	}
}
