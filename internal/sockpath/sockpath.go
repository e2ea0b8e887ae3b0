// Package sockpath keeps a listening Unix socket reachable at its path.
//
// A Unix socket is found by its path, and whoever unlinks the path cuts
// every new client off while the listener lives on. On a node that happens
// when two agents overlap: an Istio agent that stops after ours started (a
// migration, an update with maxSurge) closes its listener on the same
// path, and Go's listeners unlink their path on close; ztunnel then never
// reaches us again, and relays find no agent. So each socket gets a second
// name, a hard link beside it, and a path found missing is linked back to
// the same socket, which keeps its connections and its identity.
//
// A path that holds another socket is left alone: a newer agent owns it,
// and this one is Displaced.
package sockpath

import (
	"errors"
	"log/slog"
	"os"
	"path/filepath"
	"sync"
	"time"

	"golang.org/x/sys/unix"
)

// Identity is a file's device and inode, not following a final link.
func Identity(path string) ([2]uint64, error) {
	var st unix.Stat_t
	if err := unix.Lstat(path, &st); err != nil {
		return [2]uint64{}, err
	}
	return [2]uint64{uint64(st.Dev), st.Ino}, nil
}

// KeepName is the second name of the socket at path.
func KeepName(path string) string {
	return filepath.Join(filepath.Dir(path), "."+filepath.Base(path)+".keep")
}

// Interval is how often a Keeper looks at its path.
const Interval = 500 * time.Millisecond

// State is what a check found.
type State int

const (
	// Ours: the path leads to our socket.
	Ours State = iota
	// Missing: the path was gone at this check only; the next check puts
	// it back if it is still gone. A process that replaces a socket by
	// removing and binding again (Istio's agents do) is not raced.
	Missing
	// Restored: the path was gone at two checks in a row and leads to our
	// socket again.
	Restored
	// Displaced: the path holds another socket (or once did).
	Displaced
	// Lost: the path is gone and so is the second name, or it no longer
	// leads to our socket: nothing can put the path back.
	Lost
)

// Keeper keeps one socket's path.
type Keeper struct {
	path, keep string
	id         [2]uint64
	log        *slog.Logger

	mu        sync.Mutex
	missing   bool
	displaced bool
	lost      bool
	closed    bool
	// orphaned is when Orphaned first saw the socket out of reach.
	orphaned time.Time
	stop     chan struct{}
	done     chan struct{}
}

// Keep gives the socket at path (of identity id) its second name,
// replacing one an earlier agent left, and checks the path every interval
// (none: Interval; negative: only when Check is called) until Close.
func Keep(path string, id [2]uint64, interval time.Duration, log *slog.Logger) (*Keeper, error) {
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	k := &Keeper{path: path, keep: KeepName(path), id: id, log: log, stop: make(chan struct{}), done: make(chan struct{})}
	err := os.Remove(k.keep)
	if err == nil || errors.Is(err, os.ErrNotExist) {
		err = os.Link(path, k.keep)
	}
	if err != nil {
		// A file system or policy without hard links: the socket serves
		// all the same, and a path another process removes stays gone
		// (Orphaned says so, for the liveness probe).
		log.Warn("cannot give the socket a second name; if another process removes its path, it cannot be put back", "socket", path, "error", err.Error())
		k.keep = ""
	} else if kid, err := Identity(k.keep); err != nil || kid != id {
		// The path changed between the caller's bind and the link.
		_ = os.Remove(k.keep)
		return nil, errors.New("sockpath: " + path + " changed while it was being kept")
	}
	if interval == 0 {
		interval = Interval
	}
	if interval < 0 {
		close(k.done)
		return k, nil
	}
	go k.run(interval)
	return k, nil
}

func (k *Keeper) run(interval time.Duration) {
	defer close(k.done)
	t := time.NewTicker(interval)
	defer t.Stop()
	for {
		select {
		case <-k.stop:
			return
		case <-t.C:
			if s := k.Check(); s == Displaced || s == Lost {
				return
			}
		}
	}
}

// Check looks at the path once and puts it back when it has been gone
// since the previous check.
func (k *Keeper) Check() State {
	k.mu.Lock()
	defer k.mu.Unlock()
	switch {
	case k.closed:
		return Ours
	case k.displaced:
		return Displaced
	case k.lost:
		return Lost
	}
	id, err := Identity(k.path)
	switch {
	case err == nil && id == k.id:
		k.missing = false
		return Ours
	case err == nil:
		k.displaced = true
		k.log.Info("another process's socket replaced ours at its path (a newer agent's); leaving it to that one", "socket", k.path)
		return Displaced
	case !errors.Is(err, os.ErrNotExist):
		return Ours
	case !k.missing:
		k.missing = true
		return Missing
	}
	if kid, err := Identity(k.keep); k.keep == "" || err != nil || kid != k.id {
		k.lost = true
		k.log.Error("our socket's path was removed and its second name is gone too; new clients cannot connect until the agent restarts", "socket", k.path, "second_name", k.keep)
		return Lost
	}
	if err := os.Link(k.keep, k.path); err != nil {
		// Made again meanwhile: the next check says by whom.
		return Missing
	}
	k.missing = false
	k.log.Warn("our socket's path was removed by another process (an agent stopping on this node, such as Istio's); put it back", "socket", k.path)
	return Restored
}

// Displaced says whether the path holds another socket now, or did at a
// check: another agent took the node over.
func (k *Keeper) Displaced() bool {
	k.mu.Lock()
	defer k.mu.Unlock()
	if !k.displaced {
		if id, err := Identity(k.path); err == nil && id != k.id {
			k.displaced = true
		}
	}
	return k.displaced
}

// Close stops checking, then removes the path while it is still ours, so
// no client connects to a closing server, and the second name. It says
// whether the path held another socket (see Displaced).
func (k *Keeper) Close() (displaced bool) {
	k.mu.Lock()
	if k.closed {
		k.mu.Unlock()
		return k.Displaced()
	}
	k.closed = true
	close(k.stop)
	k.mu.Unlock()
	<-k.done
	displaced = k.Displaced()
	RemoveIfSame(k.path, k.id)
	if k.keep != "" {
		RemoveIfSame(k.keep, k.id)
	}
	return displaced
}

// RemoveIfSame removes path while it is the file of identity id, not a
// newer agent's that replaced it.
func RemoveIfSame(path string, id [2]uint64) {
	if cur, err := Identity(path); err == nil && cur == id {
		_ = os.Remove(path)
	}
}

// Orphaned says why no client can reach the socket by its path any more
// while nothing will put the path back, and since when that was first
// seen; "" while the path is ours, can be put back, or is a live newer
// agent's. A displaced socket whose path then went (the newer agent
// stopped: a rollback, a surge pod that failed) is orphaned, and so is one
// whose two names were both removed: only a restart binds it again.
func (k *Keeper) Orphaned() (string, time.Time) {
	k.mu.Lock()
	defer k.mu.Unlock()
	why := ""
	if !k.closed {
		_, err := Identity(k.path)
		gone := errors.Is(err, os.ErrNotExist)
		switch {
		case k.lost && gone:
			why = "its path was removed and cannot be put back"
		case k.displaced && gone:
			why = "another agent's socket took its path, and that agent has gone"
		}
	}
	if why == "" {
		k.orphaned = time.Time{}
		return "", time.Time{}
	}
	if k.orphaned.IsZero() {
		k.orphaned = time.Now()
	}
	return k.path + ": " + why, k.orphaned
}
