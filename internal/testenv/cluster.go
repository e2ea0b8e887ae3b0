// Package testenv starts the real parts the end-to-end tests and the
// benchmark run against: etcd and kube-apiserver, a node network namespace
// with no uplink, and pod namespaces wired by the CNI reference plugins.
package testenv

import (
	"cmp"
	"context"
	"crypto/rand"
	"crypto/rsa"
	"crypto/x509"
	"encoding/hex"
	"encoding/pem"
	"errors"
	"fmt"
	mrand "math/rand/v2"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"

	authv1 "k8s.io/api/authentication/v1"
	corev1 "k8s.io/api/core/v1"
	rbacv1 "k8s.io/api/rbac/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/rest"
)

// KubeVersion is the Kubernetes version whose binaries the tests run:
// $KUBE_VERSION, which hack/build-kube.sh builds, with the same default,
// so that a version built on request is the one looked for.
var KubeVersion = cmp.Or(os.Getenv("KUBE_VERSION"), "v1.34.4")

// Cluster is a running etcd and kube-apiserver.
type Cluster struct {
	URL     string
	Port    int
	KeyFile string
	CAFile  string
	Token   string
	Client  kubernetes.Interface
	Config  *rest.Config
	dir     string
	procs   []*exec.Cmd
	logPath string
}

// RepoRoot finds the module root from the working directory.
func RepoRoot() (string, error) {
	dir, err := os.Getwd()
	if err != nil {
		return "", err
	}
	for {
		if _, err := os.Stat(filepath.Join(dir, "go.mod")); err == nil {
			return dir, nil
		}
		parent := filepath.Dir(dir)
		if parent == dir {
			return "", errors.New("go.mod not found above the working directory")
		}
		dir = parent
	}
}

// APIServerBinary returns the kube-apiserver built by hack/build-kube.sh
// (make test does that first), from the same cache directory.
func APIServerBinary() (string, error) {
	if p := os.Getenv("KUBE_APISERVER"); p != "" {
		return p, nil
	}
	dir := os.Getenv("KUBE_CACHE_DIR")
	if dir == "" {
		base, err := os.UserCacheDir()
		if err != nil {
			return "", err
		}
		dir = filepath.Join(base, "istio-cni-go", "kube")
	}
	p := filepath.Join(dir, KubeVersion, "kube-apiserver")
	if _, err := os.Stat(p); err != nil {
		return "", fmt.Errorf("kube-apiserver not built at %s: run hack/build-kube.sh (make test does): %w", p, err)
	}
	return p, nil
}

// freePorts returns n distinct ports that were free on every address a
// moment ago, each taken at random below the kernel's ephemeral range:
// a port from that range (what listening on port 0 gives) can be taken,
// between the choice and the bind of the process it is for, by any
// outgoing connection on the machine (tests run side by side, each with
// an API server talking to its etcd). Every listener stays open until all
// are chosen, so no port comes back twice.
func freePorts(n int) ([]int, error) {
	low := ephemeralLow()
	first := max(low-12000, 1024)
	ports := make([]int, 0, n)
	var open []net.Listener
	defer func() {
		for _, l := range open {
			_ = l.Close()
		}
	}()
	for tries := 0; len(ports) < n; tries++ {
		if tries > 1000 {
			return nil, fmt.Errorf("no free port in %d-%d after %d tries", first, low-1, tries)
		}
		port := first + mrand.IntN(low-first)
		l, err := net.Listen("tcp", ":"+strconv.Itoa(port))
		if err != nil {
			continue
		}
		open = append(open, l)
		ports = append(ports, port)
	}
	return ports, nil
}

// ephemeralLow is the first port of the kernel's ephemeral range.
func ephemeralLow() int {
	b, err := os.ReadFile("/proc/sys/net/ipv4/ip_local_port_range")
	if err == nil {
		if f := strings.Fields(string(b)); len(f) == 2 {
			if v, err := strconv.Atoi(f[0]); err == nil && v > 2048 {
				return v
			}
		}
	}
	return 32768
}

func freePort() (int, error) {
	p, err := freePorts(1)
	if err != nil {
		return 0, err
	}
	return p[0], nil
}

