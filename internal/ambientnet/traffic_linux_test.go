package ambientnet

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"net"
	"net/netip"
	"os"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/containernetworking/plugins/pkg/ns"
	"golang.org/x/sys/unix"

	"github.com/istio-cni-go/istio-cni/internal/iptables"
	"github.com/istio-cni-go/istio-cni/internal/nftables"
	"github.com/istio-cni-go/istio-cni/internal/origdst"
	"github.com/istio-cni-go/istio-cni/internal/podnet"
	"github.com/istio-cni-go/istio-cni/internal/ruleset"
	"github.com/istio-cni-go/istio-cni/internal/testutil"
)

// The real-traffic tests run in three throwaway namespaces joined by veth
// pairs, with no way out of the machine: a pod, the node it runs on, and
// a client beyond the node whose traffic the node forwards. Every address
// belongs to one of them.
//
//	client 198.18.2.2 ── 198.18.2.1 node 198.18.1.1 ── 198.18.1.2 pod
//	       fd02::2          fd02::1      fd01::1          fd01::2

type family struct {
	name                 string
	v6                   bool
	pod, client          netip.Addr
	nodeToPod, nodeToCli netip.Addr
	probe                netip.Addr
	bits                 int
}

var families = []family{
	{name: "v4", pod: netip.MustParseAddr("198.18.1.2"), nodeToPod: netip.MustParseAddr("198.18.1.1"),
		client: netip.MustParseAddr("198.18.2.2"), nodeToCli: netip.MustParseAddr("198.18.2.1"), probe: ruleset.ProbeSourceV4, bits: 24},
	{name: "v6", v6: true, pod: netip.MustParseAddr("fd01::2"), nodeToPod: netip.MustParseAddr("fd01::1"),
		client: netip.MustParseAddr("fd02::2"), nodeToCli: netip.MustParseAddr("fd02::1"), probe: ruleset.ProbeSourceV6, bits: 64},
}

type backendCase struct {
	name string
	pod  InPod
	host Host
	uid  *uint32
}

func backends() []backendCase {
	root := uint32(0)
	legacy := &iptables.Applier{Force: iptables.VariantLegacy}
	nftVariant := &iptables.Applier{Force: iptables.VariantNFT}
	nft := &nftables.Applier{}
	return []backendCase{
		{name: "iptables-legacy", pod: legacy, host: legacy},
		{name: "iptables-nft", pod: nftVariant, host: nftVariant},
		// The test process stands in for the kubelet.
		{name: "nftables", pod: nft, host: nft, uid: &root},
		// No kubelet found: the node's own connections, by their socket.
		{name: "nftables-any-local-socket", pod: nft, host: nft},
	}
}

// world is one pod, node and client, with listeners where ztunnel, the
// app and the client's servers would be.
type world struct {
	fam               family
	pod, node, client ns.NetNS
	podParams         ruleset.AmbientParams
	backend           backendCase
}

func sh(t *testing.T, n ns.NetNS, args ...string) {
	t.Helper()
	testutil.RunIn(t, n, args...)
}

func writeSysctl(t *testing.T, n ns.NetNS, path, v string) {
	t.Helper()
	if err := n.Do(func(ns.NetNS) error { return os.WriteFile(path, []byte(v), 0o644) }); err != nil {
		t.Fatalf("%s: %v", path, err)
	}
}

// link joins a and b with a veth pair (named an in a, bn in b), each end
// with its address, no DAD so IPv6 works at once.
func link(t *testing.T, a ns.NetNS, an string, aAddr netip.Addr, b ns.NetNS, bn string, bAddr netip.Addr, bits int) {
	t.Helper()
	sh(t, a, "ip", "link", "add", an, "type", "veth", "peer", "name", bn, "netns", filepath.Base(b.Path()))
	for _, end := range []struct {
		n    ns.NetNS
		name string
		addr netip.Addr
	}{{a, an, aAddr}, {b, bn, bAddr}} {
		sh(t, end.n, "ip", "addr", "add", netip.PrefixFrom(end.addr, bits).String(), "dev", end.name, "nodad")
		sh(t, end.n, "ip", "link", "set", end.name, "up")
	}
}

