//! Fuzz harness (b): classification over valid headers of every adapter family (PEFT with DoRA,
//! bias, embeddings, modules_to_save and trainable tokens; diffusers, old diffusers, kohya with
//! alphas and conv, LyCORIS variants, xlabs, ai-toolkit; MoE per-expert, stacked, shared-outer
//! and target_parameters layouts), with configs, then mutated: 0-d, empty and huge shapes,
//! dropped or respelled tensors, huge layer indices, wrong-typed config fields.
//!
//! Each input is loaded as the scan loads it: fresh, then twice through the per-thread memo (the
//! second read is a memo hit unless the adapter has kohya alphas), and as `inspect` does. All
//! must return (a panic, caught by the scan as an `internal` error, fails), the memo results must
//! equal the fresh one, the scan row must equal inspect's without its modules, and every
//! problem code must be a documented one.

mod common;

use std::path::PathBuf;

use _core::scan::{load, ScanOptions, Target};
use common::adapters::{file_with_data, nbytes};
use common::alloc::CountingAlloc;
use common::headers::json_strategy;
use proptest::prelude::*;

#[global_allocator]
static ALLOC: CountingAlloc = CountingAlloc;

type Tensor = (String, String, Vec<u64>);

#[derive(Debug, Clone, Copy)]
enum Family {
    Peft,
    Experts2d,
    Stacked3d,
    SharedOuter,
    TargetParameters,
    Diffusers,
    DiffusersLegacy,
    Kohya,
    Lycoris(u8),
    Xlabs,
    AiToolkit,
}

fn family() -> impl Strategy<Value = Family> {
    prop_oneof![
        3 => Just(Family::Peft),
        1 => Just(Family::Experts2d),
        1 => Just(Family::Stacked3d),
        1 => Just(Family::SharedOuter),
        1 => Just(Family::TargetParameters),
        1 => Just(Family::Diffusers),
        1 => Just(Family::DiffusersLegacy),
        2 => Just(Family::Kohya),
        2 => (0u8..7).prop_map(Family::Lycoris),
        1 => Just(Family::Xlabs),
        1 => Just(Family::AiToolkit),
    ]
}

/// The knobs of one generated adapter.
#[derive(Debug, Clone)]
struct Recipe {
    family: Family,
    layers: Vec<u32>,
    leaves: Vec<&'static str>,
    rank: u64,
    dim: u64,
    experts: u64,
    dtype: &'static str,
    extras: u8,
    with_config: bool,
}

fn recipe() -> impl Strategy<Value = Recipe> {
    (
        family(),
        prop::collection::vec(
            prop_oneof![4 => 0u32..4, 1 => Just(999_999_999u32), 1 => any::<u32>()],
            1..3,
        ),
        prop::collection::vec(
            prop::sample::select(&["q_proj", "v_proj", "down_proj", "to_q", "to_out.0", "qkv"][..]),
            1..3,
        ),
        prop::sample::select(&[0u64, 1, 2, 4][..]),
        prop::sample::select(&[0u64, 1, 2, 8][..]),
        1u64..4,
        prop::sample::select(&["F32", "BF16", "F16", "F8_E4M3", "F64"][..]),
        any::<u8>(),
        any::<bool>(),
    )
        .prop_map(
            |(family, layers, leaves, rank, dim, experts, dtype, extras, with_config)| Recipe {
                family,
                layers,
                leaves,
                rank,
                dim,
                experts,
                dtype,
                extras,
                with_config,
            },
        )
}

/// (tensors, adapter_config.json, `__metadata__`) of a recipe.
fn add(t: &mut Vec<Tensor>, dtype: &str, name: String, shape: Vec<u64>) {
    t.push((name, dtype.to_owned(), shape));
}

/// (tensors, adapter_config.json text, `__metadata__` pairs).
type Adapter = (Vec<Tensor>, Option<String>, Option<Vec<(String, String)>>);

