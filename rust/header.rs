//! Reading and validating safetensors headers, at least as strictly as the safetensors crate.
//!
//! Two ways to get the header bytes behind one interface (`ReadMode`):
//! - `Pread`: `pread` the 8-byte length, then the header. It never maps the file, so a file that
//!   shrinks under us gives a short read (an error), never SIGBUS. It is the default: it is also
//!   the faster one for small headers (benches/bench_header.py).
//! - `Mmap`: map the file, after checking its length, and copy the header out at once. A file
//!   truncated by another process between our length check and the copy can still raise SIGBUS;
//!   that window is the copy of at most N bytes, and the test suite exercises it.

use std::borrow::Cow;
use std::fs::File;
use std::path::Path;

use crate::codes::ProblemCode;
use crate::error::{Error, HeaderError};
use crate::json::{Cursor, SyntaxError};

/// Same limit as the safetensors crate.
pub const MAX_HEADER_SIZE: u64 = 100_000_000;
/// Bytes of the little-endian header length that opens a safetensors file.
pub const N_LEN: u64 = 8;

/// A tensor's element type, spelled as safetensors spells it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
#[allow(non_camel_case_types, clippy::upper_case_acronyms)]
pub enum Dtype {
    /// Boolean, one byte.
    BOOL,
    /// 4-bit float (FP4 E2M1).
    F4,
    /// 6-bit float, 2 exponent and 3 mantissa bits.
    F6_E2M3,
    /// 6-bit float, 3 exponent and 2 mantissa bits.
    F6_E3M2,
    /// Unsigned 8-bit integer.
    U8,
    /// Signed 8-bit integer.
    I8,
    /// 8-bit float, 5 exponent and 2 mantissa bits.
    F8_E5M2,
    /// 8-bit float, 4 exponent and 3 mantissa bits.
    F8_E4M3,
    /// 8-bit exponent-only scale (MX formats).
    F8_E8M0,
    /// 8-bit float E4M3, finite, no negative zero.
    F8_E4M3FNUZ,
    /// 8-bit float E5M2, finite, no negative zero.
    F8_E5M2FNUZ,
    /// Signed 16-bit integer.
    I16,
    /// Unsigned 16-bit integer.
    U16,
    /// IEEE half precision.
    F16,
    /// bfloat16.
    BF16,
    /// Signed 32-bit integer.
    I32,
    /// Unsigned 32-bit integer.
    U32,
    /// IEEE single precision.
    F32,
    /// Complex of two 32-bit floats.
    C64,
    /// IEEE double precision.
    F64,
    /// Signed 64-bit integer.
    I64,
    /// Unsigned 64-bit integer.
    U64,
}

impl Dtype {
    /// Every dtype, in declaration order.
    pub const ALL: [Dtype; 22] = [
        Dtype::BOOL,
        Dtype::F4,
        Dtype::F6_E2M3,
        Dtype::F6_E3M2,
        Dtype::U8,
        Dtype::I8,
        Dtype::F8_E5M2,
        Dtype::F8_E4M3,
        Dtype::F8_E8M0,
        Dtype::F8_E4M3FNUZ,
        Dtype::F8_E5M2FNUZ,
        Dtype::I16,
        Dtype::U16,
        Dtype::F16,
        Dtype::BF16,
        Dtype::I32,
        Dtype::U32,
        Dtype::F32,
        Dtype::C64,
        Dtype::F64,
        Dtype::I64,
        Dtype::U64,
    ];

    /// Bits per element.
    pub fn bits(self) -> u64 {
        match self {
            Dtype::F4 => 4,
            Dtype::F6_E2M3 | Dtype::F6_E3M2 => 6,
            Dtype::BOOL
            | Dtype::U8
            | Dtype::I8
            | Dtype::F8_E5M2
            | Dtype::F8_E4M3
            | Dtype::F8_E8M0
            | Dtype::F8_E4M3FNUZ
            | Dtype::F8_E5M2FNUZ => 8,
            Dtype::I16 | Dtype::U16 | Dtype::F16 | Dtype::BF16 => 16,
            Dtype::I32 | Dtype::U32 | Dtype::F32 => 32,
            Dtype::C64 | Dtype::F64 | Dtype::I64 | Dtype::U64 => 64,
        }
    }

