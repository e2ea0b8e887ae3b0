package nlsteps

import (
	"testing"

	"golang.org/x/sys/unix"
)

// TestFrame: a batch goes out between its markers, numbered from 1, with
// an acknowledgement asked for its last message only, and no message asks
// for an echo, though a recorded one did (google/nftables asks for every
// rule's).
func TestFrame(t *testing.T) {
	s := &Step{Proto: unix.NETLINK_NETFILTER, Batch: true}
	for i, flags := range []uint16{FlagCreate | FlagEcho, FlagCreate | FlagAppend | FlagEcho | FlagAck, FlagCreate} {
		s.Add(unix.NFNL_SUBSYS_NFTABLES<<8|unix.NFT_MSG_NEWRULE, flags, NfGen(unix.NFPROTO_INET, 0), string(rune('a'+i)))
	}
	buf, waits, batchSeq, next := frame(s, 1)
	msgs, err := ParseMessages(buf)
	if err != nil {
		t.Fatal(err)
	}
	if len(msgs) != 5 || msgs[0].Type != msgBatchBegin || msgs[4].Type != msgBatchEnd || batchSeq != 1 {
		t.Fatalf("%d messages, first type %d, last type %d, batch sequence %d", len(msgs), msgs[0].Type, msgs[len(msgs)-1].Type, batchSeq)
	}
	for i, m := range msgs {
		if m.Seq != uint32(i+1) {
			t.Errorf("message %d has sequence %d", i, m.Seq)
		}
		if m.Flags&FlagEcho != 0 {
			t.Errorf("message %d asks for an echo (flags %#x)", i, m.Flags)
		}
		if want := i == 3; (m.Flags&FlagAck != 0) != want || waits[m.Seq] != want {
			t.Errorf("message %d: flags %#x, waited for %v", i, m.Flags, waits[m.Seq])
		}
	}
	if msgs[2].Flags != FlagRequest|FlagCreate|FlagAppend {
		t.Errorf("the second rule's flags became %#x", msgs[2].Flags)
	}
	if next != 6 {
		t.Errorf("next free number %d, want 6", next)
	}
	// On a kept socket the numbers go on from its last request.
	buf, waits, batchSeq, next = frame(s, 41)
	if msgs, err = ParseMessages(buf); err != nil {
		t.Fatal(err)
	}
	if batchSeq != 41 || msgs[0].Seq != 41 || msgs[4].Seq != 45 || !waits[44] || len(waits) != 1 || next != 46 {
		t.Errorf("numbered from 41: batch %d, first %d, last %d, waits %v, next %d", batchSeq, msgs[0].Seq, msgs[4].Seq, waits, next)
	}
}
