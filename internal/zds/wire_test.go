package zds

import (
	"bytes"
	"encoding/hex"
	"strings"
	"testing"

	"google.golang.org/protobuf/encoding/protowire"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/reflect/protodesc"
	"google.golang.org/protobuf/reflect/protoreflect"
	"google.golang.org/protobuf/types/descriptorpb"
	"google.golang.org/protobuf/types/dynamicpb"
)

// zdsSchema is zds.proto's schema as protobuf-go's own decoder sees it,
// written out field by field from Istio's pkg/zdsapi/zds.proto, so that
// the hand encoding is checked against a real protobuf implementation.
func zdsSchema(t testing.TB) protoreflect.FileDescriptor {
	t.Helper()
	str := func(name string, num int32) *descriptorpb.FieldDescriptorProto {
		return &descriptorpb.FieldDescriptorProto{Name: proto.String(name), Number: proto.Int32(num),
			Label: descriptorpb.FieldDescriptorProto_LABEL_OPTIONAL.Enum(), Type: descriptorpb.FieldDescriptorProto_TYPE_STRING.Enum(),
			JsonName: proto.String(name)}
	}
	msg := func(name string, num int32, typ string, oneof *int32) *descriptorpb.FieldDescriptorProto {
		return &descriptorpb.FieldDescriptorProto{Name: proto.String(name), Number: proto.Int32(num),
			Label: descriptorpb.FieldDescriptorProto_LABEL_OPTIONAL.Enum(), Type: descriptorpb.FieldDescriptorProto_TYPE_MESSAGE.Enum(),
			TypeName: proto.String(".istio.workload.zds." + typ), OneofIndex: oneof, JsonName: proto.String(name)}
	}
	payload := proto.Int32(0)
	fd := &descriptorpb.FileDescriptorProto{
		Name: proto.String("zds.proto"), Package: proto.String("istio.workload.zds"), Syntax: proto.String("proto3"),
		EnumType: []*descriptorpb.EnumDescriptorProto{{Name: proto.String("Version"), Value: []*descriptorpb.EnumValueDescriptorProto{
			{Name: proto.String("NOT_USED"), Number: proto.Int32(0)}, {Name: proto.String("V1"), Number: proto.Int32(1)}}}},
		MessageType: []*descriptorpb.DescriptorProto{
			{Name: proto.String("ZdsHello"), Field: []*descriptorpb.FieldDescriptorProto{{Name: proto.String("version"), Number: proto.Int32(1),
				Label: descriptorpb.FieldDescriptorProto_LABEL_OPTIONAL.Enum(), Type: descriptorpb.FieldDescriptorProto_TYPE_ENUM.Enum(),
				TypeName: proto.String(".istio.workload.zds.Version"), JsonName: proto.String("version")}}},
			{Name: proto.String("WorkloadInfo"), Field: []*descriptorpb.FieldDescriptorProto{
				str("name", 1), str("namespace", 2), str("service_account", 3)}},
			{Name: proto.String("AddWorkload"), Field: []*descriptorpb.FieldDescriptorProto{str("uid", 1), msg("workload_info", 2, "WorkloadInfo", nil)}},
			{Name: proto.String("KeepWorkload"), Field: []*descriptorpb.FieldDescriptorProto{str("uid", 1)}},
			{Name: proto.String("DelWorkload"), Field: []*descriptorpb.FieldDescriptorProto{str("uid", 2)}},
			{Name: proto.String("SnapshotSent")},
			{Name: proto.String("Ack"), Field: []*descriptorpb.FieldDescriptorProto{str("error", 1)}},
			{Name: proto.String("WorkloadRequest"), Field: []*descriptorpb.FieldDescriptorProto{
				msg("add", 1, "AddWorkload", payload), msg("keep", 5, "KeepWorkload", payload),
				msg("del", 2, "DelWorkload", payload), msg("snapshot_sent", 3, "SnapshotSent", payload)},
				OneofDecl: []*descriptorpb.OneofDescriptorProto{{Name: proto.String("payload")}}},
			{Name: proto.String("WorkloadResponse"), Field: []*descriptorpb.FieldDescriptorProto{msg("ack", 1, "Ack", payload)},
				OneofDecl: []*descriptorpb.OneofDescriptorProto{{Name: proto.String("payload")}}},
		},
	}
	f, err := protodesc.NewFile(fd, nil)
	if err != nil {
		t.Fatal(err)
	}
	return f
}

