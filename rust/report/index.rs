//! What the persistent index (`lorafast.Index`) stores, and the rescan that loads it: a row per adapter,
//! with the signature of its files, and a classification (modules included) per distinct content, which the
//! adapters of one recipe share.
//!
//! Everything is a compact binary encoding that loads at memory speed: a classification is its fields and
//! the module records' buffers as they are (`classify/modules/stored.rs`), snappy-compressed and named by the
//! sha256 of that blob; a row is its own fields (paths, config text, metadata, sizes) as length-prefixed
//! bytes. Each encoding opens with a tag and [`VERSION`]; decoding checks every length, index and text, so
//! damaged bytes are an error (then the caller reads the adapters again), never a wrong row or a panic.
//! An index is only read by the build that wrote it (its signature names the build), so the encoding
//! needs no compatibility with other versions, only to be recognised as theirs.
//!
//! A rescan ([`plan`], then [`assemble`]) compares each discovered adapter's [`signature`] with the stored
//! one, reuses unchanged rows and rows whose files moved, and decodes what it reuses in parallel.

use std::cell::RefCell;
use std::ffi::OsStr;
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use rayon::prelude::*;
use rustc_hash::{FxHashMap, FxHashSet};
use sha2::{Digest, Sha256};

use crate::classify::{Classification, Format, ModuleKind, Modules, MoeLayout, Problem};
use crate::codes::{ErrorCode, ProblemCode};
use crate::error::Error;
use crate::header::Dtype;
use crate::names::Variant;
use crate::remote::ObjectStat;
use crate::scan::{with_pool, AdapterResult, Target};

/// Bumped when an encoding changes.
pub const VERSION: u8 = 2;

const CLASS_TAG: [u8; 4] = [b'L', b'F', b'c', VERSION];
const ROW_TAG: [u8; 4] = [b'L', b'F', b'r', VERSION];
const ERROR_TAG: [u8; 4] = [b'L', b'F', b'e', VERSION];

/// A classification's id: the sha256 of its blob.
pub type ClassId = [u8; 32];

pub(crate) fn bad(what: &str) -> String {
    format!("stored row: bad {what}")
}

fn put_u8(out: &mut Vec<u8>, v: u8) {
    out.push(v);
}

pub(crate) fn put_u32(out: &mut Vec<u8>, v: u32) {
    out.extend_from_slice(&v.to_le_bytes());
}

fn put_u64(out: &mut Vec<u8>, v: u64) {
    out.extend_from_slice(&v.to_le_bytes());
}

fn put_i64(out: &mut Vec<u8>, v: i64) {
    out.extend_from_slice(&v.to_le_bytes());
}

pub(crate) fn put_bytes(out: &mut Vec<u8>, b: &[u8]) {
    put_u32(out, u32::try_from(b.len()).expect("stored fields are under 4 GiB"));
    out.extend_from_slice(b);
}

fn put_opt<T>(out: &mut Vec<u8>, v: Option<T>, put: impl FnOnce(&mut Vec<u8>, T)) {
    put_u8(out, u8::from(v.is_some()));
    if let Some(v) = v {
        put(out, v);
    }
}

fn put_str(out: &mut Vec<u8>, s: &str) {
    put_bytes(out, s.as_bytes());
}

fn put_path(out: &mut Vec<u8>, p: &Path) {
    put_bytes(out, p.as_os_str().as_bytes());
}

fn put_list<T>(out: &mut Vec<u8>, items: &[T], mut put: impl FnMut(&mut Vec<u8>, &T)) {
    put_u32(out, items.len() as u32);
    for item in items {
        put(out, item);
    }
}

/// Reads what the `put_*` functions wrote; every read is bound-checked.
pub(crate) struct Reader<'a> {
    rest: &'a [u8],
}

impl<'a> Reader<'a> {
    pub(crate) fn new(bytes: &'a [u8]) -> Self {
        Reader { rest: bytes }
    }

    fn take(&mut self, n: usize) -> Result<&'a [u8], String> {
        if n > self.rest.len() {
            return Err(bad("length"));
        }
        let (head, rest) = self.rest.split_at(n);
        self.rest = rest;
        Ok(head)
    }

    fn array<const N: usize>(&mut self) -> Result<[u8; N], String> {
        Ok(self.take(N)?.try_into().unwrap_or([0; N]))
    }

    fn u8(&mut self) -> Result<u8, String> {
        Ok(self.array::<1>()?[0])
    }

    fn u32(&mut self) -> Result<u32, String> {
        self.array().map(u32::from_le_bytes)
    }

    fn u64(&mut self) -> Result<u64, String> {
        self.array().map(u64::from_le_bytes)
    }

    pub(crate) fn bytes(&mut self) -> Result<&'a [u8], String> {
        let n = self.u32()? as usize;
        self.take(n)
    }

    fn str(&mut self) -> Result<&'a str, String> {
        std::str::from_utf8(self.bytes()?).map_err(|_| bad("text"))
    }

    fn string(&mut self) -> Result<String, String> {
        self.str().map(str::to_owned)
    }

    fn opt<T>(&mut self, read: impl FnOnce(&mut Self) -> Result<T, String>) -> Result<Option<T>, String> {
        match self.u8()? {
            0 => Ok(None),
            1 => read(self).map(Some),
            _ => Err(bad("option")),
        }
    }

    fn path(&mut self) -> Result<PathBuf, String> {
        Ok(PathBuf::from(OsStr::from_bytes(self.bytes()?)))
    }

    pub(crate) fn list<T>(&mut self, mut read: impl FnMut(&mut Self) -> Result<T, String>) -> Result<Vec<T>, String> {
        let n = self.u32()? as usize;
        // Each item takes at least a byte: a damaged count cannot reserve more than the bytes there are.
        let mut out = Vec::with_capacity(n.min(self.rest.len()));
        for _ in 0..n {
            out.push(read(self)?);
        }
        Ok(out)
    }

    fn index<T: Copy>(&mut self, all: &[T], what: &str) -> Result<T, String> {
        let i = self.u8()? as usize;
        all.get(i).copied().ok_or_else(|| bad(what))
    }

    pub(crate) fn tag(&mut self, tag: [u8; 4], what: &str) -> Result<(), String> {
        if self.array::<4>()? != tag {
            return Err(bad(what));
        }
        Ok(())
    }

    pub(crate) fn end(&self) -> Result<(), String> {
        if self.rest.is_empty() {
            Ok(())
        } else {
            Err(bad("trailing bytes"))
        }
    }
}

