package enablement

import (
	"bytes"
	"encoding/json"
	"fmt"
	"strings"
	"testing"
)

const modeLabel = "istio.io/dataplane-mode"

// labelCase is one pod's labels and its namespace's, and whether the
// selectors under test enrol it.
type labelCase struct {
	name      string
	pod, ns   map[string]string
	wantMatch bool
}

func ls(kv ...string) map[string]string {
	m := map[string]string{}
	for i := 0; i+1 < len(kv); i += 2 {
		m[kv[i]] = kv[i+1]
	}
	return m
}

// defaultCases are Istio's default selectors' answers: the pod's label
// enrols it; the namespace's does unless the pod's says none.
var defaultCases = []labelCase{
	{"pod label ambient", ls(modeLabel, "ambient"), nil, true},
	{"pod label ambient, namespace none", ls(modeLabel, "ambient"), ls(modeLabel, "none"), true},
	{"namespace label ambient", ls("app", "web"), ls(modeLabel, "ambient"), true},
	{"namespace ambient, pod without labels", nil, ls(modeLabel, "ambient"), true},
	{"namespace ambient, pod opts out", ls(modeLabel, "none"), ls(modeLabel, "ambient"), false},
	{"namespace ambient, pod other mode", ls(modeLabel, "sidecar"), ls(modeLabel, "ambient"), true},
	{"neither labelled", ls("app", "web"), ls("team", "a"), false},
	{"nothing at all", nil, nil, false},
	{"pod opts out, namespace unlabelled", ls(modeLabel, "none"), nil, false},
	{"namespace other mode", nil, ls(modeLabel, "sidecar"), false},
	{"label value is case sensitive", ls(modeLabel, "Ambient"), ls(modeLabel, "AMBIENT"), false},
	{"label on the wrong side", ls("ns-label", "x"), ls("app", "web", modeLabel+"x", "ambient"), false},
}

func checkCases(t *testing.T, what string, s *Selectors, cases []labelCase) {
	t.Helper()
	for _, c := range cases {
		if got := s.Match(c.pod, c.ns); got != c.wantMatch {
			t.Errorf("%s: %s: pod %v in namespace %v: match=%v, want %v", what, c.name, c.pod, c.ns, got, c.wantMatch)
		}
	}
}

// TestDefaultSelectors: Default, DefaultYAML, and every spelling of
// "no selectors given" are Istio's default.
func TestDefaultSelectors(t *testing.T) {
	checkCases(t, "Default()", Default(), defaultCases)
	for _, text := range []string{"", "   \n\t", "null", " null\n", DefaultYAML} {
		s, err := Parse(text)
		if err != nil {
			t.Fatalf("Parse(%q): %v", text, err)
		}
		checkCases(t, "Parse("+strings.TrimSpace(text)+")", s, defaultCases)
	}
	if n := len(Default().Source()); n != 2 {
		t.Fatalf("Istio's default has two selectors, got %d", n)
	}
}

// TestEmptyListEnrolsNoPod: "[]" (what Istio's installer writes with
// ambient off) selects nothing, whatever the labels.
func TestEmptyListEnrolsNoPod(t *testing.T) {
	for _, text := range []string{"[]", " [ ] ", "[]\n"} {
		s, err := Parse(text)
		if err != nil {
			t.Fatalf("Parse(%q): %v", text, err)
		}
		var none []labelCase
		for _, c := range defaultCases {
			c.wantMatch = false
			none = append(none, c)
		}
		checkCases(t, "Parse("+text+")", s, none)
		if src := s.Source(); len(src) != 0 {
			t.Fatalf("Parse(%q).Source() = %+v", text, src)
		}
	}
}

// customYAML exercises every operator, matchLabels with several keys,
// and an entry with only a namespace selector.
const customYAML = `
- podSelector:
    matchLabels: {app: web, tier: front}
  namespaceSelector:
    matchExpressions:
      - {key: team, operator: In, values: [a, b]}
- namespaceSelector:
    matchExpressions:
      - {key: mesh, operator: Exists}
      - {key: legacy, operator: DoesNotExist}
- podSelector:
    matchExpressions:
      - {key: env, operator: NotIn, values: [dev, test]}
      - {key: env, operator: Exists}
  namespaceSelector:
    matchLabels: {prod: "true"}
`

