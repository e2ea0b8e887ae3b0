package main

import (
	"bufio"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"time"
)

// A burst's latency follows from the CPU it needs once the machine is
// saturated, so the parallel series also count CPU, split by who spends
// it: the runtime (this process, running libcni), the plugin processes it
// starts (ptp, host-local, the istio-cni relay, any fallback), and the
// node agent with its children (iptables-restore). All three counters are
// exact (scheduler time), not tick samples.

// cpuGroup is a cgroup v2 group holding the agent and its children, for
// their CPU time.
type cpuGroup struct{ dir, root string }

func newCPUGroup(name string) (*cpuGroup, error) {
	root, err := cgroup2Mount()
	if err != nil {
		return nil, err
	}
	dir := filepath.Join(root, fmt.Sprintf("%s-%d", name, os.Getpid()))
	if err := os.Mkdir(dir, 0o755); err != nil {
		return nil, err
	}
	return &cpuGroup{dir: dir, root: root}, nil
}

func cgroup2Mount() (string, error) {
	f, err := os.Open("/proc/self/mountinfo")
	if err != nil {
		return "", err
	}
	defer f.Close()
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		// Fields: id parent major:minor root mountpoint opts... - fstype source superopts
		fields := strings.Fields(sc.Text())
		for i, fld := range fields {
			if fld == "-" && i+1 < len(fields) && fields[i+1] == "cgroup2" {
				return fields[4], nil
			}
		}
	}
	return "", errors.New("no cgroup2 hierarchy mounted")
}

func (g *cpuGroup) add(pid int) error {
	return os.WriteFile(filepath.Join(g.dir, "cgroup.procs"), []byte(strconv.Itoa(pid)), 0o644)
}

// usage is the group's total CPU time so far.
func (g *cpuGroup) usage() (time.Duration, error) {
	data, err := os.ReadFile(filepath.Join(g.dir, "cpu.stat"))
	if err != nil {
		return 0, err
	}
	for _, line := range strings.Split(string(data), "\n") {
		if v, ok := strings.CutPrefix(line, "usage_usec "); ok {
			us, err := strconv.ParseInt(v, 10, 64)
			return time.Duration(us) * time.Microsecond, err
		}
	}
	return 0, errors.New("cpu.stat has no usage_usec")
}

// close moves anything left back to the root group and removes the group.
func (g *cpuGroup) close() {
	if data, err := os.ReadFile(filepath.Join(g.dir, "cgroup.procs")); err == nil {
		for _, pid := range strings.Fields(string(data)) {
			_ = os.WriteFile(filepath.Join(g.root, "cgroup.procs"), []byte(pid), 0o644)
		}
	}
	_ = os.Remove(g.dir)
}

// cpuSplit is CPU time by spender.
type cpuSplit struct{ runtime, plugins, agent time.Duration }

func (c cpuSplit) total() time.Duration { return c.runtime + c.plugins + c.agent }

func (c cpuSplit) sub(o cpuSplit) cpuSplit {
	return cpuSplit{c.runtime - o.runtime, c.plugins - o.plugins, c.agent - o.agent}
}

func (c cpuSplit) add(o cpuSplit) cpuSplit {
	return cpuSplit{c.runtime + o.runtime, c.plugins + o.plugins, c.agent + o.agent}
}

// div is c shared among n pods; none counts as one.
func (c cpuSplit) div(n int) cpuSplit {
	d := time.Duration(max(n, 1))
	return cpuSplit{c.runtime / d, c.plugins / d, c.agent / d}
}

func rusage(who int) (time.Duration, error) {
	var ru syscall.Rusage
	if err := syscall.Getrusage(who, &ru); err != nil {
		return 0, err
	}
	return time.Duration(ru.Utime.Nano() + ru.Stime.Nano()), nil
}

// cpuNow reads the three counters. Plugin processes count once libcni has
// waited for them, which it does before a command returns.
func (b *bench) cpuNow() (cpuSplit, error) {
	var c cpuSplit
	var err1, err2, err3 error
	c.runtime, err1 = rusage(syscall.RUSAGE_SELF)
	c.plugins, err2 = rusage(syscall.RUSAGE_CHILDREN)
	if b.agentCPU != nil {
		c.agent, err3 = b.agentCPU.usage()
	}
	return c, errors.Join(err1, err2, err3)
}

// ownCPU is this process's CPU time and that of its waited-for children.
func ownCPU() (time.Duration, error) {
	self, err1 := rusage(syscall.RUSAGE_SELF)
	kids, err2 := rusage(syscall.RUSAGE_CHILDREN)
	return self + kids, errors.Join(err1, err2)
}
