package version

import (
	"bytes"
	"encoding/json"
	"strings"
	"testing"
)

func TestCommand(t *testing.T) {
	run := func(args ...string) (int, string, string) {
		var out, errOut bytes.Buffer
		code := Command(args, &out, &errOut)
		return code, out.String(), errOut.String()
	}
	if code, out, _ := run(); code != 0 || !strings.HasPrefix(out, "version.BuildInfo{Version:") {
		t.Fatalf("version: %d %q", code, out)
	}
	if code, out, _ := run("--short"); code != 0 || strings.TrimSpace(out) != Get().Version {
		t.Fatalf("--short: %d %q", code, out)
	}
	code, out, _ := run("-o", "json")
	var doc map[string]Info
	if code != 0 || json.Unmarshal([]byte(out), &doc) != nil || doc["clientVersion"].GolangVersion == "" {
		t.Fatalf("-o json: %d %q", code, out)
	}
	if code, out, _ := run("--output=yaml"); code != 0 || !strings.Contains(out, "clientVersion:") {
		t.Fatalf("-o yaml: %d %q", code, out)
	}
	for _, bad := range [][]string{{"-o", "xml"}, {"--nope"}, {"-o"}} {
		if code, _, errOut := run(bad...); code != 2 || errOut == "" {
			t.Errorf("%q: exit %d, stderr %q", bad, code, errOut)
		}
	}
}
