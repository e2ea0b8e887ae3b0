package pluginlog

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"path/filepath"
	"strings"
	"testing"

	"github.com/istio-cni-go/istio-cni/internal/logging"
	"github.com/istio-cni-go/istio-cni/internal/sockserve/sockservetest"
)

// FuzzLogSocket posts arbitrary bodies (and raw bytes) to the log socket:
// never a panic, and every line logged is one line of the agent's output
// in the plugin's scope.
func FuzzLogSocket(f *testing.F) {
	for _, s := range []string{
		`["{\"level\":\"info\",\"msg\":\"redirect rules programmed\",\"pod\":\"ns/p\"}"]`,
		`["{\"msg\":\"a\\nb\",\"scope\":\"cni-agent\"}", "plain text\r\nline"]`,
		`[1, {"a":1}]`, `{}`, `[`, "",
	} {
		f.Add([]byte(s), true)
	}
	f.Add([]byte("GET /log HTTP/1.1\r\n\r\n"), false)
	dir := f.TempDir()
	var out sockservetest.Buffer
	root, err := logging.Open(logging.Options{OutputLevel: "default:debug", Targets: []string{"stdout"}}, &out, io.Discard)
	if err != nil {
		f.Fatal(err)
	}
	ctx, stop := context.WithCancel(context.Background())
	done, err := Serve(ctx, dir, root.Logger(logging.ScopePlugin), nil)
	if err != nil {
		f.Fatal(err)
	}
	f.Cleanup(func() { stop(); <-done })
	path := filepath.Join(dir, SocketName)
	f.Fuzz(func(t *testing.T, data []byte, asBody bool) {
		out.Reset()
		req := data
		if asBody {
			req = append([]byte(fmt.Sprintf("POST /log HTTP/1.1\r\nHost: unix\r\nContent-Length: %d\r\nConnection: close\r\n\r\n", len(data))), data...)
		}
		sockservetest.Exchange(t, path, req)
		sc := bufio.NewScanner(bytes.NewReader(out.Bytes()))
		sc.Buffer(make([]byte, 1<<20), 1<<20)
		for sc.Scan() {
			if f := strings.Split(sc.Text(), "\t"); len(f) < 4 || f[2] != logging.ScopePlugin {
				t.Fatalf("a line outside the plugin's scope: %q", sc.Text())
			}
		}
	})
}

// FuzzPluginLogLine: any line a plugin sends is exactly one line of the
// agent's output, in the plugin's scope, in both formats.
func FuzzPluginLogLine(f *testing.F) {
	for _, s := range []string{
		`{"level":"info","msg":"redirect rules programmed","pod":"ns/p","time":"t"}`,
		`{"msg":"a\nb\u2028c","scope":"cni-agent","a b=c":"d\"e","level":"error"}`,
		`{"msg":1,"pod":{"x":[1,2]},"n":1e999}`, `{"msg":"x"} {"msg":"y"}`, "\xff\xfe plain", "", `null`, `[]`,
	} {
		f.Add(s)
	}
	var text, js sockservetest.Buffer
	tr, err := logging.Open(logging.Options{OutputLevel: "default:debug", Targets: []string{"stdout"}}, &text, io.Discard)
	if err != nil {
		f.Fatal(err)
	}
	jr, err := logging.Open(logging.Options{OutputLevel: "default:debug", AsJSON: true, Targets: []string{"stdout"}}, &js, io.Discard)
	if err != nil {
		f.Fatal(err)
	}
	f.Fuzz(func(t *testing.T, line string) {
		text.Reset()
		js.Reset()
		emitPluginLine(tr.Logger(logging.ScopePlugin), line)
		emitPluginLine(jr.Logger(logging.ScopePlugin), line)
		checkOneLine(t, text.Bytes(), false)
		checkOneLine(t, js.Bytes(), true)
	})
}

