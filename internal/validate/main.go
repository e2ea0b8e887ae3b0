package validate

import (
	"context"
	"flag"
	"fmt"
	"io"
	"net"
	"net/netip"
	"time"
)

// Main parses the arguments Istio's injector gives the istio-validation
// container (istio-iptables flags) and runs the probe. It returns the
// exit code: 0 when the rules are in place, 126 when not, 2 on bad usage.
func Main(args []string, stdout, stderr io.Writer) int {
	fs := flag.NewFlagSet("istio-cni-validate", flag.ContinueOnError)
	fs.SetOutput(stderr)
	proxyPort := fs.Int("p", 15001, "outbound capture port of the proxy")
	inboundPort := fs.Int("z", 15006, "inbound capture port of the proxy")
	timeout := fs.Duration("probe-timeout", 5*time.Second, "how long to wait for a redirected probe")
	runValidation := fs.Bool("run-validation", false, "probe the rules (the only supported mode)")
	// Accepted for compatibility with the injector's command line; the
	// rules themselves are the CNI plugin's business.
	for _, name := range []string{"u", "g", "m", "i", "x", "b", "d", "q", "o", "k", "c", "t", "log_output_level", "iptables-probe-port", "r"} {
		fs.String(name, "", "accepted for compatibility, ignored")
	}
	for _, name := range []string{"skip-rule-apply", "log_as_json", "native-nftables", "redirect-dns", "capture-all-dns", "dry-run"} {
		fs.Bool(name, false, "accepted for compatibility, ignored")
	}
	if err := fs.Parse(args); err != nil {
		return 2
	}
	if !*runValidation {
		fmt.Fprintln(stderr, "istio-cni-validate only validates redirection (--run-validation); the rules are programmed by the istio-cni plugin")
		return 2
	}
	err := Run(context.Background(), Config{
		IPv6:        firstAddressIsIPv6(),
		ListenPorts: []int{*proxyPort, *inboundPort},
		Timeout:     *timeout,
		Interval:    time.Second,
		Log:         stdout,
	})
	if err != nil {
		fmt.Fprintf(stderr, "%v\n\nThe pod started before its traffic redirection was set up: the istio-cni plugin was not yet "+
			"installed on this node when the pod's network was created, or it failed. The istio-cni node agent "+
			"repairs or restarts such pods; check its logs on this node (kubectl -n <ns> logs -l k8s-app=istio-cni-node).\n", err)
		return ExitValidationFailed
	}
	return 0
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