func newWorld(t *testing.T, b backendCase, fam family, pod ruleset.AmbientParams) *world {
	t.Helper()
	testutil.RequireTools(t, "ip", "iptables-legacy-restore", "iptables-nft-restore")
	w := &world{fam: fam, backend: b, podParams: pod, pod: testutil.NewNS(t), node: testutil.NewNS(t), client: testutil.NewNS(t)}
	for _, n := range []ns.NetNS{w.pod, w.node, w.client} {
		if filepath.Dir(n.Path()) != "/var/run/netns" && filepath.Dir(n.Path()) != "/run/netns" {
			t.Fatalf("namespace %s is not where ip(8) finds it by name", n.Path())
		}
	}
	for _, n := range []ns.NetNS{w.pod, w.node, w.client} {
		// Link-local addresses too must be usable at once, or the
		// first neighbour discovery waits for their DAD.
		writeSysctl(t, n, "/proc/sys/net/ipv6/conf/default/accept_dad", "0")
		writeSysctl(t, n, "/proc/sys/net/ipv6/conf/all/accept_dad", "0")
	}
	link(t, w.node, "vpod", fam.nodeToPod, w.pod, "eth0", fam.pod, fam.bits)
	link(t, w.node, "vcli", fam.nodeToCli, w.client, "eth0", fam.client, fam.bits)
	ipv := "-4"
	if fam.v6 {
		ipv = "-6"
		writeSysctl(t, w.node, "/proc/sys/net/ipv6/conf/all/forwarding", "1")
	} else {
		writeSysctl(t, w.node, "/proc/sys/net/ipv4/ip_forward", "1")
	}
	sh(t, w.pod, "ip", ipv, "route", "add", "default", "via", fam.nodeToPod.String())
	sh(t, w.client, "ip", ipv, "route", "add", "default", "via", fam.nodeToCli.String())
	// The node owns the probe source too, so a connection can come from
	// it without the node's SNAT.
	sh(t, w.node, "ip", "addr", "add", netip.PrefixFrom(fam.probe, fam.probe.BitLen()).String(), "dev", "lo", "nodad")

	w.serve(t, w.pod, "ztunnel-outbound", 15001, true)
	w.serve(t, w.pod, "ztunnel-inbound", 15006, true)
	w.serve(t, w.pod, "ztunnel-hbone", 15008, false)
	w.serve(t, w.pod, "ztunnel-dns", 15053, true)
	w.serve(t, w.pod, "app", 8080, false)
	w.serve(t, w.client, "client-server", 9090, false)
	w.serve(t, w.client, "client-dns", 53, false)
	// On loopback, where the redirect sends the queries: an answer must
	// leave from the address the query came to for conntrack to turn it
	// back into the resolver's (ztunnel's proxy does the same).
	w.serveUDP(t, w.pod, "ztunnel-dns", 15053, true)
	w.serveUDP(t, w.client, "client-dns", 53, false)
	return w
}

func (w *world) network(proto string) string {
	if w.fam.v6 {
		return proto + "6"
	}
	return proto + "4"
}

func (w *world) any(port int) string {
	if w.fam.v6 {
		return fmt.Sprintf("[::]:%d", port)
	}
	return fmt.Sprintf("0.0.0.0:%d", port)
}

// serve listens on port in n and answers each connection with one line:
// the listener's name, the connection's original destination (with
// origDst; "-" otherwise) and its peer.
func (w *world) serve(t *testing.T, n ns.NetNS, name string, port int, origDst bool) {
	t.Helper()
	var l net.Listener
	if err := n.Do(func(ns.NetNS) error {
		var err error
		l, err = net.Listen(w.network("tcp"), w.any(port))
		return err
	}); err != nil {
		t.Fatalf("listening for %s: %v", name, err)
	}
	t.Cleanup(func() { _ = l.Close() })
	go func() {
		for {
			c, err := l.Accept()
			if err != nil {
				return
			}
			dst := "-"
			if origDst {
				if d, err := origdst.Get(c); err == nil {
					dst = d.String()
				} else {
					dst = "error:" + err.Error()
				}
			}
			_, _ = fmt.Fprintf(c, "%s %s %s\n", name, dst, c.RemoteAddr())
			_ = c.Close()
		}
	}()
}

