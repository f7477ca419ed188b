//! torch's zip container (`torch.save` since 1.6), read without inflating anything.
//!
//! torch's writer (miniz in `PyTorchStreamWriter`) stores every record uncompressed, so only stored
//! records are accepted: a compressed record is refused, never inflated, which rules out zip bombs.
//! The central directory is read once, bounded by the file's size; a local header is read only for
//! a record asked for. Everything is read by `pread`, so a file truncated underneath gives a short
//! read (an error), never SIGBUS.

use std::fs::File;
use std::os::unix::fs::FileExt;

use rustc_hash::FxHashMap;

use crate::codes::TorchErrorCode;
use crate::torch::TorchError;

/// A larger central directory is not torch's (about 100 bytes per tensor storage).
pub const MAX_CENTRAL_DIRECTORY: u64 = 64 << 20;
const EOCD_LEN: usize = 22;
const ZIP64_LOCATOR_LEN: usize = 20;
const ZIP64_EOCD_LEN: usize = 56;
const CENTRAL_LEN: usize = 46;
const LOCAL_LEN: usize = 30;
/// The end record can be followed by a comment of at most this many bytes.
const MAX_COMMENT: usize = 0xFFFF;

/// One stored record of the archive.
#[derive(Debug, Clone)]
pub struct Record {
    /// Full name, prefix included (`archive/data/0`).
    pub name: String,
    /// Its stored (uncompressed) size in bytes.
    pub size: u64,
    local_offset: u64,
}

/// The stored records of a zip archive (torch.save writes them uncompressed), from its central
/// directory.
#[derive(Debug)]
pub struct Archive<'f> {
    file: &'f File,
    /// Records end before the central directory starts.
    data_end: u64,
    records: Vec<Record>,
    by_name: FxHashMap<String, usize>,
    /// The folder every record lookup is relative to: the first record's top folder, as torch's
    /// `PyTorchStreamReader` takes it.
    prefix: String,
}

fn invalid(message: impl Into<String>) -> TorchError {
    TorchError::new(TorchErrorCode::InvalidZip, message)
}

fn u16_at(b: &[u8], at: usize) -> u16 {
    u16::from_le_bytes([b[at], b[at + 1]])
}

fn u32_at(b: &[u8], at: usize) -> u32 {
    u32::from_le_bytes(b[at..at + 4].try_into().expect("4 bytes"))
}

fn u64_at(b: &[u8], at: usize) -> u64 {
    u64::from_le_bytes(b[at..at + 8].try_into().expect("8 bytes"))
}

/// Whether `len` bytes from `start` end at or before `limit` (without overflowing).
fn fits(start: u64, len: u64, limit: u64) -> bool {
    matches!(start.checked_add(len), Some(end) if end <= limit)
}

/// Reads `len` bytes at `at`; the caller has checked the range against the file's size.
pub fn read_at(file: &File, at: u64, len: usize) -> Result<Vec<u8>, TorchError> {
    let mut buf = vec![0u8; len];
    file.read_exact_at(&mut buf, at).map_err(TorchError::Io)?;
    Ok(buf)
}

/// Where the central directory is: (offset, size, number of records, where the end records start).
struct Directory {
    offset: u64,
    size: u64,
    count: u64,
    end: u64,
}

