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
    /// PEFT `lora_embedding_A` (an embedding's A factor).
    EmbeddingA,
    /// PEFT `lora_embedding_B` (an embedding's B factor).
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

/// A family of adapters that are not plain LoRA, told by its factor names.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Variant {
    /// LoHa: Hadamard product of two low-rank pairs (`hada_w1_a`, ...).
    Loha,
    /// LoKr: Kronecker product (`lokr_w1`, `lokr_w2_a`, ...).
    Lokr,
    /// OFT: orthogonal finetuning blocks.
    Oft,
    /// BOFT: butterfly orthogonal finetuning.
    Boft,
    /// IA3: learned rescaling vectors.
    Ia3,
    /// GLoRA: generalised LoRA (`a1`, `b1`, ...).
    Glora,
    /// A full weight difference (`.diff`).
    Diff,
}

impl Variant {
    /// Every variant, in declaration order.
    pub const ALL: [Variant; 7] = [
        Variant::Loha,
        Variant::Lokr,
        Variant::Oft,
        Variant::Boft,
        Variant::Ia3,
        Variant::Glora,
        Variant::Diff,
    ];

    /// The variant's name (`"loha"`), as module kinds and the `variants` column spell it.
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
    (
        ".token_adapter.trainable_tokens_delta",
        Role::TrainableTokens,
        Spelling::Other,
    ),
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

/// Does `b` end with the `N` bytes of `suffix`? A fixed-size compare, so no `memcmp` call.
#[inline]
fn ends_with<const N: usize>(b: &[u8], suffix: &[u8; N]) -> bool {
    b.len() >= N && b[b.len() - N..] == *suffix
}

/// Splits a tensor name into (module key, role, spelling); None for names no rule understands
/// (full weights such as modules_to_save, or junk). The module key is never empty.
#[inline]
pub fn split(name: &str) -> Option<(&str, Role, Spelling)> {
    // Fast path for the overwhelmingly common PEFT spelling.
    let b = name.as_bytes();
    if b.len() > 14 {
        if ends_with(b, b".lora_A.weight") {
            return Some((&name[..b.len() - 14], Role::A, Spelling::Peft));
        }
        if ends_with(b, b".lora_B.weight") {
            return Some((&name[..b.len() - 14], Role::B, Spelling::Peft));
        }
    }
    split_other(name)
}

fn split_other(name: &str) -> Option<(&str, Role, Spelling)> {
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

/// A fast 64-bit hash of a short byte string, eight bytes per step (for in-memory tables only).
#[inline]
pub fn hash_bytes(bytes: &[u8]) -> u64 {
    const K: u64 = 0x9E37_79B9_7F4A_7C15;
    let mut h = bytes.len() as u64;
    let mut chunks = bytes.chunks_exact(8);
    for c in &mut chunks {
        let w = u64::from_le_bytes([c[0], c[1], c[2], c[3], c[4], c[5], c[6], c[7]]);
        h = (h.rotate_left(23) ^ w).wrapping_mul(K);
    }
    let tail = chunks.remainder();
    if !tail.is_empty() {
        // The last eight bytes (overlapping the words above), or the short tail alone.
        let w = match bytes.last_chunk::<8>() {
            Some(w) => u64::from_le_bytes(*w),
            None => tail.iter().fold(0, |v, &c| v << 8 | u64::from(c)),
        };
        h = (h.rotate_left(23) ^ w).wrapping_mul(K);
    }
    h ^ (h >> 29)
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

/// A module key without its wrapper prefix (`base_model.model.`, a diffusers component): the
/// module's name in the base model.
pub fn strip_prefix(key: &str) -> &str {
    // Fixed-size compares (no `memcmp` call), choosing by the first byte: at most one prefix
    // can match a key, so this gives the answer trying all of them in order would.
    fn cut<'k, const N: usize>(key: &'k str, prefix: &[u8; N]) -> Option<&'k str> {
        (key.as_bytes().first_chunk::<N>() == Some(prefix)).then(|| &key[N..])
    }
    let rest = match key.as_bytes().first() {
        Some(b'b') => cut(key, b"base_model.model."),
        Some(b'p') => cut(key, b"peft_model.base_model.model."),
        Some(b'u') => cut(key, b"unet."),
        Some(b't') => cut(key, b"transformer.")
            .or_else(|| cut(key, b"text_encoder."))
            .or_else(|| cut(key, b"text_encoder_2.")),
        Some(b'd') => cut(key, b"diffusion_model."),
        _ => None,
    };
    debug_assert_eq!(rest, PREFIXES.iter().find_map(|p| key.strip_prefix(p)));
    rest.unwrap_or(key)
}

/// The module path PEFT matches `rank_pattern`/`alpha_pattern` keys against (`get_pattern_key`): the key
/// without PEFT's `base_model.model.` wrapper, a diffusers component prefix kept, since SDXL's two text
/// encoders share everything after it. A key that matches the prefix-free name matches this one too.
pub fn pattern_name(key: &str) -> &str {
    key.strip_prefix("peft_model.base_model.model.")
        .or_else(|| key.strip_prefix("base_model.model."))
        .unwrap_or(key)
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

/// What the rest of the classifier needs from a module key, found in one pass.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct KeyParts<'k> {
    /// The number after `layers` / `layer` / `h` / `*blocks` (or kohya's `blocks_N` / `layers_N`).
    pub layer: Option<u32>,
    /// The number after a part ending in `experts`.
    pub expert: Option<u32>,
    /// The last dotted component (`q_proj`).
    pub last: &'k str,
    /// `last`, with its parent when `last` is a number (`to_out.0`): the leaf of a dotted name.
    pub dotted_leaf: &'k str,
}

/// Is `part` one of the words a layer index follows? By length first, then a fixed-size compare.
#[inline]
fn is_layer_word(part: &[u8]) -> bool {
    match part.len() {
        1 => part[0] == b'h',
        5 => part == b"layer",
        6 => part == b"layers" || part == b"blocks",
        13 => part == b"double_blocks" || part == b"single_blocks",
        18 => part == b"transformer_blocks",
        25 => part == b"single_transformer_blocks",
        _ => false,
    }
}

/// Bit masks of the dots and the ASCII digits in a key of at most 64 bytes (bit i: byte i).
#[inline]
fn dot_digit_masks(b: &[u8]) -> Option<(u64, u64)> {
    if b.len() > 64 {
        return None;
    }
    #[cfg(target_arch = "x86_64")]
    {
        use std::arch::x86_64::{
            __m128i, _mm_cmpeq_epi8, _mm_loadu_si128, _mm_min_epu8, _mm_movemask_epi8, _mm_set1_epi8, _mm_sub_epi8,
        };
        // Masks of one 16-byte chunk: (dots, digits).
        // SAFETY: SSE2 is part of the x86_64 baseline; `chunk` is 16 readable bytes.
        let chunk = |chunk: &[u8; 16]| unsafe {
            let v = _mm_loadu_si128(chunk.as_ptr().cast::<__m128i>());
            let dots = _mm_movemask_epi8(_mm_cmpeq_epi8(v, _mm_set1_epi8(b'.' as i8))) as u16;
            // A digit is a byte whose distance above '0' is at most 9 (unsigned).
            let d = _mm_sub_epi8(v, _mm_set1_epi8(b'0' as i8));
            let digits = _mm_movemask_epi8(_mm_cmpeq_epi8(_mm_min_epu8(d, _mm_set1_epi8(9)), d)) as u16;
            (u64::from(dots), u64::from(digits))
        };
        let len = b.len();
        if len < 16 {
            let mut padded = [0u8; 16];
            padded[..len].copy_from_slice(b);
            return Some(chunk(&padded));
        }
        let (mut dots, mut digits) = (0u64, 0u64);
        let mut at = 0;
        while at + 16 <= len {
            let (d, g) = chunk(b[at..at + 16].try_into().ok()?);
            dots |= d << at;
            digits |= g << at;
            at += 16;
        }
        if at < len {
            // The last 16 bytes, overlapping bytes already seen (they give the same bits).
            let from = len - 16;
            let (d, g) = chunk(b[from..].try_into().ok()?);
            dots |= d << from;
            digits |= g << from;
        }
        Some((dots, digits))
    }
    #[cfg(not(target_arch = "x86_64"))]
    Some(dot_digit_masks_scalar(b))
}

#[cfg_attr(target_arch = "x86_64", allow(dead_code))]
fn dot_digit_masks_scalar(b: &[u8]) -> (u64, u64) {
    b.iter().enumerate().fold((0, 0), |(dots, digits), (i, &c)| {
        (
            dots | u64::from(c == b'.') << i,
            digits | u64::from(c.is_ascii_digit()) << i,
        )
    })
}

/// Layer, expert, last component and dotted leaf of a module key.
pub fn parts(key: &str) -> KeyParts<'_> {
    let b = key.as_bytes();
    let Some((dots, digits)) = dot_digit_masks(b) else {
        let (layer, expert) = indices_slow(key);
        let last = key.rsplit('.').next().unwrap_or(key);
        return KeyParts {
            layer,
            expert,
            last,
            dotted_leaf: dotted_leaf(key, last),
        };
    };
    let len = b.len();
    // Bits 0..i, for i < 64.
    let below = |i: usize| (1u64 << i) - 1;
    // Start of the part that ends just before the dot at `dot`: after the previous dot, or 0.
    let part_start = |dot: usize| {
        let before = dots & below(dot);
        if before == 0 {
            0
        } else {
            64 - before.leading_zeros() as usize
        }
    };
    let (mut layer, mut expert) = (None, None);
    // Parts that may be indices start with a digit, at the start or right after a dot.
    let mut starts = digits & ((dots << 1) | 1);
    while starts != 0 {
        let s = starts.trailing_zeros() as usize;
        starts &= starts - 1;
        let after = dots >> s;
        let end = if after == 0 {
            len
        } else {
            s + after.trailing_zeros() as usize
        };
        let n = end - s;
        if n > 9 || (digits >> s) & below(n) != below(n) {
            continue;
        }
        let value = b[s..end].iter().fold(0u32, |v, &d| v * 10 + u32::from(d - b'0'));
        let prev: &[u8] = if s == 0 { b"" } else { &b[part_start(s - 1)..s - 1] };
        if layer.is_none() && is_layer_word(prev) {
            layer = Some(value);
        } else if expert.is_none() && prev.ends_with(b"experts") {
            expert = Some(value);
        }
    }
    if layer.is_none() && dots == 0 {
        layer = kohya_layer(key);
    }
    if dots == 0 {
        return KeyParts {
            layer,
            expert,
            last: key,
            dotted_leaf: key,
        };
    }
    let last_dot = 63 - dots.leading_zeros() as usize;
    let last = &key[last_dot + 1..];
    // A number (or nothing) after the last dot is a Sequential index: the leaf takes its parent.
    let tail = len - last_dot - 1;
    let numeric = tail == 0 || (digits >> (last_dot + 1)) & below(tail.min(63)) == below(tail.min(63));
    let before = dots & below(last_dot);
    let dotted_leaf = if numeric && before != 0 {
        &key[64 - before.leading_zeros() as usize..]
    } else {
        last
    };
    KeyParts {
        layer,
        expert,
        last,
        dotted_leaf,
    }
}

