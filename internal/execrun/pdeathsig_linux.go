package execrun

import "syscall"

// dieWithParent has the kernel kill the child when its parent dies.
func dieWithParent() *syscall.SysProcAttr {
	return &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
}
