//! The persistent index's rows, grouped in chunks: one SQLite row holds up to `per_chunk` adapter rows, so
//! SQLite and Python handle one value per chunk, not one per adapter (written one by one, the 20,000 rows of
//! small adapters took twice as long as scanning them). A chunk is [`CHUNK_TAG`], a count, then each row's
//! path and entry ([`index::entry`]), snappy-compressed: rows repeat their paths and the scan's context, so a
//! chunk is about a fifth of their bytes (written and fetched at that size). A rescan rewrites only the chunks
//! that hold a changed or removed row, and puts new rows in the last chunk while it has room, then in new ones.
//!
//! Two writers may both add an adapter: its path is then in two chunks. The later chunk's row is the one
//! read, and the first rewrite of the other chunk drops the earlier one.

use std::ops::Range;

use rayon::prelude::*;
use rustc_hash::{FxHashMap, FxHashSet};

use super::index::{self, put_u32, Reader, Stored, VERSION};

const CHUNK_TAG: [u8; 4] = [b'L', b'F', b'k', VERSION];

/// The rows of every stored chunk, in chunk order.
#[derive(Debug, Default)]
pub struct Rows<'a> {
    /// Every row, chunk after chunk.
    pub rows: Vec<Stored<'a>>,
    /// Each chunk's rows in `rows` (empty for a chunk that does not parse).
    pub ranges: Vec<Range<usize>>,
    /// The chunks that do not parse: their rows are lost (their adapters are read again) and they are dropped.
    pub damaged: Vec<usize>,
}

/// A chunk's records: each row's path and entry.
type Records<'a> = Vec<(&'a [u8], &'a [u8])>;

fn parse_chunk(body: &[u8]) -> Result<Records<'_>, String> {
    let mut r = Reader::new(body);
    r.tag(CHUNK_TAG, "chunk tag")?;
    let records = r.list(|r| Ok((r.bytes()?, r.bytes()?)))?;
    r.end()?;
    Ok(records)
}

/// A stored chunk's bytes, decompressed: empty (so damaged, see [`rows`]) when the blob does not decompress.
pub fn unpack(blob: &[u8]) -> Vec<u8> {
    index::decompress(blob).unwrap_or_default()
}

/// The rows of `chunks` (their bodies, [`unpack`]ed, in id order). A body that does not parse has no rows
/// and is damaged.
pub fn rows<'a>(chunks: &[&'a [u8]]) -> Rows<'a> {
    let mut out = Rows::default();
    for (c, body) in chunks.iter().enumerate() {
        let start = out.rows.len();
        match parse_chunk(body) {
            Ok(records) => out
                .rows
                .extend(records.into_iter().map(|(path, entry)| Stored::parse(path, entry))),
            Err(_) => out.damaged.push(c),
        }
        out.ranges.push(start..out.rows.len());
    }
    out
}

/// The distinct adapter paths of stored chunks (as blobs), sorted.
pub fn paths(blobs: &[&[u8]]) -> Vec<Vec<u8>> {
    let bodies: Vec<Vec<u8>> = blobs.iter().map(|b| unpack(b)).collect();
    let bodies: Vec<&[u8]> = bodies.iter().map(Vec::as_slice).collect();
    let mut paths: Vec<Vec<u8>> = rows(&bodies).rows.iter().map(|s| s.path.to_vec()).collect();
    paths.sort_unstable();
    paths.dedup();
    paths
}

/// A row to write: its path, classification id and entry.
#[derive(Debug, Clone)]
pub struct NewRow {
    /// The adapter's path.
    pub path: Vec<u8>,
    /// Its classification's id (None for a failed row).
    pub class: Option<Vec<u8>>,
    /// Its [`index::entry`].
    pub entry: Vec<u8>,
}

/// One chunk to write, in a transaction of its own.
#[derive(Debug)]
pub struct ChunkWrite<'n> {
    /// The stored chunk it replaces (None: a new chunk).
    pub id: Option<i64>,
    /// Its body, compressed (None: the chunk is deleted, it holds no row any more).
    pub body: Option<Vec<u8>>,
    /// The distinct classification ids its rows name, concatenated (what a sweep of unnamed ones reads).
    pub classes: Vec<u8>,
    /// The classification ids of its new rows, each once: those to write with it.
    pub new_classes: Vec<&'n [u8]>,
}