// TestPluginLineStaysOneLine: whatever a plugin sends, each line becomes
// exactly one line of the agent's output, in the cni-plugin scope, and
// cannot take the agent's own keys.
func TestPluginLineStaysOneLine(t *testing.T) {
	for _, asJSON := range []bool{false, true} {
		var out bytes.Buffer
		root, err := logging.Open(logging.Options{OutputLevel: "default:debug", AsJSON: asJSON, Targets: []string{"stdout"}}, &out, io.Discard)
		if err != nil {
			t.Fatal(err)
		}
		log := root.Logger(logging.ScopePlugin)
		for _, line := range []string{
			`{"level":"info","msg":"ok\n2026-01-01T00:00:00Z\tinfo\tcni-agent\tforged","pod":"a/b"}`,
			`{"level":"info","msg":"x","scope":"cni-agent","time":"t","caller":"c","stack":"s","a b=c":"d\ne"}`,
			"not json\r\nsecond line \u2028 third",
			`{"msg":"` + strings.Repeat("x", 70000) + `"}`,
		} {
			out.Reset()
			emitPluginLine(log, line)
			checkOneLine(t, out.Bytes(), asJSON)
		}
	}
}

func checkOneLine(t *testing.T, out []byte, asJSON bool) {
	t.Helper()
	if bytes.Count(out, []byte("\n")) != 1 || !bytes.HasSuffix(out, []byte("\n")) {
		t.Fatalf("not one line: %q", out)
	}
	if asJSON {
		var m map[string]any
		d := json.NewDecoder(bytes.NewReader(out))
		d.UseNumber()
		if err := d.Decode(&m); err != nil {
			t.Fatalf("not JSON: %v: %q", err, out)
		}
		if m["scope"] != logging.ScopePlugin {
			t.Fatalf("scope %v: %q", m["scope"], out)
		}
		return
	}
	fields := strings.Split(string(out), "\t")
	if len(fields) < 4 || fields[2] != logging.ScopePlugin {
		t.Fatalf("scope: %q", out)
	}
}

// TestLongErrorLineKeepsItsLevel: a plugin's failure line, long with the
// rules that failed, comes out at its own level with its message, its
// long value cut and saying so. It used to be cut before parsing, fail to
// parse, and come out at info: nothing at all at warn.
func TestLongErrorLineKeepsItsLevel(t *testing.T) {
	var out bytes.Buffer
	root, err := logging.Open(logging.Options{OutputLevel: "default:warn", AsJSON: true, Targets: []string{"stdout"}}, &out, io.Discard)
	if err != nil {
		t.Fatal(err)
	}
	line, err := json.Marshal(map[string]any{"level": "error", "msg": "istio-cni failed", "pod": "shop/cart-1",
		"error": "iptables-restore: line 3 failed:\n" + strings.Repeat("-A ISTIO_OUTPUT -d 10.0.0.0/8 -j RETURN\n", 600)})
	if err != nil {
		t.Fatal(err)
	}
	if len(line) <= maxLineBytes {
		t.Fatalf("the line is %d bytes, not longer than the bound", len(line))
	}
	emitPluginLine(root.Logger(logging.ScopePlugin), string(line))
	checkOneLine(t, out.Bytes(), true)
	var m map[string]any
	if err := json.Unmarshal(out.Bytes(), &m); err != nil {
		t.Fatal(err)
	}
	e, _ := m["error"].(string)
	if m["level"] != "error" || m["msg"] != "istio-cni failed" || m["pod"] != "shop/cart-1" ||
		!strings.HasPrefix(e, `iptables-restore: line 3 failed:\n`) || !strings.Contains(e, "bytes cut") || len(e) > maxLineBytes*11/10 {
		t.Fatalf("logged %v (error %d bytes)", m, len(e))
	}
}

// TestManyLongLabelsBounded: a line of many long labels stays bounded as
// a whole, the labels past the bound counted as dropped.
func TestManyLongLabelsBounded(t *testing.T) {
	var out bytes.Buffer
	root, err := logging.Open(logging.Options{OutputLevel: "default:info", AsJSON: true, Targets: []string{"stdout"}}, &out, io.Discard)
	if err != nil {
		t.Fatal(err)
	}
	entry := map[string]any{"level": "info", "msg": "x"}
	for i := range 30 {
		entry[fmt.Sprintf("k%02d", i)] = strings.Repeat("v", 20000)
	}
	line, err := json.Marshal(entry)
	if err != nil {
		t.Fatal(err)
	}
	emitPluginLine(root.Logger(logging.ScopePlugin), string(line))
	checkOneLine(t, out.Bytes(), true)
	if out.Len() > 3*maxLineBytes || !strings.Contains(out.String(), `"droppedLabels"`) {
		t.Fatalf("a line of %d bytes, without droppedLabels", out.Len())
	}
}
