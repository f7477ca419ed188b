use super::listing::Dir;
use super::loading::merge_ranges;
use super::url::{parse_url, Kind};

fn walk(keys: &[&str], top_url: &str, recursive: bool) -> Vec<(String, String, Option<String>)> {
    let mut d = Dir::default();
    for k in keys {
        d.insert(&k.split('/').map(str::to_owned).collect::<Vec<_>>());
    }
    let mut out = Vec::new();
    d.walk(top_url, recursive, true, &mut out);
    out.into_iter()
        .map(|r| match r {
            Ok(t) => (
                t.path.display().to_string(),
                t.weights.display().to_string(),
                t.config.map(|c| c.display().to_string()),
            ),
            Err(e) => (e.path().display().to_string(), e.code().to_owned(), None),
        })
        .collect()
}

#[test]
fn parses_urls() {
    let p = parse_url("s3://bucket/a/b.safetensors").unwrap();
    assert_eq!(
        (p.kind, p.base.as_str(), p.key.as_str()),
        (Kind::S3, "s3://bucket", "a/b.safetensors")
    );
    let p = parse_url("http://127.0.0.1:8000/x/").unwrap();
    assert_eq!(
        (p.kind, p.base.as_str(), p.key.as_str()),
        (Kind::Http, "http://127.0.0.1:8000", "x/")
    );
    assert_eq!(parse_url("gs://b").unwrap().key, "");
    assert_eq!(parse_url("https://h/x?sig=1").unwrap_err().code(), "invalid_url");
    assert_eq!(parse_url("hf://org").unwrap_err().code(), "invalid_url");
}

#[test]
fn parses_hf_urls() {
    let p = parse_url("hf://org/repo@v1/sub/adapter_model.safetensors").unwrap();
    assert_eq!(p.kind, Kind::HuggingFace);
    // One store for the whole Hub: repos share its connections.
    assert_eq!(p.base, parse_url("hf://other/model/x.safetensors").unwrap().base);
    assert!(!p.base.contains("/org/repo"), "{}", p.base);
    assert_eq!(p.key, "org/repo/resolve/v1/sub/adapter_model.safetensors");
    let p = parse_url("hf://datasets/org/repo/x.safetensors").unwrap();
    assert_eq!(p.key, "datasets/org/repo/resolve/main/x.safetensors");
}

#[test]
fn listing_follows_local_rules() {
    let keys = [
        "peft/adapter_config.json",
        "peft/adapter_model.safetensors",
        "peft/extra/ignored.safetensors",
        "one/only.safetensors",
        "two/a.safetensors",
        "two/b.safetensors",
        "bin/adapter_config.json",
        "bin/adapter_model.bin",
        ".hidden/x.safetensors",
        "top.safetensors",
        "notes.txt",
    ];
    let got = walk(&keys, "s3://b/", true);
    let want = vec![
        ("s3://b/top.safetensors".into(), "s3://b/top.safetensors".into(), None),
        ("s3://b/bin".into(), "missing_weights".into(), None),
        ("s3://b/one".into(), "s3://b/one/only.safetensors".into(), None),
        (
            "s3://b/peft".into(),
            "s3://b/peft/adapter_model.safetensors".into(),
            Some("s3://b/peft/adapter_config.json".into()),
        ),
        (
            "s3://b/two/a.safetensors".into(),
            "s3://b/two/a.safetensors".into(),
            None,
        ),
        (
            "s3://b/two/b.safetensors".into(),
            "s3://b/two/b.safetensors".into(),
            None,
        ),
    ];
    assert_eq!(got, want);
    // Not recursive: only the top level's files; a top folder with one file is not a "one-file folder".
    assert_eq!(walk(&["only.safetensors"], "s3://b/p", false).len(), 1);
    assert_eq!(walk(&keys, "s3://b", false).len(), 1);
}

