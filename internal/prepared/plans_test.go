package prepared

import (
	"errors"
	"io/fs"
	"os"
	"path/filepath"
	"strings"
	"testing"
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
