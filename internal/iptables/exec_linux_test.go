package iptables

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"sort"
	"strings"
	"testing"

	"github.com/istio-cni-go/istio-cni/internal/execrun"
	"github.com/istio-cni-go/istio-cni/internal/podnet"
	"github.com/istio-cni-go/istio-cni/internal/ruleset"
	"github.com/istio-cni-go/istio-cni/internal/testutil"
)

// scriptedTables stands for the namespace's tables: legacy ones where a
// case says so, and tables of a variant wherever its iptables-save has
// something to print.
type scriptedTables struct {
	legacyFams map[ruleset.Family]bool
	saves      map[string]string
}

func (s *scriptedTables) legacy(fam ruleset.Family) bool { return s.legacyFams[fam] }

func (s *scriptedTables) has(v *variant, fam ruleset.Family) (bool, error) {
	return s.saves[filepath.Base(v.save(fam))] != "", nil
}

// execCase is one call of the applier on a pod, with what the pod's
// namespace answers.
type execCase struct {
	name string
	// plan is the redirect case applied ("" removes), v6 with IPv6 rules.
	plan string
	v6   bool
	// saves names, per iptables-save binary, the recorded output it
	// prints (testdata/exec/save/); a binary not named has no tables.
	saves  map[string]string
	legacy map[ruleset.Family]bool
	// userns makes the pod's network namespace belong to a user
	// namespace of its own (hostUsers: false).
	userns bool
	// noNsenter leaves only busybox to enter the user namespace.
	noNsenter bool
	// fail makes the binary named fail, printing the text.
	fail map[string]string
	// check runs Check's part instead of Apply's.
	check bool
}

var (
	basicSaves = map[string]string{"iptables-nft-save": "basic.nft.v4", "ip6tables-nft-save": "basic.nft.v6"}
	staleSaves = map[string]string{"iptables-nft-save": "tproxy-and-foreign.nft.v4", "ip6tables-nft-save": "tproxy-and-foreign.nft.v6"}
)

var execCases = []execCase{
	{name: "fresh-v4", plan: "basic"},
	{name: "fresh-dual", plan: "basic", v6: true},
	{name: "unchanged-dual", plan: "basic", v6: true, saves: basicSaves},
	// Ours are TPROXY rules of an older plan, next to another agent's rule
	// in nat OUTPUT, which stays.
	{name: "replace-dual", plan: "basic", v6: true, saves: staleSaves},
	{name: "remove", plan: "", saves: staleSaves},
	{name: "remove-nothing", plan: ""},
	// Legacy IPv4 tables (another agent's rule only): IPv4 goes legacy,
	// IPv6, with no legacy tables, nft.
	{name: "legacy-detected", plan: "basic", v6: true,
		saves:  map[string]string{"iptables-legacy-save": "foreign.legacy.v4"},
		legacy: map[ruleset.Family]bool{ruleset.IPv4: true}},
	{name: "userns-fresh", plan: "basic", v6: true, userns: true},
	// Reads run plainly, writes in the pod's user namespace.
	{name: "userns-replace", plan: "basic", saves: staleSaves, userns: true},
	{name: "userns-busybox", plan: "basic", userns: true, noNsenter: true},
	{name: "restore-fails", plan: "basic", v6: true,
		fail: map[string]string{"iptables-nft-restore": "iptables-nft-restore v1.8.9 (nf_tables): line 9 failed: No chain/target/match by that name."}},
	// The refused line matches an entry of an annotation's list: the
	// error names the annotation.
	{name: "restore-fails-at-list", plan: "include-exclude-ports", v6: true,
		fail: map[string]string{"ip6tables-nft-restore": "ip6tables-nft-restore v1.8.9 (nf_tables): line 10 failed"}},
	{name: "userns-restore-fails", plan: "basic", userns: true,
		fail: map[string]string{"nsenter": "nsenter: cannot open /proc/self/fd/4: Permission denied"}},
	// Check reads, and writes nothing whatever it finds.
	{name: "check-unchanged", plan: "basic", v6: true, saves: basicSaves, check: true},
	{name: "check-stale", plan: "basic", v6: true, saves: staleSaves, check: true},
	{name: "check-fresh", plan: "basic", check: true},
	{name: "save-fails", plan: "basic", saves: basicSaves,
		fail: map[string]string{"iptables-nft-save": "iptables-nft-save: Could not fetch rule set generation id: Permission denied (you must be root)"}},
}

// TestExecGolden records every command the applier runs for a pod, and
// what it feeds them, through a scripted runner: the decisions to apply,
// replace, remove or leave rules alone, the variant chosen, and how a
// user-namespaced pod's writes are run, all without root. The recorded
// iptables-save outputs are real ones (iptables v1.8.9), taken from a
// namespace holding the plan's rules.
func TestExecGolden(t *testing.T) {
	for _, c := range execCases {
		t.Run(c.name, func(t *testing.T) {
			testutil.CompareGolden(t, filepath.Join("exec", c.name+".golden"), runExecCase(t, c))
		})
	}
}

