package nftables

import (
	"bytes"
	"fmt"
	"net/netip"
	"sort"
	"strings"
	"time"

	"github.com/containernetworking/plugins/pkg/ns"
	"github.com/google/nftables"
	"github.com/google/nftables/expr"

	"github.com/istio-cni-go/istio-cni/internal/nsfacts"
	"github.com/istio-cni-go/istio-cni/internal/podnet"
	"github.com/istio-cni-go/istio-cni/internal/ruleset"
)

// VariantName is how reports name this backend.
const VariantName = nsfacts.KindNFTables

// Applier programs rule sets through netlink. It runs no binary.
type Applier struct {
	// sndBuf and rcvBuf, when set, replace the socket buffer sizes the
	// applier computes for each batch, so tests can make the kernel
	// refuse a batch for its size.
	sndBuf, rcvBuf int
}

// Apply makes the pod's namespace hold exactly the plan's tables: nothing
// happens when they already match; otherwise our old tables are deleted
// and the new ones added in the same netlink transaction.
func (a *Applier) Apply(netnsPath string, plan *ruleset.Plan) (podnet.Report, error) {
	var rep podnet.Report
	start := time.Now()
	rs, err := Build(plan)
	if err != nil {
		return rep, err
	}
	err = a.withOurTables(netnsPath, TablePrefix, rs, func(conn *nftables.Conn, existing []*nftables.Table) error {
		action, note, err := replace(conn, existing, rs)
		if err != nil {
			return err
		}
		rep.Families = append(rep.Families, podnet.FamilyReport{Family: ruleset.IPv4, Variant: VariantName, Action: action, Duration: time.Since(start), Note: note})
		return podnet.SyncRouting(plan)
	})
	return rep, err
}

// replace makes the namespace's tables of ours (existing) exactly the
// ruleset's, in one transaction, unless they already are. It says what it
// did: "applied", "replaced", "unchanged" or "none", and a note.
func replace(conn *nftables.Conn, existing []*nftables.Table, rs *Ruleset) (action, note string, err error) {
	action = "applied"
	if len(existing) > 0 {
		diffs, err := diff(conn, existing, rs)
		if err != nil {
			// A rule that cannot even be read back is not ours: the
			// tables are replaced whole, as for any difference.
			diffs = []string{"unreadable: " + err.Error()}
		}
		action = "replaced"
		if len(diffs) == 0 {
			action = "unchanged"
		}
	}
	if len(rs.Rules) == 0 && len(existing) == 0 {
		action = "none"
	}
	if action == "unchanged" || action == "none" {
		return action, "", nil
	}
	for _, t := range existing {
		conn.DelTable(t)
	}
	if err := program(conn, rs); err != nil {
		return "", "", err
	}
	if err := conn.Flush(); err != nil {
		if !landed(rs, err) {
			return "", "", refusal(rs, err)
		}
		// The replies overflowed the socket but the batch went
		// through: the namespace holds exactly the plan.
		note = "kernel replies lost, rules verified"
	}
	return action, note, nil
}

// Remove deletes our tables and the TPROXY policy route.
func (a *Applier) Remove(netnsPath string) (podnet.Report, error) {
	return a.Apply(netnsPath, &ruleset.Plan{V4: &ruleset.Set{Family: ruleset.IPv4}})
}

// Check lists every difference between the namespace and the plan.
func (a *Applier) Check(netnsPath string, plan *ruleset.Plan) error {
	rs, err := Build(plan)
	if err != nil {
		return err
	}
	return a.withOurTables(netnsPath, TablePrefix, nil, func(conn *nftables.Conn, existing []*nftables.Table) error {
		diffs, err := diff(conn, existing, rs)
		if err != nil {
			return err
		}
		return podnet.Mismatch(plan, diffs)
	})
}

// withOurTables runs fn inside the pod's namespace with a netlink
// connection there, its buffers sized for rs (nil: defaults), and the
// tables of ours (named with prefix) it holds.
func (a *Applier) withOurTables(netnsPath, prefix string, rs *Ruleset, fn func(*nftables.Conn, []*nftables.Table) error) error {
	return ns.WithNetNSPath(netnsPath, func(ns.NetNS) error {
		// One socket for the whole call, bound to this thread's namespace
		// when it is made.
		opts := []nftables.ConnOption{nftables.AsLasting()}
		if rs != nil {
			opts = append(opts, nftables.WithSockOptions(a.sizeFor(rs)))
		}
		conn, err := nftables.New(opts...)
		if err != nil {
			return fmt.Errorf("opening nftables netlink: %w", err)
		}
		// Closing only releases the socket: the call's outcome is decided.
		defer func() { _ = conn.CloseLasting() }()
		existing, err := ourTables(conn, prefix)
		if err != nil {
			return err
		}
		return fn(conn, existing)
	})
}

