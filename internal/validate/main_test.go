package validate

import (
	"strings"
	"testing"
	"time"

	"github.com/istio-cni-go/istio-cni/internal/testenv"
)

func noEnv(string) (string, bool) { return "", false }

func envOf(m map[string]string) func(string) (string, bool) {
	return func(k string) (string, bool) { v, ok := m[k]; return v, ok }
}

func TestParseInjectorArgs(t *testing.T) {
	args := testenv.InjectedValidationArgs()
	if args[0] != "istio-iptables" {
		t.Fatalf("fixture does not start with the subcommand: %q", args)
	}
	o, warnings, err := parseArgs(args, noEnv)
	if err != nil || len(warnings) != 0 {
		t.Fatalf("the injector's arguments: err %v, warnings %q", err, warnings)
	}
	want := options{runValidation: true, proxyPort: 15001, inboundPort: 15006, probePort: 15002, timeout: 5 * time.Second, proxyUID: "1337"}
	if o != want {
		t.Fatalf("got %+v, want %+v", o, want)
	}
}

func TestParseIstioForms(t *testing.T) {
	for _, tc := range []struct {
		name string
		args []string
		env  map[string]string
		want func(o options) bool
	}{
		{"long names", []string{"--envoy-port=16001", "--inbound-capture-port", "16006", "--proxy-uid", "1400", "--run-validation"}, nil,
			func(o options) bool {
				return o.proxyPort == 16001 && o.inboundPort == 16006 && o.proxyUID == "1400" && o.runValidation
			}},
		{"attached shorthand", []string{"-p16001", "-z16006", "--run-validation"}, nil,
			func(o options) bool { return o.proxyPort == 16001 && o.inboundPort == 16006 }},
		{"probe port and timeout", []string{"--run-validation", "--iptables-probe-port", "15999", "--probe-timeout=2s"}, nil,
			func(o options) bool { return o.probePort == 15999 && o.timeout == 2*time.Second }},
		{"nftables probe port", []string{"--run-validation", "--nftables-probe-port=15998", "--native-nftables"}, nil,
			func(o options) bool { return o.probePort == 15998 }},
		{"environment as viper", []string{"--run-validation"}, map[string]string{"PROBE_TIMEOUT": "9s", "IPTABLES_PROBE_PORT": "15997", "ENVOY_PORT": "16001"},
			func(o options) bool {
				return o.timeout == 9*time.Second && o.probePort == 15997 && o.proxyPort == 16001
			}},
		{"flag beats environment", []string{"--run-validation", "--probe-timeout", "1s"}, map[string]string{"PROBE_TIMEOUT": "9s"},
			func(o options) bool { return o.timeout == time.Second }},
		{"every rule flag Istio has", []string{"istio-iptables", "-e", "15008", "-n", "-f", "--dual-stack", "--drop-invalid", "--iptables-trace-logging",
			"--network-namespace", "/var/run/netns/x", "--cni-mode", "--host-nsenter-exec", "--force-apply", "--reconcile", "--cleanup-only",
			"--redirect-dns", "--capture-all-dns", "-q", "80", "-o", "3306", "-k", "eth1", "-c", "eth2", "-t", "1337", "-r", "133",
			"--log_as_json", "--log_caller", "default", "--run-validation", "--skip-rule-apply"}, nil,
			func(o options) bool { return o.runValidation && o.proxyPort == 15001 }},
	} {
		t.Run(tc.name, func(t *testing.T) {
			o, warnings, err := parseArgs(tc.args, envOf(tc.env))
			if err != nil || len(warnings) != 0 {
				t.Fatalf("err %v, warnings %q", err, warnings)
			}
			if !tc.want(o) {
				t.Fatalf("parsed %+v", o)
			}
		})
	}
}

func TestParseUnknownAndWordsWarned(t *testing.T) {
	o, warnings, err := parseArgs([]string{"istio-iptables", "--some-future-flag=x", "-Y", "--run-validation", "stray"}, noEnv)
	if err != nil || !o.runValidation {
		t.Fatalf("err %v, %+v", err, o)
	}
	joined := strings.Join(warnings, "\n")
	for _, want := range []string{"--some-future-flag=x", "-Y", "stray"} {
		if !strings.Contains(joined, want) {
			t.Fatalf("warnings %q do not name %s", warnings, want)
		}
	}
}

func TestParseRefusesBadValues(t *testing.T) {
	for _, tc := range []struct {
		args []string
		env  map[string]string
		want string
	}{
		{[]string{"-p", "70000"}, nil, `--envoy-port="70000"`},
		{[]string{"-z", "http"}, nil, `--inbound-capture-port="http"`},
		{[]string{"--probe-timeout", "-1s"}, nil, `--probe-timeout="-1s"`},
		{nil, map[string]string{"PROBE_TIMEOUT": "soon"}, `environment variable PROBE_TIMEOUT="soon"`},
	} {
		_, _, err := parseArgs(append(tc.args, "--run-validation"), envOf(tc.env))
		if err == nil || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("%q %v: err %v, want one naming %s", tc.args, tc.env, err, tc.want)
		}
	}
	if code := Main([]string{"-p", "0", "--run-validation"}, new(strings.Builder), new(strings.Builder)); code != 2 {
		t.Fatalf("a bad port: exit %d, want 2", code)
	}
}

func TestUIDHint(t *testing.T) {
	if h := uidHint(options{proxyUID: "1337"}, 1337, 1337); h != "" {
		t.Fatalf("hint for the proxy uid: %s", h)
	}
	if h := uidHint(options{proxyUID: "1337"}, 1000, 1000); !strings.Contains(h, "uid 1000") || !strings.Contains(h, "uid 1337") {
		t.Fatalf("hint %q does not name both uids", h)
	}
	if h := uidHint(options{}, 1337, 1337); h != "" {
		t.Fatalf("-u absent defaults to 1337: %s", h)
	}
}

// TestParseWarnsSingleDashLongFlags: -run-validation reads as -r with the
// value "un-validation" (as in cobra), which the warning says; a negative
// value is not taken for a flag.
func TestParseWarnsSingleDashLongFlags(t *testing.T) {
	_, warnings, _ := parseArgs([]string{"-run-validation", "-probe-timeout=2s"}, noEnv)
	if joined := strings.Join(warnings, "\n"); !strings.Contains(joined, "two dashes") || !strings.Contains(joined, "-run-validation") ||
		!strings.Contains(joined, "-probe-timeout=2s") {
		t.Fatalf("warnings %q", warnings)
	}
	_, warnings, err := parseArgs([]string{"--run-validation", "--probe-timeout", "-1s"}, noEnv)
	if len(warnings) != 0 || err == nil {
		t.Fatalf("a negative timeout: warnings %q, err %v (want no warning, an error)", warnings, err)
	}
}