// StartCluster starts etcd and kube-apiserver on loopback in dir. It
// returns when the API server is ready.
func StartCluster(dir string) (*Cluster, error) { return startCluster(dir, "127.0.0.1") }

// StartPodReachableCluster serves the API on RemoteV4 as well, an address
// of the node namespace that pods reach through their default route, so
// in-cluster clients (the agent as a pod) can talk to it. Only inside the
// node namespace, which has no uplink.
func StartPodReachableCluster(dir string) (*Cluster, error) { return startCluster(dir, RemoteV4) }

func startCluster(dir, address string) (*Cluster, error) {
	apiserver, err := APIServerBinary()
	if err != nil {
		return nil, err
	}
	etcdBin, err := exec.LookPath("etcd")
	if err != nil {
		return nil, fmt.Errorf("etcd is required (Debian package etcd-server): %w", err)
	}
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return nil, err
	}
	c := &Cluster{dir: dir, logPath: filepath.Join(dir, "cluster.log")}
	logf, err := os.Create(c.logPath)
	if err != nil {
		return nil, err
	}
	ports, err := freePorts(3)
	if err != nil {
		return nil, err
	}
	clientPort, peerPort, apiPort := ports[0], ports[1], ports[2]
	etcdURL := fmt.Sprintf("http://127.0.0.1:%d", clientPort)
	if err := c.start(logf, etcdBin, "--data-dir", filepath.Join(dir, "etcd"),
		"--listen-client-urls", etcdURL, "--advertise-client-urls", etcdURL,
		"--listen-peer-urls", fmt.Sprintf("http://127.0.0.1:%d", peerPort),
		"--initial-advertise-peer-urls", fmt.Sprintf("http://127.0.0.1:%d", peerPort),
		"--initial-cluster", fmt.Sprintf("default=http://127.0.0.1:%d", peerPort),
		"--log-level", "error"); err != nil {
		return nil, err
	}

	key, err := rsa.GenerateKey(rand.Reader, 2048)
	if err != nil {
		return nil, err
	}
	keyPath := filepath.Join(dir, "sa.key")
	c.KeyFile = keyPath
	keyPEM := pem.EncodeToMemory(&pem.Block{Type: "RSA PRIVATE KEY", Bytes: x509.MarshalPKCS1PrivateKey(key)})
	if err := os.WriteFile(keyPath, keyPEM, 0o600); err != nil {
		return nil, err
	}
	tok := make([]byte, 16)
	_, _ = rand.Read(tok)
	c.Token = hex.EncodeToString(tok)
	tokenFile := filepath.Join(dir, "tokens.csv")
	if err := os.WriteFile(tokenFile, []byte(c.Token+",admin,admin,system:masters\n"), 0o600); err != nil {
		return nil, err
	}
	certDir := filepath.Join(dir, "certs")
	if err := c.start(logf, apiserver,
		"--etcd-servers", etcdURL,
		"--bind-address", bindFor(address), "--advertise-address", address,
		"--secure-port", strconv.Itoa(apiPort), "--cert-dir", certDir,
		"--token-auth-file", tokenFile,
		"--service-account-key-file", keyPath, "--service-account-signing-key-file", keyPath,
		"--service-account-issuer", "https://kubernetes.default.svc",
		"--authorization-mode", "RBAC",
		"--service-cluster-ip-range", "10.96.0.0/16",
		"--enable-priority-and-fairness=false",
		"--profiling=false", "-v", "0"); err != nil {
		c.Stop()
		return nil, err
	}
	c.URL = fmt.Sprintf("https://%s", net.JoinHostPort(address, strconv.Itoa(apiPort)))
	c.Port = apiPort
	c.CAFile = filepath.Join(certDir, "apiserver.crt")
	if err := c.waitReady(90 * time.Second); err != nil {
		c.Stop()
		return nil, err
	}
	c.Config = &rest.Config{Host: c.URL, BearerToken: c.Token, TLSClientConfig: rest.TLSClientConfig{CAFile: c.CAFile}, QPS: 1000, Burst: 1000}
	if c.Client, err = kubernetes.NewForConfig(c.Config); err != nil {
		c.Stop()
		return nil, err
	}
	return c, nil
}

