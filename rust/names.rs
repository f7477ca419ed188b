//! Tensor-name parsing: which part of which module a tensor is, across PEFT, diffusers, kohya,
//! LyCORIS and xlabs spellings (reference: shared/reference/lora-formats.md §1.2, §3).

/// What a tensor is, read from its name's suffix.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Role {
    /// Down / A factor (`lora_A.weight`, `lora_down.weight`, `.down.weight`, ...).
    A,
    /// Up / B factor.
    B,
    /// `lora_B.bias` (PEFT `lora_bias=True`).
    Bias,
    EmbeddingA,
    EmbeddingB,
    /// DoRA magnitude: PEFT `lora_magnitude_vector`, kohya/LyCORIS `dora_scale`.
    Magnitude,
    /// kohya / LyCORIS per-module `.alpha` scalar.
    Alpha,
    /// LoCon Tucker `lora_mid.weight`.
    Mid,
    /// A factor of a non-LoRA family (LoHa, LoKr, OFT, BOFT, IA3, GLoRA, full diff).
    Variant(Variant),
    /// PEFT trainable tokens delta.
    TrainableTokens,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Variant {
    Loha,
    Lokr,
    Oft,
    Boft,
    Ia3,
    Glora,
    Diff,
}

impl Variant {
    pub fn name(self) -> &'static str {
        match self {
            Variant::Loha => "loha",
            Variant::Lokr => "lokr",
            Variant::Oft => "oft",
            Variant::Boft => "boft",
            Variant::Ia3 => "ia3",
            Variant::Glora => "glora",
            Variant::Diff => "diff",
        }
    }
}

/// How the A/B pair was spelled; used to tell formats apart.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Spelling {
    /// `lora_A` / `lora_B` (PEFT, diffusers, ai-toolkit)
    Peft,
    /// `lora_down` / `lora_up` (kohya, LoCon)
    Kohya,
    /// `.lora.down` / `_lora.down` / `lora_linear_layer.down` (old diffusers)
    DiffusersLegacy,
    /// `.down.weight` / `.up.weight` under `processor.` (xlabs)
    Xlabs,
    /// Anything else we understand (embeddings, LyCORIS factors, DoRA, alpha).
    Other,
}

/// (suffix, role, spelling). Longest and most specific first: the first match wins.
const SUFFIXES: &[(&str, Role, Spelling)] = &[
    (".lora_A.weight", Role::A, Spelling::Peft),
    (".lora_B.weight", Role::B, Spelling::Peft),
    (".lora_B.bias", Role::Bias, Spelling::Peft),
    (".lora_embedding_A", Role::EmbeddingA, Spelling::Other),
    (".lora_embedding_B", Role::EmbeddingB, Spelling::Other),
    (".lora_magnitude_vector", Role::Magnitude, Spelling::Other),
    (".lora_magnitude_vector.weight", Role::Magnitude, Spelling::Other),
    (".lora_down.weight", Role::A, Spelling::Kohya),
    (".lora_up.weight", Role::B, Spelling::Kohya),
    (".lora_mid.weight", Role::Mid, Spelling::Kohya),
    (".lora_linear_layer.down.weight", Role::A, Spelling::DiffusersLegacy),
    (".lora_linear_layer.up.weight", Role::B, Spelling::DiffusersLegacy),
    ("_lora.down.weight", Role::A, Spelling::DiffusersLegacy),
    ("_lora.up.weight", Role::B, Spelling::DiffusersLegacy),
    (".lora.down.weight", Role::A, Spelling::DiffusersLegacy),
    (".lora.up.weight", Role::B, Spelling::DiffusersLegacy),
    (".lora_A", Role::A, Spelling::Peft),
    (".lora_B", Role::B, Spelling::Peft),
    (".alpha", Role::Alpha, Spelling::Other),
    (".dora_scale", Role::Magnitude, Spelling::Other),
    (".token_adapter.trainable_tokens_delta", Role::TrainableTokens, Spelling::Other),
    (".hada_w1_a", Role::Variant(Variant::Loha), Spelling::Other),
    (".hada_w1_b", Role::Variant(Variant::Loha), Spelling::Other),
    (".hada_w2_a", Role::Variant(Variant::Loha), Spelling::Other),
    (".hada_w2_b", Role::Variant(Variant::Loha), Spelling::Other),
    (".hada_t1", Role::Variant(Variant::Loha), Spelling::Other),
    (".hada_t2", Role::Variant(Variant::Loha), Spelling::Other),
    (".lokr_w1", Role::Variant(Variant::Lokr), Spelling::Other),
    (".lokr_w1_a", Role::Variant(Variant::Lokr), Spelling::Other),
    (".lokr_w1_b", Role::Variant(Variant::Lokr), Spelling::Other),
    (".lokr_w2", Role::Variant(Variant::Lokr), Spelling::Other),
    (".lokr_w2_a", Role::Variant(Variant::Lokr), Spelling::Other),
    (".lokr_w2_b", Role::Variant(Variant::Lokr), Spelling::Other),
    (".lokr_t1", Role::Variant(Variant::Lokr), Spelling::Other),
    (".lokr_t2", Role::Variant(Variant::Lokr), Spelling::Other),
    (".oft_blocks", Role::Variant(Variant::Oft), Spelling::Other),
    (".oft_diag", Role::Variant(Variant::Oft), Spelling::Other),
    (".oft_R.weight", Role::Variant(Variant::Oft), Spelling::Other),
    (".oft_r", Role::Variant(Variant::Oft), Spelling::Other),
    (".oft_s", Role::Variant(Variant::Oft), Spelling::Other),
    (".rescale", Role::Variant(Variant::Oft), Spelling::Other),
    (".boft_R", Role::Variant(Variant::Boft), Spelling::Other),
    (".boft_s", Role::Variant(Variant::Boft), Spelling::Other),
    (".ia3_l", Role::Variant(Variant::Ia3), Spelling::Other),
    (".on_input", Role::Variant(Variant::Ia3), Spelling::Other),
    (".a1.weight", Role::Variant(Variant::Glora), Spelling::Other),
    (".a2.weight", Role::Variant(Variant::Glora), Spelling::Other),
    (".b1.weight", Role::Variant(Variant::Glora), Spelling::Other),
    (".b2.weight", Role::Variant(Variant::Glora), Spelling::Other),
    (".bm.weight", Role::Variant(Variant::Glora), Spelling::Other),
    (".diff", Role::Variant(Variant::Diff), Spelling::Other),
    (".diff_b", Role::Variant(Variant::Diff), Spelling::Other),
    (".w_norm", Role::Variant(Variant::Diff), Spelling::Other),
    (".b_norm", Role::Variant(Variant::Diff), Spelling::Other),
];

