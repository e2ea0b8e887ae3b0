package main

import (
	"context"
	"fmt"
	"net/netip"
	"path/filepath"
	"time"

	"github.com/containernetworking/cni/libcni"
	current "github.com/containernetworking/cni/pkg/types/100"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	k8stypes "k8s.io/apimachinery/pkg/types"

	"github.com/istio-cni-go/istio-cni/internal/ambient"
	"github.com/istio-cni-go/istio-cni/internal/iptables"
	"github.com/istio-cni-go/istio-cni/internal/testenv"
	"github.com/istio-cni-go/istio-cni/internal/ztunnelsim"
)

// ambientBackends are the backends the ambient series runs on, each with
// an agent of its own (the agent's backend is its setting, not a pod's).
var ambientBackends = []string{"iptables", "nftables"}

// ambientSeries runs, for each backend, with the agent in ambient mode
// and a stand-in ztunnel binding its listeners in each pod: n rounds of
// the primary plugin alone, a sidecar pod and an enrolled pod through
// the chain (alternated, so the machine's drift hits all three alike),
// then n running pods labelled into the mesh, timed from the label's
// patch to ztunnel's acknowledgement. The sidecar agent must be stopped.
func (b *bench) ambientSeries(ctx context.Context, n int) (*samples, error) {
	s := newSamples()
	for _, backend := range ambientBackends {
		if err := b.ambientBackend(ctx, s, backend, n); err != nil {
			return nil, fmt.Errorf("ambient, %s: %w", backend, err)
		}
	}
	return s, nil
}

func (b *bench) ambientBackend(ctx context.Context, s *samples, backend string, n int) error {
	sock := filepath.Join(b.dir, "ztunnel-"+backend+".sock")
	extra := []string{"--ambient-enabled", "--ambient-dns-capture=true", "--ztunnel-uds-address", sock}
	list := b.node.Chained
	if backend == "nftables" {
		extra = append(extra, "--native-nftables=true")
		list = b.chainedNFT
	}
	stop, err := b.startAgentIn(ctx, "agent-ambient-"+backend, extra...)
	if err != nil {
		return err
	}
	defer stop()
	defer func() {
		// The node's probe SNAT stays with an agent stopped for an
		// upgrade; the next backend's agent starts from a clean node.
		_ = (&iptables.Applier{}).RemoveHost("/proc/self/ns/net")
	}()
	sim, err := ztunnelsim.Start(ztunnelsim.Config{Path: sock, Listeners: true, Reconnect: true})
	if err != nil {
		return err
	}
	defer sim.Close()
	wctx, cancel := context.WithTimeout(ctx, 10*time.Second)
	_, err = sim.Wait(wctx, func(st ztunnelsim.State) bool { return st.Connected && st.Snapshots == 1 })
	cancel()
	if err != nil {
		return fmt.Errorf("the stand-in ztunnel never got its snapshot: %w", err)
	}
	prefix := "amb/" + backend + "/"
	enrolled := map[string]string{ambient.LabelDataplaneMode: ambient.ModeAmbient}
	for i := 0; i < n; i++ {
		if err := b.pod(ctx, s, prefix+"primary", b.node.Primary); err != nil {
			return err
		}
		if err := b.specPod(ctx, s, prefix+"sidecar", list, testenv.PodSpec{Sidecar: true}); err != nil {
			return err
		}
		if err := b.specPod(ctx, s, prefix+"enrolled", list, testenv.PodSpec{Labels: enrolled}); err != nil {
			return err
		}
	}
	for i := 0; i < n; i++ {
		if err := b.enrolRunning(ctx, s, prefix+"enrol running pod", list, sim); err != nil {
			return err
		}
	}
	return nil
}

// specPod is pod for a pod shaped by spec (its namespace and name are
// the bench's); the pod object is deleted after its DEL, so the agent
// lets its namespace go.
func (b *bench) specPod(ctx context.Context, s *samples, series string, list *libcni.NetworkConfigList, spec testenv.PodSpec) error {
	pod, err := b.preparePodSpec(ctx, spec)
	if err != nil {
		return err
	}
	defer pod.Close()
	defer b.deletePod(pod.Name)
	// An enrolled pod's ADD returns once ztunnel acknowledged it.
	return b.addDel(ctx, s, series, list, pod)
}

func (b *bench) deletePod(name string) {
	zero := int64(0)
	_ = b.cluster.Client.CoreV1().Pods("bench").Delete(context.Background(), name, metav1.DeleteOptions{GracePeriodSeconds: &zero})
}

// enrolRunning starts a pod no selector enrols, reports its address as
// the kubelet does, then labels it into the mesh and times the label's
// patch to ztunnel's acknowledgement of its namespace.
func (b *bench) enrolRunning(ctx context.Context, s *samples, series string, list *libcni.NetworkConfigList, sim *ztunnelsim.Sim) error {
	pod, err := b.preparePodSpec(ctx, testenv.PodSpec{})
	if err != nil {
		return err
	}
	defer pod.Close()
	defer b.deletePod(pod.Name)
	res, err := b.node.Add(ctx, list, pod)
	if err != nil {
		return fmt.Errorf("%s ADD: %w", series, err)
	}
	defer func() { _ = b.node.Del(context.Background(), list, pod) }()
	r, err := current.NewResultFromResult(res)
	if err != nil || len(r.IPs) == 0 {
		return fmt.Errorf("%s: ADD result %v: %w", series, res, err)
	}
	ip, _ := netip.AddrFromSlice(r.IPs[0].Address.IP.To4())
	pods := b.cluster.Client.CoreV1().Pods("bench")
	p, err := pods.Get(ctx, pod.Name, metav1.GetOptions{})
	if err != nil {
		return err
	}
	p.Status.Phase, p.Status.PodIP, p.Status.PodIPs = corev1.PodRunning, ip.String(), []corev1.PodIP{{IP: ip.String()}}
	if _, err := pods.UpdateStatus(ctx, p, metav1.UpdateOptions{}); err != nil {
		return err
	}
	// The sandbox as the kubelet runs it: a process of the pod's cgroup
	// in its namespace, by which the agent finds the namespace.
	stopSandbox, err := pod.StartSandboxProcess()
	if err != nil {
		return err
	}
	defer stopSandbox()
	patch := []byte(fmt.Sprintf(`{"metadata":{"labels":{%q:%q}}}`, ambient.LabelDataplaneMode, ambient.ModeAmbient))
	start := time.Now()
	if _, err := pods.Patch(ctx, pod.Name, k8stypes.MergePatchType, patch, metav1.PatchOptions{}); err != nil {
		return err
	}
	wctx, cancel := context.WithTimeout(ctx, 30*time.Second)
	defer cancel()
	if _, err := sim.Wait(wctx, func(st ztunnelsim.State) bool { _, ok := st.Workloads[pod.UID]; return ok }); err != nil {
		return fmt.Errorf("%s: the labelled pod never reached ztunnel: %w", series, err)
	}
	s.record(series, time.Since(start))
	return nil
}
