//! Parsing and classification on hostile inputs: classification is total
//! (0-d factors on MoE modules), memory follows the input (huge layer indices), no quadratic
//! duplicate or `modules_to_save` checks, wrong-typed config fields are problems, and bad UTF-8
//! is the error reported first, as in the safetensors crate.

mod common;

use std::path::Path;

use _core::classify::{classify, Classification, Configs, Options};
use _core::config::LoraConfig;
use _core::header::{parse_file, parse_header};
use _core::scan::{load, ScanOptions, Target};
use _core::ProblemCode;
use common::alloc::{peak_during, CountingAlloc};

#[global_allocator]
static ALLOC: CountingAlloc = CountingAlloc;

/// A file with these (name, dtype, shape) tensors, data contiguous, and its header text.
fn file_of(tensors: &[(&str, &str, &[u64])]) -> Vec<u8> {
    common::adapters::file_of(
        &tensors
            .iter()
            .map(|(n, d, s)| ((*n).to_owned(), (*d).to_owned(), s.to_vec()))
            .collect::<Vec<_>>(),
        None,
    )
}

fn classify_file(file: &[u8], config: Option<&LoraConfig>) -> Classification {
    let header = parse_file(file).expect("a valid header");
    let configs = Configs {
        file: config,
        components: &[],
    };
    classify(
        &header,
        configs,
        Path::new("/nonexistent"),
        Options { keep_modules: true },
    )
}

const EXPERTS: &str = "base_model.model.model.layers.0.mlp.experts";

#[test]
fn zero_d_factor_on_experts_module_is_classified() {
    // 0-d lora_A, 2-D lora_B: the PEFT target_parameters shape test must not index the empty shape.
    let file = file_of(&[
        (&format!("{EXPERTS}.lora_A.weight"), "F32", &[]),
        (&format!("{EXPERTS}.lora_B.weight"), "F32", &[64, 4]),
    ]);
    let c = classify_file(&file, None);
    assert_eq!(c.modules.len(), 1);
    let m = c.modules.get(0).unwrap();
    assert_eq!(m.kind.name(), "target_parameters");
    assert_eq!(m.a_shape, Some(&[][..]));
    // Both ranks unknown from A's side: no rank comparison, no crash.
    assert!(
        c.problems.iter().all(|p| p.code != ProblemCode::RankMismatch),
        "{:?}",
        c.problems
    );
}

#[test]
fn zero_d_b_on_stacked_experts_module_is_classified() {
    // 3-D lora_A makes a stacked module; the shared-outer test must not index the 0-d lora_B.
    let file = file_of(&[
        (&format!("{EXPERTS}.gate_up_proj.lora_A.weight"), "F32", &[8, 4, 16]),
        (&format!("{EXPERTS}.gate_up_proj.lora_B.weight"), "F32", &[]),
    ]);
    let c = classify_file(&file, None);
    assert_eq!(c.modules.get(0).unwrap().kind.name(), "stacked_3d");
    assert_eq!(c.moe_layout.code(), "stacked_3d");
    assert_eq!(c.num_experts, 8);
}

