package plugin

import (
	"bytes"
	"cmp"
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/containernetworking/cni/pkg/skel"
	"github.com/containernetworking/cni/pkg/types"
	current "github.com/containernetworking/cni/pkg/types/100"

	"github.com/istio-cni-go/istio-cni/internal/cnirelay"
	"github.com/istio-cni-go/istio-cni/internal/logging"
	"github.com/istio-cni-go/istio-cni/internal/nlsteps"
	"github.com/istio-cni-go/istio-cni/internal/nslock"
	"github.com/istio-cni-go/istio-cni/internal/podinfo"
	"github.com/istio-cni-go/istio-cni/internal/podnet"
	"github.com/istio-cni-go/istio-cni/internal/podrules"
	"github.com/istio-cni-go/istio-cni/internal/prepared"
	"github.com/istio-cni-go/istio-cni/internal/redirect"
	"github.com/istio-cni-go/istio-cni/internal/ruleset"
)

// Rules is what the plugin needs from a rule backend.
type Rules = podrules.Rules

// Plugin carries the plugin's dependencies; the cmd wires real ones.
type Plugin struct {
	Log    *logging.Logger
	Stdout io.Writer
	Rules  Rules
	// NFTables is the backend for native_nftables: true.
	NFTables Rules
	// AgentForced, when set, is the iptables backend forced to the
	// variant the node agent in the config's run directory forces, or nil
	// when it forces none: it replaces Rules.
	AgentForced func(runDir string) Rules
	// NewSource builds the pod source for a config and the pod's UID (the
	// agent's cache, then the API, by default).
	NewSource func(conf *Config, uid string) (podinfo.Source, error)
	// Ready, when set, answers STATUS (the node agent serving the command
	// in-process); nil means asking the agent over its socket.
	Ready func() error
	// Unprepared says why the relay did not serve the ADD from the pod's
	// prepared record though there was one; it goes into the log.
	Unprepared string
	// FallbackReason says why the relay ran this process instead of the
	// node agent; it goes into the log.
	FallbackReason string
	// StoredPlans makes an ADD that is not handed to Commit (the
	// fallback) send requests for the pod's plan instead of applying the
	// rules in place, where it has them: those the agent stored
	// (iptables: it then runs no iptables-restore), or, for a backend
	// that prepares them cheaply (nftables), its own.
	StoredPlans bool
	// ProcessCPU, when set (the plugin running as a process of its own,
	// the fallback), is that process's CPU so far with its children's
	// (iptables-restore); the ADD's line carries it as plugin_cpu, as the
	// agent's lines carry the relay's.
	ProcessCPU func() time.Duration
	// SkipAgentCache makes the default pod source read the API server
	// without asking the agent's pod cache first: the relay left the
	// agent because it did not answer.
	SkipAgentCache bool
	// Commit, when set, hands a redirected pod's rules, prepared as
	// netlink requests, to whoever sends them (the relay, for the agent),
	// with the result to print once they are in. A namespace the backend
	// cannot prepare for gets them applied here with Rules all the same.
	Commit func(txn *nlsteps.Txn, result []byte) (nlsteps.Outcome, error)
	// CommittedBy names, in the log, whom Commit has the rules sent by:
	// "plugin" (the relay) when empty.
	CommittedBy string
	// HandOverOnly makes an ADD that Commit cannot be handed fail with
	// ErrInPlace instead of applying the rules here: the relay may have
	// left for the fallback (cnirelay.Request.MayLeave), which must be
	// the only one to write to the namespace.
	HandOverOnly bool
	// Ambient, when set (the node agent in ambient mode), is asked first
	// on ADD: true means it enrolled the pod in the ambient mesh, which
	// then gets no sidecar rules; an error fails the ADD.
	Ambient func(ctx context.Context, a *K8sArgs) (bool, error)
	// AmbientCheck is Ambient's CHECK: true means the pod is enrolled
	// and its ambient redirection is as it should be; an error with true
	// names what differs, an error with false says the pod could not be
	// decided (it or its namespace could not be read).
	AmbientCheck func(ctx context.Context, a *K8sArgs) (bool, error)
	// Namespaces reads namespaces' labels when this process decides
	// ambient enrolment itself (the fallback); nil means the API server
	// with the agent's kubeconfig.
	Namespaces NamespaceReader

	// logSocket is the agent's log socket of the config last loaded, where
	// the lines of this run are forwarded at exit.
	logSocket string
}

