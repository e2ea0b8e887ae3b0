// Package podnet holds what every rule backend (iptables, nftables, and
// the ones to come) shares about a pod's network namespace and owns none
// of: the report of an apply, the routing the redirect rules rely on
// besides netfilter, and the pod's addresses. The backends depend on it,
// never on each other.
package podnet

import (
	"fmt"
	"strings"
	"time"

	"github.com/istio-cni-go/istio-cni/internal/ruleset"
)

// FamilyReport says what happened to one family.
type FamilyReport struct {
	Family  ruleset.Family
	Variant string
	// Action is "applied", "replaced", "unchanged", "removed" or "none".
	Action   string
	Duration time.Duration
	// Note says what else is worth knowing of the call, if anything.
	Note string
}

// NotePrepared is a FamilyReport's note when the rules went in as
// requests prepared for a fresh namespace, not applied in place.
const NotePrepared = "prepared"

// Report describes one Apply or Remove.
type Report struct {
	Families []FamilyReport
}

func (r Report) String() string {
	var parts []string
	for _, f := range r.Families {
		note := ""
		if f.Note != "" {
			note = "," + f.Note
		}
		parts = append(parts, fmt.Sprintf("%s:%s(%s,%s%s)", f.Family, f.Action, f.Variant, f.Duration.Round(10*time.Microsecond), note))
	}
	return strings.Join(parts, " ")
}