// PodAddrs lists the namespace's addresses.
func (a *Applier) PodAddrs(netnsPath string) ([]netip.Addr, error) {
	return podnet.PodAddrs(netnsPath)
}

func ourTables(conn *nftables.Conn, prefix string) ([]*nftables.Table, error) {
	tables, err := conn.ListTablesOfFamily(nftables.TableFamilyINet)
	if err != nil {
		return nil, fmt.Errorf("listing nftables tables: %w", err)
	}
	var out []*nftables.Table
	for _, t := range tables {
		if strings.HasPrefix(t.Name, prefix) {
			out = append(out, t)
		}
	}
	return out, nil
}

// elemBatch is how many set elements one message carries: a netlink
// attribute is at most 64 KiB, and an interface-name element with its
// interval flag takes about 40 bytes.
const elemBatch = 1000

func program(conn *nftables.Conn, rs *Ruleset) error {
	tables := map[string]*nftables.Table{}
	for _, name := range rs.Tables {
		tables[name] = conn.AddTable(&nftables.Table{Name: name, Family: nftables.TableFamilyINet})
	}
	chains := map[string]*nftables.Chain{}
	for _, c := range rs.Chains {
		ch := &nftables.Chain{Name: c.Name, Table: tables[c.Table]}
		if c.Base != nil {
			ch.Type, ch.Hooknum, ch.Priority = c.Base.Type, c.Base.Hook, c.Base.Priority
		}
		chains[c.Table+"/"+c.Name] = conn.AddChain(ch)
	}
	for _, st := range rs.Sets {
		// The ID is set, so the library does not number the set from a
		// counter that concurrent pods would share unguarded.
		set := &nftables.Set{Table: tables[st.Table], Name: st.Name, ID: st.ID, KeyType: st.KeyType, Interval: st.Interval, Size: st.Size, Comment: st.Comment}
		if err := conn.AddSet(set, nil); err != nil {
			return fmt.Errorf("set %s: %w", st.Name, err)
		}
		for e := st.Elements; len(e) > 0; {
			n := min(elemBatch, len(e))
			if err := conn.SetAddElements(set, e[:n]); err != nil {
				return fmt.Errorf("elements of set %s: %w", st.Name, err)
			}
			e = e[n:]
		}
	}
	for _, r := range rs.Rules {
		conn.AddRule(&nftables.Rule{Table: tables[r.Table], Chain: chains[r.Table+"/"+r.Chain], Exprs: r.Exprs})
	}
	return nil
}

// diff compares the kernel's tables with the ruleset, rule by rule, on
// the netlink encoding of each expression (counters zeroed).
func diff(conn *nftables.Conn, existing []*nftables.Table, rs *Ruleset) ([]string, error) {
	var diffs []string
	want := map[string]bool{}
	for _, t := range rs.Tables {
		want[t] = true
	}
	have := map[string]*nftables.Table{}
	for _, t := range existing {
		have[t.Name] = t
		if !want[t.Name] {
			diffs = append(diffs, "unexpected table "+t.Name)
		}
	}
	for _, t := range rs.Tables {
		if have[t] == nil {
			diffs = append(diffs, "table "+t+" missing")
		}
	}
	if len(diffs) > 0 {
		return diffs, nil
	}
	kernelChains, err := conn.ListChainsOfTableFamily(nftables.TableFamilyINet)
	if err != nil {
		return nil, fmt.Errorf("listing nftables chains: %w", err)
	}
	haveChains := map[string]*nftables.Chain{}
	for _, c := range kernelChains {
		if c.Table != nil && want[c.Table.Name] {
			haveChains[c.Table.Name+"/"+c.Name] = c
		}
	}
	wantRules := map[string][]Rule{}
	for _, r := range rs.Rules {
		wantRules[r.Table+"/"+r.Chain] = append(wantRules[r.Table+"/"+r.Chain], r)
	}
	wantChains := map[string]bool{}
	for _, c := range rs.Chains {
		key := c.Table + "/" + c.Name
		wantChains[key] = true
		kc := haveChains[key]
		if kc == nil {
			diffs = append(diffs, "chain "+key+" missing")
			continue
		}
		rules, err := conn.GetRules(have[c.Table], kc)
		if err != nil {
			return nil, fmt.Errorf("reading rules of %s: %w", key, err)
		}
		wr := wantRules[key]
		if len(rules) != len(wr) {
			diffs = append(diffs, fmt.Sprintf("chain %s has %d rules, want %d", key, len(rules), len(wr)))
			continue
		}
		for i := range wr {
			if !sameExprs(rules[i].Exprs, wr[i].Exprs) {
				diffs = append(diffs, fmt.Sprintf("chain %s rule %d differs, want %q", key, i+1, wr[i].Text))
			}
		}
	}
	var extra []string
	for key := range haveChains {
		if !wantChains[key] {
			extra = append(extra, key)
		}
	}
	sort.Strings(extra)
	for _, key := range extra {
		diffs = append(diffs, "unexpected chain "+key)
	}
	setDiffs, err := diffSets(conn, have, rs)
	if err != nil {
		return nil, err
	}
	return append(diffs, setDiffs...), nil
}

