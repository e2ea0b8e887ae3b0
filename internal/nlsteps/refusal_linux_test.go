package nlsteps

import (
	"encoding/binary"
	"testing"

	"golang.org/x/sys/unix"
)

// errorAnswer is the kernel's NLMSG_ERROR body for a refused request of
// type typ, with extended words msg ("" for none).
func errorAnswer(typ uint16, errno int32, msg string) Message {
	b := binary.NativeEndian.AppendUint32(nil, uint32(-errno))
	b = binary.NativeEndian.AppendUint32(b, HeaderLen)
	b = binary.NativeEndian.AppendUint16(b, typ)
	b = append(b, make([]byte, HeaderLen-6)...)
	if msg != "" {
		b = Attr(b, unix.NLMSGERR_ATTR_MSG, append([]byte(msg), 0))
	}
	return Message{Type: unix.NLMSG_ERROR, Body: b}
}

// TestRefusalWords: a refusal reads as the errno, with the kernel's
// extended words; ipset's own numbers, which the C library does not
// know, read in ipset's words, and only for an ipset request.
func TestRefusalWords(t *testing.T) {
	ipsetAdd := uint16(unix.NFNL_SUBSYS_IPSET<<8 | 9)
	for _, c := range []struct {
		typ   uint16
		errno int32
		msg   string
		want  string
	}{
		{unix.RTM_NEWADDR, int32(unix.EINVAL), "ipv4: Invalid prefix length", "invalid argument (ipv4: Invalid prefix length)"},
		{ipsetAdd, int32(unix.ENOENT), "", "no such file or directory"},
		{ipsetAdd, 4104, "", "ipset: invalid prefix length"},
		{ipsetAdd, 4100, "", "ipset: the set is in use"},
		{ipsetAdd, 4115, "", "ipset: a bitmask and a netmask together"},
		{ipsetAdd, 4352, "", "ipset: error 4352 of the set's type (a hash set full, an entry outside a bitmap's range)"},
		{ipsetAdd, 4200, "", "ipset: error 4200"},
		// Not ipset's: the number as the C library has it.
		{uint16(unix.NFNL_SUBSYS_NFTABLES<<8 | unix.NFT_MSG_NEWTABLE), 4104, "", "errno 4104"},
	} {
		if got := refusal(errorAnswer(c.typ, c.errno, c.msg), c.errno).Error(); got != c.want {
			t.Errorf("type %#x, errno %d: %q, want %q", c.typ, c.errno, got, c.want)
		}
	}
}