func runExecCase(t *testing.T, c execCase) string {
	t.Helper()
	dir := t.TempDir()
	open := func(name string) *os.File {
		f, err := os.Create(filepath.Join(dir, name))
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { f.Close() })
		return f
	}
	labels := map[*os.File]string{}
	lock := open("lock")
	labels[lock] = "xtables lock"
	saves := map[string]string{}
	for bin, file := range c.saves {
		data, err := os.ReadFile(filepath.Join("testdata", "exec", "save", file))
		if err != nil {
			t.Fatal(err)
		}
		saves[bin] = string(data)
	}

	var log strings.Builder
	runner := execrun.Func(func(_ context.Context, cmd *execrun.Cmd) (execrun.Result, error) {
		fmt.Fprintf(&log, "$ %s\n", cmd)
		fmt.Fprintf(&log, "  env: %s\n", strings.Join(cmd.Env, " "))
		for i, f := range cmd.ExtraFiles {
			label, ok := labels[f]
			if !ok {
				label = "unknown file " + f.Name()
			}
			fmt.Fprintf(&log, "  fd %d: %s\n", i+3, label)
		}
		if cmd.Stdin != nil {
			log.WriteString("  stdin:\n")
			for _, line := range strings.SplitAfter(strings.TrimSuffix(string(cmd.Stdin), "\n"), "\n") {
				log.WriteString("  | " + line)
			}
			log.WriteString("\n")
		}
		bin := filepath.Base(cmd.Path)
		if stderr, ok := c.fail[bin]; ok {
			return execrun.Result{Stderr: []byte(stderr + "\n")}, &execrun.ExitError{Cmd: cmd.String(), Code: 1, Stderr: stderr + "\n"}
		}
		if strings.HasSuffix(bin, "-save") {
			out, ok := saves[bin]
			if !ok {
				t.Errorf("%s ran on a namespace without its tables", cmd)
			}
			return execrun.Result{Stdout: []byte(out)}, nil
		}
		return execrun.Result{}, nil
	})

	a := &Applier{
		Runner: runner,
		LookPath: func(name string) (string, error) {
			switch {
			case name == "nsenter" && c.noNsenter:
				return "", fmt.Errorf("%s not found", name)
			case name == "nsenter", name == "busybox":
				return "/usr/bin/" + name, nil
			}
			return "/usr/sbin/" + name, nil
		},
	}
	target := &podTarget{
		path:   "/var/run/netns/pod",
		lock:   lock,
		tables: &scriptedTables{legacyFams: c.legacy, saves: saves},
		runner: runner,
	}
	if c.userns {
		target.userns = open("userns")
		labels[target.userns] = "pod user namespace"
		var err error
		if target.nsenter, err = a.nsenter(); err != nil {
			t.Fatal(err)
		}
	}
	plan := &ruleset.Plan{V4: &ruleset.Set{Family: ruleset.IPv4}}
	if c.plan != "" {
		plan = planFor(t, caseNamed(t, c.plan), c.v6)
	}
	var err error
	if c.check {
		var diffs []string
		_, diffs, err = a.diff(target, plan)
		log.WriteString("differences:\n")
		for _, d := range diffs {
			log.WriteString("  " + d + "\n")
		}
	} else {
		var rep podnet.Report
		rep, err = a.apply(target, plan)
		var fams []string
		for _, f := range rep.Families {
			fams = append(fams, fmt.Sprintf("%s %s (%s)", f.Family, f.Action, f.Variant))
		}
		fmt.Fprintf(&log, "report: %s\n", strings.Join(fams, ", "))
	}
	if err != nil {
		fmt.Fprintf(&log, "error: %v\n", err)
	}
	if (err != nil) != (len(c.fail) > 0) {
		t.Errorf("error %v, want one: %v", err, len(c.fail) > 0)
	}
	return log.String()
}

func caseNamed(t *testing.T, name string) testutil.RedirectCase {
	t.Helper()
	for _, c := range testutil.RedirectCases {
		if c.Name == name {
			return c
		}
	}
	t.Fatalf("no redirect case %q", name)
	return testutil.RedirectCase{}
}

// TestExecCasesUseEveryRecording keeps the recorded outputs in use: one
// no case names is a fixture nobody checks.
func TestExecCasesUseEveryRecording(t *testing.T) {
	used := map[string]bool{}
	for _, c := range execCases {
		for _, f := range c.saves {
			used[f] = true
		}
	}
	entries, err := os.ReadDir(filepath.Join("testdata", "exec", "save"))
	if err != nil {
		t.Fatal(err)
	}
	var unused []string
	for _, e := range entries {
		if !used[e.Name()] {
			unused = append(unused, e.Name())
		}
	}
	sort.Strings(unused)
	if len(unused) > 0 {
		t.Errorf("recorded iptables-save outputs no case uses: %v", unused)
	}
}
