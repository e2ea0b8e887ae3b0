package cnirelay

import (
	"bytes"
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/containernetworking/plugins/pkg/ns"
	"golang.org/x/sys/unix"

	"github.com/istio-cni-go/istio-cni/internal/nlsteps"
	"github.com/istio-cni-go/istio-cni/internal/nsfacts"
	"github.com/istio-cni-go/istio-cni/internal/nslock"
	"github.com/istio-cni-go/istio-cni/internal/prepared"
	"github.com/istio-cni-go/istio-cni/internal/testutil"
)

// TestServePrepared: a relay serves an ADD from the pod's record only
// when the record is this pod's, under this very config, and the pod's
// real namespace can take the rules; then it sends the transaction for
// the namespace's addresses, passes the previous result on as it came,
// and tells the agent without waiting. In every other case it asks the
// agent, exactly as without records.
func TestServePrepared(t *testing.T) {
	const uid = "0f4c1c2e-1d9a-4e53-9d61-5b1f2f3a4b5c"
	prev := `{"cniVersion":"1.0.0","interfaces":[{"name":"eth0","sandbox":"/x"}],"ips":[{"address":"10.1.0.2/24","interface":0}]}`
	txn := func(summary string) []byte {
		b, err := (&nlsteps.Txn{Summary: summary}).MarshalBinary()
		if err != nil {
			t.Fatal(err)
		}
		return b
	}
	for _, c := range []struct {
		name string
		// args and stdin of the ADD, given the run dir; kind, skip and
		// fail of the record's entry.
		args        string
		stdin       func(runDir string) string
		kind, skip  string
		noRecord    bool
		addrs       []string
		env         string
		agentForces string // the agent's own FORCE_IPTABLES_BINARY, said in the run dir
		setup       func(t *testing.T, n ns.NetNS)
		sendFails   bool
		containerID string
		noTxn46     bool
		// seen: how long ago the agent last renewed its file (none
		// with noBeat).
		seen           time.Duration
		noBeat         bool
		wantSent       string // the transaction sent ("" none)
		wantFromRecord bool
		wantErr        string
	}{
		{name: "served with IPv4 rules", wantSent: "v4", wantFromRecord: true},
		{name: "served with IPv6 rules too", addrs: []string{"fd00::2/64"}, wantSent: "v46", wantFromRecord: true},
		{name: "a pod that gets no rules", skip: "no istio-proxy container", wantFromRecord: true},
		{name: "iptables-nft rules", kind: nsfacts.KindIPTablesNFT, env: "nft", wantSent: "v4", wantFromRecord: true},
		{name: "the runtime forces legacy iptables", kind: nsfacts.KindIPTablesNFT, env: "legacy"},
		{name: "the runtime forces legacy iptables, the agent nft", kind: nsfacts.KindIPTablesNFT, env: "legacy", agentForces: "nft",
			wantSent: "v4", wantFromRecord: true},
		{name: "no record", noRecord: true},
		{name: "another pod of the name", args: "K8S_POD_NAMESPACE=ns;K8S_POD_NAME=other;K8S_POD_UID=" + uid},
		{name: "no UID", args: "K8S_POD_NAMESPACE=ns;K8S_POD_NAME=p"},
		{name: "another config", stdin: func(d string) string {
			return `{"cniVersion":"1.0.0","name":"k8s-pod-network","type":"istio-cni","exclude_namespaces":["x"],"cni_agent_run_dir":"` + d + `","prevResult":` + prev + `}`
		}},
		{name: "no prevResult", stdin: func(d string) string {
			return `{"cniVersion":"1.0.0","name":"k8s-pod-network","type":"istio-cni","cni_agent_run_dir":"` + d + `"}`
		}},
		{name: "a prevResult of another version", stdin: func(d string) string {
			return `{"cniVersion":"1.0.0","name":"k8s-pod-network","type":"istio-cni","cni_agent_run_dir":"` + d + `","prevResult":` + strings.Replace(prev, "1.0.0", "0.4.0", 1) + `}`
		}},
		{name: "a namespace that holds tables of ours", setup: func(t *testing.T, n ns.NetNS) {
			testutil.RequireTools(t, "nft")
			testutil.RunIn(t, n, "nft", "add", "table", "inet", nsfacts.NFTablesPrefix+"nat")
		}},
		{name: "a namespace with no address yet", addrs: []string{}},
		{name: "unknown CNI_ARGS keys", args: "K8S_POD_NAMESPACE=ns;K8S_POD_NAME=p;K8S_POD_UID=" + uid + ";FOO=1"},
		{name: "unknown CNI_ARGS keys ignored", args: "IgnoreUnknown=1;K8S_POD_NAMESPACE=ns;K8S_POD_NAME=p;K8S_POD_UID=" + uid + ";FOO=1",
			wantSent: "v4", wantFromRecord: true},
		{name: "a container ID the plugin refuses", containerID: "-bad"},
		{name: "IPv6 rules the agent could not prepare", addrs: []string{"fd00::2/64"}, noTxn46: true},
		{name: "an agent last seen 50s ago", seen: 50 * time.Second, wantSent: "v4", wantFromRecord: true},
		{name: "an agent last seen over a minute ago", seen: 61 * time.Second},
		{name: "an agent seen over a minute from now (the clock set back)", seen: -61 * time.Second},
		{name: "no agent ever kept the records", noBeat: true},
		{name: "a send that fails fails the ADD", sendFails: true, wantSent: "v4", wantFromRecord: true, wantErr: "pod ns/p: refused"},
	} {
		t.Run(c.name, func(t *testing.T) {
			n := testutil.NewNS(t)
			testutil.RunIn(t, n, "ip", "link", "add", "eth0", "type", "veth", "peer", "name", "peer0")
			addrs := c.addrs
			if addrs == nil {
				addrs = []string{"10.1.0.2/24", "fd00::2/64"}
			}
			for _, a := range addrs {
				testutil.RunIn(t, n, "ip", "addr", "add", a, "dev", "eth0", "nodad")
			}
			if c.setup != nil {
				c.setup(t, n)
			}
			fromRecord := c.wantFromRecord
			reply := []byte(nil) // the notice gets no answer
			if !fromRecord {
				reply = answer(t, Response{Stdout: []byte("from the agent")})
			}
			a := startAgent(t, reply)
			stdin := `{"cniVersion":"1.0.0","name":"k8s-pod-network","type":"istio-cni","cni_agent_run_dir":"` + a.runDir + `","prevResult":` + prev + `}`
			if c.stdin != nil {
				stdin = c.stdin(a.runDir)
			}
			learnt, err := prepared.ParseConfig([]byte(`{"cniVersion":"1.0.0","name":"k8s-pod-network","type":"istio-cni","cni_agent_run_dir":"` + a.runDir + `","prevResult":{}}`))
			if err != nil {
				t.Fatal(err)
			}
			kind := c.kind
			if kind == "" {
				kind = nsfacts.KindNFTables
			}
			if err := prepared.WriteForcedVariant(a.runDir, c.agentForces); err != nil {
				t.Fatal(err)
			}
			dir := filepath.Join(a.runDir, prepared.DirName)
			if err := prepared.Dir(dir).Reset(); err != nil {
				t.Fatal(err)
			}
			if !c.noBeat {
				if err := prepared.Dir(dir).Beat(); err != nil {
					t.Fatal(err)
				}
				at := time.Now().Add(-c.seen)
				if err := os.Chtimes(filepath.Join(dir, ".agent-alive"), at, at); err != nil {
					t.Fatal(err)
				}
			}
			if !c.noRecord {
				e := prepared.Entry{Config: learnt.Canonical, Skip: c.skip, Mode: "REDIRECT", Kind: kind, Txn4: txn("v4"), Txn46: txn("v46")}
				if c.noTxn46 {
					e.Txn46 = nil
				}
				if err := prepared.Dir(dir).Put(&prepared.Record{Namespace: "ns", Name: "p", UID: uid, Entries: []prepared.Entry{e}}); err != nil {
					t.Fatal(err)
				}
			}
			var out bytes.Buffer
			sent := ""
			r := &Relay{Fallback: "/nonexistent", Stdout: &out, Stderr: io.Discard, Timeout: 5 * time.Second,
				Getenv: func(k string) string {
					if k == "FORCE_IPTABLES_BINARY" {
						return c.env
					}
					return ""
				},
				SendHere: func(txn *nlsteps.Txn) error {
					sent = txn.Summary
					if c.sendFails {
						return errors.New("refused")
					}
					return nil
				}}
			args := c.args
			if args == "" {
				args = "K8S_POD_NAMESPACE=ns;K8S_POD_NAME=p;K8S_POD_UID=" + uid
			}
			containerID := c.containerID
			if containerID == "" {
				containerID = "c1"
			}
			err = r.Run(&Args{Command: "ADD", ContainerID: containerID, Netns: n.Path(), IfName: "eth0", Args: args, Path: "/opt/cni/bin", Stdin: []byte(stdin)})
			got := <-a.got
			if got.err != nil {
				t.Fatalf("the agent could not read what the relay sent: %v", got.err)
			}
			if sent != c.wantSent {
				t.Fatalf("sent %q, want %q", sent, c.wantSent)
			}
			if !fromRecord {
				if err != nil || out.String() != "from the agent" || got.req.Done != nil || !got.req.Steps {
					t.Fatalf("not served from the record, the relay must ask the agent: error %v, output %q, request %+v", err, out.String(), got.req)
				}
				// It tells the agent why a record there went unused.
				noRecord := c.noRecord || !strings.Contains(args, "K8S_POD_UID")
				if noRecord != (got.req.Unprepared == "") {
					t.Fatalf("the agent was told %q of why the record went unused", got.req.Unprepared)
				}
				return
			}
			d := got.req.Done
			if d == nil || got.req.Args != args || got.req.ContainerID != "c1" || got.gotFD || d.Total <= 0 || d.CPU <= 0 {
				t.Fatalf("the agent heard %+v (descriptor %t), want an account of the ADD", got.req, got.gotFD)
			}
			if c.wantErr != "" {
				if err == nil || !strings.Contains(err.Error(), c.wantErr) || d.Error != "refused" || out.Len() != 0 {
					t.Fatalf("error %v, account %+v, output %q; want the ADD failed with %q", err, d, out.String(), c.wantErr)
				}
				return
			}
			if err != nil || out.String() != prev {
				t.Fatalf("error %v, output %q; want the previous result as it came", err, out.String())
			}
			if d.Skip != c.skip || (c.skip == "" && (d.Summary != kind || d.Mode != "REDIRECT" || d.IPv6 != (c.wantSent == "v46"))) {
				t.Fatalf("the agent heard %+v", d)
			}
		})
	}
}

