package nftables

import (
	"fmt"
	"regexp"
	"strings"
	"testing"

	"github.com/containernetworking/plugins/pkg/ns"
	"golang.org/x/sys/unix"

	"github.com/istio-cni-go/istio-cni/internal/nlsteps"
	"github.com/istio-cni-go/istio-cni/internal/nsfacts"
	"github.com/istio-cni-go/istio-cni/internal/redirect"
	"github.com/istio-cni-go/istio-cni/internal/ruleset"
	"github.com/istio-cni-go/istio-cni/internal/testenv"
	"github.com/istio-cni-go/istio-cni/internal/testutil"
)

// nsState is what a namespace holds of a pod's redirection, as an
// operator lists it: the nftables ruleset and the routing the rules need.
func nsState(t *testing.T, n ns.NetNS) string {
	t.Helper()
	testutil.WaitLocalRoutes(t, n)
	var b strings.Builder
	handles := regexp.MustCompile(` # handle \d+`)
	for _, cmd := range [][]string{
		{"nft", "list", "ruleset"},
		{"ip", "rule"}, {"ip", "-6", "rule"},
		{"ip", "route", "show", "table", "all"}, {"ip", "-6", "route", "show", "table", "all"},
		{"ip", "-6", "addr", "show", "dev", "lo"},
	} {
		b.WriteString("$ " + strings.Join(cmd, " ") + "\n")
		b.WriteString(handles.ReplaceAllString(testutil.RunIn(t, n, cmd...), ""))
	}
	return b.String()
}

// TestPrepareMatchesApply: for every rule set of the goldens and every
// long-list case, IPv4 only and dual stack, and lists of the sizes the
// issue names, the prepared transaction sent to a fresh namespace leaves
// it holding what Apply leaves in another, and CHECK passes there.
func TestPrepareMatchesApply(t *testing.T) {
	testutil.RequireRoot(t)
	testutil.RequireTools(t, "nft", "ip")
	type tc struct {
		name string
		plan func(v6 bool) *ruleset.Plan
	}
	var cases []tc
	for _, c := range testutil.RedirectCases {
		cases = append(cases, tc{c.Name, func(v6 bool) *ruleset.Plan { return planFor(t, c, v6) }})
	}
	for _, c := range testenv.ListCases() {
		cases = append(cases, tc{c.Name, func(v6 bool) *ruleset.Plan { return listPlan(t, c.Annotations, v6) }})
	}
	for _, size := range []int{1000, 5000} {
		l := testenv.Lists{N: size}
		ann := map[string]string{redirect.AnnotationExcludeOutboundCIDRs: l.CIDRs(), redirect.AnnotationExcludeOutboundPorts: l.Ports()}
		cases = append(cases, tc{fmt.Sprintf("size-%d", size), func(v6 bool) *ruleset.Plan { return listPlan(t, ann, v6) }})
	}
	for _, c := range cases {
		for _, v6 := range []bool{false, true} {
			name := c.name
			if v6 {
				name += "/dual"
			}
			t.Run(name, func(t *testing.T) {
				plan := c.plan(v6)
				a := &Applier{}
				direct := newNS(t)
				if _, err := a.Apply(direct.Path(), plan); err != nil {
					t.Fatal(err)
				}
				want := nsState(t, direct)
				pod := newNS(t)
				txn, why, err := a.Prepare(pod.Path(), plan)
				if err != nil || txn == nil {
					t.Fatalf("prepare: %v (%s)", err, why)
				}
				if err := pod.Do(func(ns.NetNS) error { return nlsteps.Run(txn) }); err != nil {
					t.Fatalf("sending: %v", err)
				}
				if got := nsState(t, pod); got != want {
					t.Fatalf("after the prepared requests the namespace holds\n%s\nApply leaves\n%s", got, want)
				}
				if err := a.Check(pod.Path(), plan); err != nil {
					t.Fatalf("check: %v", err)
				}
			})
		}
	}
}

