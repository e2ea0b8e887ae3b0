// Package diag explains a pod's redirection: which rules are in place,
// through which backend, and whether they are what the pod asks for.
package diag

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"net/netip"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"time"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/istio-cni-go/istio-cni/internal/ambient"
	"github.com/istio-cni-go/istio-cni/internal/ambientnet"
	"github.com/istio-cni-go/istio-cni/internal/iptables"
	"github.com/istio-cni-go/istio-cni/internal/nftables"
	"github.com/istio-cni-go/istio-cni/internal/plugin"
	"github.com/istio-cni-go/istio-cni/internal/podinfo"
	"github.com/istio-cni-go/istio-cni/internal/podrules"
	"github.com/istio-cni-go/istio-cni/internal/prepared"
	"github.com/istio-cni-go/istio-cni/internal/redirect"
	"github.com/istio-cni-go/istio-cni/internal/repair"
)

// Exit codes: 0 the rules are what the pod needs, 1 they are not, 2 the
// command could not tell.
const (
	ExitOK       = 0
	ExitMismatch = 1
	ExitError    = 2
)

// Main runs the command.
func Main(args []string, stdout, stderr io.Writer) int {
	fs := flag.NewFlagSet("istio-cni-diag", flag.ContinueOnError)
	fs.SetOutput(stderr)
	podRef := fs.String("pod", "", "namespace/name of the pod to explain")
	netnsPath := fs.String("netns", "", "network namespace path (default: the pod's sandbox, found through --proc by the pod's UID and checked to hold its IP)")
	runDir := fs.String("run-dir", plugin.DefaultRunDir, "the agent's run dir (kubeconfig and agent socket)")
	kubeconfig := fs.String("kubeconfig", "", "kubeconfig to read the pod (default: the plugin's, in --run-dir)")
	procDir := fs.String("proc", "", "the host's /proc, to find the pod's namespace (default: /host/proc where it is mounted, as in the agent's container, else /proc)")
	if err := fs.Parse(args); err != nil {
		return ExitError
	}
	if *procDir == "" {
		*procDir = "/proc"
		if _, err := os.Stat("/host/proc/1/ns/net"); err == nil {
			*procDir = "/host/proc"
		}
	}
	if *podRef == "" && *netnsPath == "" {
		fmt.Fprintln(stderr, "give --pod namespace/name, --netns PATH, or both")
		return ExitError
	}
	r := &report{w: stdout}
	code, err := r.run(*podRef, *netnsPath, *runDir, *kubeconfig, *procDir)
	if err != nil {
		fmt.Fprintln(stderr, "istio-cni-diag:", err)
		return ExitError
	}
	return code
}

type report struct{ w io.Writer }

func (r *report) say(format string, args ...any) { fmt.Fprintf(r.w, format+"\n", args...) }