var customCases = []labelCase{
	{"first entry", ls("app", "web", "tier", "front"), ls("team", "b"), true},
	{"first entry, extra labels", ls("app", "web", "tier", "front", "x", "y"), ls("team", "a", "z", "1"), true},
	{"first entry, one label missing", ls("app", "web"), ls("team", "a"), false},
	{"first entry, namespace not in set", ls("app", "web", "tier", "front"), ls("team", "c"), false},
	{"second entry: any pod in a mesh namespace", nil, ls("mesh", ""), true},
	{"second entry: legacy namespace excluded", ls("app", "web"), ls("mesh", "1", "legacy", "1"), false},
	{"third entry", ls("env", "prod"), ls("prod", "true"), true},
	{"third entry, env dev", ls("env", "dev"), ls("prod", "true"), false},
	{"third entry, no env label", ls("app", "x"), ls("prod", "true"), false},
	{"third entry, namespace not prod", ls("env", "prod"), ls("prod", "false"), false},
	{"default's labels mean nothing here", ls(modeLabel, "ambient"), ls(modeLabel, "ambient"), false},
}

func TestCustomSelectors(t *testing.T) {
	s, err := Parse(customYAML)
	if err != nil {
		t.Fatal(err)
	}
	checkCases(t, "custom", s, customCases)
	// An entry with both selectors empty enrols every pod.
	all, err := Parse(`[{}]`)
	if err != nil {
		t.Fatal(err)
	}
	for _, c := range defaultCases {
		if !all.Match(c.pod, c.ns) {
			t.Errorf("[{}]: %s not matched", c.name)
		}
	}
}

// TestSourceRoundTripsAsJSON: the agent writes Source() as JSON into the
// plugin's entry and the plugin parses that JSON; both must select the
// same pods, whatever form the operator wrote the selectors in.
func TestSourceRoundTripsAsJSON(t *testing.T) {
	matrix := append(append([]labelCase(nil), defaultCases...), customCases...)
	for _, tc := range []struct{ name, text string }{
		{"default (empty)", ""},
		{"default yaml", DefaultYAML},
		{"custom", customYAML},
		{"empty list", "[]"},
		{"match everything", "[{}]"},
		{"json input", `[{"podSelector":{"matchLabels":{"app":"web"}},"namespaceSelector":{"matchExpressions":[{"key":"team","operator":"NotIn","values":["x"]}]}}]`},
		// YAML's own spellings of an empty document: Istio reads them as
		// no selectors at all, and so must the plugin reading the entry.
		{"yaml null", "~"},
		{"comment only", "# no selectors yet"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			orig, err := Parse(tc.text)
			if err != nil {
				t.Fatal(err)
			}
			js, err := json.Marshal(orig.Source())
			if err != nil {
				t.Fatal(err)
			}
			back, err := Parse(string(js))
			if err != nil {
				t.Fatalf("the JSON form %s does not parse: %v", js, err)
			}
			var differ []string
			for _, c := range matrix {
				if a, b := orig.Match(c.pod, c.ns), back.Match(c.pod, c.ns); a != b {
					differ = append(differ, fmt.Sprintf("%s (text %v, JSON %v)", c.name, a, b))
				}
			}
			if len(differ) > 0 {
				t.Errorf("parsed from %q and from its JSON form %s, the selectors disagree on:\n%s", tc.text, js, strings.Join(differ, "\n"))
			}
			// The JSON is stable: a second round gives the same bytes.
			js2, err := json.Marshal(back.Source())
			if err != nil || !bytes.Equal(js2, js) {
				t.Errorf("second round: %s, first %s (%v)", js2, js, err)
			}
		})
	}
}

// TestDefaultJSONIsIstios: the default's JSON form, as it goes into the
// conflist, is the one Istio's chart yields (the empty namespace selector
// of the first entry spelt out, as Istio's non-pointer field marshals).
func TestDefaultJSONIsIstios(t *testing.T) {
	js, err := json.Marshal(Default().Source())
	if err != nil {
		t.Fatal(err)
	}
	want := `[{"podSelector":{"matchLabels":{"istio.io/dataplane-mode":"ambient"}},"namespaceSelector":{}},` +
		`{"podSelector":{"matchExpressions":[{"key":"istio.io/dataplane-mode","operator":"NotIn","values":["none"]}]},` +
		`"namespaceSelector":{"matchLabels":{"istio.io/dataplane-mode":"ambient"}}}]`
	if string(js) != want {
		t.Fatalf("default as JSON:\n got %s\nwant %s", js, want)
	}
}

