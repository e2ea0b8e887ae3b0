// Package execrun is the one place the product starts other processes
// (iptables-restore, iptables-save, nsenter, the fallback plugin). Callers
// describe a command as data and hand it to a Runner, so the decisions
// around a command (what to run, what its answer means) can be tested with
// a recorded Runner and no root, and the real one stays a few lines.
package execrun

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"os/exec"
	"runtime"
	"strings"
	"time"
)

// DefaultTimeout bounds a command whose Cmd sets no Timeout: twice the
// xtables lock's 30 s wait the iptables writes ask for. A tool that hangs
// (stopped, or stuck in the kernel) would otherwise hold its pod's
// namespace lock, and every ADD waiting on the same prepared plan,
// forever.
const DefaultTimeout = time.Minute

// waitDelay is how long a killed command's output may still be read: a
// grandchild holding its pipes open must not keep Run waiting.
const waitDelay = 2 * time.Second

var errTimedOut = errors.New("the command's timeout passed")

// Cmd is one process to run, argument list only: nothing goes through a
// shell.
type Cmd struct {
	Path string
	Args []string // without argv[0]
	// Env is the whole environment; nil means an empty one (never the
	// caller's, which would leak the agent's into tools by accident).
	Env   []string
	Stdin []byte
	// ExtraFiles become fds 3, 4, ... in the child.
	ExtraFiles []*os.File
	// Stdout and Stderr, when set, receive the output as it comes instead
	// of it being returned in Result.
	Stdout, Stderr io.Writer
	// Timeout is how long the command may run before it is killed: 0 is
	// DefaultTimeout; negative, only ctx bounds it.
	Timeout time.Duration
}

// String is the command line as a person would type it, for errors and
// golden files.
func (c *Cmd) String() string {
	return strings.Join(append([]string{c.Path}, c.Args...), " ")
}

// Result is what a finished command printed (the parts not sent to
// Cmd.Stdout/Cmd.Stderr).
type Result struct {
	Stdout, Stderr []byte
}

// ExitError is a command that ran and exited non-zero or was killed.
type ExitError struct {
	Cmd  string
	Code int // -1 when a signal ended it
	// Status is how it ended as the os package says it ("exit status 1",
	// "signal: killed"); empty means "exit status <Code>".
	Status string
	Stderr string
}

// State is how the command ended, for messages.
func (e *ExitError) State() string {
	if e.Status != "" {
		return e.Status
	}
	return fmt.Sprintf("exit status %d", e.Code)
}

func (e *ExitError) Error() string {
	msg := strings.TrimSpace(e.Stderr)
	if msg == "" {
		return fmt.Sprintf("%s: %s", e.Cmd, e.State())
	}
	return fmt.Sprintf("%s: %s: %s", e.Cmd, e.State(), msg)
}

// Runner runs a command to completion. An error is either *ExitError (it
// ran and failed) or a failure to start it.
type Runner interface {
	Run(ctx context.Context, c *Cmd) (Result, error)
}

// OS runs commands for real.
type OS struct{}

// Run starts c and waits for it; ctx ending or c's timeout passing kills
// it, and so does the death of the calling process (a plugin process the
// runtime killed at its deadline must not leave its children writing
// into a sandbox being torn down, nor holding the runtime's stderr).
func (OS) Run(ctx context.Context, c *Cmd) (Result, error) {
	timeout := c.Timeout
	if timeout == 0 {
		timeout = DefaultTimeout
	}
	if timeout > 0 {
		var cancel context.CancelFunc
		ctx, cancel = context.WithTimeoutCause(ctx, timeout, errTimedOut)
		defer cancel()
	}
	// Running what the caller describes is this package's job; argv only,
	// never a shell.
	cmd := exec.CommandContext(ctx, c.Path, c.Args...) //nolint:gosec // G204: see above.
	cmd.WaitDelay = waitDelay
	cmd.SysProcAttr = dieWithParent()
	// The parent-death signal comes when the thread that forked exits, not
	// the process: the goroutine keeps its thread until the child is
	// reaped, so no thread the runtime retires can take the child along.
	runtime.LockOSThread()
	defer runtime.UnlockOSThread()
	cmd.Env = c.Env
	if cmd.Env == nil {
		cmd.Env = []string{}
	}
	cmd.ExtraFiles = c.ExtraFiles
	if c.Stdin != nil {
		cmd.Stdin = bytes.NewReader(c.Stdin)
	}
	var stdout, stderr bytes.Buffer
	cmd.Stdout, cmd.Stderr = &stdout, &stderr
	if c.Stdout != nil {
		cmd.Stdout = c.Stdout
	}
	if c.Stderr != nil {
		cmd.Stderr = c.Stderr
	}
	err := cmd.Run()
	res := Result{Stdout: stdout.Bytes(), Stderr: stderr.Bytes()}
	var exit *exec.ExitError
	if errors.As(err, &exit) {
		status := exit.String()
		if errors.Is(context.Cause(ctx), errTimedOut) && exit.ExitCode() == -1 {
			status = fmt.Sprintf("%s after %s", status, timeout)
		}
		return res, &ExitError{Cmd: c.String(), Code: exit.ExitCode(), Status: status, Stderr: stderr.String()}
	}
	return res, err
}

// Func adapts a function to Runner: the recorded or scripted runner of
// tests.
type Func func(ctx context.Context, c *Cmd) (Result, error)

// Run calls f.
func (f Func) Run(ctx context.Context, c *Cmd) (Result, error) { return f(ctx, c) }
