package installloop

import (
	"log/slog"
	"path/filepath"
	"sync"
	"time"

	"github.com/fsnotify/fsnotify"
	"golang.org/x/sys/unix"
)

// watchSet watches the agent's directories and keeps watching them: an
// inotify watch belongs to a directory's inode, so a directory deleted and
// created again, or replaced, needs a new watch; a missing directory is
// found again through its parent's events and the periodic resync.
type watchSet struct {
	log  *slog.Logger
	dirs []string
	// extra is the directory a symbolic link to the primary config leads
	// into, when that is not the config dir itself ("" when none).
	extra string
	w     *fsnotify.Watcher
	// ids are the inodes watched, by directory.
	ids map[string][2]uint64
	// parents are watched while a directory of ours is missing.
	parents map[string]bool

	// started is set once the first sync has added the watches.
	started bool

	mu          sync.Mutex
	missingFrom map[string]time.Time
}

func newWatchSet(dirs []string, log *slog.Logger) (*watchSet, error) {
	s := &watchSet{log: log, ids: map[string][2]uint64{}, parents: map[string]bool{}, missingFrom: map[string]time.Time{}}
	for _, d := range dirs {
		s.dirs = append(s.dirs, filepath.Clean(d))
	}
	w, err := fsnotify.NewWatcher()
	if err != nil {
		return nil, err
	}
	s.w = w
	return s, nil
}

// dirID is the directory's identity; a directory that was deleted (still
// seen through a mount that holds it, with no link left) counts as gone.
func dirID(path string) ([2]uint64, bool) {
	var st unix.Stat_t
	if err := unix.Stat(path, &st); err != nil || st.Nlink == 0 || st.Mode&unix.S_IFMT != unix.S_IFDIR {
		return [2]uint64{}, false
	}
	return [2]uint64{uint64(st.Dev), st.Ino}, true
}

// sync makes the watches match the directories as they are now.
func (s *watchSet) sync() {
	if s.w == nil {
		if w, err := fsnotify.NewWatcher(); err == nil {
			s.w = w
		}
	}
	// A watch the kernel ended (its directory deleted, moved or unmounted)
	// is gone from the watcher's own list, with or without an event. The
	// directory's identity cannot tell: a file system may give a directory
	// made again under the same path the inode number of the one deleted
	// (ext4 does, at once), and the path would look watched while no event
	// of the new directory arrives.
	if s.w != nil {
		live := map[string]bool{}
		for _, p := range s.w.WatchList() {
			live[p] = true
		}
		for d := range s.ids {
			if !live[d] {
				delete(s.ids, d)
			}
		}
	}
	missing := map[string]bool{}
	dirs := s.dirs
	if s.extra != "" {
		dirs = append(dirs[:len(dirs):len(dirs)], s.extra)
	}
	// A directory back under the same path (recreated or replaced) gets a
	// whole new watcher: re-adding it to the old one races the kernel's
	// notice that the old inode's watch is gone, which fsnotify applies by
	// path and so can drop the new watch with it, losing every later event.
	if s.started && s.w != nil {
		for _, d := range dirs {
			id, ok := dirID(d)
			if cur, watched := s.ids[d]; ok && (!watched || cur != id) {
				s.log.Debug("a watched directory is back under its path; replacing the file watcher", "dir", d)
				s.reset()
				break
			}
		}
	}
	s.started = true
	for _, d := range dirs {
		id, ok := dirID(d)
		if !ok {
			if _, watched := s.ids[d]; watched {
				_ = s.w.Remove(d)
				delete(s.ids, d)
			}
			if d != s.extra {
				missing[filepath.Dir(d)] = true
				s.markMissing(d, true)
			}
			continue
		}
		s.markMissing(d, false)
		if cur, watched := s.ids[d]; watched && cur == id {
			continue
		}
		if s.w == nil {
			continue
		}
		// No watch, or one on the inode the path named before.
		_ = s.w.Remove(d)
		delete(s.ids, d)
		if err := s.w.Add(d); err != nil {
			s.log.Warn("cannot watch a directory; the periodic resync covers it", "dir", d, "error", err.Error())
			missing[filepath.Dir(d)] = true
			continue
		}
		s.ids[d] = id
	}
	if s.w == nil {
		return
	}
	for p := range missing {
		if _, ours := s.ids[p]; !ours && !s.parents[p] {
			if err := s.w.Add(p); err == nil {
				s.parents[p] = true
			}
		}
	}
	for p := range s.parents {
		if !missing[p] {
			if _, ours := s.ids[p]; !ours {
				_ = s.w.Remove(p)
			}
			delete(s.parents, p)
		}
	}
}

func (s *watchSet) markMissing(d string, gone bool) {
	s.mu.Lock()
	defer s.mu.Unlock()
	_, was := s.missingFrom[d]
	switch {
	case gone && !was:
		s.missingFrom[d] = time.Now()
	case !gone && was:
		delete(s.missingFrom, d)
	}
}

// follow sets the directory a linked primary config lives in, watched
// besides the others until the link leads elsewhere.
func (s *watchSet) follow(dir string) {
	dir = filepath.Clean(dir)
	for _, d := range s.dirs {
		if d == dir {
			dir = ""
		}
	}
	if dir == s.extra {
		return
	}
	if s.extra != "" && s.w != nil {
		_ = s.w.Remove(s.extra)
		delete(s.ids, s.extra)
	}
	s.extra = dir
	s.sync()
}

// isExtra reports whether dir is the linked config's directory.
func (s *watchSet) isExtra(dir string) bool { return s.extra != "" && filepath.Clean(dir) == s.extra }

// missingSince is when dir went missing (zero while it exists).
func (s *watchSet) missingSince(dir string) time.Time {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.missingFrom[filepath.Clean(dir)]
}

// concerns reports whether an event is about one of the directories
// themselves: deleted, moved, or (seen from its parent) created again.
func (s *watchSet) concerns(ev fsnotify.Event) bool {
	name := filepath.Clean(ev.Name)
	for _, d := range s.dirs {
		if name == d {
			return true
		}
	}
	return false
}

// reset replaces the watcher, after it failed or was closed.
func (s *watchSet) reset() {
	_ = s.w.Close()
	s.ids = map[string][2]uint64{}
	s.parents = map[string]bool{}
	w, err := fsnotify.NewWatcher()
	if err != nil {
		s.log.Error("cannot create a file watcher; relying on the periodic resync", "error", err.Error())
		s.w = nil
		return
	}
	s.w = w
}

func (s *watchSet) events() <-chan fsnotify.Event {
	if s.w == nil {
		return nil
	}
	return s.w.Events
}

func (s *watchSet) errors() <-chan error {
	if s.w == nil {
		return nil
	}
	return s.w.Errors
}

func (s *watchSet) close() {
	if s.w != nil {
		_ = s.w.Close()
	}
}
