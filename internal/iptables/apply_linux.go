package iptables

import (
	"bytes"
	"errors"
	"fmt"
	"net/netip"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"time"

	"github.com/google/nftables"
	"golang.org/x/sys/unix"

	"github.com/istio-cni-go/istio-cni/internal/execrun"
	"github.com/istio-cni-go/istio-cni/internal/podnet"
	"github.com/istio-cni-go/istio-cni/internal/ruleset"
)

// Variant names, as FORCE_IPTABLES_BINARY spells them.
const (
	VariantLegacy = "legacy"
	VariantNFT    = "nft"
	VariantPlain  = "default"
)

// Applier programs rule sets into network namespaces.
type Applier struct {
	// Force selects a variant ("legacy" or "nft") instead of detecting it.
	Force string
	// LookPath finds binaries; exec.LookPath with sbin fallbacks if nil.
	LookPath func(string) (string, error)
	// Hide are the paths covered for the commands run for a pod with
	// hostUsers: false; nil means DefaultHidden.
	Hide []string
	// Runner runs the iptables commands (and nsenter); nil means
	// execrun.OS{}.
	Runner execrun.Runner

	// expandSets makes the applier behave as on a kernel without ipset
	// (long lists as a rule per entry), so tests cover that path here.
	expandSets bool
	// planDir, when set (StorePlansIn), is where plans prepared are also
	// stored for the fallback.
	planDir string
}

// Apply makes the namespace hold exactly the plan's rules: nothing is done
// when they are already there, old rules of ours are replaced in the same
// transaction as the new ones are added, and the TPROXY policy route and
// the IPv6 passthrough address are set up as needed.
func (a *Applier) Apply(netnsPath string, plan *ruleset.Plan) (podnet.Report, error) {
	var rep podnet.Report
	err := a.inPod(netnsPath, func(t *podTarget) error {
		var err error
		if rep, err = a.apply(t, plan); err != nil {
			return err
		}
		return podnet.SyncRouting(plan)
	})
	return rep, err
}

// apply is Apply's netfilter part, from the thread inside the pod's
// namespace: every iptables command of a call is decided and run here,
// through t's runner, which is what lets tests see those decisions
// without root. The report holds the families done when it fails.
func (a *Applier) apply(t *podTarget, plan *ruleset.Plan) (podnet.Report, error) {
	var rep podnet.Report
	start := time.Now()
	fams := []ruleset.Family{ruleset.IPv4, ruleset.IPv6}
	variants := make([]*variant, len(fams))
	states := make([]*State, len(fams))
	for i, fam := range fams {
		var err error
		if variants[i], states[i], err = a.read(t, fam); err != nil {
			return rep, err
		}
	}
	plan, sets, err := a.prepareSets(plan, states)
	if err != nil {
		return rep, err
	}
	defer sets.close()
	if sets.client != nil {
		if err := sets.ensure(plan); err != nil {
			return rep, err
		}
	}
	for i, fam := range fams {
		fr, err := a.sync(t, fam, variants[i], states[i], planSet(plan, fam), sets.changed)
		if err != nil {
			sets.undo()
			return rep, err
		}
		if i == 0 {
			// The first family's time includes reading both and the sets.
			fr.Duration = time.Since(start)
		}
		rep.Families = append(rep.Families, fr)
	}
	return rep, sets.dropStale()
}

// Remove deletes every rule and chain of ours and the TPROXY policy route.
func (a *Applier) Remove(netnsPath string) (podnet.Report, error) {
	return a.Apply(netnsPath, &ruleset.Plan{V4: &ruleset.Set{Family: ruleset.IPv4}})
}

// Check returns an error describing every difference between the
// namespace and the plan.
func (a *Applier) Check(netnsPath string, plan *ruleset.Plan) error {
	return a.inPod(netnsPath, func(t *podTarget) error {
		plan, diffs, err := a.diff(t, plan)
		if err != nil {
			return err
		}
		return podnet.Mismatch(plan, diffs)
	})
}

// diff is Check's netfilter part, from the thread inside the pod's
// namespace, as apply is Apply's: the plan as the namespace's kernel
// gets it (long lists written out where it has no ipset) and every
// difference of our rules and sets from it.
func (a *Applier) diff(t *podTarget, plan *ruleset.Plan) (*ruleset.Plan, []string, error) {
	fams := []ruleset.Family{ruleset.IPv4, ruleset.IPv6}
	states := make([]*State, len(fams))
	for i, fam := range fams {
		var err error
		if _, states[i], err = a.read(t, fam); err != nil {
			return nil, nil, err
		}
	}
	plan, sets, err := a.prepareSets(plan, states)
	if err != nil {
		return nil, nil, err
	}
	sets.close()
	var diffs []string
	for i, fam := range fams {
		for _, d := range Diff(states[i], planSet(plan, fam)) {
			diffs = append(diffs, fam.String()+" "+d)
		}
	}
	return plan, diffs, nil
}