fn adapter(r: &Recipe) -> Adapter {
    let (rk, d, e) = (r.rank, r.dim, r.experts);
    let mut t: Vec<Tensor> = Vec::new();
    let extra = |bit: u8| r.extras & (1 << bit) != 0;
    let peft = "base_model.model.model.layers";
    let mut metadata = None;
    for &l in &r.layers {
        for leaf in &r.leaves {
            match r.family {
                Family::Peft => {
                    let m = format!("{peft}.{l}.self_attn.{leaf}");
                    add(&mut t, r.dtype, format!("{m}.lora_A.weight"), vec![rk, d]);
                    add(&mut t, r.dtype, format!("{m}.lora_B.weight"), vec![d, rk]);
                    if extra(0) {
                        add(&mut t, r.dtype, format!("{m}.lora_magnitude_vector"), vec![d]);
                    }
                    if extra(1) {
                        add(&mut t, r.dtype, format!("{m}.lora_B.bias"), vec![d]);
                    }
                }
                Family::Experts2d => {
                    for x in 0..e {
                        let m = format!("{peft}.{l}.mlp.experts.{x}.{leaf}");
                        add(&mut t, r.dtype, format!("{m}.lora_A.weight"), vec![rk, d]);
                        add(&mut t, r.dtype, format!("{m}.lora_B.weight"), vec![d, rk]);
                    }
                }
                Family::Stacked3d | Family::SharedOuter => {
                    let m = format!("{peft}.{l}.mlp.experts.{leaf}");
                    let outer = if matches!(r.family, Family::SharedOuter) { 1 } else { e };
                    add(&mut t, r.dtype, format!("{m}.lora_A.weight"), vec![outer, rk, d]);
                    add(&mut t, r.dtype, format!("{m}.lora_B.weight"), vec![e, d, rk]);
                }
                Family::TargetParameters => {
                    let m = format!("{peft}.{l}.mlp.experts");
                    add(&mut t, r.dtype, format!("{m}.lora_A.weight"), vec![e * rk, d]);
                    add(&mut t, r.dtype, format!("{m}.lora_B.weight"), vec![d, e * rk]);
                    add(
                        &mut t,
                        r.dtype,
                        format!("{m}.base_layer.lora_A.weight"),
                        vec![e * rk, d],
                    );
                    add(
                        &mut t,
                        r.dtype,
                        format!("{m}.base_layer.lora_B.weight"),
                        vec![2 * d, e * rk],
                    );
                }
                Family::Diffusers => {
                    let m = format!("unet.down_blocks.0.attentions.0.transformer_blocks.{l}.attn1.{leaf}");
                    add(&mut t, r.dtype, format!("{m}.lora_A.weight"), vec![rk, d]);
                    add(&mut t, r.dtype, format!("{m}.lora_B.weight"), vec![d, rk]);
                    let config =
                        format!(r#"{{"unet.r": {rk}, "unet.lora_alpha": 8, "unet.target_modules": ["{leaf}"]}}"#);
                    metadata = Some(vec![("lora_adapter_metadata".to_owned(), config)]);
                }
                Family::DiffusersLegacy => {
                    let m =
                        format!("unet.down_blocks.0.attentions.0.transformer_blocks.{l}.attn1.processor.{leaf}_lora");
                    add(&mut t, r.dtype, format!("{m}.down.weight"), vec![rk, d]);
                    add(&mut t, r.dtype, format!("{m}.up.weight"), vec![d, rk]);
                }
                Family::Kohya => {
                    let leaf = leaf.replace('.', "_");
                    let m = format!("lora_unet_down_blocks_0_attentions_0_transformer_blocks_{l}_attn1_{leaf}");
                    if extra(2) {
                        add(&mut t, r.dtype, format!("{m}.lora_down.weight"), vec![rk, d, 3, 3]);
                        add(&mut t, r.dtype, format!("{m}.lora_up.weight"), vec![d, rk, 1, 1]);
                        add(&mut t, r.dtype, format!("{m}.lora_mid.weight"), vec![rk, rk, 3, 3]);
                    } else {
                        add(&mut t, r.dtype, format!("{m}.lora_down.weight"), vec![rk, d]);
                        add(&mut t, r.dtype, format!("{m}.lora_up.weight"), vec![d, rk]);
                    }
                    if extra(3) {
                        add(&mut t, r.dtype, format!("{m}.dora_scale"), vec![d, 1]);
                    }
                    let alpha_dtype = ["F32", "F16", "BF16", "I64"][usize::from(r.extras % 4)];
                    add(&mut t, alpha_dtype, format!("{m}.alpha"), vec![]);
                }
                Family::Lycoris(v) => {
                    let m = format!("lycoris_te_text_model_encoder_layers_{l}_self_attn_{leaf}");
                    let factors: &[(&str, Vec<u64>)] = match v {
                        0 => &[
                            ("hada_w1_a", vec![d, rk]),
                            ("hada_w1_b", vec![rk, d]),
                            ("hada_w2_a", vec![d, rk]),
                            ("hada_w2_b", vec![rk, d]),
                        ],
                        1 => &[
                            ("lokr_w1", vec![2, 2]),
                            ("lokr_w2_a", vec![d, rk]),
                            ("lokr_w2_b", vec![rk, d]),
                        ],
                        2 => &[("oft_blocks", vec![e, d, d])],
                        3 => &[("boft_R", vec![e, 2, d, d]), ("boft_s", vec![d, 1])],
                        4 => &[("ia3_l", vec![d])],
                        5 => &[
                            ("a1.weight", vec![rk, d]),
                            ("a2.weight", vec![d, rk]),
                            ("b1.weight", vec![rk, d]),
                            ("b2.weight", vec![d, rk]),
                        ],
                        _ => &[("diff", vec![d, d]), ("diff_b", vec![d])],
                    };
                    for (suffix, shape) in factors {
                        add(&mut t, r.dtype, format!("{m}.{suffix}"), shape.clone());
                    }
                    if extra(4) {
                        add(&mut t, "F32", format!("{m}.alpha"), vec![]);
                    }
                }
                Family::Xlabs => {
                    let m = format!("double_blocks.{l}.processor.{}_lora1", leaf.replace('.', "_"));
                    add(&mut t, r.dtype, format!("{m}.down.weight"), vec![rk, d]);
                    add(&mut t, r.dtype, format!("{m}.up.weight"), vec![3 * d, rk]);
                }
                Family::AiToolkit => {
                    let m = format!("transformer.double_blocks.{l}.img_attn.{leaf}");
                    add(&mut t, r.dtype, format!("{m}.lora_A.weight"), vec![rk, d]);
                    add(&mut t, r.dtype, format!("{m}.lora_B.weight"), vec![d, rk]);
                }
            }
        }
    }
    if matches!(r.family, Family::Peft) {
        if extra(5) {
            add(
                &mut t,
                r.dtype,
                "base_model.model.model.embed_tokens.lora_embedding_A".to_owned(),
                vec![rk, 16],
            );
            add(
                &mut t,
                r.dtype,
                "base_model.model.model.embed_tokens.lora_embedding_B".to_owned(),
                vec![d, rk],
            );
        }
        if extra(6) {
            add(&mut t, r.dtype, "base_model.model.score.weight".to_owned(), vec![2, d]);
            add(
                &mut t,
                r.dtype,
                "base_model.model.model.embed_tokens.token_adapter.trainable_tokens_delta".to_owned(),
                vec![2, d],
            );
        }
        if extra(7) {
            add(
                &mut t,
                r.dtype,
                "base_model.model.lm_head.base_layer.weight".to_owned(),
                vec![4, d],
            );
        }
    }
    let config = r.with_config.then(|| {
        let leaves: Vec<String> = r.leaves.iter().map(|l| format!("{l:?}")).collect();
        let targets = if extra(1) { r#""all-linear""#.to_owned() } else { format!("[{}]", leaves.join(",")) };
        let parameters = if matches!(r.family, Family::TargetParameters) {
            r#", "target_parameters": ["experts.gate_up_proj", "experts.down_proj"]"#
        } else {
            ""
        };
        let peft_type = match r.family {
            Family::Lycoris(0) => "LOHA",
            Family::Lycoris(1) => "LOKR",
            _ => "LORA",
        };
        format!(
            r#"{{"peft_type": "{peft_type}", "r": {rk}, "lora_alpha": {}, "target_modules": {targets}, "modules_to_save": ["score"], "use_dora": {}, "rank_pattern": {{"down_proj": 2, "layers\\.0\\..*": 4}}{parameters}}}"#,
            2 * rk,
            extra(0)
        )
    });
    (t, config, metadata)
}

#[derive(Debug, Clone)]
enum Twist {
    ZeroD(usize),
    Empty(usize, usize),
    Huge(usize, bool),
    Grow(usize),
    Shrink(usize),
    Drop(usize),
    Respell(usize),
    Repeat(usize),
    LayerIndex(usize, &'static str),
    Dtype(usize, &'static str),
    ConfigField(&'static str, String),
}

fn twist() -> impl Strategy<Value = Twist> {
    let i = any::<usize>();
    prop_oneof![
        3 => i.prop_map(Twist::ZeroD),
        2 => (i, any::<usize>()).prop_map(|(i, at)| Twist::Empty(i, at)),
        2 => (i, any::<bool>()).prop_map(|(i, lead)| Twist::Huge(i, lead)),
        1 => i.prop_map(Twist::Grow),
        1 => i.prop_map(Twist::Shrink),
        2 => i.prop_map(Twist::Drop),
        1 => i.prop_map(Twist::Respell),
        1 => i.prop_map(Twist::Repeat),
        2 => (i, prop::sample::select(&["999999999", "4294967295", "0000000001", "99999999999", "x"][..])).prop_map(|(i, s)| Twist::LayerIndex(i, s)),
        1 => (i, prop::sample::select(&["F4", "BOOL", "U8", "C64", "F6_E2M3"][..])).prop_map(|(i, d)| Twist::Dtype(i, d)),
        2 => (prop::sample::select(&["r", "lora_alpha", "target_modules", "modules_to_save", "rank_pattern", "alpha_pattern", "target_parameters", "use_rslora", "peft_type", "init_lora_weights"][..]), json_strategy())
            .prop_map(|(k, v)| Twist::ConfigField(k, v)),
    ]
}

fn apply(tensors: &mut Vec<Tensor>, config: &mut Option<String>, twist: &Twist) {
    let n = tensors.len();
    let pick = |i: usize| (n > 0).then(|| i % n);
    match twist {
        Twist::ZeroD(i) => pick(*i).into_iter().for_each(|i| tensors[i].2.clear()),
        Twist::Empty(i, at) => {
            if let Some(i) = pick(*i) {
                let shape = &mut tensors[i].2;
                let at = at % (shape.len() + 1);
                shape.insert(at, 0);
            }
        }
        Twist::Huge(i, lead) => {
            if let Some(i) = pick(*i) {
                // Valid only with a 0 dim: a huge extent over no elements.
                tensors[i].2 = if *lead {
                    vec![u64::MAX / 2, 0]
                } else {
                    vec![0, 1 << 40, 1 << 40]
                };
            }
        }
        Twist::Grow(i) => pick(*i).into_iter().for_each(|i| tensors[i].2.insert(0, 2)),
        Twist::Shrink(i) => pick(*i).into_iter().for_each(|i| {
            tensors[i].2.pop();
        }),
        Twist::Drop(i) => {
            if let Some(i) = pick(*i) {
                tensors.remove(i);
            }
        }
        Twist::Respell(i) => {
            if let Some(i) = pick(*i) {
                let name = &mut tensors[i].0;
                *name = name
                    .replace(".lora_A.weight", ".lora_A")
                    .replace(".lora_down.weight", ".lora_A.weight");
            }
        }
        Twist::Repeat(i) => {
            if let Some(i) = pick(*i) {
                let copy = tensors[i].clone();
                tensors.push(copy);
            }
        }
        Twist::LayerIndex(i, index) => {
            if let Some(i) = pick(*i) {
                let name = &tensors[i].0;
                if let Some(at) = name.find("layers.").or_else(|| name.find("blocks_")) {
                    let start = at + 7;
                    let end = start + name[start..].bytes().take_while(u8::is_ascii_digit).count();
                    tensors[i].0 = format!("{}{index}{}", &name[..start], &name[end..]);
                }
            }
        }
        Twist::Dtype(i, dtype) => {
            if let Some(i) = pick(*i) {
                if nbytes(dtype, &tensors[i].2).is_some() {
                    tensors[i].1 = (*dtype).to_owned();
                }
            }
        }
        Twist::ConfigField(key, value) => {
            if let Some(text) = config {
                if let (Ok(serde_json::Value::Object(mut map)), Ok(v)) = (
                    serde_json::from_str::<serde_json::Value>(text),
                    serde_json::from_str::<serde_json::Value>(value),
                ) {
                    map.insert((*key).to_owned(), v);
                    *text = serde_json::Value::Object(map).to_string();
                }
            }
        }
    }
}

/// An input: `u32` config length (`u32::MAX`: none), the config, then the safetensors file.
fn encode(config: Option<&str>, file: &[u8]) -> Vec<u8> {
    let mut out = config.map_or(u32::MAX, |c| c.len() as u32).to_le_bytes().to_vec();
    out.extend_from_slice(config.unwrap_or("").as_bytes());
    out.extend_from_slice(file);
    out
}

fn decode(input: &[u8]) -> Option<(Option<&[u8]>, &[u8])> {
    let len = u32::from_le_bytes(*input.first_chunk::<4>()?);
    let rest = &input[4..];
    if len == u32::MAX {
        return Some((None, rest));
    }
    let len = len as usize;
    (len <= rest.len()).then(|| (Some(&rest[..len]), &rest[len..]))
}

fn inputs() -> impl Strategy<Value = Vec<u8>> {
    (recipe(), prop::collection::vec(twist(), 0..4), any::<u64>()).prop_map(|(r, twists, seed)| {
        let (mut tensors, mut config, metadata) = adapter(&r);
        for t in &twists {
            apply(&mut tensors, &mut config, t);
        }
        // Kohya alphas read real bytes: vary them (0, NaN, negative, ...).
        let file = file_with_data(&tensors, metadata.as_deref(), seed);
        encode(config.as_deref(), &file)
    })
}

fn scratch_dir() -> PathBuf {
    std::env::temp_dir().join(format!("lorafast-fuzz-classify-{}", std::process::id()))
}

fn check(input: &[u8]) -> Result<(), String> {
    let Some((config, file)) = decode(input) else {
        return Ok(());
    };
    let dir = scratch_dir();
    std::fs::create_dir_all(&dir).map_err(|e| e.to_string())?;
    let weights = dir.join("adapter_model.safetensors");
    let config_path = dir.join("adapter_config.json");
    std::fs::write(&weights, file).map_err(|e| e.to_string())?;
    match config {
        Some(text) => std::fs::write(&config_path, text).map_err(|e| e.to_string())?,
        None => drop(std::fs::remove_file(&config_path)),
    }
    let target = Target {
        path: dir.clone(),
        weights,
        config: config.map(|_| config_path),
    };
    let run = |fresh: bool, keep_modules: bool| {
        let opts = ScanOptions {
            fresh,
            keep_modules,
            ..ScanOptions::default()
        };
        load(target.clone(), opts)
    };
    let fresh = run(true, false);
    if let Err(e) = &fresh {
        if e.code() == "internal" {
            return Err(format!("panic inside load: {}", e.detail()));
        }
    }
    let want = format!("{:?}", fresh.as_ref().map_err(|e| (e.code(), e.detail())));
    for pass in ["memo miss", "memo hit"] {
        let got = run(false, false);
        let got = format!("{:?}", got.as_ref().map_err(|e| (e.code(), e.detail())));
        if got != want {
            return Err(format!("{pass} differs from a fresh read:\n{got}\n{want}"));
        }
    }
    let inspect = run(true, true);
    // Python's scans keep modules and metadata (report iteration and module tables need them): through
    // the memo too, such a row is the fresh read's, modules and metadata included.
    let full = |r: &Result<_core::scan::AdapterResult, _core::Error>| {
        format!(
            "{:?}",
            r.as_ref()
                .map(|a| (&a.class, &a.metadata, &a.config_json))
                .map_err(|e| (e.code(), e.detail()))
        )
    };
    let want_full = full(&inspect);
    for pass in ["memo miss, modules kept", "memo hit, modules kept"] {
        let got = full(&run(false, true));
        if got != want_full {
            return Err(format!("{pass} differs from a fresh read:\n{got}\n{want_full}"));
        }
    }
    match (&fresh, &inspect) {
        (Ok(row), Ok(full)) => {
            let mut class = (*full.class).clone();
            class.modules = Default::default();
            if format!("{class:?}") != format!("{:?}", row.class) {
                return Err(format!("scan row and inspect differ:\n{:?}\n{class:?}", row.class));
            }
        }
        (Err(a), Err(b)) if a.code() == b.code() => {}
        _ => {
            return Err(format!(
                "scan and inspect disagree: {} vs {}",
                shown_result(&fresh),
                shown_result(&inspect)
            ))
        }
    }
    Ok(())
}

fn shown_result<T, E: std::fmt::Debug>(r: &Result<T, E>) -> String {
    match r {
        Ok(_) => "ok".to_owned(),
        Err(e) => format!("{e:?}"),
    }
}

#[test]
fn fuzz_classify() {
    common::fuzz::drive("classify", 1500, inputs(), check);
    std::fs::remove_dir_all(scratch_dir()).ok();
}