// LogSocket returns the log socket of the config the command ran with
// ("" when the config did not parse).
func (p *Plugin) LogSocket() string { return p.logSocket }

// AgentPodPrefix is the name prefix of the node agent's own pods, which
// must start even when nothing can be looked up yet (after a reboot the
// kubeconfig only exists once the agent has run).
const AgentPodPrefix = "istio-cni-node-"

// Decision is the outcome of pod selection.
type Decision struct {
	// Skip, when not empty, says why the pod gets no rules.
	Skip   string
	Pod    *podinfo.Pod
	Params redirect.Params
	// Warnings are ignored inputs worth telling the operator about.
	Warnings []string
}

// Decide runs the selection in Istio's order. A pod lookup failure or an
// invalid annotation is an error: the pod must not start unmeshed.
func Decide(ctx context.Context, conf *Config, a *K8sArgs, newSource func(*Config, string) (podinfo.Source, error)) (*Decision, error) {
	ns, name := string(a.K8S_POD_NAMESPACE), string(a.K8S_POD_NAME)
	if skip := skipByName(conf, a); skip != "" {
		return &Decision{Skip: skip}, nil
	}
	src, err := newSource(conf, string(a.K8S_POD_UID))
	if err != nil {
		return nil, fmt.Errorf("cannot read pod %s/%s: %w", ns, name, err)
	}
	pod, err := src.GetPod(ctx, ns, name)
	if err != nil {
		return nil, fmt.Errorf("cannot read pod %s/%s from the API server: %w", ns, name, err)
	}
	d := &Decision{Pod: pod}
	if reason := Exclusion(pod); reason != "" {
		d.Skip = reason
		return d, nil
	}
	d.Params, d.Warnings, err = redirect.FromPod(pod)
	if err != nil {
		return nil, fmt.Errorf("pod %s/%s: %w", ns, name, err)
	}
	if d.Params.Mode == redirect.ModeNone {
		d.Skip = "interception mode NONE"
	}
	return d, nil
}

// skipByName says why a pod gets nothing, from its name alone ("" when
// it must be looked up): Istio's first checks, in its order, for both
// sidecar and ambient mode.
func skipByName(conf *Config, a *K8sArgs) string {
	ns, name := string(a.K8S_POD_NAMESPACE), string(a.K8S_POD_NAME)
	switch {
	case strings.HasPrefix(name, AgentPodPrefix) && ns == conf.PodNamespace && ns != "":
		return "the node agent's own pod"
	case ns == "" || name == "":
		return "not a Kubernetes pod"
	case slices.Contains(conf.ExcludeNamespaces, ns):
		return "namespace " + ns + " is excluded"
	}
	return ""
}

// Exclusion says why a pod gets no redirection ("" when it does), by
// Istio's checks a to f, in order.
func Exclusion(pod *podinfo.Pod) string {
	if _, ok := pod.FindContainer("istio-init"); ok {
		return "already has an istio-init container"
	}
	proxy, ok := pod.FindContainer(redirect.ProxyContainerName)
	if ok {
		if v, set := proxy.Env[redirect.EnvDisableEnvoy]; set {
			if b, err := strconv.ParseBool(v); err == nil && b {
				return "DISABLE_ENVOY is set on istio-proxy"
			}
		}
	} else {
		return fmt.Sprintf("no istio-proxy container (has %v)", pod.ContainerNames())
	}
	if len(proxy.Args) >= 2 && proxy.Args[0] == "proxy" && proxy.Args[1] != "sidecar" {
		return "proxy type " + proxy.Args[1]
	}
	inject, hasInject := pod.Annotations[redirect.AnnotationInject]
	if v, ok := pod.Labels[redirect.AnnotationInject]; ok {
		inject, hasInject = v, true
	}
	if hasInject {
		if b, err := strconv.ParseBool(inject); err == nil && !b {
			return "injection disabled by sidecar.istio.io/inject"
		}
	}
	if _, ok := pod.Annotations[redirect.AnnotationStatus]; !ok {
		return "no sidecar.istio.io/status annotation (not injected)"
	}
	return ""
}

// agentTimeout bounds a lookup in the agent's cache; past it the plugin
// asks the API server, so a wedged agent costs a pod this much at most.
const agentTimeout = 500 * time.Millisecond

