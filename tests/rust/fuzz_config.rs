//! Fuzz harness (d): the config reader. Inputs are JSON texts: random values, config-like
//! objects whose fields get right and wrong types, pattern keys and repeated keys, and the real
//! configs of tests/fixtures/real with values replaced, bytes flipped or the text cut. The
//! reader must return, agree with serde_json on what is valid JSON, and read the same fields
//! through its cursor as through serde_json's `Value`; the matching helpers must return too.

mod common;

use _core::config::{LoraConfig, Matcher, Pattern};
use common::alloc::CountingAlloc;
use common::headers::json_strategy;
use proptest::prelude::*;
use serde_json::Value;

#[global_allocator]
static ALLOC: CountingAlloc = CountingAlloc;

/// Keys beyond the fields the reader knows (`config::KNOWN`): component-scoped fields and near misses.
const EXTRA_KEYS: &[&str] = &[
    "unet.r",
    "unet.lora_alpha",
    "text_encoder.target_modules",
    "x",
    "r ",
    "R",
    "unet.lora_r",
    "unet.lora_",
    "text_encoder.r",
    "text_encoder.rank_pattern",
    ".r",
    "a.b.r",
    "a.b.alpha",
];

/// Every key the generator draws: the reader's own field list, then the extras.
fn keys() -> Vec<&'static str> {
    _core::config::KNOWN.iter().chain(EXTRA_KEYS).copied().collect()
}

const PATTERN_KEYS: &[&str] = &[
    "q_proj",
    "down_proj",
    "model.layers.1.self_attn.q_proj",
    "layers\\.0\\..*",
    "(",
    "[",
    "a{100}",
    "(a|b){50}",
    "\\d+",
    "\\w{100}",
    "(?i)Q_PROJ",
    "q_proj|v_proj",
    "",
    ".*",
    "\\p{Greek}+",
    "x{1000}{1000}",
];

fn pattern_object() -> impl Strategy<Value = String> {
    let value = prop_oneof![
        Just("4".to_owned()),
        Just("0.5".to_owned()),
        Just("-1".to_owned()),
        json_strategy()
    ];
    let few = prop::collection::vec((prop::sample::select(PATTERN_KEYS), value), 0..6).prop_map(|entries| {
        entries
            .iter()
            .map(|(k, v)| format!("{}:{v}", serde_json::to_string(k).unwrap_or_default()))
            .collect::<Vec<_>>()
    });
    // Many distinct keys of one kind: a small text that once compiled to hundreds of megabytes.
    let many = (prop::sample::select(PATTERN_KEYS), 1usize..200).prop_map(|(key, n)| {
        (0..n)
            .map(|i| format!("{}:4", serde_json::to_string(&format!("{key}{i}")).unwrap_or_default()))
            .collect::<Vec<_>>()
    });
    prop_oneof![8 => few, 1 => many].prop_map(|body| format!("{{{}}}", body.join(",")))
}

fn value_strategy() -> impl Strategy<Value = String> {
    prop_oneof![
        2 => json_strategy(),
        1 => prop::sample::select(&["8", "\"8\"", "true", "null", "[\"q_proj\", 7]", "\"all-linear\"", "16.5", "-3", "[]", "{}"][..]).prop_map(str::to_owned),
        1 => prop::collection::vec(prop::sample::select(&["q_proj", "v_proj", "to_out.0", "experts.down_proj", "score", "a.b"][..]), 0..5)
            .prop_map(|v| serde_json::to_string(&v).unwrap_or_default()),
        1 => pattern_object(),
    ]
}

fn config_like() -> impl Strategy<Value = String> {
    let key = prop_oneof![4 => prop::sample::select(keys()).prop_map(str::to_owned), 1 => "[a-z_.]{0,8}"];
    (prop::collection::vec((key, value_strategy()), 0..10), any::<bool>()).prop_map(|(entries, spaced)| {
        let sep = if spaced { ", \n  " } else { "," };
        let body: Vec<String> = entries
            .iter()
            .map(|(k, v)| format!("{}:{v}", serde_json::to_string(k).unwrap_or_default()))
            .collect();
        format!("{{{}}}", body.join(sep))
    })
}

/// The adapter_config.json files of tests/fixtures/real.
fn real_configs() -> Vec<String> {
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/real");
    let mut texts: Vec<String> = std::fs::read_dir(root)
        .into_iter()
        .flatten()
        .filter_map(Result::ok)
        .filter_map(|e| std::fs::read_to_string(e.path().join("adapter_config.json")).ok())
        .collect();
    texts.sort();
    texts
}