    /// The safetensors spelling (`"BF16"`).
    pub fn name(self) -> &'static str {
        match self {
            Dtype::BOOL => "BOOL",
            Dtype::F4 => "F4",
            Dtype::F6_E2M3 => "F6_E2M3",
            Dtype::F6_E3M2 => "F6_E3M2",
            Dtype::U8 => "U8",
            Dtype::I8 => "I8",
            Dtype::F8_E5M2 => "F8_E5M2",
            Dtype::F8_E4M3 => "F8_E4M3",
            Dtype::F8_E8M0 => "F8_E8M0",
            Dtype::F8_E4M3FNUZ => "F8_E4M3FNUZ",
            Dtype::F8_E5M2FNUZ => "F8_E5M2FNUZ",
            Dtype::I16 => "I16",
            Dtype::U16 => "U16",
            Dtype::F16 => "F16",
            Dtype::BF16 => "BF16",
            Dtype::I32 => "I32",
            Dtype::U32 => "U32",
            Dtype::F32 => "F32",
            Dtype::C64 => "C64",
            Dtype::F64 => "F64",
            Dtype::I64 => "I64",
            Dtype::U64 => "U64",
        }
    }

    /// The dtype spelled `name`, if any.
    pub fn from_name(name: &str) -> Option<Dtype> {
        Dtype::from_bytes(name.as_bytes())
    }

    /// The dtype spelled `name`, if any. Runs once per tensor: a match on the bytes compiles to
    /// length and word compares.
    #[inline]
    pub fn from_bytes(name: &[u8]) -> Option<Dtype> {
        Some(match name {
            b"BF16" => Dtype::BF16,
            b"F16" => Dtype::F16,
            b"F32" => Dtype::F32,
            b"BOOL" => Dtype::BOOL,
            b"F4" => Dtype::F4,
            b"F6_E2M3" => Dtype::F6_E2M3,
            b"F6_E3M2" => Dtype::F6_E3M2,
            b"U8" => Dtype::U8,
            b"I8" => Dtype::I8,
            b"F8_E5M2" => Dtype::F8_E5M2,
            b"F8_E4M3" => Dtype::F8_E4M3,
            b"F8_E8M0" => Dtype::F8_E8M0,
            b"F8_E4M3FNUZ" => Dtype::F8_E4M3FNUZ,
            b"F8_E5M2FNUZ" => Dtype::F8_E5M2FNUZ,
            b"I16" => Dtype::I16,
            b"U16" => Dtype::U16,
            b"I32" => Dtype::I32,
            b"U32" => Dtype::U32,
            b"C64" => Dtype::C64,
            b"F64" => Dtype::F64,
            b"I64" => Dtype::I64,
            b"U64" => Dtype::U64,
            _ => return None,
        })
    }
}

/// One tensor entry. `shape` indexes into `Header::dims`, which keeps one allocation per header.
#[derive(Debug, Clone)]
pub struct TensorEntry<'a> {
    /// The tensor's name, borrowed from the header unless it had escapes.
    pub name: Cow<'a, str>,
    /// The element type.
    pub dtype: Dtype,
    /// Where the shape starts in `Header::dims`.
    pub shape_start: u32,
    /// The number of dimensions.
    pub shape_len: u32,
    /// The first byte of the data, counted from the start of the data section.
    pub begin: u64,
    /// The byte after the data, counted from the start of the data section.
    pub end: u64,
}

/// A non-fatal finding: the file is readable, but something is off.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Warning {
    /// What kind of finding (`unknown_field`, `misaligned_offset`).
    pub code: ProblemCode,
    /// What was found, naming the tensor.
    pub message: String,
}

/// `__metadata__` pairs in file order.
pub type Metadata<'a> = Vec<(Cow<'a, str>, Cow<'a, str>)>;

/// The pairs of `m` as owned strings, as a result keeps them past its header's bytes.
pub fn owned_metadata(m: &Metadata<'_>) -> Vec<(String, String)> {
    m.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect()
}

/// A parsed and validated safetensors header, borrowing its strings from the header bytes.
#[derive(Debug, Clone)]
pub struct Header<'a> {
    /// In file (JSON) order.
    pub tensors: Vec<TensorEntry<'a>>,
    /// Every tensor's shape, back to back (see `TensorEntry::shape_start`).
    pub dims: Vec<u64>,
    /// `__metadata__`, when the header has it.
    pub metadata: Option<Metadata<'a>>,
    /// The header's length in bytes (the N of the length prefix).
    pub header_size: u64,
    /// The whole file's size in bytes.
    pub file_size: u64,
    /// Non-fatal findings, in the order found.
    pub warnings: Vec<Warning>,
    /// False when the no-duplicate-names rule was left to the caller (`parse_header_unchecked_names`).
    pub names_checked: bool,
}

impl<'a> Header<'a> {
    /// The shape of tensor `t`.
    pub fn shape(&self, t: &TensorEntry<'_>) -> &[u64] {
        let start = t.shape_start as usize;
        &self.dims[start..start + t.shape_len as usize]
    }

    /// The `__metadata__` value of `key`, if the header has one.
    pub fn metadata_value(&self, key: &str) -> Option<&str> {
        self.metadata
            .as_ref()?
            .iter()
            .find(|(k, _)| k == key)
            .map(|(_, v)| v.as_ref())
    }

    /// Where the data section starts in the file.
    pub fn data_start(&self) -> u64 {
        N_LEN + self.header_size
    }
}

fn syntax(e: SyntaxError) -> HeaderError {
    if e.message == crate::json::INVALID_UTF8 {
        return HeaderError::InvalidUtf8(e.offset);
    }
    HeaderError::InvalidJson {
        message: e.message,
        offset: e.offset,
    }
}

/// Parses and validates header bytes (the N bytes after the length prefix) of a file of `file_size` bytes.
pub fn parse_header(bytes: &[u8], file_size: u64) -> Result<Header<'_>, HeaderError> {
    parse_with(bytes, file_size, true)
}

/// `parse_header` minus the duplicate-name rule when the header is otherwise valid: the scan's
/// classifier finds repeated names for free while it groups tensors by module (see
/// `classify::Classification::duplicate_tensor`). `names_checked` is false on the result.
pub fn parse_header_unchecked_names(bytes: &[u8], file_size: u64) -> Result<Header<'_>, HeaderError> {
    parse_with(bytes, file_size, false)
}

fn parse_with(bytes: &[u8], file_size: u64, check_names: bool) -> Result<Header<'_>, HeaderError> {
    // Strings are UTF-8-checked as they are read, so an error found earlier in the text can hide
    // bad UTF-8 further on. The safetensors crate checks the whole header's UTF-8 before anything
    // else: on any error, report bad UTF-8 first, as it would.
    parse_inner(bytes, file_size, check_names).map_err(|e| match std::str::from_utf8(bytes) {
        Err(bad) => HeaderError::InvalidUtf8(bad.valid_up_to()),
        Ok(_) => e,
    })
}

