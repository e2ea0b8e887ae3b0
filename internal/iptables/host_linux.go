package iptables

import (
	"context"
	"errors"
	"fmt"
	"net/netip"
	"sort"
	"strings"
	"time"

	"github.com/containernetworking/plugins/pkg/ns"
	"golang.org/x/sys/unix"

	"github.com/istio-cni-go/istio-cni/internal/execrun"
	"github.com/istio-cni-go/istio-cni/internal/nlsteps"
	"github.com/istio-cni-go/istio-cni/internal/podnet"
	"github.com/istio-cni-go/istio-cni/internal/ruleset"
)

// The node's probe SNAT (ruleset.BuildHostProbe) with ipsets. On the node
// the agent shares iptables with kube-proxy, the CNI and firewall
// managers: it owns only ISTIO_POSTRT and the jump to it, and writes
// under the node's own xtables lock, which legacy writers there take.

// EnsureHost makes the node's namespace (netnsPath; /proc/self/ns/net
// for the agent's own) hold the probe SNAT for p: the probe sets (made
// empty when missing, never emptied when there), then the rules, written
// in one iptables-restore per family when they differ. Calling it again
// after a firewall manager flushed the rules puts them back; calling it
// when they are there changes nothing. It reports whether it wrote.
func (a *Applier) EnsureHost(netnsPath string, p ruleset.HostParams) (bool, error) {
	plan := ruleset.BuildHostProbe(p)
	changed := false
	err := ns.WithNetNSPath(netnsPath, func(ns.NetNS) error {
		c, err := dialIPSet()
		if err != nil {
			return err
		}
		defer c.close()
		for _, s := range probeSets(p.IPv6) {
			if err := c.ensureAddrSet(s.name, s.v6); err != nil {
				return err
			}
		}
		changed, err = a.syncHostRules(plan)
		return err
	})
	return changed, err
}

// RemoveHost deletes the probe SNAT rules and then the probe sets.
func (a *Applier) RemoveHost(netnsPath string) error {
	return ns.WithNetNSPath(netnsPath, func(ns.NetNS) error {
		if _, err := a.syncHostRules(&ruleset.Plan{V4: &ruleset.Set{Family: ruleset.IPv4}}); err != nil {
			return err
		}
		c, err := dialIPSet()
		if err != nil {
			return err
		}
		defer c.close()
		for _, s := range probeSets(true) {
			if err := c.destroy(s.name); err != nil && !errors.Is(err, unix.ENOENT) {
				return fmt.Errorf("destroying ipset %s: %w", s.name, err)
			}
		}
		return nil
	})
}

// SyncProbes brings the probe sets to want (pod address to pod UID) by
// difference: missing entries added, entries of another pod's UID
// re-commented, entries no longer wanted deleted, the rest untouched.
// want must be complete: an address left out is taken as gone. IPv6
// entries need the IPv6 set (EnsureHost with IPv6).
func (a *Applier) SyncProbes(netnsPath string, want map[netip.Addr]string) (podnet.ProbeChanges, error) {
	var out podnet.ProbeChanges
	err := a.onHost(netnsPath, func(c *ipsetClient) error {
		v4, v6 := podnet.SplitFamilies(want)
		for _, s := range probeSets(true) {
			w := v4
			if s.v6 {
				w = v6
			}
			have, err := c.addrs(s.name)
			if errors.Is(err, errNoSet) && len(w) == 0 {
				continue
			}
			if err != nil {
				return err
			}
			d := podnet.DiffProbes(have, w)
			if err := changeSet(c, s.name, d, w); err != nil {
				return err
			}
			out.Added = append(out.Added, d.Added...)
			out.Updated = append(out.Updated, d.Updated...)
			out.Removed = append(out.Removed, d.Removed...)
		}
		return nil
	})
	return out, err
}

// ChangeProbes makes the changes ch, found against what the sets held
// after the caller's last write, without reading the sets: Added and Updated
// added with want's UIDs (an entry there already takes the new one),
// Removed deleted.
func (a *Applier) ChangeProbes(netnsPath string, ch podnet.ProbeChanges, want map[netip.Addr]string) error {
	if ch.Empty() {
		return nil
	}
	return a.onHost(netnsPath, func(c *ipsetClient) error {
		v4, v6 := podnet.SplitFamilies(want)
		for _, s := range probeSets(true) {
			w := v4
			if s.v6 {
				w = v6
			}
			if err := changeSet(c, s.name, ch.InSet(s.name), w); err != nil {
				return err
			}
		}
		return nil
	})
}

