package logging

import "sync"

var (
	onceMu   sync.Mutex
	onceSeen = map[[2]string]bool{}
)

// FirstTime reports whether (key, value) is seen for the first time in
// this process, so that a setting that is wrong on every pod is reported
// once, not on every ADD. It remembers a bounded number of pairs: past
// that a long-running agent reports again rather than grow.
func FirstTime(key, value string) bool {
	onceMu.Lock()
	defer onceMu.Unlock()
	k := [2]string{key, value}
	if onceSeen[k] {
		return false
	}
	if len(onceSeen) >= 256 {
		clear(onceSeen)
	}
	onceSeen[k] = true
	return true
}
