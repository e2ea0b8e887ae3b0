package e2e

import (
	"encoding/json"
	"math/rand"
	"os"
	"path/filepath"
	"reflect"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/containernetworking/cni/libcni"

	"github.com/istio-cni-go/istio-cni/internal/install"
)

// checkConfDir asserts what a runtime would find: a primary config that
// libcni loads, holding every plugin of the original, unchanged.
func checkConfDir(t *testing.T, dir string, origPlugins []any) {
	t.Helper()
	primary, _, err := install.FindPrimary(dir, "")
	if err != nil {
		t.Fatalf("no valid config left: %v", err)
	}
	list, err := libcni.ConfListFromFile(primary)
	if err != nil {
		t.Fatalf("libcni rejects %s: %v", primary, err)
	}
	var plugins []any
	for _, p := range list.Plugins {
		var m any
		if err := json.Unmarshal(p.Bytes, &m); err != nil {
			t.Fatal(err)
		}
		if m.(map[string]any)["type"] != "istio-cni" {
			plugins = append(plugins, m)
		}
	}
	if !reflect.DeepEqual(plugins, origPlugins) {
		t.Fatalf("primary content lost or changed in %s:\n%v", primary, plugins)
	}
}

// TestAgentCrashSafety kills the agent with SIGKILL at random instants
// during install and during clean-up, over a hundred times; after each
// kill the node's CNI config must be valid and complete.
func TestAgentCrashSafety(t *testing.T) {
	ensureDaemonSet(t, false)
	rng := rand.New(rand.NewSource(time.Now().UnixNano()))
	origData, err := os.ReadFile(filepath.Join(primaryDir, "10-calico.conflist"))
	if err != nil {
		t.Fatal(err)
	}
	var orig struct {
		Plugins []any `json:"plugins"`
	}
	if err := json.Unmarshal(origData, &orig); err != nil {
		t.Fatal(err)
	}
	h := newHost(t)
	calico := filepath.Join(h.NetDir, "10-calico.conflist")
	copyFile(t, filepath.Join(primaryDir, "10-calico.conflist"), calico)
	kills := 0
	for i := 0; i < 60; i++ {
		// During install: any instant from exec to well after readiness.
		h.start("--conflict-limit", "1000")
		time.Sleep(time.Duration(rng.Intn(40000)) * time.Microsecond) // the random kill instant is the point
		h.Kill()
		kills++
		checkConfDir(t, h.NetDir, orig.Plugins)

		// During clean-up: SIGTERM, then SIGKILL a moment later.
		h.start("--conflict-limit", "1000")
		h.waitReadyz(200, 20*time.Second)
		h.Signal(syscall.SIGTERM)
		time.Sleep(time.Duration(rng.Intn(3000)) * time.Microsecond) // the random kill instant is the point
		h.Kill()
		kills++
		checkConfDir(t, h.NetDir, orig.Plugins)
	}
	// A last clean start and stop leaves no temp files behind.
	h.start()
	h.waitReadyz(200, 20*time.Second)
	if code := h.stop(syscall.SIGTERM); code != 0 {
		t.Fatalf("exit %d", code)
	}
	entries, _ := os.ReadDir(h.NetDir)
	for _, e := range entries {
		if strings.Contains(e.Name(), "tmp") {
			t.Fatalf("temp file left: %s", e.Name())
		}
	}
	checkConfDir(t, h.NetDir, orig.Plugins)
	t.Logf("%d kills, config valid and complete after each", kills)
}
