package nlsteps_test

import (
	"encoding/binary"
	"errors"
	"net/netip"
	"strings"
	"testing"

	"golang.org/x/sys/unix"

	"github.com/istio-cni-go/istio-cni/internal/nlsteps"
	"github.com/istio-cni-go/istio-cni/internal/testutil"
)

// ifinfo is an ifinfomsg asking about the link of index (0: all).
func ifinfo(index int32) []byte {
	b := make([]byte, unix.SizeofIfInfomsg)
	binary.NativeEndian.PutUint32(b[4:], uint32(index))
	return b
}

// addrMsg is a request body that adds addr/bits to lo (index 1).
func addrMsg(addr netip.Addr, bits uint8) []byte {
	b := []byte{unix.AF_INET, bits, 0, unix.RT_SCOPE_HOST}
	b = binary.NativeEndian.AppendUint32(b, 1)
	return nlsteps.Attr(b, unix.IFA_LOCAL, addr.AsSlice())
}

// linkNames reads the link names of RTM_NEWLINK answers.
func linkNames(t *testing.T, msgs []nlsteps.Message) []string {
	t.Helper()
	var out []string
	for _, m := range msgs {
		if m.Type != unix.RTM_NEWLINK || len(m.Body) < unix.SizeofIfInfomsg {
			t.Fatalf("answer of type %d, %d bytes", m.Type, len(m.Body))
		}
		attrs, err := nlsteps.ParseAttrs(m.Body[unix.SizeofIfInfomsg:])
		if err != nil {
			t.Fatal(err)
		}
		for _, a := range attrs {
			if a.Type == unix.IFLA_IFNAME {
				out = append(out, string(a.Data[:len(a.Data)-1]))
			}
		}
	}
	return out
}

// TestConn: a request's reply comes back without its acknowledgement
// and the next request on the socket gets its own answers; a dump
// spread over many reads comes back whole; a refusal carries its errno
// and the kernel's words; every answer is from the namespace the socket
// was made in.
func TestConn(t *testing.T) {
	testutil.RequireRoot(t)
	pod, f := podNS(t)
	var c *nlsteps.Conn
	if err := nlsteps.InNetNS(f, func() (err error) { c, err = nlsteps.Dial(unix.NETLINK_ROUTE); return err }); err != nil {
		t.Fatal(err)
	}
	defer c.Close()

	// lo, by index: one reply, then the acknowledgement Request asked
	// for, which it reads and does not return.
	for range 2 {
		msgs, err := c.Request(unix.RTM_GETLINK, 0, ifinfo(1))
		if err != nil {
			t.Fatal(err)
		}
		if names := linkNames(t, msgs); len(names) != 1 || names[0] != "lo" {
			t.Fatalf("link 1 is %v", names)
		}
	}

	_, err := c.Request(unix.RTM_GETLINK, 0, ifinfo(4242))
	var r *nlsteps.Refusal
	if !errors.As(err, &r) || !errors.Is(err, unix.ENODEV) {
		t.Fatalf("a link that is not there: %v", err)
	}
	_, err = c.Request(unix.RTM_NEWADDR, unix.NLM_F_CREATE|unix.NLM_F_EXCL, addrMsg(netip.MustParseAddr("10.9.0.1"), 33))
	if !errors.As(err, &r) || r.Errno != unix.EINVAL || r.Msg == "" {
		t.Fatalf("an address of prefix length 33: want EINVAL with the kernel's words, got %#v", err)
	}

	// 3,000 addresses on lo: their dump takes many reads, each of many
	// messages.
	const n = 3000
	base := netip.MustParseAddr("10.9.0.0")
	a := base
	for range n {
		a = a.Next()
		if _, err := c.Request(unix.RTM_NEWADDR, unix.NLM_F_CREATE|unix.NLM_F_EXCL, addrMsg(a, 32)); err != nil {
			t.Fatalf("adding %s: %v", a, err)
		}
	}
	msgs, err := c.Request(unix.RTM_GETADDR, unix.NLM_F_DUMP, []byte{unix.AF_INET, 0, 0, 0, 0, 0, 0, 0})
	if err != nil {
		t.Fatal(err)
	}
	seen := map[netip.Addr]bool{}
	for _, m := range msgs {
		attrs, err := nlsteps.ParseAttrs(m.Body[unix.SizeofIfAddrmsg:])
		if err != nil {
			t.Fatal(err)
		}
		for _, at := range attrs {
			if at.Type == unix.IFA_LOCAL {
				ip, _ := netip.AddrFromSlice(at.Data)
				seen[ip] = true
			}
		}
	}
	a = base
	for range n {
		a = a.Next()
		if !seen[a] {
			t.Fatalf("the dump of %d messages lacks %s", len(msgs), a)
		}
	}
	if !seen[netip.MustParseAddr("127.0.0.1")] || len(seen) != n+1 {
		t.Fatalf("the dump holds %d addresses, want lo's and the %d added", len(seen), n)
	}
	if out := testutil.RunIn(t, pod, "ip", "-4", "-o", "addr", "show", "dev", "lo"); strings.Count(out, " 10.9.") != n {
		t.Fatalf("the pod's namespace holds %d of the addresses", strings.Count(out, " 10.9."))
	}
}
