package nlsteps

import (
	"bytes"
	"reflect"
	"testing"
)

// TestBinaryRoundTrip: the relay reads back exactly what the agent wrote,
// and refuses what is cut short or has bytes after it.
func TestBinaryRoundTrip(t *testing.T) {
	a := Step{Proto: 12, Batch: true}
	a.Add(0xa00, FlagCreate, []byte{2, 0, 0, 0, 9}, "table ip nat")
	a.Add(0xa06, FlagAppend, []byte{2, 0, 0, 0}, "rule")
	b := Step{Proto: 0, ExistOK: true}
	b.Add(20, FlagExcl, []byte{10, 128, 0, 0}, "address")
	in := &Txn{Steps: []Step{a, b}, Undo: []Step{b}, Summary: "iptables-nft"}
	data, err := in.MarshalBinary()
	if err != nil {
		t.Fatal(err)
	}
	var out Txn
	if err := out.UnmarshalBinary(data); err != nil {
		t.Fatal(err)
	}
	if !reflect.DeepEqual(in, &out) {
		t.Fatalf("round trip:\n%+v\n%+v", in, &out)
	}
	for n := 0; n < len(data); n++ {
		if err := new(Txn).UnmarshalBinary(data[:n]); err == nil {
			t.Fatalf("%d of %d bytes decoded", n, len(data))
		}
	}
	if err := new(Txn).UnmarshalBinary(append(data, 0)); err == nil {
		t.Fatal("a trailing byte decoded")
	}
}

// FuzzUnmarshalBinary: no input panics or allocates without bound, and
// what decodes encodes back to the same bytes.
func FuzzUnmarshalBinary(f *testing.F) {
	s := Step{Proto: 12, Batch: true}
	s.Add(1, 0, []byte{1, 2, 3, 4}, "x")
	seed, _ := (&Txn{Steps: []Step{s}, Summary: "s"}).MarshalBinary()
	f.Add(seed)
	f.Add([]byte(binaryMagic + "\x00\x00\x00\x00\xff\xff\xff\xff"))
	f.Fuzz(func(t *testing.T, data []byte) {
		var txn Txn
		if txn.UnmarshalBinary(data) != nil {
			return
		}
		again, err := txn.MarshalBinary()
		if err != nil || !bytes.Equal(again, data) {
			t.Fatalf("decoded input does not encode back: %x vs %x", again, data)
		}
	})
}

// TestValidateRefusesSizeAlone: a transaction kept as its size alone
// (Cache, over MaxTxn) is refused before anything is sent, so that no
// caller reports rules it never sent; one with no steps (a plan with
// nothing to write) is not.
func TestValidateRefusesSizeAlone(t *testing.T) {
	if err := (&Txn{Summary: "nftables", Oversize: MaxTxn + 1}).Validate(); err == nil {
		t.Error("a transaction kept as its size alone validated")
	}
	if err := (&Txn{Summary: "nftables"}).Validate(); err != nil {
		t.Errorf("a transaction with nothing to write: %v", err)
	}
}
