package nlsteps

import (
	"container/list"
	"fmt"
	"sync"
)

// Cache keeps prepared transactions by key (a backend and a plan's
// fingerprint), the most recently used first, within a byte budget: the
// pods of one Deployment share a plan, so a burst of them is prepared
// once. Concurrent callers of one key share one preparation.
type Cache struct {
	mu      sync.Mutex
	budget  int
	size    int
	order   *list.List // of *cacheEntry, most recent first
	entries map[string]*list.Element
	pending map[string]*pendingPrep
}

type cacheEntry struct {
	key  string
	txn  *Txn
	size int
}

type pendingPrep struct {
	done chan struct{}
	txn  *Txn
	err  error
}

// MaxTxn bounds a transaction handed to a relay: far above any plan but
// one with thousands of rules (a list of interfaces is a rule per entry),
// which the agent applies itself rather than pass megabytes through the
// socket. A cache keeps a larger one as its size alone (Oversize), so it
// is not prepared again only to be refused.
const MaxTxn = 1 << 20

// NewCache returns a cache holding at most budget bytes of messages.
func NewCache(budget int) *Cache {
	return &Cache{budget: budget, order: list.New(), entries: map[string]*list.Element{}, pending: map[string]*pendingPrep{}}
}

// Get returns the transaction of key, preparing it with prepare when the
// cache lacks it; hit says it was there.
func (c *Cache) Get(key string, prepare func() (*Txn, error)) (txn *Txn, hit bool, err error) {
	c.mu.Lock()
	if e, ok := c.entries[key]; ok {
		c.order.MoveToFront(e)
		c.mu.Unlock()
		return e.Value.(*cacheEntry).txn, true, nil
	}
	if p, ok := c.pending[key]; ok {
		c.mu.Unlock()
		<-p.done
		return p.txn, p.err == nil, p.err
	}
	p := &pendingPrep{done: make(chan struct{})}
	c.pending[key] = p
	c.mu.Unlock()

	// A panicking prepare (which the agent recovers from, failing that
	// command) must not leave the key pending: every later caller of it
	// would wait for ever, holding its namespace's locks.
	defer func() {
		if r := recover(); r != nil {
			c.mu.Lock()
			delete(c.pending, key)
			c.mu.Unlock()
			p.txn, p.err = nil, fmt.Errorf("preparing the requests panicked: %v", r)
			close(p.done)
			panic(r)
		}
	}()
	p.txn, p.err = prepare()
	if p.err == nil {
		if size := p.txn.Size(); size > MaxTxn {
			p.txn = &Txn{Summary: p.txn.Summary, Oversize: size}
		}
	}
	c.mu.Lock()
	delete(c.pending, key)
	if p.err == nil {
		c.add(key, p.txn)
	}
	c.mu.Unlock()
	close(p.done)
	return p.txn, false, p.err
}

func (c *Cache) add(key string, t *Txn) {
	size := t.Size()
	if size > c.budget {
		return
	}
	c.entries[key] = c.order.PushFront(&cacheEntry{key: key, txn: t, size: size})
	c.size += size
	for c.size > c.budget {
		last := c.order.Back()
		e := last.Value.(*cacheEntry)
		c.order.Remove(last)
		delete(c.entries, e.key)
		c.size -= e.size
	}
}

// Len is the number of transactions held.
func (c *Cache) Len() int {
	c.mu.Lock()
	defer c.mu.Unlock()
	return len(c.entries)
}

// Size is the bytes of messages a transaction holds, roughly what it
// costs to keep.
func (t *Txn) Size() int {
	n := len(t.Summary)
	for _, steps := range [][]Step{t.Steps, t.Undo} {
		for _, s := range steps {
			n += len(s.Msgs)
			for _, w := range s.What {
				n += len(w) + 16
			}
		}
	}
	return n
}