func planSet(plan *ruleset.Plan, fam ruleset.Family) *ruleset.Set {
	if fam == ruleset.IPv4 && plan.V4 != nil {
		return plan.V4
	}
	if fam == ruleset.IPv6 && plan.V6 != nil {
		return plan.V6
	}
	return &ruleset.Set{Family: fam}
}

// sync brings one family's rules to the set, from the state read before;
// changed names the sets this call filled, which makes rules that use
// them count as replaced even when their text is the same.
func (a *Applier) sync(t *podTarget, fam ruleset.Family, v *variant, st *State, set *ruleset.Set, changed map[string]bool) (podnet.FamilyReport, error) {
	start := time.Now()
	fr := podnet.FamilyReport{Family: fam, Action: "none", Variant: v.name}
	var text string
	switch {
	case st.Empty() && set.Empty():
	case st.Empty():
		text, fr.Action = set.Restore(), "applied"
	case diffRules(st, set) == nil:
		fr.Action = "unchanged"
		for _, s := range set.IPSets {
			if changed[s.Name] {
				fr.Action = "replaced"
			}
		}
	case set.Empty():
		text, fr.Action = ReplaceText(st, set), "removed"
	default:
		text, fr.Action = ReplaceText(st, set), "replaced"
	}
	if text != "" {
		if err := v.usable(fam); err != nil {
			return fr, err
		}
		if _, err := t.run(true, v.restore(fam), text, "--noflush", "--wait=30"); err != nil {
			var origin string
			var re *restoreError
			if errors.As(err, &re) {
				origin = originOfFailure(re.stderr, text, set)
			}
			if origin != "" {
				return fr, fmt.Errorf("programming %s rules with %s%s, at a rule for %s: %w", fam, v.restore(fam), t.how(), origin, err)
			}
			return fr, fmt.Errorf("programming %s rules with %s%s: %w", fam, v.restore(fam), t.how(), err)
		}
	}
	fr.Duration = time.Since(start)
	return fr, nil
}

// variantOf finds a variant's four binaries (suffix "-legacy", "-nft" or
// "" for the plain ones). The IPv6 ones may be missing (a host with
// iptables but not ip6tables): an IPv4-only pod needs none of them, and
// a pod that does is refused when its IPv6 rules are read or written.
func (a *Applier) variantOf(name, suffix string) (*variant, error) {
	v := &variant{name: name, legacy: name == VariantLegacy}
	var err error
	for _, p := range []struct {
		dst  *string
		base string
	}{{&v.save4, "iptables"}, {&v.restore4, "iptables"}, {&v.save6, "ip6tables"}, {&v.restore6, "ip6tables"}} {
		kind := "-save"
		if p.dst == &v.restore4 || p.dst == &v.restore6 {
			kind = "-restore"
		}
		if *p.dst, err = a.lookPath(p.base + suffix + kind); err != nil {
			if p.base == "iptables" {
				return nil, err
			}
			v.save6, v.restore6, v.missing6 = "", "", err
			break
		}
	}
	return v, nil
}

type variant struct {
	name                             string
	save4, restore4, save6, restore6 string
	legacy                           bool
	// missing6 is why the IPv6 binaries are not there (nil when they are).
	missing6 error
}

// usable is nil when the variant's binaries of the family are there.
func (v *variant) usable(f ruleset.Family) error {
	if f == ruleset.IPv6 && v.missing6 != nil {
		return fmt.Errorf("no usable ip6tables found on the node for the pod's IPv6 rules: %w", v.missing6)
	}
	return nil
}

func (v *variant) save(f ruleset.Family) string {
	if f == ruleset.IPv6 {
		return v.save6
	}
	return v.save4
}

func (v *variant) restore(f ruleset.Family) string {
	if f == ruleset.IPv6 {
		return v.restore6
	}
	return v.restore4
}