// serveUDP answers each datagram on port in n (on loopback only, with
// loopback) with the listener's name and the sender.
func (w *world) serveUDP(t *testing.T, n ns.NetNS, name string, port int, loopback bool) {
	t.Helper()
	addr := w.any(port)
	if loopback {
		addr = netip.AddrPortFrom(netip.IPv6Loopback(), uint16(port)).String()
		if !w.fam.v6 {
			addr = netip.AddrPortFrom(netip.MustParseAddr("127.0.0.1"), uint16(port)).String()
		}
	}
	var pc net.PacketConn
	if err := n.Do(func(ns.NetNS) error {
		var err error
		pc, err = net.ListenPacket(w.network("udp"), addr)
		return err
	}); err != nil {
		t.Fatalf("listening for %s: %v", name, err)
	}
	t.Cleanup(func() { _ = pc.Close() })
	go func() {
		buf := make([]byte, 512)
		for {
			_, from, err := pc.ReadFrom(buf)
			if err != nil {
				return
			}
			_, _ = pc.WriteTo(fmt.Appendf(nil, "%s - %s\n", name, from), from)
		}
	}()
}

// dialOpts shape a connection the way ztunnel shapes its own.
type dialOpts struct {
	// mark is SO_MARK: 1337 for ztunnel's sockets.
	mark int
	// src binds the socket; with transparent, to an address the
	// namespace does not have (the client's, as ztunnel's inbound does).
	src         netip.Addr
	transparent bool
	udp         bool
}

// exchange connects from n to dst and returns the one line the far end
// answered: who accepted, the original destination it saw, the peer.
func (w *world) exchange(n ns.NetNS, dst netip.AddrPort, o dialOpts) (string, error) {
	var line string
	err := n.Do(func(ns.NetNS) error {
		d := net.Dialer{Timeout: 2 * time.Second}
		if o.src.IsValid() {
			if o.udp {
				d.LocalAddr = &net.UDPAddr{IP: o.src.AsSlice()}
			} else {
				d.LocalAddr = &net.TCPAddr{IP: o.src.AsSlice()}
			}
		}
		d.Control = func(_, _ string, rc syscall.RawConn) error {
			var serr error
			err := rc.Control(func(fd uintptr) {
				if o.mark != 0 {
					serr = unix.SetsockoptInt(int(fd), unix.SOL_SOCKET, unix.SO_MARK, o.mark)
				}
				if serr == nil && o.transparent {
					if w.fam.v6 {
						serr = unix.SetsockoptInt(int(fd), unix.SOL_IPV6, unix.IPV6_TRANSPARENT, 1)
					} else {
						serr = unix.SetsockoptInt(int(fd), unix.SOL_IP, unix.IP_TRANSPARENT, 1)
					}
				}
			})
			return errors.Join(err, serr)
		}
		proto := "tcp"
		if o.udp {
			proto = "udp"
		}
		c, err := d.DialContext(context.Background(), w.network(proto), dst.String())
		if err != nil {
			return err
		}
		defer c.Close()
		_ = c.SetDeadline(time.Now().Add(2 * time.Second))
		if o.udp {
			if _, err := c.Write([]byte("query")); err != nil {
				return err
			}
		}
		line, err = bufio.NewReader(c).ReadString('\n')
		return err
	})
	return strings.TrimSpace(line), err
}

// want is who must answer a connection and what it must have seen;
// empty fields are not checked.
type want struct {
	by, origDst string
	peer        netip.Addr
}

func (w *world) expect(t *testing.T, got string, err error, x want) {
	t.Helper()
	if err != nil {
		t.Fatalf("connection failed, want it answered by %s: %v", x.by, err)
	}
	f := strings.Fields(got)
	if len(f) != 3 {
		t.Fatalf("answer %q", got)
	}
	peer, perr := netip.ParseAddrPort(f[2])
	switch {
	case f[0] != x.by:
		t.Fatalf("answered by %s, want %s (%q)", f[0], x.by, got)
	case x.origDst != "" && f[1] != x.origDst:
		t.Fatalf("original destination %s, want %s (%q)", f[1], x.origDst, got)
	case x.peer.IsValid() && (perr != nil || peer.Addr().Unmap() != x.peer):
		t.Fatalf("peer %s, want %s (%q)", f[2], x.peer, got)
	}
}

func ap(a netip.Addr, port uint16) netip.AddrPort { return netip.AddrPortFrom(a, port) }

