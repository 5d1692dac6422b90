package main

import (
	"fmt"
	"strings"
	"unicode"
	"unicode/utf16"
	"unicode/utf8"
)

// Text from a mount table (paths, sources, volume and container names) is
// anyone's: a pod's subPath directory, a FUSE daemon's source string. The
// kernel escapes only space, tab, newline and backslash in mountinfo paths,
// and writes ESC, carriage returns and the rest as they are. Before any of
// it reaches a terminal or a line-oriented reader, scan escapes:
//
//   - ASCII control bytes, DEL and backslash as mountinfo does (\012 for a
//     newline, \033 for ESC, \134 for a backslash), so a path reads as in
//     /proc/self/mountinfo and one row is one line;
//   - C1 controls (U+0080-U+009F, which some terminals take as CSI) and
//     Unicode format characters (bidi overrides, zero-width marks) as \u202e;
//   - bytes that are not UTF-8 as \ooo.

// needsEscape reports whether rune r (from valid UTF-8) must be escaped.
func needsEscape(r rune) bool {
	if r < utf8.RuneSelf {
		return r < 0x20 || r == 0x7f || r == '\\'
	}
	return r <= 0x9f || unicode.Is(unicode.Cf, r)
}

// printable returns s with every byte or character that could move the
// cursor, end the line, change the terminal or hide text escaped.
func printable(s string) string { return escape(s, false) }

// printableText is printable that keeps newlines: for error messages,
// which may span lines.
func printableText(s string) string { return escape(s, true) }

func escape(s string, keepNewline bool) string {
	// Most text is printable ASCII: look at bytes, decode runes only past
	// ASCII, and copy nothing when there is nothing to escape.
	i := 0
	for i < len(s) {
		c := s[i]
		if c >= 0x20 && c < 0x7f && c != '\\' || keepNewline && c == '\n' {
			i++
			continue
		}
		if c >= utf8.RuneSelf {
			if r, n := utf8.DecodeRuneInString(s[i:]); !(r == utf8.RuneError && n == 1) && !needsEscape(r) {
				i += n
				continue
			}
		}
		break
	}
	if i == len(s) {
		return s
	}
	var b strings.Builder
	b.Grow(len(s) + 16)
	b.WriteString(s[:i])
	for i < len(s) {
		r, n := utf8.DecodeRuneInString(s[i:])
		switch {
		case r == utf8.RuneError && n == 1, r < utf8.RuneSelf && needsEscape(r) && !(keepNewline && r == '\n'):
			fmt.Fprintf(&b, "\\%03o", s[i])
		case r >= utf8.RuneSelf && needsEscape(r):
			writeU(&b, r)
		default:
			b.WriteString(s[i : i+n])
		}
		i += n
	}
	return b.String()
}

func writeU(b *strings.Builder, r rune) {
	if r > 0xffff {
		fmt.Fprintf(b, "\\U%08x", r)
		return
	}
	fmt.Fprintf(b, "\\u%04x", r)
}

// jsonSafe escapes, in encoding/json's output, the characters that it
// leaves raw and a terminal may act on: DEL, C1 controls and Unicode format
// characters become \uXXXX escapes (a surrogate pair above U+FFFF), which
// decode to the same string. encoding/json itself escapes the other control
// characters and replaces bytes that are not UTF-8.
func jsonSafe(data []byte) []byte {
	var out []byte
	last := 0
	for i := 0; i < len(data); {
		c := data[i]
		if c < utf8.RuneSelf && c != 0x7f {
			i++
			continue
		}
		r, n := utf8.DecodeRune(data[i:])
		if r != 0x7f && !(r >= 0x80 && r <= 0x9f) && !unicode.Is(unicode.Cf, r) {
			i += n
			continue
		}
		out = append(out, data[last:i]...)
		if r > 0xffff {
			r1, r2 := utf16.EncodeRune(r)
			out = fmt.Appendf(out, "\\u%04x\\u%04x", r1, r2)
		} else {
			out = fmt.Appendf(out, "\\u%04x", r)
		}
		i += n
		last = i
	}
	if out == nil {
		return data
	}
	return append(out, data[last:]...)
}
