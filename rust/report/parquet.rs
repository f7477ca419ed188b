//! A Parquet writer for a report's tables (`ScanReport.to_parquet`), from the columns as the core
//! and numpy hold them: numbers, masks of nulls, dictionary codes with their distinct strings, and
//! Arrow's string buffers.
//!
//! Why not pyarrow's or the `parquet` crate's writer: pyarrow's writer runs on one thread and takes
//! longer than the scan it reports on, and the `parquet`
//! crate re-hashes every value of a dictionary column to build its dictionary. Here the codes the
//! core already made are written as they are (RLE/bit-packed, the Parquet dictionary encoding),
//! and the column chunks of a row group are encoded in parallel. The file is plain Parquet 2.x:
//! data pages v1, snappy, with the Arrow schema in the footer (`ARROW:schema`, given by the caller)
//! so that Arrow readers get the same types back (dictionaries, unsigned integers).

use std::io::{self, Write};

use rayon::prelude::*;

/// Rows of a row group, as pyarrow's default.
pub const ROW_GROUP_ROWS: usize = 1 << 20;
/// Rows of a data page. Each thread encodes a page whole in memory, then compresses it: 16 Ki rows of
/// u64 are 128 KiB, so the pages in flight stay small beside the columns themselves.
pub const PAGE_ROWS: usize = 1 << 14;
/// A page of strings ends once past this many bytes.
pub const PAGE_BYTES: usize = 1 << 18;
/// The longest string, and the largest dictionary, a page may hold (a page's sizes are `i32`).
pub const MAX_VALUE_BYTES: usize = 1 << 30;

/// The offsets of Arrow's string buffers (`string` or `large_string`).
#[derive(Clone, Copy)]
pub enum Offsets<'a> {
    /// 32-bit offsets.
    I32(&'a [i32]),
    /// 64-bit offsets.
    I64(&'a [i64]),
}

impl Offsets<'_> {
    fn len(&self) -> usize {
        match self {
            Offsets::I32(o) => o.len(),
            Offsets::I64(o) => o.len(),
        }
    }

    fn get(&self, i: usize) -> i64 {
        match self {
            Offsets::I32(o) => i64::from(o[i]),
            Offsets::I64(o) => o[i],
        }
    }
}