// changeSet adds and re-comments, then deletes, one set's entries.
func changeSet(c *ipsetClient, name string, d podnet.ProbeChanges, want map[netip.Addr]string) error {
	for _, ip := range append(append([]netip.Addr{}, d.Added...), d.Updated...) {
		if err := c.addAddr(name, ip, want[ip]); err != nil {
			return err
		}
	}
	for _, ip := range d.Removed {
		if err := c.delAddr(name, ip); err != nil {
			return err
		}
	}
	return nil
}

// ForgetProbe deletes ip from the probe sets only if its entry is uid's:
// a deleted pod's address may already be a new pod's. It reports whether
// it deleted.
func (a *Applier) ForgetProbe(netnsPath string, ip netip.Addr, uid string) (bool, error) {
	ip = ip.Unmap()
	name := ruleset.ProbeSetOf(ip)
	deleted := false
	err := a.onHost(netnsPath, func(c *ipsetClient) error {
		have, err := c.addrs(name)
		if errors.Is(err, errNoSet) {
			return nil
		}
		if err != nil {
			return err
		}
		if got, ok := have[ip]; !ok || got != uid {
			return nil
		}
		deleted = true
		return c.delAddr(name, ip)
	})
	return deleted, err
}

// ProbeEntries lists the probe sets' entries: address to pod UID.
func (a *Applier) ProbeEntries(netnsPath string) (map[netip.Addr]string, error) {
	out := map[netip.Addr]string{}
	err := a.onHost(netnsPath, func(c *ipsetClient) error {
		for _, s := range probeSets(true) {
			have, err := c.addrs(s.name)
			if errors.Is(err, errNoSet) {
				continue
			}
			if err != nil {
				return err
			}
			for ip, uid := range have {
				out[ip] = uid
			}
		}
		return nil
	})
	return out, err
}

// hostSocket is the kept socket of the node's namespace, for its probe
// sets; one for the process, since appliers are copied (a node has one
// namespace; a change of path makes a new socket).
var hostSocket nlsteps.Kept

// onHost runs fn with an ipset client on the kept socket of the node's
// namespace.
func (a *Applier) onHost(netnsPath string, fn func(*ipsetClient) error) error {
	return hostSocket.Do(netnsPath, unix.NETLINK_NETFILTER, func(c *nlsteps.Conn) error { return fn(&ipsetClient{c: c}) })
}

type probeSet struct {
	name string
	v6   bool
}

func probeSets(v6 bool) []probeSet {
	out := []probeSet{{ruleset.ProbeSetV4, false}}
	if v6 {
		out = append(out, probeSet{ruleset.ProbeSetV6, true})
	}
	return out
}

// syncHostRules brings our part of the node's nat table, per family, to
// the plan's, from the calling thread's namespace. It reports whether it
// wrote.
func (a *Applier) syncHostRules(plan *ruleset.Plan) (bool, error) {
	changed := false
	for _, fam := range []ruleset.Family{ruleset.IPv4, ruleset.IPv6} {
		views, err := a.hostViews(fam)
		if err != nil {
			return changed, err
		}
		set := planSet(plan, fam)
		for i, hv := range views {
			want := set
			if i > 0 {
				// Ours left in another variant (written before the node's
				// rules moved, or by a tool's stray table): removed, so the
				// node holds one copy and an uninstall leaves none.
				want = &ruleset.Set{Family: fam}
			}
			var text string
			switch {
			case hv.ours.Empty() && want.Empty():
			case hv.ours.Empty():
				text = want.Restore()
			case len(Diff(hv.ours, want)) > 0:
				text = ReplaceText(hv.ours, want)
			}
			if text == "" {
				continue
			}
			if _, err := a.hostRun(hv.v.restore(fam), text, "--noflush", "--wait=30"); err != nil {
				return changed, fmt.Errorf("programming the node's %s probe SNAT with %s: %w", fam, hv.v.restore(fam), err)
			}
			changed = true
		}
	}
	return changed, nil
}

// hostView is one variant's view of the node's nat table: our rules in
// it, and how many rules the node has there.
type hostView struct {
	v     *variant
	ours  *State
	rules int
}