// detect picks the iptables variant for a family as Istio does: legacy when
// the namespace already has legacy tables, else nft, else the plain binary.
// Reading /proc replaces Istio's probe commands, which cost several
// process starts per pod.
func (a *Applier) detect(tables nsTables, fam ruleset.Family) (*variant, error) {
	mk := func(name, suffix string) (*variant, error) { return a.variantOf(name, suffix) }
	switch a.Force {
	case VariantLegacy:
		return mk(VariantLegacy, "-legacy")
	case VariantNFT:
		return mk(VariantNFT, "-nft")
	case "":
	default:
		return nil, fmt.Errorf("unknown iptables variant %q (want legacy or nft)", a.Force)
	}
	// A variant without the family's binaries is the last resort: an
	// IPv4-only pod needs no ip6tables, and one that does is refused
	// naming what is missing (variant.usable).
	var partial *variant
	try := func(name, suffix string) (*variant, error) {
		v, err := mk(name, suffix)
		if err == nil && v.usable(fam) != nil {
			if partial == nil {
				partial = v
			}
			return nil, v.usable(fam)
		}
		return v, err
	}
	if tables.legacy(fam) {
		if v, err := try(VariantLegacy, "-legacy"); err == nil {
			return v, nil
		}
	}
	if v, err := try(VariantNFT, "-nft"); err == nil {
		return v, nil
	}
	v, err := try(VariantPlain, "")
	switch {
	case err == nil:
		return v, nil
	case partial != nil:
		return partial, nil
	}
	return nil, fmt.Errorf("no usable iptables found on the node: %w", err)
}

func hasLegacyTables(fam ruleset.Family) bool {
	name := "/proc/thread-self/net/ip_tables_names"
	if fam == ruleset.IPv6 {
		name = "/proc/thread-self/net/ip6_tables_names"
	}
	data, err := os.ReadFile(name)
	return err == nil && len(bytes.TrimSpace(data)) > 0
}

// read picks the variant for a family and reads our rules with it.
func (a *Applier) read(t *podTarget, fam ruleset.Family) (*variant, *State, error) {
	v, err := a.detect(t.tables, fam)
	if err != nil {
		return nil, nil, err
	}
	st, err := a.state(t, v, fam)
	if err != nil {
		return nil, nil, err
	}
	return v, st, nil
}

// state reads our rules; it only runs iptables-save when the namespace has
// tables of that variant at all, which a fresh pod namespace does not.
func (a *Applier) state(t *podTarget, v *variant, fam ruleset.Family) (*State, error) {
	present, err := t.tables.has(v, fam)
	if err != nil {
		return nil, err
	}
	if !present {
		return &State{}, nil
	}
	if err := v.usable(fam); err != nil {
		// Tables of the family are there, and ours may be among them.
		return nil, err
	}
	out, err := t.run(false, v.save(fam), "")
	if err != nil {
		return nil, fmt.Errorf("reading %s rules with %s: %w", fam, v.save(fam), err)
	}
	return ParseSave(out)
}

// nsTables answers what choosing the iptables variant and reading our
// rules ask of the namespace besides iptables itself: which tables it
// has. tableSnapshot asks the kernel; tests script the answers.
type nsTables interface {
	// legacy reports whether the namespace has legacy tables of the
	// family.
	legacy(fam ruleset.Family) bool
	// has reports whether it has tables of the variant for the family,
	// which is when running iptables-save is worth it.
	has(v *variant, fam ruleset.Family) (bool, error)
}

// tableSnapshot lists the namespace's nftables tables once for both
// families of one call (it must be used inside the namespace).
type tableSnapshot struct {
	listed      bool
	unsupported bool
	families    map[nftables.TableFamily]bool
}

func (s *tableSnapshot) legacy(fam ruleset.Family) bool { return hasLegacyTables(fam) }

func (s *tableSnapshot) has(v *variant, fam ruleset.Family) (bool, error) {
	if v.legacy {
		return hasLegacyTables(fam), nil
	}
	if !s.listed {
		// No explicit namespace option: the netlink library then binds
		// its socket to the calling thread's namespace, which ns.Do has
		// set. (An explicit fd made it list the wrong namespace's tables.)
		conn, err := nftables.New()
		if err != nil {
			return false, fmt.Errorf("opening nftables netlink: %w", err)
		}
		tables, err := conn.ListTables()
		_ = conn.CloseLasting()
		switch {
		case errors.Is(err, unix.EPROTONOSUPPORT):
			s.unsupported = true
		case err != nil:
			return false, fmt.Errorf("listing nftables tables: %w", err)
		}
		s.families = map[nftables.TableFamily]bool{}
		for _, t := range tables {
			s.families[t.Family] = true
		}
		s.listed = true
	}
	if s.unsupported {
		return hasLegacyTables(fam), nil
	}
	if fam == ruleset.IPv6 {
		return s.families[nftables.TableFamilyIPv6], nil
	}
	return s.families[nftables.TableFamilyIPv4], nil
}

