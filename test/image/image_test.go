// Package image builds the node agent's image with no container engine and
// proves it: its layout and entry point, its binaries (Debian's iptables
// included) running from its root file system, and a real containerd
// importing it.
package image

import (
	"archive/tar"
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/istio-cni-go/istio-cni/internal/testenv"
	"github.com/istio-cni-go/istio-cni/internal/testutil"
)

const tag = "istio-cni-go/install-cni:test"

func TestImage(t *testing.T) {
	testutil.RequireRoot(t)
	testutil.RequireTools(t, "containerd", "ctr", "dpkg-deb", "chroot")
	root, err := testenv.RepoRoot()
	if err != nil {
		t.Fatal(err)
	}
	dir := t.TempDir()
	out := filepath.Join(dir, "install-cni.tar")
	cmd := exec.Command(filepath.Join(root, "hack", "build-image.sh"), out, tag)
	cmd.Dir = root
	if b, err := cmd.CombinedOutput(); err != nil {
		t.Fatalf("building the image: %v\n%s", err, b)
	}

	files := readTar(t, out)
	var manifest []struct {
		Config   string
		RepoTags []string
		Layers   []string
	}
	if err := json.Unmarshal(files["manifest.json"], &manifest); err != nil || len(manifest) != 1 ||
		strings.Join(manifest[0].RepoTags, " ") != tag+" "+tag+"-distroless "+tag+"-debug" {
		t.Fatalf("manifest: %s %v", files["manifest.json"], err)
	}
	var config struct {
		Config struct{ Entrypoint []string }
	}
	if err := json.Unmarshal(files[manifest[0].Config], &config); err != nil || strings.Join(config.Config.Entrypoint, " ") != "install-cni" {
		t.Fatalf("entry point: %v %v", config.Config.Entrypoint, err)
	}

	rootfs := filepath.Join(dir, "rootfs")
	if err := os.MkdirAll(rootfs, 0o755); err != nil {
		t.Fatal(err)
	}
	untar := exec.Command("tar", "-x", "-C", rootfs)
	untar.Stdin = bytes.NewReader(files[manifest[0].Layers[0]])
	if b, err := untar.CombinedOutput(); err != nil {
		t.Fatalf("extracting the layer: %v %s", err, b)
	}
	for _, p := range []string{"usr/local/bin/install-cni", "opt/cni/bin/istio-cni", "opt/cni/bin/istio-cni-fallback", "usr/local/bin/istio-cni-validate", "usr/local/bin/istio-cni-diag"} {
		if fi, err := os.Stat(filepath.Join(rootfs, p)); err != nil || fi.Mode().Perm()&0o111 == 0 {
			t.Fatalf("%s missing or not executable: %v", p, err)
		}
	}
	// The image's own iptables runs from its root: libraries complete.
	for _, bin := range []string{"/usr/sbin/iptables-nft-restore", "/usr/sbin/iptables-legacy-save"} {
		b, err := exec.Command("chroot", rootfs, bin, "--version").CombinedOutput()
		if err != nil || !strings.Contains(string(b), "v1.8") {
			t.Fatalf("%s in the image: %v %s", bin, err, b)
		}
	}
	// Its nsenter, for user-namespaced pods (the agent calls it as an
	// applet of busybox when no nsenter binary is there).
	if b, err := exec.Command("chroot", rootfs, "/bin/busybox", "nsenter", "--help").CombinedOutput(); !strings.Contains(string(b), "Usage: nsenter") {
		t.Fatalf("busybox nsenter in the image: %v %s", err, b)
	}
	// No nsswitch.conf: glibc then only reads local files for the owner
	// match's user lookup, so the agent skips hiding it.
	if _, err := os.Stat(filepath.Join(rootfs, "etc", "nsswitch.conf")); !os.IsNotExist(err) {
		t.Fatalf("the image has an /etc/nsswitch.conf (%v); the agent would hide it for every iptables command", err)
	}
	b, err := exec.Command("chroot", rootfs, "install-cni", "--kubeconfig-mode", "x").CombinedOutput()
	var ee *exec.ExitError
	if !errors.As(err, &ee) || ee.ExitCode() != 2 {
		t.Fatalf("install-cni in the image: %v %s", err, b)
	}

	importIntoContainerd(t, dir, out)
}

func readTar(t *testing.T, path string) map[string][]byte {
	t.Helper()
	f, err := os.Open(path)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	out := map[string][]byte{}
	tr := tar.NewReader(f)
	for {
		h, err := tr.Next()
		if errors.Is(err, io.EOF) {
			return out
		}
		if err != nil {
			t.Fatal(err)
		}
		b, err := io.ReadAll(tr)
		if err != nil {
			t.Fatal(err)
		}
		out[h.Name] = b
	}
}

// importIntoContainerd runs a containerd of its own (temp root, state and
// socket) and imports the image into the namespace kubelets use.
func importIntoContainerd(t *testing.T, dir, image string) {
	t.Helper()
	sock := filepath.Join(dir, "containerd.sock")
	cfg := filepath.Join(dir, "containerd.toml")
	conf := fmt.Sprintf("version = 2\nroot = %q\nstate = %q\n[grpc]\n  address = %q\n[plugins.\"io.containerd.grpc.v1.cri\"]\n  restrict_oom_score_adj = true\n",
		filepath.Join(dir, "ctrd-root"), filepath.Join(dir, "ctrd-state"), sock)
	if err := os.WriteFile(cfg, []byte(conf), 0o644); err != nil {
		t.Fatal(err)
	}
	var logs bytes.Buffer
	cmd := exec.Command("containerd", "--config", cfg)
	cmd.Stdout, cmd.Stderr = &logs, &logs
	cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true}
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	defer func() {
		_ = syscall.Kill(-cmd.Process.Pid, syscall.SIGKILL)
		_ = cmd.Wait()
	}()
	ctr := func(args ...string) ([]byte, error) {
		return exec.Command("ctr", append([]string{"--address", sock, "-n", "k8s.io"}, args...)...).CombinedOutput()
	}
	deadline := time.Now().Add(30 * time.Second)
	for { // containerd has no readiness signal but its socket answering
		if _, err := ctr("version"); err == nil {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("containerd did not start:\n%s", logs.String())
		}
		time.Sleep(50 * time.Millisecond)
	}
	if b, err := ctr("images", "import", image); err != nil {
		t.Fatalf("ctr images import: %v\n%s", err, b)
	}
	b, err := ctr("images", "ls", "-q")
	if err != nil || !strings.Contains(string(b), tag+"\n") || !strings.Contains(string(b), tag+"-distroless\n") {
		t.Fatalf("image not in containerd after import: %v\n%s", err, b)
	}
}