func (r *report) run(podRef, netnsPath, runDir, kubeconfig, procDir string) (int, error) {
	var pod *podinfo.Pod
	// Found by the pod, the namespace is held open and used through the
	// descriptor, so that what was checked is what is inspected.
	shown := netnsPath
	if podRef != "" {
		ns, name, ok := strings.Cut(podRef, "/")
		if !ok {
			return 0, fmt.Errorf("--pod wants namespace/name, got %q", podRef)
		}
		if kubeconfig == "" {
			kubeconfig = filepath.Join(runDir, plugin.KubeconfigName)
		}
		c, err := podinfo.NewAPIClient(kubeconfig, "")
		if err != nil {
			return 0, err
		}
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		if pod, err = c.GetPod(ctx, ns, name); err != nil {
			return 0, fmt.Errorf("reading pod %s: %w", podRef, err)
		}
		r.say("pod %s (uid %s), IPs %v", podRef, pod.UID, pod.PodIPs)
		if netnsPath == "" {
			if len(pod.PodIPs) == 0 {
				return 0, errors.New("the pod has no IP yet; give --netns")
			}
			id := repair.PodNetNS{UID: pod.UID}
			for _, s := range pod.PodIPs {
				ip, err := netip.ParseAddr(s)
				if err != nil {
					return 0, err
				}
				id.IPs = append(id.IPs, ip)
			}
			held, err := repair.OpenPodNetNS(procDir, id)
			if err != nil {
				return 0, err
			}
			defer held.Close()
			shown, netnsPath = held.Name(), repair.FDPath(held)
		}
	}
	r.say("network namespace %s", shown)

	ipt := &iptables.Applier{}
	nft := &nftables.Applier{}
	inspections, err := ipt.Inspect(netnsPath)
	if err != nil {
		return 0, err
	}
	haveIPT := false
	for _, in := range inspections {
		r.say("iptables %s (variant %s): %d rules of ours", in.Family, in.Variant, len(in.Rules))
		for _, l := range in.Rules {
			r.say("  %s", l)
		}
		haveIPT = haveIPT || len(in.Rules) > 0
	}
	nftLines, err := nft.Inspect(netnsPath)
	if err != nil {
		return 0, err
	}
	r.say("nftables: %d chains of ours", len(nftLines))
	for _, l := range nftLines {
		r.say("  %s", l)
	}
	ambientLines, err := nft.InspectTables(netnsPath, nftables.AmbientTablePrefix)
	if err != nil {
		return 0, err
	}
	if len(ambientLines) > 0 {
		r.say("nftables, ambient mode: %d chains", len(ambientLines))
		for _, l := range ambientLines {
			r.say("  %s", l)
		}
	}
	haveNFT := len(nftLines)+len(ambientLines) > 0
	if pod != nil {
		if st := pod.Annotations[ambient.AnnotationRedirection]; st == ambient.RedirectionEnabled || st == ambient.RedirectionPending {
			return r.ambientVerdict(pod, st, netnsPath, len(ambientLines) > 0)
		}
	}

	if pod == nil {
		switch {
		case haveIPT || haveNFT:
			r.say("VERDICT: redirect rules present (give --pod to check them against the pod's annotations)")
		default:
			r.say("VERDICT: no redirect rules in this namespace")
		}
		return ExitOK, nil
	}
	skip := plugin.Exclusion(pod)
	if _, ok := pod.FindContainer("istio-init"); ok {
		// Istio's own init container programmed the pod; istio-cni
		// leaves such a pod alone, and its rules are istio-init's.
		if haveIPT || haveNFT {
			r.say("VERDICT: OK: the pod's istio-init container programmed its rules (istio-cni leaves such pods alone; they are not checked here)")
			return ExitOK, nil
		}
		r.say("VERDICT: MISMATCH: the pod has an istio-init container but no redirect rules")
		return ExitMismatch, nil
	}
	if skip == "" && excludedNamespace(runDir, pod.Namespace) {
		skip = "namespace " + pod.Namespace + " is in the plugin's exclude_namespaces"
	}
	params, _, perr := redirect.FromPod(pod)
	if perr != nil {
		r.say("VERDICT: MISMATCH: the pod's annotations are invalid, so the plugin refuses it: %v", perr)
		return ExitMismatch, nil
	}
	if skip == "" && params.Mode == redirect.ModeNone {
		skip = "interception mode NONE"
	}
	if skip != "" {
		if haveIPT || haveNFT {
			r.say("VERDICT: MISMATCH: the pod should not be redirected (%s) but has rules", skip)
			return ExitMismatch, nil
		}
		r.say("VERDICT: OK: the pod is not redirected (%s) and has no rules", skip)
		return ExitOK, nil
	}
	if haveIPT && len(nftLines) > 0 {
		// Both redirect; the plugin writes one backend's, so one set is
		// another writer's or an earlier config's, and checking either
		// alone would pass a pod whose traffic goes through both.
		r.say("VERDICT: MISMATCH: the pod holds redirect rules of both iptables and nftables; the plugin writes one backend's (native_nftables says which)")
		return ExitMismatch, nil
	}
	var rules plugin.Rules = ipt
	backend := "iptables"
	if haveNFT && !haveIPT {
		rules, backend = nft, "nftables"
	}
	if !haveIPT && !haveNFT {
		r.say("VERDICT: MISMATCH: the pod should be redirected but has no rules: it started before the plugin was in the chain (or in a namespace the plugin's exclude_namespaces listed then); the repair controller fixes it, or delete the pod so that it gets a new sandbox (restarting its containers does not)")
		return ExitMismatch, nil
	}
	plan, err := podrules.BuildPlan(rules, netnsPath, params)
	if err != nil {
		return 0, err
	}
	if err := rules.Check(netnsPath, plan); err != nil {
		r.say("VERDICT: MISMATCH (%s): %v", backend, err)
		return ExitMismatch, nil
	}
	r.say("VERDICT: OK: the %s rules are exactly what the pod's annotations ask for (%s, IPv6 %v)", backend, params.Mode, plan.V6 != nil)
	return ExitOK, nil
}

