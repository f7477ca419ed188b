//! A strict, allocation-light JSON reader specialised for safetensors headers.
//!
//! serde_json parses a 57 KB adapter header in about 100 µs; the scan's budget is about 50 µs per
//! adapter for everything (see benches/), so the header is read by this small cursor instead. It
//! accepts exactly RFC 8259 JSON (the grammar serde_json accepts), borrows strings without escapes
//! from the input, and leaves the schema to `header.rs`.

use std::borrow::Cow;

/// A syntax error: what went wrong and where.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SyntaxError {
    pub message: &'static str,
    pub offset: usize,
}

pub type Result<T> = std::result::Result<T, SyntaxError>;

/// The message of the one syntax error that is really an encoding error (see header.rs).
pub const INVALID_UTF8: &str = "invalid UTF-8 in string";

/// Nesting limit for values we skip, as serde_json's default recursion limit.
const MAX_DEPTH: u32 = 128;

pub struct Cursor<'a> {
    src: &'a [u8],
    pub pos: usize,
}

impl<'a> Cursor<'a> {
    pub fn new(src: &'a [u8]) -> Self {
        // Callers need not pre-validate UTF-8: strings are checked as they are read, and the
        // grammar outside strings is ASCII, so any other high byte is a syntax error.
        Cursor { src, pos: 0 }
    }

    pub fn err<T>(&self, message: &'static str) -> Result<T> {
        Err(SyntaxError { message, offset: self.pos })
    }

    #[inline]
    pub fn skip_ws(&mut self) {
        while let Some(&b) = self.src.get(self.pos) {
            if matches!(b, b' ' | b'\n' | b'\r' | b'\t') {
                self.pos += 1;
            } else {
                break;
            }
        }
    }

    /// The next non-whitespace byte, not consumed.
    #[inline]
    pub fn peek(&mut self) -> Option<u8> {
        self.skip_ws();
        self.src.get(self.pos).copied()
    }

    #[inline]
    pub fn expect(&mut self, byte: u8, message: &'static str) -> Result<()> {
        if self.peek() == Some(byte) {
            self.pos += 1;
            Ok(())
        } else {
            self.err(message)
        }
    }

    /// After a value inside an object: true if a `,` follows, false at `}`.
    #[inline]
    pub fn object_next(&mut self) -> Result<bool> {
        match self.peek() {
            Some(b',') => {
                self.pos += 1;
                Ok(true)
            }
            Some(b'}') => {
                self.pos += 1;
                Ok(false)
            }
            _ => self.err("expected ',' or '}'"),
        }
    }

    /// After a value inside an array: true if a `,` follows, false at `]`.
    #[inline]
    pub fn array_next(&mut self) -> Result<bool> {
        match self.peek() {
            Some(b',') => {
                self.pos += 1;
                Ok(true)
            }
            Some(b']') => {
                self.pos += 1;
                Ok(false)
            }
            _ => self.err("expected ',' or ']'"),
        }
    }

    /// Opens an object; returns false if it is empty (`{}` consumed whole).
    pub fn object_start(&mut self) -> Result<bool> {
        self.expect(b'{', "expected '{'")?;
        if self.peek() == Some(b'}') {
            self.pos += 1;
            return Ok(false);
        }
        Ok(true)
    }

    /// If the next key is exactly `"word"` (no escapes), consumes it and its `:`.
    #[inline]
    pub fn known_key(&mut self, word: &[u8]) -> bool {
        self.skip_ws();
        let rest = &self.src[self.pos..];
        if rest.len() > word.len() + 1 && rest[0] == b'"' && &rest[1..=word.len()] == word && rest[word.len() + 1] == b'"' {
            let save = self.pos;
            self.pos += word.len() + 2;
            if self.expect(b':', "expected ':'").is_ok() {
                return true;
            }
            self.pos = save;
        }
        false
    }

