//go:build !linux

package execrun

import "syscall"

// dieWithParent: only Linux has a parent-death signal.
func dieWithParent() *syscall.SysProcAttr { return nil }