// defaultSource asks the node agent's cache first (no API request per
// pod; not with skipAgent), then the API server with the agent's
// kubeconfig, bounded by the config's timeout and budget; with rw, a
// refused token is replaced by the next agent's (apiSource).
func defaultSource(log *slog.Logger, skipAgent bool, rw *rolloutWatch) func(*Config, string) (podinfo.Source, error) {
	return func(conf *Config, uid string) (podinfo.Source, error) {
		f := &podinfo.Fallback{API: func() (podinfo.Source, error) {
			return apiSource(conf, log, rw)
		}}
		if sock := conf.AgentSocketPath(); !skipAgent && fileExists(sock) {
			ac := podinfo.NewAgentClient(sock, agentTimeout)
			ac.UID = uid
			f.Agent = ac
			f.OnAgent = func(hit bool, err error) {
				if !hit {
					log.Debug("pod not served by the node agent; asking the API server", "reason", err.Error())
				}
			}
		}
		return f, nil
	}
}

// kubeconfigPoll is how often a plugin whose token the API server
// refused looks for the next agent's kubeconfig.
var kubeconfigPoll = 100 * time.Millisecond

// renewWithin is how recently a node agent must have stopped leaving the
// plugin in place (cnirelay.StoppedName) for a refused token to be waited
// on: an agent replaced in a rollout did, and with none that recent no
// new token is coming soon, so the pod fails at once, as it did, and the
// kubelet retries it.
const renewWithin = 5 * time.Minute

// rolloutWatch is what a fallback ADD learns of a rollout of the node
// agent: the agent socket as it was before the first API request, and
// whether the API server refused the old agent's token and a new
// kubeconfig came.
type rolloutWatch struct {
	start   time.Time
	sock    string
	before  os.FileInfo
	renewed bool
}

func newRolloutWatch(runDir string) *rolloutWatch {
	rw := &rolloutWatch{start: time.Now(), sock: filepath.Join(runDir, cnirelay.SocketName)}
	rw.before, _ = os.Stat(rw.sock)
	return rw
}

// agentCame says whether an agent's socket is there now that was not
// (missing, or a dead agent's) when the watch began.
func (rw *rolloutWatch) agentCame() bool { return cnirelay.AgentCame(rw.sock, rw.before) }

// waitAgent waits, within ctx, for a new agent's socket; errAgentStarted
// when it comes, so that the relay asks that agent.
func (rw *rolloutWatch) waitAgent(ctx context.Context) error {
	t := time.NewTicker(kubeconfigPoll)
	defer t.Stop()
	for !rw.agentCame() {
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-t.C:
		}
	}
	return errAgentStarted
}

// rolloutRecent says whether a node agent stopped leaving the plugin in
// place within renewWithin.
func rolloutRecent(runDir string) (bool, string) {
	fi, err := os.Stat(filepath.Join(runDir, cnirelay.StoppedName))
	switch {
	case err != nil:
		return false, "no node agent stopped for a rollout (" + cnirelay.StoppedName + " is missing)"
	case time.Since(fi.ModTime()) > renewWithin:
		return false, fmt.Sprintf("the last node agent stopped %s ago, so no rollout is under way", time.Since(fi.ModTime()).Round(time.Second))
	}
	return true, ""
}

// errAgentStarted ends the wait for a kubeconfig when a node agent
// started meanwhile: the relay that ran this fallback asks it instead.
var errAgentStarted = errors.New("a node agent started meanwhile (the plugin asks it)")

// apiSource reads pods from the API server with the agent's kubeconfig,
// bounded by the config's timeout and budget. With rw (an ADD), a token
// the API server refuses (its agent's pod is gone: istio-cni-node is
// being replaced) is replaced by the next kubeconfig written within the
// budget: the next agent writes its own before it serves anything, and
// the pod starts then rather than at the kubelet's next try of a failed
// sandbox. A new agent's socket ends the wait too: an agent that could
// not write the kubeconfig may still serve, and the relay asks it.
func apiSource(conf *Config, log *slog.Logger, rw *rolloutWatch) (podinfo.Source, error) {
	path := conf.KubeconfigPath()
	loaded, _ := os.Stat(path)
	c, err := podinfo.NewAPIClient(path, conf.CNIAgentRunDir)
	if err != nil {
		return nil, err
	}
	r := conf.Bounded(c)
	if rw == nil {
		return r, nil
	}
	r.Renew = func(ctx context.Context) (podinfo.Source, error) {
		if ok, why := rolloutRecent(conf.CNIAgentRunDir); !ok {
			return nil, errors.New(why + "; no new token is coming")
		}
		log.Info("the API server refused the node agent's token, which ends with the agent's pod; waiting for the next agent's kubeconfig",
			"kubeconfig", path, "within", conf.retryBudget.String())
		t := time.NewTicker(kubeconfigPoll)
		defer t.Stop()
		for {
			select {
			case <-ctx.Done():
				return nil, ctx.Err()
			case <-t.C:
			}
			// The kubeconfig first: the next agent writes it before its
			// socket, and a relay of an older release asks no agent again.
			if fi, err := os.Stat(path); err == nil && (loaded == nil || !sameVersion(fi, loaded)) {
				loaded = fi
				// A kubeconfig another writer left half-written parses at
				// the next change.
				next, err := podinfo.NewAPIClient(path, conf.CNIAgentRunDir)
				if err == nil {
					c.CloseIdleConnections()
					c = next
					rw.renewed = true
					log.Info("asking the API server again with the next kubeconfig", "kubeconfig", path)
					return next, nil
				}
				log.Debug("the next kubeconfig cannot be used yet", "error", err.Error())
			}
			if rw.agentCame() {
				return nil, errAgentStarted
			}
		}
	}
	return r, nil
}