func (a *Applier) lookPath(name string) (string, error) {
	if a.LookPath != nil {
		return a.LookPath(name)
	}
	key := name + "\x00" + os.Getenv("PATH")
	if p, ok := foundPaths.Load(key); ok {
		return p.(string), nil
	}
	if p, err := exec.LookPath(name); err == nil {
		foundPaths.Store(key, p)
		return p, nil
	}
	// Runtimes often exec plugins with a PATH that lacks sbin, or with
	// hardly any PATH at all.
	for _, dir := range []string{"/usr/sbin", "/sbin", "/usr/local/sbin", "/usr/bin", "/bin"} {
		p := filepath.Join(dir, name)
		if fi, err := os.Stat(p); err == nil && fi.Mode().IsRegular() && fi.Mode()&0o111 != 0 {
			foundPaths.Store(key, p)
			return p, nil
		}
	}
	return "", fmt.Errorf("%s not found in PATH or sbin directories", name)
}

// foundPaths remembers binaries found, by name and PATH: the agent looks
// up the same four for every pod.
var foundPaths sync.Map

// PodAddrs lists the namespace's addresses, so an Applier serves as the
// plugin's rule backend.
func (a *Applier) PodAddrs(netnsPath string) ([]netip.Addr, error) {
	return podnet.PodAddrs(netnsPath)
}

// Inspection is what a namespace holds of ours, per family.
type Inspection struct {
	Family  ruleset.Family
	Variant string
	// Rules is our part of iptables-save, as lines.
	Rules []string
}

// Inspect reports the iptables variant in use and our rules, per family,
// each family followed by the ipsets its rules match against.
func (a *Applier) Inspect(netnsPath string) ([]Inspection, error) {
	var out []Inspection
	err := a.inPod(netnsPath, func(t *podTarget) error {
		var sets map[string]*ruleset.IPSet
		for _, fam := range []ruleset.Family{ruleset.IPv4, ruleset.IPv6} {
			v, st, err := a.read(t, fam)
			if err != nil {
				return err
			}
			in := Inspection{Family: fam, Variant: v.name}
			var used []string
			add := func(table, chain string, r []string) {
				in.Rules = append(in.Rules, fmt.Sprintf("%s: -A %s %s", table, chain, strings.Join(r, " ")))
				for i := 0; i+1 < len(r); i++ {
					if r[i] == "--match-set" {
						used = append(used, r[i+1])
					}
				}
			}
			for _, table := range sortedKeys(st.Builtin) {
				for _, chain := range sortedKeys(st.Builtin[table]) {
					for _, r := range st.Builtin[table][chain] {
						add(table, chain, r)
					}
				}
			}
			for _, table := range sortedKeys(st.Chains) {
				for _, chain := range sortedKeys(st.Chains[table]) {
					for _, r := range st.Chains[table][chain] {
						add(table, chain, r)
					}
				}
			}
			if len(used) > 0 && sets == nil {
				c, err := dialIPSet()
				if err != nil {
					return err
				}
				sets, err = c.list()
				c.close()
				if err != nil {
					return err
				}
			}
			seen := map[string]bool{}
			for _, name := range used {
				if seen[name] {
					continue
				}
				seen[name] = true
				in.Rules = append(in.Rules, describeSet(name, sets[name]))
			}
			out = append(out, in)
		}
		return nil
	})
	return out, err
}

// describeSet is one line about an ipset: its kind, size and ends.
func describeSet(name string, s *ruleset.IPSet) string {
	if s == nil {
		return "ipset " + name + ": missing"
	}
	kind := "bitmap:port"
	if s.Kind == ruleset.SetNets {
		kind = "hash:net " + s.Family.String()
	}
	e := s.Entries()
	switch len(e) {
	case 0:
		return fmt.Sprintf("ipset %s: %s, empty", name, kind)
	case 1, 2:
		return fmt.Sprintf("ipset %s: %s, %d entries: %s", name, kind, s.Len(), strings.Join(e, ","))
	}
	return fmt.Sprintf("ipset %s: %s, %d entries: %s ... %s", name, kind, s.Len(), e[0], e[len(e)-1])
}
