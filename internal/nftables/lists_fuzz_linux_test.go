package nftables

import (
	"errors"
	"fmt"
	"math/rand/v2"
	"net/netip"
	"strconv"
	"strings"
	"testing"

	"github.com/istio-cni-go/istio-cni/internal/iptables"
	"github.com/istio-cni-go/istio-cni/internal/podinfo"
	"github.com/istio-cni-go/istio-cni/internal/podnet"
	"github.com/istio-cni-go/istio-cni/internal/redirect"
	"github.com/istio-cni-go/istio-cni/internal/ruleset"
	"github.com/istio-cni-go/istio-cni/internal/testutil"
)

// listKeys are the list-valued annotations.
var listKeys = []string{
	redirect.AnnotationIncludeOutboundCIDRs,
	redirect.AnnotationExcludeOutboundCIDRs,
	redirect.AnnotationIncludeInboundPorts,
	redirect.AnnotationExcludeInboundPorts,
	redirect.AnnotationIncludeOutboundPorts,
	redirect.AnnotationExcludeOutboundPorts,
	redirect.AnnotationExcludeInterfaces,
	redirect.AnnotationRerouteVirtualIfaces,
	redirect.AnnotationKubevirtInterfaces,
}

func randomCIDR(r *rand.Rand) string {
	if r.IntN(2) == 0 {
		a := netip.AddrFrom4([4]byte{byte(r.IntN(256)), byte(r.IntN(256)), byte(r.IntN(256)), byte(r.IntN(256))})
		// Host bits set, overlaps and /0 included: all valid input.
		return netip.PrefixFrom(a, r.IntN(33)).String()
	}
	var b [16]byte
	for i := range b {
		b[i] = byte(r.IntN(256))
	}
	if r.IntN(4) > 0 {
		// Mostly a narrow range, so entries overlap and touch.
		b[0], b[1] = 0xfd, 0
		for i := 2; i < 14; i++ {
			b[i] = 0
		}
	}
	return netip.PrefixFrom(netip.AddrFrom16(b), r.IntN(129)).String()
}

func randomIface(r *rand.Rand) string {
	const chars = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789-_.@"
	n := 1 + r.IntN(14)
	b := make([]byte, n)
	for i := range b {
		b[i] = chars[r.IntN(len(chars))]
	}
	b[0] = "abcdefghijklmnopqrstuvwxyz"[r.IntN(26)]
	s := string(b)
	if r.IntN(8) == 0 {
		s += "+"
	}
	return s
}

// randomList is up to n valid entries for an annotation, spaces and all.
func randomList(r *rand.Rand, key string, n int) string {
	if n == 0 {
		return ""
	}
	m := r.IntN(n + 1)
	parts := make([]string, m)
	for i := range parts {
		switch key {
		case redirect.AnnotationIncludeOutboundCIDRs, redirect.AnnotationExcludeOutboundCIDRs:
			parts[i] = randomCIDR(r)
		case redirect.AnnotationExcludeInterfaces, redirect.AnnotationRerouteVirtualIfaces, redirect.AnnotationKubevirtInterfaces:
			parts[i] = randomIface(r)
		default:
			parts[i] = strconv.Itoa(r.IntN(65536))
		}
		if r.IntN(16) == 0 {
			parts[i] = " " + parts[i] + " "
		}
	}
	return strings.Join(parts, ",")
}

// FuzzListsInKernel: any valid lists, of any length up to 6000 entries,
// become rules every backend's kernel side accepts and reads back equal,
// each in a network namespace of its own that nothing else uses; and an
// entry that does not validate is refused with its annotation's name.
func FuzzListsInKernel(f *testing.F) {
	f.Add(uint64(1), uint16(3), "")
	f.Add(uint64(2), uint16(17), "10.0.0.0/33")
	f.Add(uint64(3), uint16(40), "eth0 -j ACCEPT")
	f.Add(uint64(4), uint16(300), "65536")
	f.Add(uint64(5), uint16(300), "")
	f.Add(uint64(6), uint16(2000), " ,")
	f.Add(uint64(7), uint16(5000), "")
	f.Fuzz(func(t *testing.T, seed uint64, n uint16, extra string) {
		testutil.RequireRoot(t)
		r := rand.New(rand.NewPCG(seed, uint64(n)))
		size := int(n) % 6001
		ann := map[string]string{redirect.AnnotationStatus: "{}"}
		for _, key := range listKeys {
			if r.IntN(4) > 0 {
				ann[key] = randomList(r, key, size)
			}
		}
		if r.IntN(3) == 0 {
			ann[redirect.AnnotationIncludeOutboundCIDRs] = "*"
		}
		if r.IntN(3) == 0 {
			ann[redirect.AnnotationInterceptionMode] = "TPROXY"
		}
		pod := func() *podinfo.Pod {
			return &podinfo.Pod{Annotations: ann, Containers: []podinfo.Container{{Name: redirect.ProxyContainerName}}}
		}
		if extra != "" {
			key := listKeys[r.IntN(len(listKeys))]
			valid := ann[key]
			parts := strings.Split(valid, ",")
			if valid == "" {
				parts = nil
			}
			at := r.IntN(len(parts) + 1)
			parts = append(parts[:at], append([]string{extra}, parts[at:]...)...)
			ann[key] = strings.Join(parts, ",")
			if _, _, err := redirect.FromPod(pod()); err != nil {
				var ia *redirect.InvalidAnnotationError
				if !errors.As(err, &ia) || ia.Key != key || !strings.Contains(err.Error(), key) {
					t.Fatalf("entry %q in %s: error does not name the annotation: %v", extra, key, err)
				}
				ann[key] = valid
			}
		}
		params, _, err := redirect.FromPod(pod())
		if err != nil {
			t.Fatalf("valid lists refused: %v", err)
		}
		plan := ruleset.Build(params, r.IntN(2) == 0)
		backends := []struct {
			name string
			a    interface {
				Apply(string, *ruleset.Plan) (podnet.Report, error)
				Check(string, *ruleset.Plan) error
			}
		}{
			{"nftables", &Applier{}},
			{"iptables-nft", &iptables.Applier{Force: iptables.VariantNFT}},
			{"iptables-legacy", &iptables.Applier{Force: iptables.VariantLegacy}},
		}
		for _, b := range backends {
			n := newNS(t)
			if _, err := b.a.Apply(n.Path(), plan); err != nil {
				t.Fatalf("%s refused valid lists (%s): %v", b.name, summary(ann), err)
			}
			if err := b.a.Check(n.Path(), plan); err != nil {
				t.Fatalf("%s reads back other rules (%s): %v", b.name, summary(ann), err)
			}
		}
	})
}

// summary says how long each list of a failing input was.
func summary(ann map[string]string) string {
	var parts []string
	for _, k := range listKeys {
		if v, ok := ann[k]; ok {
			parts = append(parts, fmt.Sprintf("%s: %d entries", k[strings.LastIndex(k, "/")+1:], strings.Count(v, ",")+1))
		}
	}
	return strings.Join(parts, ", ")
}
