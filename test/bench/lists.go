package main

import (
	"context"
	"fmt"
	"os/exec"
	"strings"
	"time"

	"github.com/istio-cni-go/istio-cni/internal/redirect"
	"github.com/istio-cni-go/istio-cni/internal/testenv"
)

// listLengths are the list lengths of the list series: the pod start-up
// issue's cost target is the plugin's share within 10% between 10 and
// 1,000 entries; 5,000 shows what lies beyond.
var listLengths = []int{10, 1000, 5000}

// listBackend is one way of programming the rules.
type listBackend struct {
	name string
	// nft selects the chain with native_nftables.
	nft bool
	// legacy gives each pod's namespace a legacy table first, so the
	// plugin picks iptables-legacy as Istio's detection does.
	legacy bool
}

var listBackends = []listBackend{{name: "iptables-nft"}, {name: "iptables-legacy", legacy: true}, {name: "nftables", nft: true}}

func listSeries(path string, n int, be listBackend) string {
	return fmt.Sprintf("lists/%s/N=%d/%s", path, n, be.name)
}

// listAnnotations are the issue's: N IPv4 CIDRs and N ports excluded.
func listAnnotations(n int) map[string]string {
	l := testenv.Lists{N: n}
	return map[string]string{
		redirect.AnnotationExcludeOutboundCIDRs: l.CIDRs4(),
		redirect.AnnotationExcludeOutboundPorts: l.Ports(),
	}
}

// lists times ADD and DEL of sidecar pods carrying the lists, for
// every length and backend, pod by pod interleaved with the primary
// plugin alone, n rounds, so machine noise falls on all series alike.
// path names how the plugin runs ("no agent": the fallback; "agent");
// lengths are the list lengths timed, listLengths when none.
func (b *bench) lists(ctx context.Context, n int, path string, lengths ...int) (*samples, error) {
	if len(lengths) == 0 {
		lengths = listLengths
	}
	s := newSamples()
	for i := 0; i < n; i++ {
		if err := b.listsRound(ctx, s, path, lengths); err != nil {
			return nil, err
		}
	}
	return s, nil
}

// listsRound is one pod per list length and backend, each after a pod of
// the primary plugin alone. So every timed pod follows the same pod: the
// kernel tears a stopped pod's namespace down in a worker after its DEL,
// and a pod timed right after a heavier one (a 1,000-entry pod's sets)
// would otherwise pay for it, always the longer lists. And its share is
// against the primary timed just before it. Each pod's object goes once
// its sandbox is gone, so that the node's pods (the agent's cache and
// records) do not add up over the rounds.
func (b *bench) listsRound(ctx context.Context, s *samples, path string, lengths []int) error {
	for _, n := range lengths {
		for _, be := range listBackends {
			if err := b.flatPod(ctx, s, "lists/"+path+"/primary", b.node.Primary); err != nil {
				return err
			}
			primary := s.last("lists/" + path + "/primary ADD")
			list := b.node.Chained
			if be.nft {
				list = b.chainedNFT
			}
			if err := b.timedPod(ctx, s, listSeries(path, n, be), list, listAnnotations(n), be.legacy); err != nil {
				return err
			}
			s.record(listSeries(path, n, be)+" share", s.last(listSeries(path, n, be)+" ADD")-primary)
		}
	}
	return nil
}

// seedLegacy gives a pod's namespace a legacy iptables table, as a node
// whose other components use iptables-legacy has.
func seedLegacy(pod *testenv.Pod) error {
	return pod.InPod(func() error {
		out, err := exec.Command("iptables-legacy", "-t", "filter", "-A", "INPUT", "-p", "255", "-j", "RETURN").CombinedOutput()
		if err != nil {
			return fmt.Errorf("seeding a legacy table: %w: %s", err, out)
		}
		return nil
	})
}

// relayFigures are what the agent logs of an ADD the relay committed: the
// relay's send, its CPU, the agent's lookup and planning (none for an
// ADD the relay served from the pod's prepared record), and the relay's
// run from its main to its answer (only for a prepared ADD: otherwise
// it is the agent's time).
var relayFigures = []string{"apply", "plugin_cpu", "lookup", "plan", "duration"}

// recordRelay records, for an ADD through the agent that the relay
// committed, the figures the agent logged of it; nothing for an ADD the
// agent applied itself (legacy tables) or without an agent. The relay
// tells the agent of an ADD it served from a record without waiting for
// it, so the line is waited for.
func (b *bench) recordRelay(s *samples, series string, pod *testenv.Pod) error {
	if b.agentHost == nil {
		return nil
	}
	want := `"pod":"` + pod.Namespace + "/" + pod.Name + `"`
	deadline := time.Now().Add(5 * time.Second)
	var text, line string
	for line == "" {
		text = b.agentHost.LogText()
		b.logSeen = min(b.logSeen, len(text))
		for _, l := range strings.Split(text[b.logSeen:], "\n") {
			if strings.Contains(l, "redirect rules programmed") && strings.Contains(l, want) {
				line = l
				break
			}
		}
		if line == "" {
			if time.Now().After(deadline) {
				return fmt.Errorf("%s: the agent logged no ADD of pod %s", series, pod.Name)
			}
			time.Sleep(time.Millisecond) // polling an outside process's log, untimed
		}
	}
	if strings.Contains(line, `"committed_by":"plugin"`) {
		for _, key := range relayFigures {
			prepared := strings.Contains(line, `"prepared":true`)
			if (prepared && !strings.Contains(line, `"`+key+`":`)) || (!prepared && key == "duration") {
				continue
			}
			d, err := testenv.LogDuration(line, key)
			if err != nil {
				return fmt.Errorf("%s: %w", series, err)
			}
			s.record(series+" "+key, d)
		}
	}
	b.logSeen = len(text)
	return nil
}
