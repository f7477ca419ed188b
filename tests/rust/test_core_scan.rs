//! The scan reads headers with the duplicate-name rule left to the classifier (which finds
//! repeats while grouping tensors). Its verdict must equal the fully checked `parse_header`'s on
//! every file: same error code, same repeated name, same precedence over layout errors. The
//! same files check that a result remembered from an identical header equals a fresh one.

use std::path::PathBuf;

use _core::header::parse_header;
use _core::scan::{load, ScanOptions, Target};

/// Tensor names covering each way a name is grouped: factor slots (two spellings of one slot),
/// LyCORIS variant lists, names no rule understands, trainable tokens.
const NAMES: &[&str] = &[
    "m.lora_A.weight",
    "m.lora_B.weight",
    "m.lora_A",
    "n.lora_A.weight",
    "n.lora_B.weight",
    "x.hada_w1_a",
    "x.hada_w1_b",
    "x.hada_w2_a",
    "junk",
    "other.weight",
    "emb.token_adapter.trainable_tokens_delta",
    "m.alpha",
];

/// Leading `__metadata__` values: none, run-specific ones the memo key leaves out, a diffusers
/// config it keeps, and invalid ones.
const METADATA: &[Option<&str>] = &[
    None,
    Some(r#"{"run":"a"}"#),
    Some(r#"{"run":"bb"}"#),
    Some(r#"{"lora_adapter_metadata":"{\"r\": 4}"}"#),
    Some(r#"{"lora_adapter_metadata":"{\"r\": 8}","run":"c"}"#),
    Some(r#"{"run":1}"#),
    Some(r#"{"run":"a","run":"b"}"#),
    Some("null"),
];

fn header_json(names: &[&str], shift: Option<usize>, metadata: Option<&str>) -> String {
    let entries: Vec<String> = names
        .iter()
        .enumerate()
        .map(|(i, n)| {
            let begin = i * 4 + usize::from(shift == Some(i));
            format!(
                r#""{n}":{{"dtype":"F32","shape":[1],"data_offsets":[{begin},{}]}}"#,
                begin + 4
            )
        })
        .collect();
    let metadata = metadata.map(|m| format!(r#""__metadata__":{m}"#));
    let all: Vec<String> = metadata.into_iter().chain(entries).collect();
    format!("{{{}}}", all.join(","))
}

#[test]
fn scan_finds_the_same_duplicates_as_parse_header() {
    let dir = std::env::temp_dir().join(format!("lorafast-dups-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let mut seed = 0x9E37_79B9_7F4A_7C15u64;
    let mut next = || {
        seed ^= seed << 13;
        seed ^= seed >> 7;
        seed ^= seed << 17;
        seed
    };
    let (mut dups, mut errors) = (0, 0);
    for case in 0..1500 {
        let count = 1 + (next() % 7) as usize;
        let names: Vec<&str> = (0..count)
            .map(|_| NAMES[(next() % NAMES.len() as u64) as usize])
            .collect();
        let shift = (next() % 4 == 0).then(|| (next() % count as u64) as usize);
        let metadata = METADATA[(next() % METADATA.len() as u64) as usize];
        let json = header_json(&names, shift, metadata);
        let data = names.len() * 4;
        let mut file = (json.len() as u64).to_le_bytes().to_vec();
        file.extend_from_slice(json.as_bytes());
        file.resize(file.len() + data, 0);
        let path: PathBuf = dir.join(format!("case-{case}.safetensors"));
        std::fs::write(&path, &file).unwrap();

        let want = parse_header(json.as_bytes(), file.len() as u64)
            .map(|_| ())
            .map_err(|e| (e.code(), e.to_string()));
        let target = Target {
            path: path.clone(),
            weights: path.clone(),
            config: None,
        };
        let outcome = |fresh: bool| {
            let opts = ScanOptions {
                fresh,
                ..ScanOptions::default()
            };
            load(target.clone(), opts)
                .map(|r| format!("{r:?}"))
                .map_err(|e| (e.code(), e.detail()))
        };
        // Many cases repeat an earlier header byte for byte: a remembered result (`_core::scan::memo`)
        // must equal a fresh read in every field.
        let remembered = outcome(false);
        assert_eq!(remembered, outcome(true), "{json}");
        assert_eq!(remembered.map(|_| ()), want, "{json}");
        match &want {
            Err((code, _)) if *code == "duplicate_tensor" => dups += 1,
            Err(_) => errors += 1,
            Ok(()) => {}
        }
        std::fs::remove_file(&path).unwrap();
    }
    std::fs::remove_dir(&dir).ok();
    // The generator must reach both kinds of verdict often.
    assert!(
        dups > 300 && errors > 50,
        "{dups} duplicate cases, {errors} other errors"
    );
}