// ControlPlanePIDs are the cluster's own processes (etcd, the API
// server and, once started, the controller manager), which on this one
// machine share its CPUs with the node.
func (c *Cluster) ControlPlanePIDs() []int {
	out := make([]int, 0, len(c.procs))
	for _, p := range c.procs {
		out = append(out, p.Process.Pid)
	}
	return out
}

func (c *Cluster) start(logf *os.File, bin string, args ...string) error {
	cmd := exec.Command(bin, args...)
	cmd.Stdout, cmd.Stderr = logf, logf
	// Die with the test process, whatever happens to it. The death signal
	// follows the forking thread, not the process, so the fork happens on
	// a thread that lives as long as the process.
	cmd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL, Setpgid: true}
	if err := startOnLongLivedThread(cmd); err != nil {
		return fmt.Errorf("starting %s: %w", bin, err)
	}
	c.procs = append(c.procs, cmd)
	return nil
}

var (
	spawnOnce sync.Once
	spawnReq  chan spawnRequest
)

type spawnRequest struct {
	cmd  *exec.Cmd
	done chan error
}

func startOnLongLivedThread(cmd *exec.Cmd) error {
	spawnOnce.Do(func() {
		spawnReq = make(chan spawnRequest)
		go func() {
			runtime.LockOSThread() // never unlocked: this thread must not exit
			for r := range spawnReq {
				r.done <- r.cmd.Start()
			}
		}()
	})
	done := make(chan error, 1)
	spawnReq <- spawnRequest{cmd, done}
	return <-done
}

func (c *Cluster) waitReady(limit time.Duration) error {
	deadline := time.Now().Add(limit)
	client := &http.Client{Timeout: 2 * time.Second, Transport: &http.Transport{TLSClientConfig: insecureTLS()}}
	var last string
	for time.Now().Before(deadline) {
		for _, p := range c.procs {
			if p.ProcessState != nil {
				return fmt.Errorf("%s exited; see %s", p.Path, c.logPath)
			}
		}
		req, _ := http.NewRequest(http.MethodGet, c.URL+"/readyz", http.NoBody)
		req.Header.Set("Authorization", "Bearer "+c.Token)
		resp, err := client.Do(req)
		if err == nil {
			_ = resp.Body.Close()
			if resp.StatusCode == http.StatusOK {
				if _, err := os.Stat(c.CAFile); err == nil {
					return nil
				}
			}
			last = resp.Status
		} else {
			last = err.Error()
		}
		time.Sleep(200 * time.Millisecond) // polling a server we cannot be told about
	}
	tail, _ := os.ReadFile(c.logPath)
	if len(tail) > 3000 {
		tail = tail[len(tail)-3000:]
	}
	return fmt.Errorf("kube-apiserver not ready after %s (last: %s); log tail:\n%s", limit, last, tail)
}

// Stop kills the processes.
func (c *Cluster) Stop() {
	for i := len(c.procs) - 1; i >= 0; i-- {
		p := c.procs[i]
		if p.Process != nil {
			_ = syscall.Kill(-p.Process.Pid, syscall.SIGKILL)
			_ = p.Wait()
		}
	}
	c.procs = nil
}

// PluginKubeconfig creates the plugin's service account with read access
// to pods only, mints a token for it and writes a kubeconfig at path with
// mode 0600, as the node agent does.
func (c *Cluster) PluginKubeconfig(ctx context.Context, path string) error {
	tok, err := c.PluginToken(ctx)
	if err != nil {
		return err
	}
	return WriteKubeconfig(path, c.URL, c.CAFile, tok)
}

// PluginToken ensures the istio-cni service account (read access to pods,
// and to namespaces as the chart's ambient role grants) and mints a token
// for it, as a projected service account volume holds.
func (c *Cluster) PluginToken(ctx context.Context) (string, error) {
	return c.TokenFor(ctx, "istio-cni", []rbacv1.PolicyRule{
		{APIGroups: []string{""}, Resources: []string{"pods"}, Verbs: []string{"get"}},
		{APIGroups: []string{""}, Resources: []string{"namespaces"}, Verbs: []string{"get"}},
	})
}

