// Package zds is the node agent's side of ZDS, the protocol by which the
// agent hands pod network namespaces to ztunnel: the messages of Istio's
// pkg/zdsapi/zds.proto, encoded by hand with protowire (seven messages do
// not justify generated code), and the server ztunnel connects to.
package zds

import (
	"errors"
	"fmt"
	"unicode/utf8"

	"google.golang.org/protobuf/encoding/protowire"
)

// Version is zds.proto's Version enum, carried by ZdsHello.
type Version int32

const (
	VersionNotUsed Version = 0
	V1             Version = 1
)

func (v Version) String() string {
	switch v {
	case VersionNotUsed:
		return "NOT_USED"
	case V1:
		return "V1"
	}
	return fmt.Sprintf("Version(%d)", int32(v))
}

// MaxRequestSize is what ztunnel reads of one packet: a longer request
// reaches it truncated and is refused, so the agent refuses to send one.
const MaxRequestSize = 1024

// Field numbers of zds.proto. DelWorkload.uid is 2, not 1: the proto says so.
const (
	fieldHelloVersion = 1

	fieldInfoName           = 1
	fieldInfoNamespace      = 2
	fieldInfoServiceAccount = 3

	fieldAddUID  = 1
	fieldAddInfo = 2
	fieldKeepUID = 1
	fieldDelUID  = 2

	fieldRequestAdd          = 1
	fieldRequestDel          = 2
	fieldRequestSnapshotSent = 3
	fieldRequestKeep         = 5

	fieldResponseAck = 1
	fieldAckError    = 1
)

// Hello is ZdsHello, the first message ztunnel sends on a connection.
type Hello struct {
	Version Version
}

// WorkloadInfo is the pod ztunnel runs a proxy for.
type WorkloadInfo struct {
	Name           string
	Namespace      string
	ServiceAccount string
}

// Kind says which member of WorkloadRequest's payload oneof is set.
type Kind int

const (
	// KindNone: no payload, which ztunnel refuses.
	KindNone Kind = iota
	KindAdd
	KindKeep
	KindDel
	KindSnapshotSent
)

func (k Kind) String() string {
	switch k {
	case KindNone:
		return "none"
	case KindAdd:
		return "add"
	case KindKeep:
		return "keep"
	case KindDel:
		return "del"
	case KindSnapshotSent:
		return "snapshot_sent"
	}
	return fmt.Sprintf("Kind(%d)", int(k))
}

// Request is WorkloadRequest flattened: the payload's kind, the uid of
// add, keep and del, and the workload_info of add.
type Request struct {
	Kind Kind
	UID  string
	// Info is add's workload_info; nil when absent, which ztunnel treats
	// as a protocol error, so presence is kept apart from emptiness.
	Info *WorkloadInfo
}

// Response is WorkloadResponse; Ack is nil when the payload is absent.
type Response struct {
	Ack *Ack
}

// Ack answers one request; a non-empty Error is a refusal (a nack).
type Ack struct {
	Error string
}

// Marshal encodes the hello. NOT_USED is proto3's default and so sent as
// nothing at all.
func (h Hello) Marshal() []byte {
	var b []byte
	if h.Version != 0 {
		b = protowire.AppendTag(b, fieldHelloVersion, protowire.VarintType)
		// Enums are int32 on the wire as varints, negative ones sign-extended.
		b = protowire.AppendVarint(b, uint64(int64(h.Version)))
	}
	return b
}