/// Splits a tensor name into (module key, role, spelling); None for names no rule understands
/// (full weights such as modules_to_save, or junk).
#[inline]
pub fn split(name: &str) -> Option<(&str, Role, Spelling)> {
    // Fast path for the overwhelmingly common PEFT spelling.
    if let Some(stem) = name.strip_suffix(".weight") {
        if let Some(key) = stem.strip_suffix(".lora_A") {
            return Some((key, Role::A, Spelling::Peft));
        }
        if let Some(key) = stem.strip_suffix(".lora_B") {
            return Some((key, Role::B, Spelling::Peft));
        }
    }
    for &(suffix, role, spelling) in SUFFIXES {
        if let Some(key) = name.strip_suffix(suffix) {
            if !key.is_empty() {
                return Some((key, role, spelling));
            }
        }
    }
    // xlabs: `double_blocks.0.processor.qkv_lora1.down.weight`
    if name.contains(".processor.") {
        if let Some(key) = name.strip_suffix(".down.weight") {
            return Some((key, Role::A, Spelling::Xlabs));
        }
        if let Some(key) = name.strip_suffix(".up.weight") {
            return Some((key, Role::B, Spelling::Xlabs));
        }
    }
    None
}

/// Wrapper prefixes stripped to get the name PEFT matches patterns against.
const PREFIXES: &[&str] = &[
    "base_model.model.",
    "peft_model.base_model.model.",
    "unet.",
    "transformer.",
    "text_encoder.",
    "text_encoder_2.",
    "diffusion_model.",
];

pub fn strip_prefix(key: &str) -> &str {
    for p in PREFIXES {
        if let Some(rest) = key.strip_prefix(p) {
            return rest;
        }
    }
    key
}

/// Reads the number right after `marker` when it is followed by `.` or `_` (e.g. `layers.12.`).
#[inline]
fn number_after(name: &str, marker: &str) -> Option<u32> {
    let mut search = 0;
    while let Some(found) = memchr::memmem::find(&name.as_bytes()[search..], marker.as_bytes()) {
        let start = search + found + marker.len();
        let digits = name[start..].bytes().take_while(u8::is_ascii_digit).count();
        if digits > 0 && digits <= 9 {
            let next = name.as_bytes().get(start + digits);
            if matches!(next, Some(b'.' | b'_') | None) {
                return name[start..start + digits].parse().ok();
            }
        }
        search = start;
    }
    None
}

fn is_index(part: &str) -> bool {
    !part.is_empty() && part.len() <= 9 && part.bytes().all(|b| b.is_ascii_digit())
}

