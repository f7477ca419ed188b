//! A strict, allocation-light JSON reader specialised for safetensors headers.
//!
//! serde_json parses a 57 KB adapter header in about 100 µs; the scan's budget is about 50 µs per
//! adapter for everything (see benches/), so the header is read by this small cursor instead. It
//! accepts exactly what serde_json accepts (RFC 8259, plus serde_json's recursion limit and its
//! float range), borrows strings without escapes from the input, and leaves the schema to
//! `header.rs`.

use std::borrow::Cow;
use std::sync::OnceLock;

/// A syntax error: what went wrong and where.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SyntaxError {
    /// What is wrong.
    pub message: &'static str,
    /// The byte offset in the input where it was found.
    pub offset: usize,
}

/// A result whose error is a [`SyntaxError`].
pub type Result<T> = std::result::Result<T, SyntaxError>;

/// The message of the one syntax error that is really an encoding error (see header.rs).
pub const INVALID_UTF8: &str = "invalid UTF-8 in string";

/// serde_json's recursion limit: the 128th nested array or object is an error.
const MAX_OPEN: u32 = 128;

/// A number as serde_json reads it: integers that fit stay integers, the rest become `f64`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Number {
    /// A non-negative integer that fits 64 bits.
    U64(u64),
    /// A negative integer that fits 64 bits.
    I64(i64),
    /// Any other number.
    F64(f64),
}

impl Number {
    /// serde_json's `Value::as_u64`.
    pub fn as_u64(self) -> Option<u64> {
        match self {
            Number::U64(v) => Some(v),
            Number::I64(_) | Number::F64(_) => None,
        }
    }

    /// serde_json's `Value::as_f64`.
    #[allow(clippy::cast_precision_loss)]
    pub fn as_f64(self) -> f64 {
        match self {
            Number::U64(v) => v as f64,
            Number::I64(v) => v as f64,
            Number::F64(v) => v,
        }
    }
}

/// Bytes that end a plain run inside a string: quote, backslash, control and non-ASCII bytes.
static STRING_STOP: [bool; 256] = {
    let mut table = [false; 256];
    let mut i = 0;
    while i < 256 {
        table[i] = i < 0x20 || i >= 0x80 || i == b'"' as usize || i == b'\\' as usize;
        i += 1;
    }
    table
};

/// Index of the first byte at or after `i` that `STRING_STOP` marks, or `src.len()`.
#[inline]
pub(crate) fn plain_run_end(src: &[u8], mut i: usize) -> usize {
    #[cfg(target_arch = "x86_64")]
    {
        use std::arch::x86_64::{
            __m128i, _mm_cmpeq_epi8, _mm_cmplt_epi8, _mm_loadu_si128, _mm_movemask_epi8, _mm_or_si128, _mm_set1_epi8,
        };
        // SAFETY: SSE2 is part of the x86_64 baseline, and every load reads 16 bytes inside `src`.
        unsafe {
            let quote = _mm_set1_epi8(b'"' as i8);
            let backslash = _mm_set1_epi8(b'\\' as i8);
            let space = _mm_set1_epi8(0x20);
            while i + 16 <= src.len() {
                let v = _mm_loadu_si128(src.as_ptr().add(i).cast::<__m128i>());
                // A signed compare: bytes >= 0x80 are negative, so `< 0x20` catches them as well.
                let stop = _mm_or_si128(
                    _mm_or_si128(_mm_cmpeq_epi8(v, quote), _mm_cmpeq_epi8(v, backslash)),
                    _mm_cmplt_epi8(v, space),
                );
                let mask = _mm_movemask_epi8(stop) as u32;
                if mask != 0 {
                    return i + mask.trailing_zeros() as usize;
                }
                i += 16;
            }
        }
    }
    while i < src.len() && !STRING_STOP[usize::from(src[i])] {
        i += 1;
    }
    i
}