/// Containers open around a tensor entry's fields: the header object and the entry itself.
const ENTRY_DEPTH: u32 = 2;

#[inline(never)]
fn parse_inner(bytes: &[u8], file_size: u64, check_names: bool) -> Result<Header<'_>, HeaderError> {
    let header_size = bytes.len() as u64;
    let mut cur = Cursor::new(bytes);
    if cur.peek() != Some(b'{') {
        return Err(if cur.peek().is_none() {
            syntax(SyntaxError {
                message: "empty header",
                offset: cur.pos,
            })
        } else {
            HeaderError::HeaderNotObject
        });
    }
    let mut header = Header {
        tensors: Vec::new(),
        dims: Vec::new(),
        metadata: None,
        header_size,
        file_size,
        warnings: Vec::new(),
        names_checked: check_names,
    };
    // While every entry is compact and follows the previous one exactly, `validate` would find
    // nothing: its checks are done as entries are read, and only the coverage check is left.
    let (mut in_place, mut data_end) = (true, 0u64);
    if cur.object_start().map_err(syntax)? {
        // Rough capacity from the header size: compact PEFT entries take ~130 bytes each.
        header.tensors.reserve((bytes.len() / 100).min(1 << 20));
        header.dims.reserve((bytes.len() / 50).min(1 << 21));
        let mut seen_metadata = false;
        loop {
            match compact_run(
                &mut cur,
                &mut header.tensors,
                &mut header.dims,
                &mut data_end,
                &mut in_place,
            ) {
                Run::Closed => break,
                Run::AfterEntry => {
                    if !cur.object_next().map_err(syntax)? {
                        break;
                    }
                    continue;
                }
                Run::AtEntry => {}
            }
            let name = cur.key().map_err(syntax)?;
            if name == "__metadata__" {
                // Not a tensor: the entries around it can still be in place.
                if seen_metadata {
                    return Err(HeaderError::DuplicateKey(name.into_owned()));
                }
                seen_metadata = true;
                header.metadata = parse_metadata(&mut cur)?;
            } else {
                in_place = false;
                let entry = parse_entry(&mut cur, name, &mut header.dims, &mut header.warnings)?;
                header.tensors.push(entry);
            }
            if !cur.object_next().map_err(syntax)? {
                break;
            }
        }
    }
    cur.finish().map_err(syntax)?;
    let layout = |header: &mut Header<'_>| {
        if in_place {
            check_coverage(header, data_end)
        } else {
            validate(header)
        }
    };
    // Duplicates are reported before layout errors: the crate never sees the entry a repeated
    // name replaces, so that entry's offsets must not decide the verdict.
    if check_names {
        check_duplicates(&header.tensors)?;
        layout(&mut header)?;
    } else if let Err(e) = layout(&mut header) {
        check_duplicates(&header.tensors)?;
        return Err(e);
    }
    Ok(header)
}

/// For an entry read in file order: does it start where the previous one ended (`data_end`),
/// with the size its dtype and shape give, at an aligned offset? True for every entry means the
/// entries are in offset order and `validate` has no error or warning to give.
#[inline]
fn fits_in_place(t: &TensorEntry<'_>, dims: &[u64], data_end: &mut u64) -> bool {
    let bits = t.dtype.bits();
    let shape = &dims[t.shape_start as usize..(t.shape_start + t.shape_len) as usize];
    let nbits = shape
        .iter()
        .try_fold(1u64, |acc, &d| acc.checked_mul(d))
        .and_then(|n| n.checked_mul(bits));
    let fits = t.begin == *data_end
        && t.end >= t.begin
        && nbits.is_some_and(|n| n % 8 == 0 && t.end - t.begin == n / 8)
        && t.begin & ((bits / 8).max(1) - 1) == 0;
    *data_end = t.end;
    fits
}

/// The data section holds exactly the tensors' bytes (`validate`'s last check).
fn check_coverage(header: &Header<'_>, data_end: u64) -> Result<(), HeaderError> {
    let available = header.file_size.saturating_sub(N_LEN + header.header_size);
    if data_end != available {
        return Err(HeaderError::IncompleteBuffer { data_end, available });
    }
    Ok(())
}

fn parse_metadata<'a>(cur: &mut Cursor<'a>) -> Result<Option<Metadata<'a>>, HeaderError> {
    if cur.null() {
        return Ok(None);
    }
    if cur.peek() != Some(b'{') {
        return Err(HeaderError::InvalidMetadata("not an object".into()));
    }
    let mut pairs: Metadata<'a> = Vec::new();
    // Repeated keys are looked for once, by hashing, after the pairs are read (a scan per key
    // was quadratic). An error part way reports a repeat before it first, as a scan per key would.
    let read = read_metadata_pairs(cur, &mut pairs);
    if let Some(i) = first_repeat(pairs.iter().map(|(k, _)| k.as_ref())) {
        return Err(HeaderError::DuplicateKey(format!("__metadata__.{}", pairs[i].0)));
    }
    read?;
    Ok(Some(pairs))
}

fn read_metadata_pairs<'a>(cur: &mut Cursor<'a>, pairs: &mut Metadata<'a>) -> Result<(), HeaderError> {
    if cur.object_start().map_err(syntax)? {
        loop {
            let key = cur.key().map_err(syntax)?;
            if cur.peek() != Some(b'"') {
                return Err(HeaderError::InvalidMetadata(format!(
                    "value of {key:?} is not a string"
                )));
            }
            let value = cur.string().map_err(syntax)?;
            pairs.push((key, value));
            if !cur.object_next().map_err(syntax)? {
                break;
            }
        }
    }
    Ok(())
}

