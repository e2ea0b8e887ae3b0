package prepared

import (
	"errors"
	"io/fs"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"
)

// TestStoredPlan: a plan's requests come back under its key and no
// other; a missing plan is fs.ErrNotExist; a file under the plan's name
// holding another key, garbage, or a link is refused; Reset removes the
// plans (an earlier agent's) and keeps the configs.
func TestStoredPlan(t *testing.T) {
	d := Dir(t.TempDir())
	if _, err := ReadPlan(string(d), "iptables  abc"); !errors.Is(err, fs.ErrNotExist) {
		t.Fatalf("missing plan: %v", err)
	}
	if err := d.PutPlan("iptables  abc", []byte("requests")); err != nil {
		t.Fatal(err)
	}
	if got, err := ReadPlan(string(d), "iptables  abc"); err != nil || string(got) != "requests" {
		t.Fatalf("read back %q, %v", got, err)
	}
	if _, err := ReadPlan(string(d), "iptables nft abc"); !errors.Is(err, fs.ErrNotExist) {
		t.Fatalf("another key: %v", err)
	}
	// Another plan's file under this name.
	if err := d.PutPlan("iptables  def", []byte("other")); err != nil {
		t.Fatal(err)
	}
	if err := os.Rename(filepath.Join(string(d), planName("iptables  def")), filepath.Join(string(d), planName("iptables  abc"))); err != nil {
		t.Fatal(err)
	}
	if _, err := ReadPlan(string(d), "iptables  abc"); err == nil || !strings.Contains(err.Error(), "not the stored plan") {
		t.Fatalf("another plan's file: %v", err)
	}
	for name, data := range map[string]string{"garbage": "nonsense", "short": planMagic + "\x00\x00", "long key": planMagic + "\x00\x00\x10\x00abc"} {
		if err := os.WriteFile(filepath.Join(string(d), planName("iptables  abc")), []byte(data), 0o600); err != nil {
			t.Fatal(err)
		}
		if _, err := ReadPlan(string(d), "iptables  abc"); err == nil {
			t.Fatalf("%s read as a plan", name)
		}
	}
	target := filepath.Join(t.TempDir(), "plan")
	if err := d.PutPlan("iptables  abc", []byte("requests")); err != nil {
		t.Fatal(err)
	}
	if err := os.Rename(filepath.Join(string(d), planName("iptables  abc")), target); err != nil {
		t.Fatal(err)
	}
	if err := os.Symlink(target, filepath.Join(string(d), planName("iptables  abc"))); err != nil {
		t.Fatal(err)
	}
	if _, err := ReadPlan(string(d), "iptables  abc"); err == nil {
		t.Fatal("a plan read through a link")
	}
	if err := d.PutPlan("iptables  ghi", []byte("kept until reset")); err != nil {
		t.Fatal(err)
	}
	if err := d.SaveConfigs([][]byte{[]byte(`{"type":"istio-cni"}`)}); err != nil {
		t.Fatal(err)
	}
	if err := d.Reset(); err != nil {
		t.Fatal(err)
	}
	if _, err := ReadPlan(string(d), "iptables  ghi"); !errors.Is(err, fs.ErrNotExist) {
		t.Fatalf("a plan outlived Reset: %v", err)
	}
	if len(d.LoadConfigs()) != 1 {
		t.Fatal("Reset lost the configs")
	}
	if err := d.PutPlan("iptables  big", make([]byte, MaxRecord)); err == nil {
		t.Fatal("a plan over MaxRecord stored")
	}
}

// TestPlanBudget: past the budget the longest-stored plans go, never the
// one just stored nor anything but plans.
func TestPlanBudget(t *testing.T) {
	d := Dir(t.TempDir())
	if err := d.SaveConfigs([][]byte{[]byte(`{"type":"istio-cni"}`)}); err != nil {
		t.Fatal(err)
	}
	txn := []byte(strings.Repeat("r", 1000))
	size := int64(len(planMagic) + 4 + len("plan a") + len(txn)) // every key here is as long
	at := time.Now().Add(-time.Hour)
	for _, k := range []string{"plan a", "plan b", "plan c"} {
		if err := d.putPlan(k, txn, 1<<20); err != nil {
			t.Fatal(err)
		}
		// Stored a minute apart, b first: the order is the files' times,
		// not the names'.
		order := map[string]int{"plan b": 0, "plan a": 1, "plan c": 2}[k]
		if err := os.Chtimes(filepath.Join(string(d), planName(k)), at, at.Add(time.Duration(order)*time.Minute)); err != nil {
			t.Fatal(err)
		}
	}
	if err := d.putPlan("plan d", txn, 3*size); err != nil {
		t.Fatal(err)
	}
	for k, want := range map[string]bool{"plan a": true, "plan b": false, "plan c": true, "plan d": true} {
		if got := HasPlan(string(d), k); got != want {
			t.Errorf("%s stored: %v, want %v", k, got, want)
		}
	}
	if _, err := os.Stat(filepath.Join(string(d), configsName)); err != nil {
		t.Errorf("the configs went with the plans: %v", err)
	}
	// One plan over the budget alone stays: the pod preparing it sends it.
	if err := d.putPlan("plan e", txn, size/2); err != nil {
		t.Fatal(err)
	}
	for k, want := range map[string]bool{"plan a": false, "plan c": false, "plan d": false, "plan e": true} {
		if got := HasPlan(string(d), k); got != want {
			t.Errorf("%s stored: %v, want %v", k, got, want)
		}
	}
}
