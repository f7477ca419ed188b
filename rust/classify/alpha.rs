//! Kohya `.alpha` scalars: the only tensor data classification reads, a few bytes each by pread.

use std::fs::File;
use std::os::unix::fs::FileExt;
use std::path::Path;

use crate::codes::ProblemCode;
use crate::header::{Dtype, Header};

use super::grouping::Group;
use super::Classification;

/// Reads each module's 0-d `.alpha` value (a few bytes per module, by pread).
pub(super) fn read_alphas(
    header: &Header<'_>,
    groups: &[Group<'_>],
    path: &Path,
    out: &mut Classification,
) -> Vec<Option<f64>> {
    let mut alphas = vec![None; groups.len()];
    if !groups.iter().any(|g| g.alpha.is_some()) {
        return alphas;
    }
    let file = match File::open(path) {
        Ok(f) => f,
        Err(e) => {
            out.problem(
                ProblemCode::InvalidAlpha,
                format_args!("cannot reopen the file to read alpha values: {e}"),
                None,
            );
            return alphas;
        }
    };
    for (slot, g) in alphas.iter_mut().zip(groups) {
        let Some(i) = g.alpha else { continue };
        let t = &header.tensors[i as usize];
        // Checked: `classify` must not panic, even on a header no validation has seen.
        let nelem = header.shape(t).iter().try_fold(1u64, |n, &d| n.checked_mul(d));
        if nelem != Some(1) {
            let nelem = nelem.map_or_else(|| "too many".to_owned(), |n| n.to_string());
            out.problem(
                ProblemCode::InvalidAlpha,
                format_args!("alpha tensor {:?} has {nelem} elements, expected 1", t.name),
                Some(&t.name),
            );
            continue;
        }
        let mut buf = [0u8; 8];
        let width = (t.dtype.bits() / 8) as usize;
        let at = header.data_start().saturating_add(t.begin);
        let value = match file.read_exact_at(&mut buf[..width.min(8)], at) {
            Ok(()) => scalar(t.dtype, &buf),
            Err(_) => None,
        };
        match value {
            // sd-scripts treats alpha 0 as "no alpha": alpha = rank, scale 1.
            Some(0.0) => {}
            Some(v) if v.is_finite() => *slot = Some(v),
            _ => out.problem(
                ProblemCode::InvalidAlpha,
                format_args!(
                    "alpha tensor {:?} ({}) is not a readable finite number",
                    t.name,
                    t.dtype.name()
                ),
                Some(&t.name),
            ),
        }
    }
    alphas
}

fn scalar(dtype: Dtype, b: &[u8; 8]) -> Option<f64> {
    let u16v = u16::from_le_bytes([b[0], b[1]]);
    Some(match dtype {
        Dtype::F32 => f64::from(f32::from_le_bytes([b[0], b[1], b[2], b[3]])),
        Dtype::F64 => f64::from_le_bytes(*b),
        Dtype::BF16 => f64::from(f32::from_bits(u32::from(u16v) << 16)),
        Dtype::F16 => f16_to_f64(u16v),
        Dtype::I64 => i64::from_le_bytes(*b) as f64,
        Dtype::I32 => f64::from(i32::from_le_bytes([b[0], b[1], b[2], b[3]])),
        Dtype::I16 => f64::from(i16::from_le_bytes([b[0], b[1]])),
        Dtype::U8 => f64::from(b[0]),
        Dtype::I8 => f64::from(b[0] as i8),
        _ => return None,
    })
}

fn f16_to_f64(h: u16) -> f64 {
    let sign = if h >> 15 == 1 { -1.0 } else { 1.0 };
    let exp = i32::from((h >> 10) & 0x1f);
    let frac = f64::from(h & 0x3ff);
    match exp {
        0 => sign * frac * 2f64.powi(-24),
        31 => {
            if frac == 0.0 {
                sign * f64::INFINITY
            } else {
                f64::NAN
            }
        }
        _ => sign * (1.0 + frac / 1024.0) * 2f64.powi(exp - 15),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn half_precision() {
        assert_eq!(f16_to_f64(0x3c00), 1.0);
        assert_eq!(f16_to_f64(0x4c00), 16.0);
        assert_eq!(f16_to_f64(0xc000), -2.0);
    }
}