func newDynamic(f protoreflect.FileDescriptor, name string) *dynamicpb.Message {
	return dynamicpb.NewMessage(f.Messages().ByName(protoreflect.Name(name)))
}

// fromDynamic reads a decoded WorkloadRequest as this package's Request.
func fromDynamic(m *dynamicpb.Message) Request {
	var r Request
	od := m.Descriptor().Oneofs().ByName("payload")
	fd := m.WhichOneof(od)
	if fd == nil {
		return r
	}
	sub := m.Get(fd).Message()
	get := func(m protoreflect.Message, name string) string {
		return m.Get(m.Descriptor().Fields().ByName(protoreflect.Name(name))).String()
	}
	switch fd.Name() {
	case "add":
		r.Kind, r.UID = KindAdd, get(sub, "uid")
		infoFD := sub.Descriptor().Fields().ByName("workload_info")
		if sub.Has(infoFD) {
			info := sub.Get(infoFD).Message()
			r.Info = &WorkloadInfo{Name: get(info, "name"), Namespace: get(info, "namespace"), ServiceAccount: get(info, "service_account")}
		}
	case "keep":
		r.Kind, r.UID = KindKeep, get(sub, "uid")
	case "del":
		r.Kind, r.UID = KindDel, get(sub, "uid")
	case "snapshot_sent":
		r.Kind = KindSnapshotSent
	}
	return r
}

func sampleRequests() []Request {
	return []Request{
		{},
		{Kind: KindAdd, UID: "3f0c8a4e-1111-2222-3333-444455556666",
			Info: &WorkloadInfo{Name: "web-7d9f", Namespace: "shop", ServiceAccount: "web"}},
		{Kind: KindAdd, UID: "u1", Info: &WorkloadInfo{}},
		{Kind: KindAdd, UID: "u-no-info"},
		{Kind: KindAdd, Info: &WorkloadInfo{Name: "ünïcode"}},
		{Kind: KindKeep, UID: "u2"},
		{Kind: KindKeep},
		{Kind: KindDel, UID: "u3"},
		{Kind: KindDel},
		{Kind: KindSnapshotSent},
	}
}

func equalRequest(a, b Request) bool {
	if a.Kind != b.Kind || a.UID != b.UID || (a.Info == nil) != (b.Info == nil) {
		return false
	}
	return a.Info == nil || *a.Info == *b.Info
}

// TestRequestBytes pins the exact bytes of each kind, field numbers
// included (DelWorkload.uid is field 2, keep is payload field 5).
func TestRequestBytes(t *testing.T) {
	for _, tc := range []struct {
		req  Request
		want string
	}{
		{Request{Kind: KindDel, UID: "abc"}, "1205" + "1203616263"},
		{Request{Kind: KindKeep, UID: "abc"}, "2a05" + "0a03616263"},
		{Request{Kind: KindSnapshotSent}, "1a00"},
		{Request{Kind: KindAdd, UID: "u", Info: &WorkloadInfo{Name: "n", Namespace: "s", ServiceAccount: "a"}},
			"0a0e" + "0a0175" + "1209" + "0a016e" + "120173" + "1a0161"},
		// Present but empty workload info is still sent: ztunnel needs it.
		{Request{Kind: KindAdd, UID: "u", Info: &WorkloadInfo{}}, "0a05" + "0a0175" + "1200"},
	} {
		got, err := tc.req.Marshal()
		if err != nil {
			t.Fatal(err)
		}
		if hex.EncodeToString(got) != tc.want {
			t.Errorf("%+v: got %x, want %s", tc.req, got, tc.want)
		}
	}
	if got := (Hello{Version: V1}).Marshal(); !bytes.Equal(got, []byte{0x08, 0x01}) {
		t.Errorf("hello V1: got %x, want 0801", got)
	}
	got, err := Response{Ack: &Ack{Error: "no"}}.Marshal()
	if err != nil || hex.EncodeToString(got) != "0a040a026e6f" {
		t.Errorf("nack: got %x, %v; want 0a040a026e6f", got, err)
	}
	got, err = Response{Ack: &Ack{}}.Marshal()
	if err != nil || hex.EncodeToString(got) != "0a00" {
		t.Errorf("ack: got %x, %v; want 0a00", got, err)
	}
}

