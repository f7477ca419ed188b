//! [`Modules`] as bytes, for the index (`crate::report::index`): its buffers as they are (the text whole, the records
//! field by field), so that loading a stored classification is a copy and a pass over small numbers, not a
//! rebuild module by module. Every span is checked on the way in (within its buffer, on character
//! boundaries), so stored bytes that decode at all give records that never panic when read.
//!
//! A record's fields are varints, a field that is 0 left out (a mask says which are there), and each span's
//! start is the difference from the same span of the record before: a record takes about 35 bytes, not the
//! 150 of its fields laid out whole, which is less to compress, store, decompress and read.

use super::{Modules, Record, Span};
use crate::classify::ModuleKind;
use crate::header::Dtype;
use crate::report::index::{bad, put_u32};

/// Every `Record::present` bit.
const ALL_PRESENT: u16 = (1 << 15) - 1;
/// `Record::dtype` None.
const NO_DTYPE: u64 = 0xff;
/// A record's fields, as `fields` lists them.
const FIELDS: usize = 32;
/// Spans in a record, as `spans` lists them.
const SPANS: usize = 11;

fn put_varint(out: &mut Vec<u8>, mut v: u64) {
    while v >= 0x80 {
        out.push(v as u8 | 0x80);
        v >>= 7;
    }
    out.push(v as u8);
}

/// The varint at `b[*at..]`; None past the end or past 64 bits.
#[inline(always)]
fn varint(b: &[u8], at: &mut usize) -> Option<u64> {
    let first = *b.get(*at)?;
    *at += 1;
    if first < 0x80 {
        return Some(u64::from(first)); // most fields: one byte
    }
    let mut v = u64::from(first & 0x7f);
    for shift in (7..64).step_by(7) {
        let byte = *b.get(*at)?;
        *at += 1;
        v |= u64::from(byte & 0x7f) << shift;
        if byte < 0x80 {
            return Some(v);
        }
    }
    None
}

/// A count at `b[*at..]`. Each item takes a byte at least: a damaged count cannot reserve more than the bytes
/// there are.
fn count(b: &[u8], at: &mut usize) -> Result<usize, String> {
    let n = varint(b, at).and_then(|n| usize::try_from(n).ok());
    n.filter(|&n| n <= b.len()).ok_or_else(|| bad("count"))
}

fn zigzag(d: i64) -> u64 {
    ((d << 1) ^ (d >> 63)) as u64
}

fn unzigzag(v: u64) -> i64 {
    (v >> 1) as i64 ^ -((v & 1) as i64)
}

fn spans(r: &Record) -> [Span; SPANS] {
    [
        r.key,
        r.name,
        r.leaf,
        r.a_key,
        r.b_key,
        r.alpha_key,
        r.bias_key,
        r.magnitude_key,
        r.a_shape,
        r.b_shape,
        r.extra_keys,
    ]
}

/// Spans as deltas of their starts from `prev` (updated) and their lengths.
fn put_spans(fields: &mut [u64], spans: &[Span], prev: &mut [u32]) {
    for (k, s) in spans.iter().enumerate() {
        fields[2 * k] = zigzag(i64::from(s.start) - i64::from(prev[k]));
        fields[2 * k + 1] = u64::from(s.len);
        prev[k] = s.start;
    }
}

fn get_span(fields: &[u64], k: usize, prev: &mut [u32]) -> Result<Span, String> {
    let start = i64::from(prev[k]) + unzigzag(fields[2 * k]);
    let start = u32::try_from(start).map_err(|_| bad("span"))?;
    let len = u32::try_from(fields[2 * k + 1]).map_err(|_| bad("span"))?;
    prev[k] = start;
    Ok(Span { start, len })
}

/// Writes `fields` as a mask of those that are not 0, then those as varints.
fn put_fields(out: &mut Vec<u8>, fields: &[u64; FIELDS]) {
    let mask = fields
        .iter()
        .enumerate()
        .fold(0u32, |m, (i, &f)| m | (u32::from(f != 0) << i));
    put_varint(out, u64::from(mask));
    for &f in fields.iter().filter(|&&f| f != 0) {
        put_varint(out, f);
    }
}

