// Package nlsteps carries a pod's rules as prepared netlink requests: the
// node agent, which knows the pod and has the rule backends, builds them;
// the relay, the short-lived istio-cni process the runtime starts in its
// own cgroup, sends them from inside the pod's network namespace. The
// relay then spends on a pod only what the kernel needs, one socket per
// step, with no rule backend, binary or library of its own.
//
// The package imports the standard library and x/sys/unix only, since
// every relay start pays for what it links.
package nlsteps

import (
	"encoding/binary"
	"fmt"
	"strings"
	"time"
)

// Txn is what takes a pod's namespace from none of our rules to its plan.
type Txn struct {
	// Steps run in order; the first that fails stops the rest.
	Steps []Step `json:"steps"`
	// Undo runs, best effort, when a step fails: it removes what earlier
	// steps made that the failed one would have used (sets a refused
	// rule batch referred to).
	Undo []Step `json:"undo,omitempty"`
	// Summary says what the transaction holds, for log lines.
	Summary string `json:"summary,omitempty"`
	// Oversize, when set, stands for a transaction of that many bytes,
	// over MaxTxn, whose requests were dropped: it is never sent.
	Oversize int `json:"-"`
}

// Outcome is the sender's report of a transaction, for the agent's log
// line and metrics.
type Outcome struct {
	// Error, when set, is why the pod got no rules (its ADD fails).
	Error string `json:"error,omitempty"`
	// Took is the time from entering the namespace to the kernel's last
	// answer.
	Took time.Duration `json:"took"`
	// CPU is the sending process's CPU time from its start to the
	// report: what the pod's start cost in the runtime's cgroup, beside
	// the primary plugin's (the agent logs it as plugin_cpu).
	CPU time.Duration `json:"cpu,omitempty"`
}

// Step is the requests of one netlink socket.
type Step struct {
	// Proto is the netlink protocol (unix.NETLINK_NETFILTER or
	// unix.NETLINK_ROUTE).
	Proto int `json:"proto"`
	// Batch makes the messages one nf_tables transaction: the kernel
	// takes all of them or none.
	Batch bool `json:"batch,omitempty"`
	// ExistOK counts EEXIST as success, for requests that ensure
	// something (an address, a policy rule) another writer may have made.
	ExistOK bool `json:"existOK,omitempty"`
	// Msgs are complete netlink messages, back to back; the sender
	// numbers them.
	Msgs []byte `json:"msgs"`
	// What names each message, in order, for errors.
	What []string `json:"what"`
}

// Len is the number of messages the step holds.
func (s *Step) Len() int { return len(s.What) }

// Header sizes of a netlink message and of nfnetlink's generic header.
const (
	HeaderLen = 16
	NfGenLen  = 4
)

// Message flags, as the kernel spells them.
const (
	FlagRequest = 0x1
	FlagAck     = 0x4
	FlagEcho    = 0x8
	FlagReplace = 0x100
	FlagExcl    = 0x200
	FlagCreate  = 0x400
	FlagAppend  = 0x800
)

// Add appends one message to the step: its type and flags, and its body
// (everything after the netlink header).
func (s *Step) Add(typ, flags uint16, body []byte, what string) {
	b := binary.NativeEndian.AppendUint32(s.Msgs, uint32(HeaderLen+len(body)))
	b = binary.NativeEndian.AppendUint16(b, typ)
	b = binary.NativeEndian.AppendUint16(b, flags|FlagRequest)
	b = binary.NativeEndian.AppendUint32(b, 0) // seq, set by the sender
	b = binary.NativeEndian.AppendUint32(b, 0) // port id, the kernel's
	b = append(b, body...)
	for len(b)%4 != 0 {
		b = append(b, 0)
	}
	s.Msgs = b
	s.What = append(s.What, what)
}

// NfGen is nfnetlink's generic header: the family, version 0, and the
// resource id (big endian).
func NfGen(family uint8, res uint16) []byte {
	return []byte{family, 0, byte(res >> 8), byte(res)}
}

// Attr appends one attribute, padded as netlink wants.
func Attr(b []byte, typ uint16, data []byte) []byte {
	b = binary.NativeEndian.AppendUint16(b, uint16(4+len(data)))
	b = binary.NativeEndian.AppendUint16(b, typ)
	b = append(b, data...)
	for len(b)%4 != 0 {
		b = append(b, 0)
	}
	return b
}

// Attribute is one netlink attribute: its type with the flags, and its
// payload.
type Attribute struct {
	Type uint16
	Data []byte
}

// ParseAttrs splits a run of attributes; a truncated one ends the run
// with an error.
func ParseAttrs(b []byte) ([]Attribute, error) {
	var out []Attribute
	for len(b) > 0 {
		if len(b) < 4 {
			return out, fmt.Errorf("netlink attribute truncated: %d bytes left", len(b))
		}
		l := int(binary.NativeEndian.Uint16(b))
		if l < 4 || l > len(b) {
			return out, fmt.Errorf("netlink attribute of length %d in %d bytes", l, len(b))
		}
		out = append(out, Attribute{Type: binary.NativeEndian.Uint16(b[2:]), Data: b[4:l]})
		next := (l + 3) &^ 3
		if next > len(b) {
			next = len(b)
		}
		b = b[next:]
	}
	return out, nil
}

// Message is one parsed netlink message.
type Message struct {
	Type, Flags uint16
	Seq         uint32
	Body        []byte
}

