package ambient

import (
	"fmt"
	"net/netip"
	"os"

	"github.com/istio-cni-go/istio-cni/internal/podnet"
	"github.com/istio-cni-go/istio-cni/internal/repair"
)

// fdPath names an open namespace by the agent's descriptor (no bind
// mount of the runtime's is needed).
func fdPath(f *os.File) string { return repair.FDPath(f) }

// netnsIndex maps pod UIDs to /proc/<pid>/ns/net of their sandbox
// process, read once per pass over many pods.
type netnsIndex struct {
	procDir string
	index   map[string]string
	err     error
	read    bool
}

// find opens the network namespace of a running pod: the one of the
// oldest process in the pod's cgroup (identity by UID), accepted only if
// it holds one of the pod's IPs, so a namespace is never taken for the
// pod's by its address alone, nor by its cgroup alone.
func (x *netnsIndex) find(uid string, ips []netip.Addr, hostUsers *bool) (*os.File, error) {
	if !x.read {
		x.index, x.err = repair.IndexPodNetNS(x.procDir)
		x.read = true
	}
	if x.err != nil {
		return nil, fmt.Errorf("scanning %s for the pod's processes: %w", x.procDir, x.err)
	}
	path, ok := x.index[uid]
	if !ok {
		return nil, fmt.Errorf("no process of pod %s found under %s (no cgroup path names its UID)", uid, x.procDir)
	}
	if len(ips) == 0 {
		return nil, fmt.Errorf("pod %s has no IP yet to check its network namespace %s against", uid, path)
	}
	f, err := repair.OpenVerifiedNetNS(path, repair.PodNetNS{UID: uid, IPs: ips, HostUsers: hostUsers})
	if err != nil {
		return nil, fmt.Errorf("the network namespace of pod %s's sandbox process: %w", uid, err)
	}
	return f, nil
}

// netnsAddrs lists the pod addresses a namespace holds, for an ADD that
// comes before the kubelet has reported them: loopback and link-local
// ones are no pod IPs.
func netnsAddrs(f *os.File) ([]netip.Addr, error) {
	all, err := podnet.PodAddrs(fdPath(f))
	if err != nil {
		return nil, err
	}
	var out []netip.Addr
	for _, a := range all {
		if a.IsLoopback() || a.IsLinkLocalUnicast() || a.IsUnspecified() {
			continue
		}
		out = append(out, a)
	}
	return out, nil
}

// sameNetns reports whether two descriptors name one namespace.
func sameNetns(a, b *os.File) bool {
	if a == nil || b == nil {
		return false
	}
	ka, err1 := keyOf(a)
	kb, err2 := keyOf(b)
	return err1 == nil && err2 == nil && ka == kb
}
