package cnirelay

import (
	"bytes"
	"encoding/json"
	"io"
	"os"
	"strings"
	"testing"

	"github.com/containernetworking/cni/pkg/skel"
	"github.com/containernetworking/cni/pkg/version"
)

// skelRun runs the CNI library's skel with env and returns what it
// prints on stdout and stderr and its exit code, as PluginMainFuncs would
// have ended the process; the plugin's own commands only record that
// they were called.
func skelRun(t *testing.T, env map[string]string, about string) (stdout, stderr string, code int) {
	t.Helper()
	for _, k := range []string{"CNI_COMMAND", "CNI_CONTAINERID", "CNI_NETNS", "CNI_IFNAME", "CNI_ARGS", "CNI_PATH", "CNI_NETNS_OVERRIDE"} {
		t.Setenv(k, env[k])
	}
	outR, outW, _ := os.Pipe()
	errR, errW, _ := os.Pipe()
	inR, inW, _ := os.Pipe()
	_ = inW.Close()
	saved := []*os.File{os.Stdout, os.Stderr, os.Stdin}
	os.Stdout, os.Stderr, os.Stdin = outW, errW, inR
	called := func(*skel.CmdArgs) error { return nil }
	e := skel.PluginMainFuncsWithError(skel.CNIFuncs{Add: called, Del: called, Check: called, GC: called, Status: called}, version.All, about)
	if e != nil {
		_ = e.Print()
		code = 1
	}
	os.Stdout, os.Stderr, os.Stdin = saved[0], saved[1], saved[2]
	_ = outW.Close()
	_ = errW.Close()
	o, _ := io.ReadAll(outR)
	r, _ := io.ReadAll(errR)
	return string(o), string(r), code
}

// TestFrontMatchesSkel: what the relay answers by itself (run by hand,
// VERSION, the variables a command lacks) is byte for byte what a plugin
// built on the CNI library's skel prints, with the same exit code.
func TestFrontMatchesSkel(t *testing.T) {
	const about = "istio-cni: test"
	full := map[string]string{"CNI_CONTAINERID": "c1", "CNI_NETNS": "/nonexistent", "CNI_IFNAME": "eth0", "CNI_PATH": "/opt/cni/bin"}
	without := func(cmd string, drop ...string) map[string]string {
		env := map[string]string{"CNI_COMMAND": cmd}
		for k, v := range full {
			env[k] = v
		}
		for _, d := range drop {
			delete(env, d)
		}
		return env
	}
	for _, c := range []struct {
		name string
		env  map[string]string
	}{
		{"run by hand", map[string]string{}},
		{"run by hand with some variables", map[string]string{"CNI_PATH": "/x"}},
		{"VERSION", map[string]string{"CNI_COMMAND": "VERSION"}},
		{"ADD without anything", map[string]string{"CNI_COMMAND": "ADD"}},
		{"ADD without a namespace", without("ADD", "CNI_NETNS")},
		{"CHECK without a container or interface", without("CHECK", "CNI_CONTAINERID", "CNI_IFNAME")},
		{"DEL without a path", without("DEL", "CNI_PATH", "CNI_NETNS")},
		{"GC without a path", without("GC", "CNI_PATH")},
		{"STATUS without a path", without("STATUS", "CNI_PATH")},
	} {
		t.Run(c.name, func(t *testing.T) {
			wantOut, wantErr, wantCode := skelRun(t, c.env, about)
			var out, errOut bytes.Buffer
			code := run(about, func(k string) string { return c.env[k] }, nil, strings.NewReader(""), &out, &errOut)
			if out.String() != wantOut || errOut.String() != wantErr || code != wantCode {
				t.Fatalf("relay printed %q, %q and exits %d; skel prints %q, %q and exits %d",
					out.String(), errOut.String(), code, wantOut, wantErr, wantCode)
			}
		})
	}
}

// TestFrontRefusesItsOwnNamespace: an ADD or DEL naming the namespace the
// relay itself runs in fails as skel fails it, and reaches no agent and
// no fallback; CNI_NETNS_OVERRIDE lets it through, as in skel.
func TestFrontRefusesItsOwnNamespace(t *testing.T) {
	env := map[string]string{"CNI_COMMAND": "ADD", "CNI_CONTAINERID": "c1", "CNI_NETNS": "/proc/self/ns/net", "CNI_IFNAME": "eth0", "CNI_PATH": "/nonexistent"}
	var out bytes.Buffer
	conf := `{"cniVersion":"1.0.0","name":"n","type":"istio-cni","cni_agent_run_dir":"/nonexistent"}`
	code := run("", func(k string) string { return env[k] }, nil, strings.NewReader(conf), &out, io.Discard)
	var e Error
	if code != 1 || json.Unmarshal(out.Bytes(), &e) != nil || e.Code != ErrInvalidNetNS || e.Msg != "plugin's netns and netns from CNI_NETNS should not be the same" {
		t.Fatalf("exit %d, printed %s", code, out.String())
	}
	env["CNI_NETNS_OVERRIDE"] = "true"
	out.Reset()
	code = run("", func(k string) string { return env[k] }, nil, strings.NewReader(conf), &out, io.Discard)
	if strings.Contains(out.String(), "should not be the same") {
		t.Fatalf("with the override: exit %d, printed %s", code, out.String())
	}
}
