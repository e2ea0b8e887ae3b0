package iptables

import (
	"errors"
	"fmt"
	"io/fs"
	"os"
	"runtime"
	"strings"

	"github.com/containernetworking/plugins/pkg/ns"
	"golang.org/x/sys/unix"
)

// nsswitchPath is where glibc reads which name services to ask (a
// variable for tests).
var nsswitchPath = "/etc/nsswitch.conf"

// inPodNetns runs fn on an OS thread inside the pod's network namespace,
// as ns.WithNetNSPath does, so the iptables commands fn starts act on the
// pod. When the node's nsswitch.conf sends user or group lookups beyond
// local files, that thread also gets a private mount namespace in which
// the file reads empty: `--uid-owner 1337` makes iptables look 1337 up as
// a user name before reading it as a number, and with LDAP or SSSD behind
// NSS that lookup goes to the network and can hold a pod's start for tens
// of seconds (Istio hides it always, istio/istio#48416). Where the file
// does not exist (the agent's image) or names local services only, nothing
// needs hiding, and the mount namespace, whose copy of a node's hundreds
// of mounts costs milliseconds per pod, is not made.
func inPodNetns(netnsPath string, fn func(ns.NetNS) error) error {
	return inPodNetnsHiding(netnsPath, nil, fn)
}

// DefaultHidden are the paths of the agent's (and the node's) credentials:
// the service account token, the plugin's kubeconfig and the host mounts.
// A pod with hostUsers: false gets our iptables commands in its user
// namespace, where its root may read /proc/<pid>/root of those processes:
// they must see none of these.
var DefaultHidden = []string{"/var/run/secrets", "/run/secrets", "/var/run/istio-cni", "/run/istio-cni", "/host"}

// inPodNetnsHiding is inPodNetns that, when hide is not empty, also
// covers those paths with empty read-only file systems in the thread's
// private mount namespace, or fails: for a pod's user namespace, running
// with them visible is not an option.
func inPodNetnsHiding(netnsPath string, hide []string, fn func(ns.NetNS) error) error {
	hideNSS := nssReachesOut(nsswitchPath)
	if !hideNSS && len(hide) == 0 {
		return ns.WithNetNSPath(netnsPath, fn)
	}
	target, err := ns.GetNS(netnsPath)
	if err != nil {
		return err
	}
	defer target.Close()
	errc := make(chan error, 1)
	go func() {
		// Never unlocked: the thread's mount namespace differs from the
		// process's, so Go must end the thread with this goroutine rather
		// than run other code on it.
		runtime.LockOSThread()
		if err := privateMounts(hideNSS); err != nil {
			if len(hide) > 0 {
				errc <- fmt.Errorf("a private mount namespace for a user-namespaced pod's commands: %w", err)
				return
			}
			// Some nodes forbid it (SELinux, seccomp); the rules matter
			// more than the lookup, so run as Istio does then: without.
			errc <- ns.WithNetNSPath(netnsPath, fn)
			return
		}
		for _, p := range hide {
			if fi, err := os.Stat(p); err != nil || !fi.IsDir() {
				continue
			}
			if err := unix.Mount("tmpfs", p, "tmpfs", unix.MS_RDONLY|unix.MS_NOSUID|unix.MS_NODEV|unix.MS_NOEXEC, "mode=0,size=4k"); err != nil {
				errc <- fmt.Errorf("hiding %s from a user-namespaced pod's commands: %w", p, err)
				return
			}
		}
		if err := target.Set(); err != nil {
			errc <- fmt.Errorf("entering %s: %w", netnsPath, err)
			return
		}
		errc <- fn(target)
	}()
	return <-errc
}

// privateMounts gives the calling thread its own mount namespace,
// detached from the host's mount propagation, with /dev/null over
// nsswitch.conf when nss says so.
func privateMounts(nss bool) error {
	if err := unix.Unshare(unix.CLONE_NEWNS); err != nil {
		return fmt.Errorf("unshare mount namespace: %w", err)
	}
	if err := unix.Mount("", "/", "", unix.MS_PRIVATE|unix.MS_REC, ""); err != nil {
		if err := unix.Mount("", "/", "", unix.MS_SLAVE|unix.MS_REC, ""); err != nil {
			return fmt.Errorf("making / private: %w", err)
		}
	}
	if nss {
		if err := unix.Mount("/dev/null", nsswitchPath, "", unix.MS_BIND, ""); err != nil {
			return fmt.Errorf("hiding %s: %w", nsswitchPath, err)
		}
	}
	return nil
}

// localNSS are the name services that answer from the node itself: files,
// their compat form, Berkeley DB files, and systemd's (nss-systemd,
// dynamic users and userdb over a local socket).
var localNSS = map[string]bool{"files": true, "compat": true, "db": true, "systemd": true}

// nssReachesOut reports whether the nsswitch.conf at path may send a user
// or group lookup beyond the node's own services (ldap, sss, nis,
// winbind, or anything not known to be local). A file that is missing
// means glibc's local defaults; one that cannot be read is taken as
// reaching out.
func nssReachesOut(path string) bool {
	data, err := os.ReadFile(path) //nolint:gosec // G304: the node's nsswitch.conf
	if errors.Is(err, fs.ErrNotExist) {
		return false
	}
	if err != nil {
		return true
	}
	return !nssLocal(data)
}

// nssLocal reports whether the passwd and group databases of an
// nsswitch.conf use local services only ([action] items aside); a
// database not listed gets glibc's local default.
func nssLocal(conf []byte) bool {
	for line := range strings.SplitSeq(string(conf), "\n") {
		if i := strings.IndexByte(line, '#'); i >= 0 {
			line = line[:i]
		}
		db, services, ok := strings.Cut(line, ":")
		if !ok {
			continue
		}
		if db = strings.TrimSpace(db); db != "passwd" && db != "group" {
			continue
		}
		inAction := false
		for _, f := range strings.Fields(services) {
			switch {
			case strings.HasPrefix(f, "["):
				inAction = !strings.HasSuffix(f, "]")
			case inAction:
				inAction = !strings.HasSuffix(f, "]")
			case !localNSS[f]:
				return false
			}
		}
	}
	return true
}
