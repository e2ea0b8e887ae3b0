package podinfo

import (
	"crypto/tls"
	"path/filepath"
	"testing"
)

func TestDecodeJSON(t *testing.T) {
	p, err := DecodeJSON([]byte(`{"metadata":{"namespace":"ns","name":"web","uid":"u1",
	  "labels":{"app":"web"},"annotations":{"sidecar.istio.io/status":"{}"}},
	 "spec":{"initContainers":[{"name":"istio-proxy","restartPolicy":"Always","args":["proxy","sidecar"],
	   "env":[{"name":"A","value":"1"},{"name":"B","valueFrom":{"fieldRef":{"fieldPath":"x"}}}],
	   "securityContext":{"runAsUser":1000,"runAsGroup":2000}}],
	  "containers":[{"name":"app"}]},
	 "status":{"podIPs":[{"ip":"10.0.0.5"},{"ip":"fd00::5"}]}}`))
	if err != nil {
		t.Fatal(err)
	}
	proxy, ok := p.FindContainer("istio-proxy")
	if !ok || proxy.Env["A"] != "1" || len(proxy.Env) != 1 || *proxy.RunAsUser != 1000 || *proxy.RunAsGroup != 2000 {
		t.Fatalf("proxy: %+v", proxy)
	}
	if p.Namespace != "ns" || p.UID != "u1" || len(p.PodIPs) != 2 || p.Labels["app"] != "web" {
		t.Fatalf("pod: %+v", p)
	}
	if _, err := DecodeJSON([]byte(`{"metadata":`)); err == nil {
		t.Fatal("truncated JSON accepted")
	}
}

func TestValidateName(t *testing.T) {
	if err := ValidateName("default", "web-0.x"); err != nil {
		t.Fatal(err)
	}
	for _, c := range [][2]string{{"Default", "a"}, {"ns", "a/b"}, {"ns", "../x"}, {"", "a"}, {"ns", "a?b"}} {
		if ValidateName(c[0], c[1]) == nil {
			t.Errorf("%q/%q accepted", c[0], c[1])
		}
	}
}

func TestSessionCacheRoundTripIgnoresGarbage(t *testing.T) {
	dir := t.TempDir()
	c := &fileSessionCache{path: filepath.Join(dir, SessionCacheName)}
	if _, ok := c.Get("k"); ok {
		t.Fatal("hit on an empty cache")
	}
	if err := writeFileAtomic(c.path, []byte("garbage"), 0o600); err != nil {
		t.Fatal(err)
	}
	if _, ok := c.Get("k"); ok {
		t.Fatal("hit on a corrupt cache")
	}
	c.Put("k", nil)
	var _ tls.ClientSessionCache = c
}
