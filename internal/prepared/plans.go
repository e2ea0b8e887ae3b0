package prepared

import (
	"bytes"
	"encoding/binary"
	"errors"
	"fmt"
	"hash/fnv"
	"io/fs"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"time"
)

// Stored plans.
//
// Some rule backends prepare a plan's requests at a cost (iptables-nft:
// iptables-nft-restore into a scratch namespace, read back), once per
// distinct plan in the agent. The agent also leaves each such plan's
// requests here, under a name made from the plan's key, so that a
// fallback plugin process, which reads its pod from the API server when
// the agent is behind, sends the same requests instead of running
// iptables-restore itself. The agent empties the directory when it
// starts (Reset), so the plans are the running agent's.

// planPrefix starts a stored plan's file name; no UID starts with it.
const planPrefix = ".plan-"

// planMagic starts a stored plan; the number is its form's version.
const planMagic = "istio-cni plan 1\n"

// planName is the file of the plan with key. The file holds the key
// too (ReadPlan compares it), so two keys of one name only cost one of
// them its stored plan; and the hash links nothing into the relay, which
// imports this package and starts for every pod.
func planName(key string) string {
	h := fnv.New64a()
	_, _ = h.Write([]byte(key))
	return planPrefix + strconv.FormatUint(h.Sum64(), 16)
}

// PlanBudget bounds the bytes of the plans stored at once. The run
// directory is a tmpfs whose pages count against the agent's memory; the
// plans of a node's usual few pod shapes take kilobytes, and a node whose
// pods carry many distinct long lists would otherwise grow it for as long
// as the agent runs. It matches the agent's cache of prepared requests.
const PlanBudget = 4 << 20

// PutPlan stores the requests (an nlsteps.Txn, binary) of the plan with
// key, whole or not at all, and then removes the longest-stored other
// plans while the stored plans exceed PlanBudget. A plan removed only
// sends a fallback to iptables-restore; the agent stores it again when
// it next prepares it.
func (d Dir) PutPlan(key string, txn []byte) error { return d.putPlan(key, txn, PlanBudget) }

func (d Dir) putPlan(key string, txn []byte, budget int64) error {
	b := append([]byte(planMagic), binary.BigEndian.AppendUint32(nil, uint32(len(key)))...)
	b = append(append(b, key...), txn...)
	if len(b) > MaxRecord {
		return fmt.Errorf("the stored plan would be %d bytes, more than a record holds", len(b))
	}
	name := planName(key)
	if err := d.write(name, b); err != nil {
		return err
	}
	return d.prunePlans(name, budget)
}

// prunePlans removes stored plans other than keep, the longest stored
// first, until the rest fit in budget bytes.
func (d Dir) prunePlans(keep string, budget int64) error {
	entries, err := os.ReadDir(string(d))
	if err != nil {
		return err
	}
	type plan struct {
		name string
		size int64
		at   time.Time
	}
	var plans []plan
	var total int64
	for _, e := range entries {
		if !strings.HasPrefix(e.Name(), planPrefix) || !e.Type().IsRegular() {
			continue
		}
		info, err := e.Info()
		if err != nil {
			continue // removed meanwhile
		}
		total += info.Size()
		if e.Name() != keep {
			plans = append(plans, plan{e.Name(), info.Size(), info.ModTime()})
		}
	}
	if total <= budget {
		return nil
	}
	slices.SortStableFunc(plans, func(a, b plan) int { return a.at.Compare(b.at) })
	for _, p := range plans {
		if total <= budget {
			break
		}
		if err := os.Remove(filepath.Join(string(d), p.name)); err != nil && !errors.Is(err, fs.ErrNotExist) {
			return err
		}
		total -= p.size
	}
	return nil
}

// ReadPlan returns the requests PutPlan stored in dir for key; a missing
// plan is an error that errors.Is(err, fs.ErrNotExist).
func ReadPlan(dir, key string) ([]byte, error) {
	path := filepath.Join(dir, planName(key))
	b, err := readFile(path, MaxRecord, "a stored plan")
	if err != nil {
		return nil, err
	}
	rest, ok := bytes.CutPrefix(b, []byte(planMagic))
	if !ok || len(rest) < 4 {
		return nil, fmt.Errorf("%s is not a stored plan", path)
	}
	n := binary.BigEndian.Uint32(rest)
	if uint64(n) > uint64(len(rest)-4) || string(rest[4:4+n]) != key {
		return nil, fmt.Errorf("%s is not the stored plan of %q", path, key)
	}
	return rest[4+n:], nil
}

// HasPlan says whether dir holds a file under the name of key's plan.
func HasPlan(dir, key string) bool {
	_, err := os.Lstat(filepath.Join(dir, planName(key)))
	return err == nil
}
