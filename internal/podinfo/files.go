package podinfo

import (
	"fmt"
	"io"
	"os"
	"syscall"
)

// maxFileBytes bounds what is read from a kubeconfig, a CA or token file
// it names, and the TLS session file: each is a few kilobytes.
const maxFileBytes = 1 << 20

// readSmallFile reads a regular file of at most maxFileBytes. A path that
// names a FIFO, a device (/dev/zero) or a huge file fails at once rather
// than blocking a pod's start or filling memory.
func readSmallFile(path string) ([]byte, error) {
	f, err := os.OpenFile(path, os.O_RDONLY|syscall.O_NONBLOCK, 0) //nolint:gosec // G304: the plugin's kubeconfig and the files it names, written by the agent
	if err != nil {
		return nil, err
	}
	defer f.Close()
	fi, err := f.Stat()
	if err != nil {
		return nil, err
	}
	if !fi.Mode().IsRegular() {
		return nil, fmt.Errorf("%s is not a regular file", path)
	}
	data, err := io.ReadAll(io.LimitReader(f, maxFileBytes+1))
	if err != nil {
		return nil, err
	}
	if len(data) > maxFileBytes {
		return nil, fmt.Errorf("%s is larger than %d bytes", path, maxFileBytes)
	}
	return data, nil
}
