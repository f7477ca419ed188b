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

use crate::error::{Error, HeaderError};
use crate::json::{Cursor, SyntaxError};

/// Same limit as the safetensors crate.
pub const MAX_HEADER_SIZE: u64 = 100_000_000;
pub const N_LEN: u64 = 8;

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
#[allow(non_camel_case_types, clippy::upper_case_acronyms)]
pub enum Dtype {
    BOOL,
    F4,
    F6_E2M3,
    F6_E3M2,
    U8,
    I8,
    F8_E5M2,
    F8_E4M3,
    F8_E8M0,
    F8_E4M3FNUZ,
    F8_E5M2FNUZ,
    I16,
    U16,
    F16,
    BF16,
    I32,
    U32,
    F32,
    C64,
    F64,
    I64,
    U64,
}

impl Dtype {
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

    pub fn from_name(name: &str) -> Option<Dtype> {
        // The common dtypes first: this runs once per tensor.
        match name {
            "BF16" => Some(Dtype::BF16),
            "F16" => Some(Dtype::F16),
            "F32" => Some(Dtype::F32),
            _ => Dtype::ALL.iter().copied().find(|d| d.name() == name),
        }
    }
}

/// One tensor entry. `shape` indexes into `Header::dims`, which keeps one allocation per header.
#[derive(Debug, Clone)]
pub struct TensorEntry<'a> {
    pub name: Cow<'a, str>,
    pub dtype: Dtype,
    pub shape_start: u32,
    pub shape_len: u32,
    pub begin: u64,
    pub end: u64,
}

/// A non-fatal finding: the file is readable, but something is off.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Warning {
    pub code: &'static str,
    pub message: String,
}

#[derive(Debug, Clone)]
pub struct Header<'a> {
    /// In file (JSON) order.
    pub tensors: Vec<TensorEntry<'a>>,
    pub dims: Vec<u64>,
    pub metadata: Option<Vec<(Cow<'a, str>, Cow<'a, str>)>>,
    pub header_size: u64,
    pub file_size: u64,
    pub warnings: Vec<Warning>,
}

impl<'a> Header<'a> {
    pub fn shape(&self, t: &TensorEntry<'_>) -> &[u64] {
        let start = t.shape_start as usize;
        &self.dims[start..start + t.shape_len as usize]
    }

    pub fn metadata_value(&self, key: &str) -> Option<&str> {
        self.metadata.as_ref()?.iter().find(|(k, _)| k == key).map(|(_, v)| v.as_ref())
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
    HeaderError::InvalidJson { message: e.message, offset: e.offset }
}

/// Parses and validates header bytes (the N bytes after the length prefix) of a file of `file_size` bytes.
pub fn parse_header(bytes: &[u8], file_size: u64) -> Result<Header<'_>, HeaderError> {
    // Strings are UTF-8-checked as they are read; on a syntax error, report bad UTF-8 first,
    // as the safetensors crate (which validates the whole header up front) would.
    match parse_inner(bytes, file_size) {
        Err(HeaderError::InvalidJson { message, offset }) => match std::str::from_utf8(bytes) {
            Err(e) => Err(HeaderError::InvalidUtf8(e.valid_up_to())),
            Ok(_) => Err(HeaderError::InvalidJson { message, offset }),
        },
        other => other,
    }
}

