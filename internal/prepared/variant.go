package prepared

import (
	"errors"
	"io"
	"io/fs"
	"os"
	"path/filepath"
	"strings"
	"syscall"
)

// VariantName is the file in the run directory in which the node agent
// names the iptables variant its FORCE_IPTABLES_BINARY forces. The
// fallback runs in the runtime's environment, not the agent's: it reads
// the variant there, so that a pod gets the same rules whichever serves
// it, and a CHECK, served by either, looks where they are.
const VariantName = "iptables-variant"

// WriteForcedVariant says in runDir that the agent forces variant ("legacy" or
// "nft"); "" removes what an earlier agent said. The file is replaced
// whole by a rename, so a reader never sees a part of it.
func WriteForcedVariant(runDir, variant string) error {
	path := filepath.Join(runDir, VariantName)
	if variant == "" {
		if err := os.Remove(path); err != nil && !errors.Is(err, fs.ErrNotExist) {
			return err
		}
		return nil
	}
	return Dir(runDir).writeMode(VariantName, []byte(variant+"\n"), 0o644)
}

// ReadForcedVariant is the variant the agent said it forces in runDir, or ""
// when it said none. Only this user's (root's) regular file, which no
// other user can write, is read: the variant decides where a pod's rules
// go.
func ReadForcedVariant(runDir string) string {
	f, err := os.OpenFile(filepath.Join(runDir, VariantName), os.O_RDONLY|syscall.O_NOFOLLOW|syscall.O_NONBLOCK, 0) //nolint:gosec // G304: a file in the run dir the plugin's config names
	if err != nil {
		return ""
	}
	defer f.Close()
	fi, err := f.Stat()
	if err != nil || !fi.Mode().IsRegular() || fi.Mode().Perm()&0o022 != 0 {
		return ""
	}
	if st, ok := fi.Sys().(*syscall.Stat_t); !ok || st.Uid != uint32(os.Geteuid()) { //nolint:gosec // G115: a uid
		return ""
	}
	b, err := io.ReadAll(io.LimitReader(f, 64))
	if err != nil {
		return ""
	}
	switch v := strings.TrimSpace(string(b)); v {
	case "legacy", "nft":
		return v
	}
	return ""
}
