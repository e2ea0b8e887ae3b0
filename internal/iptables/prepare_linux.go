package iptables

import (
	"cmp"
	"encoding/binary"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"runtime"
	"strings"

	"github.com/containernetworking/plugins/pkg/ns"
	"github.com/mdlayher/netlink"
	"github.com/vishvananda/netlink/nl"
	"golang.org/x/sys/unix"

	"github.com/istio-cni-go/istio-cni/internal/nlsteps"
	"github.com/istio-cni-go/istio-cni/internal/nsfacts"
	"github.com/istio-cni-go/istio-cni/internal/podnet"
	"github.com/istio-cni-go/istio-cni/internal/prepared"
	"github.com/istio-cni-go/istio-cni/internal/ruleset"
)

// Preparing a pod's rules for the relay to send.
//
// iptables-nft keeps its rules in nf_tables, so what iptables-nft-restore
// would write into a pod's namespace is a set of netlink requests. They
// are found by running iptables-nft-restore, once per distinct plan, in a
// scratch namespace of the agent's and reading back what it made: the
// tables, chains and rules byte for byte as that iptables encodes them
// (its compat extensions included), and the ipsets they match, made in the
// same order so that the kernel numbers them the same. A pod with that
// plan then gets them in one nf_tables transaction, sent by the relay with
// no iptables process at all; iptables-save lists them as its own.

// preparedTxns are the plans already prepared, by variant and
// fingerprint. 4 MiB holds hundreds of plans with short lists.
var preparedTxns = nlsteps.NewCache(4 << 20)

// Prepare returns the requests that give a namespace with none of our
// rules the plan, exactly as Apply would, for a relay to send; or, with a
// nil transaction, why the namespace needs Apply instead (it holds rules,
// legacy tables or ipsets already, it belongs to a user namespace of its
// own, or iptables here is not iptables-nft).
func (a *Applier) Prepare(netnsPath string, plan *ruleset.Plan) (*nlsteps.Txn, string, error) {
	facts, why, err := a.Examine(netnsPath)
	if err != nil || why != "" {
		return nil, why, err
	}
	return a.PrepareFresh(facts, plan)
}

// Examine reads the namespace's facts and says why it cannot take
// prepared requests, "" when it can.
func (a *Applier) Examine(netnsPath string) (nsfacts.Facts, string, error) {
	facts, err := nsfacts.ReadFactsIn(netnsPath)
	return facts, a.unfit(facts), err
}

// unfit says why a namespace with these facts cannot take prepared
// requests, "" when it can; whether it holds ipsets is looked at once
// the requests are known to make some.
func (a *Applier) unfit(f nsfacts.Facts) string {
	if a.Force == VariantLegacy {
		return legacyForced
	}
	return f.Unfit(nsfacts.KindIPTablesNFT, false)
}

// PrepareFresh returns the requests for a namespace Examine found fit: the
// plan's, prepared once and then taken from the cache.
func (a *Applier) PrepareFresh(facts nsfacts.Facts, plan *ruleset.Plan) (*nlsteps.Txn, string, error) {
	return a.prepareFresh(facts, plan, a.planDir)
}

// prepareFresh is PrepareFresh storing what it prepares in planDir, none
// when "".
func (a *Applier) prepareFresh(facts nsfacts.Facts, plan *ruleset.Plan, planDir string) (*nlsteps.Txn, string, error) {
	if a.Force == VariantLegacy {
		return nil, legacyForced, nil
	}
	key := a.planKey(plan)
	txn, hit, err := preparedTxns.Get(key, func() (*nlsteps.Txn, error) {
		return a.compile(plan)
	})
	if errors.Is(err, errNotNFT) {
		return nil, err.Error(), nil
	}
	if err != nil {
		return nil, "", err
	}
	if planDir != "" && txn.Oversize == 0 {
		storePlan(planDir, key, txn, hit)
	}
	return fitFor(facts, txn)
}

// storePlan leaves a plan's requests for the fallback, best effort: a
// plan not stored only leaves a fallback to run iptables-restore itself.
// A plan the cache held is written again if its file is gone (a write
// that failed, a directory emptied since): a stat per prepared pod.
func storePlan(dir, key string, txn *nlsteps.Txn, cached bool) {
	if cached && prepared.HasPlan(dir, key) {
		return
	}
	if b, err := txn.MarshalBinary(); err == nil {
		_ = prepared.Dir(dir).PutPlan(key, b)
	}
}

