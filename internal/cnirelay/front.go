package cnirelay

import (
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"strings"

	"golang.org/x/sys/unix"
)

// Args is one command as the runtime gave it: the CNI_ variables and the
// config on stdin.
type Args struct {
	Command       string
	ContainerID   string
	Netns         string
	IfName        string
	Args          string
	Path          string
	NetnsOverride string
	Stdin         []byte
}

// SupportedVersions are the CNI versions the plugin speaks, as the
// fallback (the CNI library's version.All) answers VERSION.
var SupportedVersions = []string{"0.1.0", "0.2.0", "0.3.0", "0.3.1", "0.4.0", "1.0.0", "1.1.0"}

// The variables each command needs, in the order the CNI library lists
// them when some are missing.
var required = []struct {
	name string
	for_ map[string]bool
}{
	{"CNI_COMMAND", nil},
	{"CNI_CONTAINERID", map[string]bool{"ADD": true, "CHECK": true, "DEL": true}},
	{"CNI_NETNS", map[string]bool{"ADD": true, "CHECK": true}},
	{"CNI_IFNAME", map[string]bool{"ADD": true, "CHECK": true, "DEL": true}},
	{"CNI_PATH", map[string]bool{"ADD": true, "CHECK": true, "DEL": true, "GC": true, "STATUS": true}},
}

// argsFromEnv reads the command's variables; a missing one is the error
// the CNI library gives for it.
func argsFromEnv(getenv func(string) string) (*Args, *Error) {
	a := &Args{Command: getenv("CNI_COMMAND"), ContainerID: getenv("CNI_CONTAINERID"), Netns: getenv("CNI_NETNS"),
		IfName: getenv("CNI_IFNAME"), Args: getenv("CNI_ARGS"), Path: getenv("CNI_PATH"), NetnsOverride: getenv("CNI_NETNS_OVERRIDE")}
	var missing []string
	for _, v := range required {
		if getenv(v.name) == "" && (v.for_ == nil || v.for_[a.Command]) {
			missing = append(missing, v.name)
		}
	}
	if len(missing) > 0 {
		return nil, NewError(ErrInvalidEnvironmentVariables, fmt.Sprintf("required env variables [%s] missing", strings.Join(missing, ",")), "")
	}
	return a, nil
}

// Main runs the relay as a runtime executes it and returns the exit code.
func Main(about string) int {
	return run(about, os.Getenv, os.Environ(), os.Stdin, os.Stdout, os.Stderr)
}

func run(about string, getenv func(string) string, environ []string, stdin io.Reader, stdout, stderr io.Writer) int {
	a, cerr := argsFromEnv(getenv)
	switch {
	case cerr != nil && getenv("CNI_COMMAND") == "" && about != "":
		// Run by hand: say what this is.
		_, _ = fmt.Fprintln(stderr, about)
		_, _ = fmt.Fprintf(stderr, "CNI protocol versions supported: %s\n", strings.Join(SupportedVersions, ", "))
		return 0
	case cerr != nil:
		printError(stdout, cerr)
		return 1
	case a.Command == "VERSION":
		b, _ := json.Marshal(struct {
			CNIVersion string   `json:"cniVersion"`
			Supported  []string `json:"supportedVersions"`
		}{SupportedVersions[len(SupportedVersions)-1], SupportedVersions})
		_, _ = stdout.Write(append(b, '\n'))
		return 0
	}
	data, err := io.ReadAll(stdin)
	if err != nil {
		printError(stdout, NewError(ErrIOFailure, fmt.Sprintf("error reading from stdin: %v", err), ""))
		return 1
	}
	a.Stdin = data
	if (a.Command == "ADD" || a.Command == "DEL") && !strings.EqualFold(a.NetnsOverride, "true") && a.NetnsOverride != "1" && ownNetns(a.Netns) {
		// As the CNI library checks every plugin's ADD and DEL (after
		// the plugin ran; here before): rules meant for a pod must never
		// land in the node's own namespace.
		printError(stdout, NewError(ErrInvalidNetNS, "plugin's netns and netns from CNI_NETNS should not be the same", ""))
		return 1
	}
	fallback := FallbackBinary
	if exe, err := os.Executable(); err == nil {
		fallback = filepath.Join(filepath.Dir(exe), FallbackBinary)
	}
	r := &Relay{Fallback: fallback, Environ: environ, Stdout: stdout, Stderr: stderr, Timeout: Timeout, Getenv: getenv}
	if err := r.Run(a); err != nil {
		var e *Error
		if !errors.As(err, &e) {
			e = NewError(ErrInternal, err.Error(), "")
		}
		printError(stdout, e)
		return 1
	}
	return 0
}

// printError prints a CNI error object as the CNI library does: indented
// by four spaces, with no newline after it.
func printError(w io.Writer, e *Error) {
	b, err := json.MarshalIndent(e, "", "    ")
	if err == nil {
		_, _ = w.Write(b)
	}
}

// ownNetns reports whether path names the namespace this process runs in.
func ownNetns(path string) bool {
	var pod, own unix.Stat_t
	if path == "" || unix.Stat(path, &pod) != nil || unix.Stat("/proc/self/ns/net", &own) != nil {
		return false
	}
	return pod.Dev == own.Dev && pod.Ino == own.Ino
}