#[derive(Debug, Clone)]
enum Mutation {
    Replace(usize, String),
    Flip(usize, u8),
    Cut(usize),
}

fn mutated_real() -> impl Strategy<Value = String> {
    let texts = real_configs();
    assert!(!texts.is_empty(), "tests/fixtures/real has no adapter_config.json");
    let mutation = prop_oneof![
        4 => (any::<usize>(), value_strategy()).prop_map(|(i, v)| Mutation::Replace(i, v)),
        1 => (any::<usize>(), any::<u8>()).prop_map(|(i, b)| Mutation::Flip(i, b)),
        1 => any::<usize>().prop_map(Mutation::Cut),
    ];
    (prop::sample::select(texts), prop::collection::vec(mutation, 0..4)).prop_map(|(text, mutations)| {
        let mut bytes = text.into_bytes();
        for m in mutations {
            match m {
                Mutation::Replace(i, v) => {
                    // Replace the value of one top-level field (when the text is still an object).
                    let Ok(Value::Object(mut map)) = serde_json::from_slice::<Value>(&bytes) else {
                        continue;
                    };
                    if map.is_empty() {
                        continue;
                    }
                    let key = map.keys().nth(i % map.len()).cloned().unwrap_or_default();
                    let Ok(value) = serde_json::from_str::<Value>(&v) else {
                        continue;
                    };
                    map.insert(key, value);
                    bytes = serde_json::to_vec_pretty(&Value::Object(map)).unwrap_or_default();
                }
                Mutation::Flip(i, b) if !bytes.is_empty() => {
                    let n = bytes.len();
                    bytes[i % n] = b;
                }
                Mutation::Cut(i) if !bytes.is_empty() => bytes.truncate(i % bytes.len()),
                _ => {}
            }
        }
        String::from_utf8_lossy(&bytes).into_owned()
    })
}

fn pats(p: &[Pattern]) -> Vec<(String, u64, bool)> {
    p.iter()
        .map(|p| (p.key.clone(), p.value.to_bits(), !matches!(p.matcher, Matcher::Bad)))
        .collect()
}

/// Every field the reader keeps, comparable.
fn summary(c: &LoraConfig) -> String {
    format!(
        "{:?} {:?} {:?} {} {} {:?} {:?} {:?} {:?} {:?} {:?} {} {:?} {:?} {:?}",
        c.peft_type,
        c.r,
        c.lora_alpha.map(f64::to_bits),
        c.use_rslora,
        c.use_dora,
        pats(&c.rank_pattern),
        pats(&c.alpha_pattern),
        c.target_modules,
        c.target_parameters,
        c.base_model_name_or_path,
        c.modules_to_save,
        c.lora_bias,
        c.unsupported_features,
        c.bad_patterns,
        c.invalid_fields
    )
}

const NAMES: &[&str] = &[
    "model.layers.0.self_attn.q_proj",
    "model.layers.1.self_attn.q_proj",
    "model.layers.0.mlp.down_proj",
    "score",
    "a.b.c",
    "",
    "unet.up.0.to_out.0",
    "modelXlayers_1Xself_attnXq_proj",
    "a\nb.q_proj",
    "é.x",
];

/// PEFT's rule, with the regex crate's defaults: each key's `^(?:.*\.)?(?:key)$`, for the keys
/// lorafast evaluates (None for the others).
fn regexes(patterns: &[Pattern]) -> Vec<Option<regex::Regex>> {
    patterns
        .iter()
        .map(|p| match p.matcher {
            Matcher::Bad => None,
            _ => regex::Regex::new(&format!(r"^(?:.*\.)?(?:{})$", p.key)).ok(),
        })
        .collect()
}

/// The value of the first key (in file order) whose regex matches `name`.
fn first_match(patterns: &[Pattern], regexes: &[Option<regex::Regex>], name: &str) -> Option<f64> {
    let i = regexes
        .iter()
        .position(|r| r.as_ref().is_some_and(|r| r.is_match(name)))?;
    Some(patterns[i].value)
}