/// One record of a chunk being written: a stored row kept, or a new row.
#[derive(Clone, Copy)]
enum Record<'s, 'n> {
    Kept(&'s Stored<'s>),
    New(&'n NewRow),
}

impl Record<'_, '_> {
    fn path(&self) -> &[u8] {
        match self {
            Record::Kept(s) => s.path,
            Record::New(n) => &n.path,
        }
    }
    fn entry(&self) -> &[u8] {
        match self {
            Record::Kept(s) => s.entry,
            Record::New(n) => &n.entry,
        }
    }
    fn class(&self) -> Option<&[u8]> {
        match self {
            Record::Kept(s) => s.class,
            Record::New(n) => n.class.as_deref(),
        }
    }
}

fn encode<'n>(id: Option<i64>, records: &[Record<'_, 'n>]) -> ChunkWrite<'n> {
    let size: usize = records.iter().map(|r| r.path().len() + r.entry().len() + 8).sum();
    let mut body = Vec::with_capacity(size + 8);
    body.extend_from_slice(&CHUNK_TAG);
    put_u32(&mut body, records.len() as u32);
    for r in records {
        index::put_bytes(&mut body, r.path());
        index::put_bytes(&mut body, r.entry());
    }
    let mut named: Vec<&[u8]> = records.iter().filter_map(Record::class).collect();
    named.sort_unstable();
    named.dedup();
    let mut new_classes: Vec<&'n [u8]> = records
        .iter()
        .filter_map(|r| match r {
            Record::New(n) => n.class.as_deref(),
            Record::Kept(_) => None,
        })
        .collect();
    new_classes.sort_unstable();
    new_classes.dedup();
    ChunkWrite {
        id,
        body: Some(body),
        classes: named.concat(),
        new_classes,
    }
}

/// The chunks to write for a rescan: `stored` (the chunks `ids`, as [`rows`] read them) without the rows
/// `gone` (adapters no longer there) and `hidden` (another chunk's later copy of the same path), with the `new`
/// rows, `per_chunk` rows a chunk. Compressed in parallel (call it in the pool the scan runs in).
///
/// A chunk is rewritten when it holds a gone row, does not parse, or half its rows or more are dead (hidden, or
/// superseded by a new row); a new row of a path stored in such a chunk takes its old row's place. Any other new
/// row is appended: to the last chunk while it has room (which rewrites it), then to new chunks; a changed row's
/// old copy stays where it was, hidden by the new one. So a rescan that changes one row in every chunk (every
/// hundredth adapter of a fleet) writes the changed rows once, not every chunk again, and a chunk is compacted
/// once its dead rows are half of it.
pub fn writes<'n>(
    ids: &[i64],
    stored: &Rows<'_>,
    gone: &[usize],
    hidden: &[usize],
    new: &'n [NewRow],
    per_chunk: usize,
) -> Vec<ChunkWrite<'n>> {
    let per_chunk = per_chunk.max(1);
    let chunks = stored.ranges.len();
    let gone: FxHashSet<usize> = gone.iter().copied().collect();
    let hidden: FxHashSet<usize> = hidden.iter().copied().collect();
    let mut chunk_of = vec![0; stored.rows.len()];
    for (c, range) in stored.ranges.iter().enumerate() {
        chunk_of[range.clone()].fill(c);
    }
    let live: FxHashMap<&[u8], usize> = stored
        .rows
        .iter()
        .enumerate()
        .filter(|(i, _)| !gone.contains(i) && !hidden.contains(i))
        .map(|(i, s)| (s.path, i))
        .collect();
    // Each new row's stored row of the same path, if any.
    let old: Vec<Option<usize>> = new.iter().map(|n| live.get(n.path.as_slice()).copied()).collect();
    let mut dead = vec![0; chunks];
    for &i in hidden.iter().chain(old.iter().flatten()) {
        dead[chunk_of[i]] += 1;
    }
    let damaged: FxHashSet<usize> = stored.damaged.iter().copied().collect();
    let mut rewrite: Vec<bool> = (0..chunks)
        .map(|c| {
            let range = &stored.ranges[c];
            damaged.contains(&c) || range.clone().any(|i| gone.contains(&i)) || 2 * dead[c] >= range.len().max(1)
        })
        .collect();
    let last = chunks.checked_sub(1);
    if let Some(l) = last {
        // With room, it takes the rows that would be appended, and its own changed rows in place.
        let appends = old.iter().any(|o| o.map_or(true, |i| !rewrite[chunk_of[i]]));
        if stored.ranges[l].len() < per_chunk && appends {
            rewrite[l] = true;
        }
    }
    let mut replaced: FxHashMap<usize, &NewRow> = FxHashMap::default();
    let mut appended: Vec<&NewRow> = Vec::new();
    for (n, o) in new.iter().zip(&old) {
        match o {
            Some(i) if rewrite[chunk_of[*i]] => {
                replaced.insert(*i, n);
            }
            _ => appended.push(n),
        }
    }
    let mut out = Vec::new();
    let mut appended = appended.into_iter();
    for (c, range) in stored.ranges.iter().enumerate() {
        if !rewrite[c] {
            continue;
        }
        let mut records: Vec<Record<'_, 'n>> = range
            .clone()
            .filter(|i| !gone.contains(i) && !hidden.contains(i))
            .map(|i| {
                replaced
                    .get(&i)
                    .map_or(Record::Kept(&stored.rows[i]), |n| Record::New(n))
            })
            .collect();
        if Some(c) == last {
            let room = per_chunk.saturating_sub(records.len());
            records.extend(appended.by_ref().take(room).map(Record::New));
        }
        out.push(if records.is_empty() {
            ChunkWrite {
                id: Some(ids[c]),
                body: None,
                classes: Vec::new(),
                new_classes: Vec::new(),
            }
        } else {
            encode(Some(ids[c]), &records)
        });
    }
    let rest: Vec<Record<'_, 'n>> = appended.map(Record::New).collect();
    out.extend(rest.chunks(per_chunk).map(|records| encode(None, records)));
    out.par_iter_mut()
        .for_each(|w| w.body = w.body.as_deref().map(index::compress));
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn entry(sig: &[u8], class: Option<&[u8]>) -> Vec<u8> {
        index::entry(sig, class, b"row")
    }

    fn new(path: &str, class: &[u8]) -> NewRow {
        NewRow {
            path: path.as_bytes().to_vec(),
            class: Some(class.to_vec()),
            entry: entry(b"new", Some(class)),
        }
    }

    fn chunk(rows: &[(&str, &[u8])]) -> Vec<u8> {
        let rows: Vec<NewRow> = rows.iter().map(|(p, c)| new(p, c)).collect();
        let records: Vec<Record<'_, '_>> = rows.iter().map(Record::New).collect();
        encode(None, &records).body.unwrap()
    }

    #[test]
    fn rows_round_trip_and_damage_is_a_chunk_without_rows() {
        let a = chunk(&[("/a", b"x"), ("/b", b"y")]);
        let b = chunk(&[("/c", b"x")]);
        let cut = &a[..a.len() - 1];
        let read = rows(&[&a, cut, &b, b"\x00"]);
        let found: Vec<&[u8]> = read.rows.iter().map(|s| s.path).collect();
        assert_eq!(found, [&b"/a"[..], b"/b", b"/c"]);
        assert_eq!(read.ranges, [0..2, 2..2, 2..3, 3..3]);
        assert_eq!(read.damaged, [1, 3]);
        assert_eq!(read.rows[1].class, Some(&b"y"[..]));
        let (a, b) = (index::compress(&a), index::compress(&b));
        assert_eq!(
            paths(&[&a, &b, &a, b"\x00"]),
            [b"/a".to_vec(), b"/b".to_vec(), b"/c".to_vec()]
        );
        assert!(unpack(b"\xff\xff\xff\x7f").is_empty()); // claims 256 MiB from 4 bytes
    }

    #[test]
    fn writes_touch_only_the_chunks_that_change() {
        let c0 = chunk(&[("/a", b"x"), ("/b", b"y")]);
        let c1 = chunk(&[("/c", b"x"), ("/d", b"y")]);
        let c2 = chunk(&[("/e", b"z")]);
        let c3 = chunk(&[("/a", b"z")]); // a second writer's copy of /a: hides c0's
        let stored = rows(&[&c0, &c1, &c2, &c3]);
        let fresh = [new("/d", b"w"), new("/f", b"w"), new("/g", b"v"), new("/h", b"v")];
        // /a's hidden copy and /e are dropped, /d is replaced, /f.. are new; c2 (now empty) is the last
        // chunk, with room for one: it takes /f.
        let w = writes(&[10, 11, 12, 13], &stored, &[4], &[0], &fresh, 2);
        let summary: Vec<(Option<i64>, Vec<Vec<u8>>)> = w
            .iter()
            .map(|c| {
                let paths = c.body.as_deref().map_or_else(Vec::new, |b| {
                    rows(&[&unpack(b)]).rows.iter().map(|s| s.path.to_vec()).collect()
                });
                (c.id, paths)
            })
            .collect();
        let p = |s: &[&str]| s.iter().map(|s| s.as_bytes().to_vec()).collect::<Vec<_>>();
        assert_eq!(
            summary,
            [
                (Some(10), p(&["/b"])),
                (Some(11), p(&["/c", "/d"])),
                (Some(12), p(&[])),
                (Some(13), p(&["/a", "/f"])),
                (None, p(&["/g", "/h"])),
            ]
        );
        assert!(w[2].body.is_none());
        assert_eq!(w[1].classes, b"wx"); // sorted
        assert_eq!(w[1].new_classes, [&b"w"[..]]);
        let body = unpack(w[1].body.as_deref().unwrap());
        let replaced = rows(&[&body]);
        assert_eq!(replaced.rows[1].signature, b"new");
        // Nothing changed: nothing written.
        assert!(writes(&[10, 11], &rows(&[&c0, &c1]), &[], &[], &[], 2).is_empty());
    }

    #[test]
    fn a_changed_row_is_appended_until_half_its_chunk_is_dead() {
        let full = chunk(&[("/a", b"x"), ("/b", b"x"), ("/c", b"x"), ("/d", b"x")]);
        let stored = rows(&[&full]);
        let summary = |w: &[ChunkWrite<'_>]| -> Vec<(Option<i64>, Vec<Vec<u8>>)> {
            w.iter()
                .map(|c| {
                    let body = unpack(c.body.as_deref().unwrap());
                    (c.id, rows(&[&body]).rows.iter().map(|s| s.path.to_vec()).collect())
                })
                .collect()
        };
        // One of four changed, and the chunk is full: the new row goes to a new chunk, the old one stays.
        let one = [new("/b", b"y")];
        assert_eq!(
            summary(&writes(&[1], &stored, &[], &[], &one, 4)),
            [(None, vec![b"/b".to_vec()])]
        );
        // Two of four (or one changed and one hidden): the chunk is rewritten, the new rows in place.
        let two = [new("/b", b"y"), new("/c", b"y")];
        let in_place = vec![b"/a".to_vec(), b"/b".to_vec(), b"/c".to_vec(), b"/d".to_vec()];
        assert_eq!(
            summary(&writes(&[1], &stored, &[], &[], &two, 4)),
            [(Some(1), in_place)]
        );
        let compacted = summary(&writes(&[1], &stored, &[], &[0], &one, 4));
        assert_eq!(
            compacted,
            [(Some(1), vec![b"/b".to_vec(), b"/c".to_vec(), b"/d".to_vec()])]
        );
        // With room in the last chunk, an appended row fills it.
        let short = chunk(&[("/a", b"x"), ("/b", b"x"), ("/c", b"x")]);
        let d = [new("/d", b"y")];
        let w = writes(&[1, 2], &rows(&[&full, &short]), &[], &[], &d, 4);
        let tail = [b"/a".to_vec(), b"/b".to_vec(), b"/c".to_vec(), b"/d".to_vec()];
        assert_eq!(summary(&w), [(Some(2), tail.to_vec())]);
    }
}