    /// Reads `"key" :` inside an object.
    #[inline]
    pub fn key(&mut self) -> Result<Cow<'a, str>> {
        let key = self.string()?;
        self.expect(b':', "expected ':'")?;
        Ok(key)
    }

    /// Reads a string, borrowing it when it has no escapes.
    #[inline]
    pub fn string(&mut self) -> Result<Cow<'a, str>> {
        self.expect(b'"', "expected a string")?;
        let start = self.pos;
        let src = self.src;
        let Some(len) = memchr::memchr2(b'"', b'\\', &src[start..]) else {
            self.pos = src.len();
            return self.err("unterminated string");
        };
        let end = start + len;
        let body = &src[start..end];
        // One OR-reduction (it vectorises) tells whether any byte is a control or non-ASCII byte.
        let odd = body.iter().fold(0u8, |acc, &b| acc | u8::from(b < 0x20) | (b & 0x80));
        if odd & 1 != 0 {
            self.pos = start + body.iter().position(|&b| b < 0x20).unwrap_or(0);
            return self.err("control character in string");
        }
        if src[end] == b'\\' {
            self.pos = end;
            return self.string_escaped(start).map(Cow::Owned);
        }
        let text = if odd & 0x80 != 0 {
            match std::str::from_utf8(body) {
                Ok(t) => t,
                Err(e) => {
                    self.pos = start + e.valid_up_to();
                    return self.err(INVALID_UTF8);
                }
            }
        } else {
            as_str(body)
        };
        self.pos = end + 1;
        Ok(Cow::Borrowed(text))
    }

    fn string_escaped(&mut self, start: usize) -> Result<String> {
        let head = std::str::from_utf8(&self.src[start..self.pos]).map_err(|e| SyntaxError {
            message: INVALID_UTF8,
            offset: start + e.valid_up_to(),
        })?;
        let mut out = String::from(head);
        loop {
            let Some(&b) = self.src.get(self.pos) else {
                return self.err("unterminated string");
            };
            match b {
                b'"' => {
                    self.pos += 1;
                    return Ok(out);
                }
                b'\\' => {
                    self.pos += 1;
                    let Some(&e) = self.src.get(self.pos) else {
                        return self.err("unterminated string");
                    };
                    self.pos += 1;
                    match e {
                        b'"' => out.push('"'),
                        b'\\' => out.push('\\'),
                        b'/' => out.push('/'),
                        b'b' => out.push('\u{8}'),
                        b'f' => out.push('\u{c}'),
                        b'n' => out.push('\n'),
                        b'r' => out.push('\r'),
                        b't' => out.push('\t'),
                        b'u' => out.push(self.unicode_escape()?),
                        _ => {
                            self.pos -= 1;
                            return self.err("invalid escape");
                        }
                    }
                }
                0..=0x1f => return self.err("control character in string"),
                _ => {
                    // Copy the run of plain bytes up to the next quote, backslash or control byte.
                    let run_start = self.pos;
                    let mut i = self.pos;
                    while i < self.src.len() && !matches!(self.src[i], b'"' | b'\\' | 0..=0x1f) {
                        i += 1;
                    }
                    match std::str::from_utf8(&self.src[run_start..i]) {
                        Ok(t) => out.push_str(t),
                        Err(e) => {
                            self.pos = run_start + e.valid_up_to();
                            return self.err(INVALID_UTF8);
                        }
                    }
                    self.pos = i;
                }
            }
        }
    }

    fn hex4(&mut self) -> Result<u32> {
        let Some(digits) = self.src.get(self.pos..self.pos + 4) else {
            return self.err("truncated \\u escape");
        };
        let mut v = 0u32;
        for &d in digits {
            let n = match d {
                b'0'..=b'9' => d - b'0',
                b'a'..=b'f' => d - b'a' + 10,
                b'A'..=b'F' => d - b'A' + 10,
                _ => return self.err("invalid \\u escape"),
            };
            v = v * 16 + u32::from(n);
        }
        self.pos += 4;
        Ok(v)
    }

    fn unicode_escape(&mut self) -> Result<char> {
        let first = self.hex4()?;
        let code = match first {
            0xD800..=0xDBFF => {
                if self.src.get(self.pos..self.pos + 2) != Some(b"\\u") {
                    return self.err("lone leading surrogate in \\u escape");
                }
                self.pos += 2;
                let second = self.hex4()?;
                if !(0xDC00..=0xDFFF).contains(&second) {
                    return self.err("invalid trailing surrogate in \\u escape");
                }
                0x10000 + ((first - 0xD800) << 10) + (second - 0xDC00)
            }
            0xDC00..=0xDFFF => return self.err("lone trailing surrogate in \\u escape"),
            c => c,
        };
        char::from_u32(code).map_or_else(|| self.err("invalid \\u escape"), Ok)
    }

    /// Reads a non-negative integer that fits in u64 (what safetensors' `usize` fields accept).
    #[inline]
    pub fn uint(&mut self) -> Result<u64> {
        self.skip_ws();
        let start = self.pos;
        let src = self.src;
        let mut i = start;
        let mut value: u64 = 0;
        while let Some(&d) = src.get(i) {
            if !d.is_ascii_digit() {
                break;
            }
            value = match value.checked_mul(10).and_then(|v| v.checked_add(u64::from(d - b'0'))) {
                Some(v) => v,
                None => {
                    self.pos = start;
                    return self.err("integer does not fit in 64 bits");
                }
            };
            i += 1;
        }
        if i == start {
            return self.err("expected a non-negative integer");
        }
        if src[start] == b'0' && i - start > 1 {
            return self.err("leading zero in integer");
        }
        if matches!(src.get(i), Some(b'.' | b'e' | b'E')) {
            self.pos = i;
            return self.err("expected an integer, found a float");
        }
        self.pos = i;
        Ok(value)
    }

    /// Skips any JSON value, validating it.
    pub fn skip_value(&mut self) -> Result<()> {
        self.skip_value_at(0)
    }

    fn skip_value_at(&mut self, depth: u32) -> Result<()> {
        if depth > MAX_DEPTH {
            return self.err("nesting too deep");
        }
        match self.peek() {
            Some(b'"') => self.string().map(drop),
            Some(b'{') => {
                if self.object_start()? {
                    loop {
                        self.key()?;
                        self.skip_value_at(depth + 1)?;
                        if !self.object_next()? {
                            break;
                        }
                    }
                }
                Ok(())
            }
            Some(b'[') => {
                self.pos += 1;
                if self.peek() == Some(b']') {
                    self.pos += 1;
                    return Ok(());
                }
                loop {
                    self.skip_value_at(depth + 1)?;
                    if !self.array_next()? {
                        return Ok(());
                    }
                }
            }
            Some(b't') => self.literal(b"true"),
            Some(b'f') => self.literal(b"false"),
            Some(b'n') => self.literal(b"null"),
            Some(b'-' | b'0'..=b'9') => self.number(),
            Some(_) => self.err("expected a value"),
            None => self.err("unexpected end of input"),
        }
    }

    /// Consumes `null` if it is next.
    pub fn null(&mut self) -> bool {
        if self.peek() == Some(b'n') && self.src[self.pos..].starts_with(b"null") {
            self.pos += 4;
            true
        } else {
            false
        }
    }

    fn literal(&mut self, word: &[u8]) -> Result<()> {
        if self.src[self.pos..].starts_with(word) {
            self.pos += word.len();
            Ok(())
        } else {
            self.err("invalid literal")
        }
    }

    fn number(&mut self) -> Result<()> {
        let src = self.src;
        let mut i = self.pos;
        if src.get(i) == Some(&b'-') {
            i += 1;
        }
        let int_start = i;
        while src.get(i).is_some_and(u8::is_ascii_digit) {
            i += 1;
        }
        if i == int_start || (src[int_start] == b'0' && i - int_start > 1) {
            self.pos = int_start;
            return self.err("invalid number");
        }
        if src.get(i) == Some(&b'.') {
            i += 1;
            let frac = i;
            while src.get(i).is_some_and(u8::is_ascii_digit) {
                i += 1;
            }
            if i == frac {
                self.pos = i;
                return self.err("invalid number");
            }
        }
        if matches!(src.get(i), Some(b'e' | b'E')) {
            i += 1;
            if matches!(src.get(i), Some(b'+' | b'-')) {
                i += 1;
            }
            let exp = i;
            while src.get(i).is_some_and(u8::is_ascii_digit) {
                i += 1;
            }
            if i == exp {
                self.pos = i;
                return self.err("invalid number");
            }
        }
        self.pos = i;
        Ok(())
    }

    /// Only whitespace may follow the top-level value.
    pub fn finish(&mut self) -> Result<()> {
        if self.peek().is_some() {
            return self.err("trailing characters after the JSON value");
        }
        Ok(())
    }
}