// TestPrepareRefusesWhatItCannotExpress: a namespace holding tables of
// ours or a TPROXY policy rule gets Apply, named why, untouched by
// Prepare; a table of ours appearing between Prepare and the send fails
// the transaction whole.
func TestPrepareRefusesWhatItCannotExpress(t *testing.T) {
	testutil.RequireRoot(t)
	basic := planFor(t, testutil.RedirectCases[0], false)
	a := &Applier{}
	for _, c := range []struct {
		name  string
		setup []string
		why   string
	}{
		{"tables of ours", []string{"nft", "add", "table", "inet", TablePrefix + "nat"}, "tables of ours"},
		{"tproxy rule", []string{"ip", "rule", "add", "fwmark", "1337", "lookup", "133"}, "TPROXY policy rule"},
	} {
		t.Run(c.name, func(t *testing.T) {
			n := newNS(t)
			testutil.RunIn(t, n, c.setup...)
			before := nsState(t, n)
			txn, why, err := a.Prepare(n.Path(), basic)
			if err != nil || txn != nil || !strings.Contains(why, c.why) {
				t.Fatalf("got %v, %q, %v; want no transaction because %q", txn != nil, why, err, c.why)
			}
			if after := nsState(t, n); after != before {
				t.Fatalf("Prepare changed the namespace:\n%s\nwas\n%s", after, before)
			}
		})
	}
	t.Run("raced", func(t *testing.T) {
		n := newNS(t)
		txn, why, err := a.Prepare(n.Path(), basic)
		if err != nil || txn == nil {
			t.Fatalf("prepare: %v (%s)", err, why)
		}
		testutil.RunIn(t, n, "nft", "add", "table", "inet", TablePrefix+"nat")
		before := nsState(t, n)
		err = n.Do(func(ns.NetNS) error { return nlsteps.Run(txn) })
		if err == nil || !strings.Contains(err.Error(), "table inet "+TablePrefix+"nat: file exists") ||
			!strings.Contains(err.Error(), "nothing of it applied") {
			t.Fatalf("sending over a table made meanwhile: %v", err)
		}
		if after := nsState(t, n); after != before {
			t.Fatalf("a refused transaction changed the namespace:\n%s\nwas\n%s", after, before)
		}
	})
}

// TestUnfitIgnoresOthersTables: tables of other names or families (an
// iptables-nft table, another component's inet table) leave a namespace
// fit; ours or a TPROXY rule do not.
func TestUnfitIgnoresOthersTables(t *testing.T) {
	for _, c := range []struct {
		facts nsfacts.Facts
		want  string
	}{
		{nsfacts.Facts{Tables: []nsfacts.Table{{Family: unix.NFPROTO_IPV4, Name: TablePrefix + "nat"}, {Family: unix.NFPROTO_INET, Name: "filter"}}}, ""},
		{nsfacts.Facts{Tables: []nsfacts.Table{{Family: unix.NFPROTO_INET, Name: TablePrefix + "mangle"}}}, "tables of ours"},
		{nsfacts.Facts{TProxyRule: true}, "TPROXY"},
	} {
		if got := unfit(c.facts); (c.want == "") != (got == "") || !strings.Contains(got, c.want) {
			t.Errorf("%+v: %q, want %q", c.facts, got, c.want)
		}
	}
}

// TestPrepareHereBeyondRelayBound: a plan whose requests are more than a
// relay is handed (thousands of excluded interfaces, a rule each, dual
// stack) is still prepared for the process that sends them itself (the
// fallback), whole, where the agent's cache keeps only its size; sent
// into a fresh namespace in one batch, they leave what Apply leaves, and
// CHECK passes.
func TestPrepareHereBeyondRelayBound(t *testing.T) {
	testutil.RequireRoot(t)
	testutil.RequireTools(t, "nft", "ip")
	plan := listPlan(t, testenv.Lists{N: 7000}.ExcludeAnnotations(""), true)
	a := &Applier{}
	pod := newNS(t)
	facts, unfit, err := a.Examine(pod.Path())
	if err != nil || unfit != "" {
		t.Fatalf("examine a fresh namespace: %v (%s)", err, unfit)
	}
	if cached, _, err := a.PrepareFresh(facts, plan); err != nil || cached.Oversize <= nlsteps.MaxTxn {
		t.Fatalf("the agent's prepared requests: %v, oversize %d; want the plan over the relay's bound of %d bytes", err, cached.Oversize, nlsteps.MaxTxn)
	}
	txn, why, err := a.PrepareHere(facts, plan)
	if err != nil || txn == nil || why != "" {
		t.Fatalf("prepare here: %v (%s)", err, why)
	}
	if txn.Oversize != 0 || txn.Size() <= nlsteps.MaxTxn {
		t.Fatalf("prepared here: %d bytes, oversize %d; want the whole transaction, over %d bytes", txn.Size(), txn.Oversize, nlsteps.MaxTxn)
	}
	if err := pod.Do(func(ns.NetNS) error { return nlsteps.Run(txn) }); err != nil {
		t.Fatalf("sending %d bytes: %v", txn.Size(), err)
	}
	direct := newNS(t)
	if _, err := a.Apply(direct.Path(), plan); err != nil {
		t.Fatal(err)
	}
	if got, want := nsState(t, pod), nsState(t, direct); got != want {
		t.Fatalf("after the requests prepared here the namespace holds\n%.2000s\nApply leaves\n%.2000s", got, want)
	}
	if err := a.Check(pod.Path(), plan); err != nil {
		t.Fatalf("check: %.2000s", err)
	}
}
