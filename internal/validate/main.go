package validate

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"net/netip"
	"os"
	"strconv"
	"strings"
	"time"

	"github.com/spf13/pflag"
)

// Main parses the arguments Istio's injector gives the istio-validation
// container and runs the probe. It returns the exit code: 0 when the rules
// are in place, 126 when not, 2 on bad usage.
func Main(args []string, stdout, stderr io.Writer) int {
	o, warnings, err := parseArgs(args, os.LookupEnv)
	for _, w := range warnings {
		fmt.Fprintf(stderr, "istio-cni-validate: %s\n", w)
	}
	if err != nil {
		if !errors.Is(err, pflag.ErrHelp) {
			fmt.Fprintf(stderr, "istio-cni-validate: %v\n", err)
		}
		return 2
	}
	if !o.runValidation {
		fmt.Fprintln(stderr, "istio-cni-validate only validates redirection (--run-validation); the rules are programmed by the istio-cni plugin")
		return 2
	}
	err = Run(context.Background(), Config{
		IPv6:        firstAddressIsIPv6(),
		ListenPorts: []int{o.proxyPort, o.inboundPort},
		ProbePort:   o.probePort,
		Timeout:     o.timeout,
		Interval:    time.Second,
		Log:         stdout,
	})
	if err != nil {
		fmt.Fprintf(stderr, "%v\n\n", err)
		if hint := uidHint(o, os.Getuid(), os.Getgid()); hint != "" {
			fmt.Fprintf(stderr, "%s\n\n", hint)
		}
		fmt.Fprint(stderr, "The pod started before its traffic redirection was set up: the istio-cni plugin was not yet "+
			"installed on this node when the pod's network was created, or it failed. The istio-cni node agent "+
			"repairs or restarts such pods; check its logs on this node (kubectl -n <ns> logs -l k8s-app=istio-cni-node).\n")
		return ExitValidationFailed
	}
	return 0
}

// options are what the probe reads of istio-iptables' command line.
type options struct {
	runValidation                     bool
	proxyPort, inboundPort, probePort int
	timeout                           time.Duration
	// proxyUID and proxyGID are -u and -g as given ("" when absent).
	proxyUID, proxyGID string
}

// parseArgs reads the command line as pilot-agent's istio-iptables does
// (cobra/pflag): flags and words may be mixed, every flag has Istio's long
// name beside its shorthand, and a flag that is absent is read from the
// environment under its upper-cased name (viper's AutomaticEnv), so
// PROBE_TIMEOUT in the proxy's metadata reaches the probe as it does
// Istio's. The injector's list starts with the subcommand's name
// (istio-iptables), which is skipped. Flags this command does not know are
// ignored with a warning rather than refused: a newer injector's template
// must not leave every pod failing with a usage error, which the repair
// controller does not act on.
func parseArgs(args []string, env func(string) (string, bool)) (options, []string, error) {
	fs := pflag.NewFlagSet("istio-cni-validate", pflag.ContinueOnError)
	fs.SetOutput(io.Discard)
	fs.ParseErrorsWhitelist.UnknownFlags = true
	str := map[string]*string{}
	for _, f := range []struct{ name, short string }{
		{"envoy-port", "p"}, {"inbound-capture-port", "z"}, {"inbound-tunnel-port", "e"},
		{"proxy-uid", "u"}, {"proxy-gid", "g"}, {"istio-inbound-interception-mode", "m"},
		{"istio-inbound-ports", "b"}, {"istio-local-exclude-ports", "d"}, {"istio-exclude-interfaces", "c"},
		{"istio-service-cidr", "i"}, {"istio-service-exclude-cidr", "x"}, {"istio-outbound-ports", "q"},
		{"istio-local-outbound-ports-exclude", "o"}, {"kube-virt-interfaces", "k"},
		{"istio-inbound-tproxy-mark", "t"}, {"istio-inbound-tproxy-route-table", "r"},
		{"iptables-probe-port", ""}, {"nftables-probe-port", ""}, {"probe-timeout", ""}, {"network-namespace", ""},
		// pilot-agent's logging flags.
		{"log_output_level", ""}, {"log_stacktrace_level", ""}, {"log_caller", ""}, {"log_target", ""},
		{"log_rotate", ""}, {"log_rotate_max_age", ""}, {"log_rotate_max_backups", ""}, {"log_rotate_max_size", ""},
		{"vklog", ""},
	} {
		str[f.name] = fs.StringP(f.name, f.short, "", "")
	}
	boolean := map[string]*bool{}
	for _, f := range []struct{ name, short string }{
		{"run-validation", ""}, {"skip-rule-apply", ""}, {"dry-run", "n"}, {"restore-format", "f"},
		{"iptables-trace-logging", ""}, {"nftables-trace-logging", ""}, {"redirect-dns", ""}, {"capture-all-dns", ""},
		{"drop-invalid", ""}, {"dual-stack", ""}, {"cni-mode", ""}, {"host-nsenter-exec", ""}, {"reconcile", ""},
		{"cleanup-only", ""}, {"force-apply", ""}, {"native-nftables", ""}, {"force-legacy-iptables", ""},
		{"log_as_json", ""},
	} {
		boolean[f.name] = fs.BoolP(f.name, f.short, false, "")
	}
	warnings := unknownFlags(fs, args)
	if err := fs.Parse(args); err != nil {
		return options{}, warnings, err
	}
	words := fs.Args()
	if len(words) > 0 && words[0] == "istio-iptables" {
		words = words[1:]
	}
	if len(words) > 0 {
		warnings = append(warnings, fmt.Sprintf("ignoring arguments that are not flags: %q", words))
	}
	// value is the flag as given, else its environment variable, else def.
	value := func(name, def string) (string, string) {
		if fs.Changed(name) {
			return *str[name], "--" + name
		}
		key := strings.ToUpper(strings.ReplaceAll(name, "-", "_"))
		if v, ok := env(key); ok && v != "" {
			return v, "environment variable " + key
		}
		return def, ""
	}
	var o options
	var errs []error
	port := func(name, def string) int {
		v, from := value(name, def)
		p, err := strconv.ParseUint(strings.TrimSpace(v), 10, 16)
		if err != nil || p == 0 {
			errs = append(errs, fmt.Errorf("%s=%q is not a port (1-65535)", from, v))
		}
		return int(p)
	}
	o.proxyPort = port("envoy-port", "15001")
	o.inboundPort = port("inbound-capture-port", "15006")
	o.probePort = port("iptables-probe-port", strconv.Itoa(DefaultProbePort))
	if fs.Changed("nftables-probe-port") && !fs.Changed("iptables-probe-port") {
		o.probePort = port("nftables-probe-port", "")
	}
	v, from := value("probe-timeout", DefaultTimeout.String())
	d, err := time.ParseDuration(v)
	if err != nil || d <= 0 {
		errs = append(errs, fmt.Errorf("%s=%q is not a positive duration (like 5s)", from, v))
	}
	o.timeout = d
	o.proxyUID, _ = value("proxy-uid", "")
	o.proxyGID, _ = value("proxy-gid", "")
	o.runValidation = *boolean["run-validation"]
	if !fs.Changed("run-validation") {
		if v, ok := env("RUN_VALIDATION"); ok {
			o.runValidation, _ = strconv.ParseBool(v)
		}
	}
	return o, warnings, errors.Join(errs...)
}

