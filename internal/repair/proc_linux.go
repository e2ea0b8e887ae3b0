package repair

import (
	"errors"
	"os"
	"strconv"
	"strings"
)

// ErrNoNetNS means the pod has no network namespace on this node.
var ErrNoNetNS = errors.New("no network namespace of the pod on this node")

// startTime reads a process's start time (field 22 of /proc/<pid>/stat),
// so the sandbox's pause process wins over later ones in its namespace.
func startTime(statPath string) uint64 {
	data, err := os.ReadFile(statPath) //nolint:gosec // G304: a process's stat file under the host's /proc
	if err != nil {
		return ^uint64(0)
	}
	s := string(data)
	i := strings.LastIndexByte(s, ')')
	if i < 0 {
		return ^uint64(0)
	}
	fields := strings.Fields(s[i+1:])
	if len(fields) < 20 {
		return ^uint64(0)
	}
	v, err := strconv.ParseUint(fields[19], 10, 64)
	if err != nil {
		return ^uint64(0)
	}
	return v
}