fn find_directory(file: &File, file_size: u64) -> Result<Directory, TorchError> {
    if file_size < EOCD_LEN as u64 {
        return Err(invalid(format!("{file_size} bytes is too short for a zip archive")));
    }
    let tail_len = file_size.min((EOCD_LEN + MAX_COMMENT) as u64) as usize;
    let tail_start = file_size - tail_len as u64;
    let tail = read_at(file, tail_start, tail_len)?;
    // The last end record whose comment runs exactly to the end of the file.
    let at = (0..=tail_len - EOCD_LEN)
        .rev()
        .find(|&p| tail[p..p + 4] == *b"PK\x05\x06" && p + EOCD_LEN + u16_at(&tail, p + 20) as usize == tail_len)
        .ok_or_else(|| invalid("no end-of-central-directory record"))?;
    let eocd = &tail[at..at + EOCD_LEN];
    let eocd_pos = tail_start + at as u64;
    let (disk, cd_disk) = (u16_at(eocd, 4), u16_at(eocd, 6));
    let (on_disk, count) = (u16_at(eocd, 8), u16_at(eocd, 10));
    let mut dir = Directory {
        offset: u64::from(u32_at(eocd, 16)),
        size: u64::from(u32_at(eocd, 12)),
        count: u64::from(count),
        end: eocd_pos,
    };
    if (disk, cd_disk) != (0, 0) || on_disk != count {
        return Err(invalid("multi-disk archives are not torch files"));
    }
    // torch always writes the zip64 end records; they hold the true values.
    if eocd_pos >= (ZIP64_LOCATOR_LEN + ZIP64_EOCD_LEN) as u64 {
        let loc = read_at(file, eocd_pos - ZIP64_LOCATOR_LEN as u64, ZIP64_LOCATOR_LEN)?;
        if loc[..4] == *b"PK\x06\x07" {
            let rec_pos = u64_at(&loc, 8);
            if u32_at(&loc, 4) != 0 || u32_at(&loc, 16) != 1 {
                return Err(invalid("multi-disk archives are not torch files"));
            }
            let limit = eocd_pos - ZIP64_LOCATOR_LEN as u64;
            if !fits(rec_pos, ZIP64_EOCD_LEN as u64, limit) {
                return Err(invalid("zip64 end record lies outside the archive"));
            }
            let rec = read_at(file, rec_pos, ZIP64_EOCD_LEN)?;
            if rec[..4] != *b"PK\x06\x06" {
                return Err(invalid("zip64 locator does not point at a zip64 end record"));
            }
            if u32_at(&rec, 16) != 0 || u32_at(&rec, 20) != 0 || u64_at(&rec, 24) != u64_at(&rec, 32) {
                return Err(invalid("multi-disk archives are not torch files"));
            }
            dir = Directory {
                count: u64_at(&rec, 32),
                size: u64_at(&rec, 40),
                offset: u64_at(&rec, 48),
                end: rec_pos,
            };
        }
    }
    if !fits(dir.offset, dir.size, dir.end) {
        return Err(invalid(format!(
            "central directory ({} bytes at {}) runs past its end record at {}",
            dir.size, dir.offset, dir.end
        )));
    }
    if dir.size > MAX_CENTRAL_DIRECTORY {
        return Err(invalid(format!("central directory of {} bytes is too large", dir.size)));
    }
    if dir.count > dir.size / CENTRAL_LEN as u64 {
        return Err(invalid(format!(
            "{} records cannot fit a {}-byte central directory",
            dir.count, dir.size
        )));
    }
    Ok(dir)
}

/// (uncompressed size, local header offset) with zip64 values taken from the extra field where
/// the 32-bit ones are saturated, in the order the zip spec gives.
fn zip64_values(extra: &[u8], mut size: u64, compressed: u64, mut offset: u64) -> Result<(u64, u64), TorchError> {
    let (need_size, need_comp, need_off) = (size == 0xFFFF_FFFF, compressed == 0xFFFF_FFFF, offset == 0xFFFF_FFFF);
    if !(need_size || need_comp || need_off) {
        return Ok((size, offset));
    }
    let mut at = 0;
    while at + 4 <= extra.len() {
        let (id, len) = (u16_at(extra, at), u16_at(extra, at + 2) as usize);
        let body = extra
            .get(at + 4..at + 4 + len)
            .ok_or_else(|| invalid("extra field runs past its record"))?;
        if id == 1 {
            let mut fields = body
                .chunks_exact(8)
                .map(|c| u64::from_le_bytes(c.try_into().expect("8 bytes")));
            let mut next = |wanted: bool, current: u64| -> Result<u64, TorchError> {
                if !wanted {
                    return Ok(current);
                }
                fields.next().ok_or_else(|| invalid("zip64 extra field is too short"))
            };
            size = next(need_size, size)?;
            let comp = next(need_comp, compressed)?;
            offset = next(need_off, offset)?;
            if comp != size {
                return Err(invalid("a stored record's compressed and uncompressed sizes differ"));
            }
            return Ok((size, offset));
        }
        at += 4 + len;
    }
    Err(invalid(
        "a record's sizes are saturated but it has no zip64 extra field",
    ))
}