/// A header that opens with its `__metadata__` entry, as the safetensors serializer writes it:
/// the parsed metadata and the rest of the header after its value (from the `,` or `}` on). None
/// when the header does not start exactly so, or when the metadata is not valid.
pub fn split_leading_metadata(bytes: &[u8]) -> Option<(Option<Metadata<'_>>, &[u8])> {
    const OPENING: &[u8] = b"{\"__metadata__\":";
    if !bytes.starts_with(OPENING) {
        return None;
    }
    let mut cur = Cursor::new(bytes);
    cur.pos = OPENING.len();
    let metadata = parse_metadata(&mut cur).ok()?;
    Some((metadata, &bytes[cur.pos..]))
}

/// Eight bytes from `s[at..]`, zero-padded past the end (a zero byte is not a digit or quote).
#[inline(always)]
fn word_at(s: &[u8], at: usize) -> u64 {
    // One compare against a bound the caller's loop can hoist, rather than a checked `at + 8`.
    if at < s.len().saturating_sub(7) {
        // SAFETY: `at + 8 <= s.len()`, so the eight bytes are inside `s`.
        return u64::from_le(unsafe { s.as_ptr().add(at).cast::<u64>().read_unaligned() });
    }
    let mut w = [0u8; 8];
    let tail = s.get(at..).unwrap_or_default();
    w[..tail.len().min(8)].copy_from_slice(&tail[..tail.len().min(8)]);
    u64::from_le_bytes(w)
}

/// How many leading bytes of `w` are ASCII digits, and `w` with each byte turned into its value.
#[inline(always)]
fn leading_digits(w: u64) -> (usize, u64) {
    const LO: u64 = 0x0F0F_0F0F_0F0F_0F0F;
    let v = w ^ 0x3030_3030_3030_3030;
    // A byte is not a digit if its high nibble was not 3, or its low nibble is above 9.
    let not_digit = (v & !LO) | (((v & LO) + 0x0606_0606_0606_0606) & 0x1010_1010_1010_1010);
    ((not_digit.trailing_zeros() / 8) as usize, v)
}

/// The value of the first `n` (1..=8) digit values in `v` (first digit in the low byte).
#[inline(always)]
fn digits_value(v: u64, n: usize) -> u64 {
    // Left-align so that the missing digits read as leading zeros, then combine pairs, quads, octets.
    let mut v = v << (8 * (8 - n));
    v = (v.wrapping_mul(10) + (v >> 8)) & 0x00FF_00FF_00FF_00FF;
    v = (v.wrapping_mul(100) + (v >> 16)) & 0x0000_FFFF_0000_FFFF;
    (v.wrapping_mul(10_000) + (v >> 32)) & 0xFFFF_FFFF
}

/// A non-negative integer of 1 to 16 digits without a leading zero, read eight bytes at a time;
/// returns (value, digits). The caller checks what follows (the compact form allows only `,`,
/// `]`), so a float or a longer number never passes; None sends it to the general reader.
#[inline(always)]
fn short_uint(s: &[u8], at: usize) -> Option<(u64, usize)> {
    let (n, v) = leading_digits(word_at(s, at));
    let (value, len) = match n {
        0 => return None,
        8 => {
            let (m, v2) = leading_digits(word_at(s, at + 8));
            if m == 8 {
                return None;
            }
            let high = digits_value(v, 8);
            if m == 0 {
                (high, 8)
            } else {
                (high * 10u64.pow(m as u32) + digits_value(v2, m), 8 + m)
            }
        }
        _ => (digits_value(v, n), n),
    };
    // The first digit's value is the low byte of `v`.
    if v & 0xFF == 0 && len > 1 {
        return None;
    }
    Some((value, len))
}

/// Eight bytes of text as the word `word_at` reads them.
const fn word(text: &[u8; 8]) -> u64 {
    u64::from_le_bytes(*text)
}

/// How a run of compact entries ended.
enum Run {
    /// At the object's closing brace, consumed.
    Closed,
    /// At an entry that is not compact (its name's quote, or whitespace before it).
    AtEntry,
    /// Right after an entry, before a separator the general reader must take (whitespace).
    AfterEntry,
}

/// Reads entries written exactly as the safetensors serializer writes them, and the commas
/// between them, while they come: `"NAME":{"dtype":"BF16","shape":[8,64],"data_offsets":[0,1024]}`
/// with NAME printable ASCII and no escapes. Anything else (whitespace, escapes, other field
/// orders, extra fields, errors) stops the run with the cursor and `dims` as before that entry,
/// and the general reader takes over. One tight loop, so that its state stays in registers.
#[inline(never)]
fn compact_run<'a>(
    cur: &mut Cursor<'a>,
    tensors: &mut Vec<TensorEntry<'a>>,
    dims: &mut Vec<u64>,
    data_end: &mut u64,
    in_place: &mut bool,
) -> Run {
    let src = cur.src();
    let mut pos = cur.pos;
    let (mut end_seen, mut fits) = (*data_end, *in_place);
    let run = loop {
        let Some((entry, after)) = compact_entry(src, pos, dims) else {
            break Run::AtEntry;
        };
        fits &= fits_in_place(&entry, dims, &mut end_seen);
        tensors.push(entry);
        pos = after;
        match src.get(pos) {
            Some(b',') => pos += 1,
            Some(b'}') => {
                pos += 1;
                break Run::Closed;
            }
            _ => break Run::AfterEntry,
        }
    };
    cur.pos = pos;
    (*data_end, *in_place) = (end_seen, fits);
    run
}