fn parse_inner(bytes: &[u8], file_size: u64) -> Result<Header<'_>, HeaderError> {
    let header_size = bytes.len() as u64;
    let mut cur = Cursor::new(bytes);
    if cur.peek() != Some(b'{') {
        return Err(if cur.peek().is_none() {
            syntax(SyntaxError { message: "empty header", offset: cur.pos })
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
    };
    if cur.object_start().map_err(syntax)? {
        // Rough capacity from the header size: PEFT entries take ~130 bytes each.
        header.tensors.reserve((bytes.len() / 160).min(1 << 20));
        header.dims.reserve((bytes.len() / 60).min(1 << 21));
        let mut seen_metadata = false;
        loop {
            let name = cur.key().map_err(syntax)?;
            if name == "__metadata__" {
                if seen_metadata {
                    return Err(HeaderError::DuplicateKey(name.into_owned()));
                }
                seen_metadata = true;
                header.metadata = parse_metadata(&mut cur)?;
            } else {
                let entry = parse_entry(&mut cur, name, &mut header.dims, &mut header.warnings)?;
                header.tensors.push(entry);
            }
            if !cur.object_next().map_err(syntax)? {
                break;
            }
        }
    }
    cur.finish().map_err(syntax)?;
    validate(&mut header)?;
    Ok(header)
}

fn parse_metadata<'a>(cur: &mut Cursor<'a>) -> Result<Option<Vec<(Cow<'a, str>, Cow<'a, str>)>>, HeaderError> {
    if cur.null() {
        return Ok(None);
    }
    if cur.peek() != Some(b'{') {
        return Err(HeaderError::InvalidMetadata("not an object".into()));
    }
    let mut pairs: Vec<(Cow<'a, str>, Cow<'a, str>)> = Vec::new();
    if cur.object_start().map_err(syntax)? {
        loop {
            let key = cur.key().map_err(syntax)?;
            if cur.peek() != Some(b'"') {
                return Err(HeaderError::InvalidMetadata(format!("value of {key:?} is not a string")));
            }
            let value = cur.string().map_err(syntax)?;
            if pairs.iter().any(|(k, _)| *k == key) {
                return Err(HeaderError::DuplicateKey(format!("__metadata__.{key}")));
            }
            pairs.push((key, value));
            if !cur.object_next().map_err(syntax)? {
                break;
            }
        }
    }
    Ok(Some(pairs))
}

fn parse_entry<'a>(
    cur: &mut Cursor<'a>,
    name: Cow<'a, str>,
    dims: &mut Vec<u64>,
    warnings: &mut Vec<Warning>,
) -> Result<TensorEntry<'a>, HeaderError> {
    let bad = |name: &str, message: String| HeaderError::InvalidTensorEntry { name: name.to_owned(), message };
    if cur.peek() != Some(b'{') {
        return Err(bad(&name, "entry is not an object".into()));
    }
    let mut dtype: Option<Dtype> = None;
    let mut shape: Option<(u32, u32)> = None;
    let mut offsets: Option<(u64, u64)> = None;
    if cur.object_start().map_err(syntax)? {
        loop {
            // The three known keys are matched in place; anything else goes through the full reader.
            let field = if cur.known_key(b"dtype") {
                Cow::Borrowed("dtype")
            } else if cur.known_key(b"shape") {
                Cow::Borrowed("shape")
            } else if cur.known_key(b"data_offsets") {
                Cow::Borrowed("data_offsets")
            } else {
                cur.key().map_err(syntax)?
            };
            match field.as_ref() {
                "dtype" => {
                    if dtype.is_some() {
                        return Err(HeaderError::DuplicateKey(format!("{name}.dtype")));
                    }
                    if cur.peek() != Some(b'"') {
                        return Err(bad(&name, "dtype is not a string".into()));
                    }
                    let s = cur.string().map_err(syntax)?;
                    dtype = Some(Dtype::from_name(&s).ok_or_else(|| HeaderError::UnknownDtype {
                        name: name.to_string(),
                        dtype: s.to_string(),
                    })?);
                }
                "shape" => {
                    if shape.is_some() {
                        return Err(HeaderError::DuplicateKey(format!("{name}.shape")));
                    }
                    if cur.peek() != Some(b'[') {
                        return Err(bad(&name, "shape is not a list".into()));
                    }
                    let start = dims.len();
                    cur.pos += 1;
                    if cur.peek() == Some(b']') {
                        cur.pos += 1;
                    } else {
                        loop {
                            let d = cur.uint().map_err(|e| bad(&name, format!("shape: {}", e.message)))?;
                            dims.push(d);
                            if !cur.array_next().map_err(syntax)? {
                                break;
                            }
                        }
                    }
                    let len = dims.len() - start;
                    let (Ok(start), Ok(len)) = (u32::try_from(start), u32::try_from(len)) else {
                        return Err(HeaderError::Overflow(name.into_owned()));
                    };
                    shape = Some((start, len));
                }
                "data_offsets" => {
                    if offsets.is_some() {
                        return Err(HeaderError::DuplicateKey(format!("{name}.data_offsets")));
                    }
                    if cur.peek() != Some(b'[') {
                        return Err(bad(&name, "data_offsets is not a list".into()));
                    }
                    cur.pos += 1;
                    let msg = |e: SyntaxError| bad(&name, format!("data_offsets: {}", e.message));
                    let begin = cur.uint().map_err(msg)?;
                    cur.expect(b',', "expected ','")
                        .map_err(|_| bad(&name, "data_offsets must hold exactly two integers".into()))?;
                    let end = cur.uint().map_err(msg)?;
                    cur.expect(b']', "expected ']'")
                        .map_err(|_| bad(&name, "data_offsets must hold exactly two integers".into()))?;
                    offsets = Some((begin, end));
                }
                other => {
                    warnings.push(Warning {
                        code: "unknown_field",
                        message: format!("tensor {name:?} has an unknown field {other:?} (ignored)"),
                    });
                    cur.skip_value().map_err(syntax)?;
                }
            }
            if !cur.object_next().map_err(syntax)? {
                break;
            }
        }
    }
    let missing = |field: &str| bad(&name, format!("missing field {field:?}"));
    let dtype = dtype.ok_or_else(|| missing("dtype"))?;
    let (shape_start, shape_len) = shape.ok_or_else(|| missing("shape"))?;
    let (begin, end) = offsets.ok_or_else(|| missing("data_offsets"))?;
    Ok(TensorEntry { name, dtype, shape_start, shape_len, begin, end })
}

