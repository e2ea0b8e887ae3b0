// Package soak holds a soak benchmark of the node agent: the real agent
// binary serving thousands of pod ADD and DEL from real relay processes on
// real network namespaces, against a real kube-apiserver, with an hour of a
// node's other events (resyncs, token rotations, the primary rewriting its
// config, pods coming and going in the API, fallback lookups and log
// lines) compressed into the run. It reports the agent's open descriptors,
// goroutines, threads and resident memory at the start and at the end,
// which must stay bounded and flat.
//
//	go test -run '^$' -bench Soak -benchtime 3000x ./test/soak/
//
// Without -bench it runs the memory test (memory_test.go) only.
package soak

import (
	"bytes"
	"context"
	"encoding/json"
	"flag"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/containernetworking/plugins/pkg/netlinksafe"
	"github.com/containernetworking/plugins/pkg/ns"
	"github.com/containernetworking/plugins/pkg/testutils"
	"github.com/vishvananda/netlink"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/istio-cni-go/istio-cni/internal/install"
	"github.com/istio-cni-go/istio-cni/internal/podinfo"
	"github.com/istio-cni-go/istio-cni/internal/testenv"
	"github.com/istio-cni-go/istio-cni/internal/testutil"
)

var (
	cluster  *testenv.Cluster
	workDir  string
	relayBin string
	agentBin string
)

const soakNS = "soak"

func TestMain(m *testing.M) {
	flag.Parse()
	// Listing starts nothing.
	if f := flag.Lookup("test.list"); f != nil && f.Value.String() != "" {
		os.Exit(m.Run())
	}
	testenv.EnterNodeNamespace()
	os.Exit(run(m))
}

func run(m *testing.M) int {
	var err error
	if workDir, err = os.MkdirTemp("", "istio-cni-soak-"); err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 2
	}
	defer os.RemoveAll(workDir)
	_ = os.Chmod(workDir, 0o755)
	if relayBin, err = testenv.BuildPlugin(workDir); err == nil {
		agentBin, err = testenv.BuildCommand(workDir, "install-cni")
	}
	if err == nil {
		cluster, err = testenv.StartCluster(filepath.Join(workDir, "cluster"))
	}
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 2
	}
	defer cluster.Stop()
	for _, n := range []string{soakNS, "istio-system", "kube-system"} {
		if err := testenv.EnsureNamespace(context.Background(), cluster.Client, n); err != nil {
			fmt.Fprintln(os.Stderr, err)
			return 2
		}
	}
	return m.Run()
}

// procStats is what the benchmark watches of the agent process.
type procStats struct{ fds, goroutines, threads, rssKB int }

func (s procStats) String() string {
	return fmt.Sprintf("fds %d, goroutines %d, threads %d, RSS %.1f MB", s.fds, s.goroutines, s.threads, float64(s.rssKB)/1024)
}

func statsOf(b *testing.B, h *testenv.AgentHost) procStats {
	b.Helper()
	var s procStats
	entries, err := os.ReadDir(fmt.Sprintf("/proc/%d/fd", h.Pid()))
	if err != nil {
		b.Fatal(err)
	}
	s.fds = len(entries)
	status, err := os.ReadFile(fmt.Sprintf("/proc/%d/status", h.Pid()))
	if err != nil {
		b.Fatal(err)
	}
	for _, l := range strings.Split(string(status), "\n") {
		f := strings.Fields(l)
		if len(f) < 2 {
			continue
		}
		switch f[0] {
		case "Threads:":
			s.threads, _ = strconv.Atoi(f[1])
		case "VmRSS:":
			s.rssKB, _ = strconv.Atoi(f[1])
		}
	}
	lines, err := h.Metrics("go_goroutines ")
	if err != nil || len(lines) == 0 {
		b.Fatalf("go_goroutines: %v", err)
	}
	s.goroutines, _ = strconv.Atoi(strings.Fields(lines[0])[1])
	return s
}

// soakPod is a pod sandbox: a fresh namespace whose eth0 holds an address,
// as the primary plugin leaves it.
func soakPod() (ns.NetNS, error) {
	n, err := testutils.NewNS()
	if err != nil {
		return nil, err
	}
	err = n.Do(func(ns.NetNS) error {
		if err := netlink.LinkAdd(&netlink.Veth{LinkAttrs: netlink.LinkAttrs{Name: "eth0"}, PeerName: "peer0"}); err != nil {
			return err
		}
		eth, err := netlinksafe.LinkByName("eth0")
		if err != nil {
			return err
		}
		if err := netlink.LinkSetUp(eth); err != nil {
			return err
		}
		return netlink.AddrAdd(eth, &netlink.Addr{IPNet: &net.IPNet{IP: net.IPv4(10, 1, 0, 2), Mask: net.CIDRMask(24, 32)}})
	})
	if err != nil {
		_ = testutil.RemoveNS(n)
		return nil, err
	}
	return n, nil
}

