package install

import (
	"context"
	"errors"
	"os"
	"os/exec"
	"path/filepath"
	"sync"
	"syscall"
	"testing"
)

// TestInstalledBinaryRunsWhileTheAgentForks installs a binary over and
// over while other goroutines start processes, and runs each copy as
// soon as it is in place, as a runtime runs the plugin the agent has just
// installed. A child forked while the temp file was open for writing
// holds that descriptor until its own exec; a binary run meanwhile fails
// with "text file busy", and the pod's ADD with it.
func TestInstalledBinaryRunsWhileTheAgentForks(t *testing.T) {
	truePath, err := exec.LookPath("true")
	if err != nil {
		t.Fatal(err)
	}
	orig, err := os.ReadFile(truePath)
	if err != nil {
		t.Fatal(err)
	}
	dir := t.TempDir()
	// Two sources that differ, so every round writes: an ELF file runs
	// with bytes after its end.
	srcs := []string{filepath.Join(dir, "a"), filepath.Join(dir, "b")}
	for i, p := range srcs {
		if err := os.WriteFile(p, append(orig, make([]byte, i)...), 0o755); err != nil {
			t.Fatal(err)
		}
	}
	ctx, cancel := context.WithCancel(context.Background())
	var wg sync.WaitGroup
	for range 2 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for ctx.Err() == nil {
				_ = exec.Command(truePath).Run()
			}
		}()
	}
	defer func() { cancel(); wg.Wait() }()
	dst := filepath.Join(dir, "installed")
	for i := range 300 {
		if _, err := CopyFileAtomic(srcs[i%2], dst, 0o755); err != nil {
			t.Fatal(err)
		}
		if err := exec.Command(dst).Run(); err != nil {
			if errors.Is(err, syscall.ETXTBSY) {
				t.Fatalf("round %d: the installed binary could not run: %v", i, err)
			}
			t.Fatalf("round %d: %v", i, err)
		}
	}
}
