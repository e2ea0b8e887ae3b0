package cniserver

import (
	"os"
	"path/filepath"
	"testing"
	"time"

	"github.com/istio-cni-go/istio-cni/internal/prepared"
)

// TestAgentRenewsItsBeat: an agent that prepares tells relays it runs
// from its start, renews that while it runs, and leaves it when it stops
// (pods starting before the next agent still find their records, until
// prepared.AliveFor has passed).
func TestAgentRenewsItsBeat(t *testing.T) {
	was := beatEvery
	beatEvery = 20 * time.Millisecond
	t.Cleanup(func() { beatEvery = was })
	r := newPreparingRig(t)
	dir := r.s.PreparedDir
	first, ok := prepared.AgentSeen(dir, time.Now())
	if !ok || first < 0 || first > time.Minute {
		t.Fatalf("an agent just started was last seen %s ago (%t)", first, ok)
	}
	fi, err := os.Stat(filepath.Join(dir, ".agent-alive"))
	if err != nil {
		t.Fatal(err)
	}
	deadline := time.Now().Add(20 * time.Second)
	for {
		now, err := os.Stat(filepath.Join(dir, ".agent-alive"))
		if err != nil {
			t.Fatal(err)
		}
		if now.ModTime().After(fi.ModTime()) {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("the agent did not renew its beat every %s", beatEvery)
		}
		time.Sleep(5 * time.Millisecond) // polling the agent's ticker, bounded
	}
	r.stop()
	if _, ok := prepared.AgentSeen(dir, time.Now()); !ok {
		t.Fatal("the stopped agent took its beat away: its records are unusable at once")
	}
}
