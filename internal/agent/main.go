package agent

import (
	"context"
	"errors"
	"fmt"
	"os"
	"os/signal"
	"syscall"

	"k8s.io/client-go/rest"
	"k8s.io/client-go/tools/clientcmd"

	"github.com/istio-cni-go/istio-cni/internal/kubeclient"
	"github.com/istio-cni-go/istio-cni/internal/logging"
	"github.com/istio-cni-go/istio-cni/internal/version"
)

// Exit codes of install-cni.
const (
	ExitOK       = 0
	ExitFailure  = 1
	ExitBadUsage = 2
)

// Main runs the node agent and returns its exit code.
func Main(args []string) int {
	if len(args) > 0 && args[0] == "version" {
		return version.Command(args[1:], os.Stdout, os.Stderr)
	}
	// Cobra's `help` subcommand, which Istio's install-cni has.
	if len(args) > 0 && args[0] == "help" {
		args = []string{"--help"}
	}
	cfg, err := ParseOptions(args, os.LookupEnv)
	if errors.Is(err, ErrHelp) {
		return ExitOK
	}
	if err != nil {
		fmt.Fprintf(os.Stderr, "install-cni: invalid configuration: %v\n", err)
		return ExitBadUsage
	}
	logs, err := logging.Open(cfg.Log, os.Stdout, os.Stderr)
	if err != nil {
		fmt.Fprintf(os.Stderr, "install-cni: %v\n", err)
		return ExitBadUsage
	}
	defer logs.Close()
	log := logs.Logger(logging.ScopeAgent)
	for _, p := range logs.Problems {
		log.Warn("logging option not understood or not usable", "problem", p)
	}
	// The plugin's level is written into its config entry.
	level := &cfg.Loop.Install.Entry.LogLevel
	if cfg.PluginLogLevelSet {
		lv, ok := logging.PluginLevel(*level)
		if !ok {
			log.Warn("plugin-log-level not understood; using "+logging.LevelName(lv), "value", *level)
		}
		*level = logging.LevelName(lv)
	} else {
		*level = logging.LevelName(logs.Level(logging.ScopePlugin))
	}
	for _, n := range cfg.Notes {
		log.Warn(n)
	}
	log.Info("starting install-cni", "version", version.Get().String(), "logLevel", logging.LevelName(logs.Level(logging.ScopeAgent)),
		"pluginLogLevel", *level, "options", fmt.Sprintf("%+v", *cfg))
	a := New(cfg, log)
	a.PluginLog = logs.Logger(logging.ScopePlugin)
	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGTERM, syscall.SIGINT)
	defer stop()
	// With API access, Run also watches the DaemonSet to tell an upgrade
	// from an uninstall at termination.
	if cs, err := apiClient(cfg); err != nil {
		log.Warn("no API access: termination will always remove the plugin", "error", err.Error())
	} else {
		a.Clientset, a.Namespaces = cs, cs.Namespaces()
	}
	if err := a.Run(ctx); err != nil {
		log.Error("install-cni failed", "error", err.Error())
		return ExitFailure
	}
	return ExitOK
}

func apiClient(cfg *Config) (*kubeclient.Client, error) {
	rc, err := restConfig(cfg)
	if err != nil {
		return nil, err
	}
	return kubeclient.New(rc)
}

func restConfig(cfg *Config) (*rest.Config, error) {
	var rc *rest.Config
	var err error
	if cfg.Kubeconfig != "" {
		rc, err = clientcmd.BuildConfigFromFlags("", cfg.Kubeconfig)
	} else {
		rc, err = rest.InClusterConfig()
	}
	if err != nil {
		return nil, err
	}
	rc.QPS, rc.Burst = APIQPS, APIBurst
	return rc, nil
}

// The agent's API request rate, Istio's node agent's: client-go's default
// (5 per second, bursts of 10) held each pod's enrolment in ambient mode
// to 0.3 s once a few pods had been labelled in a row, and would do the
// same to repair's writes.
const (
	APIQPS   = 80
	APIBurst = 160
)