// planKey names a plan's requests in the cache and among stored plans;
// the unforced variant prepares as nft does, so both share one name.
func (a *Applier) planKey(plan *ruleset.Plan) string {
	return "iptables " + cmp.Or(a.Force, VariantNFT) + " " + plan.Fingerprint()
}

// StorePlansIn makes the applier also leave each plan it prepares in the
// agent's prepared directory (prepared.Dir.PutPlan), for fallback plugin
// processes; call it before the applier is used.
func (a *Applier) StorePlansIn(dir string) { a.planDir = dir }

// PrepareStored is PrepareFresh for a process that does not prepare
// plans itself (the fallback): the requests the agent stored in dir for
// the plan, when there are some; with none, why.
func (a *Applier) PrepareStored(dir string, facts nsfacts.Facts, plan *ruleset.Plan) (*nlsteps.Txn, string, error) {
	if a.Force == VariantLegacy {
		return nil, legacyForced, nil
	}
	b, err := prepared.ReadPlan(dir, a.planKey(plan))
	if errors.Is(err, fs.ErrNotExist) {
		return nil, "the agent stored no requests for the plan", nil
	}
	if err != nil {
		return nil, "the agent's stored requests for the plan do not read: " + err.Error(), nil
	}
	txn := &nlsteps.Txn{}
	if err := txn.UnmarshalBinary(b); err != nil {
		return nil, "the agent's stored requests for the plan do not read: " + err.Error(), nil
	}
	return fitFor(facts, txn)
}

// legacyForced is why a legacy-forced applier sends no prepared
// requests: they are nf_tables requests.
const legacyForced = "FORCE_IPTABLES_BINARY=legacy"

// fitFor hands txn on when a namespace with these facts can take it;
// whether it makes ipsets is known only once the requests are.
func fitFor(facts nsfacts.Facts, txn *nlsteps.Txn) (*nlsteps.Txn, string, error) {
	if why := facts.Unfit(nsfacts.KindIPTablesNFT, len(txn.Undo) > 0); why != "" {
		return nil, why, nil
	}
	return txn, "", nil
}

func cString(b []byte) string { return strings.TrimRight(string(b), "\x00") }

func nftType(msg int) netlink.HeaderType {
	return netlink.HeaderType(unix.NFNL_SUBSYS_NFTABLES<<8 | msg)
}

// errNotNFT: the iptables the agent has writes legacy tables, which no
// netlink request can make.
var errNotNFT = errors.New("iptables on this node is not iptables-nft")

// compile applies the plan to a scratch namespace and reads it back as
// requests.
func (a *Applier) compile(plan *ruleset.Plan) (*nlsteps.Txn, error) {
	scratch, err := newScratchNS()
	if err != nil {
		return nil, fmt.Errorf("making a scratch network namespace: %w", err)
	}
	defer scratch.Close()
	path := fmt.Sprintf("/proc/%d/fd/%d", os.Getpid(), scratch.Fd())
	b := *a
	if b.Force == "" {
		b.Force = VariantNFT
	}
	if _, err := b.Apply(path, plan); err != nil {
		if _, lerr := b.lookPath("iptables-nft-restore"); lerr != nil {
			return nil, errNotNFT
		}
		return nil, err
	}
	txn := &nlsteps.Txn{}
	err = ns.WithNetNSPath(path, func(ns.NetNS) error {
		if hasLegacyTables(ruleset.IPv4) || hasLegacyTables(ruleset.IPv6) {
			return errNotNFT
		}
		c, err := dialIPSet()
		if err != nil {
			if len(plan.IPSets()) > 0 {
				return err
			}
		} else {
			defer c.close()
			sets, undo, err := c.recreate(plan)
			if err != nil {
				return err
			}
			if sets != nil {
				txn.Steps = append(txn.Steps, *sets)
				txn.Undo = append(txn.Undo, *undo)
			}
		}
		batch, err := dumpTables(plan)
		if err != nil {
			return err
		}
		if batch.Len() > 0 {
			txn.Steps = append(txn.Steps, *batch)
		}
		return nil
	})
	if err != nil {
		return nil, err
	}
	txn.Steps = append(txn.Steps, podnet.RoutingSteps(plan)...)
	txn.Summary = nsfacts.KindIPTablesNFT
	return txn, nil
}

