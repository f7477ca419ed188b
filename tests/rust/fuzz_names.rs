//! Fuzz harness (c): the tensor-name parser. Names are built from the pieces real names are made
//! of (layer words, indices of every length, `experts`, kohya underscores, suffixes of every
//! family) mixed with arbitrary text. Every function must return, and agree with a plain
//! reading of its documented rule: `parts` with a split on dots, `split` with the name itself.

mod common;

use _core::names::{self, hash_bytes, leaf, parts, split, strip_prefix};
use common::alloc::CountingAlloc;
use proptest::prelude::*;

#[global_allocator]
static ALLOC: CountingAlloc = CountingAlloc;

const PIECES: &[&str] = &[
    "layers",
    "layer",
    "h",
    "blocks",
    "double_blocks",
    "single_blocks",
    "transformer_blocks",
    "single_transformer_blocks",
    "experts",
    "shared_experts",
    "mlp",
    "self_attn",
    "q_proj",
    "to_out",
    "0",
    "7",
    "12",
    "007",
    "999999999",
    "4294967295",
    "1234567890",
    "",
    "lora_unet_blocks_3",
    "layers_4_x",
    "blocks_",
    "base_model",
    "model",
    "unet",
    "transformer",
    "text_encoder_2",
    "processor",
    "é",
    "😀",
    "x1",
    "lora_A",
    "weight",
    "lora_B",
    "alpha",
    "hada_w1_a",
    "lokr_w1",
    "lora_down",
    "lora_up",
    "down",
    "up",
    "diff",
];

fn name_strategy() -> impl Strategy<Value = String> {
    let piece = prop::sample::select(PIECES);
    let sep = prop::sample::select(&[".", ".", ".", "_", ""][..]);
    prop_oneof![
        4 => prop::collection::vec((piece, sep), 0..24).prop_map(|v| v.into_iter().flat_map(|(p, s)| [p, s]).collect()),
        1 => "\\PC{0,80}",
        1 => "[0-9._a-z]{0,140}",
    ]
}

/// The documented reading of `parts`: layer after a layer word, expert after `*experts`, each
/// index 1-9 ASCII digits; kohya's `blocks_N` / `layers_N` when the key has no dot.
fn reference(key: &str) -> (Option<u32>, Option<u32>, &str, &str) {
    let is_index = |p: &str| (1..=9).contains(&p.len()) && p.bytes().all(|b| b.is_ascii_digit());
    let layer_word = |p: &str| {
        matches!(
            p,
            "h" | "layer"
                | "layers"
                | "blocks"
                | "double_blocks"
                | "single_blocks"
                | "transformer_blocks"
                | "single_transformer_blocks"
        )
    };
    let (mut layer, mut expert) = (None, None);
    let all: Vec<&str> = key.split('.').collect();
    for (i, part) in all.iter().enumerate() {
        let prev = if i == 0 { "" } else { all[i - 1] };
        if is_index(part) {
            if layer.is_none() && layer_word(prev) {
                layer = part.parse().ok();
            } else if expert.is_none() && prev.ends_with("experts") {
                expert = part.parse().ok();
            }
        }
    }
    if layer.is_none() && !key.contains('.') {
        layer = ["blocks_", "layers_"].iter().find_map(|marker| {
            key.match_indices(marker).find_map(|(at, m)| {
                let rest = &key[at + m.len()..];
                let digits = rest.bytes().take_while(u8::is_ascii_digit).count();
                let next = rest.as_bytes().get(digits);
                ((1..=9).contains(&digits) && matches!(next, None | Some(b'.' | b'_')))
                    .then(|| rest[..digits].parse().ok())
                    .flatten()
            })
        });
    }
    let last = all[all.len() - 1];
    let numeric = last.bytes().all(|b| b.is_ascii_digit());
    let dotted_leaf = if numeric && all.len() > 2 {
        &key[key.len() - last.len() - 1 - all[all.len() - 2].len()..]
    } else {
        last
    };
    (layer, expert, last, dotted_leaf)
}

fn check(input: &[u8]) -> Result<(), String> {
    let Ok(name) = std::str::from_utf8(input) else {
        return Ok(());
    };
    if let Some((key, _, _)) = split(name) {
        let rest = name.strip_prefix(key).ok_or("split: key is not a prefix")?;
        if key.is_empty() || rest.is_empty() || !matches!(rest.as_bytes()[0], b'.' | b'_') {
            return Err(format!("split: key {key:?} rest {rest:?}"));
        }
    }
    let p = parts(name);
    let want = reference(name);
    if (p.layer, p.expert, p.last, p.dotted_leaf) != want {
        return Err(format!("parts {p:?}, reference {want:?}"));
    }
    if (names::layer_index(name), names::expert_index(name)) != (p.layer, p.expert) {
        return Err("layer_index / expert_index differ from parts".into());
    }
    for kohya in [false, true] {
        let l = leaf(name, kohya);
        if !name.ends_with(l) {
            return Err(format!("leaf {l:?} (kohya: {kohya}) is not a suffix"));
        }
    }
    if !name.ends_with(strip_prefix(name)) {
        return Err("strip_prefix is not a suffix".into());
    }
    if hash_bytes(name.as_bytes()) != hash_bytes(name.to_owned().as_bytes()) {
        return Err("hash_bytes is not a function of the bytes".into());
    }
    Ok(())
}

#[test]
fn fuzz_names() {
    common::fuzz::drive("names", 12000, name_strategy().prop_map(String::into_bytes), check);
}