fn check(input: &[u8]) -> Result<(), String> {
    let Ok(text) = std::str::from_utf8(input) else {
        return Ok(());
    };
    let ours = LoraConfig::from_json(text);
    match serde_json::from_str::<Value>(text) {
        Ok(Value::Object(map)) => {
            let ours = ours.map_err(|e| format!("serde_json reads an object, we reject: {e}"))?;
            let want = LoraConfig::from_map(&map, "");
            if summary(&ours) != summary(&want) {
                return Err(format!("cursor {}\nserde {}", summary(&ours), summary(&want)));
            }
            // diffusers components: one config per prefix of a `<prefix>r` key, as read through serde.
            let want: Vec<(String, String)> = map
                .keys()
                .filter_map(|k| k.strip_suffix('r').filter(|p| p.ends_with('.')))
                .map(|p| (p.to_owned(), summary(&LoraConfig::from_map(&map, p))))
                .collect();
            let got: Vec<(String, String)> = LoraConfig::components_from_json(text)
                .into_iter()
                .flatten()
                .map(|(p, c)| (p, summary(&c)))
                .collect();
            if got != want {
                return Err(format!("components {got:?}\nserde {want:?}"));
            }
        }
        Ok(_) => {
            if ours.is_ok() {
                return Err("a JSON value that is not an object was read as a config".into());
            }
        }
        Err(e) => match ours {
            Ok(_) => return Err(format!("serde_json rejects ({e}), we accept")),
            Err(message) if message != format!("adapter_config.json is not valid JSON: {e}") => {
                return Err(format!("message {message:?}, serde_json: {e}"));
            }
            Err(_) => {}
        },
    }
    let mut configs: Vec<LoraConfig> = LoraConfig::from_json(text).into_iter().collect();
    configs.extend(
        LoraConfig::components_from_json(text)
            .into_iter()
            .flatten()
            .map(|(_, c)| c),
    );
    for c in &configs {
        // A key whose only regex syntax is `.` is always evaluated (never capped or refused).
        for p in c.rank_pattern.iter().chain(&c.alpha_pattern) {
            let plain = regex::escape(&p.key) == p.key.replace('.', "\\.");
            if plain != matches!(p.matcher, Matcher::Plain) {
                return Err(format!("key {:?} read as {:?}", p.key, p.matcher));
            }
        }
        let (rank_regexes, alpha_regexes) = (regexes(&c.rank_pattern), regexes(&c.alpha_pattern));
        for name in NAMES {
            let alpha = c.alpha_for(name).map(f64::to_bits);
            let want = first_match(&c.alpha_pattern, &alpha_regexes, name)
                .or(c.lora_alpha)
                .map(f64::to_bits);
            if alpha != want {
                return Err(format!("alpha_for({name:?}) {alpha:?}, the regexes give {want:?}"));
            }
            let rank = c.rank_for(name);
            let want = first_match(&c.rank_pattern, &rank_regexes, name)
                .map(|v| v as u64)
                .or(c.r);
            if rank != want {
                return Err(format!("rank_for({name:?}) {rank:?}, the regexes give {want:?}"));
            }
            let last = name.rsplit('.').next().unwrap_or(name);
            let _ = (c.rank_for(name), c.alpha_for(name), c.targets(name), c.saves(name));
            let _ = c.last_only_hits(last);
            c.list_hits(name, last, |_| {});
        }
    }
    Ok(())
}

/// Hand-picked texts: repeated keys, wrong types, unknown PEFT features, numbers out of range, and texts
/// serde_json rejects (the cursor must too, with its message).
#[test]
fn hand_picked_texts() {
    for text in [
        r#"{"r": 8, "r": 16, "lora_alpha": 8.5, "use_rslora": true, "target_modules": "all-linear"}"#,
        r#"{"r": -1, "alpha": 4, "rank_pattern": {"b": 2, "a": 3, "b": 5, "c": "x"}, "peft_type": "LOHA"}"#,
        r#"{"r": 8.0, "lora_alpha": 1e3, "target_modules": ["q_proj", 3, "to_out.0"], "modules_to_save": "score"}"#,
        r#"{"init_lora_weights": "PiSSA_niter_4", "layer_replication": [[0, 4]], "use_qalora": false}"#,
        r#"{"alora_invocation_tokens": null, "use_bdlora": {}, "trainable_token_indices": 0, "x": {"y": [1]}}"#,
        r#"{"r": 18446744073709551616, "lora_alpha": -0, "use_dora": 1, "lora_bias": true}"#,
        r#"{"rank_pattern": {"(": 4}, "alpha_pattern": [], "target_parameters": ["experts.down_proj"]}"#,
        r#"  {"base_model_name_or_path": "a\u00e9\n", "r": 4} "#,
        r#"{"r": 1e999}"#,
        "[]",
        r#"{"r": 1,}"#,
        r#"{"a": "\ud800"}"#,
        r#"{"r": 1} x"#,
    ] {
        check(text.as_bytes()).unwrap_or_else(|e| panic!("{text}: {e}"));
    }
}

#[test]
fn fuzz_config() {
    let texts = prop_oneof![
        1 => json_strategy(),
        3 => config_like(),
        3 => mutated_real(),
    ];
    common::fuzz::drive("config", 1500, texts.prop_map(String::into_bytes), check);
}
