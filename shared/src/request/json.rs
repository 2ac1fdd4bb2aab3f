//! A small validating JSON scanner that hands out borrowed raw slices.
//!
//! The request path only needs a few fields of a body that may be megabytes of prompt text,
//! so instead of building values it walks the bytes once: strings are scanned eight bytes at a
//! time for `"`, `\` and control characters, and skipped values are checked for structure
//! without recursion. String contents are not checked for UTF-8 (prompt bytes are hashed as
//! sent; the model server rejects invalid text); the short strings kvoy reads as text are.

use std::borrow::Cow;

use thiserror::Error;

/// Deepest nesting accepted, as serde_json's default recursion limit.
const MAX_DEPTH: usize = 128;

#[derive(Debug, Error, PartialEq, Eq)]
pub enum JsonError {
    #[error("unexpected end of input")]
    Eof,
    #[error("unexpected {found} at byte {at}, expected {expected}")]
    Unexpected {
        at: usize,
        found: String,
        expected: &'static str,
    },
    #[error("nesting deeper than {MAX_DEPTH} levels at byte {0}")]
    TooDeep(usize),
    #[error("invalid escape in string at byte {0}")]
    BadEscape(usize),
    #[error("string at byte {0} is not valid UTF-8")]
    BadUtf8(usize),
}

const LO: u64 = 0x0101_0101_0101_0101;
const HI: u64 = 0x8080_8080_8080_8080;

/// A mask with the high bit set in each lane of `x` that is `"`, `\\` or below 0x20, and
/// possibly in lanes after such a lane (borrows run upwards); the lowest set bit is exact.
#[inline]
fn special_mask(x: u64) -> u64 {
    let quote = x ^ (LO * u64::from(b'"'));
    let backslash = x ^ (LO * u64::from(b'\\'));
    let zero = |v: u64| v.wrapping_sub(LO) & !v & HI;
    let control = x.wrapping_sub(LO * 0x20) & !x & HI;
    zero(quote) | zero(backslash) | control
}

#[derive(Debug, Clone)]
pub struct Cursor<'a> {
    b: &'a [u8],
    i: usize,
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum Frame {
    Object,
    Array,
}

impl<'a> Cursor<'a> {
    pub fn new(b: &'a [u8]) -> Self {
        Cursor { b, i: 0 }
    }

    fn unexpected(&self, expected: &'static str) -> JsonError {
        match self.b.get(self.i) {
            None => JsonError::Eof,
            Some(&c) => JsonError::Unexpected {
                at: self.i,
                found: if c.is_ascii_graphic() {
                    format!("`{}`", c as char)
                } else {
                    format!("byte 0x{c:02x}")
                },
                expected,
            },
        }
    }

    #[inline]
    pub fn ws(&mut self) {
        while let Some(c) = self.b.get(self.i) {
            if matches!(c, b' ' | b'\n' | b'\r' | b'\t') {
                self.i += 1;
            } else {
                break;
            }
        }
    }

    /// The next non-whitespace byte, not consumed.
    #[inline]
    pub fn peek(&mut self) -> Option<u8> {
        self.ws();
        self.b.get(self.i).copied()
    }

    fn expect(&mut self, c: u8, what: &'static str) -> Result<(), JsonError> {
        if self.peek() == Some(c) {
            self.i += 1;
            Ok(())
        } else {
            Err(self.unexpected(what))
        }
    }

    /// Fails unless only whitespace is left.
    pub fn end(&mut self) -> Result<(), JsonError> {
        match self.peek() {
            None => Ok(()),
            Some(_) => Err(self.unexpected("end of input")),
        }
    }

