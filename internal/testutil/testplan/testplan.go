// Package testplan builds the rule plans of the shared redirect cases for
// the backend tests (a package of its own: package ruleset's own tests use
// package testutil, which must not import ruleset).
package testplan

import (
	"testing"

	"github.com/istio-cni-go/istio-cni/internal/redirect"
	"github.com/istio-cni-go/istio-cni/internal/ruleset"
	"github.com/istio-cni-go/istio-cni/internal/testutil"
)

// For builds the plan of a redirect case, with or without IPv6 rules.
func For(t testing.TB, c testutil.RedirectCase, v6 bool) *ruleset.Plan {
	t.Helper()
	p, _, err := redirect.FromPod(c.Pod())
	if err != nil {
		t.Fatal(err)
	}
	return ruleset.Build(p, v6)
}