// TestSourceIsACopy: changing what Source returned changes neither the
// next Source nor the compiled selectors.
func TestSourceIsACopy(t *testing.T) {
	s := Default()
	src := s.Source()
	src[0] = Selector{}
	if s.Source()[0].PodSelector.MatchLabels[modeLabel] != "ambient" {
		t.Fatal("Source shares its slice with the selectors")
	}
	if s.Match(ls("app", "x"), nil) {
		t.Fatal("the compiled selectors changed with Source's copy")
	}
}

// TestParseRefuses: unknown keys (strict, so a misspelling cannot widen
// the selection), bad operators, and what the label library refuses,
// each with an error saying where.
func TestParseRefuses(t *testing.T) {
	for _, c := range []struct {
		name, text string
		want       []string
	}{
		{"misspelt namespaceSelector", "- podSelector: {matchLabels: {a: b}}\n  namespaceSelecter: {matchLabels: {c: d}}", []string{"namespaceSelecter"}},
		{"misspelt matchLabels", "- podSelector: {matchLabel: {a: b}}", []string{"matchLabel"}},
		{"unknown requirement key", `[{"podSelector":{"matchExpressions":[{"key":"a","operator":"Exists","value":["x"]}]}}]`, []string{"value"}},
		{"bad operator", "- podSelector:\n    matchExpressions: [{key: a, operator: Equals, values: [b]}]", []string{"selector 1", "podSelector", `"Equals"`}},
		{"operator case", "- {}\n- namespaceSelector:\n    matchExpressions: [{key: a, operator: in, values: [b]}]", []string{"selector 2", "namespaceSelector", `"in"`}},
		{"In without values", "- podSelector:\n    matchExpressions: [{key: a, operator: In}]", []string{"selector 1", "podSelector"}},
		{"Exists with values", "- namespaceSelector:\n    matchExpressions: [{key: a, operator: Exists, values: [b]}]", []string{"namespaceSelector"}},
		{"invalid label key", "- podSelector: {matchLabels: {'bad key!': x}}", []string{"podSelector", "bad key!"}},
		{"invalid label value", "- podSelector: {matchLabels: {app: 'a b'}}", []string{"podSelector", "a b"}},
		{"not a list", "podSelector: {}", []string{"ambient enablement selectors"}},
		{"a string", `"everything"`, []string{"ambient enablement selectors"}},
		{"broken yaml", "- podSelector: {matchLabels: [", []string{"ambient enablement selectors"}},
		{"wrong type", `[{"podSelector":{"matchLabels":["a"]}}]`, []string{"ambient enablement selectors"}},
	} {
		_, err := Parse(c.text)
		if err == nil {
			t.Errorf("%s: %q accepted", c.name, c.text)
			continue
		}
		for _, w := range c.want {
			if !strings.Contains(err.Error(), w) {
				t.Errorf("%s: error %q does not say %q", c.name, err, w)
			}
		}
	}
}

// TestExclusionOrder: the reasons that keep a pod out whatever its
// labels, in Istio's order; the first that applies is the one given.
func TestExclusionOrder(t *testing.T) {
	policy := Policy{ExcludeNamespaces: []string{"kube-system", "excluded"}, SystemNamespace: "istio-system"}
	sidecar := map[string]string{"sidecar.istio.io/status": "{}"}
	for _, c := range []struct {
		name string
		pod  Pod
		want string // "" or a substring of the reason
	}{
		{"plain pod", Pod{Namespace: "default", Name: "web"}, ""},
		{"hostNetwork", Pod{Namespace: "default", Name: "web", HostNetwork: true}, "hostNetwork"},
		{"hostNetwork beats sidecar", Pod{Namespace: "default", Name: "web", HostNetwork: true, Annotations: sidecar}, "hostNetwork"},
		{"sidecar", Pod{Namespace: "default", Name: "web", Annotations: sidecar}, "sidecar.istio.io/status"},
		{"empty status annotation still a sidecar", Pod{Namespace: "default", Name: "web", Annotations: map[string]string{"sidecar.istio.io/status": ""}}, "sidecar"},
		{"other annotations", Pod{Namespace: "default", Name: "web", Annotations: map[string]string{"sidecar.istio.io/inject": "true"}}, ""},
		{"sidecar beats excluded namespace", Pod{Namespace: "kube-system", Name: "dns", Annotations: sidecar}, "sidecar"},
		{"excluded namespace", Pod{Namespace: "excluded", Name: "web"}, "namespace excluded is excluded"},
		{"excluded namespace beats agent's namespace rules", Pod{Namespace: "kube-system", Name: "istio-cni-node-abc"}, "namespace kube-system"},
		{"agent's own pod", Pod{Namespace: "istio-system", Name: "istio-cni-node-x7k2p"}, "CNI node agent"},
		{"agent's pod beats ztunnel label", Pod{Namespace: "istio-system", Name: "istio-cni-node-x", Labels: ls("app", "ztunnel")}, "CNI node agent"},
		{"ztunnel", Pod{Namespace: "istio-system", Name: "ztunnel-abcde", Labels: ls("app", "ztunnel")}, "ztunnel"},
		{"agent-named pod elsewhere", Pod{Namespace: "default", Name: "istio-cni-node-fake"}, ""},
		{"ztunnel-labelled pod elsewhere", Pod{Namespace: "default", Name: "z", Labels: ls("app", "ztunnel")}, ""},
		{"other pod in the system namespace", Pod{Namespace: "istio-system", Name: "istiod-1", Labels: ls("app", "istiod")}, ""},
	} {
		got := policy.Exclusion(c.pod)
		if (c.want == "") != (got == "") || !strings.Contains(got, c.want) {
			t.Errorf("%s: exclusion %q, want containing %q", c.name, got, c.want)
		}
	}
	// Without a system namespace, no pod is the agent's or ztunnel's.
	open := Policy{}
	for _, p := range []Pod{{Namespace: "istio-system", Name: "istio-cni-node-x"}, {Namespace: "istio-system", Name: "z", Labels: ls("app", "ztunnel")}} {
		if r := open.Exclusion(p); r != "" {
			t.Errorf("no system namespace: %s/%s excluded: %q", p.Namespace, p.Name, r)
		}
	}
}

