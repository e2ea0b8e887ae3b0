// Package version tells which build of the project is running, in the
// shape of Istio's `version` command so that scripts reading it work.
package version

import (
	"encoding/json"
	"fmt"
	"io"
	"runtime"
	"runtime/debug"

	"sigs.k8s.io/yaml"
)

// Version is set at build time (-ldflags "-X .../internal/version.Version=1.2.3");
// otherwise the module version, or 0.0.0-dev for a local build.
var Version string

// Info describes this build.
type Info struct {
	Version       string `json:"version"`
	GitRevision   string `json:"revision"`
	GolangVersion string `json:"golang_version"`
	BuildStatus   string `json:"status"`
	GitTag        string `json:"tag"`
}

// Get returns this build's information.
func Get() Info {
	i := Info{Version: Version, GitRevision: "unknown", GolangVersion: runtime.Version(), BuildStatus: "unknown"}
	if bi, ok := debug.ReadBuildInfo(); ok {
		if i.Version == "" && bi.Main.Version != "" && bi.Main.Version != "(devel)" {
			i.Version = bi.Main.Version
		}
		for _, s := range bi.Settings {
			switch s.Key {
			case "vcs.revision":
				i.GitRevision = s.Value
			case "vcs.modified":
				i.BuildStatus = map[string]string{"true": "Modified", "false": "Clean"}[s.Value]
			}
		}
	}
	if i.Version == "" {
		i.Version = "0.0.0-dev"
	}
	i.GitTag = i.Version
	return i
}

func (i Info) String() string {
	return fmt.Sprintf("version.BuildInfo{Version:%q, GitRevision:%q, GolangVersion:%q, BuildStatus:%q, GitTag:%q}",
		i.Version, i.GitRevision, i.GolangVersion, i.BuildStatus, i.GitTag)
}

// Command runs `<binary> version [--short|-s] [-o json|yaml]` and returns
// its exit code: 0, or 2 for arguments it does not know.
func Command(args []string, stdout, stderr io.Writer) int {
	short, output := false, ""
	for i := 0; i < len(args); i++ {
		switch a := args[i]; a {
		case "-s", "--short", "-short", "--short=true":
			short = true
		case "--short=false":
		case "-o", "--output", "-output":
			if i+1 >= len(args) {
				_, _ = fmt.Fprintf(stderr, "version: %s needs a value (json or yaml)\n", a)
				return 2
			}
			i++
			output = args[i]
		case "-h", "--help":
			_, _ = fmt.Fprintln(stdout, "Usage: version [--short|-s] [-o json|yaml]: prints the build's version")
			return 0
		default:
			if len(a) > 9 && a[:9] == "--output=" {
				output = a[9:]
				continue
			}
			_, _ = fmt.Fprintf(stderr, "version: unknown argument %q (want --short or -o json|yaml)\n", a)
			return 2
		}
	}
	i := Get()
	switch {
	case output == "json" || output == "yaml":
		doc := map[string]any{"clientVersion": i}
		var b []byte
		if output == "json" {
			b, _ = json.MarshalIndent(doc, "", "  ")
			b = append(b, '\n')
		} else {
			b, _ = yaml.Marshal(doc)
		}
		_, _ = stdout.Write(b)
	case output != "":
		_, _ = fmt.Fprintf(stderr, "version: --output must be json or yaml, not %q\n", output)
		return 2
	case short:
		_, _ = fmt.Fprintln(stdout, i.Version)
	default:
		_, _ = fmt.Fprintln(stdout, i.String())
	}
	return 0
}