fn position<T: PartialEq>(all: &[T], v: &T) -> u8 {
    all.iter().position(|x| x == v).unwrap_or(0) as u8
}

/// Every module kind, in a fixed order: a kind is stored as its place here.
fn kinds() -> Vec<ModuleKind> {
    ModuleKind::all().collect()
}

/// The uncompressed encoding of a classification (the part adapters of one recipe share): its modules' text
/// first, so that decoding takes the decompressed bytes as that text without a copy; then its other fields,
/// the modules' other buffers and the text's length.
fn encode_class(c: &Classification, kinds: &[ModuleKind], out: &mut Vec<u8>) {
    out.clear();
    c.modules.encode_text(out);
    let text = out.len() as u32;
    encode_head(c, out);
    c.modules.encode_body(out, kinds);
    put_u32(out, text);
}

/// A classification's encoding but its modules.
fn encode_head(c: &Classification, out: &mut Vec<u8>) {
    out.extend_from_slice(&CLASS_TAG);
    put_u8(out, position(Format::ALL, &c.format));
    put_opt(out, c.peft_type.as_deref(), put_str);
    put_u32(out, c.num_tensors);
    put_list(out, &c.dtypes, |o, d| put_u8(o, *d as u8));
    put_list(out, &c.layers, |o, l| put_u32(o, *l));
    put_opt(out, c.base_model.as_deref(), put_str);
    put_list(out, &c.target_modules, |o, t| put_str(o, t));
    put_u64(out, c.rank);
    put_u8(out, position(MoeLayout::ALL, &c.moe_layout));
    put_u64(out, c.num_experts);
    put_u32(out, c.flags);
    put_list(out, &c.variants, |o, v| put_u8(o, position(&Variant::ALL, v)));
    put_list(out, &c.full_weight_tensors, |o, t| put_str(o, t));
    put_list(out, &c.problems, |o, p| {
        put_str(o, p.code.code());
        put_str(o, &p.message);
        put_opt(o, p.tensor.as_deref(), put_str);
    });
}

fn decode_class(mut raw: Vec<u8>, kinds: &[ModuleKind]) -> Result<Classification, String> {
    let at = raw.len().checked_sub(4).ok_or_else(|| bad("classification"))?;
    let text = u32::from_le_bytes(raw[at..].try_into().unwrap_or_default()) as usize;
    if text > at {
        return Err(bad("classification"));
    }
    let mut rest = raw.split_off(text);
    rest.truncate(rest.len() - 4);
    let text = String::from_utf8(raw).map_err(|_| bad("module text"))?;
    let mut r = Reader::new(&rest);
    r.tag(CLASS_TAG, "classification")?;
    let c = Classification {
        format: r.index(Format::ALL, "format")?,
        peft_type: r.opt(Reader::string)?,
        num_tensors: r.u32()?,
        dtypes: r.list(|r| r.index(&Dtype::ALL, "dtype"))?,
        layers: r.list(Reader::u32)?,
        base_model: r.opt(Reader::string)?,
        target_modules: r.list(Reader::string)?,
        rank: r.u64()?,
        moe_layout: r.index(MoeLayout::ALL, "layout")?,
        num_experts: r.u64()?,
        flags: r.u32()?,
        variants: r.list(|r| r.index(&Variant::ALL, "variant"))?,
        full_weight_tensors: r.list(Reader::string)?,
        problems: r.list(|r| {
            Ok(Problem {
                code: ProblemCode::from_code(r.str()?).ok_or_else(|| bad("problem code"))?,
                message: r.string()?,
                tensor: r.opt(Reader::string)?,
            })
        })?,
        modules: Arc::new(Modules::decode(text, r.bytes()?, kinds)?),
        duplicate_tensor: None,
    };
    r.end()?;
    Ok(c)
}

thread_local! {
    /// One buffer per thread to encode classifications in: most of a fleet's are the same size give or take,
    /// so the buffer is seldom grown (and its pages seldom faulted in).
    static SCRATCH: RefCell<Vec<u8>> = const { RefCell::new(Vec::new()) };
}

/// A classification's id (see [`ClassId`]: the sha256 of the blob, which the same build always compresses
/// alike, and which is a few times fewer bytes to hash) and its blob as the index stores it: compressed (a
/// fleet's module names repeat).
fn class_blob(c: &Classification, kinds: &[ModuleKind]) -> (ClassId, Vec<u8>) {
    SCRATCH.with_borrow_mut(|raw| {
        encode_class(c, kinds, raw);
        let blob = compress(raw);
        (Sha256::digest(&blob).into(), blob)
    })
}

/// Snappy's output for `raw`.
pub(crate) fn compress(raw: &[u8]) -> Vec<u8> {
    snap::raw::Encoder::new()
        .compress_vec(raw)
        .expect("snappy takes any input")
}

/// The bytes a stored blob was compressed from. The length it opens with is checked against the most that
/// snappy can expand its bytes to (a copy of 3 bytes makes at most 64), so a damaged length is an error,
/// never an allocation of gigabytes.
pub(crate) fn decompress(blob: &[u8]) -> Result<Vec<u8>, String> {
    let n = snap::raw::decompress_len(blob).map_err(|e| bad(&e.to_string()))?;
    if n > blob.len().saturating_mul(22) {
        return Err(bad("compressed length"));
    }
    let mut raw = vec![0; n];
    snap::raw::Decoder::new()
        .decompress(blob, &mut raw)
        .map_err(|e| bad(&e.to_string()))?;
    Ok(raw)
}

