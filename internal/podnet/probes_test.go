package podnet

import (
	"fmt"
	"net/netip"
	"testing"
)

func TestDiffProbes(t *testing.T) {
	a, b, c, d := netip.MustParseAddr("10.0.0.1"), netip.MustParseAddr("10.0.0.2"), netip.MustParseAddr("10.0.0.3"), netip.MustParseAddr("fd00::4")
	got := DiffProbes(
		map[netip.Addr]string{a: "uid-a", b: "uid-old", c: "uid-c"},
		map[netip.Addr]string{a: "uid-a", b: "uid-new", d: "uid-d"},
	)
	if s := fmt.Sprint(got.Added, got.Updated, got.Removed); s != "[fd00::4] [10.0.0.2] [10.0.0.3]" {
		t.Fatalf("added, updated, removed = %s", s)
	}
	if !DiffProbes(map[netip.Addr]string{a: "x"}, map[netip.Addr]string{a: "x"}).Empty() {
		t.Fatal("an equal set should need no change")
	}
	v4, v6 := SplitFamilies(map[netip.Addr]string{netip.MustParseAddr("::ffff:10.0.0.9"): "m", d: "uid-d"})
	if len(v4) != 1 || v4[netip.MustParseAddr("10.0.0.9")] != "m" || len(v6) != 1 {
		t.Fatalf("split: v4 %v v6 %v", v4, v6)
	}
}