impl<'f> Archive<'f> {
    /// Reads the central directory of `file` (`file_size` bytes long).
    pub fn open(file: &'f File, file_size: u64) -> Result<Self, TorchError> {
        let dir = find_directory(file, file_size)?;
        let cd = read_at(file, dir.offset, dir.size as usize)?;
        let mut records = Vec::with_capacity(dir.count as usize);
        let mut by_name = FxHashMap::default();
        let mut at = 0usize;
        for _ in 0..dir.count {
            let fixed = cd
                .get(at..at + CENTRAL_LEN)
                .ok_or_else(|| invalid("central directory ends inside a record"))?;
            if fixed[..4] != *b"PK\x01\x02" {
                return Err(invalid(format!(
                    "bad central directory signature at byte {}",
                    dir.offset + at as u64
                )));
            }
            let (flags, method) = (u16_at(fixed, 8), u16_at(fixed, 10));
            let (compressed, size) = (u64::from(u32_at(fixed, 20)), u64::from(u32_at(fixed, 24)));
            let (name_len, extra_len, comment_len) = (
                u16_at(fixed, 28) as usize,
                u16_at(fixed, 30) as usize,
                u16_at(fixed, 32) as usize,
            );
            let disk = u16_at(fixed, 34);
            let offset = u64::from(u32_at(fixed, 42));
            let var = at + CENTRAL_LEN;
            let end = var + name_len + extra_len + comment_len;
            if end > cd.len() {
                return Err(invalid("central directory ends inside a record"));
            }
            let name = std::str::from_utf8(&cd[var..var + name_len])
                .map_err(|_| invalid("a record name is not UTF-8"))?
                .to_owned();
            if flags & 0x41 != 0 {
                return Err(invalid(format!("record {name:?} is encrypted")));
            }
            if method != 0 {
                return Err(invalid(format!(
                    "record {name:?} is compressed (method {method}); torch stores records uncompressed"
                )));
            }
            if disk != 0 && disk != 0xFFFF {
                return Err(invalid("multi-disk archives are not torch files"));
            }
            if compressed != size && compressed != 0xFFFF_FFFF && size != 0xFFFF_FFFF {
                return Err(invalid(format!(
                    "record {name:?}: compressed and uncompressed sizes differ"
                )));
            }
            let extra = &cd[var + name_len..var + name_len + extra_len];
            let (size, offset) = zip64_values(extra, size, compressed, offset)?;
            if !fits(offset, LOCAL_LEN as u64, dir.offset) || size > dir.offset {
                return Err(invalid(format!("record {name:?} lies outside the archive")));
            }
            if by_name.insert(name.clone(), records.len()).is_some() {
                return Err(invalid(format!("record {name:?} appears twice")));
            }
            records.push(Record {
                name,
                size,
                local_offset: offset,
            });
            at = end;
        }
        if at != cd.len() {
            return Err(invalid("central directory holds more than its records"));
        }
        let first = records.first().ok_or_else(|| invalid("the archive holds no records"))?;
        let prefix = match first.name.split_once('/') {
            Some((top, _)) => top.to_owned(),
            None => return Err(invalid(format!("record {:?} is not in a folder", first.name))),
        };
        Ok(Archive {
            file,
            data_end: dir.offset,
            records,
            by_name,
            prefix,
        })
    }

    /// The folder every record lookup is relative to.
    pub fn prefix(&self) -> &str {
        &self.prefix
    }

    /// The number of records.
    pub fn len(&self) -> usize {
        self.records.len()
    }

    /// Whether the archive has no record.
    pub fn is_empty(&self) -> bool {
        self.records.is_empty()
    }

    /// The record `prefix/name`.
    pub fn record(&self, name: &str) -> Option<&Record> {
        let mut full = String::with_capacity(self.prefix.len() + 1 + name.len());
        full.push_str(&self.prefix);
        full.push('/');
        full.push_str(name);
        self.by_name.get(&full).map(|&i| &self.records[i])
    }

    /// Where `record`'s bytes start, from its local header (checked against the central one). One
    /// read: the local name is as long as the central one, or the header is refused.
    pub fn data_offset(&self, record: &Record) -> Result<u64, TorchError> {
        let name_len = record.name.len() as u64;
        if !fits(record.local_offset, LOCAL_LEN as u64 + name_len, self.data_end) {
            return Err(invalid(format!("record {:?} lies outside the archive", record.name)));
        }
        let head = read_at(self.file, record.local_offset, LOCAL_LEN + record.name.len())?;
        if head[..4] != *b"PK\x03\x04" {
            return Err(invalid(format!("record {:?} has no local header", record.name)));
        }
        let extra_len = u64::from(u16_at(&head, 28));
        let start = record.local_offset + LOCAL_LEN as u64 + name_len + extra_len;
        if u64::from(u16_at(&head, 26)) != name_len || !fits(start, record.size, self.data_end) {
            return Err(invalid(format!(
                "record {:?}: local header disagrees with the directory",
                record.name
            )));
        }
        if head[LOCAL_LEN..] != *record.name.as_bytes() {
            return Err(invalid(format!(
                "record {:?}: local header names another record",
                record.name
            )));
        }
        Ok(start)
    }

    /// The bytes of `record`, refused when longer than `max`.
    pub fn read(&self, record: &Record, max: u64) -> Result<Vec<u8>, TorchError> {
        if record.size > max {
            return Err(TorchError::new(
                TorchErrorCode::PickleLimit,
                format!(
                    "record {:?} is {} bytes, more than the {max}-byte limit",
                    record.name, record.size
                ),
            ));
        }
        let start = self.data_offset(record)?;
        read_at(self.file, start, record.size as usize)
    }
}