// sameVersion says whether two stats are of one write of a file: the
// agent replaces its kubeconfig by a rename, another writer changes its
// time or size.
func sameVersion(a, b os.FileInfo) bool {
	return os.SameFile(a, b) && a.ModTime().Equal(b.ModTime()) && a.Size() == b.Size()
}

func fileExists(p string) bool {
	_, err := os.Stat(p)
	return err == nil
}

type request struct {
	conf  *Config
	args  *K8sArgs
	log   *slog.Logger
	rules Rules
}

func (p *Plugin) load(cmd string, args *skel.CmdArgs) (*request, error) {
	conf, err := ParseConfig(args.StdinData)
	if err != nil {
		var ce *ConfigError
		if errors.As(err, &ce) {
			return nil, types.NewError(types.ErrInvalidNetworkConfig, err.Error(), "")
		}
		return nil, types.NewError(types.ErrDecodingFailure, err.Error(), "")
	}
	p.logSocket = conf.LogSocketPath()
	// Istio's tooling writes many spellings of a level (scoped lists,
	// fatal, panic); none of them may fail a pod.
	lv, levelOK := logging.PluginLevel(conf.PluginLogLevel)
	p.Log.SetLevel(lv)
	k8s, err := ParseArgs(args.Args)
	if err != nil {
		return nil, types.NewError(types.ErrInvalidEnvironmentVariables, err.Error(), "")
	}
	log := p.Log.With("cmd", cmd, "pod", string(k8s.K8S_POD_NAMESPACE)+"/"+string(k8s.K8S_POD_NAME),
		"containerID", args.ContainerID)
	if p.Unprepared != "" {
		log = log.With("unprepared", p.Unprepared)
	}
	if p.FallbackReason != "" {
		lv := slog.LevelInfo
		if cmd != "ADD" && cmd != "CHECK" {
			lv = slog.LevelDebug
		}
		// Its lines reach the agent's log beside the agent's own.
		log = log.With("fallback", true)
		log.Log(context.Background(), lv, "served without the node agent", "reason", p.FallbackReason)
	}
	if !levelOK && logging.FirstTime("plugin_log_level", conf.PluginLogLevel) {
		log.Warn("plugin_log_level not understood; using "+logging.LevelName(lv), "plugin_log_level", conf.PluginLogLevel)
	}
	rules := p.Rules
	if p.AgentForced != nil {
		if r := p.AgentForced(conf.CNIAgentRunDir); r != nil {
			rules = r
		}
	}
	if conf.NativeNftables && p.NFTables != nil {
		rules = p.NFTables
	}
	return &request{conf: conf, args: k8s, log: log, rules: rules}, nil
}

func (p *Plugin) printResult(conf *Config) error {
	out, err := result(conf)
	if err != nil {
		return err
	}
	return out.PrintTo(p.Stdout)
}

// result is the previous result passed through, in the config's version.
func result(conf *Config) (types.Result, error) {
	var res types.Result
	if conf.PrevResult != nil {
		res = conf.PrevResult
	} else {
		res = &current.Result{CNIVersion: current.ImplementedSpecVersion}
	}
	out, err := res.GetAsVersion(conf.CNIVersion)
	if err != nil {
		return nil, types.NewError(types.ErrIncompatibleCNIVersion, fmt.Sprintf("converting result to %s: %v", conf.CNIVersion, err), "")
	}
	return out, nil
}

