package iptables

import (
	"errors"
	"fmt"
	"regexp"
	"sort"
	"strconv"
	"strings"

	"github.com/istio-cni-go/istio-cni/internal/ruleset"
)

// setSync is one call's view of, and work on, the namespace's ipsets.
// The rules switch from old sets to new ones in their iptables-restore
// transaction: new sets are made (under new names, as a set's name
// follows its contents) before it, old ones destroyed after it, so the
// rules never match a set that is half-filled or gone.
type setSync struct {
	client *ipsetClient
	// have is what the namespace held before this call.
	have    map[string]*ruleset.IPSet
	want    map[string]bool
	created []string
	// changed names the sets created or refilled by this call.
	changed map[string]bool
}

func (ss *setSync) close() {
	if ss.client != nil {
		ss.client.close()
	}
}

// referencesSets reports whether rules of ours match against sets.
func (st *State) referencesSets() bool {
	for _, chains := range []map[string]map[string][][]string{st.Chains, st.Builtin} {
		for _, rules := range chains {
			for _, rs := range rules {
				for _, r := range rs {
					if strings.Contains(strings.Join(r, " "), "--match-set "+ruleset.SetPrefix) {
						return true
					}
				}
			}
		}
	}
	return false
}

// prepareSets decides the plan the namespace gets and reads its sets.
// Sets are only looked at when the plan has some or our rules use some,
// so a pod with short lists never touches ipset. Where the kernel cannot
// make the plan's sets (no ipset support), the plan's long lists are
// written out one rule per entry instead: slower to apply, same effect.
func (a *Applier) prepareSets(plan *ruleset.Plan, states []*State) (*ruleset.Plan, *setSync, error) {
	ss := &setSync{want: map[string]bool{}, changed: map[string]bool{}}
	want := plan.IPSets()
	refs := false
	for _, st := range states {
		refs = refs || st.referencesSets()
	}
	if len(want) == 0 && !refs {
		return plan, ss, nil
	}
	if len(want) > 0 && a.expandSets {
		return plan.Expanded(), ss, nil
	}
	c, err := dialIPSet()
	if err != nil {
		if refs {
			return nil, nil, err
		}
		return plan.Expanded(), ss, nil
	}
	ss.client = c
	if len(want) > 0 {
		if err := c.supports(want); err != nil {
			if !refs {
				c.close()
				ss.client = nil
				return plan.Expanded(), ss, nil
			}
			plan, want = plan.Expanded(), nil
		}
	}
	if ss.have, err = c.list(); err != nil {
		c.close()
		return nil, nil, err
	}
	for _, w := range want {
		ss.want[w.Name] = true
	}
	for _, st := range states {
		st.IPSets = ss.have
	}
	return plan, ss, nil
}

// ensure makes every wanted set hold exactly its entries: new ones are
// created and filled, one whose contents were changed behind our back
// is refilled.
func (ss *setSync) ensure(plan *ruleset.Plan) error {
	for _, w := range plan.IPSets() {
		h := ss.have[w.Name]
		var err error
		switch {
		case h == nil:
			// Counted as made before its fill, which the kernel can
			// refuse: the undo destroys it too.
			if err = ss.client.make(w); err == nil {
				ss.created = append(ss.created, w.Name)
				err = ss.client.fill(w)
			}
		case !h.SameContents(w):
			err = ss.client.flushAndFill(w)
		default:
			continue
		}
		if err != nil {
			ss.undo()
			return fmt.Errorf("programming the set for %s (%d entries, ipset %s): %w", w.Origin, w.Listed, w.Name, err)
		}
		ss.changed[w.Name] = true
	}
	return nil
}

// undo destroys the sets this call created: after a failure the
// namespace holds what it held before.
func (ss *setSync) undo() {
	for _, name := range ss.created {
		_ = ss.client.destroy(name)
	}
	ss.created = nil
}

// dropStale destroys our sets no rule of the plan uses any more. One
// that something still uses (rules of ours in the other iptables
// variant, left by an older plugin) stays: it is harmless, and the next
// call tries again.
func (ss *setSync) dropStale() error {
	if ss.client == nil {
		return nil
	}
	names := make([]string, 0, len(ss.have))
	for name := range ss.have {
		if !ss.want[name] {
			names = append(names, name)
		}
	}
	sort.Strings(names)
	for _, name := range names {
		if err := ss.client.destroy(name); err != nil && !errors.Is(err, errSetInUse) {
			return fmt.Errorf("destroying ipset %s: %w", name, err)
		}
	}
	return nil
}

// diffSets lists the sets the set's rules need that the namespace lacks
// or holds with other entries.
func diffSets(st *State, set *ruleset.Set) []string {
	var diffs []string
	for _, w := range set.IPSets {
		h := st.IPSets[w.Name]
		switch {
		case h == nil:
			diffs = append(diffs, fmt.Sprintf("ipset %s (from %s, %d entries) missing", w.Name, w.Origin, w.Len()))
		case !h.SameContents(w):
			diffs = append(diffs, fmt.Sprintf("ipset %s holds %d entries, want %d (from %s)%s", w.Name, h.Len(), w.Len(), w.Origin, firstDifference(h, w)))
		}
	}
	return diffs
}

// firstDifference names one entry that is in one set and not the other.
func firstDifference(have, want *ruleset.IPSet) string {
	h, w := map[string]bool{}, map[string]bool{}
	for _, e := range have.Entries() {
		h[e] = true
	}
	for _, e := range want.Entries() {
		w[e] = true
		if !h[e] {
			return ": " + e + " missing"
		}
	}
	for _, e := range have.Entries() {
		if !w[e] {
			return ": " + e + " not wanted"
		}
	}
	return ""
}

var restoreLine = regexp.MustCompile(`line:? (\d+)`)

// originOfFailure finds, from iptables-restore's complaint about a line
// of its input, the list-valued setting to name: the one the refused
// rule matches entries of, or, when the kernel refused a whole table at
// its COMMIT, the one with the most rules in that table. "" when the
// line is a fixed rule or is not named.
func originOfFailure(stderr, text string, set *ruleset.Set) string {
	m := restoreLine.FindStringSubmatch(stderr)
	if m == nil {
		return ""
	}
	n, _ := strconv.Atoi(m[1])
	lines := strings.Split(text, "\n")
	if n < 1 || n > len(lines) {
		return ""
	}
	if lines[n-1] == "COMMIT" {
		table := ""
		for i := n - 2; i >= 0; i-- {
			if t, ok := strings.CutPrefix(lines[i], "*"); ok {
				table = strings.TrimSpace(t)
				break
			}
		}
		count := map[string]int{}
		best := ""
		for _, r := range set.Rules {
			if r.Table == table && r.Origin != "" {
				count[r.Origin]++
				if count[r.Origin] > count[best] || (count[r.Origin] == count[best] && r.Origin < best) {
					best = r.Origin
				}
			}
		}
		if best == "" {
			return ""
		}
		return fmt.Sprintf("%s (%d rules, the most of any list in table %s)", best, count[best], table)
	}
	for _, r := range set.Rules {
		if r.Command() == lines[n-1] {
			return r.Origin
		}
	}
	return ""
}
