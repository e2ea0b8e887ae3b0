package cnirelay

import (
	"encoding/base64"
	"encoding/binary"
	"encoding/json"
	"errors"
	"fmt"
	"strconv"
	"time"
	"unicode/utf8"

	"github.com/istio-cni-go/istio-cni/internal/nlsteps"
)

// The relay's side of the socket writes and reads its few fixed messages
// without encoding/json: in a process that lives for one command, its
// first use (reflection over each type, then the encoding) cost 0.13 ms,
// a tenth of the process's start. The agent still reads them as JSON.

// framedMagic starts a framed answer: a zero byte, which no JSON answer
// starts with.
const framedMagic = "\x00CN1"

// AppendFramed appends resp in the framed form: framedMagic, then
// Stdout, Unavailable, the error (a presence byte, an 8-byte code, message
// and details) and the transaction, the byte strings each prefixed with
// its length (4 bytes; all big endian).
func AppendFramed(b []byte, resp *Response) []byte {
	field := func(s []byte) {
		b = binary.BigEndian.AppendUint32(b, uint32(len(s)))
		b = append(b, s...)
	}
	b = append(b, framedMagic...)
	field(resp.Stdout)
	field([]byte(resp.Unavailable))
	if e := resp.Error; e != nil {
		b = binary.BigEndian.AppendUint64(append(b, 1), uint64(e.Code))
		field([]byte(e.Msg))
		field([]byte(e.Details))
	} else {
		b = append(b, 0)
	}
	field(resp.Txn)
	return b
}

// ParseResponse reads an agent's answer: framed, or JSON from an agent
// that predates framing.
func ParseResponse(out []byte) (*Response, error) {
	resp := &Response{}
	if len(out) > 0 && out[0] == '{' {
		return resp, json.Unmarshal(out, resp)
	}
	if len(out) < len(framedMagic) || string(out[:len(framedMagic)]) != framedMagic {
		return nil, errors.New("neither JSON nor a framed answer")
	}
	r := out[len(framedMagic):]
	var err error
	field := func() []byte {
		if err != nil {
			return nil
		}
		if len(r) < 4 || uint64(binary.BigEndian.Uint32(r)) > uint64(len(r)-4) {
			err = fmt.Errorf("a framed answer cut short (%d bytes left)", len(r))
			return nil
		}
		n := binary.BigEndian.Uint32(r)
		f := r[4 : 4+n : 4+n]
		r = r[4+n:]
		return f
	}
	if resp.Stdout = field(); len(resp.Stdout) == 0 {
		resp.Stdout = nil
	}
	resp.Unavailable = string(field())
	if err == nil && len(r) > 0 && r[0] == 1 {
		if len(r) < 9 {
			return nil, errors.New("a framed answer's error cut short")
		}
		resp.Error = &Error{Code: uint(binary.BigEndian.Uint64(r[1:]))}
		r = r[9:]
		resp.Error.Msg, resp.Error.Details = string(field()), string(field())
	} else if err == nil && (len(r) == 0 || r[0] != 0) {
		return nil, errors.New("a framed answer's error flag is missing or unknown")
	} else if err == nil {
		r = r[1:]
	}
	if resp.Txn = field(); len(resp.Txn) == 0 {
		resp.Txn = nil
	}
	if err == nil && len(r) > 0 {
		err = fmt.Errorf("%d bytes after a framed answer", len(r))
	}
	if err != nil {
		return nil, err
	}
	return resp, nil
}

