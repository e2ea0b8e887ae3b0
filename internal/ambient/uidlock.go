package ambient

import "sync"

// lockByUID serialises the steps of one pod (its ADD, its reconcile, its
// verify) while different pods proceed in parallel. Entries exist only
// while held or waited for.
type lockByUID struct {
	mu    sync.Mutex
	locks map[string]*uidEntry
}

type uidEntry struct {
	mu   sync.Mutex
	refs int
}

func newLockByUID() *lockByUID { return &lockByUID{locks: map[string]*uidEntry{}} }

func (l *lockByUID) lock(uid string) (unlock func()) {
	l.mu.Lock()
	e := l.locks[uid]
	if e == nil {
		e = &uidEntry{}
		l.locks[uid] = e
	}
	e.refs++
	l.mu.Unlock()
	e.mu.Lock()
	return func() {
		e.mu.Unlock()
		l.mu.Lock()
		e.refs--
		if e.refs == 0 {
			delete(l.locks, uid)
		}
		l.mu.Unlock()
	}
}
