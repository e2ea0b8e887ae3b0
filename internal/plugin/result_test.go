package plugin

import (
	"bytes"
	"encoding/json"
	"fmt"
	"net/netip"
	"os"
	"testing"

	"github.com/containernetworking/cni/pkg/skel"

	"github.com/istio-cni-go/istio-cni/internal/logging"
	"github.com/istio-cni-go/istio-cni/internal/nlsteps"
	"github.com/istio-cni-go/istio-cni/internal/nsfacts"
	"github.com/istio-cni-go/istio-cni/internal/podinfo"
	"github.com/istio-cni-go/istio-cni/internal/podnet"
	"github.com/istio-cni-go/istio-cni/internal/podrules"
	"github.com/istio-cni-go/istio-cni/internal/ruleset"
)

type fakeRules struct{ applied int }

func (f *fakeRules) Apply(string, *ruleset.Plan) (podnet.Report, error) {
	f.applied++
	return podnet.Report{}, nil
}
func (f *fakeRules) Check(string, *ruleset.Plan) error { return nil }

// A fake that stopped matching the interface would silently turn
// every ADD into an in-place apply.
var _ podrules.Preparer = (*fakeRules)(nil)

// Examine finds every namespace fit for prepared rules.
func (f *fakeRules) Examine(string) (nsfacts.Facts, string, error) {
	return nsfacts.Facts{Addrs: []netip.Addr{netip.MustParseAddr("10.0.0.2")}}, "", nil
}

// PrepareFresh serves a relay that sends the rules: a transaction of one
// message, never sent anywhere.
func (f *fakeRules) PrepareFresh(nsfacts.Facts, *ruleset.Plan) (*nlsteps.Txn, string, error) {
	s := nlsteps.Step{Proto: 12}
	s.Add(1, 0, nil, "nothing")
	return &nlsteps.Txn{Steps: []nlsteps.Step{s}}, "", nil
}
func (f *fakeRules) PodAddrs(string) ([]netip.Addr, error) {
	return []netip.Addr{netip.MustParseAddr("10.0.0.2")}, nil
}

func prevResultFor(version string) string {
	if version == "0.1.0" || version == "0.2.0" {
		return `{"cniVersion":"` + version + `","ip4":{"ip":"10.0.0.2/24","gateway":"10.0.0.1"},"dns":{}}`
	}
	return `{"cniVersion":"` + version + `","interfaces":[{"name":"eth0","mac":"0a:58:0a:00:00:02","sandbox":"/var/run/netns/x"}],` +
		`"ips":[{"address":"10.0.0.2/24","gateway":"10.0.0.1","interface":0}],"routes":[{"dst":"0.0.0.0/0"}]}`
}

// TestAddPassesPrevResultThrough runs ADD for a redirected and a skipped
// pod at every spec version and compares the output with prevResult.
func TestAddPassesPrevResultThrough(t *testing.T) {
	versions := []string{"0.1.0", "0.2.0", "0.3.0", "0.3.1", "0.4.0", "1.0.0", "1.1.0"}
	for _, v := range versions {
		for _, podNS := range []string{"default", "kube-system"} {
			t.Run(v+"/"+podNS, func(t *testing.T) {
				prev := prevResultFor(v)
				if v == "0.3.0" || v == "0.3.1" || v == "0.4.0" {
					prev = fmt.Sprintf(`{"cniVersion":%q,"interfaces":[{"name":"eth0","mac":"0a:58:0a:00:00:02","sandbox":"/var/run/netns/x"}],"ips":[{"version":"4","address":"10.0.0.2/24","gateway":"10.0.0.1","interface":0}],"routes":[{"dst":"0.0.0.0/0"}],"dns":{}}`, v)
				}
				conf := fmt.Sprintf(`{"cniVersion":%q,"name":"k8s-pod-network","type":"istio-cni","exclude_namespaces":["kube-system"],"prevResult":%s}`, v, prev)
				var out bytes.Buffer
				rules := &fakeRules{}
				p := &Plugin{Log: logging.New(os.Stderr), Stdout: &out, Rules: rules,
					NewSource: func(*Config, string) (podinfo.Source, error) { return &fakeSource{pod: injected(nil)}, nil }}
				err := p.Add(&skel.CmdArgs{ContainerID: "c1", Netns: "/var/run/netns/x", IfName: "eth0",
					Args: "IgnoreUnknown=1;K8S_POD_NAMESPACE=" + podNS + ";K8S_POD_NAME=web", StdinData: []byte(conf)})
				if err != nil {
					t.Fatal(err)
				}
				if want := map[string]int{"default": 1, "kube-system": 0}[podNS]; rules.applied != want {
					t.Fatalf("applied %d times, want %d", rules.applied, want)
				}
				var got, want any
				if err := json.Unmarshal(out.Bytes(), &got); err != nil {
					t.Fatalf("output %q: %v", out.String(), err)
				}
				_ = json.Unmarshal([]byte(prev), &want)
				gj, _ := json.Marshal(got)
				wj, _ := json.Marshal(want)
				if !bytes.Equal(gj, wj) {
					t.Fatalf("result changed:\n got %s\nwant %s", gj, wj)
				}
			})
		}
	}
}

func TestAddWithoutPrevResultPrintsEmptyResult(t *testing.T) {
	var out bytes.Buffer
	p := &Plugin{Log: logging.New(os.Stderr), Stdout: &out, Rules: &fakeRules{}}
	err := p.Add(&skel.CmdArgs{ContainerID: "c1", Netns: "/x", IfName: "eth0", Args: "",
		StdinData: []byte(`{"cniVersion":"1.0.0","name":"n","type":"istio-cni"}`)})
	if err != nil {
		t.Fatal(err)
	}
	var res map[string]any
	if err := json.Unmarshal(out.Bytes(), &res); err != nil || res["cniVersion"] != "1.0.0" || len(res) != 1 {
		t.Fatalf("want an empty 1.0.0 result, got %s (%v)", out.String(), err)
	}
}