// Marshal encodes the request. It fails only on a string that is not
// UTF-8, which a proto3 decoder (ztunnel's) refuses.
func (r Request) Marshal() ([]byte, error) {
	if err := checkUTF8("uid", r.UID); err != nil {
		return nil, err
	}
	var inner []byte
	var field protowire.Number
	switch r.Kind {
	case KindNone:
		if r.UID != "" || r.Info != nil {
			return nil, errors.New("zds: a request without a kind cannot carry a uid or workload info")
		}
		return nil, nil
	case KindAdd:
		field = fieldRequestAdd
		inner = appendString(inner, fieldAddUID, r.UID)
		if r.Info != nil {
			info, err := r.Info.marshal()
			if err != nil {
				return nil, err
			}
			inner = protowire.AppendTag(inner, fieldAddInfo, protowire.BytesType)
			inner = protowire.AppendBytes(inner, info)
		}
	case KindKeep:
		field = fieldRequestKeep
		inner = appendString(inner, fieldKeepUID, r.UID)
	case KindDel:
		field = fieldRequestDel
		inner = appendString(inner, fieldDelUID, r.UID)
	case KindSnapshotSent:
		if r.UID != "" {
			return nil, errors.New("zds: snapshot_sent carries no uid")
		}
		field = fieldRequestSnapshotSent
	default:
		return nil, fmt.Errorf("zds: unknown request kind %d", int(r.Kind))
	}
	if r.Kind != KindAdd && r.Info != nil {
		return nil, fmt.Errorf("zds: workload info belongs to add, not %s", r.Kind)
	}
	// A oneof member is sent even when empty: its presence is the message.
	b := protowire.AppendTag(nil, field, protowire.BytesType)
	return protowire.AppendBytes(b, inner), nil
}

func (w WorkloadInfo) marshal() ([]byte, error) {
	for _, f := range []struct{ name, v string }{
		{"workload name", w.Name}, {"workload namespace", w.Namespace}, {"workload service account", w.ServiceAccount},
	} {
		if err := checkUTF8(f.name, f.v); err != nil {
			return nil, err
		}
	}
	var b []byte
	b = appendString(b, fieldInfoName, w.Name)
	b = appendString(b, fieldInfoNamespace, w.Namespace)
	b = appendString(b, fieldInfoServiceAccount, w.ServiceAccount)
	return b, nil
}

// Marshal encodes the response (ztunnel's side: the stand-in uses it).
func (r Response) Marshal() ([]byte, error) {
	if r.Ack == nil {
		return nil, nil
	}
	if err := checkUTF8("ack error", r.Ack.Error); err != nil {
		return nil, err
	}
	inner := appendString(nil, fieldAckError, r.Ack.Error)
	b := protowire.AppendTag(nil, fieldResponseAck, protowire.BytesType)
	return protowire.AppendBytes(b, inner), nil
}

// appendString appends a proto3 string field, omitted when empty.
func appendString(b []byte, num protowire.Number, s string) []byte {
	if s == "" {
		return b
	}
	b = protowire.AppendTag(b, num, protowire.BytesType)
	return protowire.AppendString(b, s)
}

func checkUTF8(what, s string) error {
	if !utf8.ValidString(s) {
		return fmt.Errorf("zds: %s %q is not valid UTF-8", what, s)
	}
	return nil
}

// The decoders follow protobuf's rules, so that what ztunnel (prost) and
// Istio's agent (protobuf-go) accept, they accept: unknown fields, and
// known numbers with an unexpected wire type, are skipped; the last of a
// repeated scalar wins; repeated embedded messages merge; the last oneof
// member set wins (merging when it is the same one); strings must be UTF-8.

// UnmarshalHello decodes a ZdsHello.
func UnmarshalHello(b []byte) (Hello, error) {
	var h Hello
	err := walk("ZdsHello", b, func(num protowire.Number, typ protowire.Type, v []byte) error {
		if num == fieldHelloVersion && typ == protowire.VarintType {
			x, n := protowire.ConsumeVarint(v)
			if n < 0 {
				return fieldError("ZdsHello", "version", protowire.ParseError(n))
			}
			h.Version = Version(int32(x))
		}
		return nil
	})
	return h, err
}

var requestKinds = map[protowire.Number]Kind{
	fieldRequestAdd: KindAdd, fieldRequestKeep: KindKeep, fieldRequestDel: KindDel, fieldRequestSnapshotSent: KindSnapshotSent,
}