// TestAgainstProtobuf checks the encoding both ways against protobuf-go
// with zds.proto's schema.
func TestAgainstProtobuf(t *testing.T) {
	f := zdsSchema(t)
	for _, req := range sampleRequests() {
		b, err := req.Marshal()
		if err != nil {
			t.Fatal(err)
		}
		m := newDynamic(f, "WorkloadRequest")
		if err := proto.Unmarshal(b, m); err != nil {
			t.Fatalf("protobuf-go cannot read %+v (%x): %v", req, b, err)
		}
		if got := fromDynamic(m); !equalRequest(got, req) {
			t.Errorf("protobuf-go read %x as %+v, want %+v", b, got, req)
		}
		theirs, err := proto.MarshalOptions{Deterministic: true}.Marshal(m)
		if err != nil {
			t.Fatal(err)
		}
		back, err := UnmarshalRequest(theirs)
		if err != nil {
			t.Fatalf("cannot read protobuf-go's %x: %v", theirs, err)
		}
		if !equalRequest(back, req) {
			t.Errorf("read protobuf-go's %x as %+v, want %+v", theirs, back, req)
		}
		if !bytes.Equal(theirs, b) {
			t.Errorf("bytes differ from protobuf-go's for %+v: ours %x, theirs %x", req, b, theirs)
		}
	}
	for _, v := range []Version{VersionNotUsed, V1, 7, -1} {
		b := Hello{Version: v}.Marshal()
		m := newDynamic(f, "ZdsHello")
		if err := proto.Unmarshal(b, m); err != nil {
			t.Fatal(err)
		}
		got := m.Get(m.Descriptor().Fields().ByName("version")).Enum()
		if Version(got) != v {
			t.Errorf("hello %s read by protobuf-go as %d", v, got)
		}
		theirs, _ := proto.Marshal(m)
		if h, err := UnmarshalHello(theirs); err != nil || h.Version != v {
			t.Errorf("protobuf-go's hello %x read as %+v, %v; want %s", theirs, h, err, v)
		}
	}
}

func TestRoundTrip(t *testing.T) {
	for _, req := range sampleRequests() {
		b, err := req.Marshal()
		if err != nil {
			t.Fatal(err)
		}
		got, err := UnmarshalRequest(b)
		if err != nil || !equalRequest(got, req) {
			t.Errorf("%+v: read back %+v, %v", req, got, err)
		}
	}
	for _, r := range []Response{{}, {Ack: &Ack{}}, {Ack: &Ack{Error: "failure to start proxy: boom"}}} {
		b, err := r.Marshal()
		if err != nil {
			t.Fatal(err)
		}
		got, err := UnmarshalResponse(b)
		if err != nil || (got.Ack == nil) != (r.Ack == nil) || (r.Ack != nil && *got.Ack != *r.Ack) {
			t.Errorf("%+v: read back %+v, %v", r, got, err)
		}
	}
}

