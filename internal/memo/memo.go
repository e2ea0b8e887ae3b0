// Package memo keeps values computed from long inputs by those inputs,
// within a byte budget, the most recently used kept: the pods of one
// Deployment carry the same annotations, and parsing, covering and
// digesting a list of thousands of entries again for each of them was
// most of what such a pod cost the agent. The agent's budgets (parsed
// lists 3 MiB, sets 2 MiB, plans 2 MiB) hold dozens of distinct lists of
// 1,000 entries and hundreds of plans, within 7 MiB of the agent's 40 MB.
package memo

import (
	"container/list"
	"sync"
)

// LRU maps keys to values, counting each entry as its key's length and
// its value's size. Values are shared between callers and must not be
// changed.
type LRU[V any] struct {
	mu      sync.Mutex
	budget  int
	size    int
	sizeOf  func(V) int
	order   *list.List // of *entry[V], most recent first
	entries map[string]*list.Element
}

type entry[V any] struct {
	key  string
	val  V
	cost int
}

// New returns an LRU holding at most budget bytes, reckoning a value's
// size with sizeOf.
func New[V any](budget int, sizeOf func(V) int) *LRU[V] {
	return &LRU[V]{budget: budget, sizeOf: sizeOf, order: list.New(), entries: map[string]*list.Element{}}
}

// Get returns the value of key, computing it with compute when it is not
// kept, and keeping it when compute succeeds. Two callers missing at once
// both compute; the later value replaces the earlier, which equals it.
func (m *LRU[V]) Get(key []byte, compute func() (V, error)) (V, error) {
	m.mu.Lock()
	// Indexing with the conversion does not copy the key.
	if e, ok := m.entries[string(key)]; ok {
		m.order.MoveToFront(e)
		m.mu.Unlock()
		return e.Value.(*entry[V]).val, nil
	}
	m.mu.Unlock()
	v, err := compute()
	if err != nil {
		return v, err
	}
	cost := len(key) + m.sizeOf(v)
	if cost > m.budget {
		return v, nil
	}
	k := string(key)
	m.mu.Lock()
	defer m.mu.Unlock()
	if e, ok := m.entries[k]; ok {
		m.remove(e)
	}
	m.entries[k] = m.order.PushFront(&entry[V]{key: k, val: v, cost: cost})
	m.size += cost
	for m.size > m.budget {
		m.remove(m.order.Back())
	}
	return v, nil
}

func (m *LRU[V]) remove(e *list.Element) {
	x := e.Value.(*entry[V])
	m.order.Remove(e)
	delete(m.entries, x.key)
	m.size -= x.cost
}

// Len is the number of values kept.
func (m *LRU[V]) Len() int {
	m.mu.Lock()
	defer m.mu.Unlock()
	return len(m.entries)
}
