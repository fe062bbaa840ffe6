//! Strings from outside (a client's name, paths, an abort's reason, an error
//! message that quotes them, names found on disk that clients created) as
//! they go into a log line: [`esc`], the one way every log site prints them.
//!
//! The value is quoted, so it cannot pose as another `key=value` field; a
//! quote, a backslash, every control character (newline and carriage return
//! included, so it cannot start a line of its own; ESC, so it cannot drive a
//! terminal) and the invisible format characters that reorder or hide text
//! (bidirectional overrides, zero-width marks, line and paragraph
//! separators) are written as escapes; and at most [`MAX_LOGGED`] characters
//! are written, then how many bytes were left out. rcpd refuses no string
//! for this: what it answers the client is unchanged.

use std::fmt::{self, Display, Write};

/// Characters of one value written to a log line; the rest is counted.
pub const MAX_LOGGED: usize = 256;

/// `t` (anything `Display`, formatted once, without allocating) quoted,
/// escaped and cut at [`MAX_LOGGED`] characters, for a log line:
/// `tracing::info!(client = %esc(&req.client_name), ...)`.
pub fn esc<T: Display>(t: T) -> Esc<T> {
    Esc(t)
}

/// What [`esc`] returns; `Display` and `Debug` write the same.
pub struct Esc<T>(T);

impl<T: Display> Display for Esc<T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_char('"')?;
        let mut w = Limited {
            out: f,
            left: MAX_LOGGED,
            cut: 0,
        };
        write!(w, "{}", self.0)?;
        let cut = w.cut;
        f.write_char('"')?;
        if cut > 0 {
            write!(f, "...(+{cut} bytes)")?;
        }
        Ok(())
    }
}

impl<T: Display> fmt::Debug for Esc<T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        Display::fmt(self, f)
    }
}

/// Writes escaped characters while `left` lasts, then counts what it drops.
struct Limited<'a, 'b> {
    out: &'a mut fmt::Formatter<'b>,
    left: usize,
    cut: usize,
}

impl Write for Limited<'_, '_> {
    fn write_str(&mut self, s: &str) -> fmt::Result {
        for (i, c) in s.char_indices() {
            if self.left == 0 {
                self.cut += s.len() - i;
                return Ok(());
            }
            self.left -= 1;
            escaped(self.out, c)?;
        }
        Ok(())
    }
}

/// `c` as [`esc`] writes it.
fn escaped(out: &mut impl Write, c: char) -> fmt::Result {
    match c {
        '"' => out.write_str("\\\""),
        '\\' => out.write_str("\\\\"),
        '\n' => out.write_str("\\n"),
        '\r' => out.write_str("\\r"),
        '\t' => out.write_str("\\t"),
        c if hidden(c) => write!(out, "\\u{{{:x}}}", c as u32),
        c => out.write_char(c),
    }
}

/// A name (a path) for a line of rcp's own output, a dry run's `would
/// push SRC -> DST` or `deleting PATH`: as it is when it holds nothing
/// [`esc`] would escape; else quoted and escaped as [`esc`] does, whole
/// (never cut: the line is the listing). So a newline in a name cannot
/// start a line of its own, an escape sequence cannot reach the terminal,
/// and a quoted name is never taken for a plain one (a name with a quote
/// or a backslash in it is quoted too).
pub fn name(s: &str) -> std::borrow::Cow<'_, str> {
    if !s.chars().any(|c| c == '"' || c == '\\' || hidden(c)) {
        return std::borrow::Cow::Borrowed(s);
    }
    let mut out = String::with_capacity(s.len() + 8);
    out.push('"');
    for c in s.chars() {
        // Writing to a String does not fail.
        let _ = escaped(&mut out, c);
    }
    out.push('"');
    std::borrow::Cow::Owned(out)
}