func sameExprs(a, b []expr.Any) bool {
	a, b = decodable(a), decodable(b)
	if len(a) != len(b) {
		return false
	}
	for i := range a {
		x, y := canonical(a[i]), canonical(b[i])
		xb, err1 := expr.Marshal(byte(nftables.TableFamilyINet), x)
		yb, err2 := expr.Marshal(byte(nftables.TableFamilyINet), y)
		if err1 != nil || err2 != nil || !bytes.Equal(xb, yb) {
			return false
		}
	}
	return true
}

// decodable leaves out the expressions the netlink library cannot decode
// from the kernel (tproxy), so both sides are compared on the same terms;
// everything around them still is.
func decodable(in []expr.Any) []expr.Any {
	out := make([]expr.Any, 0, len(in))
	for _, e := range in {
		if _, ok := e.(*expr.TProxy); !ok {
			out = append(out, e)
		}
	}
	return out
}

// canonical drops what differs between an expression as built and as the
// library decodes it from the kernel: counter values, and the registers
// of ct and meta expressions (the decoder does not report a source
// register, so a load and a store of the same key look alike).
func canonical(e expr.Any) expr.Any {
	switch v := e.(type) {
	case *expr.Counter:
		return &expr.Counter{}
	case *expr.Ct:
		return &expr.Ct{Key: v.Key}
	case *expr.Meta:
		return &expr.Meta{Key: v.Key}
	case *expr.Lookup:
		// The kernel reports a lookup's set by name only.
		return &expr.Lookup{SourceRegister: v.SourceRegister, SetName: v.SetName, Invert: v.Invert}
	}
	return e
}

// Inspect lists our tables with their chains and rule counts.
func (a *Applier) Inspect(netnsPath string) ([]string, error) {
	return a.InspectTables(netnsPath, TablePrefix)
}

// InspectTables is Inspect for the tables whose names start with prefix
// (AmbientTablePrefix: ambient mode's).
func (a *Applier) InspectTables(netnsPath, prefix string) ([]string, error) {
	var out []string
	err := a.withOurTables(netnsPath, prefix, nil, func(conn *nftables.Conn, tables []*nftables.Table) error {
		if len(tables) == 0 {
			return nil
		}
		for _, t := range tables {
			sets, err := conn.GetSets(t)
			if err != nil {
				return err
			}
			for _, st := range sets {
				elems, err := conn.GetSetElements(st)
				if err != nil {
					return err
				}
				out = append(out, fmt.Sprintf("inet %s set %s: %s, %d elements", t.Name, st.Name, st.KeyType.Name, len(elems)))
			}
		}
		chains, err := conn.ListChainsOfTableFamily(nftables.TableFamilyINet)
		if err != nil {
			return err
		}
		for _, c := range chains {
			if c.Table == nil || !strings.HasPrefix(c.Table.Name, prefix) {
				continue
			}
			rules, err := conn.GetRules(c.Table, c)
			if err != nil {
				// Another writer's rule that cannot be decoded is worth
				// seeing, not a reason to show nothing.
				out = append(out, fmt.Sprintf("inet %s %s: rules unreadable (another writer's?): %v", c.Table.Name, c.Name, err))
				continue
			}
			out = append(out, fmt.Sprintf("inet %s %s: %d rules", c.Table.Name, c.Name, len(rules)))
		}
		sort.Strings(out)
		return nil
	})
	return out, err
}
