package plugin

import (
	"bytes"
	"io"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/containernetworking/cni/pkg/skel"

	"github.com/istio-cni-go/istio-cni/internal/logging"
	"github.com/istio-cni-go/istio-cni/internal/nlsteps"
	"github.com/istio-cni-go/istio-cni/internal/nslock"
	"github.com/istio-cni-go/istio-cni/internal/podinfo"
	"github.com/istio-cni-go/istio-cni/internal/podnet"
	"github.com/istio-cni-go/istio-cni/internal/ruleset"
	"github.com/istio-cni-go/istio-cni/internal/testutil"
)

// lockRules is fakeRules noting whether the namespace's lock is held
// when the rules are applied in place.
type lockRules struct {
	fakeRules
	held      func() bool
	heldApply bool
	appliedIn string
}

func (r *lockRules) Apply(path string, plan *ruleset.Plan) (podnet.Report, error) {
	r.heldApply, r.appliedIn = r.held(), path
	return r.fakeRules.Apply(path, plan)
}

// TestAddHoldsNamespaceLock: an ADD holds the namespace's writers' lock
// (nslock.LockWriters, under the config's run dir) from reading the
// namespace to its rules being in, whether it applies them in place (the
// fallback, or the agent for a namespace that cannot take prepared rules)
// or hands them to the relay (the agent, until the relay reports); a relay
// serving another ADD of the namespace from its record takes the same
// lock. It is free again once the ADD returns.
func TestAddHoldsNamespaceLock(t *testing.T) {
	for _, commit := range []bool{false, true} {
		name := "in place"
		if commit {
			name = "handed to the relay"
		}
		t.Run(name, func(t *testing.T) {
			// Any file stands for the namespace's: the lock is its inode's.
			path := filepath.Join(t.TempDir(), "netns")
			if err := os.WriteFile(path, nil, 0o600); err != nil {
				t.Fatal(err)
			}
			runDir := t.TempDir()
			held := func() bool { return testutil.WritersLockHeld(t, filepath.Join(runDir, nslock.WritersDir)) }
			rules := &lockRules{held: held}
			var out bytes.Buffer
			src := &fakeSource{pod: injected(nil)}
			p := &Plugin{Log: logging.New(io.Discard), Stdout: &out, Rules: rules,
				NewSource: func(*Config, string) (podinfo.Source, error) { return src, nil }}
			heldCommit := false
			if commit {
				p.Commit = func(_ *nlsteps.Txn, result []byte) (nlsteps.Outcome, error) {
					heldCommit = held()
					_, err := out.Write(result)
					return nlsteps.Outcome{}, err
				}
			}
			err := p.Add(&skel.CmdArgs{ContainerID: "c1", Netns: path, IfName: "eth0",
				Args: cniArgs("default", "web"), StdinData: ambientConf(false, `"cni_agent_run_dir":"`+runDir+`"`)})
			checkAdd(t, err, &out, nil)
			switch {
			case commit && !heldCommit:
				t.Fatal("the relay committed the rules without the namespace's lock held")
			case !commit && (rules.appliedIn != path || !rules.heldApply):
				t.Fatalf("applied in %q with the lock held %t, want in %s, held", rules.appliedIn, rules.heldApply, path)
			case held():
				t.Fatal("the namespace's lock outlived the ADD")
			}
		})
	}
}

// TestAddWarnsWithoutLock: a lock directory others may write to is not
// used; the ADD still programs the pod's rules, and its log says the
// lock was not taken and why.
func TestAddWarnsWithoutLock(t *testing.T) {
	path := filepath.Join(t.TempDir(), "netns")
	if err := os.WriteFile(path, nil, 0o600); err != nil {
		t.Fatal(err)
	}
	runDir := t.TempDir()
	if err := os.Mkdir(filepath.Join(runDir, nslock.WritersDir), 0o700); err != nil {
		t.Fatal(err)
	}
	if err := os.Chmod(filepath.Join(runDir, nslock.WritersDir), 0o777); err != nil {
		t.Fatal(err)
	}
	rules := &lockRules{held: func() bool { return false }}
	var out, logs bytes.Buffer
	src := &fakeSource{pod: injected(nil)}
	p := &Plugin{Log: logging.New(&logs), Stdout: &out, Rules: rules,
		NewSource: func(*Config, string) (podinfo.Source, error) { return src, nil }}
	err := p.Add(&skel.CmdArgs{ContainerID: "c1", Netns: path, IfName: "eth0",
		Args: cniArgs("default", "web"), StdinData: ambientConf(false, `"cni_agent_run_dir":"`+runDir+`"`)})
	checkAdd(t, err, &out, nil)
	if rules.appliedIn != path {
		t.Fatalf("rules applied in %q, want %s", rules.appliedIn, path)
	}
	if !strings.Contains(logs.String(), UnlockedWarning) || !strings.Contains(logs.String(), "is not a directory private to uid") {
		t.Fatalf("the ADD's log does not say the lock was not taken, and why:\n%s", logs.String())
	}
}