// ErrInPlace: the rules would have to be applied here, which a relay that
// may have left does not allow (Plugin.HandOverOnly).
var ErrInPlace = errors.New("the rules must be applied in place")

// ErrCommitterLeft: whom Commit hands the rules to stopped waiting for
// them (a relay that left for the fallback) and took none.
var ErrCommitterLeft = errors.New("the relay stopped waiting for the rules")

// Add decides and programs; on every success path the previous result is
// passed through unchanged.
func (p *Plugin) Add(args *skel.CmdArgs) error {
	start := time.Now()
	req, err := p.load("ADD", args)
	if err != nil {
		return err
	}
	if p.Ambient != nil && skipByName(req.conf, req.args) == "" {
		enrolled, err := p.Ambient(context.Background(), req.args)
		if err != nil {
			req.log.Error("pod blocked", "error", err.Error())
			return types.NewError(types.ErrTryAgainLater, err.Error(), "")
		}
		if enrolled {
			req.log.Info("enrolled in the ambient mesh", "duration", time.Since(start).String())
			return p.printResult(req.conf)
		}
	}
	rw := newRolloutWatch(req.conf.CNIAgentRunDir)
	d, err := Decide(context.Background(), req.conf, req.args, p.source(req.log, rw))
	if errors.Is(err, errAgentStarted) {
		// Not the pod's end: the relay that ran us asks the new agent.
		req.log.Info("the node agent started while the ADD waited for its token; handing the ADD back to the relay", "error", err.Error())
		return types.NewError(types.ErrTryAgainLater, err.Error(), "")
	}
	if err != nil {
		req.log.Error("pod blocked", "error", err.Error())
		return types.NewError(types.ErrTryAgainLater, err.Error(), "")
	}
	if req.conf.AmbientEnabled && p.Ambient == nil && d.Pod != nil {
		if err := p.refuseAmbient(context.Background(), req.conf, d.Pod, rw); err != nil {
			if errors.Is(err, errAgentStarted) {
				req.log.Info("the node agent started while the ADD waited for it; handing the ADD back to the relay")
			} else {
				req.log.Error("pod blocked", "error", err.Error())
			}
			return types.NewError(types.ErrTryAgainLater, err.Error(), "")
		}
	}
	decided := time.Now()
	for _, w := range d.Warnings {
		req.log.Warn(w)
	}
	if d.Skip != "" {
		req.log.Info("no redirection", "reason", d.Skip, "duration", time.Since(start).String())
		return p.printResult(req.conf)
	}
	var plan *ruleset.Plan
	var txn *nlsteps.Txn
	var inPlace string
	// The fallback sends requests where it has some for the pod's plan
	// (fb.txn), and says on its line where from or why not.
	var fb fallbackTxn
	// Every writer of a pod's rules holds the namespace's writers' lock
	// from reading the namespace to its rules being in: the agent (until
	// the relay it hands them to reports), the fallback, and a relay
	// serving the pod from its record (cnirelay). So two ADDs of one
	// namespace at once (a runtime's retry) never both find it fresh and
	// both send a fresh namespace's rules; the second finds ours. The
	// agent's own mutex serialises only its own work.
	defer LockWriters(req.log, req.conf.CNIAgentRunDir, args.Netns)()
	if p.StoredPlans && p.Commit == nil {
		fb = p.fallbackRequests(req, args.Netns, d.Params)
		plan = fb.plan
	}
	switch {
	case p.Commit != nil:
		plan, txn, inPlace, err = podrules.PreparePod(req.rules, args.Netns, d.Params)
	case plan == nil:
		plan, err = podrules.BuildPlan(req.rules, args.Netns, d.Params)
	}
	if err != nil {
		req.log.Error("pod blocked", "error", err.Error())
		return types.NewError(types.ErrInternal, fmt.Sprintf("pod %s/%s: %v", req.args.K8S_POD_NAMESPACE, req.args.K8S_POD_NAME, err), "")
	}
	planned := time.Now()
	if txn != nil {
		return p.commitElsewhere(req, d, plan, txn, start, decided, planned)
	}
	if p.Commit != nil && p.HandOverOnly {
		req.log.Info("rules not handed to the relay, which may have left: it runs the fallback", "why", inPlace)
		return fmt.Errorf("%w (%s)", ErrInPlace, inPlace)
	}
	var outcome string
	var applied time.Duration
	if fb.txn != nil {
		took, err := sendTxn(args.Netns, fb.txn)
		if err == nil {
			outcome, applied = fb.txn.Summary+" applied", took
		} else {
			// The namespace changed since it was read (rules made
			// meanwhile refuse the whole transaction): in place, as
			// without requests.
			req.log.Warn("the requests for the pod's plan were not taken; applying the rules in place", "from", fb.from, "error", err.Error())
			fb.why = "its send failed: " + err.Error()
		}
	}
	if outcome == "" {
		rep, err := req.rules.Apply(args.Netns, plan)
		if err != nil {
			req.log.Error("programming redirect rules failed", "error", err.Error())
			return types.NewError(types.ErrInternal, fmt.Sprintf("pod %s/%s: %v", req.args.K8S_POD_NAMESPACE, req.args.K8S_POD_NAME, err), "")
		}
		outcome, applied = rep.String(), time.Since(planned)
	}
	attrs := []any{"mode", string(d.Params.Mode), "ipv6", plan.V6 != nil,
		"result", outcome, "duration", time.Since(start).String(),
		"lookup", decided.Sub(start).String(), "plan", planned.Sub(decided).String(), "apply", applied.String()}
	if inPlace != "" {
		// Served for a relay that could have sent the rules itself.
		attrs = append(attrs, "committed_by", "agent", "why", inPlace)
	}
	attrs = append(attrs, fb.attrs()...)
	if p.ProcessCPU != nil {
		attrs = append(attrs, "plugin_cpu", p.ProcessCPU().String())
	}
	req.log.Info("redirect rules programmed", attrs...)
	return p.printResult(req.conf)
}

