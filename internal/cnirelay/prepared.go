package cnirelay

import (
	"encoding/binary"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"strings"
	"time"
	"unicode"

	"golang.org/x/sys/unix"

	"github.com/istio-cni-go/istio-cni/internal/nlsteps"
	"github.com/istio-cni-go/istio-cni/internal/nsfacts"
	"github.com/istio-cni-go/istio-cni/internal/nslock"
	"github.com/istio-cni-go/istio-cni/internal/prepared"
)

// servePrepared serves an ADD from the record the agent prepared for the
// pod, when there is one for this pod and config and the pod's namespace
// can take its rules; false means the agent must be asked. A send that
// fails fails the ADD, as a send of rules the agent handed over does.
//
// why says why a record there was not used ("" when there was none), for
// the agent's log line of the ADD. stale says the records are not to be
// trusted (their agent has not been seen for long): the ADD is then, to
// the relay, one of a pod with no record.
func (r *Relay) servePrepared(start time.Time, a *Args, conf *prepared.Config, runDir string, netns *os.File) (served bool, why string, stale bool, err error) {
	ns, name, uid := podArgs(a.Args)
	// The result passed on is the previous one as it came, which is the
	// config's version only when libcni made it so. Arguments the
	// plugin's checks would refuse go to the agent, which says why.
	if uid == "" {
		return false, "", false, nil
	}
	dir := filepath.Join(runDir, prepared.DirName)
	rec, err := prepared.ReadMapped(dir, uid)
	switch {
	case errors.Is(err, fs.ErrNotExist):
		return false, "", false, nil
	case err != nil:
		return false, "unreadable record: " + err.Error(), false, nil
	}
	if why := agentGone(dir, start); why != "" {
		return false, why, true, nil
	}
	switch {
	case rec.Namespace != ns || rec.Name != name:
		return false, "the record is of pod " + rec.Namespace + "/" + rec.Name, false, nil
	case !plainArgs(a):
		return false, "arguments the plugin checks", false, nil
	case conf.PrevResult == nil || conf.PrevCNIVersion != conf.CNIVersion:
		return false, "no prevResult of the config's version", false, nil
	}
	e := rec.Find(conf.Canonical)
	switch {
	case e == nil && len(rec.Entries) == 0:
		return false, "the agent could not prepare the pod's ADD", false, nil
	case e == nil:
		return false, "no entry for this config", false, nil
	}
	done := &Done{Skip: e.Skip, Mode: e.Mode, Summary: e.Kind}
	if e.Skip == "" {
		if e.Kind == nsfacts.KindIPTablesNFT {
			// The runtime's choice of iptables is the agent's to weigh
			// against its own.
			// The agent's own forced variant wins, as it does when the
			// agent serves (prepared with it).
			if v := r.getenv("FORCE_IPTABLES_BINARY"); v != "" && v != "nft" && prepared.ReadForcedVariant(runDir) == "" {
				return false, "the runtime's FORCE_IPTABLES_BINARY=" + v, false, nil
			}
		}
		// Two ADDs of one namespace at once (a runtime's retry, a test's
		// hundred) must not both find it fresh and both send: the second
		// transaction would be refused. Every writer of a pod's rules
		// holds the namespace's writers' lock (the agent and the fallback
		// too: plugin.Add); the next relay then finds our tables and asks
		// the agent. Held until the rules are in, or the relay turns to
		// the agent; a lock that cannot be taken leaves the ADD as it was
		// before the lock, and the agent's log says why.
		if unlock, err := nslock.LockWriters(runDir, netns); err == nil {
			defer unlock()
		} else {
			done.Unlocked = err.Error()
		}
		sent := false
		err := nlsteps.InNetNS(netns, func() error {
			facts, err := nsfacts.ReadFactsFor(e.Kind, e.IPSets)
			if err != nil {
				why = "reading the namespace: " + err.Error()
			} else if why = facts.Unfit(e.Kind, e.IPSets); why == "" && !nsfacts.HasGlobalAddr(facts.Addrs) {
				why = "the namespace has no address"
			}
			if why != "" {
				// The agent reads the namespace again.
				return nil
			}
			done.IPv6 = nsfacts.NeedsIPv6(facts.Addrs, e.DualStack)
			raw := e.Txn4
			if done.IPv6 {
				raw = e.Txn46
			}
			if len(raw) == 0 {
				why = "no IPv6 rules prepared"
				return nil
			}
			var txn nlsteps.Txn
			if err := txn.UnmarshalBinary(raw); err != nil {
				why = "unreadable rules in the record: " + err.Error()
				return nil
			}
			sent = true
			sendStart := time.Now()
			err = r.sendHere(&txn)
			done.Took = time.Since(sendStart)
			return err
		})
		if !sent {
			if err != nil {
				why = "entering the namespace: " + err.Error()
			}
			return false, why, false, nil
		}
		if err != nil {
			done.Error = err.Error()
			r.notify(runDir, a, done, start)
			return true, "", false, NewError(ErrInternal, fmt.Sprintf("pod %s/%s: %v", ns, name, err), "")
		}
	}
	_, err = r.Stdout.Write(conf.PrevResult)
	r.notify(runDir, a, done, start)
	return true, "", false, err
}