// relay runs the installed istio-cni as a runtime does.
func relay(bin, command, netns, args string, stdin []byte) error {
	cmd := exec.Command(bin)
	cmd.Env = []string{"CNI_COMMAND=" + command, "CNI_CONTAINERID=soak", "CNI_NETNS=" + netns, "CNI_IFNAME=eth0",
		"CNI_PATH=" + filepath.Dir(bin), "CNI_ARGS=IgnoreUnknown=1;" + args}
	cmd.Stdin = bytes.NewReader(stdin)
	var out bytes.Buffer
	cmd.Stdout = &out
	if err := cmd.Run(); err != nil {
		return fmt.Errorf("%s: %w: %s", command, err, out.String())
	}
	return nil
}

// BenchmarkSoak: each op is one pod's ADD and DEL through the relay and
// the agent, eight at a time; the node's other events of an hour happen
// meanwhile, scaled to the run.
func BenchmarkSoak(b *testing.B) {
	ctx := context.Background()
	h, err := testenv.NewAgentHost(ctx, b.TempDir(), cluster, relayBin)
	if err != nil {
		b.Fatal(err)
	}
	primary := filepath.Join(h.NetDir, "10-ptp.conflist")
	primaryConf := []byte(`{"cniVersion":"1.0.0","name":"k8s-pod-network","plugins":[{"type":"ptp","ipam":{"type":"host-local","subnet":"10.1.0.0/24"}}]}` + "\n")
	if err := os.WriteFile(primary, primaryConf, 0o644); err != nil {
		b.Fatal(err)
	}
	// An hour of 60 s resyncs is 60: one every half second here, a few
	// thousand pods taking about half a minute.
	if err := h.Start(agentBin, "--kubernetes-node-name", testenv.NodeName, "--resync-interval", "500ms", "--conflict-limit", "1000000"); err != nil {
		b.Fatal(err)
	}
	defer func() { _, _ = h.Stop(20 * time.Second) }()
	if err := h.WaitReady(30 * time.Second); err != nil {
		b.Fatal(err)
	}

	// A pool of sidecar pods in the API; sandboxes take them in turn.
	const pool = 64
	type apiPod struct{ name, uid string }
	pods := make([]apiPod, pool)
	mkPod := func(i int) error {
		name := fmt.Sprintf("soak-%d", i)
		_ = cluster.Client.CoreV1().Pods(soakNS).Delete(ctx, name, metav1.DeleteOptions{GracePeriodSeconds: new(int64)})
		var p *corev1.Pod
		var err error
		for attempt := 0; ; attempt++ {
			if p, err = testenv.CreatePod(ctx, cluster.Client, testenv.PodSpec{Namespace: soakNS, Name: name, Sidecar: true}); err == nil || attempt == 50 {
				break
			}
			time.Sleep(20 * time.Millisecond) // the deleted pod of that name is still going
		}
		if err != nil {
			return err
		}
		pods[i] = apiPod{name, string(p.UID)}
		return nil
	}
	for i := range pods {
		if err := mkPod(i); err != nil {
			b.Fatal(err)
		}
	}
	agent := podinfo.NewAgentClient(filepath.Join(h.RunDir, podinfo.AgentSocketName), 2*time.Second)
	for _, p := range pods {
		for deadline := time.Now().Add(20 * time.Second); ; {
			if _, err := agent.GetPod(ctx, soakNS, p.name); err == nil {
				break
			} else if time.Now().After(deadline) {
				b.Fatalf("the agent's cache never held %s: %v", p.name, err)
			}
			time.Sleep(10 * time.Millisecond) // the informer sees new pods shortly
		}
	}
	input := func() []byte {
		data, err := os.ReadFile(primary)
		if err != nil {
			b.Fatal(err)
		}
		var l struct {
			CNIVersion string            `json:"cniVersion"`
			Name       string            `json:"name"`
			Plugins    []json.RawMessage `json:"plugins"`
		}
		if err := json.Unmarshal(data, &l); err != nil {
			b.Fatal(err)
		}
		var entry map[string]any
		if err := json.Unmarshal(l.Plugins[len(l.Plugins)-1], &entry); err != nil || entry["type"] != install.PluginType {
			b.Fatalf("no entry in %s", data)
		}
		entry["cniVersion"], entry["name"] = l.CNIVersion, l.Name
		entry["prevResult"] = map[string]any{"cniVersion": "1.0.0", "ips": []map[string]any{{"address": "10.1.0.2/24"}}}
		out, _ := json.Marshal(entry)
		return out
	}
	conf := input()
	bin := filepath.Join(h.BinDir, install.PluginType)
	logLine, _ := json.Marshal([]string{`{"level":"info","msg":"served without the node agent","pod":"soak/x"}`})
	httpc := &http.Client{Timeout: 2 * time.Second, Transport: &http.Transport{DialContext: func(ctx context.Context, _, _ string) (net.Conn, error) {
		var d net.Dialer
		return d.DialContext(ctx, "unix", filepath.Join(h.RunDir, "log.sock"))
	}}}
	defer httpc.CloseIdleConnections()

	var done atomic.Int64
	// A pod object is not replaced in the API while one of its sandboxes
	// is being added.
	podMu := make([]sync.Mutex, pool)
	side := func(i int) {
		// The rest of a node's hour, in proportion: a token rotation and a
		// primary rewrite every 250 pods, a pod replaced in the API every
		// 25, a fallback's lookup and log lines every 10.
		switch {
		case i%250 == 125:
			if _, err := h.RotateToken(ctx); err != nil {
				b.Error(err)
			}
		case i%250 == 0 && i > 0:
			tmp := primary + ".tmp"
			if err := os.WriteFile(tmp, primaryConf, 0o644); err == nil {
				_ = os.Rename(tmp, primary)
			}
		}
		if i%25 == 0 {
			k := (i / 25) % pool
			podMu[k].Lock()
			if err := mkPod(k); err != nil {
				b.Error(err)
			}
			podMu[k].Unlock()
		}
		if i%10 == 0 {
			_, _ = agent.GetPod(ctx, soakNS, pods[i%pool].name)
			if resp, err := httpc.Post("http://unix/log", "application/json", bytes.NewReader(logLine)); err == nil {
				_, _ = io.Copy(io.Discard, resp.Body)
				_ = resp.Body.Close()
			}
		}
	}
	one := func(i int) {
		k := i % pool
		netns, err := soakPod()
		if err != nil {
			b.Errorf("pod %d: %v", i, err)
			return
		}
		defer func() { _ = testutil.RemoveNS(netns) }()
		podMu[k].Lock()
		p := pods[k]
		args := "K8S_POD_NAMESPACE=" + soakNS + ";K8S_POD_NAME=" + p.name + ";K8S_POD_UID=" + p.uid
		if err := relay(bin, "ADD", netns.Path(), args, conf); err != nil {
			b.Errorf("pod %d: %v", i, err)
		}
		if i%7 == 0 {
			if err := relay(bin, "CHECK", netns.Path(), args, conf); err != nil {
				b.Errorf("pod %d: %v", i, err)
			}
		}
		if err := relay(bin, "DEL", netns.Path(), args, conf); err != nil {
			b.Errorf("pod %d: %v", i, err)
		}
		podMu[k].Unlock()
		side(i)
		done.Add(1)
	}

	// Warm up, then measure from a settled agent.
	for i := 0; i < 50; i++ {
		one(i)
	}
	settle := func() {
		// Two resyncs go by: whatever was in flight has finished.
		base := resyncs(b, h)
		for deadline := time.Now().Add(30 * time.Second); resyncs(b, h) < base+2; {
			if time.Now().After(deadline) {
				b.Fatal("no resync in 30s")
			}
			time.Sleep(100 * time.Millisecond) // polling the agent's metrics
		}
	}
	settle()
	start := statsOf(b, h)
	began := time.Now()
	b.ResetTimer()
	var wg sync.WaitGroup
	next := make(chan int)
	for w := 0; w < 8; w++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for i := range next {
				one(i)
			}
		}()
	}
	for i := 0; i < b.N; i++ {
		next <- 50 + i
	}
	close(next)
	wg.Wait()
	b.StopTimer()
	elapsed := time.Since(began)
	settle()
	end := statsOf(b, h)
	b.Logf("%d pods (ADD, DEL, CHECK for 1 in 7) in %s, with %d resyncs, token rotations and primary rewrites every 250 pods",
		done.Load(), elapsed.Round(time.Second), resyncs(b, h))
	b.Logf("start: %s", start)
	b.Logf("end:   %s", end)
	b.ReportMetric(float64(start.fds), "fds-start")
	b.ReportMetric(float64(end.fds), "fds-end")
	b.ReportMetric(float64(start.goroutines), "goroutines-start")
	b.ReportMetric(float64(end.goroutines), "goroutines-end")
	b.ReportMetric(float64(start.threads), "threads-start")
	b.ReportMetric(float64(end.threads), "threads-end")
	b.ReportMetric(float64(start.rssKB)/1024, "rss-MB-start")
	b.ReportMetric(float64(end.rssKB)/1024, "rss-MB-end")
	// Bounded and flat: nothing per pod may stay behind.
	if end.fds > start.fds+16 || end.goroutines > start.goroutines+32 || end.threads > 2*start.threads+8 || end.rssKB > 2*start.rssKB+64*1024 {
		b.Errorf("the agent grew over the run:\n start %s\n   end %s", start, end)
	}
}

func resyncs(b *testing.B, h *testenv.AgentHost) int {
	b.Helper()
	lines, err := h.Metrics(`istio_cni_config_resyncs_total{reason="periodic"}`)
	if err != nil {
		b.Fatal(err)
	}
	if len(lines) == 0 {
		return 0
	}
	v, _ := strconv.ParseFloat(lines[0][strings.LastIndex(lines[0], " ")+1:], 64)
	return int(v)
}
