package origdst

import (
	"fmt"
	"net"
	"net/netip"
	"os/exec"
	"strconv"
	"testing"

	"github.com/containernetworking/plugins/pkg/ns"

	"github.com/istio-cni-go/istio-cni/internal/testutil"
)

// TestGet redirects a connection with netfilter, as a sidecar's rules do,
// and reads back where it was going, for both families.
func TestGet(t *testing.T) {
	testutil.RequireRoot(t)
	testutil.RequireTools(t, "iptables", "ip6tables")
	for _, tc := range []struct {
		name, iptables, listen string
		// dial is a destination nothing listens on; the rule sends it to
		// the listener instead.
		dial netip.AddrPort
	}{
		{"ipv4", "iptables", "127.0.0.1:0", netip.MustParseAddrPort("127.0.0.7:81")},
		{"ipv6", "ip6tables", "[::1]:0", netip.MustParseAddrPort("[::1]:81")},
	} {
		t.Run(tc.name, func(t *testing.T) {
			n := testutil.NewNS(t)
			err := n.Do(func(ns.NetNS) error {
				l, err := net.Listen("tcp", tc.listen)
				if err != nil {
					return err
				}
				defer l.Close()
				port := strconv.Itoa(l.Addr().(*net.TCPAddr).Port)
				if out, err := exec.Command(tc.iptables, "-t", "nat", "-A", "OUTPUT", "-p", "tcp", "-d", tc.dial.Addr().String(),
					"--dport", strconv.Itoa(int(tc.dial.Port())), "-j", "REDIRECT", "--to-ports", port).CombinedOutput(); err != nil {
					return fmt.Errorf("%s: %w: %s", tc.iptables, err, out)
				}
				c, err := net.Dial("tcp", tc.dial.String())
				if err != nil {
					return err
				}
				defer c.Close()
				a, err := l.Accept()
				if err != nil {
					return err
				}
				defer a.Close()
				got, err := Get(a)
				if err != nil {
					return fmt.Errorf("Get: %w", err)
				}
				if got != tc.dial {
					return fmt.Errorf("Get = %s, want %s (accepted on %s)", got, tc.dial, a.LocalAddr())
				}
				return nil
			})
			if err != nil {
				t.Fatal(err)
			}
		})
	}
}

func TestGetNotTCP(t *testing.T) {
	a, b := net.Pipe()
	defer a.Close()
	defer b.Close()
	if _, err := Get(a); err == nil {
		t.Error("Get of a pipe: want an error")
	}
}