// TestDecodeRules covers protobuf's rules the decoders follow.
func TestDecodeRules(t *testing.T) {
	tag := func(num protowire.Number, typ protowire.Type) []byte { return protowire.AppendTag(nil, num, typ) }
	bytesField := func(num protowire.Number, v []byte) []byte {
		return protowire.AppendBytes(tag(num, protowire.BytesType), v)
	}
	cat := func(parts ...[]byte) []byte { return bytes.Join(parts, nil) }
	uid := func(num protowire.Number, s string) []byte { return bytesField(num, []byte(s)) }

	for _, tc := range []struct {
		name string
		in   []byte
		want Request
	}{
		{"unknown fields of every wire type skipped",
			cat(protowire.AppendVarint(tag(9, protowire.VarintType), 300), protowire.AppendFixed32(tag(10, protowire.Fixed32Type), 1),
				protowire.AppendFixed64(tag(11, protowire.Fixed64Type), 1), bytesField(12, []byte("x")),
				tag(13, protowire.StartGroupType), protowire.AppendVarint(tag(1, protowire.VarintType), 1), tag(13, protowire.EndGroupType),
				bytesField(2, cat(uid(2, "d"), bytesField(7, []byte("ignored"))))),
			Request{Kind: KindDel, UID: "d"}},
		{"known number with another wire type is unknown", cat(bytesField(2, uid(2, "d")), protowire.AppendVarint(tag(2, protowire.VarintType), 1)),
			Request{Kind: KindDel, UID: "d"}},
		{"same oneof member twice merges", cat(bytesField(1, uid(1, "a")), bytesField(1, bytesField(2, uid(1, "n")))),
			Request{Kind: KindAdd, UID: "a", Info: &WorkloadInfo{Name: "n"}}},
		{"the last oneof member wins", cat(bytesField(1, uid(1, "a")), bytesField(5, uid(1, "k"))),
			Request{Kind: KindKeep, UID: "k"}},
		{"a member set again after another starts afresh", cat(bytesField(1, uid(1, "a")), bytesField(2, uid(2, "d")), bytesField(1, nil)),
			Request{Kind: KindAdd}},
		{"last scalar wins", bytesField(2, cat(uid(2, "first"), uid(2, "second"))), Request{Kind: KindDel, UID: "second"}},
		{"del's uid is field 2: field 1 is unknown there", bytesField(2, uid(1, "x")), Request{Kind: KindDel}},
		{"empty message has no payload", nil, Request{}},
	} {
		got, err := UnmarshalRequest(tc.in)
		if err != nil || !equalRequest(got, tc.want) {
			t.Errorf("%s: %x read as %+v, %v; want %+v", tc.name, tc.in, got, err, tc.want)
		}
	}

	for _, tc := range []struct {
		name, in, wantErr string
	}{
		{"truncated length", "0a05", "field 1"},
		{"truncated varint", "08", "ZdsHello"},
		{"truncated inside add", "0a030a0575", "AddWorkload"},
		{"field number zero", "0001", "bad field tag"},
		{"end group at top level", "0c", "end group"},
		{"invalid UTF-8", "12031201ff", "not valid UTF-8"},
		{"wire type 7", "0f", "reserved wire type"},
	} {
		b, _ := hex.DecodeString(tc.in)
		_, rerr := UnmarshalRequest(b)
		_, herr := UnmarshalHello(b)
		err := rerr
		if tc.name == "truncated varint" {
			err = herr
		}
		if err == nil || !strings.Contains(err.Error(), tc.wantErr) {
			t.Errorf("%s: %s: got %v, want an error naming %q", tc.name, tc.in, err, tc.wantErr)
		}
	}
}

func TestMarshalRefuses(t *testing.T) {
	for _, tc := range []struct {
		req     Request
		wantErr string
	}{
		{Request{Kind: KindAdd, UID: "\xff"}, "uid"},
		{Request{Kind: KindAdd, UID: "u", Info: &WorkloadInfo{Namespace: "\xc3"}}, "namespace"},
		{Request{Kind: KindKeep, UID: "u", Info: &WorkloadInfo{}}, "belongs to add"},
		{Request{Kind: KindSnapshotSent, UID: "u"}, "no uid"},
		{Request{Kind: Kind(42)}, "unknown request kind"},
	} {
		if _, err := tc.req.Marshal(); err == nil || !strings.Contains(err.Error(), tc.wantErr) {
			t.Errorf("%+v: got %v, want an error naming %q", tc.req, err, tc.wantErr)
		}
	}
	if _, err := (Response{Ack: &Ack{Error: "\xff"}}).Marshal(); err == nil {
		t.Error("a nack that is not UTF-8: want an error")
	}
}

