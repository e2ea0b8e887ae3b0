package agent

import (
	"log/slog"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/istio-cni-go/istio-cni/internal/nslock"
	"github.com/istio-cni-go/istio-cni/internal/plugin"
	"github.com/istio-cni-go/istio-cni/internal/podnet"
	"github.com/istio-cni-go/istio-cni/internal/ruleset"
	"github.com/istio-cni-go/istio-cni/internal/testutil"
)

// heldRules notes whether the namespace's writers' lock was held when
// its rules were applied.
type heldRules struct {
	plugin.Rules
	held func() bool
	was  bool
}

func (r *heldRules) Apply(string, *ruleset.Plan) (podnet.Report, error) {
	r.was = r.held()
	return podnet.Report{}, nil
}

// TestRepairHoldsWritersLock: repair's writes (lockedRules.Apply) hold the
// namespace's writers' lock, as the relays' and the fallback's do, and
// release it after; an unusable lock directory leaves the write
// unlocked, with a warning.
func TestRepairHoldsWritersLock(t *testing.T) {
	// Any file stands for the namespace's: the lock is its inode's.
	path := filepath.Join(t.TempDir(), "netns")
	if err := os.WriteFile(path, nil, 0o600); err != nil {
		t.Fatal(err)
	}
	runDir := t.TempDir()
	held := func() bool { return testutil.WritersLockHeld(t, filepath.Join(runDir, nslock.WritersDir)) }
	inner := &heldRules{held: held}
	var logs strings.Builder
	r := &lockedRules{Rules: inner, locker: nslock.New(), runDir: runDir, log: slog.New(slog.NewJSONHandler(&logs, nil))}
	if _, err := r.Apply(path, &ruleset.Plan{}); err != nil {
		t.Fatal(err)
	}
	if !inner.was {
		t.Fatal("repair applied the rules without the namespace's writers' lock")
	}
	if held() {
		t.Fatal("the writers' lock outlived the write")
	}

	if err := os.Chmod(filepath.Join(runDir, nslock.WritersDir), 0o777); err != nil {
		t.Fatal(err)
	}
	if _, err := r.Apply(path, &ruleset.Plan{}); err != nil {
		t.Fatal(err)
	}
	if !strings.Contains(logs.String(), plugin.UnlockedWarning) || !strings.Contains(logs.String(), "not a directory private") {
		t.Fatalf("an unusable lock directory, the agent's log:\n%s", logs.String())
	}
}