    /// A string, returned as the raw bytes between its quotes (escapes unprocessed).
    pub fn string(&mut self) -> Result<&'a [u8], JsonError> {
        self.expect(b'"', "a string")?;
        let start = self.i;
        let b = self.b;
        let mut i = self.i;
        loop {
            // Eight bytes at a time up to the first byte that needs a look.
            while let Some(chunk) = b.get(i..i + 8) {
                let mut word = [0u8; 8];
                word.copy_from_slice(chunk);
                let mask = special_mask(u64::from_le_bytes(word));
                if mask != 0 {
                    i += (mask.trailing_zeros() / 8) as usize;
                    break;
                }
                i += 8;
            }
            let Some(&c) = b.get(i) else {
                self.i = i;
                return Err(JsonError::Eof);
            };
            match c {
                b'"' => {
                    self.i = i + 1;
                    return Ok(&b[start..i]);
                }
                b'\\' => match b.get(i + 1) {
                    Some(b'"' | b'\\' | b'/' | b'b' | b'f' | b'n' | b'r' | b't') => i += 2,
                    Some(b'u') => {
                        let hex = b.get(i + 2..i + 6).ok_or(JsonError::Eof)?;
                        if !hex.iter().all(u8::is_ascii_hexdigit) {
                            return Err(JsonError::BadEscape(i));
                        }
                        i += 6;
                    }
                    Some(_) => return Err(JsonError::BadEscape(i)),
                    None => return Err(JsonError::Eof),
                },
                0..=0x1f => {
                    self.i = i;
                    return Err(self.unexpected("an escaped control character"));
                }
                _ => i += 1,
            }
        }
    }

    fn literal(&mut self, word: &'static [u8]) -> Result<(), JsonError> {
        if self.b.get(self.i..self.i + word.len()) == Some(word) {
            self.i += word.len();
            Ok(())
        } else {
            Err(self.unexpected("a JSON value"))
        }
    }

    fn digits(&mut self) -> usize {
        let start = self.i;
        while self.b.get(self.i).is_some_and(u8::is_ascii_digit) {
            self.i += 1;
        }
        self.i - start
    }

    fn number(&mut self) -> Result<(), JsonError> {
        if self.b.get(self.i) == Some(&b'-') {
            self.i += 1;
        }
        match self.b.get(self.i) {
            Some(b'0') => self.i += 1,
            Some(b'1'..=b'9') => {
                self.digits();
            }
            _ => return Err(self.unexpected("a digit")),
        }
        if self.b.get(self.i) == Some(&b'.') {
            self.i += 1;
            if self.digits() == 0 {
                return Err(self.unexpected("a digit"));
            }
        }
        if matches!(self.b.get(self.i), Some(b'e' | b'E')) {
            self.i += 1;
            if matches!(self.b.get(self.i), Some(b'+' | b'-')) {
                self.i += 1;
            }
            if self.digits() == 0 {
                return Err(self.unexpected("a digit"));
            }
        }
        Ok(())
    }

    /// Skips one value of any type, checking its structure, and returns its raw bytes.
    pub fn value(&mut self) -> Result<&'a [u8], JsonError> {
        self.ws();
        let start = self.i;
        let mut stack: Vec<Frame> = Vec::new();
        loop {
            // A value starts here.
            match self.peek() {
                Some(b'{') => {
                    if stack.len() >= MAX_DEPTH {
                        return Err(JsonError::TooDeep(self.i));
                    }
                    self.i += 1;
                    if self.peek() == Some(b'}') {
                        self.i += 1;
                    } else {
                        stack.push(Frame::Object);
                        self.string()?;
                        self.expect(b':', "`:`")?;
                        continue;
                    }
                }
                Some(b'[') => {
                    if stack.len() >= MAX_DEPTH {
                        return Err(JsonError::TooDeep(self.i));
                    }
                    self.i += 1;
                    if self.peek() == Some(b']') {
                        self.i += 1;
                    } else {
                        stack.push(Frame::Array);
                        continue;
                    }
                }
                Some(b'"') => {
                    self.string()?;
                }
                Some(b't') => self.literal(b"true")?,
                Some(b'f') => self.literal(b"false")?,
                Some(b'n') => self.literal(b"null")?,
                Some(b'-' | b'0'..=b'9') => self.number()?,
                _ => return Err(self.unexpected("a JSON value")),
            }
            // A value ended: close containers until one continues.
            loop {
                let Some(&top) = stack.last() else {
                    return Ok(&self.b[start..self.i]);
                };
                match (top, self.peek()) {
                    (_, Some(b',')) => {
                        self.i += 1;
                        if top == Frame::Object {
                            self.string()?;
                            self.expect(b':', "`:`")?;
                        }
                        break;
                    }
                    (Frame::Object, Some(b'}')) | (Frame::Array, Some(b']')) => {
                        self.i += 1;
                        stack.pop();
                    }
                    (Frame::Object, _) => return Err(self.unexpected("`,` or `}`")),
                    (Frame::Array, _) => return Err(self.unexpected("`,` or `]`")),
                }
            }
        }
    }

    /// Walks an object, calling `member(cursor, raw_key)` for each member; `member` must
    /// consume exactly the member's value.
    pub fn object(
        &mut self,
        mut member: impl FnMut(&mut Self, &'a [u8]) -> Result<(), JsonError>,
    ) -> Result<(), JsonError> {
        self.expect(b'{', "an object")?;
        if self.peek() == Some(b'}') {
            self.i += 1;
            return Ok(());
        }
        loop {
            let key = self.string()?;
            self.expect(b':', "`:`")?;
            member(self, key)?;
            match self.peek() {
                Some(b',') => self.i += 1,
                Some(b'}') => {
                    self.i += 1;
                    return Ok(());
                }
                _ => return Err(self.unexpected("`,` or `}`")),
            }
        }
    }

    /// Walks an array, calling `element(cursor)` for each element, which it must consume.
    pub fn array(
        &mut self,
        mut element: impl FnMut(&mut Self) -> Result<(), JsonError>,
    ) -> Result<(), JsonError> {
        self.expect(b'[', "an array")?;
        if self.peek() == Some(b']') {
            self.i += 1;
            return Ok(());
        }
        loop {
            element(self)?;
            match self.peek() {
                Some(b',') => self.i += 1,
                Some(b']') => {
                    self.i += 1;
                    return Ok(());
                }
                _ => return Err(self.unexpected("`,` or `]`")),
            }
        }
    }

    /// `null` if it comes next (consumed), for optional fields.
    pub fn null(&mut self) -> Result<bool, JsonError> {
        if self.peek() == Some(b'n') {
            self.literal(b"null")?;
            return Ok(true);
        }
        Ok(false)
    }

    pub fn boolean(&mut self) -> Result<bool, JsonError> {
        match self.peek() {
            Some(b't') => self.literal(b"true").map(|_| true),
            Some(b'f') => self.literal(b"false").map(|_| false),
            _ => Err(self.unexpected("a boolean")),
        }
    }

    /// A string as text, unescaped (borrowed when it has no escapes).
    pub fn text(&mut self) -> Result<Cow<'a, str>, JsonError> {
        let at = self.i;
        let raw = self.string()?;
        unescape(raw).ok_or(JsonError::BadUtf8(at))
    }
}

