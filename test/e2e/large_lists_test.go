package e2e

import (
	"context"
	"fmt"
	"net"
	"net/netip"
	"os"
	"path/filepath"
	"strconv"
	"sync/atomic"
	"testing"
	"time"

	"github.com/containernetworking/plugins/pkg/netlinksafe"
	"github.com/containernetworking/plugins/pkg/ns"
	"github.com/vishvananda/netlink"

	"github.com/istio-cni-go/istio-cni/internal/cniserver"
	"github.com/istio-cni-go/istio-cni/internal/testenv"
)

// listSizes are the list lengths the traffic matrix sends traffic through:
// one entry (Istio's rule-per-entry shape), 50 (where native nftables used
// to fail), and 1,000 and 5,000 (the sizes of the pod start-up issue).
var listSizes = []int{1, 50, 1000, 5000}

// TestLargeLists sends real traffic through pods whose every list-valued
// setting has N entries, on each backend, through the node agent and
// through the fallback plugin, for IPv4 and IPv6 at once (dual-stack
// pods). One pod carries every exclude list, another every include list;
// for the first, a middle and the last entry of each, traffic must take
// the way the list says, and traffic just outside the list the other.
func TestLargeLists(t *testing.T) {
	noNodeDAD(t)
	addListAddrs(t)
	for _, path := range []string{"fallback", "agent"} {
		for _, variant := range []string{"nft", "legacy", "nftables"} {
			t.Run(path+"/"+variant, func(t *testing.T) {
				e := backendEnv(t, path, variant)
				for _, n := range listSizes {
					t.Run(strconv.Itoa(n), func(t *testing.T) {
						l := testenv.Lists{N: n}
						t.Run("exclude", func(t *testing.T) { excludeTraffic(t, e, l) })
						t.Run("include", func(t *testing.T) { includeTraffic(t, e, l) })
					})
				}
			})
		}
	}
}

// backendEnv is a node whose plugin uses the backend, served by the agent's
// CNI server or, with no agent, by the fallback plugin.
func backendEnv(t *testing.T, path, variant string) *env {
	t.Helper()
	var conf map[string]any
	if variant == "nftables" {
		conf = map[string]any{"native_nftables": true}
		// No firewall binary reachable: only ip, for the test itself.
		bin := t.TempDir()
		if err := os.Symlink("/usr/sbin/ip", filepath.Join(bin, "ip")); err != nil {
			t.Fatal(err)
		}
		t.Setenv("PATH", bin)
	} else {
		t.Setenv("FORCE_IPTABLES_BINARY", variant)
	}
	e := newEnv(t, conf)
	switch path {
	case "agent":
		e.serveCNI(variant)
	case "agent-commits":
		e.serveCNIWith(variant, cniserver.CommitterAgent)
	case "prepared":
		e.prepare = true
		e.serveCNI(variant)
		e.learnConfig()
	}
	return e
}

// addListAddrs puts on the node's lo every address a list test expects
// to reach directly: inside the probed entries (the exclude pod goes
// there directly) and just outside the lists (the include pod does).
// They are in ranges no real network uses, in the node namespace that
// has no uplink.
func addListAddrs(t *testing.T) {
	t.Helper()
	lo, err := netlinksafe.LinkByName("lo")
	if err != nil {
		t.Fatal(err)
	}
	var addrs []netip.Addr
	for _, n := range listSizes {
		l := testenv.Lists{N: n}
		for _, v6 := range []bool{false, true} {
			for _, i := range l.Probes() {
				addrs = append(addrs, l.Inside(v6, i))
			}
			addrs = append(addrs, l.Outside(v6, n-1))
		}
	}
	for _, a := range addrs {
		addr := &netlink.Addr{IPNet: netipNet(a)}
		if err := netlink.AddrAdd(lo, addr); err != nil && !os.IsExist(err) {
			t.Fatalf("adding %s to the node's lo: %v", a, err)
		}
		t.Cleanup(func() { _ = netlink.AddrDel(lo, addr) })
	}
}