/// A column's values, one per row; rows that are null hold anything.
pub enum Values<'a> {
    /// Booleans.
    Bool(&'a [bool]),
    /// Unsigned 32-bit integers (Parquet INT32, UINT_32).
    U32(&'a [u32]),
    /// Unsigned 64-bit integers (Parquet INT64, UINT_64).
    U64(&'a [u64]),
    /// Signed 32-bit integers.
    I32(&'a [i32]),
    /// Signed 64-bit integers.
    I64(&'a [i64]),
    /// 32-bit floats.
    F32(&'a [f32]),
    /// 64-bit floats.
    F64(&'a [f64]),
    /// Strings as codes into `names`, its distinct values; a negative code is null.
    Dict {
        /// One per row.
        codes: &'a [i32],
        /// The dictionary, UTF-8.
        names: Vec<&'a [u8]>,
    },
    /// UTF-8 strings in Arrow's layout: row i is `data[offsets[i]..offsets[i + 1]]`.
    Utf8 {
        /// One more than the rows.
        offsets: Offsets<'a>,
        /// The strings' bytes.
        data: &'a [u8],
    },
}

/// A named column.
pub struct Column<'a> {
    /// The column's name.
    pub name: &'a str,
    /// Its values.
    pub values: Values<'a>,
    /// False where the row is null; None where no row is (a `Dict`'s negative codes are null too).
    pub valid: Option<&'a [bool]>,
    /// Write min/max statistics (integer columns; a reader filters and joins on them).
    pub statistics: bool,
}

// Parquet's enums (parquet.thrift).
const TYPE_BOOLEAN: i32 = 0;
const TYPE_INT32: i32 = 1;
const TYPE_INT64: i32 = 2;
const TYPE_FLOAT: i32 = 4;
const TYPE_DOUBLE: i32 = 5;
const TYPE_BYTE_ARRAY: i32 = 6;
const CONVERTED_UTF8: i32 = 0;
const CONVERTED_UINT_32: i32 = 13;
const CONVERTED_UINT_64: i32 = 14;
const CONVERTED_INT_32: i32 = 17;
const CONVERTED_INT_64: i32 = 18;
const REPETITION_OPTIONAL: i32 = 1;
const ENCODING_PLAIN: i32 = 0;
const ENCODING_RLE: i32 = 3;
const ENCODING_RLE_DICTIONARY: i32 = 8;
const CODEC_SNAPPY: i32 = 1;
const PAGE_DATA: i32 = 0;
const PAGE_DICTIONARY: i32 = 2;

impl Column<'_> {
    fn rows(&self) -> usize {
        match &self.values {
            Values::Bool(v) => v.len(),
            Values::U32(v) => v.len(),
            Values::U64(v) => v.len(),
            Values::I32(v) => v.len(),
            Values::I64(v) => v.len(),
            Values::F32(v) => v.len(),
            Values::F64(v) => v.len(),
            Values::Dict { codes, .. } => codes.len(),
            Values::Utf8 { offsets, .. } => offsets.len().saturating_sub(1),
        }
    }

    fn is_valid(&self, row: usize) -> bool {
        self.valid.map_or(true, |v| v[row]) && !matches!(&self.values, Values::Dict { codes, .. } if codes[row] < 0)
    }

    /// The Parquet physical type, converted type and logical type (an INTEGER's bit width and
    /// signedness, or STRING).
    fn parquet_type(&self) -> (i32, Option<i32>, Option<Logical>) {
        match &self.values {
            Values::Bool(_) => (TYPE_BOOLEAN, None, None),
            Values::U32(_) => (TYPE_INT32, Some(CONVERTED_UINT_32), Some(Logical::Integer(32, false))),
            Values::U64(_) => (TYPE_INT64, Some(CONVERTED_UINT_64), Some(Logical::Integer(64, false))),
            Values::I32(_) => (TYPE_INT32, Some(CONVERTED_INT_32), Some(Logical::Integer(32, true))),
            Values::I64(_) => (TYPE_INT64, Some(CONVERTED_INT_64), Some(Logical::Integer(64, true))),
            Values::F32(_) => (TYPE_FLOAT, None, None),
            Values::F64(_) => (TYPE_DOUBLE, None, None),
            Values::Dict { .. } | Values::Utf8 { .. } => (TYPE_BYTE_ARRAY, Some(CONVERTED_UTF8), Some(Logical::String)),
        }
    }

    /// Checks what the encoders index by, so that no input can make them panic.
    fn check(&self, rows: usize) -> Result<(), String> {
        let bad = |what: &str| Err(format!("column {:?}: {what}", self.name));
        if self.rows() != rows {
            return bad(&format!("{} rows, the table has {rows}", self.rows()));
        }
        if self.valid.is_some_and(|v| v.len() != rows) {
            return bad("its mask of valid rows is not one per row");
        }
        match &self.values {
            Values::Dict { codes, names } => {
                if codes.iter().any(|&c| c >= 0 && c as usize >= names.len()) {
                    return bad("a code is past its dictionary");
                }
                if names.iter().map(|n| n.len() + 4).sum::<usize>() > MAX_VALUE_BYTES {
                    return bad("its dictionary is over 1 GiB");
                }
            }
            Values::Utf8 { offsets, data } => {
                if offsets.len() == 0 {
                    return bad("no offsets");
                }
                let mut last = offsets.get(0);
                if last < 0 {
                    return bad("a negative offset");
                }
                for i in 1..offsets.len() {
                    let o = offsets.get(i);
                    if o < last || o as u64 > data.len() as u64 {
                        return bad("its offsets are not increasing within the data");
                    }
                    if (o - last) as u64 > MAX_VALUE_BYTES as u64 {
                        return bad("a string is over 1 GiB");
                    }
                    last = o;
                }
            }
            _ => {}
        }
        Ok(())
    }
}

enum Logical {
    String,
    Integer(i8, bool),
}

/// Columns checked to make one table that the encoders can write without indexing out of bounds,
/// before anything is written (a refused table leaves the file it would have gone to untouched).
pub struct Table<'c, 'a> {
    columns: &'c [Column<'a>],
    rows: usize,
}

impl<'c, 'a> Table<'c, 'a> {
    /// `columns`, all of one length; the error names the column and what is wrong with it.
    pub fn new(columns: &'c [Column<'a>]) -> Result<Self, String> {
        let rows = columns.first().map_or(0, Column::rows);
        for c in columns {
            c.check(rows)?;
        }
        Ok(Table { columns, rows })
    }

    /// Writes the table as a Parquet file to `out`, with `metadata` as the footer's key-value
    /// metadata. Column chunks are encoded in parallel (rayon), a row group at a time.
    pub fn write(&self, out: &mut impl Write, metadata: &[(&str, &[u8])]) -> io::Result<()> {
        write(out, self.columns, self.rows, metadata)
    }
}

fn write(out: &mut impl Write, columns: &[Column<'_>], rows: usize, metadata: &[(&str, &[u8])]) -> io::Result<()> {
    out.write_all(b"PAR1")?;
    let mut offset = 4u64;
    let mut row_groups = Vec::new();
    for start in (0..rows).step_by(ROW_GROUP_ROWS) {
        let end = (start + ROW_GROUP_ROWS).min(rows);
        let chunks: Vec<Chunk> = columns
            .par_iter()
            .map(|c| Chunk::encode(c, start, end))
            .collect::<io::Result<_>>()?;
        let mut placed = Vec::with_capacity(chunks.len());
        for chunk in chunks {
            out.write_all(&chunk.bytes)?;
            let at = offset;
            offset += chunk.bytes.len() as u64;
            placed.push((at, chunk));
        }
        row_groups.push((end - start, placed));
    }
    let footer = file_metadata(columns, rows, &row_groups, metadata);
    out.write_all(&footer)?;
    out.write_all(&(footer.len() as u32).to_le_bytes())?;
    out.write_all(b"PAR1")?;
    out.flush()
}

/// A column chunk: its pages, encoded and compressed, and what the footer says of it.
struct Chunk {
    bytes: Vec<u8>,
    /// Where its data pages start, past the dictionary page (relative to the chunk).
    data_offset: usize,
    dictionary: bool,
    uncompressed: usize,
    nulls: usize,
    /// Min and max, little-endian, of a column with statistics that has a value.
    bounds: Option<(Vec<u8>, Vec<u8>)>,
}

impl Chunk {
    fn encode(c: &Column<'_>, start: usize, end: usize) -> io::Result<Chunk> {
        SCRATCH.with_borrow_mut(|scratch| {
            let mut chunk = Chunk {
                bytes: Vec::new(),
                data_offset: 0,
                dictionary: false,
                uncompressed: 0,
                nulls: 0,
                bounds: if c.statistics { bounds(c, start, end) } else { None },
            };
            if let Values::Dict { names, .. } = &c.values {
                scratch.body.clear();
                for name in names {
                    scratch.body.extend_from_slice(&(name.len() as u32).to_le_bytes());
                    scratch.body.extend_from_slice(name);
                }
                let mut header = Thrift::default();
                header.i32(1, names.len() as i32);
                header.i32(2, ENCODING_PLAIN);
                chunk.page(PAGE_DICTIONARY, 7, header, scratch)?;
                chunk.data_offset = chunk.bytes.len();
                chunk.dictionary = true;
            }
            let mut page_start = start;
            while page_start < end {
                let page_end = page_end(c, page_start, end);
                let nulls = nulls(c, page_start, page_end);
                chunk.nulls += nulls;
                scratch.body.clear();
                page_body(&mut scratch.body, c, page_start, page_end, nulls);
                let mut header = Thrift::default();
                header.i32(1, (page_end - page_start) as i32);
                header.i32(
                    2,
                    if chunk.dictionary {
                        ENCODING_RLE_DICTIONARY
                    } else {
                        ENCODING_PLAIN
                    },
                );
                header.i32(3, ENCODING_RLE);
                header.i32(4, ENCODING_RLE);
                chunk.page(PAGE_DATA, 5, header, scratch)?;
                page_start = page_end;
            }
            scratch.trim();
            Ok(chunk)
        })
    }

    /// Appends a page: its header (with `inner`, the page type's own header, as field `field`) and
    /// the scratch body, snappy-compressed.
    fn page(&mut self, kind: i32, field: i16, inner: Thrift, scratch: &mut Scratch) -> io::Result<()> {
        let body = &scratch.body;
        let bound = snap::raw::max_compress_len(body.len());
        if scratch.compressed.len() < bound {
            scratch.compressed.resize(bound, 0);
        }
        let size = scratch
            .snappy
            .compress(body, &mut scratch.compressed)
            .map_err(io::Error::other)?;
        let mut header = Thrift::default();
        header.i32(1, kind);
        header.i32(2, body.len() as i32);
        header.i32(3, size as i32);
        header.nested(field, inner);
        header.stop();
        self.uncompressed += header.out.len() + body.len();
        self.bytes.extend_from_slice(&header.out);
        self.bytes.extend_from_slice(&scratch.compressed[..size]);
        Ok(())
    }
}

/// A thread's buffers for a page, kept from page to page: fresh ones of half a megabyte each were
/// zeroed by the kernel on first touch, a tenth of the writer's time.
struct Scratch {
    body: Vec<u8>,
    compressed: Vec<u8>,
    snappy: snap::raw::Encoder,
}

impl Scratch {
    /// Lets go of what a page of long strings grew them to.
    fn trim(&mut self) {
        for buf in [&mut self.body, &mut self.compressed] {
            if buf.capacity() > 8 * PAGE_BYTES {
                *buf = Vec::new();
            }
        }
    }
}

thread_local! {
    static SCRATCH: std::cell::RefCell<Scratch> = std::cell::RefCell::new(Scratch {
        body: Vec::new(),
        compressed: Vec::new(),
        snappy: snap::raw::Encoder::new(),
    });
}

/// Where the page from row `start` ends: after `PAGE_ROWS` rows, or once its strings pass
/// `PAGE_BYTES` (a page's sizes are 32-bit; `Column::check` keeps each string under `MAX_VALUE_BYTES`).
fn page_end(c: &Column<'_>, start: usize, end: usize) -> usize {
    let last = (start + PAGE_ROWS).min(end);
    let Values::Utf8 { offsets, .. } = &c.values else {
        return last;
    };
    let mut row = start;
    while row < last && offsets.get(row) - offsets.get(start) < PAGE_BYTES as i64 {
        row += 1;
    }
    row
}

/// The null rows in `start..end`.
fn nulls(c: &Column<'_>, start: usize, end: usize) -> usize {
    match (&c.values, c.valid) {
        (Values::Dict { .. }, Some(_)) => (start..end).filter(|&r| !c.is_valid(r)).count(),
        (Values::Dict { codes, .. }, None) => codes[start..end].iter().filter(|&&c| c < 0).count(),
        // Counted a chunk at a time in bytes, which vectorises (counting per value did not).
        (_, Some(valid)) => {
            let set: usize = valid[start..end]
                .chunks(255)
                .map(|c| usize::from(c.iter().fold(0u8, |a, &v| a + u8::from(v))))
                .sum();
            end - start - set
        }
        (_, None) => 0,
    }
}

/// A v1 data page's body: the definition levels (every column is optional), then the non-null
/// values; `nulls` of the rows are null.
fn page_body(out: &mut Vec<u8>, c: &Column<'_>, start: usize, end: usize, nulls: usize) {
    let n = end - start;
    let at = out.len();
    out.extend_from_slice(&[0; 4]);
    if nulls == 0 || nulls == n {
        varint(out, (n as u64) << 1);
        out.push(u8::from(nulls == 0));
    } else {
        hybrid(out, n, 1, |i| u32::from(c.is_valid(start + i)));
    }
    let levels = (out.len() - at - 4) as u32;
    out[at..at + 4].copy_from_slice(&levels.to_le_bytes());
    let rows = start..end;
    let valid = |r: &usize| c.is_valid(*r);
    match &c.values {
        Values::Bool(v) => {
            let pack = |group: &[bool]| {
                group
                    .iter()
                    .enumerate()
                    .fold(0u8, |b, (i, &on)| b | (u8::from(on) << i))
            };
            if nulls == 0 {
                out.extend(v[start..end].chunks(8).map(pack));
            } else {
                let bits: Vec<bool> = rows.filter(valid).map(|r| v[r]).collect();
                out.extend(bits.chunks(8).map(pack));
            }
        }
        Values::U32(v) => fixed(out, v, c, start, end, nulls),
        Values::U64(v) => fixed(out, v, c, start, end, nulls),
        Values::I32(v) => fixed(out, v, c, start, end, nulls),
        Values::I64(v) => fixed(out, v, c, start, end, nulls),
        Values::F32(v) => fixed(out, v, c, start, end, nulls),
        Values::F64(v) => fixed(out, v, c, start, end, nulls),
        Values::Dict { codes, names } => {
            let width = bit_width(names.len().saturating_sub(1) as u32);
            out.push(width as u8);
            if nulls == 0 {
                hybrid(out, n, width, |i| codes[start + i] as u32);
            } else {
                let present: Vec<u32> = rows.filter(valid).map(|r| codes[r] as u32).collect();
                hybrid(out, present.len(), width, |i| present[i]);
            }
        }
        Values::Utf8 { offsets, data } => {
            for r in rows.filter(valid) {
                let s = &data[offsets.get(r) as usize..offsets.get(r + 1) as usize];
                out.extend_from_slice(&(s.len() as u32).to_le_bytes());
                out.extend_from_slice(s);
            }
        }
    }
}

/// A number type as PLAIN stores it: its little-endian bytes.
trait Fixed: Copy {
    fn put(self, out: &mut Vec<u8>);
}

macro_rules! fixed_le {
    ($($t:ty),*) => {$(
        impl Fixed for $t {
            fn put(self, out: &mut Vec<u8>) {
                out.extend_from_slice(&self.to_le_bytes());
            }
        }
    )*};
}
fixed_le!(u32, u64, i32, i64, f32, f64);

/// The non-null values of rows `start..end`; a page without nulls copied whole.
fn fixed<T: Fixed>(out: &mut Vec<u8>, v: &[T], c: &Column<'_>, start: usize, end: usize, nulls: usize) {
    let v = &v[start..end];
    if nulls == 0 && cfg!(target_endian = "little") {
        // SAFETY: `Fixed` types are plain numbers (no padding, every byte initialised), and on a
        // little-endian machine their memory is their PLAIN encoding.
        out.extend_from_slice(unsafe { std::slice::from_raw_parts(v.as_ptr().cast::<u8>(), std::mem::size_of_val(v)) });
    } else if let Some(valid) = c.valid {
        out.reserve(std::mem::size_of_val(v));
        for (x, _) in v.iter().zip(&valid[start..end]).filter(|(_, &ok)| ok) {
            x.put(out);
        }
    } else {
        v.iter().for_each(|x| x.put(out));
    }
}

/// Bits for values up to `max`, at least 1.
fn bit_width(max: u32) -> u32 {
    (32 - max.leading_zeros()).max(1)
}

/// Parquet's RLE/bit-packing hybrid of `n` values (`get(i)`, each under 2^width): bit-packed in
/// groups of eight, except that a group of eight equal values starts an RLE run as long as the value
/// repeats. Looking for runs a group at a time, not value by value, keeps the branch on equality off
/// most values (value-by-value run finding was a third of the writer's time on a module table).
fn hybrid(out: &mut Vec<u8>, n: usize, width: u32, get: impl Fn(usize) -> u32) {
    let mut packed_from = 0;
    let mut at = 0;
    while at + 8 <= n {
        let v = get(at);
        if !(1..8).fold(true, |same, k| same & (get(at + k) == v)) {
            at += 8;
            continue;
        }
        let mut end = at + 8;
        while end < n && get(end) == v {
            end += 1;
        }
        bit_pack(out, packed_from, at, width, &get);
        varint(out, ((end - at) as u64) << 1);
        out.extend_from_slice(&v.to_le_bytes()[..width.div_ceil(8) as usize]);
        packed_from = end;
        at = end;
    }
    bit_pack(out, packed_from, n, width, &get);
}

/// One bit-packed run of values `from..to`, the last group padded with zeros.
fn bit_pack(out: &mut Vec<u8>, from: usize, to: usize, width: u32, get: &impl Fn(usize) -> u32) {
    if from == to {
        return;
    }
    let groups = (to - from).div_ceil(8);
    varint(out, ((groups as u64) << 1) | 1);
    let value = |i: usize| if i < to { get(i) } else { 0 };
    if width <= 16 {
        // A group of eight is at most 128 bits: gathered in one word and written as `width` bytes.
        out.reserve(groups * width as usize);
        for g in 0..groups {
            let at = from + g * 8;
            let acc = (0..8).fold(0u128, |acc, k| acc | (u128::from(value(at + k)) << (k as u32 * width)));
            out.extend_from_slice(&acc.to_le_bytes()[..width as usize]);
        }
        return;
    }
    let (mut acc, mut bits) = (0u64, 0u32);
    for i in from..from + groups * 8 {
        acc |= u64::from(value(i)) << bits;
        bits += width;
        while bits >= 8 {
            out.push(acc as u8);
            acc >>= 8;
            bits -= 8;
        }
    }
}

fn varint(out: &mut Vec<u8>, mut v: u64) {
    while v >= 0x80 {
        out.push(v as u8 | 0x80);
        v >>= 7;
    }
    out.push(v as u8);
}

/// Min and max of the valid values of an integer column, as Parquet's statistics store them.
fn bounds(c: &Column<'_>, start: usize, end: usize) -> Option<(Vec<u8>, Vec<u8>)> {
    fn of<T: Copy + PartialOrd>(
        v: &[T],
        rows: impl Iterator<Item = usize>,
        le: fn(T) -> Vec<u8>,
    ) -> Option<(Vec<u8>, Vec<u8>)> {
        let mut it = rows.map(|r| v[r]);
        let first = it.next()?;
        let (lo, hi) = it.fold((first, first), |(lo, hi), x| {
            (if x < lo { x } else { lo }, if x > hi { x } else { hi })
        });
        Some((le(lo), le(hi)))
    }
    let rows = (start..end).filter(|&r| c.is_valid(r));
    match &c.values {
        Values::U32(v) => of(v, rows, |x| x.to_le_bytes().to_vec()),
        Values::U64(v) => of(v, rows, |x| x.to_le_bytes().to_vec()),
        Values::I32(v) => of(v, rows, |x| x.to_le_bytes().to_vec()),
        Values::I64(v) => of(v, rows, |x| x.to_le_bytes().to_vec()),
        _ => None,
    }
}

/// The footer: Parquet's FileMetaData.
fn file_metadata(
    columns: &[Column<'_>],
    rows: usize,
    row_groups: &[(usize, Vec<(u64, Chunk)>)],
    metadata: &[(&str, &[u8])],
) -> Vec<u8> {
    let mut t = Thrift::default();
    t.i32(1, 2);
    t.list(2, STRUCT, columns.len() + 1);
    t.element(|t| {
        t.binary(4, b"schema");
        t.i32(5, columns.len() as i32);
    });
    for c in columns {
        let (physical, converted, logical) = c.parquet_type();
        t.element(|t| {
            t.i32(1, physical);
            t.i32(3, REPETITION_OPTIONAL);
            t.binary(4, c.name.as_bytes());
            if let Some(converted) = converted {
                t.i32(6, converted);
            }
            if let Some(logical) = &logical {
                let mut union = Thrift::default();
                match logical {
                    Logical::String => union.nested(1, Thrift::empty()),
                    Logical::Integer(bits, signed) => {
                        let mut int = Thrift::default();
                        int.i8(1, *bits);
                        int.bool(2, *signed);
                        union.nested(10, int);
                    }
                }
                t.nested(10, union);
            }
        });
    }
    t.i64(3, rows as i64);
    t.list(4, STRUCT, row_groups.len());
    for (group_rows, chunks) in row_groups {
        t.element(|t| {
            t.list(1, STRUCT, chunks.len());
            for ((at, chunk), c) in chunks.iter().zip(columns) {
                t.element(|t| column_chunk(t, *at, chunk, c, *group_rows));
            }
            t.i64(2, chunks.iter().map(|(_, c)| c.uncompressed as i64).sum());
            t.i64(3, *group_rows as i64);
            t.i64(5, chunks.first().map_or(0, |(at, _)| *at as i64));
            t.i64(6, chunks.iter().map(|(_, c)| c.bytes.len() as i64).sum());
        });
    }
    t.list(5, STRUCT, metadata.len());
    for (key, value) in metadata {
        t.element(|t| {
            t.binary(1, key.as_bytes());
            t.binary(2, value);
        });
    }
    t.binary(6, concat!("lorafast version ", env!("CARGO_PKG_VERSION")).as_bytes());
    // Min and max follow each type's own order (unsigned integers as unsigned).
    t.list(7, STRUCT, columns.len());
    for _ in columns {
        t.element(|t| t.nested(1, Thrift::empty()));
    }
    t.stop();
    t.out
}

/// A ColumnChunk with its ColumnMetaData.
fn column_chunk(t: &mut Thrift, at: u64, chunk: &Chunk, c: &Column<'_>, rows: usize) {
    t.i64(2, at as i64);
    let mut meta = Thrift::default();
    meta.i32(1, c.parquet_type().0);
    let encodings: &[i32] = if chunk.dictionary {
        &[ENCODING_PLAIN, ENCODING_RLE, ENCODING_RLE_DICTIONARY]
    } else {
        &[ENCODING_PLAIN, ENCODING_RLE]
    };
    meta.list(2, I32, encodings.len());
    encodings.iter().for_each(|&e| meta.varint_i64(i64::from(e)));
    meta.list(3, BINARY, 1);
    meta.raw_binary(c.name.as_bytes());
    meta.i32(4, CODEC_SNAPPY);
    meta.i64(5, rows as i64);
    meta.i64(6, chunk.uncompressed as i64);
    meta.i64(7, chunk.bytes.len() as i64);
    meta.i64(9, (at + chunk.data_offset as u64) as i64);
    if chunk.dictionary {
        meta.i64(11, at as i64);
    }
    if c.statistics {
        let mut stats = Thrift::default();
        stats.i64(3, chunk.nulls as i64);
        if let Some((min, max)) = &chunk.bounds {
            stats.binary(5, max);
            stats.binary(6, min);
        }
        meta.nested(12, stats);
    }
    t.nested(3, meta);
}

// Thrift compact protocol types.
const BOOL_TRUE: u8 = 1;
const BOOL_FALSE: u8 = 2;
const BYTE: u8 = 3;
const I32: u8 = 5;
const I64: u8 = 6;
const BINARY: u8 = 8;
const LIST: u8 = 9;
const STRUCT: u8 = 12;

/// A struct in Thrift's compact protocol, as Parquet's footer and page headers are written.
#[derive(Default)]
struct Thrift {
    out: Vec<u8>,
    /// The last field id of each struct being written, innermost last.
    last: Vec<i16>,
}

impl Thrift {
    /// An empty struct.
    fn empty() -> Thrift {
        Thrift::default()
    }

    fn field(&mut self, id: i16, kind: u8) {
        let last = self.last.last().copied().unwrap_or(0);
        let delta = id - last;
        if (1..=15).contains(&delta) {
            self.out.push(((delta as u8) << 4) | kind);
        } else {
            self.out.push(kind);
            self.varint_i64(i64::from(id));
        }
        match self.last.last_mut() {
            Some(l) => *l = id,
            None => self.last.push(id),
        }
    }

    fn varint_i64(&mut self, v: i64) {
        varint(&mut self.out, ((v << 1) ^ (v >> 63)) as u64);
    }

    fn i8(&mut self, id: i16, v: i8) {
        self.field(id, BYTE);
        self.out.push(v as u8);
    }

    fn bool(&mut self, id: i16, v: bool) {
        self.field(id, if v { BOOL_TRUE } else { BOOL_FALSE });
    }

    fn i32(&mut self, id: i16, v: i32) {
        self.field(id, I32);
        self.varint_i64(i64::from(v));
    }

    fn i64(&mut self, id: i16, v: i64) {
        self.field(id, I64);
        self.varint_i64(v);
    }

    fn raw_binary(&mut self, v: &[u8]) {
        varint(&mut self.out, v.len() as u64);
        self.out.extend_from_slice(v);
    }

    fn binary(&mut self, id: i16, v: &[u8]) {
        self.field(id, BINARY);
        self.raw_binary(v);
    }

    fn list(&mut self, id: i16, kind: u8, n: usize) {
        self.field(id, LIST);
        if n < 15 {
            self.out.push(((n as u8) << 4) | kind);
        } else {
            self.out.push(0xf0 | kind);
            varint(&mut self.out, n as u64);
        }
    }

    /// A struct element of a list, its fields written by `fill`.
    fn element(&mut self, fill: impl FnOnce(&mut Thrift)) {
        self.last.push(0);
        fill(self);
        self.out.push(0);
        self.last.pop();
    }

    /// Field `id`: the struct `inner` (its fields), ended here.
    fn nested(&mut self, id: i16, inner: Thrift) {
        self.field(id, STRUCT);
        self.out.extend_from_slice(&inner.out);
        self.out.push(0);
    }

    fn stop(&mut self) {
        self.out.push(0);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn decode_hybrid(mut data: &[u8], width: u32, n: usize) -> Vec<u32> {
        let mut out = Vec::new();
        let read_varint = |data: &mut &[u8]| {
            let (mut v, mut shift) = (0u64, 0);
            loop {
                let b = data[0];
                *data = &data[1..];
                v |= u64::from(b & 0x7f) << shift;
                shift += 7;
                if b < 0x80 {
                    return v;
                }
            }
        };
        while out.len() < n {
            let header = read_varint(&mut data);
            if header & 1 == 0 {
                let bytes = width.div_ceil(8) as usize;
                let mut value = [0u8; 4];
                value[..bytes].copy_from_slice(&data[..bytes]);
                data = &data[bytes..];
                out.extend(std::iter::repeat_n(u32::from_le_bytes(value), (header >> 1) as usize));
            } else {
                let count = (header >> 1) as usize * 8;
                let (mut acc, mut bits) = (0u64, 0u32);
                for _ in 0..count {
                    while bits < width {
                        acc |= u64::from(data[0]) << bits;
                        data = &data[1..];
                        bits += 8;
                    }
                    out.push((acc & ((1u64 << width) - 1)) as u32);
                    acc >>= width;
                    bits -= width;
                }
            }
        }
        assert!(data.is_empty(), "bytes left over");
        out.truncate(n);
        out
    }

    #[test]
    fn hybrid_round_trips_runs_and_mixed_values() {
        let mut seed = 7u64;
        for case in 0..300 {
            let width = 1 + case % 20;
            let n = (case * 37) % 700;
            let values: Vec<u32> = (0..n)
                .map(|i| {
                    seed = seed.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
                    let run = (i / (1 + (seed >> 60) as usize)) as u32;
                    if (seed >> 33) % 3 == 0 {
                        ((seed >> 40) as u32) & ((1 << width) - 1)
                    } else {
                        run & ((1 << width) - 1)
                    }
                })
                .collect();
            let mut out = Vec::new();
            hybrid(&mut out, values.len(), width as u32, |i| values[i]);
            assert_eq!(decode_hybrid(&out, width as u32, values.len()), values, "width {width}");
        }
    }

    #[test]
    fn a_long_run_is_one_rle_run() {
        let mut out = Vec::new();
        hybrid(&mut out, 100_000, 1, |_| 1);
        assert_eq!(out.len(), 4, "{out:?}"); // a 3-byte varint of 200,000, then the value
                                             // After 3 other values, the run is RLE from the next group of eight: 3 + 5 values bit-packed.
        out.clear();
        hybrid(&mut out, 1003, 9, |i| if i < 3 { i as u32 } else { 300 });
        assert_eq!(out.len(), 1 + 9 + 2 + 2, "{out:?}");
    }

    #[test]
    fn bad_columns_are_refused_not_indexed() {
        let codes = [0, 3];
        let c = Column {
            name: "x",
            values: Values::Dict {
                codes: &codes,
                names: vec![b"a"],
            },
            valid: None,
            statistics: false,
        };
        let err = Table::new(&[c]).err().unwrap();
        assert!(err.contains("past its dictionary"), "{err}");
        let offsets = [0, 5, 2];
        let c = Column {
            name: "s",
            values: Values::Utf8 {
                offsets: Offsets::I32(&offsets),
                data: b"hello",
            },
            valid: None,
            statistics: false,
        };
        assert!(Table::new(&[c]).is_err());
        let (a, b) = ([1u32, 2], [1u64]);
        let cols = [
            Column {
                name: "a",
                values: Values::U32(&a),
                valid: None,
                statistics: false,
            },
            Column {
                name: "b",
                values: Values::U64(&b),
                valid: None,
                statistics: false,
            },
        ];
        assert!(Table::new(&cols).is_err());
        let valid = [true];
        let c = Column {
            name: "a",
            values: Values::U32(&a),
            valid: Some(&valid),
            statistics: false,
        };
        assert!(Table::new(&[c]).is_err());
    }

    #[test]
    fn thrift_field_ids_past_fifteen_and_long_lists() {
        let mut t = Thrift::default();
        t.i32(1, -1);
        t.i32(20, 3);
        t.list(2, I32, 20);
        (0..20).for_each(|i| t.varint_i64(i));
        t.stop();
        // -1 zigzags to 1; id 20 after 1 is a long form header (type byte, zigzag id 40).
        // The list at id 2 after 20: long form again (LIST, zigzag 2), then 0xf0 | I32 and its size.
        assert_eq!(&t.out[..9], &[0x15, 0x01, 0x05, 40, 0x06, 0x09, 0x04, 0xf5, 20]);
    }
}