/// For slices already checked to be ASCII (every byte < 0x80).
#[inline]
fn as_str(bytes: &[u8]) -> &str {
    debug_assert!(bytes.is_ascii());
    // SAFETY: callers pass only slices whose bytes are all < 0x80, which is valid UTF-8.
    unsafe { std::str::from_utf8_unchecked(bytes) }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn strings_and_escapes() {
        let mut c = Cursor::new(br#""a\"b\u00e9\ud83d\ude00""#);
        assert_eq!(c.string().unwrap(), "a\"bé😀");
        let mut c = Cursor::new(br#""\ud83d""#);
        assert!(c.string().is_err());
        let mut c = Cursor::new(b"\"a\nb\"");
        assert!(c.string().is_err());
    }

    #[test]
    fn integers() {
        assert_eq!(Cursor::new(b" 18446744073709551615").uint().unwrap(), u64::MAX);
        assert!(Cursor::new(b"18446744073709551616").uint().is_err());
        assert!(Cursor::new(b"01").uint().is_err());
        assert!(Cursor::new(b"1.0").uint().is_err());
        assert!(Cursor::new(b"-1").uint().is_err());
    }

    #[test]
    fn skipping_values() {
        let mut c = Cursor::new(br#"{"a": [1, -2.5e3, true, null, {"b": "c"}]} "#);
        c.skip_value().unwrap();
        c.finish().unwrap();
        assert!(Cursor::new(b"[1,]").skip_value().is_err());
        assert!(Cursor::new(b"{\"a\" 1}").skip_value().is_err());
        let deep = "[".repeat(200) + &"]".repeat(200);
        assert!(Cursor::new(deep.as_bytes()).skip_value().is_err());
    }
}