fn get_fields(b: &[u8], at: &mut usize, fields: &mut [u64; FIELDS]) -> Result<(), String> {
    let mut mask = varint(b, at).ok_or_else(|| bad("record"))?;
    if mask >> FIELDS != 0 {
        return Err(bad("record"));
    }
    *fields = [0; FIELDS];
    while mask != 0 {
        fields[mask.trailing_zeros() as usize] = varint(b, at).ok_or_else(|| bad("record"))?;
        mask &= mask - 1;
    }
    Ok(())
}

impl Modules {
    /// Appends the modules' text to `out`: the bytes of a `String`, which `decode` takes back as they are.
    pub(crate) fn encode_text(&self, out: &mut Vec<u8>) {
        out.extend_from_slice(self.text.as_bytes());
    }

    /// Appends the rest of the modules' bytes to `out`, length first (read back by [`Modules::decode`]).
    pub(crate) fn encode_body(&self, out: &mut Vec<u8>, kinds: &[ModuleKind]) {
        let mut body = Vec::with_capacity(4 * self.dims.len() + 40 * self.records.len());
        put_varint(&mut body, self.dims.len() as u64);
        for &d in &self.dims {
            put_varint(&mut body, d);
        }
        put_varint(&mut body, self.extra.len() as u64);
        let mut prev = [0u32; SPANS];
        let mut fields = [0u64; FIELDS];
        for s in &self.extra {
            put_spans(&mut fields, std::slice::from_ref(s), &mut prev);
            put_varint(&mut body, fields[0]);
            put_varint(&mut body, fields[1]);
        }
        put_varint(&mut body, self.records.len() as u64);
        let mut prev = [0u32; SPANS];
        for r in &self.records {
            fields[..5].copy_from_slice(&[r.num_experts, r.rank, r.in_features, r.out_features, r.config_rank]);
            // A round alpha has its low bytes 0: swapped, they are the varint's high ones, left out.
            fields[5] = r.alpha.to_bits().swap_bytes();
            fields[6] = u64::from(r.layer);
            fields[7] = u64::from(r.expert);
            put_spans(&mut fields[8..8 + 2 * SPANS], &spans(r), &mut prev);
            fields[30] = u64::from(r.present);
            let kind = kinds.iter().position(|k| *k == r.kind).unwrap_or(0) as u64;
            let dtype = r.dtype.map_or(NO_DTYPE, |d| d as u64);
            fields[31] = kind | dtype << 8 | u64::from(r.use_rslora) << 16;
            put_fields(&mut body, &fields);
        }
        put_u32(out, body.len() as u32);
        out.extend_from_slice(&body);
    }