// fallbackTxn is what the fallback found to send for a pod's plan.
type fallbackTxn struct {
	plan *ruleset.Plan
	txn  *nlsteps.Txn
	// from is fromStored or fromHere: whose requests the fallback
	// looked for.
	from string
	// why there are none to send, or why they were not taken.
	why string
}

const (
	// fromStored: the requests the agent stored for the plan (iptables,
	// whose requests cost an iptables-restore to prepare).
	fromStored = "stored"
	// fromHere: requests the fallback prepared itself (nftables, whose
	// requests it records from the library's messages in a fraction of a
	// millisecond: far less than an in-place apply through a library
	// that waits for an echo of every message).
	fromHere = "here"
)

// attrs are the fallback's line's words on its requests.
func (f fallbackTxn) attrs() []any {
	key := "stored_plan"
	if f.from == fromHere {
		key = "prepared_here"
	}
	switch {
	case f.from == "":
		return nil
	case f.why != "":
		return []any{key, false, "why", f.why}
	case f.txn != nil:
		return []any{key, true}
	}
	return nil
}

// fallbackRequests is, for the fallback, requests to send for the pod's
// plan, with the plan it built on the way; or, with none, why not (and
// the plan when it got that far). A backend that prepares its requests
// cheaply (podrules.HerePreparer) has them prepared here; one whose
// requests cost a program to prepare has them from the agent's store;
// either only for a namespace that holds none of our rules.
// Whatever goes wrong on the way leaves the rules to be applied in place:
// the fallback is what serves pods when nothing else does.
func (p *Plugin) fallbackRequests(req *request, netnsPath string, params redirect.Params) fallbackTxn {
	if _, ok := req.rules.(podrules.HerePreparer); ok {
		f := fallbackTxn{from: fromHere}
		var err error
		f.plan, f.txn, f.why, err = podrules.PrepareToSend(req.rules, netnsPath, params)
		if err != nil {
			return fallbackTxn{from: fromHere, why: "preparing the requests: " + err.Error()}
		}
		return f
	}
	if _, ok := req.rules.(podrules.StoredPreparer); !ok {
		return fallbackTxn{}
	}
	f := fallbackTxn{from: fromStored}
	dir := filepath.Join(req.conf.CNIAgentRunDir, prepared.DirName)
	if _, err := os.Lstat(dir); err != nil {
		f.why = "no prepared directory (no agent that prepares ahead)"
		return f
	}
	var err error
	f.plan, f.txn, f.why, err = podrules.PrepareFromStore(req.rules, dir, netnsPath, params)
	if err != nil {
		return fallbackTxn{from: fromStored, why: "reading the namespace: " + err.Error()}
	}
	return f
}