// recreate records the requests that make the plan's ipsets as the
// scratch namespace (the calling thread's) holds them, and those that
// destroy them; nil when it holds none (no ipset in the kernel: the
// rules were written out entry by entry). The kernel numbered the sets in
// the order Apply made them, the plan's; so will the relay.
func (c *ipsetClient) recreate(plan *ruleset.Plan) (create, undo *nlsteps.Step, err error) {
	names, err := c.names()
	if err != nil {
		return nil, nil, err
	}
	if len(names) == 0 {
		return nil, nil, nil
	}
	want := plan.IPSets()
	if len(want) != len(names) {
		return nil, nil, fmt.Errorf("scratch namespace holds ipsets %v; the plan has %d", names, len(want))
	}
	create = &nlsteps.Step{Proto: unix.NETLINK_NETFILTER}
	undo = &nlsteps.Step{Proto: unix.NETLINK_NETFILTER}
	for i, s := range want {
		if names[i] != s.Name {
			return nil, nil, fmt.Errorf("scratch namespace holds ipsets %v, not in the plan's order", names)
		}
		rec := &ipsetClient{c: c.c, rec: create}
		if err := rec.create(s); err != nil {
			return nil, nil, err
		}
		rec.rec = undo
		if err := rec.destroy(s.Name); err != nil {
			return nil, nil, err
		}
	}
	return create, undo, nil
}

// names lists the namespace's ipsets in the kernel's order.
func (c *ipsetClient) names() ([]string, error) {
	msgs, err := c.c.Request(unix.NFNL_SUBSYS_IPSET<<8|nl.IPSET_CMD_LIST, unix.NLM_F_DUMP, nsfacts.IPSetNamesRequest())
	if err != nil {
		return nil, fmt.Errorf("listing ipsets: %w", err)
	}
	var out []string
	for _, m := range msgs {
		if len(m.Body) < nlsteps.NfGenLen {
			continue
		}
		attrs, _ := nlsteps.ParseAttrs(m.Body[nlsteps.NfGenLen:])
		for _, at := range attrs {
			if at.Type == nl.IPSET_ATTR_SETNAME {
				if n := cString(at.Data); len(out) == 0 || out[len(out)-1] != n {
					out = append(out, n)
				}
			}
		}
	}
	return out, nil
}

// Attributes of the kernel's nf_tables messages that x/sys/unix lacks.
const (
	nftaTableUserdata = 6
	nftaChainFlags    = 10
	nftaChainUserdata = 12
	nftaRuleCompat    = unix.NFTA_RULE_COMPAT
	nftCompatFlagInv  = 1 << 1
)