/// Control characters (C0, DEL, C1) and the format characters that move,
/// hide or break text when a log is read.
fn hidden(c: char) -> bool {
    c.is_control()
        || matches!(c,
            '\u{00ad}'                  // soft hyphen
            | '\u{061c}'                // Arabic letter mark
            | '\u{180e}'                // Mongolian vowel separator
            | '\u{200b}'..='\u{200f}'   // zero-width space .. right-to-left mark
            | '\u{2028}'..='\u{202e}'   // line/paragraph separators, embeddings, overrides
            | '\u{2060}'..='\u{206f}'   // word joiner .. isolates, deprecated format marks
            | '\u{feff}'                // zero-width no-break space (BOM)
            | '\u{fff9}'..='\u{fffb}'   // interlinear annotations
        )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn plain_text_is_quoted_as_is() {
        assert_eq!(esc("raw-test").to_string(), "\"raw-test\"");
        assert_eq!(esc("a/b c.txt").to_string(), "\"a/b c.txt\"");
        assert_eq!(esc("übergröße 名前").to_string(), "\"übergröße 名前\"");
        assert_eq!(format!("{:?}", esc("x")), "\"x\"");
        assert_eq!(esc(42).to_string(), "\"42\"");
    }

    /// A newline cannot start a line of its own, a quote cannot end the
    /// field, an escape sequence cannot reach a terminal.
    #[test]
    fn nothing_breaks_out_of_the_field() {
        let forged = "rcp\n2026-12-01T00:00:00Z  INFO rcp: session opened client=\"admin\"";
        let s = esc(forged).to_string();
        assert!(!s.contains('\n'), "{s}");
        assert!(s.starts_with("\"rcp\\n2026"), "{s}");
        assert_eq!(s.matches('"').count() - s.matches("\\\"").count(), 2, "{s}");
        assert_eq!(esc("a\"b\\c").to_string(), r#""a\"b\\c""#);
        assert_eq!(esc("\r\t\u{1b}[31m").to_string(), r#""\r\t\u{1b}[31m""#);
        assert_eq!(esc("\u{7f}\u{85}").to_string(), r#""\u{7f}\u{85}""#);
        // Text that reads backwards, or not at all.
        assert_eq!(
            esc("a\u{202e}b\u{200b}c\u{2028}d\u{feff}").to_string(),
            r#""a\u{202e}b\u{200b}c\u{2028}d\u{feff}""#
        );
    }

    #[test]
    fn a_name_is_escaped_only_when_it_must_be_and_never_cut() {
        assert_eq!(name("dir/a b.txt"), "dir/a b.txt");
        assert_eq!(name("übergröße 名前"), "übergröße 名前");
        assert_eq!(name("a\nb"), r#""a\nb""#);
        assert_eq!(name("c\u{1b}[31mred"), r#""c\u{1b}[31mred""#);
        assert_eq!(name("q\"uote"), r#""q\"uote""#);
        assert_eq!(name("back\\slash"), r#""back\\slash""#);
        assert_eq!(name("rtl\u{202e}x"), r#""rtl\u{202e}x""#);
        let long = format!("{}\n", "x".repeat(MAX_LOGGED * 4));
        assert_eq!(name(&long).len(), MAX_LOGGED * 4 + 4);
    }

    #[test]
    fn long_values_are_cut_and_counted() {
        let long = "x".repeat(1 << 20);
        let s = esc(&long).to_string();
        assert_eq!(
            s,
            format!(
                "\"{}\"...(+{} bytes)",
                "x".repeat(MAX_LOGGED),
                (1 << 20) - MAX_LOGGED
            )
        );
        // Characters, not bytes, are counted; the cut never splits one.
        let wide = "é".repeat(MAX_LOGGED + 3);
        let s = esc(&wide).to_string();
        assert!(
            s.starts_with(&format!("\"{}\"", "é".repeat(MAX_LOGGED))),
            "{s}"
        );
        assert!(s.ends_with("...(+6 bytes)"), "{s}");
        // Exactly at the limit: nothing cut.
        let at = "y".repeat(MAX_LOGGED);
        assert_eq!(esc(&at).to_string(), format!("\"{at}\""));
    }

    /// A value written in several pieces (a `Display` that calls
    /// `write_str` more than once) is cut across them.
    #[test]
    fn the_limit_spans_pieces() {
        struct Pieces;
        impl Display for Pieces {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                for _ in 0..100 {
                    f.write_str("abcd")?;
                }
                Ok(())
            }
        }
        let s = esc(Pieces).to_string();
        assert!(
            s.ends_with(&format!("\"...(+{} bytes)", 400 - MAX_LOGGED)),
            "{s}"
        );
    }
}