// trafficCase is one path a packet can take and where it must end up.
type trafficCase struct {
	name string
	run  func(t *testing.T, w *world)
}

// hboneReachesZtunnel: inbound HBONE on 15008 is not redirected; it
// reaches ztunnel's own listener as addressed.
var hboneReachesZtunnel = trafficCase{"inbound HBONE on 15008 is not redirected", func(t *testing.T, w *world) {
	got, err := w.exchange(w.client, ap(w.fam.pod, 15008), dialOpts{})
	w.expect(t, got, err, want{by: "ztunnel-hbone", peer: w.fam.client})
}}

// transparentInbound: ztunnel's transparent dial to the app, from the
// client's address with ztunnel's mark, gets the app's replies back.
var transparentInbound = trafficCase{"ztunnel's transparent inbound dials the app as the client and gets the replies", func(t *testing.T, w *world) {
	got, err := w.exchange(w.pod, ap(w.fam.pod, 8080), dialOpts{mark: 1337, src: w.fam.client, transparent: true})
	w.expect(t, got, err, want{by: "app", peer: w.fam.client})
}}

// captured are the paths of an enrolled pod with DNS capture, on a node
// with the probe SNAT and the pod's address in the probe set.
var captured = []trafficCase{
	{"outbound TCP reaches ztunnel's outbound listener with the dialled destination", func(t *testing.T, w *world) {
		dst := ap(w.fam.client, 9090)
		got, err := w.exchange(w.pod, dst, dialOpts{})
		w.expect(t, got, err, want{by: "ztunnel-outbound", origDst: dst.String()})
	}},
	{"ztunnel's own marked outbound is not recaptured", func(t *testing.T, w *world) {
		got, err := w.exchange(w.pod, ap(w.fam.client, 9090), dialOpts{mark: 1337})
		w.expect(t, got, err, want{by: "client-server", peer: w.fam.pod})
	}},
	{"forwarded inbound TCP reaches ztunnel's inbound listener, not SNATed", func(t *testing.T, w *world) {
		dst := ap(w.fam.pod, 8080)
		got, err := w.exchange(w.client, dst, dialOpts{})
		w.expect(t, got, err, want{by: "ztunnel-inbound", origDst: dst.String(), peer: w.fam.client})
	}},
	hboneReachesZtunnel,
	{"a connection from the probe source reaches the app", func(t *testing.T, w *world) {
		got, err := w.exchange(w.node, ap(w.fam.pod, 8080), dialOpts{src: w.fam.probe})
		w.expect(t, got, err, want{by: "app", peer: w.fam.probe})
	}},
	{"the node's own connection is SNATed to the probe source and reaches the app", func(t *testing.T, w *world) {
		got, err := w.exchange(w.node, ap(w.fam.pod, 8080), dialOpts{})
		w.expect(t, got, err, want{by: "app", peer: w.fam.probe})
	}},
	transparentInbound,
	{"DNS over UDP reaches ztunnel's DNS proxy", func(t *testing.T, w *world) {
		got, err := w.exchange(w.pod, ap(w.fam.client, 53), dialOpts{udp: true})
		w.expect(t, got, err, want{by: "ztunnel-dns"})
	}},
	{"DNS over TCP reaches ztunnel's DNS proxy with the dialled destination", func(t *testing.T, w *world) {
		dst := ap(w.fam.client, 53)
		got, err := w.exchange(w.pod, dst, dialOpts{})
		w.expect(t, got, err, want{by: "ztunnel-dns", origDst: dst.String()})
	}},
	{"ztunnel's own DNS query upstream is not recaptured", func(t *testing.T, w *world) {
		got, err := w.exchange(w.pod, ap(w.fam.client, 53), dialOpts{udp: true, mark: 1337})
		w.expect(t, got, err, want{by: "client-dns", peer: w.fam.pod})
	}},
}

// uncapturedDNS are the paths of a pod without DNS capture.
var uncapturedDNS = []trafficCase{
	{"DNS over UDP goes where it was sent", func(t *testing.T, w *world) {
		got, err := w.exchange(w.pod, ap(w.fam.client, 53), dialOpts{udp: true})
		w.expect(t, got, err, want{by: "client-dns", peer: w.fam.pod})
	}},
	{"DNS over TCP is outbound TCP like any other", func(t *testing.T, w *world) {
		dst := ap(w.fam.client, 53)
		got, err := w.exchange(w.pod, dst, dialOpts{})
		w.expect(t, got, err, want{by: "ztunnel-outbound", origDst: dst.String()})
	}},
}