/// Decodes a stored classification (a [`class_blob`]).
pub fn decode_class_blob(blob: &[u8]) -> Result<Classification, String> {
    decode_class(decompress(blob)?, &kinds())
}

/// The encoding of one row, without its classification (stored apart, see [`Fresh`]).
pub fn encode_row(row: &Result<AdapterResult, Error>) -> Vec<u8> {
    // Sized once (grown, a row was several reallocations): its texts, and at most 96 bytes of tags,
    // lengths and numbers.
    let text = |a: &AdapterResult| {
        let t = &a.target;
        let paths = [Some(&t.path), Some(&t.weights), t.config.as_ref()];
        let metadata = a
            .metadata
            .iter()
            .flatten()
            .map(|(k, v)| k.len() + v.len() + 8)
            .sum::<usize>();
        paths.iter().flatten().map(|p| p.as_os_str().len()).sum::<usize>()
            + a.config_json.as_ref().map_or(0, String::len)
            + a.content_hash.as_ref().map_or(0, String::len)
            + metadata
    };
    let mut out = Vec::with_capacity(96 + row.as_ref().map_or(256, text));
    match row {
        Ok(a) => {
            out.extend_from_slice(&ROW_TAG);
            put_target(&mut out, &a.target);
            put_opt(&mut out, a.config_json.as_deref(), put_str);
            put_opt(&mut out, a.metadata.as_deref(), |o, m| {
                put_list(o, m, |o, (k, v)| {
                    put_str(o, k);
                    put_str(o, v);
                });
            });
            put_u64(&mut out, a.header_size);
            put_u64(&mut out, a.file_size);
            put_opt(&mut out, a.content_hash.as_deref(), put_str);
        }
        Err(e) => {
            out.extend_from_slice(&ERROR_TAG);
            put_path(&mut out, e.path());
            put_str(&mut out, e.code());
            put_str(&mut out, &e.detail());
        }
    }
    out
}

fn put_target(out: &mut Vec<u8>, t: &Target) {
    put_path(out, &t.path);
    put_path(out, &t.weights);
    put_opt(out, t.config.as_deref(), put_path);
}

fn read_target(r: &mut Reader<'_>) -> Result<Target, String> {
    Ok(Target {
        path: r.path()?,
        weights: r.path()?,
        config: r.opt(Reader::path)?,
    })
}

/// Decodes a row written by [`encode_row`]; `class` gives its classification (called for a successful row).
pub fn decode_row(
    bytes: &[u8],
    class: impl FnOnce() -> Result<Arc<Classification>, String>,
) -> Result<Result<AdapterResult, Error>, String> {
    let mut r = Reader::new(bytes);
    if r.take(4)? == ERROR_TAG {
        let (path, code, detail) = (r.path()?, r.str()?, r.string()?);
        r.end()?;
        let code = ErrorCode::from_code(code).ok_or_else(|| bad("error code"))?;
        return Ok(Err(Error::adapter(path, code, detail)));
    }
    let mut r = Reader::new(bytes);
    r.tag(ROW_TAG, "row")?;
    let a = AdapterResult {
        target: read_target(&mut r)?,
        config_json: r.opt(Reader::string)?,
        metadata: r.opt(|r| r.list(|r| Ok((r.string()?, r.string()?))))?,
        header_size: r.u64()?,
        file_size: r.u64()?,
        class: class()?,
        content_hash: r.opt(Reader::string)?,
    };
    r.end()?;
    Ok(Ok(a))
}

/// A stored row with the paths of the place its files moved to (nothing else in a row names a path).
fn moved_row(row: &[u8], to: &Target) -> Result<Vec<u8>, String> {
    let mut r = Reader::new(row);
    r.tag(ROW_TAG, "row")?;
    read_target(&mut r)?;
    let mut out = ROW_TAG.to_vec();
    put_target(&mut out, to);
    out.extend_from_slice(r.rest);
    Ok(out)
}

/// What the file system or the store says of one file, as a signature holds it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum FileStat {
    /// A local file: size, mtime (seconds, nanoseconds), inode, device, and the ctime, which any write sets
    /// and no caller can set back (so a rewrite that keeps the size and puts the mtime back is seen).
    Local {
        /// Bytes.
        size: u64,
        /// mtime: seconds and nanoseconds.
        mtime: (i64, i64),
        /// Inode.
        ino: u64,
        /// Device.
        dev: u64,
        /// ctime: seconds and nanoseconds.
        ctime: (i64, i64),
    },
    /// A remote object with an ETag (and its size).
    Etag(u64, String),
    /// A remote object without an ETag: its size and last-modified time (to the second, often: weak).
    Modified(u64, i64),
}

impl FileStat {
    /// A local file's stat (following links, as the scan opens it).
    pub fn local(path: &Path) -> std::io::Result<FileStat> {
        std::fs::metadata(path).map(|m| FileStat::of(&m))
    }

    /// A local file's, from its metadata.
    pub fn of(m: &std::fs::Metadata) -> FileStat {
        FileStat::Local {
            size: m.size(),
            mtime: (m.mtime(), m.mtime_nsec()),
            ino: m.ino(),
            dev: m.dev(),
            ctime: (m.ctime(), m.ctime_nsec()),
        }
    }

    /// A remote object's, as its listing or a HEAD said; None when the store said neither an ETag nor a
    /// last-modified time (its size alone cannot tell a rewrite).
    pub fn remote(o: &ObjectStat) -> Option<FileStat> {
        match (&o.etag, o.last_modified_ns) {
            (Some(etag), _) if !etag.is_empty() => Some(FileStat::Etag(o.size, etag.clone())),
            (_, Some(ns)) => Some(FileStat::Modified(o.size, ns)),
            _ => None,
        }
    }