/// (layer, expert) indices of a module key in one pass over its dotted parts: the number after
/// `layers` / `layer` / `h` / `*blocks`, and after `experts` / `shared_experts`.
pub fn indices(key: &str) -> (Option<u32>, Option<u32>) {
    let (mut layer, mut expert) = (None, None);
    let mut prev = "";
    for part in key.split('.') {
        if is_index(part) {
            if layer.is_none() && matches!(prev, "layers" | "layer" | "h" | "blocks" | "transformer_blocks"
                | "double_blocks" | "single_blocks" | "single_transformer_blocks")
            {
                layer = part.parse().ok();
            } else if expert.is_none() && prev.ends_with("experts") {
                expert = part.parse().ok();
            }
        }
        prev = part;
    }
    if layer.is_none() && !key.contains('.') {
        // kohya joins the path with underscores: `lora_unet_double_blocks_7_img_attn_qkv`.
        layer = number_after(key, "blocks_").or_else(|| number_after(key, "layers_"));
    }
    (layer, expert)
}

/// The decoder layer (or diffusion block) index of a module.
pub fn layer_index(key: &str) -> Option<u32> {
    indices(key).0
}

/// The numbered expert of a per-expert module (`experts.N.`).
pub fn expert_index(key: &str) -> Option<u32> {
    indices(key).1
}

/// Pieces that, in kohya's underscore-joined names, belong to the leaf (`to_q`, `q_proj`, `to_out_0`).
const KOHYA_JOIN: &[&str] = &[
    "to", "q", "k", "v", "o", "out", "in", "gate", "up", "down", "ff", "img", "txt", "add", "proj",
];

/// The last component of a module key: `q_proj` for `...self_attn.q_proj`; for kohya names, the
/// underscore-joined tail such as `to_q` or `proj_out`.
pub fn leaf(key: &str, kohya: bool) -> &str {
    let last = key.rsplit('.').next().unwrap_or(key);
    if !kohya || !last.contains('_') {
        // `to_out.0`: a numeric tail names a Sequential index; keep the parent with it.
        if last.bytes().all(|b| b.is_ascii_digit()) {
            if let Some(pos) = key[..key.len() - last.len() - 1].rfind('.') {
                return &key[pos + 1..];
            }
        }
        return last;
    }
    let parts: Vec<&str> = last.split('_').collect();
    let mut start = parts.len() - 1;
    while start > 0 {
        let prev = parts[start - 1];
        let cur = parts[start];
        let joins = cur.bytes().all(|b| b.is_ascii_digit())
            || KOHYA_JOIN.contains(&prev)
            || cur == "proj" && !prev.bytes().all(|b| b.is_ascii_digit());
        if !joins {
            break;
        }
        start -= 1;
        if start + 3 < parts.len() {
            break;
        }
    }
    let offset: usize = parts[..start].iter().map(|p| p.len() + 1).sum();
    &last[offset..]
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn splits() {
        assert_eq!(
            split("base_model.model.model.layers.3.self_attn.q_proj.lora_A.weight"),
            Some(("base_model.model.model.layers.3.self_attn.q_proj", Role::A, Spelling::Peft))
        );
        assert_eq!(split("lora_unet_x_to_q.alpha"), Some(("lora_unet_x_to_q", Role::Alpha, Spelling::Other)));
        assert_eq!(
            split("double_blocks.0.processor.qkv_lora1.down.weight"),
            Some(("double_blocks.0.processor.qkv_lora1", Role::A, Spelling::Xlabs))
        );
        assert_eq!(split("base_model.model.score.weight"), None);
    }

    #[test]
    fn indices_and_leaves() {
        assert_eq!(layer_index("model.layers.12.mlp.experts.3.w1"), Some(12));
        assert_eq!(expert_index("model.layers.12.mlp.experts.3.w1"), Some(3));
        assert_eq!(expert_index("model.layers.12.mlp.experts.gate_up_proj"), None);
        assert_eq!(layer_index("lora_unet_double_blocks_7_img_attn_qkv"), Some(7));
        assert_eq!(leaf("a.self_attn.q_proj", false), "q_proj");
        assert_eq!(leaf("unet.attn1.to_out.0", false), "to_out.0");
        assert_eq!(leaf("lora_unet_down_blocks_0_attentions_0_transformer_blocks_0_attn1_to_q", true), "to_q");
        assert_eq!(leaf("lora_te_text_model_encoder_layers_0_self_attn_q_proj", true), "q_proj");
        assert_eq!(leaf("lora_unet_mid_block_attentions_0_proj_out", true), "proj_out");
    }
}