// bypassed are the paths of a pod with ambient.istio.io/bypass-inbound-
// capture: inbound goes to the app as sent, but HBONE still reaches
// ztunnel, whose transparent dial to the app must get its replies back
// (Istio's #58546: without the connmark rule they left by eth0).
var bypassed = []trafficCase{
	{"forwarded inbound TCP reaches the app as sent", func(t *testing.T, w *world) {
		got, err := w.exchange(w.client, ap(w.fam.pod, 8080), dialOpts{})
		w.expect(t, got, err, want{by: "app", peer: w.fam.client})
	}},
	hboneReachesZtunnel,
	transparentInbound,
	{"outbound TCP still reaches ztunnel's outbound listener", func(t *testing.T, w *world) {
		dst := ap(w.fam.client, 9090)
		got, err := w.exchange(w.pod, dst, dialOpts{})
		w.expect(t, got, err, want{by: "ztunnel-outbound", origDst: dst.String()})
	}},
}

// TestTraffic sends real connections through an enrolled pod's rules and
// the node's probe SNAT, on every backend and both families, and checks
// where each ends up and what its receiver saw.
func TestTraffic(t *testing.T) {
	testutil.RequireRoot(t)
	for _, b := range backends() {
		for _, fam := range families {
			t.Run(b.name+"/"+fam.name, func(t *testing.T) {
				t.Run("dns-capture", func(t *testing.T) {
					w := newWorld(t, b, fam, ruleset.AmbientParams{DNSCapture: true, IPv6: fam.v6})
					// Unenrolled, the client's server answers: what follows
					// is the rules' doing.
					got, err := w.exchange(w.pod, ap(w.fam.client, 9090), dialOpts{})
					w.expect(t, got, err, want{by: "client-server", peer: w.fam.pod})
					w.enrol(t, true)
					for _, c := range captured {
						t.Run(c.name, func(t *testing.T) { c.run(t, w) })
					}
				})
				t.Run("no-dns-capture", func(t *testing.T) {
					w := newWorld(t, b, fam, ruleset.AmbientParams{IPv6: fam.v6})
					w.enrol(t, false)
					for _, c := range uncapturedDNS {
						t.Run(c.name, func(t *testing.T) { c.run(t, w) })
					}
				})
				t.Run("bypass-inbound", func(t *testing.T) {
					w := newWorld(t, b, fam, ruleset.AmbientParams{BypassInbound: true, IPv6: fam.v6})
					w.enrol(t, false)
					for _, c := range bypassed {
						t.Run(c.name, func(t *testing.T) { c.run(t, w) })
					}
				})
			})
		}
	}
}

// enrol programs the pod and, with host, the node's probe SNAT with the
// pod's address in the probe set, checking each reads back as written.
func (w *world) enrol(t *testing.T, host bool) {
	t.Helper()
	rep, err := w.backend.pod.ApplyAmbient(w.pod.Path(), w.podParams)
	if err != nil {
		t.Fatal(err)
	}
	// A fresh namespace takes prepared requests, but from legacy
	// iptables, which no netlink request writes: the traffic below is
	// theirs.
	if prepared := rep.Families[0].Note == podnet.NotePrepared; prepared != (w.backend.name != "iptables-legacy") {
		t.Fatalf("enrolling a fresh namespace with %s: %s", w.backend.name, rep)
	}
	if err := w.backend.pod.CheckAmbient(w.pod.Path(), w.podParams); err != nil {
		t.Fatal(err)
	}
	if !host {
		return
	}
	hp := ruleset.HostParams{IPv6: w.fam.v6, KubeletUID: w.backend.uid}
	if _, err := w.backend.host.EnsureHost(w.node.Path(), hp); err != nil {
		t.Fatal(err)
	}
	if _, err := w.backend.host.SyncProbes(w.node.Path(), map[netip.Addr]string{w.fam.pod: "pod-uid"}); err != nil {
		t.Fatal(err)
	}
}