    /// Without the ctime: what stays when the file is renamed.
    fn put_content(&self, out: &mut Vec<u8>) {
        match self {
            FileStat::Local {
                size, mtime, ino, dev, ..
            } => {
                put_u8(out, 0);
                for v in [*size, mtime.0 as u64, mtime.1 as u64, *ino, *dev] {
                    put_u64(out, v);
                }
            }
            FileStat::Etag(size, etag) => {
                put_u8(out, 1);
                put_u64(out, *size);
                put_str(out, etag);
            }
            FileStat::Modified(size, ns) => {
                put_u8(out, 2);
                put_u64(out, *size);
                put_i64(out, *ns);
            }
        }
    }
}

/// The signature of an adapter's files: what a rescan compares with the stored one, and which tells an
/// unchanged adapter (equal signatures) and one moved elsewhere (equal [`content`]). `context` holds what
/// else a row depends on (the read options and the build, from the caller).
///
/// Laid out as the content's length, the content (`context`, whether it is strong, the stats without
/// ctimes), then the rest (the weights' and config's paths, the local ctimes).
pub fn signature(t: &Target, weights: &FileStat, config: Option<&FileStat>, context: &[u8]) -> Vec<u8> {
    // Sized once: grown field by field, a signature was several reallocations and copies, a third of an
    // unchanged rescan's walk on 20,000 small adapters. Its texts, and at most `FIXED` bytes of lengths,
    // tags and numbers around them.
    const FIXED: usize = 160;
    let paths = [Some(&t.path), Some(&t.weights), t.config.as_ref()];
    let etags = [Some(weights), config].into_iter().flatten().map(|s| match s {
        FileStat::Etag(_, etag) => etag.len(),
        _ => 0,
    });
    let texts =
        context.len() + paths.iter().flatten().map(|p| p.as_os_str().len()).sum::<usize>() + etags.sum::<usize>();
    let mut out = Vec::with_capacity(FIXED + texts);
    out.extend_from_slice(&[0; 4]);
    put_bytes(&mut out, context);
    // A local stat or an ETag tells these files from others of the same size; a remote size and
    // last-modified time may not, so rows signed by them are never moved to another path.
    put_u8(&mut out, u8::from(!matches!(weights, FileStat::Modified(..))));
    weights.put_content(&mut out);
    put_opt(&mut out, config, |o, c| c.put_content(o));
    let len = (out.len() - 4) as u32;
    out[..4].copy_from_slice(&len.to_le_bytes());
    put_target(&mut out, t);
    for stat in [Some(weights), config].into_iter().flatten() {
        if let FileStat::Local { ctime, .. } = stat {
            put_i64(&mut out, ctime.0);
            put_i64(&mut out, ctime.1);
        }
    }
    out
}

/// A signature's content (see [`signature`]), when it is strong enough to move a row by.
fn content(sig: &[u8]) -> Option<&[u8]> {
    let mut r = Reader::new(sig);
    let len = r.u32().ok()? as usize;
    let content = r.take(len).ok()?;
    let mut c = Reader::new(content);
    c.bytes().ok()?;
    (c.u8().ok()? == 1).then_some(content)
}

/// A row as the index holds it: its path (the key) and one entry of bytes ([`entry`]), so that loading a row
/// costs SQLite and Python two values, not four.
#[derive(Debug, Clone, Copy, Default)]
pub struct Stored<'a> {
    /// The adapter's path (the key).
    pub path: &'a [u8],
    /// Its files' [`signature`] (empty: none could be had, so it is read again).
    pub signature: &'a [u8],
    /// The row ([`encode_row`]).
    pub row: &'a [u8],
    /// Its classification's id (None for a failed row).
    pub class: Option<&'a [u8]>,
    /// The entry all of this was parsed from, as stored.
    pub entry: &'a [u8],
}

impl<'a> Stored<'a> {
    /// The row at `path` stored as `entry`. An entry that does not parse gives an empty signature, which
    /// matches none: its adapter is read again and the entry written over.
    pub fn parse(path: &'a [u8], entry: &'a [u8]) -> Stored<'a> {
        let mut r = Reader::new(entry);
        let parts = (|| Ok::<_, String>((r.bytes()?, r.opt(Reader::bytes)?)))();
        match parts {
            Ok((signature, class)) => Stored {
                path,
                signature,
                row: r.rest,
                class,
                entry,
            },
            Err(_) => Stored {
                path,
                entry,
                ..Stored::default()
            },
        }
    }
}

/// A row's entry, as [`Stored::parse`] reads it: its signature, its classification's id and the row.
pub fn entry(signature: &[u8], class: Option<&[u8]>, row: &[u8]) -> Vec<u8> {
    let mut out = Vec::with_capacity(signature.len() + row.len() + 48);
    put_bytes(&mut out, signature);
    put_opt(&mut out, class, put_bytes);
    out.extend_from_slice(row);
    out
}

/// What a rescan knows of a discovered adapter's files.
#[derive(Debug)]
pub enum Sig {
    /// The store says a file is gone: the adapter is read for its error row, which is not stored.
    Missing,
    /// No signature could be had: the adapter is read, and stored with an empty signature.
    Unknown,
    /// Its [`signature`].
    Known(Vec<u8>),
}

/// One adapter of the walk, in its place.
#[derive(Debug)]
pub enum Slot {
    /// A stored row, unchanged: its index in the stored rows.
    Stored(usize),
    /// A stored row whose files moved here: its index in [`Plan::moved`].
    Moved(usize),
    /// To read: its index in [`Plan::to_read`] (and, once read, in the rows read).
    Read(usize),
    /// A failed discovery (part of the walk: nothing to read or store).
    Failed(Error),
}

/// A row to write: path, signature, row and classification id.
#[derive(Debug, Clone)]
pub struct Upsert {
    /// The adapter's path.
    pub path: Vec<u8>,
    /// Its [`signature`].
    pub signature: Vec<u8>,
    /// The row.
    pub row: Vec<u8>,
    /// Its classification's id (None for a failed row).
    pub class: Option<Vec<u8>>,
}

