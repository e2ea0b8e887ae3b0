package nftables

import (
	"strings"
	"testing"

	"github.com/containernetworking/plugins/pkg/ns"
	"github.com/google/nftables"

	"github.com/istio-cni-go/istio-cni/internal/redirect"
	"github.com/istio-cni-go/istio-cni/internal/testenv"
	"github.com/istio-cni-go/istio-cni/internal/testutil"
)

func ourTablesIn(t *testing.T, n ns.NetNS) []string {
	t.Helper()
	var out []string
	for _, name := range tablesIn(t, n) {
		if strings.HasPrefix(name, TablePrefix) {
			out = append(out, name)
		}
	}
	return out
}

// TestListCasesInKernel: every long-list case goes in as one transaction,
// reads back equal (sets and elements included, so re-ADD is a no-op and
// CHECK passes), is replaced by another plan, and is removed.
func TestListCasesInKernel(t *testing.T) {
	testutil.RequireRoot(t)
	other := listPlan(t, testenv.Lists{N: 30}.IncludeAnnotations(), true)
	for _, v6 := range []bool{false, true} {
		for _, c := range testenv.ListCases() {
			name := c.Name
			if v6 {
				name += "/v6"
			}
			t.Run(name, func(t *testing.T) {
				n := newNS(t)
				a := &Applier{}
				plan := listPlan(t, c.Annotations, v6)
				if _, err := a.Apply(n.Path(), plan); err != nil {
					t.Fatal(err)
				}
				if err := a.Check(n.Path(), plan); err != nil {
					t.Fatalf("check after apply: %v", err)
				}
				rep, err := a.Apply(n.Path(), plan)
				if err != nil || rep.Families[0].Action != "unchanged" {
					t.Fatalf("second apply: %s %v", rep, err)
				}
				if _, err := a.Apply(n.Path(), other); err != nil {
					t.Fatalf("replacing: %v", err)
				}
				if err := a.Check(n.Path(), other); err != nil {
					t.Fatalf("check after replace: %v", err)
				}
				if err := a.Check(n.Path(), plan); err == nil {
					t.Fatalf("check passed against the old plan after replacement")
				}
				if _, err := a.Remove(n.Path()); err != nil {
					t.Fatal(err)
				}
				if left := ourTablesIn(t, n); len(left) > 0 {
					t.Fatalf("tables left after remove: %v", left)
				}
			})
		}
	}
}

// TestIssueSizes applies the lists the issue reported at every size it
// tried, through one netlink transaction each, with the socket sized by
// the applier: 50 entries used to fail with "no buffer space available".
func TestIssueSizes(t *testing.T) {
	testutil.RequireRoot(t)
	for _, size := range []int{10, 40, 50, 1000, 5000} {
		l := testenv.Lists{N: size}
		ann := map[string]string{
			redirect.AnnotationExcludeOutboundCIDRs: l.CIDRs(),
			redirect.AnnotationExcludeOutboundPorts: l.Ports(),
		}
		plan := listPlan(t, ann, true)
		n := newNS(t)
		a := &Applier{}
		rep, err := a.Apply(n.Path(), plan)
		if err != nil {
			t.Fatalf("%d entries: %v", size, err)
		}
		if strings.Contains(rep.String(), "lost") {
			t.Fatalf("%d entries: replies overflowed the socket: %s", size, rep)
		}
		if err := a.Check(n.Path(), plan); err != nil {
			t.Fatalf("%d entries: %v", size, err)
		}
	}
}

// TestReceiveBufferPerReply holds ackBytes: a receive buffer of exactly
// ackBytes per message of the batch takes every reply, for batches of a
// rule per entry (the most messages there are: lists at the threshold).
func TestReceiveBufferPerReply(t *testing.T) {
	testutil.RequireRoot(t)
	plan := listPlan(t, testenv.ListCases()[3].Annotations, true)
	rs, err := Build(plan)
	if err != nil {
		t.Fatal(err)
	}
	msgs, _ := rs.batchSize()
	// The kernel doubles what is set.
	a := &Applier{rcvBuf: msgs * ackBytes / 2}
	n := newNS(t)
	rep, err := a.Apply(n.Path(), plan)
	if err != nil {
		t.Fatal(err)
	}
	if strings.Contains(rep.String(), "lost") {
		t.Fatalf("%d replies did not fit in %d bytes: %s", msgs, msgs*ackBytes, rep)
	}
}

// TestLostRepliesAfterCommit: when the replies do overflow (here a
// receive buffer far too small), the kernel has committed the batch; the
// applier finds its tables in place and succeeds.
func TestLostRepliesAfterCommit(t *testing.T) {
	testutil.RequireRoot(t)
	plan := planFor(t, testutil.RedirectCases[0], true)
	a := &Applier{rcvBuf: 2048}
	n := newNS(t)
	rep, err := a.Apply(n.Path(), plan)
	if err != nil {
		t.Fatal(err)
	}
	if !strings.Contains(rep.String(), "lost") {
		t.Fatalf("the replies were expected to overflow: %s", rep)
	}
	if err := (&Applier{}).Check(n.Path(), plan); err != nil {
		t.Fatal(err)
	}
}

