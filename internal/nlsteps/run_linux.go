package nlsteps

import (
	"encoding/binary"
	"errors"
	"fmt"
	"os"
	"runtime"
	"slices"
	"strings"
	"time"

	"golang.org/x/sys/unix"
)

// replyTimeout bounds the wait for the kernel's answer to one step: a
// kernel answers a netlink request at once, so this only catches a lost
// reply, which must fail the pod rather than hang it.
const replyTimeout = 10

// Run sends the transaction's steps in order from the calling thread,
// which must be in the pod's network namespace and stay there (a locked
// OS thread). A step the kernel refuses fails the run with the message's
// name and the kernel's words; the undo steps then run, unless a rule
// batch had landed (its rules use what the undo would remove).
func Run(t *Txn) error {
	if err := t.Validate(); err != nil {
		return fmt.Errorf("prepared rules: %w", err)
	}
	batched := false
	for i := range t.Steps {
		err := runStep(&t.Steps[i])
		if err == nil {
			batched = batched || t.Steps[i].Batch
			continue
		}
		undone := ""
		if !batched && len(t.Undo) > 0 {
			for j := range t.Undo {
				_ = runStep(&t.Undo[j])
			}
			undone = "; the undo steps ran"
		}
		if i == 0 {
			return err
		}
		// The kernel took the steps before this one, and whoever reads
		// the error next may find them in the namespace.
		return fmt.Errorf("%w (after the %s, which the kernel took%s)", err, kinds(t.Steps[:i]), undone)
	}
	return nil
}

// kind names what a step's requests are, for errors.
func (s *Step) kind() string {
	switch {
	case s.Batch:
		return "nf_tables transaction"
	case s.Proto == unix.NETLINK_ROUTE:
		return "routing requests"
	case s.Proto == unix.NETLINK_NETFILTER:
		return "ipset requests"
	}
	return "netlink requests"
}

// kinds names the steps' requests, each kind once, in order.
func kinds(steps []Step) string {
	var out []string
	for i := range steps {
		if k := steps[i].kind(); !slices.Contains(out, k) {
			out = append(out, k)
		}
	}
	return strings.Join(out, " and ")
}

// Batch markers of nfnetlink, and the subsystem a batch is for.
const (
	msgBatchBegin = 0x10
	msgBatchEnd   = 0x11
	subsysNFT     = 10
)

func runStep(s *Step) error {
	c, err := Dial(s.Proto)
	if err != nil {
		return err
	}
	defer c.Close()
	return c.Send(s)
}

// send sends the step on the socket fd, numbering its messages from seq,
// and waits for its answers; it returns the next free number.
func send(fd int, s *Step, seq uint32) (uint32, error) {
	buf, waits, batchSeq, next := frame(s, seq)
	if len(buf) > 200<<10 {
		// One sendmsg carries the whole step; the default buffer is
		// about 208 KiB. As root the limit does not apply.
		_ = unix.SetsockoptInt(fd, unix.SOL_SOCKET, unix.SO_SNDBUFFORCE, len(buf)+4096)
	}
	if err := unix.Sendto(fd, buf, 0, &unix.SockaddrNetlink{Family: unix.AF_NETLINK}); err != nil {
		return next, fmt.Errorf("sending %s: %w", s.first(), err)
	}
	return next, s.collect(fd, waits, batchSeq, seq, next)
}

// frame numbers the step's messages from seq (a batch's begin marker
// takes seq and its messages follow) and asks for acknowledgements: of every
// message of a plain step; of only the last of a batch, since the kernel
// reports every refused message anyway and takes a batch whole or not at
// all. It returns the bytes to send, the sequence numbers an answer is
// owed for, the batch's begin (0 when not a batch), and the next free
// number.
func frame(s *Step, seq uint32) (buf []byte, waits map[uint32]bool, batchSeq, next uint32) {
	waits = map[uint32]bool{}
	marker := func(typ uint16) {
		buf = binary.NativeEndian.AppendUint32(buf, HeaderLen+NfGenLen)
		buf = binary.NativeEndian.AppendUint16(buf, typ)
		buf = binary.NativeEndian.AppendUint16(buf, FlagRequest)
		buf = binary.NativeEndian.AppendUint32(buf, seq)
		buf = binary.NativeEndian.AppendUint32(buf, 0)
		buf = append(buf, NfGen(0, subsysNFT)...)
		seq++
	}
	if s.Batch {
		batchSeq = seq
		marker(msgBatchBegin)
	}
	msgs := s.Msgs
	for i := 0; len(msgs) >= HeaderLen; i++ {
		l := int(binary.NativeEndian.Uint32(msgs))
		n := (l + 3) &^ 3
		n = min(n, len(msgs))
		start := len(buf)
		buf = append(buf, msgs[:n]...)
		// No echo: nothing here reads one, and the kernel would dump
		// every echoed message back at commit (google/nftables asks for
		// each rule's, for its handle: half the commit's time for a
		// pod's rules).
		flags := binary.NativeEndian.Uint16(buf[start+6:]) &^ (FlagAck | FlagEcho)
		if !s.Batch || i == s.Len()-1 {
			flags |= FlagAck
			waits[seq] = true
		}
		binary.NativeEndian.PutUint16(buf[start+6:], flags)
		binary.NativeEndian.PutUint32(buf[start+8:], seq)
		binary.NativeEndian.PutUint32(buf[start+12:], 0)
		seq++
		msgs = msgs[n:]
	}
	if s.Batch {
		marker(msgBatchEnd)
	}
	return buf, waits, batchSeq, seq
}