// dumpTables reads the iptables tables of the calling thread's namespace
// (IPv4 and IPv6) as one transaction that makes them: each table created
// only if it is not there (the transaction fails whole otherwise), its
// chains, then its rules in order, with the attributes a create takes.
func dumpTables(plan *ruleset.Plan) (*nlsteps.Step, error) {
	c, err := netlink.Dial(unix.NETLINK_NETFILTER, nil)
	if err != nil {
		return nil, fmt.Errorf("opening netfilter netlink: %w", err)
	}
	defer c.Close()
	dump := func(msg int) ([]netlink.Message, error) {
		ms, err := c.Execute(netlink.Message{Header: netlink.Header{Type: nftType(msg), Flags: netlink.Request | netlink.Dump},
			Data: nlsteps.NfGen(unix.NFPROTO_UNSPEC, 0)})
		if err != nil {
			return nil, fmt.Errorf("reading back the scratch namespace's rules: %w", err)
		}
		return ms, nil
	}
	step := &nlsteps.Step{Proto: unix.NETLINK_NETFILTER, Batch: true}
	names := ruleNames(plan)
	for _, kind := range []struct {
		get, make int
		flags     uint16
		keep      map[uint16]bool
	}{
		{unix.NFT_MSG_GETTABLE, unix.NFT_MSG_NEWTABLE, nlsteps.FlagCreate | nlsteps.FlagExcl,
			map[uint16]bool{unix.NFTA_TABLE_NAME: true, unix.NFTA_TABLE_FLAGS: true, nftaTableUserdata: true}},
		{unix.NFT_MSG_GETCHAIN, unix.NFT_MSG_NEWCHAIN, nlsteps.FlagCreate,
			map[uint16]bool{unix.NFTA_CHAIN_TABLE: true, unix.NFTA_CHAIN_NAME: true, unix.NFTA_CHAIN_HOOK: true,
				unix.NFTA_CHAIN_POLICY: true, unix.NFTA_CHAIN_TYPE: true, nftaChainFlags: true, nftaChainUserdata: true}},
		{unix.NFT_MSG_GETRULE, unix.NFT_MSG_NEWRULE, nlsteps.FlagCreate | nlsteps.FlagAppend,
			map[uint16]bool{unix.NFTA_RULE_TABLE: true, unix.NFTA_RULE_CHAIN: true, unix.NFTA_RULE_EXPRESSIONS: true, unix.NFTA_RULE_USERDATA: true}},
	} {
		msgs, err := dump(kind.get)
		if err != nil {
			return nil, err
		}
		for _, m := range msgs {
			if len(m.Data) < nlsteps.NfGenLen {
				continue
			}
			fam := m.Data[0]
			attrs, err := nlsteps.ParseAttrs(m.Data[nlsteps.NfGenLen:])
			if err != nil {
				return nil, err
			}
			body := nlsteps.NfGen(fam, 0)
			var table, chain string
			for _, at := range attrs {
				t := at.Type &^ (unix.NLA_F_NESTED | unix.NLA_F_NET_BYTEORDER)
				switch t {
				case unix.NFTA_TABLE_NAME: // = NFTA_CHAIN_TABLE = NFTA_RULE_TABLE
					table = cString(at.Data)
				case unix.NFTA_CHAIN_NAME:
					if kind.get == unix.NFT_MSG_GETCHAIN {
						chain = cString(at.Data)
					}
				}
				if kind.get == unix.NFT_MSG_GETRULE && t == unix.NFTA_RULE_CHAIN {
					chain = cString(at.Data)
				}
				if kind.keep[t] {
					body = nlsteps.Attr(body, at.Type, at.Data)
				}
			}
			what := familyName(fam) + " table " + table
			switch kind.get {
			case unix.NFT_MSG_GETCHAIN:
				what = "chain " + chain + " of " + what
			case unix.NFT_MSG_GETRULE:
				what = names.next(fam, table, chain)
				if compat := compatOf(attrs); compat != nil {
					body = nlsteps.Attr(body, nftaRuleCompat|unix.NLA_F_NESTED, compat)
				}
			}
			step.Add(uint16(nftType(kind.make)), kind.flags, body, what)
		}
	}
	return step, nil
}

func familyName(fam uint8) string {
	if fam == unix.NFPROTO_IPV6 {
		return "ip6"
	}
	return "ip"
}

// ruleSeq names each rule read back by the iptables-restore line it
// came from: the plan's rules per table and chain, in the kernel's order.
type ruleSeq struct {
	final map[uint8]map[string]map[string][]ruleset.Rule
	seen  map[string]int
}

func ruleNames(plan *ruleset.Plan) *ruleSeq {
	r := &ruleSeq{final: map[uint8]map[string]map[string][]ruleset.Rule{}, seen: map[string]int{}}
	for _, s := range plan.Sets() {
		fam := uint8(unix.NFPROTO_IPV4)
		if s.Family == ruleset.IPv6 {
			fam = unix.NFPROTO_IPV6
		}
		r.final[fam] = s.Final()
	}
	return r
}

func (r *ruleSeq) next(fam uint8, table, chain string) string {
	key := fmt.Sprintf("%d %s %s", fam, table, chain)
	i := r.seen[key]
	r.seen[key] = i + 1
	rules := r.final[fam][table][chain]
	if i < len(rules) {
		return fmt.Sprintf("%s table %s, rule %d of %s: %s", familyName(fam), table, i+1, chain, rules[i].Command())
	}
	return fmt.Sprintf("%s table %s, rule %d of %s", familyName(fam), table, i+1, chain)
}

