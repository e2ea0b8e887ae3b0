package nftables

import (
	"bytes"
	"math/rand/v2"
	"net/netip"
	"slices"
	"strconv"
	"strings"
	"testing"

	"github.com/google/nftables"
	"golang.org/x/sys/unix"

	"github.com/istio-cni-go/istio-cni/internal/ruleset"
	"github.com/istio-cni-go/istio-cni/internal/testenv"
	"github.com/istio-cni-go/istio-cni/internal/testutil"
)

func listPlan(t testing.TB, ann map[string]string, v6 bool) *ruleset.Plan {
	t.Helper()
	plan, err := testenv.ListPlan(ann, v6)
	if err != nil {
		t.Fatal(err)
	}
	return plan
}

// TestListsGolden pins the nftables form of long lists: a named set per
// list (per family for CIDRs; ports keyed by protocol) looked up by one
// rule, interface runs merged into a set of names, lists up to the
// threshold a rule per entry as before.
func TestListsGolden(t *testing.T) {
	for _, c := range testenv.ListCases() {
		t.Run(c.Name, func(t *testing.T) {
			for _, v6 := range []bool{false, true} {
				rs, err := Build(listPlan(t, c.Annotations, v6))
				if err != nil {
					t.Fatal(err)
				}
				suffix := ".v4.golden"
				if v6 {
					suffix = ".v6.golden"
				}
				testutil.CompareGolden(t, c.Name+suffix, rs.Text())
			}
		})
	}
}

// TestPortSetHoldsEachPortPerProtocol: a port set holds every listed
// port once for each protocol its rules look it up with, in a hash sized
// for exactly that, whatever runs the list merges into ranges.
func TestPortSetHoldsEachPortPerProtocol(t *testing.T) {
	r := rand.New(rand.NewPCG(3, 4))
	for round := 0; round < 100; round++ {
		var ports []string
		want := map[uint16]bool{}
		for i := 0; i < 17+r.IntN(300); i++ {
			// Runs of at most two ports: the keyed form.
			p := uint16(r.IntN(400))
			if p%3 == 2 {
				p--
			}
			if round%2 == 1 {
				p = 65535 - p
			}
			want[p] = true
			ports = append(ports, strconv.Itoa(int(p)))
		}
		s := fromIPSet("t", ruleset.NewPortSet("T", "o", ports))
		protos := []byte{unix.IPPROTO_TCP, unix.IPPROTO_UDP}[:1+round%2]
		for _, proto := range protos {
			s.withProto(proto)
			s.withProto(proto)
		}
		if s.Interval || s.KeyType.Name != "inet_proto . inet_service" || int(s.Size) != len(s.Elements) {
			t.Fatalf("port set: interval %v, type %q, size %d for %d elements", s.Interval, s.KeyType.Name, s.Size, len(s.Elements))
		}
		got := map[string]bool{}
		for _, e := range s.Elements {
			if len(e.Key) != 8 || e.Key[1] != 0 || e.Key[2] != 0 || e.Key[3] != 0 || e.Key[6] != 0 || e.Key[7] != 0 || e.IntervalEnd {
				t.Fatalf("element %x is not a protocol and a port, each padded to 4 bytes", e.Key)
			}
			if got[string(e.Key)] {
				t.Fatalf("element %x twice", e.Key)
			}
			got[string(e.Key)] = true
		}
		for _, proto := range protos {
			for p := range want {
				k := []byte{proto, 0, 0, 0, byte(p >> 8), byte(p), 0, 0}
				if !got[string(k)] {
					t.Fatalf("port %d of protocol %d missing", p, proto)
				}
			}
		}
		if len(got) != len(want)*len(protos) {
			t.Fatalf("%d elements for %d ports and %d protocols", len(got), len(want), len(protos))
		}
	}
}

// TestPortRunsStayIntervals: a list whose ports run on for more than two
// in a row on average (how a range is listed, the annotation having no
// range syntax) is an interval set of its runs, which holds 20,000 ports
// in two elements where the keyed form would need 40,000.
func TestPortRunsStayIntervals(t *testing.T) {
	var ports []string
	for p := 10000; p < 30000; p++ {
		ports = append(ports, strconv.Itoa(p))
	}
	s := fromIPSet("t", ruleset.NewPortSet("T", "o", ports))
	if !s.Interval || s.KeyType.Name != nftables.TypeInetService.Name || len(s.Elements) != 3 {
		t.Fatalf("20,000 consecutive ports: interval %v, type %q, %d elements", s.Interval, s.KeyType.Name, len(s.Elements))
	}
	if got := strings.Join(s.Entries(), ","); got != "10000-29999" {
		t.Fatalf("entries %q", got)
	}
	// Runs of three: more ports than twice the runs.
	ports = nil
	for p := 0; p < 60; p += 4 {
		ports = append(ports, strconv.Itoa(1000+p), strconv.Itoa(1001+p), strconv.Itoa(1002+p))
	}
	if s := fromIPSet("t", ruleset.NewPortSet("T", "o", ports)); !s.Interval {
		t.Fatal("runs of three ports: not an interval set")
	}
}

