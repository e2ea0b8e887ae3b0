package plugin

import (
	"os"
	"path/filepath"
	"runtime"
	"time"

	"github.com/containernetworking/cni/pkg/skel"
	"github.com/containernetworking/cni/pkg/version"
	"golang.org/x/sys/unix"

	"github.com/istio-cni-go/istio-cni/internal/cnirelay"
	"github.com/istio-cni-go/istio-cni/internal/iptables"
	"github.com/istio-cni-go/istio-cni/internal/logging"
	"github.com/istio-cni-go/istio-cni/internal/nftables"
	"github.com/istio-cni-go/istio-cni/internal/prepared"
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
		// The agent's FORCE_IPTABLES_BINARY wins over the runtime's, as it
		// does for the ADDs the agent serves.
		AgentForced: func(runDir string) Rules {
			if v := prepared.ReadForcedVariant(runDir); v != "" {
				return &iptables.Applier{Force: v}
			}
			return nil
		},
		// Set by the relay (istio-cni) when no node agent answered.
		FallbackReason: os.Getenv(cnirelay.FallbackReasonEnv),
		SkipAgentCache: os.Getenv(cnirelay.FallbackSkipAgentEnv) == "1",
		ProcessCPU:     processCPU,
		StoredPlans:    true,
	}
	err := skel.PluginMainFuncsWithError(skel.CNIFuncs{
		Add:    p.Add,
		Del:    p.Del,
		Check:  p.Check,
		Status: p.Status,
		GC:     p.GC,
	}, version.All, "istio-cni "+Version+": sidecar traffic redirection for Istio")
	code := 0
	if err != nil {
		log.Error("istio-cni failed", "code", err.Code, "error", err.Msg)
		_ = err.Print()
		code = 1
	}
	if sock := p.LogSocket(); sock != "" {
		// The run directory's log file, as Istio's plugin keeps it; only
		// into a run directory that exists (after a reboot it is made by
		// the agent).
		if dir := filepath.Dir(sock); dirExists(dir) {
			_ = log.WriteKept(logging.NewPluginFile(dir))
		}
		_ = log.Forward(sock, time.Second)
	}
	return code
}

// processCPU is this process's CPU time and that of the children it has
// waited for (iptables-restore), from the kernel's accounting.
func processCPU() time.Duration {
	var total time.Duration
	for _, who := range []int{unix.RUSAGE_SELF, unix.RUSAGE_CHILDREN} {
		var ru unix.Rusage
		if unix.Getrusage(who, &ru) == nil {
			total += time.Duration(ru.Utime.Nano() + ru.Stime.Nano())
		}
	}
	return total
}

func dirExists(dir string) bool {
	fi, err := os.Stat(dir)
	return err == nil && fi.IsDir()
}