// TestDecide: exclusions first (whatever the labels), then the
// selectors, nil meaning Istio's default.
func TestDecide(t *testing.T) {
	custom, err := Parse(`[{"podSelector":{"matchLabels":{"app":"web"}}}]`)
	if err != nil {
		t.Fatal(err)
	}
	none, err := Parse("[]")
	if err != nil {
		t.Fatal(err)
	}
	ambientNS := ls(modeLabel, "ambient")
	for _, c := range []struct {
		name   string
		policy Policy
		pod    Pod
		ns     map[string]string
		enrol  bool
		reason string
	}{
		{"default, namespace enrolled", Policy{}, Pod{Namespace: "a", Name: "p"}, ambientNS, true, "matches"},
		{"default, pod enrolled", Policy{}, Pod{Namespace: "a", Name: "p", Labels: ls(modeLabel, "ambient")}, nil, true, "matches"},
		{"default, pod opts out", Policy{}, Pod{Namespace: "a", Name: "p", Labels: ls(modeLabel, "none")}, ambientNS, false, "no enablement selector"},
		{"default, hostNetwork", Policy{}, Pod{Namespace: "a", Name: "p", HostNetwork: true, Labels: ls(modeLabel, "ambient")}, ambientNS, false, "hostNetwork"},
		{"default, sidecar", Policy{}, Pod{Namespace: "a", Name: "p", Annotations: map[string]string{"sidecar.istio.io/status": "{}"}}, ambientNS, false, "sidecar"},
		{"excluded namespace", Policy{ExcludeNamespaces: []string{"a"}}, Pod{Namespace: "a", Name: "p", Labels: ls(modeLabel, "ambient")}, ambientNS, false, "excluded"},
		{"ztunnel", Policy{SystemNamespace: "istio-system"}, Pod{Namespace: "istio-system", Name: "ztunnel-1", Labels: ls("app", "ztunnel", modeLabel, "ambient")}, ambientNS, false, "ztunnel"},
		{"custom selects", Policy{Selectors: custom}, Pod{Namespace: "a", Name: "p", Labels: ls("app", "web")}, nil, true, "matches"},
		{"custom ignores the default's labels", Policy{Selectors: custom}, Pod{Namespace: "a", Name: "p", Labels: ls(modeLabel, "ambient")}, ambientNS, false, "no enablement selector"},
		{"no selectors", Policy{Selectors: none}, Pod{Namespace: "a", Name: "p", Labels: ls(modeLabel, "ambient")}, ambientNS, false, "no enablement selector"},
	} {
		d := c.policy.Decide(c.pod, c.ns)
		if d.Enrol != c.enrol || !strings.Contains(d.Reason, c.reason) {
			t.Errorf("%s: %+v, want enrol=%v with a reason containing %q", c.name, d, c.enrol, c.reason)
		}
	}
}
