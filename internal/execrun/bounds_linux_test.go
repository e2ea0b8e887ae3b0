package execrun

import (
	"context"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"
)

// TestOSRunTimeout: a command that hangs is killed when its timeout
// passes, and the error says so; one with no timeout of its own gets the
// default.
func TestOSRunTimeout(t *testing.T) {
	_, err := OS{}.Run(context.Background(), &Cmd{Path: "/bin/sleep", Args: []string{"60"}, Timeout: 100 * time.Millisecond})
	var exit *ExitError
	if !errors.As(err, &exit) || exit.Code != -1 || exit.State() != "signal: killed after 100ms" {
		t.Fatalf("error %v, want a kill after 100ms", err)
	}
	// A cancelled caller is not reported as the command's timeout.
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	_, err = OS{}.Run(ctx, &Cmd{Path: "/bin/sleep", Args: []string{"60"}})
	if err == nil || strings.Contains(err.Error(), " after ") {
		t.Fatalf("error %v, want the cancellation's", err)
	}
}

// TestOSRunKilledCommandsGrandchild: a killed command's grandchild that
// keeps its output pipe open does not keep Run waiting for it.
func TestOSRunKilledCommandsGrandchild(t *testing.T) {
	done := make(chan error, 1)
	go func() {
		_, err := OS{}.Run(context.Background(), &Cmd{Path: "/bin/sh", Args: []string{"-c", "sleep 60 & sleep 60"}, Timeout: 100 * time.Millisecond})
		done <- err
	}()
	select {
	case err := <-done:
		if err == nil {
			t.Fatal("the command was not killed")
		}
	case <-time.After(30 * time.Second):
		t.Fatal("Run waited for the grandchild holding the command's output")
	}
}

// TestOSRunChildDiesWithItsParent: a process that runs a command and is
// killed (a plugin process the runtime kills at its deadline) takes the
// command with it.
func TestOSRunChildDiesWithItsParent(t *testing.T) {
	if os.Getenv("EXECRUN_PARENT") != "" {
		_, err := OS{}.Run(context.Background(), &Cmd{Path: "/bin/sh",
			Args: []string{"-c", `echo $$ > "$1.tmp" && mv "$1.tmp" "$1" && exec sleep 60`, "sh", os.Getenv("EXECRUN_PARENT")}})
		fmt.Println(err)
		os.Exit(3)
	}
	pidFile := filepath.Join(t.TempDir(), "child")
	parent := exec.Command(os.Args[0], "-test.run=^TestOSRunChildDiesWithItsParent$")
	parent.Env = append(os.Environ(), "EXECRUN_PARENT="+pidFile)
	if err := parent.Start(); err != nil {
		t.Fatal(err)
	}
	var child int
	for deadline := time.Now().Add(30 * time.Second); child == 0; {
		if b, err := os.ReadFile(pidFile); err == nil {
			if child, err = strconv.Atoi(strings.TrimSpace(string(b))); err != nil {
				t.Fatal(err)
			}
		} else if time.Now().After(deadline) {
			_ = parent.Process.Kill()
			t.Fatal("the command never started")
		}
		time.Sleep(10 * time.Millisecond) // polling a file the child writes
	}
	t.Cleanup(func() { _ = syscall.Kill(child, syscall.SIGKILL) })
	if err := parent.Process.Kill(); err != nil {
		t.Fatal(err)
	}
	_ = parent.Wait()
	for deadline := time.Now().Add(30 * time.Second); alive(child); {
		if time.Now().After(deadline) {
			t.Fatalf("the command (pid %d) outlived the process that ran it", child)
		}
		time.Sleep(10 * time.Millisecond) // polling the child's state
	}
}

// alive: pid is a process that has not ended (a zombie has).
func alive(pid int) bool {
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
	if err != nil {
		return false
	}
	s := string(b)
	i := strings.LastIndexByte(s, ')')
	return i < 0 || i+2 >= len(s) || s[i+2] != 'Z'
}