// agentGone says why the records in dir may be out of date: the agent
// that keeps them has not been seen for longer than prepared.AliveFor
// ("" when it has).
func agentGone(dir string, now time.Time) string {
	ago, ok := prepared.AgentSeen(dir, now)
	switch {
	case !ok:
		return "no agent keeps the records"
	case ago > prepared.AliveFor || ago < -prepared.AliveFor:
		return fmt.Sprintf("the agent that keeps the records was last seen %s ago", ago.Round(time.Second))
	}
	return ""
}

// serveDel answers a DEL as the agent would, without it, when it can: in
// sidecar mode a pod's rules go with its network namespace, so the
// agent's DEL checks the config and arguments and does nothing. A config
// the agent keeps (prepared.Dir.Knows: it passed those checks, and is not
// ambient mode's) with arguments that pass the plugin's checks needs no
// round trip to an agent that may be short of CPU in a burst of pod
// starts and stops. The agent is told, without waiting, for its log and
// metrics; anything else goes to it as before.
func (r *Relay) serveDel(a *Args, conf *prepared.Config, runDir string, start time.Time) bool {
	if !plainArgs(a) || !prepared.Dir(filepath.Join(runDir, prepared.DirName)).Knows(conf.Canonical) {
		return false
	}
	r.notify(runDir, a, &Done{}, start)
	return true
}

// sendHere sends a transaction from the calling thread, which is in the
// pod's namespace.
func (r *Relay) sendHere(txn *nlsteps.Txn) error {
	if r.SendHere != nil {
		return r.SendHere(txn)
	}
	return nlsteps.Run(txn)
}

func (r *Relay) getenv(k string) string {
	if r.Getenv != nil {
		return r.Getenv(k)
	}
	return os.Getenv(k)
}

// notify tells the agent how the ADD (or DEL) went, for its log and metrics,
// without waiting for it: a socket that takes no more connections, or no
// agent, loses the line and nothing else.
func (r *Relay) notify(runDir string, a *Args, d *Done, start time.Time) {
	var ru unix.Rusage
	if unix.Getrusage(unix.RUSAGE_SELF, &ru) == nil {
		d.CPU = time.Duration(ru.Utime.Nano() + ru.Stime.Nano())
	}
	d.Total = time.Since(start)
	req := Request{Command: a.Command, ContainerID: a.ContainerID, IfName: a.IfName, Args: a.Args, Done: d}
	body := req.appendJSON(make([]byte, 4, 256+len(a.Args)))
	binary.BigEndian.PutUint32(body, uint32(len(body)-4))
	fd, err := unix.Socket(unix.AF_UNIX, unix.SOCK_STREAM|unix.SOCK_NONBLOCK|unix.SOCK_CLOEXEC, 0)
	if err != nil {
		return
	}
	defer unix.Close(fd)
	for {
		err = unix.Connect(fd, &unix.SockaddrUnix{Name: filepath.Join(runDir, SocketName)})
		if !errors.Is(err, unix.EINTR) {
			break
		}
	}
	if err != nil {
		return
	}
	// A few hundred bytes fit the socket's buffer whole.
	_, _ = unix.SendmsgN(fd, body, nil, nil, unix.MSG_NOSIGNAL|unix.MSG_DONTWAIT)
}

// plainArgs reports whether the command's arguments pass what the
// plugin checks of them (the CNI library's): a container ID and interface
// name of the allowed form, and CNI_ARGS of the keys the plugin reads,
// or IgnoreUnknown.
func plainArgs(a *Args) bool {
	if !validContainerID(a.ContainerID) || !validIfName(a.IfName) {
		return false
	}
	ignore := false
	known := true
	for _, kv := range strings.Split(a.Args, ";") {
		k, v, ok := strings.Cut(kv, "=")
		if !ok || strings.Contains(v, "=") {
			return false // the library's "invalid pair"
		}
		switch k {
		case "IgnoreUnknown":
			switch strings.ToLower(v) {
			case "1", "true":
				ignore = true
			case "0", "false":
				ignore = false
			default:
				return false // not a boolean the library reads
			}
		case "K8S_POD_NAMESPACE", "K8S_POD_NAME", "K8S_POD_INFRA_CONTAINER_ID", "K8S_POD_UID":
		default:
			known = false
		}
	}
	return known || ignore
}

// validContainerID is the CNI library's container ID form: a letter or
// digit, then letters, digits, '_', '.' and '-'.
func validContainerID(id string) bool {
	for i := 0; i < len(id); i++ {
		c := id[i]
		alnum := c >= 'a' && c <= 'z' || c >= 'A' && c <= 'Z' || c >= '0' && c <= '9'
		if !alnum && (i == 0 || c != '_' && c != '.' && c != '-') {
			return false
		}
	}
	return id != ""
}

// validIfName is the CNI library's interface name form.
func validIfName(n string) bool {
	if n == "" || len(n) > 15 || n == "." || n == ".." {
		return false
	}
	for _, r := range n {
		if r == '/' || r == ':' || unicode.IsSpace(r) {
			return false
		}
	}
	return true
}

// podArgs reads the pod's namespace, name and UID from CNI_ARGS.
func podArgs(args string) (ns, name, uid string) {
	for _, kv := range strings.Split(args, ";") {
		k, v, _ := strings.Cut(kv, "=")
		switch k {
		case "K8S_POD_NAMESPACE":
			ns = v
		case "K8S_POD_NAME":
			name = v
		case "K8S_POD_UID":
			uid = v
		}
	}
	return ns, name, uid
}
