package nslock

import (
	"os"
	"sync"
	"testing"

	"github.com/containernetworking/plugins/pkg/ns"
	"github.com/containernetworking/plugins/pkg/testutils"

	"github.com/istio-cni-go/istio-cni/internal/testutil"
)

// TestOneNamespaceOneLock: a bind mount, a descriptor and a process's
// /proc entry of the same namespace share one lock; another namespace has
// its own; nothing is kept once released.
func TestOneNamespaceOneLock(t *testing.T) {
	testutil.RequireRoot(t)
	a, err := testutils.NewNS()
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = testutil.RemoveNS(a) }()
	b, err := testutils.NewNS()
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = testutil.RemoveNS(b) }()

	f, err := os.Open(a.Path())
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	byPath, err := KeyOfPath(a.Path())
	if err != nil {
		t.Fatal(err)
	}
	byFile, err := KeyOfFile(f)
	if err != nil {
		t.Fatal(err)
	}
	var byProc Key
	if err := a.Do(func(ns.NetNS) error {
		var err error
		byProc, err = KeyOfPath("/proc/thread-self/ns/net")
		return err
	}); err != nil {
		t.Fatal(err)
	}
	other, err := KeyOfPath(b.Path())
	if err != nil {
		t.Fatal(err)
	}
	if byPath != byFile || byPath != byProc {
		t.Fatalf("one namespace, three keys: %v %v %v", byPath, byFile, byProc)
	}
	if other == byPath {
		t.Fatal("two namespaces share a key")
	}

	l := New()
	unlock := l.Lock(byPath)
	// Another namespace is not held up.
	l.Lock(other)()
	got := make(chan struct{})
	go func() {
		l.Lock(byFile)()
		close(got)
	}()
	select {
	case <-got:
		t.Fatal("the same namespace's lock was taken twice")
	default:
	}
	unlock()
	<-got
	if n := l.Held(); n != 0 {
		t.Fatalf("%d locks kept after release", n)
	}
}

// TestLockExcludes runs many holders of one key at once: never two inside.
func TestLockExcludes(t *testing.T) {
	l := New()
	k := Key{1, 2}
	var inside, most int
	var mu sync.Mutex
	var wg sync.WaitGroup
	for i := 0; i < 200; i++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			unlock := l.Lock(k)
			mu.Lock()
			inside++
			most = max(most, inside)
			mu.Unlock()
			mu.Lock()
			inside--
			mu.Unlock()
			unlock()
		}()
	}
	wg.Wait()
	if most != 1 || l.Held() != 0 {
		t.Fatalf("at most %d inside at once, %d locks kept", most, l.Held())
	}
}