// TestRefusedBatchNamesTheSetting: a batch the kernel will not take (here
// larger than the socket may send) fails the ADD with an error naming
// the largest list's annotation, and the namespace has no table of ours:
// the transaction is all or nothing.
func TestRefusedBatchNamesTheSetting(t *testing.T) {
	testutil.RequireRoot(t)
	l := testenv.Lists{N: 5000}
	plan := listPlan(t, map[string]string{
		redirect.AnnotationExcludeOutboundCIDRs: l.CIDRs(),
		redirect.AnnotationExcludeOutboundPorts: testenv.Lists{N: 100}.Ports(),
	}, true)
	n := newNS(t)
	_, err := (&Applier{sndBuf: 32 << 10}).Apply(n.Path(), plan)
	if err == nil {
		t.Fatal("a batch beyond the send buffer went through")
	}
	for _, want := range []string{"too large", redirect.AnnotationExcludeOutboundCIDRs, "5000 entries", "nothing was changed"} {
		if !strings.Contains(err.Error(), want) {
			t.Fatalf("error does not say %q: %v", want, err)
		}
	}
	if left := ourTablesIn(t, n); len(left) > 0 {
		t.Fatalf("tables left after a refused batch: %v", left)
	}
	// A replacement refused the same way leaves the old tables whole.
	basic := planFor(t, testutil.RedirectCases[0], true)
	if _, err := (&Applier{}).Apply(n.Path(), basic); err != nil {
		t.Fatal(err)
	}
	if _, err := (&Applier{sndBuf: 32 << 10}).Apply(n.Path(), plan); err == nil {
		t.Fatal("a batch beyond the send buffer went through")
	}
	if err := (&Applier{}).Check(n.Path(), basic); err != nil {
		t.Fatalf("the old rules are not whole after a refused replacement: %v", err)
	}
}

// TestCheckFindsSetTampering: CHECK fails when a set loses an element,
// naming the set, and the next ADD puts it right.
func TestCheckFindsSetTampering(t *testing.T) {
	testutil.RequireRoot(t)
	n := newNS(t)
	a := &Applier{}
	plan := listPlan(t, testenv.Lists{N: 40}.ExcludeAnnotations(""), false)
	if _, err := a.Apply(n.Path(), plan); err != nil {
		t.Fatal(err)
	}
	var victim string
	if err := n.Do(func(ns.NetNS) error {
		conn, err := nftables.New()
		if err != nil {
			return err
		}
		tb := &nftables.Table{Name: TableName("nat"), Family: nftables.TableFamilyINet}
		sets, err := conn.GetSets(tb)
		if err != nil {
			return err
		}
		for _, s := range sets {
			if s.KeyType == nftables.TypeIPAddr {
				elems, err := conn.GetSetElements(s)
				if err != nil {
					return err
				}
				victim = s.Name
				// A start and its end: one range gone.
				if err := conn.SetDeleteElements(s, elems[:2]); err != nil {
					return err
				}
			}
		}
		return conn.Flush()
	}); err != nil {
		t.Fatal(err)
	}
	err := a.Check(n.Path(), plan)
	if victim == "" || err == nil || !strings.Contains(err.Error(), victim) {
		t.Fatalf("CHECK after deleting elements of %q: %v", victim, err)
	}
	rep, err := a.Apply(n.Path(), plan)
	if err != nil || rep.Families[0].Action != "replaced" {
		t.Fatalf("re-apply over a tampered set: %v %v", rep, err)
	}
	if err := a.Check(n.Path(), plan); err != nil {
		t.Fatal(err)
	}
}

// TestInspectShowsSets: the diagnostics' view lists the sets and their
// sizes.
func TestInspectShowsSets(t *testing.T) {
	testutil.RequireRoot(t)
	n := newNS(t)
	a := &Applier{}
	plan := listPlan(t, testenv.Lists{N: 40}.ExcludeAnnotations(""), false)
	if _, err := a.Apply(n.Path(), plan); err != nil {
		t.Fatal(err)
	}
	lines, err := a.Inspect(n.Path())
	if err != nil {
		t.Fatal(err)
	}
	text := strings.Join(lines, "\n")
	for _, want := range []string{"set istio-out-excl-net4-", "set istio-excl-if-", "ipv4_addr", "ifname"} {
		if !strings.Contains(text, want) {
			t.Fatalf("inspection lacks %q:\n%s", want, text)
		}
	}
}
