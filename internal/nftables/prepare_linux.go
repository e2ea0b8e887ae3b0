package nftables

import (
	"errors"
	"fmt"
	"strings"

	"github.com/google/nftables"
	"github.com/mdlayher/netlink"
	"golang.org/x/sys/unix"

	"github.com/istio-cni-go/istio-cni/internal/nlsteps"
	"github.com/istio-cni-go/istio-cni/internal/nsfacts"
	"github.com/istio-cni-go/istio-cni/internal/podnet"
	"github.com/istio-cni-go/istio-cni/internal/ruleset"
)

// preparedTxns are the plans already prepared, by fingerprint.
var preparedTxns = nlsteps.NewCache(4 << 20)

// Prepare returns the requests that give a namespace with none of our
// tables the plan, the same transaction Apply sends there, for a relay
// to send; or, with a nil transaction, why the namespace needs Apply
// instead (it holds tables of ours, or a TPROXY policy rule).
func (a *Applier) Prepare(netnsPath string, plan *ruleset.Plan) (*nlsteps.Txn, string, error) {
	facts, why, err := a.Examine(netnsPath)
	if err != nil || why != "" {
		return nil, why, err
	}
	return a.PrepareFresh(facts, plan)
}

// Examine reads the namespace's facts and says why it cannot take
// prepared requests, "" when it can. It reads only what native nftables
// rules care for (not iptables' tables, ipsets or the user namespace),
// which costs half as much.
func (a *Applier) Examine(netnsPath string) (nsfacts.Facts, string, error) {
	facts, err := nsfacts.ReadFactsForIn(netnsPath, nsfacts.KindNFTables, false)
	return facts, unfit(facts), err
}

// unfit says why a namespace with these facts cannot take prepared
// requests, "" when it can.
func unfit(f nsfacts.Facts) string { return f.Unfit(nsfacts.KindNFTables, false) }

// PrepareFresh returns the requests for a namespace Examine found fit: the
// plan's, prepared once and then taken from the cache.
func (a *Applier) PrepareFresh(_ nsfacts.Facts, plan *ruleset.Plan) (*nlsteps.Txn, string, error) {
	txn, _, err := preparedTxns.Get(plan.Fingerprint(), func() (*nlsteps.Txn, error) { return compile(plan) })
	return txn, "", err
}

// PrepareHere returns the requests for a namespace Examine found fit,
// compiled for a process that sends them itself and then exits (the
// fallback): not kept in the cache, and not bounded by what a relay is
// handed.
func (a *Applier) PrepareHere(_ nsfacts.Facts, plan *ruleset.Plan) (*nlsteps.Txn, string, error) {
	txn, err := compile(plan)
	return txn, "", err
}

// compile records the transaction program and Flush would send for the
// plan, with every table created only if it is not there (the
// transaction fails whole otherwise), then the routing the plan needs.
func compile(plan *ruleset.Plan) (*nlsteps.Txn, error) {
	rs, err := Build(plan)
	if err != nil {
		return nil, err
	}
	return compileRuleset(rs, podnet.RoutingSteps(plan))
}

// compileRuleset records what program and Flush would send for rs into a
// namespace with none of its tables, followed by routing.
func compileRuleset(rs *Ruleset, routing []nlsteps.Step) (*nlsteps.Txn, error) {
	rules := 0
	step, err := recordBatch(func(conn *nftables.Conn) error { return program(conn, rs) },
		func(typ, flags uint16, data []byte) (uint16, string) {
			what := describeMsg(typ, data)
			switch typ & 0xff {
			case unix.NFT_MSG_NEWTABLE:
				flags |= nlsteps.FlagExcl
			case unix.NFT_MSG_NEWRULE:
				if rules < len(rs.Rules) {
					r := rs.Rules[rules]
					what = fmt.Sprintf("rule of %s %s: %s", r.Table, r.Chain, r.Text)
				}
				rules++
			}
			return flags, what
		})
	if err != nil {
		return nil, err
	}
	txn := &nlsteps.Txn{Summary: VariantName}
	if step.Len() > 0 {
		txn.Steps = append(txn.Steps, step)
	}
	txn.Steps = append(txn.Steps, routing...)
	if err := txn.Validate(); err != nil {
		return nil, errors.Join(errors.New("recording the transaction"), err)
	}
	return txn, nil
}

// recordBatch records the one batch the library sends for what queue
// queues, as a step for nlsteps to send over a blocking socket; each
// message's flags and name come from each.
func recordBatch(queue func(*nftables.Conn) error, each func(typ, flags uint16, data []byte) (uint16, string)) (nlsteps.Step, error) {
	step := nlsteps.Step{Proto: unix.NETLINK_NETFILTER, Batch: true}
	record := func(req []netlink.Message) ([]netlink.Message, error) {
		for _, m := range req {
			typ := uint16(m.Header.Type)
			if typ == unix.NFNL_MSG_BATCH_BEGIN || typ == unix.NFNL_MSG_BATCH_END {
				continue
			}
			flags, what := each(typ, uint16(m.Header.Flags), m.Data)
			step.Add(typ, flags, m.Data, what)
		}
		// An acknowledgement for every read the library makes.
		return []netlink.Message{{Header: netlink.Header{Type: netlink.Error}, Data: make([]byte, 4)}}, nil
	}
	conn, err := nftables.New(nftables.WithTestDial(record))
	if err != nil {
		return step, err
	}
	if err := queue(conn); err != nil {
		return step, err
	}
	if err := conn.Flush(); err != nil {
		return step, fmt.Errorf("recording the transaction: %w", err)
	}
	return step, nil
}

// describeMsg names a table, chain or set message by what it makes.
func describeMsg(typ uint16, data []byte) string {
	kind := map[uint16]string{unix.NFT_MSG_NEWTABLE: "table", unix.NFT_MSG_NEWCHAIN: "chain", unix.NFT_MSG_NEWSET: "set",
		unix.NFT_MSG_NEWSETELEM: "elements of set", unix.NFT_MSG_DELSETELEM: "deleting elements of set", unix.NFT_MSG_NEWRULE: "rule"}[typ&0xff]
	if kind == "" {
		kind = fmt.Sprintf("message %d", typ&0xff)
	}
	if len(data) < nlsteps.NfGenLen {
		return kind
	}
	attrs, _ := nlsteps.ParseAttrs(data[nlsteps.NfGenLen:])
	var table, name string
	for _, a := range attrs {
		switch a.Type &^ unix.NLA_F_NESTED {
		case 1: // NFTA_{TABLE_NAME,CHAIN_TABLE,SET_TABLE,SET_ELEM_LIST_TABLE}
			table = strings.TrimRight(string(a.Data), "\x00")
		case 2: // NFTA_SET_NAME, NFTA_SET_ELEM_LIST_SET
			if k := typ & 0xff; k == unix.NFT_MSG_NEWSET || k == unix.NFT_MSG_NEWSETELEM || k == unix.NFT_MSG_DELSETELEM {
				name = strings.TrimRight(string(a.Data), "\x00")
			}
		case 3: // NFTA_CHAIN_NAME
			if typ&0xff == unix.NFT_MSG_NEWCHAIN {
				name = strings.TrimRight(string(a.Data), "\x00")
			}
		}
	}
	if typ&0xff == unix.NFT_MSG_NEWTABLE {
		return "table inet " + table
	}
	return kind + " " + name + " of table inet " + table
}
