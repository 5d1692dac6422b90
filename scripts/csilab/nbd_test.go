package csilab

import (
	"bytes"
	"encoding/binary"
	"testing"
)

// TestNetlinkAttrs checks the attribute layout the kernel's nla_parse
// expects: 4-byte header (length without padding, type), payload, padding
// to 4; nested attributes carry their children as payload.
func TestNetlinkAttrs(t *testing.T) {
	got := encodeAttrs([]nlAttr{
		{typ: nbdAttrIndex, data: u32(7)},
		{typ: ctrlAttrFamilyName, data: []byte("nbd\x00")},
		{typ: nbdAttrSockets, nested: []nlAttr{{typ: nbdSockItem, nested: []nlAttr{{typ: nbdSockFD, data: u32(3)}}}}},
		{typ: 9, data: []byte{1}},
	})
	var want []byte
	put := func(n, typ uint16, payload ...byte) {
		want = binary.NativeEndian.AppendUint16(want, n)
		want = binary.NativeEndian.AppendUint16(want, typ)
		want = append(want, payload...)
	}
	put(8, nbdAttrIndex, u32(7)...)
	put(8, ctrlAttrFamilyName, 'n', 'b', 'd', 0)
	put(16, nbdAttrSockets)
	put(12, nbdSockItem)
	put(8, nbdSockFD, u32(3)...)
	put(5, 9, 1, 0, 0, 0)
	if !bytes.Equal(got, want) {
		t.Fatalf("encodeAttrs =\n%x, want\n%x", got, want)
	}
	back := decodeAttrs(got)
	if len(back) != 4 || back[0].typ != nbdAttrIndex || binary.NativeEndian.Uint32(back[0].data) != 7 ||
		string(back[1].data) != "nbd\x00" || len(back[2].data) != 12 || !bytes.Equal(back[3].data, []byte{1}) {
		t.Fatalf("decodeAttrs(encodeAttrs(x)) = %+v", back)
	}
	// A truncated attribute ends the list instead of reading past it.
	if n := len(decodeAttrs(got[:len(got)-6])); n != 3 {
		t.Errorf("decodeAttrs of a cut list = %d attributes, want 3", n)
	}
}
