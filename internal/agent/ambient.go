package agent

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"path/filepath"

	"github.com/istio-cni-go/istio-cni/internal/ambient"
	"github.com/istio-cni-go/istio-cni/internal/ambientnet"
	"github.com/istio-cni-go/istio-cni/internal/repair"
	"github.com/istio-cni-go/istio-cni/internal/ruleset"
	"github.com/istio-cni-go/istio-cni/internal/zds"
)

// ambientPart is ambient mode's controller as the agent runs it.
type ambientPart struct {
	c    *ambient.Controller
	host ambientnet.Host
	// stale is the other backend's host rules (an earlier agent's).
	stale     ambientnet.Host
	hostNetns string
	// closeNetns releases the node's namespace, once nothing uses it.
	closeNetns func()
}

// hostNetns opens the node's network namespace, where the node's rules
// go, and names it by the agent's descriptor (held until close), so a
// kubelet restart cannot change what the name means. When the agent runs
// in a pod network of its own (ALLOW_SWITCH_TO_HOST_NS), that is the
// kubelet's namespace, found in the host's /proc, else PID 1's as Istio
// takes it (the same on a plain node; the kubelet's is right where the
// node is itself a namespace of a bigger machine, as in kind or this
// project's test node); else the agent's own.
func hostNetns(cfg *Config, log *slog.Logger) (path string, closeFn func(), err error) {
	if !cfg.Ambient.SwitchToHostNS {
		return "/proc/self/ns/net", func() {}, nil
	}
	pid1 := filepath.Join(cfg.HostProcDir, "1", "ns", "net")
	path = cfg.Ambient.NodeNetns
	switch path {
	case "pid1":
		path = pid1
	case "", "kubelet":
		rel, kerr := ambientnet.KubeletNetns(os.DirFS(cfg.HostProcDir))
		switch {
		case kerr == nil:
			path = filepath.Join(cfg.HostProcDir, rel)
		case path == "kubelet":
			return "", nil, fmt.Errorf("the kubelet's network namespace (AMBIENT_NODE_NETNS=kubelet): %w", kerr)
		default:
			path = pid1
			log.Info("the node's network namespace is taken as PID 1's", "reason", kerr.Error())
		}
	}
	f, err := os.Open(path) //nolint:gosec // G304: the host's /proc, or the path configured
	if err != nil {
		return "", nil, fmt.Errorf("opening the node's network namespace: %w", err)
	}
	log.Info("the node's probe SNAT goes into this network namespace", "path", path)
	return repair.FDPath(f), func() { _ = f.Close() }, nil
}

// newAmbient builds the controller from the agent's settings; it runs in
// startAmbient.
func (a *Agent) newAmbient(cfg *Config) (*ambientPart, error) {
	if a.Clientset == nil || a.Namespaces == nil {
		return nil, errors.New("ambient mode needs API access (pods and namespaces), and the agent has none")
	}
	nft := cfg.Loop.Install.Entry.NativeNftables
	inPod, host := ambientnet.Backends(nft, cfg.ForceIPTablesBinary)
	hp := ruleset.HostParams{IPv6: cfg.Ambient.IPv6}
	if nft {
		// nftables cannot ask whether a socket exists: the kubelet's
		// connections are told by their owner.
		uid, err := ambientnet.KubeletUID(os.DirFS(cfg.HostProcDir))
		if err != nil {
			a.log.Warn("kubelet not found in the host's /proc; the probe SNAT matches every connection the node opens to an enrolled pod",
				"hostProc", cfg.HostProcDir, "error", err.Error())
		} else {
			hp.KubeletUID = &uid
		}
	}
	netnsPath, closeNetns, err := hostNetns(cfg, a.log)
	if err != nil {
		return nil, err
	}
	p := &ambientPart{host: host, stale: ambientnet.OtherHost(nft), hostNetns: netnsPath, closeNetns: closeNetns}
	am := cfg.Ambient
	c, err := ambient.New(ambient.Config{
		Node: cfg.NodeName, Kube: a.Clientset, Namespaces: a.Namespaces,
		Policy: ambient.Policy{Selectors: am.Selectors, ExcludeNamespaces: cfg.Loop.Install.Entry.ExcludeNamespaces,
			SystemNamespace: cfg.Loop.Install.Entry.PodNamespace},
		Defaults: ambient.Defaults{DNSCapture: am.DNSCapture, IPv6: am.IPv6},
		InPod:    inPod, Host: host, StaleHost: p.stale, HostNetns: p.hostNetns, HostParams: hp,
		ZDS:     zds.Config{Path: am.ZtunnelSocket},
		ProcDir: cfg.HostProcDir,
		// Its own lock per namespace: the CNI server holds the
		// namespace's lock while it asks the controller to enrol.
		ZtunnelWait: am.ZtunnelWait, HostInterval: am.HostInterval, VerifyInterval: am.VerifyInterval,
		Registerer: a.metrics.Registry,
		Log:        a.log,
	})
	if err != nil {
		closeNetns()
		return nil, err
	}
	p.c = c
	return p, nil
}

// start runs the controller until ctx ends; the channel is closed once it
// has stopped.
func (p *ambientPart) start(ctx context.Context, a *Agent) <-chan struct{} {
	done := make(chan struct{})
	go func() {
		defer close(done)
		if err := p.c.Run(ctx); err != nil {
			a.log.Error("ambient controller stopped", "error", err.Error())
		}
	}()
	return done
}

// uninstall removes the node's probe SNAT and sets, as an uninstall
// does: no enrolled pod is left to probe. The pods' own rules stay with
// them (ztunnel is being removed too, and they are restarted to leave
// the mesh).
func (p *ambientPart) uninstall(a *Agent) {
	// The other backend's too: an earlier agent's, which the controller
	// may not have got to remove.
	if err := p.stale.RemoveHost(p.hostNetns); err != nil {
		a.log.Warn("removing the other rule backend's probe SNAT", "error", err.Error())
	}
	if err := p.host.RemoveHost(p.hostNetns); err != nil {
		a.log.Warn("removing the node's ambient probe SNAT", "error", err.Error())
		return
	}
	a.log.Info("removed the node's ambient probe SNAT rules and sets")
}
