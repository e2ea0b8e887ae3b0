package cniserver

import (
	"os"
	"testing"

	"github.com/containernetworking/cni/pkg/skel"
	"github.com/containernetworking/cni/pkg/types"
	"github.com/containernetworking/cni/pkg/version"

	"github.com/istio-cni-go/istio-cni/internal/cnirelay"
)

// skelVerdict runs the CNI library's skel on a command and says whether
// it would call the plugin, or its error.
func skelVerdict(t *testing.T, req *cnirelay.Request) (called bool, e *types.Error) {
	t.Helper()
	for k, v := range map[string]string{"CNI_COMMAND": req.Command, "CNI_CONTAINERID": req.ContainerID, "CNI_NETNS": "/nonexistent",
		"CNI_IFNAME": req.IfName, "CNI_ARGS": req.Args, "CNI_PATH": "/opt/cni/bin"} {
		t.Setenv(k, v)
	}
	r, w, err := os.Pipe()
	if err != nil {
		t.Fatal(err)
	}
	if _, err := w.Write(req.Stdin); err != nil {
		t.Fatal(err)
	}
	_ = w.Close()
	saved := os.Stdin
	os.Stdin = r
	defer func() { os.Stdin = saved }()
	call := func(*skel.CmdArgs) error { called = true; return nil }
	e = skel.PluginMainFuncsWithError(skel.CNIFuncs{Add: call, Del: call, Check: call, GC: call, Status: call}, version.All, "")
	return called, e
}

// TestCheckAsSkelMatchesSkel: the checks the agent makes for the relay
// give every command what skel gives it: the same error (code, message,
// details), or the plugin called.
func TestCheckAsSkelMatchesSkel(t *testing.T) {
	conf := func(v string) []byte {
		return []byte(`{"cniVersion":"` + v + `","name":"k8s-pod-network","type":"istio-cni"}`)
	}
	ok := func(cmd, v string) *cnirelay.Request {
		return &cnirelay.Request{Command: cmd, ContainerID: "abc-1.x_y", IfName: "eth0", Stdin: conf(v)}
	}
	with := func(r *cnirelay.Request, f func(*cnirelay.Request)) *cnirelay.Request { f(r); return r }
	cases := map[string]*cnirelay.Request{
		"bad container id":    with(ok("ADD", "1.0.0"), func(r *cnirelay.Request) { r.ContainerID = "-bad/id" }),
		"long interface name": with(ok("CHECK", "1.0.0"), func(r *cnirelay.Request) { r.IfName = "a-very-long-ifname" }),
		"interface with /":    with(ok("DEL", "1.0.0"), func(r *cnirelay.Request) { r.IfName = "eth/0" }),
		"interface ..":        with(ok("ADD", "1.0.0"), func(r *cnirelay.Request) { r.IfName = ".." }),
		"config not JSON":     with(ok("ADD", "1.0.0"), func(r *cnirelay.Request) { r.Stdin = []byte("{") }),
		"no network name":     with(ok("ADD", "1.0.0"), func(r *cnirelay.Request) { r.Stdin = []byte(`{"cniVersion":"1.0.0"}`) }),
		"bad network name":    with(ok("DEL", "1.0.0"), func(r *cnirelay.Request) { r.Stdin = []byte(`{"cniVersion":"1.0.0","name":"a b"}`) }),
		"unknown version":     ok("ADD", "0.9.9"),
		"bad version":         ok("DEL", "x.y"),
		"no version":          with(ok("ADD", ""), func(r *cnirelay.Request) { r.Stdin = []byte(`{"name":"n"}`) }),
		"CHECK at 0.3.1":      ok("CHECK", "0.3.1"),
		"CHECK at 2.0.0":      ok("CHECK", "2.0.0"),
		"GC at 1.0.0":         ok("GC", "1.0.0"),
		"STATUS at 1.0.0":     ok("STATUS", "1.0.0"),
		"STATUS at 1.2.0":     ok("STATUS", "1.2.0"),
		"unknown command":     ok("FOO", "1.0.0"),
	}
	for _, cmd := range []string{"ADD", "DEL", "CHECK", "GC", "STATUS"} {
		cases["valid "+cmd] = ok(cmd, "1.1.0")
	}
	cases["valid ADD at 0.3.1"] = ok("ADD", "0.3.1")
	for name, req := range cases {
		t.Run(name, func(t *testing.T) {
			called, want := skelVerdict(t, req)
			got := checkAsSkel(req)
			switch {
			case want == nil && !called:
				t.Fatal("skel neither called the plugin nor failed")
			case want == nil && got != nil:
				t.Fatalf("skel calls the plugin; the agent refuses: %+v", got)
			case want != nil && (got == nil || *got != *want):
				t.Fatalf("skel: %+v; the agent: %+v", want, got)
			}
		})
	}
}
