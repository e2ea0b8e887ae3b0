package install

import "os"

// The installer reads and writes only at paths the agent's own
// configuration names (the node's CNI config, bin and run dirs, the
// service account mount) and what it finds inside them, never at a path
// from a request: gosec's G304 (file inclusion via a variable) does not
// apply, so it is answered here once instead of at every call.

func readFile(path string) ([]byte, error) {
	return os.ReadFile(path) //nolint:gosec // G304: a configured path, see above
}

func open(path string) (*os.File, error) {
	return os.Open(path) //nolint:gosec // G304: a configured path, see above
}

func openFile(path string, flag int, mode os.FileMode) (*os.File, error) {
	return os.OpenFile(path, flag, mode) //nolint:gosec // G304: a configured path, see above
}