/// One compact entry at `start` (its name's opening quote): the entry and the index after it.
#[inline(always)]
fn compact_entry<'a>(src: &'a [u8], start: usize, dims: &mut Vec<u64>) -> Option<(TensorEntry<'a>, usize)> {
    if src.get(start) != Some(&b'"') {
        return None;
    }
    let name_end = crate::json::plain_run_end(src, start + 1);
    if src.get(name_end) != Some(&b'"') {
        return None;
    }
    let name = &src[start + 1..name_end];
    if name == b"__metadata__" {
        return None;
    }
    let dims_start = dims.len();
    let fields = compact_fields(src, name_end + 1, dims);
    let shape_start = u32::try_from(dims_start).ok();
    let shape_len = u32::try_from(dims.len() - dims_start).ok();
    let (Some((dtype, begin, end, after)), Some(shape_start), Some(shape_len)) = (fields, shape_start, shape_len)
    else {
        dims.truncate(dims_start);
        return None;
    };
    // SAFETY: `plain_run_end` stopped at the first byte that is not printable ASCII.
    let name = unsafe { std::str::from_utf8_unchecked(name) };
    Some((
        TensorEntry {
            name: Cow::Borrowed(name),
            dtype,
            shape_start,
            shape_len,
            begin,
            end,
        },
        after,
    ))
}

/// The compact entry after its name: `:{"dtype":"BF16","shape":[8,64],"data_offsets":[0,1024]}`.
/// Returns (dtype, begin, end, the index after the closing brace).
#[inline(always)]
fn compact_fields(src: &[u8], at: usize, dims: &mut Vec<u64>) -> Option<(Dtype, u64, u64, usize)> {
    if word_at(src, at) != word(b":{\"dtype") {
        return None;
    }
    // `":"` and the dtype: the common ones end within this word.
    let w = word_at(src, at + 8);
    let (dtype, mut i) = if w == word(b"\":\"BF16\"") {
        (Dtype::BF16, at + 16)
    } else if w == word(b"\":\"F32\",") {
        (Dtype::F32, at + 15)
    } else if w == word(b"\":\"F16\",") {
        (Dtype::F16, at + 15)
    } else if w & 0xFF_FFFF == u64::from(u32::from_le_bytes(*b"\":\"\0")) {
        let from = at + 11;
        let len = src.get(from..)?.iter().take(12).position(|&b| b == b'"')?;
        (Dtype::from_bytes(&src[from..from + len])?, from + len + 1)
    } else {
        return None;
    };
    if word_at(src, i) != word(b",\"shape\"") || src.get(i + 8..i + 10) != Some(b":[") {
        return None;
    }
    i += 10;
    if src.get(i) == Some(&b']') {
        i += 1;
    } else {
        loop {
            let (d, n) = short_uint(src, i)?;
            dims.push(d);
            i += n + 1;
            match src.get(i - 1) {
                Some(b',') => {}
                Some(b']') => break,
                _ => return None,
            }
        }
    }
    if word_at(src, i) != word(b",\"data_o")
        || word_at(src, i + 8) != word(b"ffsets\":")
        || src.get(i + 16) != Some(&b'[')
    {
        return None;
    }
    i += 17;
    let (begin, n) = short_uint(src, i)?;
    i += n;
    if src.get(i) != Some(&b',') {
        return None;
    }
    let (end, n) = short_uint(src, i + 1)?;
    i += n + 1;
    if src.get(i..i + 2) != Some(b"]}") {
        return None;
    }
    Some((dtype, begin, end, i + 2))
}

fn bad(name: &str, message: String) -> HeaderError {
    HeaderError::InvalidTensorEntry {
        name: name.to_owned(),
        message,
    }
}

/// Reads a tensor entry in any form serde_json and the safetensors crate accept: an object with
/// the three fields in any order (unknown fields are warnings), or the same three values as an
/// array, which serde also accepts for a struct.
fn parse_entry<'a>(
    cur: &mut Cursor<'a>,
    name: Cow<'a, str>,
    dims: &mut Vec<u64>,
    warnings: &mut Vec<Warning>,
) -> Result<TensorEntry<'a>, HeaderError> {
    let (dtype, shape, offsets) = match cur.peek() {
        Some(b'{') => entry_object(cur, &name, dims, warnings)?,
        Some(b'[') => entry_array(cur, &name, dims)?,
        _ => return Err(bad(&name, "entry is not an object".into())),
    };
    let missing = |field: &str| bad(&name, format!("missing field {field:?}"));
    let dtype = dtype.ok_or_else(|| missing("dtype"))?;
    let (shape_start, shape_len) = shape.ok_or_else(|| missing("shape"))?;
    let (begin, end) = offsets.ok_or_else(|| missing("data_offsets"))?;
    Ok(TensorEntry {
        name,
        dtype,
        shape_start,
        shape_len,
        begin,
        end,
    })
}

type EntryFields = (Option<Dtype>, Option<(u32, u32)>, Option<(u64, u64)>);