/// The safetensors crate's `Metadata::validate` plus full-file coverage, with checked arithmetic,
/// and our extra rule: no duplicate names.
fn validate(header: &mut Header<'_>) -> Result<(), HeaderError> {
    let tensors = &header.tensors;
    // Contiguity is checked in offset order; files written by safetensors are already in it.
    let mut order: Vec<u32> = Vec::new();
    let sorted = tensors.windows(2).all(|w| (w[0].begin, w[0].end) <= (w[1].begin, w[1].end));
    if !sorted {
        order = (0..tensors.len() as u32).collect();
        order.sort_by_key(|&i| (tensors[i as usize].begin, tensors[i as usize].end));
    }
    let mut expected: u64 = 0;
    for k in 0..tensors.len() {
        let t = if sorted { &tensors[k] } else { &tensors[order[k] as usize] };
        if t.begin != expected || t.end < t.begin {
            return Err(HeaderError::InvalidOffset { name: t.name.to_string(), begin: t.begin, end: t.end, expected });
        }
        expected = t.end;
        let overflow = || HeaderError::Overflow(t.name.to_string());
        let shape = &header.dims[t.shape_start as usize..(t.shape_start + t.shape_len) as usize];
        let nelem = shape.iter().try_fold(1u64, |acc, &d| acc.checked_mul(d)).ok_or_else(overflow)?;
        let nbits = nelem.checked_mul(t.dtype.bits()).ok_or_else(overflow)?;
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
        let align = (t.dtype.bits() / 8).max(1);
        if t.begin % align != 0 {
            header.warnings.push(Warning {
                code: "misaligned_offset",
                message: format!("tensor {:?} starts at data offset {} (not a multiple of {align})", t.name, t.begin),
            });
        }
    }
    let available = header.file_size.saturating_sub(N_LEN + header.header_size);
    if expected != available {
        return Err(HeaderError::IncompleteBuffer { data_end: expected, available });
    }
    check_duplicates(tensors)
}

fn check_duplicates(tensors: &[TensorEntry<'_>]) -> Result<(), HeaderError> {
    let mut seen: rustc_hash::FxHashSet<&str> = rustc_hash::FxHashSet::default();
    seen.reserve(tensors.len());
    for t in tensors {
        if !seen.insert(t.name.as_ref()) {
            return Err(HeaderError::DuplicateTensor(t.name.to_string()));
        }
    }
    Ok(())
}

/// How to fetch header bytes from disk.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum ReadMode {
    #[default]
    Pread,
    Mmap,
}

