package e2e

import (
	"fmt"
	"os/exec"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/containernetworking/plugins/pkg/ns"

	"github.com/istio-cni-go/istio-cni/internal/testenv"
)

// attackerNetNS is what any unprivileged user of a node can make: a
// network namespace of their own user namespace, holding ip. It returns
// the namespace's path.
func attackerNetNS(t *testing.T, ip string) string {
	t.Helper()
	cmd := exec.Command("/bin/sleep", "infinity")
	cmd.SysProcAttr = &syscall.SysProcAttr{Cloneflags: syscall.CLONE_NEWUSER | syscall.CLONE_NEWNET,
		// Root inside, which is the host's nobody: no privilege at all.
		Credential:  &syscall.Credential{Uid: 0, Gid: 0, NoSetGroups: true},
		UidMappings: []syscall.SysProcIDMap{{ContainerID: 0, HostID: 65534, Size: 1}},
		GidMappings: []syscall.SysProcIDMap{{ContainerID: 0, HostID: 65534, Size: 1}}}
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = cmd.Process.Kill(); _ = cmd.Wait() })
	path := fmt.Sprintf("/proc/%d/ns/net", cmd.Process.Pid)
	// The user is root in their own user namespace and may do this
	// themselves; done from here for brevity, it changes nothing the
	// agent sees.
	err := ns.WithNetNSPath(path, func(ns.NetNS) error {
		for _, args := range [][]string{{"link", "add", "fake0", "type", "veth", "peer", "name", "fake1"}, {"addr", "add", ip + "/32", "dev", "fake0"},
			{"link", "set", "fake0", "up"}, {"link", "set", "lo", "up"}} {
			if b, err := exec.Command("ip", args...).CombinedOutput(); err != nil {
				return fmt.Errorf("ip %v: %w %s", args, err, b)
			}
		}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	return path
}

func istioChainsIn(t *testing.T, netnsPath string) string {
	t.Helper()
	var out string
	err := ns.WithNetNSPath(netnsPath, func(ns.NetNS) error {
		b, err := exec.Command("iptables-nft-save", "-t", "nat").CombinedOutput()
		out = string(b)
		return err
	})
	if err != nil {
		t.Fatal(err)
	}
	if strings.Contains(out, "ISTIO_") {
		return out
	}
	return ""
}

// TestRepairFindsThePodByIdentity: repair and the start-up scan find a
// pod's network namespace by the pod's UID in its sandbox's cgroup, never
// by its IP alone. An unprivileged user's namespace holding the same IP
// (issue: repair chose it 10 times out of 10) is never programmed, and a
// namespace that does not hold the pod's IP or belongs to another user
// namespace than the pod's is refused with an Event saying why.
func TestRepairFindsThePodByIdentity(t *testing.T) {
	ensureDaemonSet(t, false)
	e := newEnv(t, nil)

	// Attackers made before and after the pod, so neither a first nor a
	// last match can pick them.
	pod, ip := racedPod(t, e, testenv.PodSpec{Sidecar: true, InitNames: []string{"istio-validation"}})
	before, after := attackerNetNS(t, ip), attackerNetNS(t, ip)
	h := repairHost(t, "--repair-host-proc", "/proc")
	h.waitReadyz(200, 20*time.Second)
	markValidation(t, pod.Name, ip, 126)
	waitEvent(t, pod.Name, "RepairedPod")
	if code, out, _ := runValidation(t, pod); code != 0 {
		t.Fatalf("validation after repair: exit %d, want 0:\n%s", code, out)
	}
	for _, p := range []string{before, after} {
		if rules := istioChainsIn(t, p); rules != "" {
			t.Fatalf("repair programmed an unprivileged user's namespace %s:\n%s", p, rules)
		}
	}

	t.Run("sandbox-without-the-pod-IP", func(t *testing.T) {
		// The status says an IP that the pod's namespace does not hold:
		// only an attacker's namespace does.
		pod, _ := racedPod(t, e, testenv.PodSpec{Sidecar: true, InitNames: []string{"istio-validation"}})
		attacker := attackerNetNS(t, "10.98.0.7")
		markValidation(t, pod.Name, "10.98.0.7", 126)
		ev := waitEvent(t, pod.Name, "RepairPodFailed")
		if !strings.Contains(ev.Message, "does not hold the pod's IP") {
			t.Fatalf("event does not say why: %q", ev.Message)
		}
		if rules := istioChainsIn(t, attacker); rules != "" {
			t.Fatalf("repair programmed the namespace holding the claimed IP:\n%s", rules)
		}
		if rules := rulesIn(t, pod); strings.Contains(rules, "ISTIO_") {
			t.Fatalf("repair programmed a namespace it refused:\n%s", rules)
		}
	})

	t.Run("user-namespaced-sandbox-of-a-pod-without-hostUsers-false", func(t *testing.T) {
		pod, ip := racedPodIn(t, e, testenv.NewUserNSPod, testenv.PodSpec{Sidecar: true, InitNames: []string{"istio-validation"}})
		markValidation(t, pod.Name, ip, 126)
		ev := waitEvent(t, pod.Name, "RepairPodFailed")
		if !strings.Contains(ev.Message, "user namespace") {
			t.Fatalf("event does not say why: %q", ev.Message)
		}
	})
}