fn entry_object(
    cur: &mut Cursor<'_>,
    name: &str,
    dims: &mut Vec<u64>,
    warnings: &mut Vec<Warning>,
) -> Result<EntryFields, HeaderError> {
    let (mut dtype, mut shape, mut offsets) = (None, None, None);
    if cur.object_start().map_err(syntax)? {
        loop {
            let field = cur.key().map_err(syntax)?;
            match field.as_ref() {
                "dtype" => {
                    if dtype.is_some() {
                        return Err(HeaderError::DuplicateKey(format!("{name}.dtype")));
                    }
                    dtype = Some(read_dtype(cur, name)?);
                }
                "shape" => {
                    if shape.is_some() {
                        return Err(HeaderError::DuplicateKey(format!("{name}.shape")));
                    }
                    shape = Some(read_shape(cur, name, dims)?);
                }
                "data_offsets" => {
                    if offsets.is_some() {
                        return Err(HeaderError::DuplicateKey(format!("{name}.data_offsets")));
                    }
                    offsets = Some(read_offsets(cur, name)?);
                }
                other => {
                    warnings.push(Warning {
                        code: ProblemCode::UnknownField,
                        message: format!("tensor {name:?} has an unknown field {other:?} (ignored)"),
                    });
                    cur.skip_value(ENTRY_DEPTH).map_err(syntax)?;
                }
            }
            if !cur.object_next().map_err(syntax)? {
                break;
            }
        }
    }
    Ok((dtype, shape, offsets))
}

/// `[dtype, shape, data_offsets]`: exactly three values, in that order.
fn entry_array(cur: &mut Cursor<'_>, name: &str, dims: &mut Vec<u64>) -> Result<EntryFields, HeaderError> {
    let length = || {
        bad(
            name,
            "an entry written as a list must hold exactly dtype, shape and data_offsets".into(),
        )
    };
    if !cur.array_start().map_err(syntax)? {
        return Err(length());
    }
    let dtype = read_dtype(cur, name)?;
    if !cur.array_next().map_err(syntax)? {
        return Err(length());
    }
    let shape = read_shape(cur, name, dims)?;
    if !cur.array_next().map_err(syntax)? {
        return Err(length());
    }
    let offsets = read_offsets(cur, name)?;
    if cur.array_next().map_err(syntax)? {
        return Err(length());
    }
    Ok((Some(dtype), Some(shape), Some(offsets)))
}

/// A dtype name, or serde's other spelling of a unit enum variant, `{"F32": null}`.
fn read_dtype(cur: &mut Cursor<'_>, name: &str) -> Result<Dtype, HeaderError> {
    let as_map = match cur.peek() {
        Some(b'"') => false,
        Some(b'{') => true,
        _ => return Err(bad(name, "dtype is not a string".into())),
    };
    if as_map && !cur.object_start().map_err(syntax)? {
        return Err(bad(name, "dtype is an empty object".into()));
    }
    let s = if as_map { cur.key() } else { cur.string() }.map_err(syntax)?;
    let dtype = Dtype::from_name(&s).ok_or_else(|| HeaderError::UnknownDtype {
        name: name.to_owned(),
        dtype: s.to_string(),
    })?;
    if as_map {
        // The one value is null, and the object ends after it.
        let closed = cur.null() && !cur.object_next().map_err(syntax)?;
        if !closed {
            return Err(bad(name, "dtype written as an object must be {\"NAME\": null}".into()));
        }
    }
    Ok(dtype)
}

fn read_shape(cur: &mut Cursor<'_>, name: &str, dims: &mut Vec<u64>) -> Result<(u32, u32), HeaderError> {
    if cur.peek() != Some(b'[') {
        return Err(bad(name, "shape is not a list".into()));
    }
    let start = dims.len();
    if cur.array_start().map_err(syntax)? {
        loop {
            let d = cur.uint().map_err(|e| bad(name, format!("shape: {}", e.message)))?;
            dims.push(d);
            if !cur.array_next().map_err(syntax)? {
                break;
            }
        }
    }
    let len = dims.len() - start;
    let (Ok(start), Ok(len)) = (u32::try_from(start), u32::try_from(len)) else {
        return Err(HeaderError::Overflow(name.to_owned()));
    };
    Ok((start, len))
}

fn read_offsets(cur: &mut Cursor<'_>, name: &str) -> Result<(u64, u64), HeaderError> {
    if cur.peek() != Some(b'[') {
        return Err(bad(name, "data_offsets is not a list".into()));
    }
    cur.pos += 1;
    let msg = |e: SyntaxError| bad(name, format!("data_offsets: {}", e.message));
    let two = || bad(name, "data_offsets must hold exactly two integers".into());
    let begin = cur.uint().map_err(msg)?;
    cur.expect(b',', "expected ','").map_err(|_| two())?;
    let end = cur.uint().map_err(msg)?;
    cur.expect(b']', "expected ']'").map_err(|_| two())?;
    Ok((begin, end))
}

/// The safetensors crate's `Metadata::validate` plus full-file coverage, with checked arithmetic.
fn validate(header: &mut Header<'_>) -> Result<(), HeaderError> {
    let tensors = &header.tensors;
    // Contiguity is checked in offset order; files written by safetensors are already in it.
    let sorted = tensors
        .windows(2)
        .all(|w| (w[0].begin, w[0].end) <= (w[1].begin, w[1].end));
    let mut order: Vec<u32> = Vec::new();
    if !sorted {
        order = (0..tensors.len() as u32).collect();
        order.sort_by_key(|&i| (tensors[i as usize].begin, tensors[i as usize].end));
    }
    let mut expected: u64 = 0;
    for k in 0..tensors.len() {
        let t = if sorted {
            &tensors[k]
        } else {
            &tensors[order[k] as usize]
        };
        if t.begin != expected || t.end < t.begin {
            return Err(HeaderError::InvalidOffset {
                name: t.name.to_string(),
                begin: t.begin,
                end: t.end,
                expected,
            });
        }
        expected = t.end;
        let bits = t.dtype.bits();
        let shape = &header.dims[t.shape_start as usize..(t.shape_start + t.shape_len) as usize];
        let nbits = shape
            .iter()
            .try_fold(1u64, |acc, &d| acc.checked_mul(d))
            .and_then(|n| n.checked_mul(bits));
        let Some(nbits) = nbits else {
            return Err(HeaderError::Overflow(t.name.to_string()));
        };
        if nbits % 8 != 0 {
            return Err(HeaderError::MisalignedSlice(t.name.to_string()));
        }
        if t.end - t.begin != nbits / 8 {
            return Err(HeaderError::TensorSizeMismatch {
                name: t.name.to_string(),
                span: t.end - t.begin,
                expected: nbits / 8,
            });
        }
        // Alignments are powers of two.
        let align = (bits / 8).max(1);
        if t.begin & (align - 1) != 0 {
            header.warnings.push(Warning {
                code: ProblemCode::MisalignedOffset,
                message: format!(
                    "tensor {:?} starts at data offset {} (not a multiple of {align})",
                    t.name, t.begin
                ),
            });
        }
    }
    check_coverage(header, expected)
}

