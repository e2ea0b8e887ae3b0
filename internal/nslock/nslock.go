// Package nslock serialises the node agent's work on one network
// namespace: the CNI commands it runs for the relay and the repair
// controller's rules both read a namespace's rules and then write them, and
// two such passes at once make one of them fail ("Chain already exists")
// or write over what the other just wrote.
//
// A namespace is known by its nsfs inode, whatever path or descriptor
// names it: the runtime's bind mount, a descriptor the relay passed, or
// /proc/<pid>/ns/net of a process inside it all lead to the same lock.
package nslock

import (
	"fmt"
	"os"
	"sync"

	"golang.org/x/sys/unix"
)

// Key identifies a network namespace.
type Key struct{ Dev, Ino uint64 }

// Keyed hands out one mutex per key. Mutexes exist only while someone
// holds or waits for them, so a node's churn of pods does not grow it.
// Namespaces are its first keys (Locker); ambient mode also serialises
// each pod's steps by its UID.
type Keyed[K comparable] struct {
	mu    sync.Mutex
	locks map[K]*entry
}

type entry struct {
	mu   sync.Mutex
	refs int
}

// NewKeyed returns an empty lock per key.
func NewKeyed[K comparable]() *Keyed[K] { return &Keyed[K]{locks: map[K]*entry{}} }

// Lock takes k's lock and returns the function that releases it.
func (l *Keyed[K]) Lock(k K) (unlock func()) {
	l.mu.Lock()
	e := l.locks[k]
	if e == nil {
		e = &entry{}
		l.locks[k] = e
	}
	e.refs++
	l.mu.Unlock()
	e.mu.Lock()
	return func() {
		e.mu.Unlock()
		l.mu.Lock()
		e.refs--
		if e.refs == 0 {
			delete(l.locks, k)
		}
		l.mu.Unlock()
	}
}

// Held is the number of keys whose lock is held or waited for.
func (l *Keyed[K]) Held() int {
	l.mu.Lock()
	defer l.mu.Unlock()
	return len(l.locks)
}

// Locker hands out one mutex per network namespace.
type Locker = Keyed[Key]

// New returns an empty locker.
func New() *Locker { return NewKeyed[Key]() }

// KeyOfFile is the key of the namespace an open descriptor refers to.
func KeyOfFile(f *os.File) (Key, error) {
	var st unix.Stat_t
	if err := unix.Fstat(int(f.Fd()), &st); err != nil {
		return Key{}, fmt.Errorf("reading the network namespace descriptor: %w", err)
	}
	return Key{uint64(st.Dev), st.Ino}, nil
}

// KeyOfPath is the key of the namespace at path (a bind mount, or
// /proc/<pid>/ns/net).
func KeyOfPath(path string) (Key, error) {
	var st unix.Stat_t
	if err := unix.Stat(path, &st); err != nil {
		return Key{}, fmt.Errorf("reading the network namespace %s: %w", path, err)
	}
	return Key{uint64(st.Dev), st.Ino}, nil
}