/// The text of a raw string body (the bytes between the quotes); `None` if it is not valid.
pub fn unescape(raw: &[u8]) -> Option<Cow<'_, str>> {
    if !raw.contains(&b'\\') {
        return std::str::from_utf8(raw).ok().map(Cow::Borrowed);
    }
    let mut quoted = Vec::with_capacity(raw.len() + 2);
    quoted.push(b'"');
    quoted.extend_from_slice(raw);
    quoted.push(b'"');
    serde_json::from_slice::<String>(&quoted)
        .ok()
        .map(Cow::Owned)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn skip(s: &str) -> Result<String, JsonError> {
        let mut c = Cursor::new(s.as_bytes());
        let v = c.value()?;
        c.end()?;
        Ok(String::from_utf8_lossy(v).into_owned())
    }

    #[test]
    fn skips_every_kind_of_value() {
        for ok in [
            "0",
            "-1.5e+3",
            "true",
            "false",
            "null",
            "\"a\\\"b\\u00e9\"",
            "[]",
            "{}",
            "[1,[2,{\"a\":[]}],\"x\"]",
            " {\"a\" : {\"b\" : [ null , true ] } } ",
        ] {
            assert_eq!(skip(ok).unwrap(), ok.trim(), "{ok}");
        }
        for bad in [
            "",
            "[",
            "[1,]",
            "{\"a\"}",
            "{\"a\":}",
            "{,}",
            "01",
            "1.",
            "-",
            "1e",
            "tru",
            "\"abc",
            "\"a\\x\"",
            "\"\\u12g4\"",
            "[1 2]",
            "{\"a\":1,}",
            "\"a\u{1}b\"",
            "[}",
            "{]",
            "1 2",
        ] {
            assert!(skip(bad).is_err(), "accepted {bad:?}");
        }
    }

    #[test]
    fn depth_is_bounded() {
        let deep = "[".repeat(MAX_DEPTH + 1) + &"]".repeat(MAX_DEPTH + 1);
        assert!(matches!(skip(&deep), Err(JsonError::TooDeep(_))));
        let ok = "[".repeat(MAX_DEPTH) + &"]".repeat(MAX_DEPTH);
        assert!(skip(&ok).is_ok());
        // very deep input does not overflow the stack
        let huge = "[".repeat(1_000_000);
        assert!(skip(&huge).is_err());
    }

    #[test]
    fn string_scan_finds_specials_in_every_lane() {
        for lane in 0..20 {
            let mut s = "x".repeat(lane);
            s.push_str("\\\"y\"");
            let json = format!("\"{s}");
            let mut c = Cursor::new(json.as_bytes());
            assert_eq!(
                c.string().unwrap(),
                format!("{}\\\"y", "x".repeat(lane)).as_bytes()
            );
            let ctl = format!("\"{}\u{7}zzzzzzzz\"", "x".repeat(lane));
            assert!(Cursor::new(ctl.as_bytes()).string().is_err());
        }
    }

    #[test]
    fn text_unescapes() {
        let mut c = Cursor::new(br#""a\/b\u00e9""#);
        assert_eq!(c.text().unwrap(), "a/bé");
        let mut c = Cursor::new(b"\"\xff\"");
        assert!(c.text().is_err());
    }
}