impl ReadMode {
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

/// Reads the header bytes of `path` into `buf` (cleared first); returns the file size.
/// `buf` is reused across calls by the scan, so steady state allocates nothing.
pub fn read_header_bytes(path: &Path, mode: ReadMode, buf: &mut Vec<u8>) -> Result<u64, Error> {
    let file = File::open(path).map_err(|e| Error::io(path, e))?;
    let file_size = file.metadata().map_err(|e| Error::io(path, e))?.len();
    let header_err = |kind| Error::Header { path: path.to_path_buf(), kind };
    if file_size < N_LEN {
        return Err(header_err(HeaderError::HeaderTooSmall(file_size)));
    }
    buf.clear();
    match mode {
        ReadMode::Pread => {
            let mut prefix = [0u8; 8];
            std::io::Read::read_exact(&mut &file, &mut prefix).map_err(|e| Error::io(path, e))?;
            let n = check_length(prefix, file_size).map_err(header_err)?;
            // n is bounded by MAX_HEADER_SIZE and by the file size before we allocate for it.
            // read_to_end fills spare capacity without zeroing it first.
            buf.reserve(n as usize);
            let got = std::io::Read::read_to_end(&mut std::io::Read::take(&file, n), buf).map_err(|e| Error::io(path, e))?;
            if got as u64 != n {
                return Err(Error::io(
                    path,
                    std::io::Error::new(
                        std::io::ErrorKind::UnexpectedEof,
                        "file ended before the header did (was it truncated while being read?)",
                    ),
                ));
            }
        }
        ReadMode::Mmap => {
            // SAFETY: the map is read-only and dropped before returning. The length was checked just
            // above; if another process truncates the file between that check and the copy below,
            // touching a page past the new end raises SIGBUS. We keep that window to one memcpy of
            // at most N bytes; use `Pread` where files may change underneath.
            let map = unsafe { memmap2::MmapOptions::new().len(file_size as usize).map(&file) }
                .map_err(|e| Error::io(path, e))?;
            let mut prefix = [0u8; 8];
            prefix.copy_from_slice(&map[..8]);
            let n = check_length(prefix, file_size).map_err(header_err)?;
            buf.extend_from_slice(&map[8..8 + n as usize]);
        }
    }
    Ok(file_size)
}

/// Reads and validates the header of one file; the result borrows from `buf`.
pub fn read_header<'b>(path: &Path, mode: ReadMode, buf: &'b mut Vec<u8>) -> Result<Header<'b>, Error> {
    let file_size = read_header_bytes(path, mode, buf)?;
    parse_header(buf, file_size).map_err(|kind| Error::Header { path: path.to_path_buf(), kind })
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
        assert_eq!(code(&entry(r#"{"dtype":"X","shape":[],"data_offsets":[0,0]}"#), 0), "unknown_dtype");
        assert_eq!(code(&entry(r#"{"dtype":"F32","shape":[1],"data_offsets":[0,8]}"#), 8), "tensor_size_mismatch");
        assert_eq!(code(&entry(r#"{"dtype":"F4","shape":[1],"data_offsets":[0,0]}"#), 0), "misaligned_slice");
        assert_eq!(code(&entry(r#"{"dtype":"F32","shape":[1],"data_offsets":[4,8]}"#), 8), "invalid_offset");
        assert_eq!(code(&entry(r#"{"dtype":"F32","shape":[1],"data_offsets":[0,4]}"#), 5), "incomplete_buffer");
        let big = format!(r#"{{"dtype":"F32","shape":[{},4],"data_offsets":[0,0]}}"#, u64::MAX / 2);
        assert_eq!(code(&entry(&big), 0), "overflow");
        assert_eq!(code(&entry(r#"{"dtype":"F32","shape":[1]}"#), 0), "invalid_tensor_entry");
        assert_eq!(code(r#"[]"#, 0), "header_not_object");
        assert_eq!(code(r#"{"__metadata__":{"a":1}}"#, 0), "invalid_metadata");
        let dup = r#"{"t":{"dtype":"F32","shape":[0],"data_offsets":[0,0]},"t":{"dtype":"F32","shape":[0],"data_offsets":[0,0]}}"#;
        assert_eq!(code(dup, 0), "duplicate_tensor");
        assert_eq!(code(&entry(r#"{"dtype":"F32","dtype":"F32","shape":[0],"data_offsets":[0,0]}"#), 0), "duplicate_key");
    }

    #[test]
    fn unknown_fields_warn() {
        let h = parse(r#"{"t":{"dtype":"F32","shape":[0],"data_offsets":[0,0],"x":[1,{"y":null}]}}"#, 0).unwrap();
        assert_eq!(h.warnings[0].code, "unknown_field");
    }
}