#[test]
fn empty_and_zero_d_shapes_on_every_kind_give_rows() {
    let shapes: [&[u64]; 5] = [&[], &[0], &[0, 5], &[0, 1, 1], &[1, 0, 1, 1]];
    let keys = [
        EXPERTS.to_owned(),
        format!("{EXPERTS}.base_layer"),
        format!("{EXPERTS}.3.w1"),
        format!("{EXPERTS}.gate_up_proj"),
        "base_model.model.model.layers.0.self_attn.q_proj".to_owned(),
    ];
    for key in &keys {
        for a in shapes {
            for b in shapes {
                let file = file_of(&[
                    (&format!("{key}.lora_A.weight"), "BF16", a),
                    (&format!("{key}.lora_B.weight"), "BF16", b),
                ]);
                let c = classify_file(&file, Some(&LoraConfig::from_json(r#"{"r": 4}"#).unwrap()));
                assert_eq!(c.modules.len(), 1, "{key} {a:?} {b:?}");
            }
        }
    }
}

#[test]
fn scan_load_gives_a_row_for_zero_d_experts() {
    let dir = std::env::temp_dir().join(format!("lorafast-zero-d-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("moe.safetensors");
    std::fs::write(
        &path,
        file_of(&[
            (&format!("{EXPERTS}.lora_A.weight"), "F32", &[]),
            (&format!("{EXPERTS}.lora_B.weight"), "F32", &[64, 4]),
        ]),
    )
    .unwrap();
    let target = Target {
        path: path.clone(),
        weights: path.clone(),
        config: None,
    };
    for fresh in [false, true] {
        let opts = ScanOptions {
            fresh,
            ..ScanOptions::default()
        };
        assert!(load(target.clone(), opts).is_ok());
    }
    std::fs::remove_dir_all(&dir).ok();
}

#[test]
fn huge_layer_index_costs_memory_by_count() {
    let file = file_of(&[
        ("model.layers.999999999.q_proj.lora_A.weight", "F32", &[0]),
        ("model.layers.999999999.q_proj.lora_B.weight", "F32", &[0]),
        ("model.layers.3.q_proj.lora_A.weight", "F32", &[0]),
        ("model.layers.3.q_proj.lora_B.weight", "F32", &[0]),
        ("model.layers.70000.q_proj.lora_A.weight", "F32", &[0]),
        ("model.layers.70000.q_proj.lora_B.weight", "F32", &[0]),
    ]);
    let (c, peak) = peak_during(|| classify_file(&file, None));
    assert_eq!(c.layers, [3, 70000, 999_999_999]);
    // Memory follows the count of layers, not the largest index (no bit mask up to it).
    assert!(peak < 1 << 20, "peak {peak} bytes for a {}-byte file", file.len());
}

#[test]
fn metadata_with_many_keys_checks_repeats() {
    // Repeats are found in one hashed pass, not a scan per key.
    let keys: Vec<String> = (0..60_000).map(|i| format!(r#""k{i}":"v""#)).collect();
    let ok = format!(r#"{{"__metadata__":{{{}}}}}"#, keys.join(","));
    let h = parse_header(ok.as_bytes(), 8 + ok.len() as u64).unwrap();
    assert_eq!(h.metadata.unwrap().len(), 60_000);
    let mut dup = keys.clone();
    dup.push(r#""k59998":"w""#.to_owned());
    dup.push(r#""k7":"w""#.to_owned());
    let bad = format!(r#"{{"__metadata__":{{{}}}}}"#, dup.join(","));
    let err = parse_header(bad.as_bytes(), 8 + bad.len() as u64).unwrap_err();
    assert_eq!(err.code(), "duplicate_key");
    // The first key that repeats an earlier one, in file order.
    assert!(err.to_string().contains("k59998"), "{err}");
    // A repeat before a later fault still wins, as when each key was checked as read.
    let bad = r#"{"__metadata__":{"a":"1","a":"2","b":3}}"#;
    assert_eq!(
        parse_header(bad.as_bytes(), 8 + bad.len() as u64).unwrap_err().code(),
        "duplicate_key"
    );
}

#[test]
fn many_modules_to_save_and_unknown_tensors() {
    // One lookup per component, not a substring search per pair.
    let n = 8_000;
    let saved: Vec<String> = (0..n).map(|i| format!("\"head{i}\"")).collect();
    let config = LoraConfig::from_json(&format!(r#"{{"modules_to_save": [{}]}}"#, saved.join(","))).unwrap();
    let names: Vec<String> = (0..n)
        .map(|i| {
            if i % 2 == 0 {
                format!("base_model.model.head{i}.weight")
            } else {
                format!("base_model.model.other{i}.weight")
            }
        })
        .collect();
    let tensors: Vec<(&str, &str, &[u64])> = names.iter().map(|n| (n.as_str(), "F32", &[0u64][..])).collect();
    let c = classify_file(&file_of(&tensors), Some(&config));
    assert_eq!(c.full_weight_tensors.len(), n / 2);
    let unknown = c
        .problems
        .iter()
        .filter(|p| p.code == ProblemCode::UnknownTensor)
        .count();
    // Problems are capped; all that are listed are the unsaved ones.
    assert!(unknown > 0 && c.problems.iter().all(|p| !p.message.contains("head")));
}

#[test]
fn wrong_typed_config_fields_are_problems() {
    let cases = [
        (r#"{"r": "8"}"#, "\"r\" is a string"),
        (r#"{"r": -1}"#, "\"r\" is a negative integer"),
        (r#"{"r": 8.5}"#, "\"r\" is a fractional number"),
        (r#"{"target_modules": 7}"#, "\"target_modules\" is an integer"),
        (
            r#"{"target_modules": ["q_proj", 7]}"#,
            "\"target_modules\" is a list with items",
        ),
        (r#"{"lora_alpha": "16"}"#, "\"lora_alpha\" is a string"),
        (r#"{"use_rslora": 1}"#, "\"use_rslora\" is an integer"),
        (r#"{"use_dora": "yes"}"#, "\"use_dora\" is a string"),
        (r#"{"rank_pattern": ["q_proj"]}"#, "\"rank_pattern\" is a list"),
        (r#"{"rank_pattern": {"q_proj": "4"}}"#, "\"rank_pattern\" is an object"),
        (
            r#"{"alpha_pattern": {"q_proj": null}}"#,
            "\"alpha_pattern\" is an object",
        ),
        (r#"{"modules_to_save": {"a": 1}}"#, "\"modules_to_save\" is an object"),
        (
            r#"{"base_model_name_or_path": 3}"#,
            "\"base_model_name_or_path\" is an integer",
        ),
        (r#"{"peft_type": ["LORA"]}"#, "\"peft_type\" is a list"),
        (r#"{"init_lora_weights": 0}"#, "\"init_lora_weights\" is an integer"),
    ];
    let file = file_of(&[
        ("model.layers.0.q_proj.lora_A.weight", "F32", &[4, 8]),
        ("model.layers.0.q_proj.lora_B.weight", "F32", &[8, 4]),
    ]);
    for (text, want) in cases {
        let config = LoraConfig::from_json(text).unwrap();
        assert_eq!(config.invalid_fields.len(), 1, "{text}: {:?}", config.invalid_fields);
        assert!(
            config.invalid_fields[0].contains(want),
            "{text}: {:?}",
            config.invalid_fields
        );
        let c = classify_file(&file, Some(&config));
        let found: Vec<_> = c
            .problems
            .iter()
            .filter(|p| p.code == ProblemCode::InvalidConfigField)
            .collect();
        assert_eq!(found.len(), 1, "{text}: {:?}", c.problems);
    }
    // Right types, null included, are not problems.
    let good = r#"{"r": 8, "lora_alpha": 16.5, "use_rslora": false, "use_dora": null, "rank_pattern": {"q": 4},
        "alpha_pattern": {"q": 0.5}, "target_modules": "all-linear", "modules_to_save": ["score"],
        "target_parameters": null, "peft_type": "LORA", "init_lora_weights": "gaussian", "layer_replication": [[0, 1]]}"#;
    assert_eq!(
        LoraConfig::from_json(good).unwrap().invalid_fields,
        Vec::<String>::new()
    );
}

#[test]
fn invalid_utf8_is_reported_before_other_faults() {
    // Each header has bad UTF-8 after another fault the reader meets first.
    let faults: [&[u8]; 6] = [
        b"[\"\xff\"]",
        b"{\"t\":{\"dtype\":\"X\",\"shape\":[],\"data_offsets\":[0,0]},\"\xff\":1}",
        b"{\"__metadata__\":{\"a\":1,\"\xff\":\"b\"}}",
        b"{\"t\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[4,8]},\"u\":{\"dtype\":\"F32\",\"shape\":[0],\"data_offsets\":[8,8],\"x\":\"\xfe\"}}",
        b"{\"t\":{\"dtype\":\"F32\",\"shape\":[0],\"data_offsets\":[0,0]},\"t\":{\"dtype\":\"F32\",\"shape\":[0],\"data_offsets\":[0,0],\"\xc3\":0}}",
        b"{\"t\":1} \xff",
    ];
    for header in faults {
        let mut file = (header.len() as u64).to_le_bytes().to_vec();
        file.extend_from_slice(header);
        file.extend_from_slice(&[0; 8]);
        let ours = parse_file(&file).unwrap_err();
        assert_eq!(ours.code(), "invalid_utf8", "{}", String::from_utf8_lossy(header));
        let theirs = safetensors::SafeTensors::read_metadata(&file).unwrap_err();
        assert!(
            matches!(theirs, safetensors::SafeTensorError::InvalidHeader(_)),
            "{theirs:?}"
        );
    }
}

#[test]
fn many_components_pick_the_first_prefix_by_position() {
    // Past 16 components a prefix index replaces the scan per module; the rule stays "first
    // component, in key order, whose prefix the module key starts with".
    let mut pairs: Vec<String> = (0..40).map(|i| format!(r#""c{i}.r": {}"#, i + 1)).collect();
    pairs.push(r#""unet.down.r": 7"#.to_owned());
    pairs.push(r#""unet.r": 5"#.to_owned());
    let components = LoraConfig::components_from_json(&format!("{{{}}}", pairs.join(","))).unwrap();
    assert_eq!(components.len(), 42);
    let keys = [
        "unet.down.x.q_proj",
        "unet.up.q_proj",
        "c3.q_proj",
        "c39.a.b",
        "zzz.q_proj",
    ];
    let tensors: Vec<(String, String, Vec<u64>)> = keys
        .iter()
        .flat_map(|k| {
            [
                (format!("{k}.lora_A.weight"), "F32".to_owned(), vec![2, 2]),
                (format!("{k}.lora_B.weight"), "F32".to_owned(), vec![2, 2]),
            ]
        })
        .collect();
    let file = common::adapters::file_of(&tensors, None);
    let header = parse_file(&file).unwrap();
    let configs = Configs {
        file: None,
        components: &components,
    };
    let c = classify(
        &header,
        configs,
        Path::new("/nonexistent"),
        Options { keep_modules: true },
    );
    let ranks: Vec<Option<u64>> = c.modules.iter().map(|m| m.config_rank).collect();
    assert_eq!(ranks, [Some(7), Some(5), Some(4), Some(40), None]);
}

#[test]
fn many_distinct_leaves_are_listed_once_in_order() {
    let mut tensors = Vec::new();
    for layer in 0..3 {
        for i in 0..100 {
            for f in ["A", "B"] {
                tensors.push((
                    format!("model.layers.{layer}.m{i}.lora_{f}.weight"),
                    "F32".to_owned(),
                    vec![0],
                ));
            }
        }
    }
    let c = classify_file(&common::adapters::file_of(&tensors, None), None);
    let want: Vec<String> = (0..100).map(|i| format!("m{i}")).collect();
    assert_eq!(c.target_modules, want);
    assert_eq!(c.layers, [0, 1, 2]);
}

#[test]
fn many_diffusers_components_read_in_one_pass() {
    // 20,000 components once took a pass over every key per component.
    let pairs: Vec<String> = (0..20_000)
        .map(|i| format!(r#""c{i}.r": {i}, "c{i}.lora_alpha": 2"#))
        .collect();
    let components = LoraConfig::components_from_json(&format!("{{{}}}", pairs.join(","))).unwrap();
    assert_eq!(components.len(), 20_000);
    assert_eq!(components[12_345].0, "c12345.");
    assert_eq!(
        (components[12_345].1.r, components[12_345].1.lora_alpha),
        (Some(12_345), Some(2.0))
    );
}

#[test]
fn many_pattern_keys_resolve_by_lookup() {
    // PEFT writes one rank_pattern key per module; 8,000 keys x 8,000 modules was a compare per pair.
    let mut pairs: Vec<String> = (0..8_000)
        .map(|i| format!(r#""layers.{i}.q_proj": {}"#, i % 7 + 1))
        .collect();
    pairs.insert(3, r#""layers\\.5\\..*": 99"#.to_owned());
    let c = LoraConfig::from_json(&format!(r#"{{"r": 8, "rank_pattern": {{{}}}}}"#, pairs.join(","))).unwrap();
    assert_eq!(c.rank_for("model.layers.3.q_proj"), Some(4));
    // The regex key comes before layers.5's own key in file order: first match wins.
    assert_eq!(c.rank_for("model.layers.5.q_proj"), Some(99));
    assert_eq!(c.rank_for("model.layers.7999.q_proj"), Some(7999 % 7 + 1));
    assert_eq!(c.rank_for("model.layers.8000.q_proj"), Some(8));
    assert_eq!(c.rank_for("xlayers.3.q_proj"), Some(8));
}