// UnmarshalRequest decodes a WorkloadRequest.
func UnmarshalRequest(b []byte) (Request, error) {
	var r Request
	err := walk("WorkloadRequest", b, func(num protowire.Number, typ protowire.Type, v []byte) error {
		if typ != protowire.BytesType {
			return nil
		}
		kind, ok := requestKinds[num]
		if !ok {
			return nil
		}
		if r.Kind != kind {
			r = Request{Kind: kind}
		}
		switch kind {
		case KindAdd:
			return r.mergeAdd(v)
		case KindKeep:
			return mergeUID("KeepWorkload", fieldKeepUID, v, &r.UID)
		case KindDel:
			return mergeUID("DelWorkload", fieldDelUID, v, &r.UID)
		default:
			// SnapshotSent has no fields, but what it holds must still parse.
			return walk("SnapshotSent", v, func(protowire.Number, protowire.Type, []byte) error { return nil })
		}
	})
	return r, err
}

func (r *Request) mergeAdd(b []byte) error {
	return walk("AddWorkload", b, func(num protowire.Number, typ protowire.Type, v []byte) error {
		if typ != protowire.BytesType {
			return nil
		}
		switch num {
		case fieldAddUID:
			return setString("AddWorkload", "uid", v, &r.UID)
		case fieldAddInfo:
			if r.Info == nil {
				r.Info = &WorkloadInfo{}
			}
			return r.Info.merge(v)
		}
		return nil
	})
}

func (w *WorkloadInfo) merge(b []byte) error {
	return walk("WorkloadInfo", b, func(num protowire.Number, typ protowire.Type, v []byte) error {
		if typ != protowire.BytesType {
			return nil
		}
		switch num {
		case fieldInfoName:
			return setString("WorkloadInfo", "name", v, &w.Name)
		case fieldInfoNamespace:
			return setString("WorkloadInfo", "namespace", v, &w.Namespace)
		case fieldInfoServiceAccount:
			return setString("WorkloadInfo", "service_account", v, &w.ServiceAccount)
		}
		return nil
	})
}

func mergeUID(msg string, field protowire.Number, b []byte, uid *string) error {
	return walk(msg, b, func(num protowire.Number, typ protowire.Type, v []byte) error {
		if num == field && typ == protowire.BytesType {
			return setString(msg, "uid", v, uid)
		}
		return nil
	})
}

// UnmarshalResponse decodes a WorkloadResponse.
func UnmarshalResponse(b []byte) (Response, error) {
	var r Response
	err := walk("WorkloadResponse", b, func(num protowire.Number, typ protowire.Type, v []byte) error {
		if num != fieldResponseAck || typ != protowire.BytesType {
			return nil
		}
		if r.Ack == nil {
			r.Ack = &Ack{}
		}
		return walk("Ack", v, func(num protowire.Number, typ protowire.Type, v []byte) error {
			if num == fieldAckError && typ == protowire.BytesType {
				return setString("Ack", "error", v, &r.Ack.Error)
			}
			return nil
		})
	})
	return r, err
}

// walk calls fn with each field of the message b: its number, wire type
// and value (for a bytes field the contents, without the length).
func walk(msg string, b []byte, fn func(protowire.Number, protowire.Type, []byte) error) error {
	for off := 0; off < len(b); {
		num, typ, n := protowire.ConsumeTag(b[off:])
		if n < 0 {
			return fmt.Errorf("zds: %s: bad field tag at byte %d: %w", msg, off, protowire.ParseError(n))
		}
		if num > protowire.MaxValidNumber {
			return fmt.Errorf("zds: %s: field number %d at byte %d is beyond protobuf's largest", msg, num, off)
		}
		off += n
		m := protowire.ConsumeFieldValue(num, typ, b[off:])
		if m < 0 {
			return fmt.Errorf("zds: %s: field %d (wire type %d) at byte %d: %w", msg, num, typ, off, protowire.ParseError(m))
		}
		v := b[off : off+m]
		if typ == protowire.BytesType {
			// ConsumeFieldValue has checked the length prefix; drop it.
			v, _ = protowire.ConsumeBytes(v)
		}
		off += m
		if err := fn(num, typ, v); err != nil {
			return err
		}
	}
	return nil
}

func setString(msg, field string, v []byte, dst *string) error {
	if !utf8.Valid(v) {
		return fieldError(msg, field, errors.New("string is not valid UTF-8"))
	}
	*dst = string(v)
	return nil
}

func fieldError(msg, field string, err error) error {
	return fmt.Errorf("zds: %s.%s: %w", msg, field, err)
}