// TestBatchStaysSmall: however long the lists, a pod's batch is a few
// dozen messages, not a message per entry.
func TestBatchStaysSmall(t *testing.T) {
	for _, n := range []int{50, 1000, testenv.MaxListLen} {
		l := testenv.Lists{N: n}
		ann := l.ExcludeAnnotations("")
		for k, v := range l.IncludeAnnotations() {
			ann[k] = v
		}
		rs, err := Build(listPlan(t, ann, true))
		if err != nil {
			t.Fatal(err)
		}
		msgs, _ := rs.batchSize()
		if limit := 120 + 2*n/elemBatch*len(rs.Sets); msgs > limit {
			t.Fatalf("lists of %d: %d messages (limit %d)", n, msgs, limit)
		}
	}
}

func TestIntervalElements(t *testing.T) {
	k := func(b ...byte) []byte { return b }
	got := intervalElements([]keyRange{{k(0, 80), k(0, 90)}, {k(0, 22), k(0, 22)}, {k(0, 85), k(0, 100)}, {k(0, 101), k(0, 101)}, {k(0xff, 0xfe), k(0xff, 0xff)}})
	var b strings.Builder
	for _, e := range got {
		b.WriteString(string(rune('0' + len(e.Key))))
		for _, x := range e.Key {
			b.WriteString(" " + string("0123456789abcdef"[x>>4]) + string("0123456789abcdef"[x&15]))
		}
		if e.IntervalEnd {
			b.WriteString(" end")
		}
		b.WriteString(";")
	}
	want := "2 00 00 end;2 00 16;2 00 17 end;2 00 50;2 00 66 end;2 ff fe;"
	if b.String() != want {
		t.Fatalf("got  %s\nwant %s", b.String(), want)
	}
	if got := intervalElements([]keyRange{{k(0, 0), k(0, 5)}}); len(got) != 2 || got[0].IntervalEnd {
		t.Fatalf("a range from zero needs no leading end element: %v", got)
	}
}

// TestSetsMatchTheList: for random CIDR lists, an address is in the
// nftables sets made of a list exactly when it is in a listed prefix,
// checked at every prefix's edges and one past them. An interval set is
// looked up as the kernel does: the greatest element not above the
// address decides, a start matching and an end not.
func TestSetsMatchTheList(t *testing.T) {
	r := rand.New(rand.NewPCG(7, 8))
	for round := 0; round < 300; round++ {
		v6 := round%2 == 1
		var in []netip.Prefix
		for i := 0; i < 17+r.IntN(60); i++ {
			var b [16]byte
			b[0], b[15], b[14] = 0xfd, byte(r.IntN(256)), byte(r.IntN(4))
			p := netip.PrefixFrom(netip.AddrFrom16(b), 112+r.IntN(17))
			if !v6 {
				p = netip.PrefixFrom(netip.AddrFrom4([4]byte{10, 0, byte(r.IntN(4)), byte(r.IntN(256))}), 20+r.IntN(13))
			}
			in = append(in, p)
		}
		fam := ruleset.IPv4
		if v6 {
			fam = ruleset.IPv6
		}
		ip := ruleset.NewNetSet("T", "o", fam, in)
		interval := fromIPSet("t", ip)
		var perLength []*Set
		for _, l := range prefixLengths(ip) {
			perLength = append(perLength, prefixSet("t", "s", ip, l))
		}
		inList := func(a netip.Addr) bool {
			return slices.ContainsFunc(in, func(p netip.Prefix) bool { return p.Contains(a) })
		}
		inInterval := func(a netip.Addr) bool {
			key := a.AsSlice()
			var best *nftables.SetElement
			for i := range interval.Elements {
				e := &interval.Elements[i]
				if bytes.Compare(e.Key, key) <= 0 && (best == nil || bytes.Compare(e.Key, best.Key) > 0) {
					best = e
				}
			}
			return best != nil && !best.IntervalEnd
		}
		inPerLength := func(a netip.Addr) bool {
			for _, s := range perLength {
				p, _ := a.Prefix(s.Bits)
				for _, e := range s.Elements {
					if bytes.Equal(e.Key, p.Addr().AsSlice()) {
						return true
					}
				}
			}
			return false
		}
		for _, p := range in {
			first := p.Masked().Addr()
			last := first
			for i := p.Bits(); i < first.BitLen(); i++ {
				b := last.AsSlice()
				b[i/8] |= 0x80 >> (i % 8)
				last, _ = netip.AddrFromSlice(b)
			}
			for _, a := range []netip.Addr{first, last, first.Prev(), last.Next()} {
				if !a.IsValid() {
					continue
				}
				want := inList(a)
				if got := inInterval(a); got != want {
					t.Fatalf("interval set of %v: %s matches %v, want %v", in, a, got, want)
				}
				if got := inPerLength(a); got != want {
					t.Fatalf("per-length sets of %v: %s matches %v, want %v", in, a, got, want)
				}
			}
		}
	}
}
