package iptables

import (
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/containernetworking/plugins/pkg/ns"
	"github.com/vishvananda/netlink"
	"golang.org/x/sys/unix"

	"github.com/istio-cni-go/istio-cni/internal/podnet"
	"github.com/istio-cni-go/istio-cni/internal/ruleset"
	"github.com/istio-cni-go/istio-cni/internal/testenv"
	"github.com/istio-cni-go/istio-cni/internal/testutil"
	"github.com/istio-cni-go/istio-cni/internal/testutil/testplan"
)

func newNS(t *testing.T) ns.NetNS { return testutil.NewNS(t) }

func planFor(t *testing.T, c testutil.RedirectCase, v6 bool) *ruleset.Plan {
	return testplan.For(t, c, v6)
}

func saveAll(t *testing.T, n ns.NetNS, variant string) string {
	t.Helper()
	var out strings.Builder
	err := n.Do(func(ns.NetNS) error {
		for _, bin := range []string{"iptables-" + variant + "-save", "ip6tables-" + variant + "-save"} {
			b, err := exec.Command(bin).CombinedOutput()
			if err != nil {
				return err
			}
			out.Write(b)
		}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	return out.String()
}

func actions(r podnet.Report) string {
	var s []string
	for _, f := range r.Families {
		s = append(s, f.Action)
	}
	return strings.Join(s, ",")
}

// TestApplyEveryCase applies every golden case in a fresh namespace with
// each iptables variant, for IPv4 only and for both families, and proves
// that read-back equals the plan (so re-ADD is a no-op), that a second
// apply changes nothing, that a different plan replaces rather than adds,
// and that removal leaves no chain of ours.
func TestApplyEveryCase(t *testing.T) {
	testutil.RequireRoot(t)
	testutil.RequireTools(t, "iptables-legacy-restore", "iptables-nft-restore", "ip6tables-legacy-restore", "ip6tables-nft-restore")
	other := planFor(t, testutil.RedirectCases[0], true)
	for _, variant := range []string{VariantLegacy, VariantNFT} {
		for _, v6 := range []bool{false, true} {
			for _, c := range testutil.RedirectCases {
				name := variant + "/" + c.Name
				if v6 {
					name += "/v6"
				}
				t.Run(name, func(t *testing.T) {
					n := newNS(t)
					a := &Applier{Force: variant}
					plan := planFor(t, c, v6)
					rep, err := a.Apply(n.Path(), plan)
					if err != nil {
						t.Fatal(err)
					}
					if err := a.Check(n.Path(), plan); err != nil {
						t.Fatalf("check after apply: %v\nkernel has:\n%s", err, saveAll(t, n, variant))
					}
					rep, err = a.Apply(n.Path(), plan)
					if err != nil {
						t.Fatal(err)
					}
					for _, f := range rep.Families {
						if f.Action != "unchanged" && f.Action != "none" {
							t.Fatalf("second apply was not a no-op: %s", rep)
						}
					}
					if _, err := a.Apply(n.Path(), other); err != nil {
						t.Fatalf("replacing: %v", err)
					}
					if err := a.Check(n.Path(), other); err != nil {
						t.Fatalf("check after replace: %v\nkernel has:\n%s", err, saveAll(t, n, variant))
					}
					if err := a.Check(n.Path(), plan); err == nil && c.Name != "basic" && c.Name != "custom-uid-zero" {
						t.Fatalf("check passed against the old plan after replacement")
					}
					if _, err := a.Remove(n.Path()); err != nil {
						t.Fatalf("remove: %v", err)
					}
					if got := saveAll(t, n, variant); strings.Contains(got, "ISTIO_") || strings.Contains(got, "1337") || strings.Contains(got, "0x539") {
						t.Fatalf("rules left after remove:\n%s", got)
					}
				})
			}
		}
	}
}

// TestDetectPrefersExistingLegacy checks Istio's variant choice: legacy
// only when the namespace already has legacy tables, nft otherwise.
func TestDetectPrefersExistingLegacy(t *testing.T) {
	testutil.RequireRoot(t)
	plan := planFor(t, testutil.RedirectCases[0], false)
	a := &Applier{}

	fresh := newNS(t)
	rep, err := a.Apply(fresh.Path(), plan)
	if err != nil {
		t.Fatal(err)
	}
	if rep.Families[0].Variant != VariantNFT {
		t.Fatalf("fresh namespace: variant %s, want nft", rep.Families[0].Variant)
	}

	seeded := newNS(t)
	if err := seeded.Do(func(ns.NetNS) error {
		return exec.Command("iptables-legacy", "-w", "30", "-t", "filter", "-A", "INPUT", "-p", "255", "-j", "RETURN").Run()
	}); err != nil {
		t.Fatal(err)
	}
	rep, err = a.Apply(seeded.Path(), plan)
	if err != nil {
		t.Fatal(err)
	}
	if rep.Families[0].Variant != VariantLegacy {
		t.Fatalf("namespace with legacy rules: variant %s, want legacy", rep.Families[0].Variant)
	}
	if got := saveAll(t, seeded, "legacy"); !strings.Contains(got, "-A INPUT -p 255 -j RETURN") || !strings.Contains(got, ":ISTIO_OUTPUT") {
		t.Fatalf("legacy state lost the foreign rule or lacks ours:\n%s", got)
	}
}

// TestReplaceKeepsForeignRules proves that replacing our rules leaves the
// rules of other components in built-in chains alone.
func TestReplaceKeepsForeignRules(t *testing.T) {
	testutil.RequireRoot(t)
	n := newNS(t)
	a := &Applier{Force: VariantNFT}
	if err := n.Do(func(ns.NetNS) error {
		return exec.Command("iptables-nft", "-t", "nat", "-A", "OUTPUT", "-p", "tcp", "--dport", "9999", "-j", "RETURN").Run()
	}); err != nil {
		t.Fatal(err)
	}
	tproxy := planFor(t, testutil.RedirectCases[4], false)
	if _, err := a.Apply(n.Path(), tproxy); err != nil {
		t.Fatal(err)
	}
	basic := planFor(t, testutil.RedirectCases[0], false)
	rep, err := a.Apply(n.Path(), basic)
	if err != nil {
		t.Fatal(err)
	}
	if actions(rep) != "replaced,none" {
		t.Fatalf("want replaced,none got %s", rep)
	}
	got := saveAll(t, n, "nft")
	if !strings.Contains(got, "--dport 9999 -j RETURN") {
		t.Fatalf("foreign rule lost:\n%s", got)
	}
	if strings.Contains(got, "ISTIO_TPROXY") || strings.Contains(got, "CONNMARK") {
		t.Fatalf("old TPROXY rules left:\n%s", got)
	}
	if err := a.Check(n.Path(), basic); err != nil {
		t.Fatal(err)
	}
}

// TestCommandsDoNotSeeNSS proves that, on a node whose nsswitch.conf
// sends user lookups to a network service, the commands the applier
// starts run in the pod's network namespace with that file reading empty
// (so `--uid-owner` lookups cannot reach LDAP or SSSD), that the rest of
// the process still sees the real file afterwards, on any thread, and
// that a file naming local services only is left alone (no private mount
// namespace is made).
func TestCommandsDoNotSeeNSS(t *testing.T) {
	testutil.RequireRoot(t)
	testutil.RequireTools(t, "cat", "readlink")
	for _, c := range []struct {
		name, conf string
		hidden     bool
	}{
		{"ldap", "passwd: files ldap\ngroup: files ldap\nhosts: files dns\n", true},
		{"sss after an action", "passwd: files [NOTFOUND=return] sss\n", true},
		{"local only", "passwd: files systemd\ngroup: files systemd\nhosts: files dns mdns4\n", false},
	} {
		t.Run(c.name, func(t *testing.T) {
			path := filepath.Join(t.TempDir(), "nsswitch.conf")
			if err := os.WriteFile(path, []byte(c.conf), 0o644); err != nil {
				t.Fatal(err)
			}
			saved := nsswitchPath
			nsswitchPath = path
			t.Cleanup(func() { nsswitchPath = saved })
			pod := newNS(t)
			var st unix.Stat_t
			if err := unix.Stat(pod.Path(), &st); err != nil {
				t.Fatal(err)
			}
			err := inPodNetns(pod.Path(), func(ns.NetNS) error {
				out, err := exec.Command("cat", path).Output()
				if err != nil {
					return err
				}
				if c.hidden && len(out) != 0 {
					return fmt.Errorf("a command started for the pod reads %s: %q", path, out)
				}
				if !c.hidden && string(out) != c.conf {
					return fmt.Errorf("a command started for the pod reads %s as %q; a local-only file needs no hiding", path, out)
				}
				link, err := exec.Command("readlink", "/proc/self/ns/net").Output()
				if err != nil {
					return err
				}
				if want := fmt.Sprintf("net:[%d]", st.Ino); strings.TrimSpace(string(link)) != want {
					return fmt.Errorf("command ran in %s, want the pod's %s", strings.TrimSpace(string(link)), want)
				}
				mnt, err := exec.Command("readlink", "/proc/self/ns/mnt").Output()
				if err != nil {
					return err
				}
				own, err := os.Readlink("/proc/self/ns/mnt")
				if err != nil {
					return err
				}
				if sameMnt := strings.TrimSpace(string(mnt)) == own; sameMnt == c.hidden {
					return fmt.Errorf("command's mount namespace %s, the process's %s; want a private one only for hiding", strings.TrimSpace(string(mnt)), own)
				}
				return nil
			})
			if err != nil {
				t.Fatal(err)
			}
			var wg sync.WaitGroup
			for i := 0; i < 16; i++ {
				wg.Add(1)
				go func() {
					defer wg.Done()
					runtime.LockOSThread()
					defer runtime.UnlockOSThread()
					if got, err := os.ReadFile(path); err != nil || string(got) != c.conf {
						t.Errorf("after a pod command, the process reads %s as %q (%v)", path, got, err)
					}
				}()
			}
			wg.Wait()
		})
	}
}

func TestNSSLocal(t *testing.T) {
	for conf, want := range map[string]bool{
		"": true,
		"passwd: files systemd\ngroup: files systemd\n": true,
		"passwd:compat\n":                         true,
		"passwd: files [SUCCESS=return] systemd":  true,
		"passwd: files # ldap\n":                  true,
		"hosts: files dns ldap\nnetgroup: nis\n":  true,
		"passwd: files sss\n":                     false,
		"group: files ldap\n":                     false,
		"passwd: files [NOTFOUND=return] winbind": false,
		"passwd: files [ NOTFOUND=return ] nis":   false,
		"passwd: files extrausers\n":              false,
	} {
		if got := nssLocal([]byte(conf)); got != want {
			t.Errorf("nssLocal(%q) = %v, want %v", conf, got, want)
		}
	}
	if nssReachesOut(filepath.Join(t.TempDir(), "missing")) {
		t.Error("a missing nsswitch.conf reaches out")
	}
}

// userNSPod is a network namespace that belongs to a user namespace of
// its own (a pod with hostUsers: false).
func userNSPod(t *testing.T) ns.NetNS {
	t.Helper()
	testutil.RequireRoot(t)
	pod, err := testenv.NewUserNSPod("default", "p", "", "c")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(pod.Close)
	return pod.NetNS
}

// hiding returns a LookPath that does not find the named binaries.
func hiding(names ...string) func(string) (string, error) {
	a := &Applier{}
	return func(name string) (string, error) {
		for _, n := range names {
			if n == name {
				return "", fmt.Errorf("%s hidden by the test", name)
			}
		}
		return a.lookPath(name)
	}
}

// TestUserNamespacedPodVariants writes the owner rules of a user-namespaced
// pod with each variant and with each nsenter the agent may find (util-linux
// on a node, busybox in the agent's image), and reads them back.
func TestUserNamespacedPodVariants(t *testing.T) {
	testutil.RequireTools(t, "nsenter", "busybox", "iptables-legacy-restore", "iptables-nft-restore")
	plan := planFor(t, testutil.RedirectCases[0], false)
	for _, variant := range []string{VariantLegacy, VariantNFT} {
		for _, tool := range []string{"nsenter", "busybox"} {
			t.Run(variant+"/"+tool, func(t *testing.T) {
				pod := userNSPod(t)
				a := &Applier{Force: variant}
				if tool == "busybox" {
					a.LookPath = hiding("nsenter")
				}
				rep, err := a.Apply(pod.Path(), plan)
				if err != nil {
					t.Fatal(err)
				}
				if got := actions(rep); got != "applied,none" {
					t.Fatalf("actions = %s", got)
				}
				if err := a.Check(pod.Path(), plan); err != nil {
					t.Fatalf("read-back: %v", err)
				}
				if save := saveAll(t, pod, variant); !strings.Contains(save, "--uid-owner 1337") {
					t.Fatalf("no owner rule in:\n%s", save)
				}
			})
		}
	}
}

// TestUserNamespacedPodWithoutNsenter: with no way into the pod's user
// namespace the ADD fails saying why, and nothing is half-applied.
func TestUserNamespacedPodWithoutNsenter(t *testing.T) {
	testutil.RequireTools(t, "iptables-nft-restore")
	pod := userNSPod(t)
	a := &Applier{Force: VariantNFT, LookPath: hiding("nsenter", "busybox")}
	_, err := a.Apply(pod.Path(), planFor(t, testutil.RedirectCases[0], false))
	if err == nil || !strings.Contains(err.Error(), "hostUsers: false") || !strings.Contains(err.Error(), "nsenter") {
		t.Fatalf("want an error naming hostUsers and nsenter, got %v", err)
	}
	if save := saveAll(t, pod, VariantNFT); strings.Contains(save, "ISTIO") {
		t.Fatalf("rules applied despite the error:\n%s", save)
	}
}

// TestCheckFindsMissingPolicyRoute: CHECK on a TPROXY pod fails when its
// fwmark policy rule is gone, even with every iptables rule in place.
func TestCheckFindsMissingPolicyRoute(t *testing.T) {
	testutil.RequireTools(t, "iptables-nft-restore")
	var tproxy testutil.RedirectCase
	for _, c := range testutil.RedirectCases {
		if c.Name == "tproxy" {
			tproxy = c
		}
	}
	plan := planFor(t, tproxy, false)
	pod := newNS(t)
	a := &Applier{Force: VariantNFT}
	if _, err := a.Apply(pod.Path(), plan); err != nil {
		t.Fatal(err)
	}
	if err := a.Check(pod.Path(), plan); err != nil {
		t.Fatalf("CHECK right after ADD: %v", err)
	}
	if err := pod.Do(func(ns.NetNS) error { return netlink.RuleDel(podnet.TProxyRule(netlink.FAMILY_V4)) }); err != nil {
		t.Fatal(err)
	}
	err := a.Check(pod.Path(), plan)
	if err == nil || !strings.Contains(err.Error(), "policy rule fwmark 1337 lookup 133 missing") {
		t.Fatalf("CHECK without the policy rule: %v", err)
	}
}

// TestPodCannotHoldTheLock: a process of the pod (here the test) holding
// a lock on the pod's network namespace file, as the old lock path let any
// pod do, no longer stalls writes to the pod (legacy iptables waits up to
// 30 s for its lock); the lock dir is root's alone.
func TestPodCannotHoldTheLock(t *testing.T) {
	testutil.RequireRoot(t)
	for _, variant := range []string{"legacy", "nft"} {
		t.Run(variant, func(t *testing.T) {
			pod := newNS(t)
			f, err := os.Open(pod.Path())
			if err != nil {
				t.Fatal(err)
			}
			defer f.Close()
			if err := unix.Flock(int(f.Fd()), unix.LOCK_EX); err != nil {
				t.Fatal(err)
			}
			done := make(chan error, 1)
			go func() {
				_, err := (&Applier{Force: variant}).Apply(pod.Path(), planFor(t, testutil.RedirectCases[0], false))
				done <- err
			}()
			select {
			case err := <-done:
				if err != nil {
					t.Fatal(err)
				}
			case <-time.After(20 * time.Second):
				t.Fatal("the write waited on a lock the pod holds")
			}
			var st unix.Stat_t
			if err := unix.Stat(lockDir, &st); err != nil || st.Mode&0o077 != 0 || st.Uid != 0 {
				t.Fatalf("lock dir %s: mode %o uid %d (%v); want root's alone", lockDir, st.Mode&0o777, st.Uid, err)
			}
		})
	}
}

// TestUserNamespacedPodSeesNoCredentials: the commands run in a
// user-namespaced pod's user namespace, where the pod's root could read
// their /proc/<pid>/root, see none of the hidden paths (the agent's token
// and kubeconfig); a pod in the node's user namespace needs no hiding.
func TestUserNamespacedPodSeesNoCredentials(t *testing.T) {
	testutil.RequireTools(t, "nsenter", "iptables-nft-restore", "sh")
	nsenter, err := (&Applier{}).lookPath("nsenter")
	if err != nil {
		t.Fatal(err)
	}
	secrets, probeDir, bin := t.TempDir(), t.TempDir(), t.TempDir()
	if err := os.WriteFile(filepath.Join(secrets, "token"), []byte("s3cret"), 0o600); err != nil {
		t.Fatal(err)
	}
	out := filepath.Join(probeDir, "seen")
	// A stand-in nsenter that first looks for the secret, from the mount
	// namespace it and the command it starts run in.
	probe := filepath.Join(bin, "nsenter")
	script := fmt.Sprintf("#!/bin/sh\nif cat %s/token >/dev/null 2>&1; then echo visible >%s; else echo hidden >%s; fi\nexec %s \"$@\"\n", secrets, out, out, nsenter)
	if err := os.WriteFile(probe, []byte(script), 0o755); err != nil {
		t.Fatal(err)
	}
	a := &Applier{Force: VariantNFT, Hide: []string{secrets}, LookPath: func(name string) (string, error) {
		if name == "nsenter" {
			return probe, nil
		}
		return (&Applier{}).lookPath(name)
	}}
	if _, err := a.Apply(userNSPod(t).Path(), planFor(t, testutil.RedirectCases[0], false)); err != nil {
		t.Fatal(err)
	}
	if b, err := os.ReadFile(out); err != nil || strings.TrimSpace(string(b)) != "hidden" {
		t.Fatalf("the secret from a user-namespaced pod's commands: %q (%v); want hidden", b, err)
	}
	if b, err := os.ReadFile(filepath.Join(secrets, "token")); err != nil || string(b) != "s3cret" {
		t.Fatalf("hiding changed the node's view: %q %v", b, err)
	}
}

// TestNoIP6tablesOnTheNode: a node with iptables but no ip6tables (the
// fallback runs the host's tools): an IPv4-only pod's rules are applied
// and checked, where every ADD failed for want of ip6tables-save; a pod
// that needs IPv6 rules is refused, naming what is missing.
func TestNoIP6tablesOnTheNode(t *testing.T) {
	testutil.RequireRoot(t)
	var six []string
	for _, v := range []string{"", "-nft", "-legacy"} {
		six = append(six, "ip6tables"+v+"-save", "ip6tables"+v+"-restore")
	}
	a := &Applier{LookPath: hiding(six...)}
	v4 := planFor(t, testutil.RedirectCases[0], false)
	n := newNS(t)
	rep, err := a.Apply(n.Path(), v4)
	if err != nil {
		t.Fatalf("an IPv4-only pod without ip6tables: %v", err)
	}
	if rep.Families[0].Action != "applied" || !strings.Contains(saveAll(t, n, "nft"), ":ISTIO_OUTPUT") {
		t.Fatalf("IPv4 rules not applied: %+v", rep)
	}
	if err := a.Check(n.Path(), v4); err != nil {
		t.Fatalf("check: %v", err)
	}
	dual := planFor(t, testutil.RedirectCases[0], true)
	if _, err := a.Apply(newNS(t).Path(), dual); err == nil || !strings.Contains(err.Error(), "ip6tables") {
		t.Fatalf("a pod that needs IPv6 rules without ip6tables: %v", err)
	}
}
