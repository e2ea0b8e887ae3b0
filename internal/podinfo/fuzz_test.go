package podinfo

import (
	"bytes"
	"net/url"
	"os"
	"path/filepath"
	"testing"
)

// FuzzKubeconfig loads arbitrary kubeconfig files: never a panic or a
// hang, and whatever loads names an absolute server URL.
func FuzzKubeconfig(f *testing.F) {
	dir := f.TempDir()
	ca := filepath.Join(dir, "ca.crt")
	if err := os.WriteFile(ca, []byte("not a certificate"), 0o600); err != nil {
		f.Fatal(err)
	}
	for _, s := range []string{
		"apiVersion: v1\nkind: Config\nclusters:\n- name: local\n  cluster:\n    server: https://10.0.0.1:443\n    insecure-skip-tls-verify: true\n" +
			"users:\n- name: istio-cni\n  user:\n    token: abc\ncontexts:\n- name: c\n  context:\n    cluster: local\n    user: istio-cni\ncurrent-context: c\n",
		"clusters:\n- name: a\n  cluster:\n    server: https://[fd00::1]:6443\n    certificate-authority: " + ca + "\n",
		"clusters:\n- name: a\n  cluster:\n    server: https://h\n    certificate-authority: /dev/zero\n",
		"clusters:\n- name: a\n  cluster:\n    server: https://h\nusers:\n- name: u\n  user:\n    tokenFile: /proc/self/fd/0\n",
		"clusters:\n- name: a\n  cluster:\n    server: https://h\n    certificate-authority-data: '!!!'\n",
		"users:\n- name: u\n  user:\n    client-certificate-data: eA==\n    client-key-data: eA==\n",
		"{}", "", "- [", "clusters: 7", "current-context: [x]",
	} {
		f.Add([]byte(s))
	}
	p := filepath.Join(dir, "kubeconfig")
	f.Fuzz(func(t *testing.T, data []byte) {
		if err := os.WriteFile(p, data, 0o600); err != nil {
			t.Fatal(err)
		}
		c, err := NewAPIClient(p, "")
		if err != nil {
			return
		}
		u, err := url.Parse(c.server)
		if err != nil || u.Host == "" {
			t.Fatalf("loaded with server %q", c.server)
		}
		c.CloseIdleConnections()
	})
}

// FuzzSessionFile reads arbitrary TLS session files: never a panic, and
// a hit only for a well-framed file made for the key asked.
func FuzzSessionFile(f *testing.F) {
	f.Add([]byte{}, "key")
	f.Add(joinFields([]byte(sessionMagic), []byte("key"), []byte("ticket"), []byte("state")), "key")
	f.Add(joinFields([]byte(sessionMagic), []byte("key")), "key")
	f.Add([]byte{0xff, 0xff, 0xff, 0xff, 1}, "")
	c := &fileSessionCache{path: filepath.Join(f.TempDir(), SessionCacheName)}
	f.Fuzz(func(t *testing.T, data []byte, key string) {
		if err := os.WriteFile(c.path, data, 0o600); err != nil {
			t.Fatal(err)
		}
		if _, ok := c.Get(key); ok {
			fields, framed := splitFields(data, 4)
			if !framed || string(fields[0]) != sessionMagic || string(fields[1]) != key {
				t.Fatalf("a hit from a file not made for key %q: %q", key, data)
			}
		}
		// Framing round trip: what joinFields writes, splitFields reads back.
		parts := [][]byte{[]byte(sessionMagic), []byte(key), data, bytes.ToUpper(data)}
		got, ok := splitFields(joinFields(parts...), 4)
		if !ok {
			t.Fatal("a framed file does not split")
		}
		for i := range parts {
			if !bytes.Equal(got[i], parts[i]) {
				t.Fatalf("field %d: %q, want %q", i, got[i], parts[i])
			}
		}
		if _, ok := splitFields(append(joinFields(parts...), 0), 4); ok {
			t.Fatal("trailing bytes accepted")
		}
	})
}