// UnlockedWarning is logged for an ADD that writes a pod's rules without
// the namespace's writers' lock: two writers of one namespace at once
// may then both find it fresh, and the kernel refuses the second's rules.
const UnlockedWarning = "the namespace's writers' lock could not be taken; writing the pod's rules without it"

// LockWriters takes the writers' lock of the namespace at netnsPath
// under runDir (nslock.LockWriters) and returns its release: the ADD's
// (agent or fallback) and repair's. A namespace that cannot be opened is
// left unlocked (the backend reports it), and one whose lock cannot be
// taken is left unlocked with a warning: the write goes on as it would
// without the lock.
func LockWriters(log *slog.Logger, runDir, netnsPath string) (unlock func()) {
	netns, err := os.Open(netnsPath) //nolint:gosec // G304: the runtime's netns path, as every backend opens it
	if err != nil {
		return func() {}
	}
	defer netns.Close()
	unlock, err = nslock.LockWriters(runDir, netns)
	if err != nil {
		log.Warn(UnlockedWarning, "netns", netnsPath, "error", err.Error())
		return func() {}
	}
	return unlock
}

// sendTxn sends the requests for the pod's plan from inside the pod's
// namespace, as a relay sends a record's.
func sendTxn(netnsPath string, txn *nlsteps.Txn) (time.Duration, error) {
	netns, err := os.Open(netnsPath) //nolint:gosec // G304: the runtime's netns path, as every backend opens it
	if err != nil {
		return 0, err
	}
	defer netns.Close()
	return nlsteps.RunIn(netns, txn)
}

// commitElsewhere hands the pod's prepared requests to p.Commit and logs
// what the sender reports, as Add logs its own apply.
func (p *Plugin) commitElsewhere(req *request, d *Decision, plan *ruleset.Plan, txn *nlsteps.Txn, start, decided, planned time.Time) error {
	res, err := result(req.conf)
	if err != nil {
		return err
	}
	var out bytes.Buffer
	if err := res.PrintTo(&out); err != nil {
		return types.NewError(types.ErrInternal, err.Error(), "")
	}
	pod := string(req.args.K8S_POD_NAMESPACE) + "/" + string(req.args.K8S_POD_NAME)
	a, err := p.Commit(txn, out.Bytes())
	if errors.Is(err, ErrCommitterLeft) {
		req.log.Info("the relay stopped waiting; the fallback serves the pod", "duration", time.Since(start).String(),
			"lookup", decided.Sub(start).String(), "plan", planned.Sub(decided).String())
		return err
	}
	if err != nil {
		req.log.Error("the plugin process did not report sending the redirect rules", "error", err.Error(),
			"duration", time.Since(start).String())
		return types.NewError(types.ErrInternal, fmt.Sprintf("pod %s: %v", pod, err), "")
	}
	by := cmp.Or(p.CommittedBy, "plugin")
	if a.Error != "" {
		req.log.Error("programming redirect rules failed", "error", a.Error, "committed_by", by)
		return types.NewError(types.ErrInternal, fmt.Sprintf("pod %s: %s", pod, a.Error), "")
	}
	attrs := []any{"mode", string(d.Params.Mode), "ipv6", plan.V6 != nil,
		"result", txn.Summary + " applied", "duration", time.Since(start).String(), "lookup", decided.Sub(start).String(),
		"plan", planned.Sub(decided).String(), "apply", a.Took.String(), "committed_by", by}
	if a.CPU != 0 {
		attrs = append(attrs, "plugin_cpu", a.CPU.String())
	}
	req.log.Info("redirect rules programmed", attrs...)
	return nil
}

// Del succeeds without touching the namespace, as Istio's plugin does:
// the rules live in the pod's own namespace, which the runtime destroys
// right after DEL, so removing them would only slow every pod's teardown.
// A later ADD on the same namespace replaces whatever is there. DEL never
// fails for a namespace that is gone or a pod that was never redirected.
//
// Nor does it fail on a config or arguments an ADD would refuse: Istio's
// DEL reads neither, and a failed DEL keeps the pod Terminating.
func (p *Plugin) Del(args *skel.CmdArgs) error {
	req, err := p.load("DEL", args)
	if err != nil {
		p.Log.Warn("DEL: config or arguments not understood; nothing to remove, so it succeeds", "error", err.Error())
		return nil
	}
	req.log.Debug("pod deleted; its rules go with its network namespace")
	return nil
}