/// Our rule beyond the crate (which keeps the last of two equal names): names are unique.
/// Checked before the offsets, since the crate never sees the entry a duplicate replaces.
fn check_duplicates(tensors: &[TensorEntry<'_>]) -> Result<(), HeaderError> {
    match first_repeat(tensors.iter().map(|t| t.name.as_ref())) {
        Some(i) => Err(HeaderError::DuplicateTensor(tensors[i].name.to_string())),
        None => Ok(()),
    }
}

/// The position of the first name equal to an earlier one.
pub fn first_repeat<'n>(names: impl ExactSizeIterator<Item = &'n str>) -> Option<usize> {
    let count = names.len();
    if count < 2 {
        return None;
    }
    let mut seen: rustc_hash::FxHashSet<&str> = rustc_hash::FxHashSet::default();
    seen.reserve(count);
    names
        .enumerate()
        .find_map(|(i, name)| (!seen.insert(name)).then_some(i))
}

/// How to fetch header bytes from disk.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum ReadMode {
    /// `pread` the length, then the header (no mapping: a shrinking file is a short read).
    #[default]
    Pread,
    /// Map the file and copy the header out.
    Mmap,
}

impl ReadMode {
    /// The mode named `name` (`"pread"`, `"mmap"`), if any.
    pub fn from_name(name: &str) -> Option<ReadMode> {
        match name {
            "pread" => Some(ReadMode::Pread),
            "mmap" => Some(ReadMode::Mmap),
            _ => None,
        }
    }
}

/// Checks the length prefix against the file size; returns N.
fn check_length(prefix: [u8; 8], file_size: u64) -> Result<u64, HeaderError> {
    let n = u64::from_le_bytes(prefix);
    if n > MAX_HEADER_SIZE {
        return Err(HeaderError::HeaderTooLarge(n));
    }
    if n + N_LEN > file_size {
        return Err(HeaderError::InvalidHeaderLength { n, file_size });
    }
    Ok(n)
}

/// Parses and validates a whole file held in memory (length prefix, header and data), as the
/// safetensors crate's `read_metadata` does.
pub fn parse_file(file: &[u8]) -> Result<Header<'_>, HeaderError> {
    let file_size = file.len() as u64;
    let Some(prefix) = file.first_chunk::<8>() else {
        return Err(HeaderError::HeaderTooSmall(file_size));
    };
    let n = check_length(*prefix, file_size)?;
    parse_header(&file[8..8 + n as usize], file_size)
}

/// What `Pread` asks for in its first read: the length prefix and, for most adapters, the whole
/// header, in one call (a second call fetches the rest of a longer header). One read is cheaper
/// than two even when it copies a few kilobytes past the header.
const SPECULATIVE_READ: u64 = 64 << 10;

fn truncated(path: &Path) -> Error {
    Error::io(
        path,
        std::io::Error::new(
            std::io::ErrorKind::UnexpectedEof,
            "file ended before the header did (was it truncated while being read?)",
        ),
    )
}

