//! [`Modules`] as bytes, for the index (`crate::store`): its four buffers as they are, so that loading a
//! stored classification is copies and bound checks, not a rebuild module by module. Every span is checked
//! on the way in (within its buffer, on character boundaries), so stored bytes that decode at all give
//! records that never panic when read.

use super::{Modules, Record, Span};
use crate::classify::ModuleKind;
use crate::header::Dtype;
use crate::store::{bad, put_u16, put_u32, put_u64, put_u8, Reader};

/// Every `Record::present` bit.
const ALL_PRESENT: u16 = (1 << 15) - 1;
/// `Record::dtype` None.
const NO_DTYPE: u8 = u8::MAX;
/// A record's bytes: six u64, two u32, eleven spans of two u32, a u16 and three u8.
const RECORD_BYTES: usize = 6 * 8 + 2 * 4 + 11 * 8 + 2 + 3;

fn put_span(out: &mut Vec<u8>, s: Span) {
    put_u32(out, s.start);
    put_u32(out, s.len);
}

impl Modules {
    /// Appends the modules' bytes to `out` (read back by [`Modules::decode`]).
    pub(crate) fn encode(&self, out: &mut Vec<u8>, kinds: &[ModuleKind]) {
        out.reserve(
            16 + self.text.len() + 8 * self.dims.len() + 8 * self.extra.len() + RECORD_BYTES * self.records.len(),
        );
        put_u32(out, self.text.len() as u32);
        out.extend_from_slice(self.text.as_bytes());
        put_u32(out, self.dims.len() as u32);
        for &d in &self.dims {
            put_u64(out, d);
        }
        put_u32(out, self.extra.len() as u32);
        for &s in &self.extra {
            put_span(out, s);
        }
        put_u32(out, self.records.len() as u32);
        for r in &self.records {
            for n in [
                r.num_experts,
                r.rank,
                r.in_features,
                r.out_features,
                r.config_rank,
                r.alpha.to_bits(),
            ] {
                put_u64(out, n);
            }
            put_u32(out, r.layer);
            put_u32(out, r.expert);
            for s in [
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
            ] {
                put_span(out, s);
            }
            put_u16(out, r.present);
            put_u8(out, kinds.iter().position(|k| *k == r.kind).unwrap_or(0) as u8);
            put_u8(out, r.dtype.map_or(NO_DTYPE, |d| d as u8));
            put_u8(out, u8::from(r.use_rslora));
        }
    }

    /// Reads modules written by [`Modules::encode`] (with the same `kinds`).
    pub(crate) fn decode(r: &mut Reader<'_>, kinds: &[ModuleKind]) -> Result<Modules, String> {
        let text = std::str::from_utf8(r.bytes()?)
            .map_err(|_| bad("module text"))?
            .to_owned();
        let n = r.u32()? as usize;
        let dims: Vec<u64> = r
            .take(n.checked_mul(8).ok_or_else(|| bad("dims"))?)?
            .chunks_exact(8)
            .map(|b| u64::from_le_bytes(b.try_into().unwrap_or_default()))
            .collect();
        let text_span = |s: Span| -> Result<Span, String> {
            let range = s.start as usize..s.start as usize + s.len as usize;
            match text.get(range) {
                Some(_) => Ok(s),
                None => Err(bad("text span")),
            }
        };
        let within = |s: Span, len: usize, what: &str| -> Result<Span, String> {
            match (s.start as usize).checked_add(s.len as usize) {
                Some(end) if end <= len => Ok(s),
                _ => Err(bad(what)),
            }
        };
        let n = r.u32()? as usize;
        let mut extra = Vec::with_capacity(n.min(r.remaining() / 8));
        for _ in 0..n {
            extra.push(text_span(span(r)?)?);
        }
        let n = r.u32()? as usize;
        let bytes = r.take(n.checked_mul(RECORD_BYTES).ok_or_else(|| bad("records"))?)?;
        let mut records = Vec::with_capacity(n);
        for b in bytes.chunks_exact(RECORD_BYTES) {
            // Fixed offsets, as `encode` lays them: six u64, two u32, eleven spans, then the small fields.
            let u64_at = |i: usize| u64::from_le_bytes(b[i..i + 8].try_into().unwrap_or_default());
            let u32_at = |i: usize| u32::from_le_bytes(b[i..i + 4].try_into().unwrap_or_default());
            let span_at = |k: usize| Span {
                start: u32_at(56 + 8 * k),
                len: u32_at(60 + 8 * k),
            };
            let present = u16::from_le_bytes([b[144], b[145]]);
            let (kind, dtype, use_rslora) = (b[146], b[147], b[148]);
            if present & !ALL_PRESENT != 0 || use_rslora > 1 {
                return Err(bad("module record"));
            }
            records.push(Record {
                num_experts: u64_at(0),
                rank: u64_at(8),
                in_features: u64_at(16),
                out_features: u64_at(24),
                config_rank: u64_at(32),
                alpha: f64::from_bits(u64_at(40)),
                layer: u32_at(48),
                expert: u32_at(52),
                key: text_span(span_at(0))?,
                name: text_span(span_at(1))?,
                leaf: text_span(span_at(2))?,
                a_key: text_span(span_at(3))?,
                b_key: text_span(span_at(4))?,
                alpha_key: text_span(span_at(5))?,
                bias_key: text_span(span_at(6))?,
                magnitude_key: text_span(span_at(7))?,
                a_shape: within(span_at(8), dims.len(), "shape")?,
                b_shape: within(span_at(9), dims.len(), "shape")?,
                extra_keys: within(span_at(10), extra.len(), "extra keys")?,
                present,
                kind: *kinds.get(kind as usize).ok_or_else(|| bad("module kind"))?,
                dtype: match dtype {
                    NO_DTYPE => None,
                    d => Some(*Dtype::ALL.get(d as usize).ok_or_else(|| bad("dtype"))?),
                },
                use_rslora: use_rslora == 1,
            });
        }
        Ok(Modules {
            text,
            dims,
            extra,
            records,
        })
    }
}

fn span(r: &mut Reader<'_>) -> Result<Span, String> {
    Ok(Span {
        start: r.u32()?,
        len: r.u32()?,
    })
}
