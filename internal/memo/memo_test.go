package memo

import (
	"errors"
	"fmt"
	"strings"
	"sync"
	"testing"
)

func TestLRUKeepsWithinBudget(t *testing.T) {
	// Each entry counts its 10-byte key and 10 bytes of value: three fit
	// in 60 bytes.
	m := New[int](60, func(int) int { return 10 })
	calls := 0
	get := func(k string) int {
		v, err := m.Get([]byte(k), func() (int, error) { calls++; return len(k) * 100, nil })
		if err != nil {
			t.Fatal(err)
		}
		return v
	}
	for _, k := range []string{"aaaaaaaaaa", "bbbbbbbbbb", "cccccccccc"} {
		if v := get(k); v != 1000 {
			t.Fatalf("%s = %d", k, v)
		}
	}
	if calls != 3 || m.Len() != 3 {
		t.Fatalf("%d computations, %d kept; want 3, 3", calls, m.Len())
	}
	get("aaaaaaaaaa") // used last: "b" is now the oldest
	if calls != 3 {
		t.Fatalf("a kept value was computed again (%d computations)", calls)
	}
	get("dddddddddd")
	if m.Len() != 3 {
		t.Fatalf("%d kept over a budget of 3", m.Len())
	}
	get("aaaaaaaaaa")
	get("cccccccccc")
	if calls != 4 {
		t.Fatalf("%d computations; a and c should have been kept", calls)
	}
	get("bbbbbbbbbb")
	if calls != 5 {
		t.Fatalf("%d computations; b, the least recently used, should have been dropped", calls)
	}
}

func TestLRUKeepsNoErrorsAndNothingOverBudget(t *testing.T) {
	m := New[string](100, func(v string) int { return len(v) })
	bad := errors.New("bad")
	if _, err := m.Get([]byte("k"), func() (string, error) { return "", bad }); !errors.Is(err, bad) {
		t.Fatalf("error %v, want %v", err, bad)
	}
	if v, err := m.Get([]byte(strings.Repeat("x", 98)), func() (string, error) { return "big", nil }); err != nil || v != "big" {
		t.Fatalf("got %q, %v", v, err)
	}
	if m.Len() != 0 {
		t.Fatalf("%d kept: neither a failure nor a value larger than the budget should be", m.Len())
	}
}

func TestLRUConcurrent(t *testing.T) {
	m := New[string](1<<10, func(v string) int { return len(v) })
	var wg sync.WaitGroup
	for g := 0; g < 8; g++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for i := 0; i < 500; i++ {
				k := fmt.Sprintf("key-%d", i%70)
				v, err := m.Get([]byte(k), func() (string, error) { return "v" + k, nil })
				if err != nil || v != "v"+k {
					t.Errorf("%s = %q, %v", k, v, err)
					return
				}
			}
		}()
	}
	wg.Wait()
	if m.size > m.budget {
		t.Fatalf("%d bytes kept over a budget of %d", m.size, m.budget)
	}
}