/// `10^e` exactly as the float literal `1e{e}` (what serde_json's table holds), for `e <= 308`.
fn pow10(e: usize) -> f64 {
    static TABLE: OnceLock<Vec<f64>> = OnceLock::new();
    TABLE.get_or_init(|| {
        (0..=308)
            .map(|i| format!("1e{i}").parse().unwrap_or(f64::INFINITY))
            .collect()
    })[e]
}

/// A position in JSON text, read forward by the methods below.
pub struct Cursor<'a> {
    src: &'a [u8],
    /// The byte offset of the next byte to read.
    pub pos: usize,
}

impl<'a> Cursor<'a> {
    /// A cursor at the start of `src`.
    pub fn new(src: &'a [u8]) -> Self {
        // Callers need not pre-validate UTF-8: strings are checked as they are read, and the
        // grammar outside strings is ASCII, so any other high byte is a syntax error.
        Cursor { src, pos: 0 }
    }

    /// The whole input.
    #[inline]
    pub fn src(&self) -> &'a [u8] {
        self.src
    }

    /// A syntax error `message` at the cursor.
    pub fn err<T>(&self, message: &'static str) -> Result<T> {
        Err(SyntaxError {
            message,
            offset: self.pos,
        })
    }

    /// Moves past JSON whitespace.
    #[inline]
    pub fn skip_ws(&mut self) {
        while let Some(&b) = self.src.get(self.pos) {
            if b > b' ' || !matches!(b, b' ' | b'\n' | b'\r' | b'\t') {
                break;
            }
            self.pos += 1;
        }
    }

    /// The next non-whitespace byte, not consumed.
    #[inline]
    pub fn peek(&mut self) -> Option<u8> {
        self.skip_ws();
        self.src.get(self.pos).copied()
    }

    /// Consumes `byte` after any whitespace, or fails with `message`.
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
        self.next_or_close(b'}', "expected ',' or '}'")
    }

    /// After a value inside an array: true if a `,` follows, false at `]`.
    #[inline]
    pub fn array_next(&mut self) -> Result<bool> {
        self.next_or_close(b']', "expected ',' or ']'")
    }

    /// After a value inside a container that `close` ends: true if a `,` follows, false at `close`.
    #[inline]
    fn next_or_close(&mut self, close: u8, message: &'static str) -> Result<bool> {
        match self.peek() {
            Some(b',') => {
                self.pos += 1;
                Ok(true)
            }
            Some(b) if b == close => {
                self.pos += 1;
                Ok(false)
            }
            _ => self.err(message),
        }
    }

    /// Opens an object; returns false if it is empty (`{}` consumed whole).
    pub fn object_start(&mut self) -> Result<bool> {
        self.open(b'{', "expected '{'", b'}')
    }

    /// Opens an array; returns false if it is empty (`[]` consumed whole).
    pub fn array_start(&mut self) -> Result<bool> {
        self.open(b'[', "expected '['", b']')
    }

    /// Opens a container that `open` starts and `close` ends; returns false if it is empty.
    fn open(&mut self, open: u8, message: &'static str, close: u8) -> Result<bool> {
        self.expect(open, message)?;
        if self.peek() == Some(close) {
            self.pos += 1;
            return Ok(false);
        }
        Ok(true)
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
        let end = plain_run_end(self.src, start);
        if self.src.get(end) == Some(&b'"') {
            self.pos = end + 1;
            return Ok(Cow::Borrowed(as_str(&self.src[start..end])));
        }
        self.string_slow(start, end)
    }

    /// The rest of a string with escapes, non-ASCII text or an error; `i` is the first such byte.
    #[cold]
    fn string_slow(&mut self, start: usize, mut i: usize) -> Result<Cow<'a, str>> {
        let src = self.src;
        // Unescaped text is built only once an escape is seen; `run` starts the bytes not yet copied.
        let mut out: Option<String> = None;
        let mut run = start;
        loop {
            match src.get(i) {
                None => {
                    self.pos = src.len();
                    return self.err("unterminated string");
                }
                Some(b'"') => {
                    let tail = self.checked_text(run, i)?;
                    self.pos = i + 1;
                    return Ok(match out {
                        None => Cow::Borrowed(tail),
                        Some(mut text) => {
                            text.push_str(tail);
                            Cow::Owned(text)
                        }
                    });
                }
                Some(b'\\') => {
                    let text = out.get_or_insert_with(String::new);
                    text.push_str(self.checked_text(run, i)?);
                    self.pos = i + 1;
                    self.escape(text)?;
                    i = self.pos;
                    run = i;
                }
                Some(&b) if b < 0x20 => {
                    self.pos = i;
                    return self.err("control character in string");
                }
                // Non-ASCII: checked as UTF-8 with the rest of the run.
                Some(_) => i += 1,
            }
            i = plain_run_end(src, i);
        }
    }

    /// `src[from..to]` as text, checking UTF-8 where it has high bytes.
    fn checked_text(&mut self, from: usize, to: usize) -> Result<&'a str> {
        let bytes = &self.src[from..to];
        std::str::from_utf8(bytes).map_err(|e| SyntaxError {
            message: INVALID_UTF8,
            offset: from + e.valid_up_to(),
        })
    }

    /// Reads the escape after a backslash (at `self.pos`) into `out`.
    fn escape(&mut self, out: &mut String) -> Result<()> {
        let Some(&e) = self.src.get(self.pos) else {
            return self.err("unterminated string");
        };
        self.pos += 1;
        let c = match e {
            b'"' => '"',
            b'\\' => '\\',
            b'/' => '/',
            b'b' => '\u{8}',
            b'f' => '\u{c}',
            b'n' => '\n',
            b'r' => '\r',
            b't' => '\t',
            b'u' => self.unicode_escape()?,
            _ => {
                self.pos -= 1;
                return self.err("invalid escape");
            }
        };
        out.push(c);
        Ok(())
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

    /// Skips any JSON value, validating it; `open` is how many arrays and objects enclose it
    /// (serde_json's recursion limit counts from the top of the document).
    pub fn skip_value(&mut self, open: u32) -> Result<()> {
        match self.peek() {
            Some(b'"') => self.string().map(drop),
            Some(b'{') => {
                self.enter(open)?;
                if self.object_start()? {
                    loop {
                        self.key()?;
                        self.skip_value(open + 1)?;
                        if !self.object_next()? {
                            break;
                        }
                    }
                }
                Ok(())
            }
            Some(b'[') => {
                self.enter(open)?;
                if self.array_start()? {
                    loop {
                        self.skip_value(open + 1)?;
                        if !self.array_next()? {
                            break;
                        }
                    }
                }
                Ok(())
            }
            Some(b't') => self.literal(b"true"),
            Some(b'f') => self.literal(b"false"),
            Some(b'n') => self.literal(b"null"),
            Some(b'-' | b'0'..=b'9') => self.number().map(drop),
            Some(_) => self.err("expected a value"),
            None => self.err("unexpected end of input"),
        }
    }

    /// Checks the recursion limit before opening one more array or object inside `open` others.
    #[inline]
    pub fn enter(&self, open: u32) -> Result<()> {
        if open + 1 >= MAX_OPEN {
            return self.err("recursion limit exceeded");
        }
        Ok(())
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

    /// Consumes `word` (`true`, `false`, `null`) at the cursor, or fails.
    pub fn literal(&mut self, word: &[u8]) -> Result<()> {
        if self.src[self.pos..].starts_with(word) {
            self.pos += word.len();
            Ok(())
        } else {
            self.err("invalid literal")
        }
    }

    /// Reads a number the way serde_json does (without `float_roundtrip`), including its
    /// out-of-range error for values that would be infinite.
    pub fn number(&mut self) -> Result<Number> {
        let src = self.src;
        let digit = |i: usize| src.get(i).filter(|d| d.is_ascii_digit()).map(|d| u64::from(d - b'0'));
        let mut i = self.pos;
        let positive = src.get(i) != Some(&b'-');
        if !positive {
            i += 1;
        }
        let mut significand = match digit(i) {
            Some(d) => d,
            None => {
                self.pos = i;
                return self.err("invalid number");
            }
        };
        i += 1;
        // Digits past u64 are dropped and counted in the exponent, as serde_json does.
        let mut exponent: i32 = 0;
        if significand == 0 {
            if digit(i).is_some() {
                self.pos = i;
                return self.err("invalid number");
            }
        } else {
            while let Some(d) = digit(i) {
                i += 1;
                if exponent > 0 {
                    exponent += 1;
                } else if let Some(v) = significand.checked_mul(10).and_then(|v| v.checked_add(d)) {
                    significand = v;
                } else {
                    exponent = 1;
                }
            }
        }
        let mut is_float = exponent > 0;
        if src.get(i) == Some(&b'.') {
            i += 1;
            is_float = true;
            if digit(i).is_none() {
                self.pos = i;
                return self.err("invalid number");
            }
            // Fraction digits are absorbed until the first that would overflow; the rest are dropped.
            let mut overflowed = false;
            while let Some(d) = digit(i) {
                i += 1;
                if overflowed {
                    continue;
                }
                match significand.checked_mul(10).and_then(|v| v.checked_add(d)) {
                    Some(v) => {
                        significand = v;
                        exponent -= 1;
                    }
                    None => overflowed = true,
                }
            }
        }
        if matches!(src.get(i), Some(b'e' | b'E')) {
            i += 1;
            is_float = true;
            let positive_exp = match src.get(i) {
                Some(b'+') => {
                    i += 1;
                    true
                }
                Some(b'-') => {
                    i += 1;
                    false
                }
                _ => true,
            };
            let Some(first) = digit(i) else {
                self.pos = i;
                return self.err("invalid number");
            };
            i += 1;
            let mut exp = first as i32;
            let mut exp_overflow = false;
            while let Some(d) = digit(i) {
                i += 1;
                if exp_overflow {
                    continue;
                }
                match exp.checked_mul(10).and_then(|v| v.checked_add(d as i32)) {
                    Some(v) => exp = v,
                    None => exp_overflow = true,
                }
            }
            if exp_overflow {
                // serde_json: an infinite magnitude is an error, an infinitesimal one is zero.
                if significand != 0 && positive_exp {
                    self.pos = i;
                    return self.err("number out of range");
                }
                self.pos = i;
                return Ok(Number::F64(if positive { 0.0 } else { -0.0 }));
            }
            exponent = if positive_exp {
                exponent.saturating_add(exp)
            } else {
                exponent.saturating_sub(exp)
            };
        }
        self.pos = i;
        if !is_float {
            return Ok(if positive {
                Number::U64(significand)
            } else {
                match 0i64.checked_sub_unsigned(significand) {
                    // serde_json reads `-0` as a float.
                    Some(v) if v != 0 => Number::I64(v),
                    _ => Number::F64(-(significand as f64)),
                }
            });
        }
        match f64_from_parts(significand, exponent) {
            Some(f) => Ok(Number::F64(if positive { f } else { -f })),
            None => self.err("number out of range"),
        }
    }

    /// Only whitespace may follow the top-level value.
    pub fn finish(&mut self) -> Result<()> {
        if self.peek().is_some() {
            return self.err("trailing characters after the JSON value");
        }
        Ok(())
    }
}

/// serde_json's `f64_from_parts`: `significand * 10^exponent`, None where that is infinite.
#[allow(clippy::cast_precision_loss)]
fn f64_from_parts(significand: u64, mut exponent: i32) -> Option<f64> {
    let mut f = significand as f64;
    loop {
        let e = exponent.wrapping_abs() as u32 as usize;
        if e <= 308 {
            if exponent >= 0 {
                f *= pow10(e);
                if f.is_infinite() {
                    return None;
                }
            } else {
                f /= pow10(e);
            }
            return Some(f);
        }
        if f == 0.0 {
            return Some(f);
        }
        if exponent >= 0 {
            return None;
        }
        f /= 1e308;
        exponent += 308;
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
        let long = format!("\"{}é{}\\n{}\"", "x".repeat(40), "y".repeat(20), "z".repeat(3));
        let mut c = Cursor::new(long.as_bytes());
        assert_eq!(
            c.string().unwrap(),
            format!("{}é{}\n{}", "x".repeat(40), "y".repeat(20), "zzz")
        );
        assert_eq!(c.pos, long.len());
        let bad = b"\"abcdefghijklmnopqrstuvwxyz\xc3\x28\"";
        assert_eq!(Cursor::new(bad).string().unwrap_err().message, INVALID_UTF8);
        assert!(Cursor::new(b"\"abcdefghijklmnopqrstuvwxyz").string().is_err());
    }

    #[test]
    fn fast_scan_matches_table() {
        let bytes: Vec<u8> = (0..=255u8).chain(b"abc\"def\\".iter().copied()).collect();
        for start in 0..bytes.len() {
            let slow = (start..bytes.len())
                .find(|&i| STRING_STOP[usize::from(bytes[i])])
                .unwrap_or(bytes.len());
            assert_eq!(plain_run_end(&bytes, start), slow);
            let plain = vec![b'a'; start];
            assert_eq!(plain_run_end(&plain, 0), start);
        }
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
    fn numbers_like_serde_json() {
        let read = |s: &str| Cursor::new(s.as_bytes()).number();
        assert_eq!(read("0"), Ok(Number::U64(0)));
        assert_eq!(read("-7"), Ok(Number::I64(-7)));
        assert_eq!(read("-0"), Ok(Number::F64(-0.0)));
        assert_eq!(read("18446744073709551616"), Ok(Number::F64(18446744073709551616.0)));
        assert_eq!(read("1.5e3"), Ok(Number::F64(1500.0)));
        assert_eq!(read("1e-400"), Ok(Number::F64(0.0)));
        assert_eq!(read("0e99999999999"), Ok(Number::F64(0.0)));
        assert!(read("1e309").is_err());
        assert!(read("1e99999999999").is_err());
        assert!(read(&"9".repeat(309)).is_err());
        assert!(read(&"9".repeat(308)).is_ok());
        for bad in ["-", "01", "1.", "1e", "1e+", ".5", "-a"] {
            assert!(read(bad).is_err(), "{bad}");
        }
        for text in [
            "0.1",
            "2.5e-3",
            "123456789.123456789",
            "1.7976931348623157e308",
            "4.9e-324",
            "-3.25E+2",
        ] {
            let ours = read(text).unwrap().as_f64();
            let theirs: serde_json::Value = serde_json::from_str(text).unwrap();
            assert_eq!(ours.to_bits(), theirs.as_f64().unwrap().to_bits(), "{text}");
        }
    }

    #[test]
    fn skipping_values() {
        let mut c = Cursor::new(br#"{"a": [1, -2.5e3, true, null, {"b": "c"}]} "#);
        c.skip_value(0).unwrap();
        c.finish().unwrap();
        assert!(Cursor::new(b"[1,]").skip_value(0).is_err());
        assert!(Cursor::new(b"{\"a\" 1}").skip_value(0).is_err());
        let nested = |n: usize| "[".repeat(n) + &"]".repeat(n);
        assert!(Cursor::new(nested(127).as_bytes()).skip_value(0).is_ok());
        assert!(Cursor::new(nested(128).as_bytes()).skip_value(0).is_err());
        assert!(Cursor::new(nested(125).as_bytes()).skip_value(2).is_ok());
        assert!(Cursor::new(nested(126).as_bytes()).skip_value(2).is_err());
    }
}