func fuzzSeeds(f *testing.F) {
	for _, req := range sampleRequests() {
		b, _ := req.Marshal()
		f.Add(b)
		for i := 1; i < len(b); i += 3 {
			f.Add(b[:i])
		}
	}
	for _, s := range []string{"", "0801", "08ffffffff0f", "0a00", "0a040a026e6f", "1a021a00", "0c", "ff", "12031201ff"} {
		b, _ := hex.DecodeString(s)
		f.Add(b)
	}
}

// FuzzUnmarshalRequest holds the decoder to protobuf-go's verdict on any
// input: the same accept or reject, the same message, and what it reads
// it writes back the same.
func FuzzUnmarshalRequest(f *testing.F) {
	fuzzSeeds(f)
	schema := zdsSchema(f)
	f.Fuzz(func(t *testing.T, b []byte) {
		got, err := UnmarshalRequest(b)
		m := newDynamic(schema, "WorkloadRequest")
		perr := proto.Unmarshal(b, m)
		if (err == nil) != (perr == nil) {
			t.Fatalf("%x: ours %v, protobuf-go %v", b, err, perr)
		}
		if err != nil {
			return
		}
		if want := fromDynamic(m); !equalRequest(got, want) {
			t.Fatalf("%x: ours %+v, protobuf-go %+v", b, got, want)
		}
		again, merr := got.Marshal()
		if merr != nil {
			t.Fatalf("%x: read as %+v, which does not marshal: %v", b, got, merr)
		}
		if back, err := UnmarshalRequest(again); err != nil || !equalRequest(back, got) {
			t.Fatalf("%+v: round trip gave %+v, %v", got, back, err)
		}
	})
}

func FuzzUnmarshalResponse(f *testing.F) {
	fuzzSeeds(f)
	schema := zdsSchema(f)
	f.Fuzz(func(t *testing.T, b []byte) {
		got, err := UnmarshalResponse(b)
		m := newDynamic(schema, "WorkloadResponse")
		perr := proto.Unmarshal(b, m)
		if (err == nil) != (perr == nil) {
			t.Fatalf("%x: ours %v, protobuf-go %v", b, err, perr)
		}
		if err != nil {
			return
		}
		ackFD := m.Descriptor().Fields().ByName("ack")
		if m.Has(ackFD) != (got.Ack != nil) {
			t.Fatalf("%x: ack present: ours %v, protobuf-go %v", b, got.Ack != nil, m.Has(ackFD))
		}
		if got.Ack != nil {
			ack := m.Get(ackFD).Message()
			if want := ack.Get(ack.Descriptor().Fields().ByName("error")).String(); got.Ack.Error != want {
				t.Fatalf("%x: error %q, protobuf-go %q", b, got.Ack.Error, want)
			}
		}
	})
}

func FuzzUnmarshalHello(f *testing.F) {
	fuzzSeeds(f)
	schema := zdsSchema(f)
	f.Fuzz(func(t *testing.T, b []byte) {
		got, err := UnmarshalHello(b)
		m := newDynamic(schema, "ZdsHello")
		perr := proto.Unmarshal(b, m)
		if (err == nil) != (perr == nil) {
			t.Fatalf("%x: ours %v, protobuf-go %v", b, err, perr)
		}
		if err == nil && int32(got.Version) != int32(m.Get(m.Descriptor().Fields().ByName("version")).Enum()) {
			t.Fatalf("%x: version %d, protobuf-go %d", b, got.Version, m.Get(m.Descriptor().Fields().ByName("version")).Enum())
		}
	})
}