// unknownFlags names the flags in args that fs does not define, which
// pflag's parse skips without saying so.
func unknownFlags(fs *pflag.FlagSet, args []string) []string {
	var unknown, single []string
	for _, a := range args {
		if a == "--" {
			break
		}
		switch {
		case strings.HasPrefix(a, "--"):
			if name, _, _ := strings.Cut(a[2:], "="); fs.Lookup(name) == nil {
				unknown = append(unknown, a)
			}
		case len(a) > 1 && a[0] == '-' && (a[1] < '0' || a[1] > '9'):
			// A value such as -1s is not a flag.
			if name, _, _ := strings.Cut(a[1:], "="); len(name) > 1 && fs.Lookup(name) != nil {
				single = append(single, a)
			} else if fs.ShorthandLookup(a[1:2]) == nil {
				unknown = append(unknown, a)
			}
		}
	}
	var out []string
	if len(unknown) > 0 {
		out = append(out, fmt.Sprintf("ignoring flags istio-iptables' validation does not use here: %q", unknown))
	}
	if len(single) > 0 {
		// As cobra reads them, with Istio's pilot-agent too.
		out = append(out, fmt.Sprintf("long flags need two dashes: %q are read as shorthand flags with the rest as their value", single))
	}
	return out
}

// uidHint explains a failure that comes from running as a user other than
// the proxy's: the rules leave only the proxy uid's probe to be redirected,
// so any other uid fails although the rules are in place.
func uidHint(o options, uid, gid int) string {
	want := o.proxyUID
	if want == "" {
		want = "1337"
	}
	if strconv.Itoa(uid) == want {
		return ""
	}
	return fmt.Sprintf("This process runs as uid %d (gid %d), but the probe is redirected only when it runs as the proxy's uid %s (-u): "+
		"if the container's runAsUser differs from -u, the check fails even when the rules are in place.", uid, gid, want)
}

// firstAddressIsIPv6 decides the probe family as the plugin decides the
// rule families: by the pod's first global address.
func firstAddressIsIPv6() bool {
	addrs, err := net.InterfaceAddrs()
	if err != nil {
		return false
	}
	for _, a := range addrs {
		p, err := netip.ParsePrefix(a.String())
		if err != nil {
			continue
		}
		ip := p.Addr().Unmap()
		if ip.IsLoopback() || ip.IsLinkLocalUnicast() {
			continue
		}
		return ip.Is6()
	}
	return false
}