/// What a rescan does with each discovered adapter.
#[derive(Debug, Default)]
pub struct Plan {
    /// Every adapter, in walk order.
    pub slots: Vec<Slot>,
    /// The adapters to read, with the signature to store them with (None: not stored).
    pub to_read: Vec<(Target, Option<Vec<u8>>)>,
    /// Stored rows moved to new paths, to write.
    pub moved: Vec<Upsert>,
    /// Adapters new to the index.
    pub added: Vec<PathBuf>,
    /// Adapters whose files changed.
    pub changed: Vec<PathBuf>,
    /// Stored adapters gone from under the scanned roots, in stored order.
    pub removed: Vec<PathBuf>,
    /// The stored rows of `removed`.
    pub gone: Vec<usize>,
    /// The stored rows another, later row of the same path hides (a changed row appended, or two writers
    /// that added one adapter).
    pub hidden: Vec<usize>,
}

fn under(path: &[u8], root: &[u8]) -> bool {
    let root = root.strip_suffix(b"/").unwrap_or(root);
    path == root || (path.starts_with(root) && path.get(root.len()) == Some(&b'/'))
}

/// Plans a rescan of `found` (the walk, with each adapter's signature) against the `stored` rows. Without
/// `trust`, every adapter is read (a stored row did not decode). An unchanged adapter keeps its row; a new
/// path whose files have the content of a gone adapter's (same inode, device, size and mtime; a rename sets
/// the ctime, so it is not compared) takes that row, with its paths rewritten.
pub fn plan(
    found: Vec<(Result<Target, Error>, Sig)>,
    stored: &[Stored<'_>],
    roots: &[PathBuf],
    trust: bool,
) -> Result<Plan, String> {
    let key = |t: &Target| t.path.as_os_str().as_bytes().to_vec();
    let by_path: FxHashMap<&[u8], usize> = stored.iter().enumerate().map(|(i, s)| (s.path, i)).collect();
    // A first scan (nothing stored) has nothing gone: its walk's paths are not gathered for that.
    let gone: Vec<usize> = if stored.is_empty() {
        Vec::new()
    } else {
        let seen: FxHashSet<&[u8]> = found
            .iter()
            .filter_map(|(t, sig)| match (t, sig) {
                (Ok(t), Sig::Known(_) | Sig::Unknown) => Some(t.path.as_os_str().as_bytes()),
                _ => None,
            })
            .collect();
        (0..stored.len())
            .filter(|&i| {
                let p = stored[i].path;
                by_path[&p] == i && !seen.contains(p) && roots.iter().any(|r| under(p, r.as_os_str().as_bytes()))
            })
            .collect()
    };
    // Another row of the same path hides these (a changed row appended, or two writers that added one
    // adapter): the later one is read.
    let hidden: Vec<usize> = (0..stored.len()).filter(|&i| by_path[&stored[i].path] != i).collect();
    let mut moved_from: FxHashMap<&[u8], usize> = FxHashMap::default();
    for &i in &gone {
        if let (Some(c), Some(_)) = (content(stored[i].signature), stored[i].class) {
            moved_from.entry(c).or_insert(i);
        }
    }
    let mut plan = Plan {
        removed: gone
            .iter()
            .map(|&i| PathBuf::from(OsStr::from_bytes(stored[i].path)))
            .collect(),
        ..Plan::default()
    };
    for (target, sig) in found {
        let t = match target {
            Ok(t) => t,
            Err(e) => {
                plan.slots.push(Slot::Failed(e));
                continue;
            }
        };
        let sig = match sig {
            Sig::Missing => {
                plan.slots.push(Slot::Read(plan.to_read.len()));
                plan.to_read.push((t, None));
                continue;
            }
            Sig::Unknown => Vec::new(),
            Sig::Known(s) => s,
        };
        let old = (!by_path.is_empty())
            .then(|| by_path.get(t.path.as_os_str().as_bytes()).copied())
            .flatten();
        if let Some(i) = old.filter(|&i| trust && !sig.is_empty() && stored[i].signature == sig.as_slice()) {
            plan.slots.push(Slot::Stored(i));
            continue;
        }
        if old.is_some() {
            plan.changed.push(t.path.clone());
        } else {
            plan.added.push(t.path.clone());
        }
        let origin = match old {
            None if trust && !moved_from.is_empty() => content(&sig).and_then(|c| moved_from.get(c)).copied(),
            _ => None,
        };
        if let Some(o) = origin {
            plan.slots.push(Slot::Moved(plan.moved.len()));
            plan.moved.push(Upsert {
                path: key(&t),
                row: moved_row(stored[o].row, &t)?,
                signature: sig,
                class: stored[o].class.map(<[u8]>::to_vec),
            });
            continue;
        }
        plan.slots.push(Slot::Read(plan.to_read.len()));
        plan.to_read.push((t, Some(sig)));
    }
    (plan.gone, plan.hidden) = (gone, hidden);
    Ok(plan)
}

/// Freshly read rows, encoded for the index.
#[derive(Debug, Default)]
pub struct Fresh {
    /// Each row's encoding.
    pub rows: Vec<Vec<u8>>,
    /// Each row's classification id (None for a failed row).
    pub class_ids: Vec<Option<ClassId>>,
    /// Each distinct classification of these rows, once: its id and its blob.
    pub classes: Vec<(ClassId, Vec<u8>)>,
}

/// Encodes `rows` for the index, in parallel. Rows that share their modules (a classification the memo
/// remembered, see `scan::memo`) share their classification; so do classifications of the same fields and module
/// buffers, which a scan builds wherever its memo missed a header it had seen (most of a fleet's: encoding and
/// hashing each was most of an index's first scan). Each such group is encoded, hashed and compressed once.
pub fn encode_rows(rows: &[Result<AdapterResult, Error>], threads: Option<usize>) -> Fresh {
    let kinds = kinds();
    let mut first: FxHashMap<*const Modules, usize> = FxHashMap::default();
    let mut shared: Vec<&Classification> = Vec::new();
    let row_shared: Vec<Option<usize>> = rows
        .iter()
        .map(|r| {
            r.as_ref().ok().map(|a| {
                *first.entry(Arc::as_ptr(&a.class.modules)).or_insert_with(|| {
                    shared.push(&a.class);
                    shared.len() - 1
                })
            })
        })
        .collect();
    with_pool(threads, || {
        let heads: Vec<Vec<u8>> = shared
            .par_iter()
            .map(|c| {
                let mut head = Vec::new();
                encode_head(c, &mut head);
                head
            })
            .collect();
        // Each classification's representative: the first equal one (same head bytes and module buffers),
        // looked for among those of the same head and sketch, each such group on its own.
        let mut groups: FxHashMap<(&[u8], [usize; 6]), Vec<usize>> = FxHashMap::default();
        for (i, c) in shared.iter().enumerate() {
            groups.entry((&heads[i], c.modules.sketch())).or_default().push(i);
        }
        let groups: Vec<Vec<usize>> = groups.into_values().collect();
        let mut of = vec![0; shared.len()];
        let shared = &shared;
        let found: Vec<(usize, usize)> = groups
            .par_iter()
            .flat_map_iter(|members| {
                let mut reps: Vec<usize> = Vec::new();
                members.iter().map(move |&i| {
                    let same = reps
                        .iter()
                        .find(|&&r| shared[r].modules.same_buffers(&shared[i].modules));
                    let rep = same.copied().unwrap_or_else(|| {
                        reps.push(i);
                        i
                    });
                    (i, rep)
                })
            })
            .collect();
        for &(i, rep) in &found {
            of[i] = rep;
        }
        let reps: Vec<usize> = (0..shared.len()).filter(|&i| of[i] == i).collect();
        let blobs: Vec<(usize, (ClassId, Vec<u8>))> =
            reps.par_iter().map(|&i| (i, class_blob(shared[i], &kinds))).collect();
        let mut ids: FxHashMap<usize, ClassId> = FxHashMap::default();
        let mut seen: FxHashSet<ClassId> = FxHashSet::default();
        let mut classes = Vec::new();
        for (i, (id, blob)) in blobs {
            ids.insert(i, id);
            if seen.insert(id) {
                classes.push((id, blob));
            }
        }
        Fresh {
            rows: rows.par_iter().map(encode_row).collect(),
            class_ids: row_shared.iter().map(|s| s.map(|i| ids[&of[i]])).collect(),
            classes,
        }
    })
}

/// The rows of a rescan in walk order: stored and moved rows decoded (each classification once, from
/// `bodies`, the blobs by id; its modules shared by every row that names it), `fresh` (the rows read,
/// in `to_read` order) in their places. In parallel.
pub fn assemble(
    plan: Plan,
    stored: &[Stored<'_>],
    fresh: Vec<Result<AdapterResult, Error>>,
    bodies: &FxHashMap<&[u8], &[u8]>,
    threads: Option<usize>,
) -> Result<Vec<Result<AdapterResult, Error>>, String> {
    let reused = |slot: &Slot| -> Option<(&[u8], Option<&[u8]>)> {
        match slot {
            Slot::Stored(i) => Some((stored[*i].row, stored[*i].class)),
            Slot::Moved(i) => Some((&plan.moved[*i].row, plan.moved[*i].class.as_deref())),
            _ => None,
        }
    };
    with_pool(threads, || {
        let mut ids: Vec<&[u8]> = plan.slots.iter().filter_map(|s| reused(s)?.1).collect();
        ids.sort_unstable();
        ids.dedup();
        let classes: FxHashMap<&[u8], Arc<Classification>> = ids
            .par_iter()
            .map(|id| {
                let body = bodies.get(id).ok_or_else(|| bad("classification id"))?;
                Ok((*id, Arc::new(decode_class_blob(body)?)))
            })
            .collect::<Result<_, String>>()?;
        let decoded: Vec<Option<Result<AdapterResult, Error>>> = plan
            .slots
            .par_iter()
            .with_min_len(64)
            .map(|slot| {
                let Some((row, id)) = reused(slot) else {
                    return Ok(None);
                };
                decode_row(row, || {
                    let id = id.ok_or_else(|| bad("classification id"))?;
                    classes.get(id).cloned().ok_or_else(|| bad("classification id"))
                })
                .map(Some)
            })
            .collect::<Result<_, String>>()?;
        let mut fresh = fresh.into_iter();
        let mut failed = plan.slots.into_iter();
        decoded
            .into_iter()
            .map(|d| match (d, failed.next()) {
                (Some(row), _) => Ok(row),
                (None, Some(Slot::Failed(e))) => Ok(Err(e)),
                (None, _) => fresh.next().ok_or_else(|| bad("read rows")),
            })
            .collect()
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::classify::ModuleInfo;

    fn class() -> Classification {
        class_with("q_proj")
    }

    /// `class()`, but for the name of its sixth module's leaf (the other modules' names are the same).
    fn class_with(leaf: &str) -> Classification {
        let mut modules = Modules::default();
        for (i, kind) in kinds().into_iter().enumerate() {
            let key = format!("base_model.model.layers.{i}.{}", if i == 5 { leaf } else { "q_proj" });
            let (a, b) = (format!("{key}.lora_A.weight"), format!("{key}.lora_B.weight"));
            modules.push(&ModuleInfo {
                key: &key,
                name: &key[17..],
                leaf: &key[key.len() - 6..],
                kind,
                layer: Some(i as u32),
                expert: (i % 2 == 0).then_some(3),
                num_experts: Some(8),
                rank: Some(16),
                in_features: Some(64),
                out_features: None,
                dtype: Dtype::ALL.get(i).copied(),
                a_key: Some(&a),
                b_key: (i % 3 != 0).then_some(b.as_str()),
                a_shape: Some(&[16, 64]),
                b_shape: Some(&[2, 64, 16]),
                alpha: Some(0.1 * i as f64),
                alpha_key: Some("é.alpha"),
                bias_key: None,
                magnitude_key: Some("m"),
                extra_keys: vec!["x", "ÿ"],
                config_rank: Some(4),
                use_rslora: i % 2 == 1,
            });
        }
        Classification {
            format: Format::Kohya,
            peft_type: Some("LORA".into()),
            num_tensors: 28,
            dtypes: Dtype::ALL.to_vec(),
            layers: vec![0, 1, 13],
            base_model: None,
            target_modules: vec!["q_proj".into(), "ü".into()],
            rank: 16,
            moe_layout: MoeLayout::Mixed,
            num_experts: 8,
            flags: 0b1011,
            variants: Variant::ALL.to_vec(),
            full_weight_tensors: vec!["embed".into()],
            problems: ProblemCode::ALL
                .iter()
                .map(|&code| Problem {
                    code,
                    message: "why".into(),
                    tensor: Some("t".into()),
                })
                .collect(),
            modules: Arc::new(modules),
            duplicate_tensor: None,
        }
    }

    fn same(a: &Classification, b: &Classification) {
        assert_eq!(format!("{a:?}"), format!("{b:?}"));
        assert_eq!(*a.modules, *b.modules);
    }

    #[test]
    fn a_classification_reads_back_as_written_every_kind_dtype_and_code_included() {
        let c = class();
        let (id, blob) = class_blob(&c, &kinds());
        let back = decode_class_blob(&blob).unwrap();
        same(&back, &c);
        assert_eq!(class_blob(&back, &kinds()).0, id);
    }

    #[test]
    fn equal_classifications_share_one_id_and_blob_however_their_modules_are_held() {
        let row = |class: Classification| {
            Ok(AdapterResult {
                target: target("/a"),
                config_json: None,
                metadata: None,
                header_size: 1,
                file_size: 2,
                class: class.into(),
                content_hash: None,
            })
        };
        let mut rank = class();
        rank.rank = 99;
        let shared = class();
        let rows = vec![
            row(shared.clone()),
            row(class()), // equal, with modules of its own (as where the memo missed)
            row(shared),  // the same modules
            row(rank),
            row(class_with("k_proj")), // the same lengths and ends of text, another module name
            Err(Error::adapter("/b", crate::codes::AdapterErrorCode::MissingWeights, "")),
        ];
        let fresh = encode_rows(&rows, Some(2));
        let ids = &fresh.class_ids;
        assert!(ids[0] == ids[1] && ids[1] == ids[2] && ids[5].is_none());
        assert!(ids[3] != ids[0] && ids[4] != ids[0] && ids[3] != ids[4]);
        assert_eq!(fresh.classes.len(), 3);
        for (id, blob) in &fresh.classes {
            let back = decode_class_blob(blob).unwrap();
            let i = ids.iter().position(|x| x.as_ref() == Some(id)).unwrap();
            same(&back, &rows[i].as_ref().unwrap().class);
        }
        assert_eq!(fresh.rows.len(), rows.len());
    }

    #[test]
    fn damaged_bytes_are_an_error_never_a_panic() {
        let kinds = kinds();
        let mut raw = Vec::new();
        encode_class(&class(), &kinds, &mut raw);
        for cut in (0..raw.len()).step_by(7) {
            assert!(decode_class(raw[..cut].to_vec(), &kinds).is_err(), "cut at {cut}");
        }
        // Every byte changed in turn: an error or a classification whose modules read without a panic.
        for i in 0..raw.len() {
            let mut bad = raw.clone();
            bad[i] ^= 0x5a;
            if let Ok(c) = decode_class(bad, &kinds) {
                let _ = format!("{:?}", c.modules);
            }
        }
        assert!(decode_class_blob(b"{not json").is_err());
        let row = encode_row(&Err(Error::adapter(
            "/x",
            crate::codes::AdapterErrorCode::MissingWeights,
            "m",
        )));
        for cut in 0..row.len() {
            assert!(decode_row(&row[..cut], || Ok(class().into())).is_err());
        }
    }

    fn target(dir: &str) -> Target {
        Target {
            path: PathBuf::from(dir),
            weights: PathBuf::from(format!("{dir}/adapter_model.safetensors")),
            config: Some(PathBuf::from(format!("{dir}/adapter_config.json"))),
        }
    }

    #[test]
    fn rows_read_back_and_move() {
        let odd = PathBuf::from(OsStr::from_bytes(b"/f/\xff"));
        let row = AdapterResult {
            target: Target {
                config: None,
                ..target("/f/a")
            },
            config_json: Some("{\"r\": 4}".into()),
            metadata: Some(vec![("k".into(), "v".into())]),
            header_size: 10,
            file_size: 20,
            class: class().into(),
            content_hash: Some("ab".into()),
        };
        let bytes = encode_row(&Ok(row.clone()));
        let back = decode_row(&bytes, || Ok(class().into())).unwrap().unwrap();
        assert_eq!(format!("{back:?}"), format!("{row:?}"));
        let to = Target {
            path: odd.clone(),
            weights: odd.join("w"),
            config: None,
        };
        let moved = decode_row(&moved_row(&bytes, &to).unwrap(), || Ok(class().into()))
            .unwrap()
            .unwrap();
        assert_eq!(format!("{:?}", moved.target), format!("{to:?}"));
        assert_eq!((moved.header_size, moved.metadata), (10, row.metadata));
        let e = entry(b"sig", Some(b"id"), &bytes);
        let s = Stored::parse(b"/p", &e);
        assert_eq!(
            (s.signature, s.class, s.row),
            (&b"sig"[..], Some(&b"id"[..]), bytes.as_slice())
        );
        let e = entry(b"", None, b"r");
        let s = Stored::parse(b"/p", &e);
        assert_eq!((s.signature, s.class, s.row), (&b""[..], None, &b"r"[..]));
        assert!(Stored::parse(b"/p", b"\xff").signature.is_empty());
        let err = Error::adapter(odd.clone(), crate::codes::AdapterErrorCode::MissingWeights, "gone");
        let back = decode_row(&encode_row(&Err(err)), || unreachable!())
            .unwrap()
            .unwrap_err();
        assert_eq!(
            (back.path(), back.code(), back.detail()),
            (&odd, "missing_weights", "gone".into())
        );
    }

    fn local(size: u64, ino: u64, ctime: i64) -> FileStat {
        FileStat::Local {
            size,
            mtime: (5, 6),
            ino,
            dev: 1,
            ctime: (ctime, 0),
        }
    }

    #[test]
    fn a_signature_tells_changes_and_its_content_tells_moves() {
        let (t, u) = (target("/f/a"), target("/f/b"));
        let sig = |t: &Target, w: &FileStat| signature(t, w, Some(&local(1, 2, 3)), b"ctx");
        let a = sig(&t, &local(10, 7, 8));
        assert_eq!(a, sig(&t, &local(10, 7, 8)));
        for other in [
            sig(&t, &local(11, 7, 8)),
            sig(&t, &local(10, 7, 9)),
            sig(&u, &local(10, 7, 8)),
        ] {
            assert_ne!(a, other);
        }
        assert_ne!(a, signature(&t, &local(10, 7, 8), Some(&local(1, 2, 3)), b"other"));
        // A rename keeps the content (paths and ctimes are not in it); another inode does not.
        assert_eq!(content(&a), content(&sig(&u, &local(10, 7, 9))));
        assert_ne!(content(&a), content(&sig(&u, &local(10, 8, 8))));
        assert!(content(&signature(&t, &FileStat::Modified(10, 1), None, b"")).is_none());
        assert!(content(&signature(&t, &FileStat::Etag(10, "e".into()), None, b"")).is_some());
        assert!(content(b"").is_none());
    }

    #[test]
    fn a_plan_keeps_unchanged_rows_moves_renamed_ones_and_reads_the_rest() {
        let stat = |ino| local(1, ino, 0);
        let sig = |t: &Target, ino| signature(t, &stat(ino), None, b"");
        let (a, b, c) = (target("/r/a"), target("/r/b"), target("/r/c"));
        let rows: Vec<Vec<u8>> = [&a, &b, &c]
            .iter()
            .map(|t| {
                encode_row(&Ok(AdapterResult {
                    target: (*t).clone(),
                    config_json: None,
                    metadata: None,
                    header_size: 1,
                    file_size: 2,
                    class: class().into(),
                    content_hash: None,
                }))
            })
            .collect();
        let sigs = [sig(&a, 1), sig(&b, 2), sig(&c, 3)];
        let other = b"/elsewhere/x".to_vec();
        let mut stored: Vec<Stored<'_>> = [&a, &b, &c]
            .iter()
            .enumerate()
            .map(|(i, t)| Stored {
                path: t.path.as_os_str().as_bytes(),
                signature: &sigs[i],
                row: &rows[i],
                class: Some(b"id"),
                entry: b"",
            })
            .collect();
        stored.push(Stored {
            path: &other,
            signature: b"",
            row: &rows[0],
            class: None,
            entry: b"",
        });
        let moved_to = target("/r/moved");
        let found = vec![
            (Ok(a.clone()), Sig::Known(sig(&a, 1))),               // unchanged
            (Ok(b.clone()), Sig::Known(sig(&b, 9))),               // changed
            (Ok(moved_to.clone()), Sig::Known(sig(&moved_to, 3))), // c, moved
            (
                Err(Error::adapter(
                    "/r/x",
                    crate::codes::AdapterErrorCode::MissingWeights,
                    "",
                )),
                Sig::Unknown,
            ),
            (Ok(target("/r/new")), Sig::Unknown),
        ];
        let plan = plan(found, &stored, &[PathBuf::from("/r/")], true).unwrap();
        assert!(matches!(
            plan.slots.as_slice(),
            [
                Slot::Stored(0),
                Slot::Read(0),
                Slot::Moved(0),
                Slot::Failed(_),
                Slot::Read(1)
            ]
        ));
        assert_eq!(plan.changed, std::slice::from_ref(&b.path));
        assert_eq!(plan.added, [moved_to.path.clone(), PathBuf::from("/r/new")]);
        assert_eq!(plan.removed, std::slice::from_ref(&c.path)); // not /elsewhere: not under the root
        assert_eq!(plan.to_read[1].1.as_deref(), Some(&[][..]));
        assert_eq!((&plan.gone[..], &plan.hidden[..]), (&[2][..], &[][..])); // c's row, moved: /elsewhere is not under the root
        let moved = decode_row(&plan.moved[0].row, || Ok(class().into())).unwrap().unwrap();
        assert_eq!(format!("{:?}", moved.target), format!("{moved_to:?}"));
        let id: &[u8] = b"id";
        let (_, blob) = class_blob(&class(), &kinds());
        let bodies: FxHashMap<&[u8], &[u8]> = [(id, blob.as_slice())].into_iter().collect();
        let read = (0..2)
            .map(|_| {
                Err(Error::adapter(
                    "/r/b",
                    crate::codes::AdapterErrorCode::MissingWeights,
                    "",
                ))
            })
            .collect();
        let rows = assemble(plan, &stored, read, &bodies, Some(2)).unwrap();
        let paths: Vec<&Path> = rows
            .iter()
            .map(|r| r.as_ref().map_or_else(|e| e.path().as_path(), |a| &a.target.path))
            .collect();
        assert_eq!(
            paths,
            [
                a.path.as_path(),
                Path::new("/r/b"),
                &moved_to.path,
                Path::new("/r/x"),
                Path::new("/r/b")
            ]
        );
        // Without trust, everything with weights is read.
        let again = super::plan(vec![(Ok(a.clone()), Sig::Known(sig(&a, 1)))], &stored, &[], false).unwrap();
        assert!(matches!(again.slots.as_slice(), [Slot::Read(0)]));
        assert!(under(b"/r/a", b"/r") && under(b"/r", b"/r/") && !under(b"/ra", b"/r"));
    }
}