// ambientVerdict checks an ambient-enrolled pod (annotated enabled or
// pending by the agent) against ambient mode's rules for its annotations.
// The node's defaults (AMBIENT_DNS_CAPTURE, AMBIENT_IPV6) are the agent's
// settings, which this command cannot read, so each is tried; the rules
// pass when they are exactly those of one of them.
func (r *report) ambientVerdict(pod *podinfo.Pod, state, netnsPath string, nftRules bool) (int, error) {
	r.say("ambient mode: the agent annotated the pod %s=%s", ambient.AnnotationRedirection, state)
	k := &corev1.Pod{ObjectMeta: metav1.ObjectMeta{Namespace: pod.Namespace, Name: pod.Name, Annotations: pod.Annotations}}
	if _, err := ambient.PodParams(k, ambient.Defaults{}); err != nil {
		r.say("VERDICT: MISMATCH: the pod's ambient annotations are invalid, so the agent refuses them: %v", err)
		return ExitMismatch, nil
	}
	// The backend is the agent's native_nftables, which this command
	// cannot read either: the one whose tables are there first, then the
	// other (rules flushed whole leave no hint).
	type backend struct {
		name  string
		inPod ambientnet.InPod
	}
	backends := []backend{{"iptables", &iptables.Applier{}}, {"nftables", &nftables.Applier{}}}
	if nftRules {
		backends[0], backends[1] = backends[1], backends[0]
	}
	var diffs []string
	for _, b := range backends {
		var first error
		for _, d := range []ambient.Defaults{{DNSCapture: true, IPv6: true}, {DNSCapture: true}, {IPv6: true}, {}} {
			p, _ := ambient.PodParams(k, d)
			err := b.inPod.CheckAmbient(netnsPath, p)
			if err == nil {
				r.say("VERDICT: OK: the %s ambient rules are exactly what the pod asks for (DNS capture %v, IPv6 %v, bypass inbound %v, reroute %v)",
					b.name, p.DNSCapture, p.IPv6, p.BypassInbound, p.RerouteInterfaces)
				return ExitOK, nil
			}
			if first == nil {
				first = err
			}
		}
		diffs = append(diffs, fmt.Sprintf("%s: %v", b.name, first))
	}
	r.say("VERDICT: MISMATCH (ambient mode): %s; the agent re-applies an enrolled pod's rules at its next check (every minute), and says so in an AmbientRulesRepaired Event",
		strings.Join(diffs, "; "))
	return ExitMismatch, nil
}

// excludedNamespace reports whether ns is in the exclude_namespaces of a
// plugin config the agent learnt (kept in its run dir's prepared records,
// with prepare-ahead on, as by default): the plugin skips such pods before
// anything else, and a restart does not change that.
func excludedNamespace(runDir, ns string) bool {
	for _, c := range prepared.Dir(filepath.Join(runDir, prepared.DirName)).LoadConfigs() {
		conf, err := plugin.ParseConfig(c)
		if err == nil && slices.Contains(conf.ExcludeNamespaces, ns) {
			return true
		}
	}
	return false
}