// Check verifies that a redirected pod's rules are all in place. Where
// it cannot tell, it succeeds, as Istio's CHECK always does: CRI-O runs
// CHECK while it creates every sandbox and tears the sandbox down when it
// fails, so a CHECK stricter than the ADD before it would fail pods the
// ADD set up. So a pod that gets no rules from us passes without a look
// at its namespace (its istio-init may have written Istio's chains, and a
// node that meshes no pod may lack iptables), and so does a pod that
// cannot be read again right now (the ADD read it moments ago).
func (p *Plugin) Check(args *skel.CmdArgs) error {
	req, err := p.load("CHECK", args)
	if err != nil {
		return err
	}
	if req.conf.PrevResult == nil {
		return types.NewError(types.ErrInvalidNetworkConfig, "CHECK needs prevResult: istio-cni must be chained after the primary plugin", "")
	}
	if p.AmbientCheck != nil && skipByName(req.conf, req.args) == "" {
		enrolled, err := p.AmbientCheck(context.Background(), req.args)
		if err != nil && !enrolled {
			req.log.Warn("check skipped: the pod could not be decided", "error", err.Error())
			return nil
		}
		if err != nil {
			req.log.Error("check failed", "error", err.Error())
			return types.NewError(types.ErrInternal, fmt.Sprintf("pod %s/%s: %v", req.args.K8S_POD_NAMESPACE, req.args.K8S_POD_NAME, err), "")
		}
		if enrolled {
			return nil
		}
	}
	d, err := Decide(context.Background(), req.conf, req.args, p.source(req.log, nil))
	if err != nil {
		req.log.Warn("check skipped: the pod could not be read", "error", err.Error())
		return nil
	}
	if d.Skip != "" {
		// Ambient mode's pods among them: a pod that gets sidecar rules
		// has the injector's status annotation, which ambient mode never
		// enrols. An enrolled pod's redirection is checked above when the
		// agent serves; the fallback can tell no more than Istio's plugin.
		req.log.Debug("check: the pod gets no rules from istio-cni's sidecar mode", "reason", d.Skip)
		return nil
	}
	want, err := podrules.BuildPlan(req.rules, args.Netns, d.Params)
	if err != nil {
		return types.NewError(types.ErrInternal, err.Error(), "")
	}
	if err := req.rules.Check(args.Netns, want); err != nil {
		var m *podnet.MismatchError
		if !errors.As(err, &m) {
			// The rules could not be read (the host's iptables tools
			// missing or failing), which says nothing of them: the ADD
			// before may well have sent them without those tools.
			req.log.Warn("check skipped: the pod's rules could not be read", "error", err.Error())
			return nil
		}
		req.log.Error("check failed", "error", err.Error())
		return types.NewError(types.ErrInternal, fmt.Sprintf("pod %s/%s: %v", req.args.K8S_POD_NAMESPACE, req.args.K8S_POD_NAME, err), "")
	}
	return nil
}

// source is where the plugin reads the pod from; with rw (an ADD), it
// waits within the budget for another agent's token where its own is
// refused. A CHECK does not wait: it passes a pod it cannot read.
func (p *Plugin) source(log *slog.Logger, rw *rolloutWatch) func(*Config, string) (podinfo.Source, error) {
	if p.NewSource != nil {
		return p.NewSource
	}
	return defaultSource(log, p.SkipAgentCache, rw)
}

// Status (CNI 1.1) fails only when an ADD could not be served; the
// caller that runs the plugin in-process says so through Ready.
func (p *Plugin) Status(args *skel.CmdArgs) error {
	if _, err := p.load("STATUS", args); err != nil {
		return err
	}
	if p.Ready != nil {
		if err := p.Ready(); err != nil {
			return types.NewError(errPluginNotAvailable, "istio-cni node agent not ready: "+err.Error(), "")
		}
		return nil
	}
	// This process is the fallback and serves an ADD itself (failing
	// closed for pods it cannot look up), whatever sockets a dead agent
	// left: STATUS fails only when no one could serve, which the relay
	// decides before it would run us.
	return nil
}

// GC has nothing to collect: sidecar rules live and die with the pod's
// network namespace. As DEL, it succeeds on a config an ADD would refuse.
func (p *Plugin) GC(args *skel.CmdArgs) error {
	if _, err := p.load("GC", args); err != nil {
		p.Log.Warn("GC: config not understood; nothing to collect, so it succeeds", "error", err.Error())
	}
	return nil
}

// errPluginNotAvailable is CNI 1.1's STATUS code 50: the plugin cannot
// service ADD requests.
const errPluginNotAvailable uint = 50