// appendJSON writes the request as encoding/json would decode it back:
// the same keys, the same omitted fields.
func (req *Request) appendJSON(b []byte) []byte {
	key := func(k string, first bool) {
		if !first {
			b = append(b, ',')
		}
		b = append(append(append(b, '"'), k...), '"', ':')
	}
	str := func(k, v string, omitEmpty bool) {
		if omitEmpty && v == "" {
			return
		}
		key(k, false)
		b = appendJSONString(b, v)
	}
	flag := func(k string, v bool) {
		if v {
			key(k, false)
			b = append(b, "true"...)
		}
	}
	b = append(b, '{')
	key("command", true)
	b = appendJSONString(b, req.Command)
	str("containerID", req.ContainerID, false)
	str("netns", req.Netns, true)
	flag("hasNetnsFD", req.HasNetnsFD)
	str("ifName", req.IfName, false)
	str("args", req.Args, false)
	str("path", req.Path, false)
	key("stdin", false)
	if req.Stdin == nil {
		b = append(b, "null"...)
	} else {
		b = append(b, '"')
		b = base64.StdEncoding.AppendEncode(b, req.Stdin)
		b = append(b, '"')
	}
	flag("steps", req.Steps)
	str("txnForm", req.TxnForm, true)
	str("forceIPTables", req.ForceIPTables, true)
	flag("framed", req.Framed)
	if d := req.Done; d != nil {
		key("done", false)
		b = d.appendJSON(b)
	}
	str("unprepared", req.Unprepared, true)
	flag("mayLeave", req.MayLeave)
	return append(b, '}')
}

// appendJSON writes d as encoding/json would.
func (d *Done) appendJSON(b []byte) []byte {
	first := true
	key := func(k string) {
		if !first {
			b = append(b, ',')
		}
		first = false
		b = append(append(append(b, '"'), k...), '"', ':')
	}
	str := func(k, v string) {
		if v != "" {
			key(k)
			b = appendJSONString(b, v)
		}
	}
	num := func(k string, v time.Duration) {
		if v != 0 {
			key(k)
			b = strconv.AppendInt(b, int64(v), 10)
		}
	}
	b = append(b, '{')
	str("skip", d.Skip)
	str("mode", d.Mode)
	str("summary", d.Summary)
	if d.IPv6 {
		key("ipv6")
		b = append(b, "true"...)
	}
	str("error", d.Error)
	str("unlocked", d.Unlocked)
	num("took", d.Took)
	num("total", d.Total)
	num("cpu", d.CPU)
	return append(b, '}')
}

// appendOutcomeJSON writes a send's outcome as encoding/json would.
func appendOutcomeJSON(b []byte, o *nlsteps.Outcome) []byte {
	b = append(b, '{')
	if o.Error != "" {
		b = appendJSONString(append(b, `"error":`...), o.Error)
		b = append(b, ',')
	}
	b = strconv.AppendInt(append(b, `"took":`...), int64(o.Took), 10)
	if o.CPU != 0 {
		b = strconv.AppendInt(append(b, `,"cpu":`...), int64(o.CPU), 10)
	}
	return append(b, '}')
}

// appendJSONString writes s as a JSON string: quotes, backslashes and
// control characters escaped, invalid UTF-8 as U+FFFD, as encoding/json
// does (which also escapes <, > and &, a choice JSON leaves open).
func appendJSONString(b []byte, s string) []byte {
	const hex = "0123456789abcdef"
	b = append(b, '"')
	for i := 0; i < len(s); {
		c := s[i]
		if c < utf8.RuneSelf {
			switch {
			case c == '"' || c == '\\':
				b = append(b, '\\', c)
			case c == '\n':
				b = append(b, '\\', 'n')
			case c == '\r':
				b = append(b, '\\', 'r')
			case c == '\t':
				b = append(b, '\\', 't')
			case c < 0x20:
				b = append(b, '\\', 'u', '0', '0', hex[c>>4], hex[c&0xf])
			default:
				b = append(b, c)
			}
			i++
			continue
		}
		r, size := utf8.DecodeRuneInString(s[i:])
		if r == utf8.RuneError && size == 1 {
			b = append(b, `\ufffd`...)
		} else {
			b = append(b, s[i:i+size]...)
		}
		i += size
	}
	return append(b, '"')
}
