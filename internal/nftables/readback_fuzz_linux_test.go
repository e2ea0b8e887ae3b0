package nftables

import (
	"testing"

	"github.com/containernetworking/plugins/pkg/ns"
	"github.com/google/nftables"
	"github.com/google/nftables/expr"

	"github.com/istio-cni-go/istio-cni/internal/testutil"
)

// fuzzExprs turns bytes into the expressions of a rule someone else
// writes into our tables: any the kernel takes, in any order.
func fuzzExprs(data []byte) []expr.Any {
	var out []expr.Any
	next := func() byte {
		if len(data) == 0 {
			return 0
		}
		b := data[0]
		data = data[1:]
		return b
	}
	take := func(n int) []byte {
		if n > len(data) {
			n = len(data)
		}
		b := append([]byte(nil), data[:n]...)
		data = data[n:]
		return b
	}
	for len(data) > 0 && len(out) < 12 {
		switch next() % 9 {
		case 0:
			out = append(out, &expr.Meta{Key: expr.MetaKey(next() % 20), Register: 1})
		case 1:
			out = append(out, &expr.Payload{DestRegister: 1, Base: expr.PayloadBase(next() % 3), Offset: uint32(next() % 40), Len: uint32(1 + next()%16)})
		case 2:
			out = append(out, &expr.Cmp{Op: expr.CmpOp(next() % 6), Register: 1, Data: take(1 + int(next()%16))})
		case 3:
			out = append(out, &expr.Counter{Bytes: uint64(next()), Packets: uint64(next())})
		case 4:
			out = append(out, &expr.Verdict{Kind: expr.VerdictKind(int32(next()%6) - 5)})
		case 5:
			out = append(out, &expr.Immediate{Register: 1, Data: take(1 + int(next()%16))})
		case 6:
			out = append(out, &expr.Bitwise{SourceRegister: 1, DestRegister: 1, Len: 4, Mask: take(4), Xor: take(4)})
		case 7:
			out = append(out, &expr.Ct{Register: 1, Key: expr.CtKey(next() % 20)})
		case 8:
			out = append(out, &expr.Meta{Key: expr.MetaKeyMARK, SourceRegister: true, Register: 1})
		}
	}
	return out
}

// FuzzNftablesReadBack: whatever rule another writer adds to our chains
// (the namespace is the pod's, and other components write there), the
// read-back never panics: CHECK reports the difference, Inspect shows it,
// and a re-ADD puts back exactly the plan.
func FuzzNftablesReadBack(f *testing.F) {
	testutil.RequireRoot(f)
	f.Add([]byte{0, 3, 2, 4, 1, 2, 3, 4})
	f.Add([]byte{1, 0, 9, 4, 2, 0, 2, 0x0a, 0x0b, 4, 0})
	f.Add([]byte{3, 7, 7, 8, 5, 4, 1, 2, 3, 4, 6, 0xff, 0xff, 0, 0, 0, 0, 0, 0})
	plan := planFor(&testing.T{}, testutil.RedirectCases[0], false)
	f.Fuzz(func(t *testing.T, data []byte) {
		n := testutil.NewNS(t)
		a := &Applier{}
		if _, err := a.Apply(n.Path(), plan); err != nil {
			t.Fatal(err)
		}
		added := false
		_ = n.Do(func(ns.NetNS) error {
			conn, err := nftables.New()
			if err != nil {
				return err
			}
			tb := &nftables.Table{Name: TablePrefix + "nat", Family: nftables.TableFamilyINet}
			conn.AddRule(&nftables.Rule{Table: tb, Chain: &nftables.Chain{Name: "istio-output", Table: tb}, Exprs: fuzzExprs(data)})
			// The kernel refuses much of what the bytes make; only what it
			// takes is input to the read-back.
			added = conn.Flush() == nil
			return nil
		})
		if _, err := a.Inspect(n.Path()); err != nil {
			t.Fatalf("Inspect: %v", err)
		}
		err := a.Check(n.Path(), plan)
		if added && err == nil {
			t.Fatal("CHECK passed with another writer's rule in our chain")
		}
		if _, err := a.Apply(n.Path(), plan); err != nil {
			t.Fatalf("re-ADD: %v", err)
		}
		if err := a.Check(n.Path(), plan); err != nil {
			t.Fatalf("CHECK after re-ADD: %v", err)
		}
	})
}
