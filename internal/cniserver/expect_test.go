package cniserver

import (
	"bytes"
	"context"
	"encoding/json"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/containernetworking/cni/libcni"
	"github.com/containernetworking/cni/pkg/invoke"
	"github.com/containernetworking/cni/pkg/version"

	"github.com/istio-cni-go/istio-cni/internal/prepared"
)

// recordingExec stands in for the plugins of a chain: it keeps the
// stdin libcni hands each, and answers with an empty result.
type recordingExec struct{ stdin map[string][]byte }

func (e *recordingExec) ExecPlugin(_ context.Context, path string, stdin []byte, _ []string) ([]byte, error) {
	e.stdin[filepath.Base(path)] = stdin
	var conf struct {
		CNIVersion string `json:"cniVersion"`
	}
	if err := json.Unmarshal(stdin, &conf); err != nil {
		return nil, err
	}
	return json.Marshal(map[string]any{"cniVersion": conf.CNIVersion})
}

func (e *recordingExec) FindInPath(plugin string, _ []string) (string, error) {
	return "/opt/cni/bin/" + plugin, nil
}

func (e *recordingExec) Decode(b []byte) (version.PluginInfo, error) {
	return version.PluginSupports(version.All.SupportedVersions()...), nil
}

var _ invoke.Exec = (*recordingExec)(nil)

// TestExpectedConfigIsWhatLibcniHands drives libcni's ADD down each chain
// the installer writes into a real primary's config (Calico, Cilium,
// AWS, flannel, kindnet, ...), with the capability arguments a runtime
// passes, and checks that the config expected from the file is, byte for
// byte, the one istio-cni's stdin carries but for its prevResult: what a
// relay matches records with.
func TestExpectedConfigIsWhatLibcniHands(t *testing.T) {
	files, err := filepath.Glob("../install/testdata/merged/*.golden")
	if err != nil || len(files) == 0 {
		t.Fatalf("no installer output to read: %v", err)
	}
	checked := 0
	for _, f := range files {
		t.Run(filepath.Base(f), func(t *testing.T) {
			data, err := os.ReadFile(f)
			if err != nil {
				t.Fatal(err)
			}
			want, err := ExpectedConfig(data, "istio-cni")
			if err != nil {
				t.Fatal(err)
			}
			list, err := libcni.ConfListFromBytes(data)
			if err != nil {
				t.Fatal(err)
			}
			exec := &recordingExec{stdin: map[string][]byte{}}
			cni := libcni.NewCNIConfigWithCacheDir([]string{"/opt/cni/bin"}, t.TempDir(), exec)
			rt := &libcni.RuntimeConf{ContainerID: "0123456789ab", NetNS: "/var/run/netns/cni-1", IfName: "eth0",
				Args: [][2]string{{"IgnoreUnknown", "1"}, {"K8S_POD_NAMESPACE", "default"}, {"K8S_POD_NAME", "p"}},
				CapabilityArgs: map[string]any{
					"portMappings":                      []map[string]any{{"hostPort": 8080, "containerPort": 80, "protocol": "tcp"}},
					"bandwidth":                         map[string]any{"ingressRate": 1000000, "ingressBurst": 1000000},
					"io.kubernetes.cri.pod-annotations": map[string]string{"a": "b"},
				}}
			if _, err := cni.AddNetworkList(context.Background(), list, rt); err != nil {
				t.Fatal(err)
			}
			stdin, ok := exec.stdin["istio-cni"]
			if !ok {
				t.Fatalf("libcni never ran istio-cni; it ran %v", exec.stdin)
			}
			got, err := prepared.ParseConfig(stdin)
			if err != nil {
				t.Fatal(err)
			}
			if !bytes.Equal(got.Canonical, want) {
				t.Fatalf("expected from the file:\n%s\nhanded by libcni (prevResult left out):\n%s", want, got.Canonical)
			}
			if got.PrevResult == nil && len(list.Plugins) > 1 {
				t.Fatalf("istio-cni got no prevResult after %d plugins", len(list.Plugins)-1)
			}
			checked++
		})
	}
	if checked != len(files) {
		t.Fatalf("checked %d of %d chains", checked, len(files))
	}
}

func TestExpectedConfigErrors(t *testing.T) {
	for _, c := range []struct{ name, conf, want string }{
		{"no-entry", `{"name":"net","cniVersion":"1.0.0","plugins":[{"type":"ptp"}]}`, "no istio-cni entry"},
		{"two-entries", `{"name":"net","cniVersion":"1.0.0","plugins":[{"type":"ptp"},{"type":"istio-cni"},{"type":"istio-cni"}]}`, "two istio-cni entries"},
		{"capabilities", `{"name":"net","cniVersion":"1.0.0","plugins":[{"type":"ptp"},{"type":"istio-cni","capabilities":{"portMappings":true}}]}`, "capabilities"},
		{"not-json", `{"name":`, "unexpected end"},
	} {
		t.Run(c.name, func(t *testing.T) {
			_, err := ExpectedConfig([]byte(c.conf), "istio-cni")
			if err == nil || !strings.Contains(err.Error(), c.want) {
				t.Fatalf("error %v, want one saying %q", err, c.want)
			}
		})
	}
}