/// `pread`s into all of `buf` from `at` until it is full or the file ends; returns the bytes read.
fn pread_full(file: &File, buf: &mut [u8], at: u64) -> std::io::Result<usize> {
    use std::os::unix::fs::FileExt;
    let mut got = 0;
    while got < buf.len() {
        match file.read_at(&mut buf[got..], at + got as u64) {
            Ok(0) => break,
            Ok(n) => got += n,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(got)
}

/// Makes `buf` at least `len` long. The scan reuses one buffer per thread, so only growth
/// zero-fills; bytes past what a read fills are never looked at.
fn ensure_len(buf: &mut Vec<u8>, len: usize) {
    if buf.len() < len {
        buf.resize(len, 0);
    }
}

/// Reads the length prefix and header of the open `file` (at `path`, for errors) into `buf`;
/// returns (file size, N). The header is `buf[8..8 + N]`; what follows it in `buf` is not.
/// `file_size` is the size `fstat` gave for `file`.
pub fn read_header_from(
    file: &File,
    path: &Path,
    file_size: u64,
    mode: ReadMode,
    buf: &mut Vec<u8>,
) -> Result<(u64, usize), Error> {
    let header_err = |kind| Error::Header {
        path: path.to_path_buf(),
        kind,
    };
    if file_size < N_LEN {
        return Err(header_err(HeaderError::HeaderTooSmall(file_size)));
    }
    match mode {
        ReadMode::Pread => {
            let first = file_size.min(N_LEN + SPECULATIVE_READ) as usize;
            ensure_len(buf, first);
            let got = pread_full(file, &mut buf[..first], 0).map_err(|e| Error::io(path, e))?;
            if got < N_LEN as usize {
                return Err(truncated(path));
            }
            let prefix: [u8; 8] = buf[..8].try_into().unwrap_or_default();
            // N is bounded by MAX_HEADER_SIZE and by the file size before we allocate for it.
            let n = check_length(prefix, file_size).map_err(header_err)? as usize;
            let end = N_LEN as usize + n;
            if end > got {
                if got < first {
                    return Err(truncated(path));
                }
                ensure_len(buf, end);
                let rest = pread_full(file, &mut buf[got..end], got as u64).map_err(|e| Error::io(path, e))?;
                if got + rest < end {
                    return Err(truncated(path));
                }
            }
            Ok((file_size, n))
        }
        ReadMode::Mmap => {
            // SAFETY: the map is read-only and dropped before returning. The length was checked just
            // above; if another process truncates the file between that check and the copy below,
            // touching a page past the new end raises SIGBUS. We keep that window to one memcpy of
            // at most N bytes; use `Pread` where files may change underneath.
            let map = unsafe { memmap2::MmapOptions::new().len(file_size as usize).map(file) }
                .map_err(|e| Error::io(path, e))?;
            let mut prefix = [0u8; 8];
            prefix.copy_from_slice(&map[..8]);
            let n = check_length(prefix, file_size).map_err(header_err)? as usize;
            let end = N_LEN as usize + n;
            ensure_len(buf, end);
            buf[..end].copy_from_slice(&map[..end]);
            Ok((file_size, n))
        }
    }
}

/// `read_header_from` on the file at `path`.
pub fn read_header_bytes(path: &Path, mode: ReadMode, buf: &mut Vec<u8>) -> Result<(u64, usize), Error> {
    let (file, file_size) = crate::open::open_regular(path)?;
    read_header_from(&file, path, file_size, mode, buf)
}

/// The header bytes in a buffer filled by `read_header_from`.
pub fn header_bytes(buf: &[u8], n: usize) -> &[u8] {
    &buf[N_LEN as usize..N_LEN as usize + n]
}

/// Reads, parses and validates the header of the file at `path`. `buf` holds the header bytes
/// the result borrows.
pub fn read_header<'b>(path: &Path, mode: ReadMode, buf: &'b mut Vec<u8>) -> Result<Header<'b>, Error> {
    let (file_size, n) = read_header_bytes(path, mode, buf)?;
    parse_header(header_bytes(buf, n), file_size).map_err(|kind| Error::Header {
        path: path.to_path_buf(),
        kind,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(json: &str, data_len: u64) -> Result<Header<'_>, HeaderError> {
        parse_header(json.as_bytes(), 8 + json.len() as u64 + data_len)
    }

    #[test]
    fn accepts_valid_and_reports_order() {
        let h = parse(
            r#"{"b":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},"a":{"dtype":"BF16","shape":[],"data_offsets":[8,10]},"__metadata__":{"k":"v"}}  "#,
            10,
        )
        .unwrap();
        assert_eq!(h.tensors.len(), 2);
        assert_eq!(h.tensors[0].name, "b");
        assert_eq!(h.shape(&h.tensors[0]), &[2]);
        assert_eq!(h.metadata_value("k"), Some("v"));
    }

    #[test]
    fn rules() {
        let entry = |s: &str| format!(r#"{{"t":{s}}}"#);
        let code = |json: &str, data: u64| parse(json, data).unwrap_err().code();
        assert_eq!(
            code(&entry(r#"{"dtype":"X","shape":[],"data_offsets":[0,0]}"#), 0),
            "unknown_dtype"
        );
        assert_eq!(
            code(&entry(r#"{"dtype":"F32","shape":[1],"data_offsets":[0,8]}"#), 8),
            "tensor_size_mismatch"
        );
        assert_eq!(
            code(&entry(r#"{"dtype":"F4","shape":[1],"data_offsets":[0,0]}"#), 0),
            "misaligned_slice"
        );
        assert_eq!(
            code(&entry(r#"{"dtype":"F32","shape":[1],"data_offsets":[4,8]}"#), 8),
            "invalid_offset"
        );
        assert_eq!(
            code(&entry(r#"{"dtype":"F32","shape":[1],"data_offsets":[0,4]}"#), 5),
            "incomplete_buffer"
        );
        let big = format!(r#"{{"dtype":"F32","shape":[{},4],"data_offsets":[0,0]}}"#, u64::MAX / 2);
        assert_eq!(code(&entry(&big), 0), "overflow");
        assert_eq!(
            code(&entry(r#"{"dtype":"F32","shape":[1]}"#), 0),
            "invalid_tensor_entry"
        );
        assert_eq!(code(r#"[]"#, 0), "header_not_object");
        assert_eq!(code(r#"{"__metadata__":{"a":1}}"#, 0), "invalid_metadata");
        let dup = r#"{"t":{"dtype":"F32","shape":[0],"data_offsets":[0,0]},"t":{"dtype":"F32","shape":[0],"data_offsets":[0,0]}}"#;
        assert_eq!(code(dup, 0), "duplicate_tensor");
        assert_eq!(
            code(
                &entry(r#"{"dtype":"F32","dtype":"F32","shape":[0],"data_offsets":[0,0]}"#),
                0
            ),
            "duplicate_key"
        );
    }

    #[test]
    fn unknown_fields_warn() {
        let h = parse(
            r#"{"t":{"dtype":"F32","shape":[0],"data_offsets":[0,0],"x":[1,{"y":null}]}}"#,
            0,
        )
        .unwrap();
        assert_eq!(h.warnings[0].code, ProblemCode::UnknownField);
    }
}