/// kohya joins the path with underscores: `lora_unet_double_blocks_7_img_attn_qkv`.
fn kohya_layer(key: &str) -> Option<u32> {
    number_after(key, "blocks_").or_else(|| number_after(key, "layers_"))
}

/// `last`, or `parent.last` when `last` is a number (a Sequential index such as `to_out.0`).
#[inline]
fn dotted_leaf<'k>(key: &'k str, last: &'k str) -> &'k str {
    if last.len() < key.len() && last.bytes().all(|b| b.is_ascii_digit()) {
        if let Some(pos) = key[..key.len() - last.len() - 1].rfind('.') {
            return &key[pos + 1..];
        }
    }
    last
}

/// (layer, expert) indices of a module key in one pass over its dotted parts: the number after
/// `layers` / `layer` / `h` / `*blocks`, and after `experts` / `shared_experts`.
pub fn indices(key: &str) -> (Option<u32>, Option<u32>) {
    let p = parts(key);
    (p.layer, p.expert)
}

/// The reference reading of `indices`, for keys too long for the bit masks.
fn indices_slow(key: &str) -> (Option<u32>, Option<u32>) {
    let (mut layer, mut expert) = (None, None);
    let mut prev = "";
    for part in key.split('.') {
        if is_index(part) {
            if layer.is_none() && is_layer_word(prev.as_bytes()) {
                layer = part.parse().ok();
            } else if expert.is_none() && prev.ends_with("experts") {
                expert = part.parse().ok();
            }
        }
        prev = part;
    }
    if layer.is_none() && !key.contains('.') {
        layer = kohya_layer(key);
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
    leaf_of(key, &parts(key), kohya)
}

/// `leaf` from parts already found.
pub fn leaf_of<'k>(key: &'k str, parts: &KeyParts<'k>, kohya: bool) -> &'k str {
    let last = parts.last;
    if !kohya || !last.contains('_') {
        return parts.dotted_leaf;
    }
    debug_assert!(key.ends_with(last));
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
            Some((
                "base_model.model.model.layers.3.self_attn.q_proj",
                Role::A,
                Spelling::Peft
            ))
        );
        assert_eq!(
            split("lora_unet_x_to_q.alpha"),
            Some(("lora_unet_x_to_q", Role::Alpha, Spelling::Other))
        );
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
        assert_eq!(
            leaf(
                "lora_unet_down_blocks_0_attentions_0_transformer_blocks_0_attn1_to_q",
                true
            ),
            "to_q"
        );
        assert_eq!(
            leaf("lora_te_text_model_encoder_layers_0_self_attn_q_proj", true),
            "q_proj"
        );
        assert_eq!(leaf("lora_unet_mid_block_attentions_0_proj_out", true), "proj_out");
        // Keys that are only a number (or empty) must not underflow in the Sequential-index rule.
        assert_eq!(leaf("0", false), "0");
        assert_eq!(leaf("", false), "");
        assert_eq!(split(".lora_A.weight"), None);
    }

    /// The one-pass reading agrees with a plain split on dots, for keys short and long.
    #[test]
    fn parts_match_reference() {
        let pieces = [
            "layers",
            "layer",
            "h",
            "blocks",
            "experts",
            "shared_experts",
            "mlp",
            "0",
            "12",
            "007",
            "1234567890",
            "x1",
            "",
            "single_transformer_blocks",
            "to_out",
            "lora_unet_blocks_3",
            "layers_4",
        ];
        let mut seed = 0x2545_F491_4F6C_DD1Du64;
        for _ in 0..20_000 {
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            let n = (seed % 9) as usize;
            let key: Vec<&str> = (0..n)
                .map(|i| pieces[((seed >> (i * 5 + 8)) % pieces.len() as u64) as usize])
                .collect();
            let key = key.join(".");
            let p = parts(&key);
            assert_eq!((p.layer, p.expert), indices_slow(&key), "{key}");
            assert_eq!(p.last, key.rsplit('.').next().unwrap_or(&key), "{key}");
            assert_eq!(p.dotted_leaf, dotted_leaf(&key, p.last), "{key}");
            assert_eq!(
                dot_digit_masks(key.as_bytes()).unwrap_or_default(),
                if key.len() <= 64 {
                    dot_digit_masks_scalar(key.as_bytes())
                } else {
                    (0, 0)
                },
                "{key}"
            );
        }
    }
}