// noNodeDAD turns duplicate address detection off for the node's new
// interfaces while the test runs, as the pods have it: the node's end of
// each pod's veth would hold its IPv6 address tentative for a second or
// two, and every first IPv6 connection would wait for a SYN retransmit.
func noNodeDAD(t *testing.T) {
	t.Helper()
	const knob = "/proc/sys/net/ipv6/conf/default/accept_dad"
	old, err := os.ReadFile(knob)
	if err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(knob, []byte("0"), 0o644); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = os.WriteFile(knob, old, 0o644) })
}

func netipNet(a netip.Addr) *net.IPNet {
	return &net.IPNet{IP: a.AsSlice(), Mask: net.CIDRMask(a.BitLen(), a.BitLen())}
}

// family is what a traffic check needs to know of one IP family.
type family struct {
	v6                        bool
	network, any15001, any15k string
}

var families = []family{
	{false, "tcp4", "0.0.0.0:15001", "0.0.0.0:15006"},
	{true, "tcp6", "[::]:15001", "[::]:15006"},
}

func (f family) podAddr(sb *sandbox) netip.Addr {
	if f.v6 {
		return sb.v6
	}
	return sb.v4
}

func (f family) remote() netip.Addr {
	if f.v6 {
		return netip.MustParseAddr(testenv.RemoteV6)
	}
	return netip.MustParseAddr(testenv.RemoteV4)
}

func (f family) anyPort(port int) string {
	if f.v6 {
		return fmt.Sprintf("[::]:%d", port)
	}
	return fmt.Sprintf("0.0.0.0:%d", port)
}

// listPod starts a dual-stack sidecar pod with the annotations and
// checks that CHECK agrees with what ADD programmed.
func listPod(t *testing.T, e *env, ann map[string]string) *sandbox {
	t.Helper()
	sb := e.add(&testenv.PodSpec{Sidecar: true, Annotations: ann, ProxyEnv: map[string]string{"ISTIO_DUAL_STACK": "true"}})
	if err := e.node.Check(context.Background(), e.node.Chained, sb.pod); err != nil {
		t.Fatalf("CHECK right after ADD: %v", err)
	}
	return sb
}

// captured asserts that a connection from the pod to dst arrives at the
// proxy's outbound port with dst as its original destination.
func captured(t *testing.T, sb *sandbox, f family, dst netip.AddrPort) {
	t.Helper()
	expectRedirect(t, sb.pod, f.network, f.any15001, dst, func() (net.Conn, error) {
		return testenv.Dial(sb.pod, f.network, dst.String())
	})
}

// direct asserts that a connection from the pod to dst reaches a
// listener on the node at dst: not redirected.
func direct(t *testing.T, sb *sandbox, f family, dst netip.AddrPort) {
	t.Helper()
	expectDirect(t, dst.String(), dialPing(sb.pod, f.network, dst.String()))
}

// inboundCaptured asserts that a connection from the node to the pod's
// port arrives at the proxy's inbound port.
func inboundCaptured(t *testing.T, sb *sandbox, f family, port int) {
	t.Helper()
	target := netip.AddrPortFrom(f.podAddr(sb), uint16(port))
	expectRedirect(t, sb.pod, f.network, f.any15k, target, func() (net.Conn, error) {
		return testenv.Dial(nil, f.network, target.String())
	})
}

// inboundDirect asserts that a connection from the node to the pod's
// port reaches the app listening on it.
func inboundDirect(t *testing.T, sb *sandbox, f family, port int) {
	t.Helper()
	l, err := testenv.Listen(sb.pod, f.network, f.anyPort(port), false)
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	target := netip.AddrPortFrom(f.podAddr(sb), uint16(port))
	c, err := testenv.Dial(nil, f.network, target.String())
	if err != nil {
		t.Fatalf("dial %s: %v", target, err)
	}
	defer c.Close()
	got, err := testenv.Accept(l, 5*time.Second)
	if err != nil {
		t.Fatalf("connection to %s did not reach the app: %v", target, err)
	}
	got.Close()
}

