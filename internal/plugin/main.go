package plugin

import (
	"os"
	"runtime"
	"time"

	"github.com/containernetworking/cni/pkg/skel"
	"github.com/containernetworking/cni/pkg/version"

	"github.com/istio-cni-go/istio-cni/internal/iptables"
	"github.com/istio-cni-go/istio-cni/internal/logging"
	"github.com/istio-cni-go/istio-cni/internal/nftables"
)

// Version is set at build time.
var Version = "dev"

// Main runs the plugin as a runtime executes it and returns the exit code.
func Main() int {
	// Namespace switches must stay on one OS thread; start there.
	runtime.LockOSThread()
	log := logging.New(os.Stderr)
	p := &Plugin{
		Log:      log,
		Stdout:   os.Stdout,
		Rules:    &iptables.Applier{Force: os.Getenv("FORCE_IPTABLES_BINARY")},
		NFTables: &nftables.Applier{},
	}
	var sockPath string
	wrap := func(f func(*skel.CmdArgs) error) func(*skel.CmdArgs) error {
		return func(a *skel.CmdArgs) error {
			if conf, err := ParseConfig(a.StdinData); err == nil {
				sockPath = conf.LogSocketPath()
			}
			return f(a)
		}
	}
	err := skel.PluginMainFuncsWithError(skel.CNIFuncs{
		Add:    wrap(p.Add),
		Del:    wrap(p.Del),
		Check:  wrap(p.Check),
		Status: wrap(p.Status),
		GC:     wrap(p.GC),
	}, version.All, "istio-cni "+Version+": sidecar traffic redirection for Istio")
	code := 0
	if err != nil {
		log.Error("istio-cni failed", "code", err.Code, "error", err.Msg)
		_ = err.Print()
		code = 1
	}
	if sockPath != "" {
		_ = log.Forward(sockPath, time.Second)
	}
	return code
}
