package agent

import (
	"context"
	"fmt"
	"log/slog"
	"os"
	"os/signal"
	"syscall"

	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/rest"
	"k8s.io/client-go/tools/clientcmd"
)

// Exit codes of install-cni.
const (
	ExitOK       = 0
	ExitFailure  = 1
	ExitBadUsage = 2
)

// Main runs the node agent and returns its exit code.
func Main(args []string) int {
	log := slog.New(slog.NewJSONHandler(os.Stderr, nil))
	opts, err := ParseOptions(args, os.Getenv)
	if err != nil {
		log.Error("invalid configuration", "error", err.Error())
		return ExitBadUsage
	}
	log.Info("starting install-cni", "options", fmt.Sprintf("%+v", *opts))
	a := New(opts, log, os.Getenv)
	if cs, err := clientset(opts); err != nil {
		log.Warn("no API access: termination will always remove the plugin", "error", err.Error())
	} else {
		a.Clientset = cs
		a.DaemonSetPresent = func(ctx context.Context) (bool, error) {
			ds, err := cs.AppsV1().DaemonSets(opts.PodNamespace).Get(ctx, opts.DaemonSetName, metav1.GetOptions{})
			// An uninstall removes the agent's RBAC and service account with
			// the DaemonSet: a refused read means the release is going away.
			if apierrors.IsNotFound(err) || apierrors.IsForbidden(err) || apierrors.IsUnauthorized(err) {
				return false, nil
			}
			if err != nil {
				return false, err
			}
			return ds.DeletionTimestamp == nil, nil
		}
	}
	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGTERM, syscall.SIGINT)
	defer stop()
	if err := a.Run(ctx); err != nil {
		log.Error("install-cni failed", "error", err.Error())
		return ExitFailure
	}
	return ExitOK
}

func clientset(opts *Options) (kubernetes.Interface, error) {
	var cfg *rest.Config
	var err error
	if opts.Kubeconfig != "" {
		cfg, err = clientcmd.BuildConfigFromFlags("", opts.Kubeconfig)
	} else {
		cfg, err = rest.InClusterConfig()
	}
	if err != nil {
		return nil, err
	}
	return kubernetes.NewForConfig(cfg)
}
