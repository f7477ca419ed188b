//! Answers shared by modules that repeat per layer: a module whose inputs equal an earlier one's
//! takes its kind, dims, flags, layout and target matches (`Template`).

use crate::config::{same_tagged, LoraConfig, TargetModules};
use crate::header::Dtype;

use super::shapes::Dims;
use super::ModuleKind;

/// What the module loop reads of a plain A/B module besides its name, and what it concluded.
/// Two modules with equal inputs whose names differ only where nothing reads them (the layer and
/// expert numbers, when `name_free` holds) get the same kind, dims, flags, layout and target
/// matches; the second then only adds its layer, expert and record.
#[derive(Clone, Copy)]
pub(super) struct Template<'h> {
    pub(super) leaf_tag: u64,
    pub(super) leaf: &'h str,
    pub(super) last: &'h str,
    pub(super) a_shape: &'h [u64],
    pub(super) b_shape: &'h [u64],
    pub(super) dtypes: (Dtype, Dtype),
    /// bias, magnitude, alpha present; an expert number; a 3-D A with "experts" in the key.
    pub(super) bits: u8,
    /// The answers: set when the template is remembered.
    pub(super) kind: ModuleKind,
    pub(super) dims: Option<Dims>,
    /// The index of its module's record, when records are kept (else `usize::MAX`).
    pub(super) record: usize,
}

impl Template<'_> {
    /// Inlined: an out-of-line call per module and template costs more than the compare.
    #[inline(always)]
    pub(super) fn same_inputs(&self, other: &Template<'_>) -> bool {
        self.leaf_tag == other.leaf_tag
            && self.bits == other.bits
            && self.dtypes == other.dtypes
            && same_dims(self.a_shape, other.a_shape)
            && same_dims(self.b_shape, other.b_shape)
            && same_tagged(self.leaf, other.leaf)
            // `last` is usually `leaf` itself (the same bytes): then equal leaves are enough.
            && ((same_str(self.last, self.leaf) && same_str(other.last, other.leaf)) || self.last == other.last)
    }
}

/// The same slice (address and length), not merely equal text.
#[inline]
pub(super) fn same_str(a: &str, b: &str) -> bool {
    std::ptr::eq(a, b)
}

/// Equal shapes, element by element: shapes are short, and a slice compare calls `memcmp`.
#[inline]
pub(super) fn same_dims(a: &[u64], b: &[u64]) -> bool {
    a.len() == b.len() && a.iter().zip(b).all(|(x, y)| x == y)
}

/// Does nothing in the module loop read a module's whole name under this config? Ranks come from
/// `r` alone (no `rank_pattern`) and targets from the last component alone (`memo_ok`: a list of
/// dotless entries), from a pattern matching everything, or are not given.
pub(super) fn name_free(c: &LoraConfig, memo_ok: bool) -> bool {
    c.rank_pattern.is_empty()
        && match &c.target_modules {
            None => true,
            Some(TargetModules::List(_)) => memo_ok,
            Some(TargetModules::Pattern(p)) => p == "all-linear" || p == "all",
        }
}

#[cfg(test)]
mod tests {
    use std::path::Path;

    use super::super::{classify_with, Configs, Options};
    use crate::config::LoraConfig;

    /// A header of `tensors` (name, shape; BF16) laid out in order, and its file size.
    fn header_json(tensors: &[(String, Vec<u64>)]) -> (String, u64) {
        let mut at = 0;
        let entries: Vec<String> = tensors
            .iter()
            .map(|(name, shape)| {
                let size = shape.iter().product::<u64>() * 2;
                let dims: Vec<String> = shape.iter().map(u64::to_string).collect();
                let entry = format!(
                    "\"{name}\":{{\"dtype\":\"BF16\",\"shape\":[{}],\"data_offsets\":[{at},{}]}}",
                    dims.join(","),
                    at + size
                );
                at += size;
                entry
            })
            .collect();
        let json = format!("{{{}}}", entries.join(","));
        let size = 8 + json.len() as u64 + at;
        (json, size)
    }

    /// Modules that repeat per layer share their answers (`Template`), except where the name or a
    /// problem decides: every problem is still reported for its own module, and every record is
    /// the module's own, as a module-by-module pass (`reuse` off) gives them.
    #[test]
    fn templates_give_what_a_module_by_module_pass_gives() {
        let mut tensors = Vec::new();
        for layer in 0..6u64 {
            for (m, out) in [
                ("q_proj", 64),
                ("v_proj", 16),
                ("mlp.experts.3.up_proj", 32),
                ("o_proj", 64),
            ] {
                let key = format!("base_model.model.model.layers.{layer}.{m}");
                // Layer 2's q_proj B disagrees on the rank, layer 4's v_proj A has another rank.
                let rb = if layer == 2 && m == "q_proj" { 4 } else { 8 };
                let ra = if layer == 4 && m == "v_proj" { 16 } else { 8 };
                tensors.push((format!("{key}.lora_A.weight"), vec![ra, 64]));
                tensors.push((format!("{key}.lora_B.weight"), vec![out, rb]));
                // o_proj has a bias from layer 3 on, and a DoRA magnitude in odd layers.
                if m == "o_proj" && layer >= 3 {
                    tensors.push((format!("{key}.lora_B.bias"), vec![out]));
                }
                if m == "o_proj" && layer % 2 == 1 {
                    tensors.push((format!("{key}.lora_magnitude_vector"), vec![out]));
                }
                // A `lora_mid` (a template does not compare it) in the first v_proj and layer 3's.
                if m == "v_proj" && (layer == 0 || layer == 3) {
                    tensors.push((format!("{key}.lora_mid.weight"), vec![8, 8]));
                }
            }
        }
        let (json, size) = header_json(&tensors);
        let header = crate::header::parse_header(json.as_bytes(), size).unwrap();
        for config in [
            r#"{"r": 8, "target_modules": ["q_proj", "up_proj"]}"#,
            r#"{"r": 8, "target_modules": "all-linear"}"#,
            r#"{"r": 8, "lora_alpha": 16, "target_modules": "all-linear", "alpha_pattern": {"layers.3.o_proj": 4}}"#,
            r#"{"r": 8, "target_modules": ["q_proj", "v_proj", "up_proj"], "rank_pattern": {"layers.1.q_proj": 4}}"#,
            r#"{"r": 8, "target_modules": ".*q_proj"}"#,
        ] {
            let c = LoraConfig::from_json(config).unwrap();
            let run = |keep_modules, reuse| {
                let configs = Configs {
                    file: Some(&c),
                    components: &[],
                };
                classify_with(&header, configs, Path::new("x"), Options { keep_modules }, reuse)
            };
            for keep_modules in [false, true] {
                let (fast, full) = (run(keep_modules, true), run(keep_modules, false));
                assert_eq!(format!("{fast:?}"), format!("{full:?}"), "{config}");
                assert!(!fast.problems.is_empty(), "{config}");
                assert_eq!(fast.layers, (0..6).collect::<Vec<u32>>());
                assert_eq!(fast.num_experts, 4);
                assert_eq!(fast.modules.len(), if keep_modules { 24 } else { 0 });
            }
        }
    }
}