// ParseMessages splits a buffer of netlink messages.
func ParseMessages(b []byte) ([]Message, error) {
	var out []Message
	for len(b) > 0 {
		if len(b) < HeaderLen {
			return out, fmt.Errorf("netlink message truncated: %d bytes left", len(b))
		}
		l := int(binary.NativeEndian.Uint32(b))
		if l < HeaderLen || l > len(b) {
			return out, fmt.Errorf("netlink message of length %d in %d bytes", l, len(b))
		}
		out = append(out, Message{Type: binary.NativeEndian.Uint16(b[4:]), Flags: binary.NativeEndian.Uint16(b[6:]),
			Seq: binary.NativeEndian.Uint32(b[8:]), Body: b[HeaderLen:l]})
		next := (l + 3) &^ 3
		if next > len(b) {
			next = len(b)
		}
		b = b[next:]
	}
	return out, nil
}

// Validate checks what the relay is about to send: every step's messages
// parse, are requests, and are named. The agent builds them; this stops a
// version skew or a bug from reaching the kernel as garbage.
func (t *Txn) Validate() error {
	if t.Oversize > 0 {
		// Its requests were dropped (Cache): sending nothing would
		// report rules that are not there. (No steps at all is a plan
		// with nothing to write: a pod in NONE mode.)
		return fmt.Errorf("the transaction of %d bytes was kept as its size alone (over %d)", t.Oversize, MaxTxn)
	}
	for _, steps := range [][]Step{t.Steps, t.Undo} {
		for i := range steps {
			s := &steps[i]
			msgs, err := ParseMessages(s.Msgs)
			if err != nil {
				return fmt.Errorf("step %d: %w", i, err)
			}
			if len(msgs) != len(s.What) || len(msgs) == 0 {
				return fmt.Errorf("step %d holds %d messages for %d names", i, len(msgs), len(s.What))
			}
			for _, m := range msgs {
				if m.Flags&FlagRequest == 0 {
					return fmt.Errorf("step %d: message type %d is not a request", i, m.Type)
				}
			}
		}
	}
	return nil
}

// Describe lists the steps' messages, one line each, for tests and
// diagnostics.
func (t *Txn) Describe() string {
	var b strings.Builder
	for _, s := range t.Steps {
		fmt.Fprintf(&b, "proto %d batch=%v existOK=%v\n", s.Proto, s.Batch, s.ExistOK)
		for _, w := range s.What {
			b.WriteString("  " + w + "\n")
		}
	}
	return b.String()
}

// BinaryForm starts a transaction's binary form and names it: a relay
// says which form it reads, so an agent of another release never hands it
// one it cannot decode.
const BinaryForm = "NLS1"

const binaryMagic = BinaryForm

// MarshalBinary is the transaction in the form the relay reads: decoding
// JSON is a good part of a short-lived process's first millisecond, and
// this form needs none of it.
func (t *Txn) MarshalBinary() ([]byte, error) {
	b := append([]byte(nil), binaryMagic...)
	b = appendString(b, t.Summary)
	for _, steps := range [][]Step{t.Steps, t.Undo} {
		b = binary.LittleEndian.AppendUint32(b, uint32(len(steps)))
		for _, s := range steps {
			var flags byte
			if s.Batch {
				flags |= 1
			}
			if s.ExistOK {
				flags |= 2
			}
			b = binary.LittleEndian.AppendUint32(b, uint32(s.Proto))
			b = append(b, flags)
			b = appendString(b, string(s.Msgs))
			b = binary.LittleEndian.AppendUint32(b, uint32(len(s.What)))
			for _, w := range s.What {
				b = appendString(b, w)
			}
		}
	}
	return b, nil
}

func appendString(b []byte, s string) []byte {
	b = binary.LittleEndian.AppendUint32(b, uint32(len(s)))
	return append(b, s...)
}

// UnmarshalBinary reads MarshalBinary's form; anything short or left over
// is an error.
func (t *Txn) UnmarshalBinary(data []byte) error {
	r := &reader{b: data}
	if string(r.take(len(binaryMagic))) != binaryMagic {
		return fmt.Errorf("prepared rules: not a transaction")
	}
	t.Summary = string(r.bytes())
	for _, steps := range []*[]Step{&t.Steps, &t.Undo} {
		n := r.count(9)
		*steps = nil
		for i := 0; i < n && r.err == nil; i++ {
			s := Step{Proto: int(r.u32())}
			flags := r.take(1)
			if len(flags) == 1 {
				if flags[0]&^3 != 0 {
					r.err = fmt.Errorf("unknown step flags %#x", flags[0])
				}
				s.Batch, s.ExistOK = flags[0]&1 != 0, flags[0]&2 != 0
			}
			s.Msgs = r.bytes()
			for w := r.count(4); w > 0 && r.err == nil; w-- {
				s.What = append(s.What, string(r.bytes()))
			}
			*steps = append(*steps, s)
		}
	}
	if r.err == nil && len(r.b) > 0 {
		r.err = fmt.Errorf("%d bytes after the transaction", len(r.b))
	}
	if r.err != nil {
		return fmt.Errorf("prepared rules: %w", r.err)
	}
	return nil
}

type reader struct {
	b   []byte
	err error
}

func (r *reader) take(n int) []byte {
	if r.err != nil {
		return nil
	}
	if n < 0 || n > len(r.b) {
		r.err = fmt.Errorf("truncated: %d bytes wanted, %d left", n, len(r.b))
		return nil
	}
	out := r.b[:n]
	r.b = r.b[n:]
	return out
}

func (r *reader) u32() uint32 {
	b := r.take(4)
	if len(b) < 4 {
		return 0
	}
	return binary.LittleEndian.Uint32(b)
}

func (r *reader) bytes() []byte { return r.take(int(r.u32())) }

// count reads a count of items of at least least bytes each, refusing
// one the data left cannot hold.
func (r *reader) count(least int) int {
	n := int(r.u32())
	if r.err == nil && n*least > len(r.b) {
		r.err = fmt.Errorf("%d items in %d bytes", n, len(r.b))
		return 0
	}
	return n
}
