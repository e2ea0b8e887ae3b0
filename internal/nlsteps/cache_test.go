package nlsteps

import (
	"strings"
	"sync"
	"testing"
	"time"
)

func txnOf(size int) *Txn {
	s := Step{Proto: 12}
	s.Add(1, 0, make([]byte, size), "x")
	return &Txn{Steps: []Step{s}, Summary: "t"}
}

// TestCacheKeepsWithinBudget: a key is prepared once; the least recently
// used go first when the budget is spent; a transaction over MaxTxn is
// kept as its size alone, and not prepared again.
func TestCacheKeepsWithinBudget(t *testing.T) {
	c := NewCache(2500)
	prepared := map[string]int{}
	get := func(key string, size int) (*Txn, bool) {
		txn, hit, err := c.Get(key, func() (*Txn, error) { prepared[key]++; return txnOf(size), nil })
		if err != nil {
			t.Fatal(err)
		}
		return txn, hit
	}
	if _, hit := get("a", 900); hit {
		t.Fatal("a hit on an empty cache")
	}
	if _, hit := get("a", 900); !hit || prepared["a"] != 1 {
		t.Fatalf("a second get of a was not a hit (%d preparations)", prepared["a"])
	}
	get("b", 900)
	get("a", 900) // a is now the most recent
	get("c", 900) // over budget: b goes
	if _, hit := get("b", 900); hit || prepared["b"] != 2 {
		t.Fatalf("b was kept past the budget (%d preparations)", prepared["b"])
	}
	big, _ := get("big", MaxTxn+1)
	if big.Oversize <= MaxTxn || len(big.Steps) != 0 {
		t.Fatalf("an oversize transaction came back as %+v", big)
	}
	if again, hit := get("big", MaxTxn+1); !hit || again.Oversize != big.Oversize || prepared["big"] != 1 {
		t.Fatalf("an oversize transaction was prepared again: %d", prepared["big"])
	}
}

// TestCacheOnePreparationPerKey: pods of one plan arriving together wait
// for one preparation and share it.
func TestCacheOnePreparationPerKey(t *testing.T) {
	c := NewCache(1 << 20)
	release := make(chan struct{})
	var mu sync.Mutex
	calls := 0
	var wg sync.WaitGroup
	got := make([]*Txn, 8)
	for i := range got {
		wg.Add(1)
		go func() {
			defer wg.Done()
			txn, _, err := c.Get("k", func() (*Txn, error) {
				mu.Lock()
				calls++
				mu.Unlock()
				<-release
				return txnOf(10), nil
			})
			if err != nil {
				t.Error(err)
			}
			got[i] = txn
		}()
	}
	close(release)
	wg.Wait()
	if calls != 1 {
		t.Fatalf("%d preparations for one key", calls)
	}
	for _, g := range got {
		if g != got[0] {
			t.Fatal("callers got different transactions")
		}
	}
	if !strings.Contains(got[0].Describe(), "x") {
		t.Fatalf("describe: %q", got[0].Describe())
	}
}

// TestCachePanickingPreparation: a preparation that panics passes the
// panic to its caller, fails the callers waiting for it, and leaves the
// key to be prepared again: nothing waits for it for ever.
func TestCachePanickingPreparation(t *testing.T) {
	c := NewCache(1 << 20)
	started, release := make(chan struct{}), make(chan struct{})
	recovered := make(chan any, 1)
	go func() {
		defer func() { recovered <- recover() }()
		_, _, _ = c.Get("k", func() (*Txn, error) {
			close(started)
			<-release
			panic("compile bug")
		})
	}()
	<-started
	// Waiting for the panicking preparation, or, arriving after it,
	// preparing anew: either way it returns.
	waited := make(chan error, 1)
	go func() {
		_, _, err := c.Get("k", func() (*Txn, error) { return txnOf(10), nil })
		waited <- err
	}()
	close(release)
	if r := <-recovered; r != "compile bug" {
		t.Fatalf("the preparing caller recovered %v", r)
	}
	select {
	case err := <-waited:
		if err != nil && !strings.Contains(err.Error(), "panicked: compile bug") {
			t.Fatalf("a waiting caller: %v", err)
		}
	case <-time.After(10 * time.Second):
		t.Fatal("a caller of the key still waits for a preparation that panicked")
	}
	txn, _, err := c.Get("k", func() (*Txn, error) { return txnOf(10), nil })
	if err != nil || txn == nil {
		t.Fatalf("preparing the key again: %v", err)
	}
}
