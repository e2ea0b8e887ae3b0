package nftables

import (
	"strings"
	"testing"

	"github.com/containernetworking/plugins/pkg/ns"
	"github.com/google/nftables"

	"github.com/istio-cni-go/istio-cni/internal/ruleset"
	"github.com/istio-cni-go/istio-cni/internal/testutil"
	"github.com/istio-cni-go/istio-cni/internal/testutil/testplan"
)

func newNS(t *testing.T) ns.NetNS { return testutil.NewNS(t) }

func planFor(t *testing.T, c testutil.RedirectCase, v6 bool) *ruleset.Plan {
	return testplan.For(t, c, v6)
}

func tablesIn(t *testing.T, n ns.NetNS) []string {
	t.Helper()
	var names []string
	if err := n.Do(func(ns.NetNS) error {
		conn, err := nftables.New()
		if err != nil {
			return err
		}
		tables, err := conn.ListTables()
		for _, tb := range tables {
			names = append(names, tb.Name)
		}
		return err
	}); err != nil {
		t.Fatal(err)
	}
	return names
}

// TestApplyEveryCase: the kernel accepts every case, reads back equal (so
// re-ADD is a no-op and CHECK passes), replacement leaves only the new
// rules, and removal leaves nothing.
func TestApplyEveryCase(t *testing.T) {
	testutil.RequireRoot(t)
	other := planFor(t, testutil.RedirectCases[0], true)
	a := &Applier{}
	for _, v6 := range []bool{false, true} {
		for _, c := range testutil.RedirectCases {
			name := c.Name
			if v6 {
				name += "/v6"
			}
			t.Run(name, func(t *testing.T) {
				n := newNS(t)
				plan := planFor(t, c, v6)
				if _, err := a.Apply(n.Path(), plan); err != nil {
					t.Fatal(err)
				}
				if err := a.Check(n.Path(), plan); err != nil {
					t.Fatalf("check after apply: %v", err)
				}
				rep, err := a.Apply(n.Path(), plan)
				if err != nil {
					t.Fatal(err)
				}
				if act := rep.Families[0].Action; act != "unchanged" && act != "none" {
					t.Fatalf("second apply: %s", rep)
				}
				if _, err := a.Apply(n.Path(), other); err != nil {
					t.Fatalf("replacing: %v", err)
				}
				if err := a.Check(n.Path(), other); err != nil {
					t.Fatalf("check after replace: %v", err)
				}
				if _, err := a.Remove(n.Path()); err != nil {
					t.Fatal(err)
				}
				for _, tb := range tablesIn(t, n) {
					if strings.HasPrefix(tb, TablePrefix) {
						t.Fatalf("table %s left after remove", tb)
					}
				}
			})
		}
	}
}

func TestCheckDetectsTampering(t *testing.T) {
	testutil.RequireRoot(t)
	n := newNS(t)
	a := &Applier{}
	plan := planFor(t, testutil.RedirectCases[0], false)
	if _, err := a.Apply(n.Path(), plan); err != nil {
		t.Fatal(err)
	}
	if err := n.Do(func(ns.NetNS) error {
		conn, err := nftables.New()
		if err != nil {
			return err
		}
		tb := &nftables.Table{Name: "istio-proxy-nat", Family: nftables.TableFamilyINet}
		ch := &nftables.Chain{Name: "istio-output", Table: tb}
		rules, err := conn.GetRules(tb, ch)
		if err != nil {
			return err
		}
		if err := conn.DelRule(rules[len(rules)-1]); err != nil {
			return err
		}
		return conn.Flush()
	}); err != nil {
		t.Fatal(err)
	}
	err := a.Check(n.Path(), plan)
	if err == nil || !strings.Contains(err.Error(), "istio-output") {
		t.Fatalf("check after deleting a rule: %v", err)
	}
	rep, err := a.Apply(n.Path(), plan)
	if err != nil || rep.Families[0].Action != "replaced" {
		t.Fatalf("re-apply over a tampered table: %v %v", rep, err)
	}
	if err := a.Check(n.Path(), plan); err != nil {
		t.Fatal(err)
	}
}