// excludeTraffic: the first, a middle and the last excluded CIDR, port
// and inbound port are left alone; just outside each list is captured.
// The last excluded interface is a real one, which traffic leaves by
// directly.
func excludeTraffic(t *testing.T, e *env, l testenv.Lists) {
	iface := vethName()
	sb := listPod(t, e, l.ExcludeAnnotations(iface))
	last := l.N - 1
	for _, f := range families {
		t.Run(f.network, func(t *testing.T) {
			for _, i := range l.Probes() {
				direct(t, sb, f, netip.AddrPortFrom(l.Inside(f.v6, i), 80))
				direct(t, sb, f, netip.AddrPortFrom(f.remote(), uint16(l.Port(i))))
				inboundDirect(t, sb, f, l.Port(i))
			}
			captured(t, sb, f, netip.AddrPortFrom(l.Outside(f.v6, last), 80))
			captured(t, sb, f, netip.AddrPortFrom(f.remote(), uint16(l.OutsidePort(last))))
			inboundCaptured(t, sb, f, l.OutsidePort(last))
		})
	}
	t.Run("interface", func(t *testing.T) {
		node := vethToNode(t, sb, iface)
		direct(t, sb, families[0], netip.AddrPortFrom(node, 80))
	})
}

// includeTraffic: the first, a middle and the last included CIDR, port
// and inbound port are captured; just outside each list is not.
func includeTraffic(t *testing.T, e *env, l testenv.Lists) {
	sb := listPod(t, e, l.IncludeAnnotations())
	last := l.N - 1
	for _, f := range families {
		t.Run(f.network, func(t *testing.T) {
			for _, i := range l.Probes() {
				captured(t, sb, f, netip.AddrPortFrom(l.Inside(f.v6, i), 80))
				captured(t, sb, f, netip.AddrPortFrom(f.remote(), uint16(l.Port(i))))
				inboundCaptured(t, sb, f, l.Port(i))
			}
			direct(t, sb, f, netip.AddrPortFrom(l.Outside(f.v6, last), 80))
			direct(t, sb, f, netip.AddrPortFrom(f.remote(), uint16(l.OutsidePort(last))))
			inboundDirect(t, sb, f, l.OutsidePort(last))
		})
	}
}

var vethSeq atomic.Int32

// vethName is a fresh name for the pod's end of a veth pair.
func vethName() string { return fmt.Sprintf("xv%d", vethSeq.Add(1)) }

// vethToNode gives the pod a second interface, a veth whose other end is
// in the node namespace, each with an address of a /30 of its own (in
// 198.19.250.0/24, which nothing else uses); it returns the node's end's
// address. The pair goes with the pod's namespace.
func vethToNode(t *testing.T, sb *sandbox, name string) netip.Addr {
	t.Helper()
	n := vethSeq.Add(1) % 64
	nodeAddr := netip.AddrFrom4([4]byte{198, 19, 250, byte(4*n + 1)})
	podAddr := nodeAddr.Next()
	veth := &netlink.Veth{LinkAttrs: netlink.LinkAttrs{Name: name}, PeerName: "h" + name}
	if err := netlink.LinkAdd(veth); err != nil {
		t.Fatal(err)
	}
	peer, err := netlinksafe.LinkByName("h" + name)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = netlink.LinkDel(peer) })
	mask := net.CIDRMask(30, 32)
	if err := netlink.AddrAdd(peer, &netlink.Addr{IPNet: &net.IPNet{IP: nodeAddr.AsSlice(), Mask: mask}}); err != nil {
		t.Fatal(err)
	}
	if err := netlink.LinkSetUp(peer); err != nil {
		t.Fatal(err)
	}
	link, err := netlinksafe.LinkByName(name)
	if err != nil {
		t.Fatal(err)
	}
	if err := netlink.LinkSetNsFd(link, int(sb.pod.NetNS.Fd())); err != nil {
		t.Fatal(err)
	}
	if err := sb.pod.NetNS.Do(func(ns.NetNS) error {
		link, err := netlinksafe.LinkByName(name)
		if err != nil {
			return err
		}
		if err := netlink.AddrAdd(link, &netlink.Addr{IPNet: &net.IPNet{IP: podAddr.AsSlice(), Mask: mask}}); err != nil {
			return err
		}
		return netlink.LinkSetUp(link)
	}); err != nil {
		t.Fatal(err)
	}
	return nodeAddr
}