// hostViews reads the node's nat table through each variant there is,
// the one to write first. The pods' choice (legacy whenever a legacy
// table exists) does not fit the node, where one stray legacy table (a
// tool that lists it loads it) would move the rules away from the
// node's own. So: with FORCE_IPTABLES_BINARY, that variant; else the
// variant that already holds ours; else the one holding more of the
// node's rules (kube-proxy's, the CNI's), as Istio compares them; else
// nft. A legacy table that does not exist is not read, which would load
// it.
func (a *Applier) hostViews(fam ruleset.Family) ([]hostView, error) {
	if a.Force != "" {
		v, err := a.detect(&tableSnapshot{}, fam)
		if err != nil {
			return nil, err
		}
		hv, err := a.hostRead(v, fam)
		if err != nil {
			return nil, err
		}
		return []hostView{hv}, nil
	}
	var views []hostView
	for _, c := range []struct{ name, suffix string }{{VariantNFT, "-nft"}, {VariantLegacy, "-legacy"}} {
		v, err := a.variantOf(c.name, c.suffix)
		if err != nil || v.usable(fam) != nil {
			continue
		}
		if v.legacy && !hasLegacyTables(fam) {
			views = append(views, hostView{v: v, ours: &State{}})
			continue
		}
		hv, err := a.hostRead(v, fam)
		if err != nil {
			return nil, err
		}
		views = append(views, hv)
	}
	if len(views) == 0 {
		v, err := a.variantOf(VariantPlain, "")
		if err == nil {
			err = v.usable(fam)
		}
		if err != nil {
			return nil, fmt.Errorf("no usable iptables found on the node: %w", err)
		}
		hv, err := a.hostRead(v, fam)
		if err != nil {
			return nil, err
		}
		return []hostView{hv}, nil
	}
	sort.SliceStable(views, func(i, j int) bool {
		oi, oj := !views[i].ours.Empty(), !views[j].ours.Empty()
		if oi != oj {
			return oi
		}
		return views[i].rules > views[j].rules
	})
	return views, nil
}

// hostRead reads the node's nat table with one variant.
func (a *Applier) hostRead(v *variant, fam ruleset.Family) (hostView, error) {
	if err := v.usable(fam); err != nil {
		return hostView{}, err
	}
	out, err := a.hostRun(v.save(fam), "", "-t", "nat")
	if err != nil {
		return hostView{}, fmt.Errorf("reading the node's %s nat rules with %s: %w", fam, v.save(fam), err)
	}
	all, err := ParseSave(out)
	if err != nil {
		return hostView{}, err
	}
	n := 0
	for line := range strings.SplitSeq(out, "\n") {
		if strings.HasPrefix(line, "-A ") {
			n++
		}
	}
	return hostView{v: v, ours: hostOwned(all), rules: n}, nil
}

// hostOwned keeps, of the node's nat rules, ISTIO_POSTRT and the jumps
// to it: the node's other ISTIO_ chains, if any, are some other
// component's.
func hostOwned(st *State) *State {
	out := &State{Chains: map[string]map[string][][]string{}, Builtin: map[string]map[string][][]string{}}
	if rules, ok := st.Chains["nat"][ruleset.ChainPostrouting]; ok {
		out.Chains["nat"] = map[string][][]string{ruleset.ChainPostrouting: rules}
	}
	for chain, rules := range st.Builtin["nat"] {
		for _, r := range rules {
			if len(r) >= 2 && r[len(r)-2] == "-j" && r[len(r)-1] == ruleset.ChainPostrouting {
				if out.Builtin["nat"] == nil {
					out.Builtin["nat"] = map[string][][]string{}
				}
				out.Builtin["nat"][chain] = append(out.Builtin["nat"][chain], r)
			}
		}
	}
	return out
}

// hostRun runs an iptables binary in the calling thread's namespace with
// the node's own xtables lock (no XTABLES_LOCKFILE): kube-proxy and the
// others take that one.
func (a *Applier) hostRun(bin, stdin string, args ...string) (string, error) {
	r := a.Runner
	if r == nil {
		r = execrun.OS{}
	}
	c := &execrun.Cmd{Path: bin, Args: args, Env: []string{"PATH=/usr/local/sbin:/usr/sbin:/sbin:/usr/local/bin:/usr/bin:/bin"},
		// The node's nat table can hold kube-proxy's rules for tens of
		// thousands of services, read whole, after up to 30 s waiting for
		// the node's xtables lock: slow is not hung there.
		Timeout: 5 * time.Minute}
	if stdin != "" {
		c.Stdin = []byte(stdin)
	}
	res, err := r.Run(context.Background(), c)
	if err != nil {
		msg := strings.TrimSpace(string(res.Stderr))
		if stdin != "" {
			msg += "\ninput was:\n" + abridge(stdin)
		}
		return "", &restoreError{err: err, stderr: string(res.Stderr), msg: msg}
	}
	return string(res.Stdout), nil
}