#[test]
fn merges_ranges() {
    let r = merge_ranges(&[0..8, 10..12, 100..108, 1000..1004], 50);
    assert_eq!(r, vec![0..12, 100..108, 1000..1004]);
}

#[test]
fn first_read_fits_the_headers_seen() {
    use super::{first_read_size, FIRST_GUESS_BYTES, MIN_SPECULATIVE_BYTES, SPECULATIVE_BYTES};
    // Nothing seen yet, size unknown or over 64 KiB: the guess.
    assert_eq!(first_read_size(0, None), FIRST_GUESS_BYTES);
    assert_eq!(first_read_size(0, Some(SPECULATIVE_BYTES + 1)), FIRST_GUESS_BYTES);
    assert_eq!(first_read_size(8, None), MIN_SPECULATIVE_BYTES);
    assert_eq!(first_read_size(3000, None), 4 << 10); // 3,750 bytes, in 4 KiB steps
    assert_eq!(first_read_size(4000, None), 8 << 10); // 5,000
    assert_eq!(first_read_size(57_000, None), SPECULATIVE_BYTES);
    assert_eq!(first_read_size(10 << 20, None), SPECULATIVE_BYTES);
    assert_eq!(first_read_size(u64::MAX, None), SPECULATIVE_BYTES);
    for n in [1u64, 100, 4096, 20_000, 40_000, 52_000] {
        let got = first_read_size(n, None);
        assert!(got >= n + n / 4 && got % 4096 == 0, "{n}");
    }
}

#[test]
fn first_read_uses_the_listed_size() {
    use super::{first_read_size, SPECULATIVE_BYTES};
    // Nothing seen yet: an object of at most 64 KiB is read whole, so its header never needs a
    // second request, however long.
    assert_eq!(first_read_size(0, Some(40_000)), 40_000);
    assert_eq!(first_read_size(0, Some(SPECULATIVE_BYTES)), SPECULATIVE_BYTES);
    // Once headers are known, no more than the adaptive size, and never past the object's end.
    assert_eq!(first_read_size(3000, Some(40_000)), 4 << 10);
    assert_eq!(first_read_size(3000, Some(1000)), 1000);
    // Empty or tiny objects still ask for the 8-byte length prefix (the answer says what is there).
    assert_eq!(first_read_size(0, Some(0)), 8);
    assert_eq!(first_read_size(5000, Some(3)), 8);
}

#[test]
fn settled_folders_are_emitted_once_and_open_ones_wait() {
    let pages: [&[&str]; 3] = [
        &[
            "a/x.safetensors",
            "b/adapter_config.json",
            "b/adapter_model.safetensors",
            "c/d/one.safetensors",
        ],
        &["c/d/two.safetensors", "c/e/w.safetensors", "f/w.safetensors"],
        &["f/z.safetensors"],
    ];
    let mut d = Dir::default();
    let mut emitted: Vec<Vec<String>> = Vec::new();
    for page in pages {
        let mut got = Vec::new();
        let mut last = Vec::new();
        for k in page {
            last = k.split('/').map(str::to_owned).collect::<Vec<_>>();
            d.insert(&last);
        }
        d.emit_settled("s3://b", &last, &mut |t| got.push(t.weights.display().to_string()));
        emitted.push(got);
    }
    let w = |s: &str| format!("s3://b/{s}");
    // Page 1 ends in c/d: a and b are settled, c (and c/d) are open.
    assert_eq!(emitted[0], vec![w("a/x.safetensors"), w("b/adapter_model.safetensors")]);
    // Page 2 ends in f: c/d now holds two files (two adapters, not a one-file folder), c/e is one.
    assert_eq!(
        emitted[1],
        vec![
            w("c/d/one.safetensors"),
            w("c/d/two.safetensors"),
            w("c/e/w.safetensors")
        ]
    );
    // The last key's folder stays open: the caller emits it from the final walk.
    assert!(emitted[2].is_empty());
}