// compatOf is the NFTA_RULE_COMPAT a rule was made with, which the kernel
// checks the rule's xtables extensions against (TPROXY and multiport want
// -p tcp or udp) but does not report back: iptables-nft sends the
// protocol its -p named, which the rule loads as meta l4proto and
// compares with.
func compatOf(attrs []nlsteps.Attribute) []byte {
	for _, at := range attrs {
		if at.Type&^unix.NLA_F_NESTED != unix.NFTA_RULE_EXPRESSIONS {
			continue
		}
		elems, _ := nlsteps.ParseAttrs(at.Data)
		l4proto := false
		for _, e := range elems {
			name, data := exprOf(e.Data)
			switch {
			case name == "meta":
				l4proto = metaKey(data) == unix.NFT_META_L4PROTO
			case name == "cmp" && l4proto:
				proto, op, ok := cmpByte(data)
				if !ok {
					return nil
				}
				var flags uint32
				if op == unix.NFT_CMP_NEQ {
					flags = nftCompatFlagInv
				}
				b := nlsteps.Attr(nil, unix.NFTA_RULE_COMPAT_PROTO, binary.BigEndian.AppendUint32(nil, uint32(proto)))
				return nlsteps.Attr(b, unix.NFTA_RULE_COMPAT_FLAGS, binary.BigEndian.AppendUint32(nil, flags))
			default:
				l4proto = false
			}
		}
	}
	return nil
}

func exprOf(elem []byte) (string, []byte) {
	attrs, _ := nlsteps.ParseAttrs(elem)
	var name string
	var data []byte
	for _, a := range attrs {
		switch a.Type &^ unix.NLA_F_NESTED {
		case unix.NFTA_EXPR_NAME:
			name = cString(a.Data)
		case unix.NFTA_EXPR_DATA:
			data = a.Data
		}
	}
	return name, data
}

func metaKey(data []byte) uint32 {
	attrs, _ := nlsteps.ParseAttrs(data)
	for _, a := range attrs {
		if a.Type == unix.NFTA_META_KEY && len(a.Data) == 4 {
			return binary.BigEndian.Uint32(a.Data)
		}
	}
	return 0
}

// cmpByte reads a one-byte cmp: its value and operator.
func cmpByte(data []byte) (value byte, op uint32, ok bool) {
	attrs, _ := nlsteps.ParseAttrs(data)
	for _, a := range attrs {
		switch a.Type &^ unix.NLA_F_NESTED {
		case unix.NFTA_CMP_OP:
			if len(a.Data) == 4 {
				op = binary.BigEndian.Uint32(a.Data)
			}
		case unix.NFTA_CMP_DATA:
			vals, _ := nlsteps.ParseAttrs(a.Data)
			for _, v := range vals {
				if v.Type&^unix.NLA_F_NESTED == unix.NFTA_DATA_VALUE && len(v.Data) == 1 {
					value, ok = v.Data[0], true
				}
			}
		}
	}
	return value, op, ok
}

// newScratchNS makes an empty network namespace, lo up as a pod's, held
// only by the returned file: closing it lets the kernel free it.
func newScratchNS() (*os.File, error) {
	type result struct {
		f   *os.File
		err error
	}
	ch := make(chan result, 1)
	go func() {
		// Unlocked only once the thread is back in its namespace; if it
		// cannot get back, Go ends the thread with this goroutine.
		runtime.LockOSThread()
		orig, err := os.Open("/proc/thread-self/ns/net")
		if err != nil {
			ch <- result{err: err}
			return
		}
		defer orig.Close()
		if err := unix.Unshare(unix.CLONE_NEWNET); err != nil {
			ch <- result{err: err}
			runtime.UnlockOSThread()
			return
		}
		f, err := os.Open("/proc/thread-self/ns/net")
		if err == nil {
			err = setLoUp()
		}
		if rerr := unix.Setns(int(orig.Fd()), unix.CLONE_NEWNET); rerr != nil {
			if f != nil {
				_ = f.Close()
			}
			ch <- result{err: fmt.Errorf("returning from the scratch namespace: %w", rerr)}
			return
		}
		runtime.UnlockOSThread()
		if err != nil && f != nil {
			_ = f.Close()
			f = nil
		}
		ch <- result{f, err}
	}()
	r := <-ch
	return r.f, r.err
}

// setLoUp brings lo up in the calling thread's namespace.
func setLoUp() error {
	fd, err := unix.Socket(unix.AF_INET, unix.SOCK_DGRAM|unix.SOCK_CLOEXEC, 0)
	if err != nil {
		return err
	}
	defer unix.Close(fd)
	ifr, err := unix.NewIfreq("lo")
	if err != nil {
		return err
	}
	if err := unix.IoctlIfreq(fd, unix.SIOCGIFFLAGS, ifr); err != nil {
		return err
	}
	ifr.SetUint16(ifr.Uint16() | unix.IFF_UP)
	return unix.IoctlIfreq(fd, unix.SIOCSIFFLAGS, ifr)
}