func (s *Step) first() string {
	if len(s.What) == 0 {
		return "nothing"
	}
	if len(s.What) == 1 {
		return s.What[0]
	}
	return fmt.Sprintf("%s and %d more", s.What[0], len(s.What)-1)
}

// collect reads the kernel's answers until every acknowledgement asked
// for has come, and returns the first refusal it names. The step's
// messages were numbered from start up to end; an answer to another
// (one a kept socket's earlier request left) is no answer to these.
func (s *Step) collect(fd int, waits map[uint32]bool, batchSeq, start, end uint32) error {
	first := start // the sequence number of the step's first message
	if batchSeq != 0 {
		first = batchSeq + 1
	}
	rb := make([]byte, 64<<10)
	var refused []string
	for len(waits) > 0 {
		n, _, err := unix.Recvfrom(fd, rb, 0)
		if errors.Is(err, unix.EINTR) {
			continue
		}
		if err != nil {
			if errors.Is(err, unix.EAGAIN) {
				err = fmt.Errorf("no answer from the kernel within %d s", replyTimeout)
			}
			if errors.Is(err, unix.ENOBUFS) {
				err = errors.New("the kernel's answers overflowed the socket")
			}
			return s.refusal(append(refused, err.Error()))
		}
		msgs, err := ParseMessages(rb[:n])
		if err != nil {
			return s.refusal(append(refused, err.Error()))
		}
		for _, m := range msgs {
			if m.Type != unix.NLMSG_ERROR || len(m.Body) < 4 || m.Seq < start || m.Seq >= end {
				continue
			}
			errno := -int32(binary.NativeEndian.Uint32(m.Body))
			delete(waits, m.Seq)
			if errno == 0 || (s.ExistOK && unix.Errno(errno) == unix.EEXIST) {
				continue
			}
			if m.Seq == batchSeq && batchSeq != 0 {
				// The whole batch was refused before any message of it
				// ran (no permission): nothing else will come.
				return s.refusal(append(refused, fmt.Sprintf("the transaction: %s", kernelWords(m.Body, errno))))
			}
			what := "a message"
			if i := int(m.Seq) - int(first); i >= 0 && i < len(s.What) {
				what = s.What[i]
			}
			refused = append(refused, fmt.Sprintf("%s: %s", what, kernelWords(m.Body, errno)))
		}
	}
	if len(refused) > 0 {
		return s.refusal(refused)
	}
	return nil
}

func (s *Step) refusal(refused []string) error {
	kind := s.kind()
	if s.Batch {
		kind += " (nothing of it applied)"
	}
	if len(refused) > 3 {
		refused = append(refused[:3], fmt.Sprintf("%d more", len(refused)-3))
	}
	return fmt.Errorf("the kernel refused the %s: %s", kind, strings.Join(refused, "; "))
}

// kernelWords is an error answer's errno, with the kernel's extended
// message when it gave one.
func kernelWords(body []byte, errno int32) string {
	return refusal(Message{Type: unix.NLMSG_ERROR, Body: body}, errno).Error()
}

// RunIn runs the transaction from the calling goroutine's thread inside
// the network namespace netns (InNetNS).
func RunIn(netns *os.File, t *Txn) (took time.Duration, err error) {
	start := time.Now()
	err = InNetNS(netns, func() error {
		err := Run(t)
		took = time.Since(start)
		return err
	})
	if took == 0 {
		took = time.Since(start)
	}
	return took, err
}

// InNetNS runs fn on the calling goroutine's thread, which enters the
// network namespace netns for it and returns to its own after: the
// process's other threads, and its sockets, stay where they were. No
// other goroutine or thread is woken for it (the CNI library's ns.Do
// starts a goroutine, whose thread handoffs cost a pod start tens of
// microseconds on an idle VM). A thread that cannot return is left to end
// with its goroutine (Go then ends it rather than run other code there).
// The thread returns even when fn panics, so a caller that recovers goes
// on in its own namespace.
func InNetNS(netns *os.File, fn func() error) (err error) {
	runtime.LockOSThread()
	own, err := os.Open("/proc/thread-self/ns/net")
	if err != nil {
		runtime.UnlockOSThread()
		return fmt.Errorf("reading this thread's network namespace: %w", err)
	}
	defer own.Close()
	if err := unix.Setns(int(netns.Fd()), unix.CLONE_NEWNET); err != nil {
		runtime.UnlockOSThread()
		return fmt.Errorf("entering the pod's network namespace: %w", err)
	}
	defer func() {
		if rerr := unix.Setns(int(own.Fd()), unix.CLONE_NEWNET); rerr != nil {
			// Locked for good: see above.
			err = errors.Join(err, fmt.Errorf("returning from the pod's network namespace: %w", rerr))
			return
		}
		runtime.UnlockOSThread()
	}()
	return fn()
}
