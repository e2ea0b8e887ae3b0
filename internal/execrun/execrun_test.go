package execrun

import (
	"context"
	"errors"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"
)

func TestOSRunPassesWhatTheCmdSays(t *testing.T) {
	extra := filepath.Join(t.TempDir(), "extra")
	if err := os.WriteFile(extra, []byte("from fd 3"), 0o600); err != nil {
		t.Fatal(err)
	}
	f, err := os.Open(extra)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	res, err := OS{}.Run(context.Background(), &Cmd{
		Path:       "/bin/sh",
		Args:       []string{"-c", `read line; echo "$line|$FOO|$(cat <&3)"`},
		Env:        []string{"FOO=bar"},
		Stdin:      []byte("hello\n"),
		ExtraFiles: []*os.File{f},
	})
	if err != nil {
		t.Fatal(err)
	}
	if got := string(res.Stdout); got != "hello|bar|from fd 3\n" {
		t.Errorf("stdout %q", got)
	}
}

func TestOSRunEmptyEnvIsEmpty(t *testing.T) {
	t.Setenv("EXECRUN_LEAK", "yes")
	res, err := OS{}.Run(context.Background(), &Cmd{Path: "/usr/bin/env"})
	if err != nil {
		t.Fatal(err)
	}
	if len(res.Stdout) != 0 {
		t.Errorf("nil Env gave the child an environment: %q", res.Stdout)
	}
}

func TestOSRunExitError(t *testing.T) {
	res, err := OS{}.Run(context.Background(), &Cmd{Path: "/bin/sh", Args: []string{"-c", "echo out; echo bad thing >&2; exit 3"}})
	var exit *ExitError
	if !errors.As(err, &exit) {
		t.Fatalf("error %v (%T), want *ExitError", err, err)
	}
	if exit.Code != 3 || exit.Stderr != "bad thing\n" || exit.Cmd != "/bin/sh -c echo out; echo bad thing >&2; exit 3" {
		t.Errorf("ExitError %+v", exit)
	}
	if want := "/bin/sh -c echo out; echo bad thing >&2; exit 3: exit status 3: bad thing"; err.Error() != want {
		t.Errorf("message %q, want %q", err.Error(), want)
	}
	if string(res.Stdout) != "out\n" || string(res.Stderr) != "bad thing\n" {
		t.Errorf("result %q %q", res.Stdout, res.Stderr)
	}
}

func TestOSRunStreams(t *testing.T) {
	var out, errs strings.Builder
	res, err := OS{}.Run(context.Background(), &Cmd{Path: "/bin/sh", Args: []string{"-c", "echo o; echo e >&2"}, Stdout: &out, Stderr: &errs})
	if err != nil {
		t.Fatal(err)
	}
	if out.String() != "o\n" || errs.String() != "e\n" || len(res.Stdout)+len(res.Stderr) != 0 {
		t.Errorf("streams %q %q, result %q %q", out.String(), errs.String(), res.Stdout, res.Stderr)
	}
}

func TestOSRunContextKills(t *testing.T) {
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	_, err := OS{}.Run(ctx, &Cmd{Path: "/bin/sleep", Args: []string{"60"}})
	if err == nil {
		t.Fatal("a cancelled context still ran the command to the end")
	}
}

func TestOSRunSignalled(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	_, err := OS{}.Run(ctx, &Cmd{Path: "/bin/sh", Args: []string{"-c", "kill -KILL $$"}})
	var exit *ExitError
	if !errors.As(err, &exit) {
		t.Fatalf("error %v (%T), want *ExitError", err, err)
	}
	if exit.Code != -1 || exit.State() != "signal: killed" {
		t.Errorf("ExitError %+v, state %q", exit, exit.State())
	}
}

func TestOSRunMissingBinary(t *testing.T) {
	_, err := OS{}.Run(context.Background(), &Cmd{Path: "/nonexistent/tool"})
	var exit *ExitError
	if err == nil || errors.As(err, &exit) {
		t.Fatalf("error %v, want a start failure", err)
	}
}

func TestFuncRuns(t *testing.T) {
	var seen *Cmd
	r := Func(func(_ context.Context, c *Cmd) (Result, error) {
		seen = c
		return Result{Stdout: []byte("x")}, nil
	})
	c := &Cmd{Path: "/bin/true", Args: []string{"a", "b"}}
	res, err := r.Run(context.Background(), c)
	if err != nil || string(res.Stdout) != "x" || seen != c || c.String() != "/bin/true a b" {
		t.Errorf("Func.Run: %q %v %v %q", res.Stdout, err, seen, c.String())
	}
}