    /// The modules whose text `encode_text` and rest `encode_body` wrote (`b`, its length read off; the same
    /// `kinds`).
    pub(crate) fn decode(text: String, b: &[u8], kinds: &[ModuleKind]) -> Result<Modules, String> {
        let at = &mut 0;
        let n = count(b, at)?;
        let mut dims = Vec::with_capacity(n);
        for _ in 0..n {
            dims.push(varint(b, at).ok_or_else(|| bad("dims"))?);
        }
        let text_span = |s: Span| match text.get(s.start as usize..s.start as usize + s.len as usize) {
            Some(_) => Ok(s),
            None => Err(bad("text span")),
        };
        let within = |s: Span, len: usize, what: &str| match (s.start as usize).checked_add(s.len as usize) {
            Some(end) if end <= len => Ok(s),
            _ => Err(bad(what)),
        };
        let n = count(b, at)?;
        let mut extra = Vec::with_capacity(n);
        let mut prev = [0u32; SPANS];
        let mut fields = [0u64; FIELDS];
        for _ in 0..n {
            fields[0] = varint(b, at).ok_or_else(|| bad("extra keys"))?;
            fields[1] = varint(b, at).ok_or_else(|| bad("extra keys"))?;
            extra.push(text_span(get_span(&fields, 0, &mut prev)?)?);
        }
        let n = count(b, at)?;
        let mut records = Vec::with_capacity(n);
        let mut prev = [0u32; SPANS];
        for _ in 0..n {
            get_fields(b, at, &mut fields)?;
            let small = |v: u64| u32::try_from(v).map_err(|_| bad("module record"));
            let spans = &fields[8..8 + 2 * SPANS];
            let mut span = |k: usize| get_span(spans, k, &mut prev);
            let (key, name, leaf, a_key, b_key) = (span(0)?, span(1)?, span(2)?, span(3)?, span(4)?);
            let (alpha_key, bias_key, magnitude_key) = (span(5)?, span(6)?, span(7)?);
            let (a_shape, b_shape, extra_keys) = (span(8)?, span(9)?, span(10)?);
            let present = u16::try_from(fields[30]).ok().filter(|p| p & !ALL_PRESENT == 0);
            let (kind, dtype, use_rslora) = (fields[31] & 0xff, fields[31] >> 8 & 0xff, fields[31] >> 16);
            if use_rslora > 1 {
                return Err(bad("module record"));
            }
            records.push(Record {
                num_experts: fields[0],
                rank: fields[1],
                in_features: fields[2],
                out_features: fields[3],
                config_rank: fields[4],
                alpha: f64::from_bits(fields[5].swap_bytes()),
                layer: small(fields[6])?,
                expert: small(fields[7])?,
                key: text_span(key)?,
                name: text_span(name)?,
                leaf: text_span(leaf)?,
                a_key: text_span(a_key)?,
                b_key: text_span(b_key)?,
                alpha_key: text_span(alpha_key)?,
                bias_key: text_span(bias_key)?,
                magnitude_key: text_span(magnitude_key)?,
                a_shape: within(a_shape, dims.len(), "shape")?,
                b_shape: within(b_shape, dims.len(), "shape")?,
                extra_keys: within(extra_keys, extra.len(), "extra keys")?,
                present: present.ok_or_else(|| bad("module record"))?,
                kind: *kinds.get(kind as usize).ok_or_else(|| bad("module kind"))?,
                dtype: match dtype {
                    NO_DTYPE => None,
                    d => Some(*Dtype::ALL.get(d as usize).ok_or_else(|| bad("dtype"))?),
                },
                use_rslora: use_rslora == 1,
            });
        }
        if *at != b.len() {
            return Err(bad("modules"));
        }
        Ok(Modules {
            text,
            dims,
            extra,
            records,
        })
    }

    /// A cheap key for modules that may be equal: their buffers' lengths and the ends of their text.
    pub(crate) fn sketch(&self) -> [usize; 6] {
        let t = self.text.as_bytes();
        let word = |b: &[u8]| b.iter().fold(0usize, |h, &x| h.rotate_left(5) ^ x as usize);
        let (head, tail) = (&t[..t.len().min(32)], &t[t.len().saturating_sub(32)..]);
        [
            t.len(),
            self.dims.len(),
            self.extra.len(),
            self.records.len(),
            word(head),
            word(tail),
        ]
    }

    /// Whether both hold the same buffers, byte for byte (then they hold the same modules, and encode alike).
    /// The modules the scan builds from one header by the same steps do; a compare costs far less than an
    /// encoding and its hash.
    pub(crate) fn same_buffers(&self, o: &Modules) -> bool {
        let same_record = |a: &Record, b: &Record| {
            (
                a.num_experts,
                a.rank,
                a.in_features,
                a.out_features,
                a.config_rank,
                a.alpha.to_bits(),
            ) == (
                b.num_experts,
                b.rank,
                b.in_features,
                b.out_features,
                b.config_rank,
                b.alpha.to_bits(),
            ) && (a.layer, a.expert, a.present, a.kind, a.dtype, a.use_rslora)
                == (b.layer, b.expert, b.present, b.kind, b.dtype, b.use_rslora)
                && spans(a) == spans(b)
        };
        self.text == o.text
            && self.dims == o.dims
            && self.extra == o.extra
            && self.records.len() == o.records.len()
            && self.records.iter().zip(&o.records).all(|(a, b)| same_record(a, b))
    }
}