// TestServeDel: a DEL under a config the agent keeps, with arguments the
// plugin takes, is answered by the relay alone (no output, no error) and
// the agent only hears of it, without a descriptor; a DEL under any other
// config, with arguments the plugin would check, or with no configs kept,
// goes to the agent as before, which answers it.
func TestServeDel(t *testing.T) {
	const args = "K8S_POD_NAMESPACE=ns;K8S_POD_NAME=p;K8S_POD_UID=0f4c1c2e-1d9a-4e53-9d61-5b1f2f3a4b5c"
	for _, c := range []struct {
		name      string
		args      string
		other     bool // the DEL's config is not the kept one
		noConfigs bool
		wantLocal bool
	}{
		{name: "a kept config", wantLocal: true},
		{name: "another config", other: true},
		{name: "no configs kept", noConfigs: true},
		{name: "unknown CNI_ARGS keys", args: args + ";FOO=1"},
		{name: "unknown CNI_ARGS keys ignored", args: "IgnoreUnknown=1;" + args + ";FOO=1", wantLocal: true},
	} {
		t.Run(c.name, func(t *testing.T) {
			reply := []byte(nil) // the notice gets no answer
			if !c.wantLocal {
				reply = answer(t, Response{})
			}
			a := startAgent(t, reply)
			kept := `{"cniVersion":"1.0.0","name":"k8s-pod-network","type":"istio-cni","cni_agent_run_dir":"` + a.runDir + `"}`
			learnt, err := prepared.ParseConfig([]byte(kept))
			if err != nil {
				t.Fatal(err)
			}
			d := prepared.Dir(filepath.Join(a.runDir, prepared.DirName))
			if err := d.Reset(); err != nil {
				t.Fatal(err)
			}
			if !c.noConfigs {
				if err := d.SaveConfigs([][]byte{learnt.Canonical}); err != nil {
					t.Fatal(err)
				}
			}
			// The runtime passes the ADD's result on to DEL.
			stdin := `{"cniVersion":"1.0.0","name":"k8s-pod-network","type":"istio-cni","cni_agent_run_dir":"` + a.runDir +
				`","prevResult":{"cniVersion":"1.0.0","ips":[{"address":"10.1.0.2/24"}]}}`
			if c.other {
				stdin = `{"cniVersion":"1.0.0","name":"k8s-pod-network","type":"istio-cni","exclude_namespaces":["x"],"cni_agent_run_dir":"` + a.runDir + `"}`
			}
			dargs := c.args
			if dargs == "" {
				dargs = args
			}
			var out bytes.Buffer
			r := &Relay{Fallback: "/nonexistent", Stdout: &out, Stderr: io.Discard, Timeout: 5 * time.Second}
			err = r.Run(&Args{Command: "DEL", ContainerID: "c1", Netns: "/var/run/netns/gone", IfName: "eth0", Args: dargs, Path: "/opt/cni/bin", Stdin: []byte(stdin)})
			if err != nil || out.Len() != 0 {
				t.Fatalf("DEL: error %v, output %q", err, out.String())
			}
			got := <-a.got
			if got.err != nil {
				t.Fatalf("the agent could not read what the relay sent: %v", got.err)
			}
			if got.req.Command != "DEL" || got.req.Args != dargs || got.req.ContainerID != "c1" || got.gotFD {
				t.Fatalf("the agent heard %+v (descriptor %t)", got.req, got.gotFD)
			}
			if local := got.req.Done != nil; local != c.wantLocal {
				t.Fatalf("answered by the relay alone: %t, want %t (the agent heard %+v)", local, c.wantLocal, got.req)
			}
		})
	}
}