// TokenFor ensures a service account in kube-system bound to a cluster
// role with exactly rules, and mints a token for it.
func (c *Cluster) TokenFor(ctx context.Context, name string, rules []rbacv1.PolicyRule) (string, error) {
	const ns = "kube-system"
	cs := c.Client
	if _, err := cs.CoreV1().ServiceAccounts(ns).Create(ctx, &corev1.ServiceAccount{ObjectMeta: metav1.ObjectMeta{Name: name}}, metav1.CreateOptions{}); err != nil && !isExists(err) {
		return "", err
	}
	role := &rbacv1.ClusterRole{ObjectMeta: metav1.ObjectMeta{Name: name}, Rules: rules}
	if _, err := cs.RbacV1().ClusterRoles().Create(ctx, role, metav1.CreateOptions{}); err != nil && !isExists(err) {
		return "", err
	}
	binding := &rbacv1.ClusterRoleBinding{ObjectMeta: metav1.ObjectMeta{Name: name},
		RoleRef:  rbacv1.RoleRef{APIGroup: "rbac.authorization.k8s.io", Kind: "ClusterRole", Name: name},
		Subjects: []rbacv1.Subject{{Kind: "ServiceAccount", Name: name, Namespace: ns}}}
	if _, err := cs.RbacV1().ClusterRoleBindings().Create(ctx, binding, metav1.CreateOptions{}); err != nil && !isExists(err) {
		return "", err
	}
	exp := int64(3600)
	tr, err := cs.CoreV1().ServiceAccounts(ns).CreateToken(ctx, name, &authv1.TokenRequest{Spec: authv1.TokenRequestSpec{ExpirationSeconds: &exp}}, metav1.CreateOptions{})
	if err != nil {
		return "", fmt.Errorf("minting plugin token: %w", err)
	}
	return tr.Status.Token, nil
}

// AdminKubeconfig writes a kubeconfig with the cluster's admin token.
func (c *Cluster) AdminKubeconfig(path string) error {
	return WriteKubeconfig(path, c.URL, c.CAFile, c.Token)
}

// WriteKubeconfig writes a token kubeconfig with the CA embedded.
func WriteKubeconfig(path, server, caFile, token string) error {
	ca, err := os.ReadFile(caFile)
	if err != nil {
		return err
	}
	kc := fmt.Sprintf(`apiVersion: v1
kind: Config
clusters:
- name: local
  cluster:
    server: %s
    certificate-authority-data: %s
users:
- name: istio-cni
  user:
    token: %s
contexts:
- name: istio-cni-context
  context:
    cluster: local
    user: istio-cni
current-context: istio-cni-context
`, server, b64(ca), token)
	if err := os.MkdirAll(filepath.Dir(path), 0o755); err != nil {
		return err
	}
	return os.WriteFile(path, []byte(kc), 0o600)
}

func isExists(err error) bool {
	return err != nil && strings.Contains(err.Error(), "already exists")
}

func bindFor(address string) string {
	if address == "127.0.0.1" {
		return address
	}
	return "0.0.0.0"
}

// StartControllerManager runs kube-controller-manager (DaemonSets, service
// account tokens' CA config maps, garbage collection) against the cluster.
func (c *Cluster) StartControllerManager() error {
	p, err := APIServerBinary()
	if err != nil {
		return err
	}
	kcm := filepath.Join(filepath.Dir(p), "kube-controller-manager")
	kc := filepath.Join(c.dir, "kcm.kubeconfig")
	if err := c.AdminKubeconfig(kc); err != nil {
		return err
	}
	logf, err := os.OpenFile(c.logPath, os.O_APPEND|os.O_WRONLY, 0o644)
	if err != nil {
		return err
	}
	return c.start(logf, kcm, "--kubeconfig", kc, "--leader-elect=false", "--use-service-account-credentials=false",
		"--service-account-private-key-file", c.KeyFile, "--root-ca-file", c.CAFile, "--secure-port", "0",
		"--authentication-skip-lookup", "--controllers", "*", "-v", "1")
}
