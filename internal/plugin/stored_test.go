package plugin

import (
	"bytes"
	"errors"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/containernetworking/cni/pkg/skel"

	"github.com/istio-cni-go/istio-cni/internal/logging"
	"github.com/istio-cni-go/istio-cni/internal/nlsteps"
	"github.com/istio-cni-go/istio-cni/internal/nsfacts"
	"github.com/istio-cni-go/istio-cni/internal/podinfo"
	"github.com/istio-cni-go/istio-cni/internal/podrules"
	"github.com/istio-cni-go/istio-cni/internal/prepared"
	"github.com/istio-cni-go/istio-cni/internal/ruleset"
)

// storedRules is a backend whose stored plans the test sets: a plan to
// hand out (one message to the wrong protocol, which a send refuses) or
// why there is none, and an Examine that may fail.
type storedRules struct {
	fakeRules
	stored      bool
	examineErr  error
	askedStored int
}

var _ podrules.StoredPreparer = (*storedRules)(nil)

func (f *storedRules) Examine(p string) (nsfacts.Facts, string, error) {
	if f.examineErr != nil {
		return nsfacts.Facts{}, "", f.examineErr
	}
	return f.fakeRules.Examine(p)
}

func (f *storedRules) PrepareStored(string, nsfacts.Facts, *ruleset.Plan) (*nlsteps.Txn, string, error) {
	f.askedStored++
	if !f.stored {
		return nil, "the agent stored no requests for the plan", nil
	}
	txn, _, err := f.PrepareFresh(nsfacts.Facts{}, nil)
	return txn, "", err
}

// fallbackAdd runs the fallback's ADD of an injected pod with rules, on
// a namespace that does not exist (so any send fails), in a run dir that
// holds a prepared directory when dir is set; it fails the test unless
// the ADD succeeds, and returns the ADD's "redirect rules programmed"
// line and the whole log.
func fallbackAdd(t *testing.T, rules Rules, dir bool) (line, logs string) {
	t.Helper()
	run := t.TempDir()
	if dir {
		if err := os.Mkdir(filepath.Join(run, prepared.DirName), 0o700); err != nil {
			t.Fatal(err)
		}
	}
	var out, log bytes.Buffer
	p := &Plugin{Log: logging.New(&log), Stdout: &out, Rules: rules, StoredPlans: true,
		NewSource: func(*Config, string) (podinfo.Source, error) { return &fakeSource{pod: injected(nil)}, nil }}
	conf := `{"cniVersion":"1.0.0","name":"n","type":"istio-cni","cni_agent_run_dir":"` + run + `","prevResult":` + prevResultFor("1.0.0") + `}`
	err := p.Add(&skel.CmdArgs{ContainerID: "c1", Netns: filepath.Join(run, "no-such-netns"), IfName: "eth0",
		Args: "IgnoreUnknown=1;K8S_POD_NAMESPACE=default;K8S_POD_NAME=web", StdinData: []byte(conf)})
	if err != nil {
		t.Fatalf("ADD: %v\n%s", err, log.String())
	}
	for _, l := range strings.Split(log.String(), "\n") {
		if strings.Contains(l, "redirect rules programmed") {
			line = l
		}
	}
	return line, log.String()
}

// TestFallbackStoredPlans: the fallback asks for the agent's stored plan
// only where an agent prepares ahead, and applies the rules in place,
// saying why on its line, when there is none, when the namespace does
// not read, or when the plan's send fails; the ADD succeeds each time.
func TestFallbackStoredPlans(t *testing.T) {
	for _, c := range []struct {
		name       string
		dir        bool
		rules      storedRules
		why        string
		askedStore int
	}{
		{name: "no prepared dir", why: "no prepared directory"},
		{name: "no plan stored", dir: true, why: "the agent stored no requests", askedStore: 1},
		{name: "namespace does not read", dir: true, rules: storedRules{examineErr: errors.New("listing tables: EBUSY")}, why: "reading the namespace: listing tables: EBUSY"},
		{name: "send fails", dir: true, rules: storedRules{stored: true}, why: "its send failed", askedStore: 1},
	} {
		t.Run(c.name, func(t *testing.T) {
			rules := c.rules
			line, logs := fallbackAdd(t, &rules, c.dir)
			if rules.applied != 1 || rules.askedStored != c.askedStore {
				t.Fatalf("applied in place %d times, stored plan asked %d times; want 1 and %d\n%s", rules.applied, rules.askedStored, c.askedStore, logs)
			}
			if !strings.Contains(line, `"stored_plan":false`) || !strings.Contains(line, c.why) {
				t.Fatalf("the line does not say why no stored plan (%q):\n%s", c.why, logs)
			}
		})
	}
}

// unfitRules is a backend that prepares its own requests (not the
// agent's store) and finds the namespace unfit for them.
type unfitRules struct {
	fakeRules
	unfit      string
	examineErr error
	askedHere  int
}

var _ podrules.HerePreparer = (*unfitRules)(nil)

func (f *unfitRules) Examine(p string) (nsfacts.Facts, string, error) {
	if f.examineErr != nil {
		return nsfacts.Facts{}, "", f.examineErr
	}
	facts, _, err := f.fakeRules.Examine(p)
	return facts, f.unfit, err
}

func (f *unfitRules) PrepareHere(facts nsfacts.Facts, plan *ruleset.Plan) (*nlsteps.Txn, string, error) {
	f.askedHere++
	return f.PrepareFresh(facts, plan)
}

// TestFallbackPreparesHere: a backend that prepares its requests cheaply
// (nftables) is never sent to the agent's store, with or without a
// prepared directory: the fallback prepares them itself, and applies in
// place, saying why, when the namespace is unfit or the send fails.
func TestFallbackPreparesHere(t *testing.T) {
	for _, c := range []struct {
		name       string
		dir        bool
		unfit      string
		examineErr error
		why        string
	}{
		{name: "send fails", why: "its send failed"},
		{name: "send fails, prepared dir", dir: true, why: "its send failed"},
		{name: "namespace unfit", unfit: "the namespace has tables of ours already", why: "the namespace has tables of ours already"},
		{name: "namespace does not read", examineErr: errors.New("listing tables: EBUSY"), why: "preparing the requests: listing tables: EBUSY"},
	} {
		t.Run(c.name, func(t *testing.T) {
			rules := &unfitRules{unfit: c.unfit, examineErr: c.examineErr}
			line, logs := fallbackAdd(t, rules, c.dir)
			wantHere := 1
			if c.unfit != "" || c.examineErr != nil {
				wantHere = 0
			}
			if rules.applied != 1 || rules.askedHere != wantHere {
				t.Fatalf("applied in place %d times, prepared here %d; want 1 and %d\n%s", rules.applied, rules.askedHere, wantHere, logs)
			}
			if !strings.Contains(line, `"prepared_here":false`) || !strings.Contains(line, c.why) || strings.Contains(line, "stored_plan") {
				t.Fatalf("the line does not say why the requests prepared here were not sent (%q):\n%s", c.why, logs)
			}
		})
	}
}