// TestServePreparedLocksNamespace: a relay serving from a record holds the
// namespace's writers' lock while it finds the namespace fresh and sends,
// so two ADDs of one namespace at once do not both send a fresh
// namespace's rules: held by another (here the test, as the agent or the
// fallback holds it while writing the pod's rules), the relay waits for it
// before sending. A process of the pod holding the namespace's own file
// (which it can open) stalls nothing.
func TestServePreparedLocksNamespace(t *testing.T) {
	const uid = "0f4c1c2e-1d9a-4e53-9d61-5b1f2f3a4b5c"
	prev := `{"cniVersion":"1.0.0","interfaces":[{"name":"eth0","sandbox":"/x"}],"ips":[{"address":"10.1.0.2/24","interface":0}]}`
	n := testutil.NewNS(t)
	testutil.RunIn(t, n, "ip", "link", "add", "eth0", "type", "veth", "peer", "name", "peer0")
	testutil.RunIn(t, n, "ip", "addr", "add", "10.1.0.2/24", "dev", "eth0", "nodad")
	a := startAgent(t, nil, nil, nil)
	stdin := `{"cniVersion":"1.0.0","name":"k8s-pod-network","type":"istio-cni","cni_agent_run_dir":"` + a.runDir + `","prevResult":` + prev + `}`
	conf, err := prepared.ParseConfig([]byte(stdin))
	if err != nil {
		t.Fatal(err)
	}
	txn, err := (&nlsteps.Txn{Summary: "v4"}).MarshalBinary()
	if err != nil {
		t.Fatal(err)
	}
	dir := prepared.Dir(filepath.Join(a.runDir, prepared.DirName))
	if err := dir.Reset(); err != nil {
		t.Fatal(err)
	}
	if err := dir.Beat(); err != nil {
		t.Fatal(err)
	}
	if err := dir.Put(&prepared.Record{Namespace: "ns", Name: "p", UID: uid, Entries: []prepared.Entry{
		{Config: conf.Canonical, Mode: "REDIRECT", Kind: nsfacts.KindNFTables, Txn4: txn, Txn46: txn}}}); err != nil {
		t.Fatal(err)
	}
	sent := make(chan struct{}, 1)
	r := &Relay{Fallback: "/nonexistent", Stdout: io.Discard, Stderr: io.Discard, Timeout: 5 * time.Second,
		SendHere: func(*nlsteps.Txn) error { sent <- struct{}{}; return nil }}
	add := func() chan error {
		done := make(chan error, 1)
		go func() {
			done <- r.Run(&Args{Command: "ADD", ContainerID: "c1", Netns: n.Path(), IfName: "eth0",
				Args: "K8S_POD_NAMESPACE=ns;K8S_POD_NAME=p;K8S_POD_UID=" + uid, Path: "/opt/cni/bin", Stdin: []byte(stdin)})
		}()
		return done
	}
	served := func(done chan error) *Done {
		t.Helper()
		select {
		case err := <-done:
			if err != nil {
				t.Fatal(err)
			}
		case <-time.After(10 * time.Second):
			t.Fatal("the ADD did not end")
		}
		select {
		case <-sent:
		default:
			t.Fatal("the relay did not send")
		}
		got := <-a.got
		if got.req.Done == nil {
			t.Fatalf("the agent heard %+v, want the account of an ADD served from the record", got.req)
		}
		return got.req.Done
	}

	// The pod's own file, locked as a process of the pod could.
	podHeld, err := os.Open(n.Path())
	if err != nil {
		t.Fatal(err)
	}
	if err := unix.Flock(int(podHeld.Fd()), unix.LOCK_EX); err != nil {
		t.Fatal(err)
	}
	if d := served(add()); d.Unlocked != "" {
		t.Fatalf("served without the lock: %s", d.Unlocked)
	}
	_ = podHeld.Close()

	unlock, err := nslock.LockWriters(a.runDir, openNS(t, n.Path()))
	if err != nil {
		t.Fatal(err)
	}
	locks, err := filepath.Glob(filepath.Join(a.runDir, nslock.WritersDir, "*.lock"))
	if err != nil || len(locks) != 1 {
		t.Fatalf("lock files %v (%v), want the namespace's one", locks, err)
	}
	var st unix.Stat_t
	if err := unix.Stat(locks[0], &st); err != nil {
		t.Fatal(err)
	}
	done := add()
	// The kernel lists the relay as waiting for the namespace's lock.
	waiting := fmt.Sprintf("-> FLOCK  ADVISORY  WRITE %d ", os.Getpid())
	deadline := time.Now().Add(10 * time.Second)
	for {
		b, err := os.ReadFile("/proc/locks")
		if err != nil {
			t.Fatal(err)
		}
		if blockedOn(string(b), waiting, st.Ino) {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("the relay never waited for the namespace's lock:\n%s", b)
		}
		time.Sleep(time.Millisecond) // polling the kernel's lock table, bounded
	}
	select {
	case <-sent:
		t.Fatal("the relay sent while another held the namespace's lock")
	default:
	}
	unlock()
	served(done)

	// A lock directory others may write to is not used: the rules go in
	// without the lock, and the agent hears why.
	if err := os.Chmod(filepath.Join(a.runDir, nslock.WritersDir), 0o755); err != nil {
		t.Fatal(err)
	}
	if d := served(add()); !strings.Contains(d.Unlocked, "is not a directory private to uid") {
		t.Fatalf("served with an unusable lock directory, the agent heard %+v", d)
	}
}

// openNS opens the namespace at path, closed with the test.
func openNS(t *testing.T, path string) *os.File {
	t.Helper()
	f, err := os.Open(path)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = f.Close() })
	return f
}

// blockedOn reports whether /proc/locks lists a waiter line starting with
// prefix on inode ino.
func blockedOn(locks, prefix string, ino uint64) bool {
	for _, l := range strings.Split(locks, "\n") {
		if i := strings.Index(l, prefix); i >= 0 && strings.Contains(l[i+len(prefix):], fmt.Sprintf(":%d ", ino)) {
			return true
		}
	}
	return false
}
