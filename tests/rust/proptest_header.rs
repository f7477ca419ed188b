//! Differential test of the header reader against the safetensors crate (`read_metadata`).
//!
//! Generated files are valid or nearly so: random names (escapes, unicode, controls), every dtype,
//! 0-d and empty shapes, contiguous or perturbed offsets, metadata, padding, duplicates, unknown
//! fields, trailing bytes and wrong length prefixes. The property: whenever we accept, the crate
//! accepts the same file and agrees on every name, dtype, shape and offset; whenever the crate
//! accepts and we reject, the reason is one of our documented extra rules (duplicates).

mod common;

use _core::header::parse_file;
use common::headers::{build, case_strategy, compare, file_of};
use proptest::prelude::*;
use safetensors::SafeTensors;

proptest! {
    #![proptest_config(ProptestConfig { cases: 512, ..ProptestConfig::default() })]

    #[test]
    fn agrees_with_safetensors((tensors, order, meta, twists, seed) in case_strategy()) {
        let file = build(&tensors, &order, &meta, &twists, seed);
        let shown = String::from_utf8_lossy(&file[8.min(file.len())..]).chars().take(2000).collect::<String>();
        prop_assert!(compare(&file).is_ok(), "{}\nheader: {shown}", compare(&file).unwrap_err());
    }
}

#[test]
fn serde_quirks_and_limits() {
    let entry = |extra: &str| format!(r#"{{"t":{{"dtype":"F32","shape":[2],"data_offsets":[0,8]{extra}}}}}"#);
    let deep = |open: &str, close: &str, n: usize| entry(&format!(r#","x":{}1{}"#, open.repeat(n), close.repeat(n)));
    let cases = [
        (r#"{"t":["F32",[2],[0,8]]}"#.to_owned(), true),
        (r#"{"t":["F32",[2],[0,8],1]}"#.to_owned(), false),
        (
            r#"{"t":{"dtype":{"F32":null},"shape":[2],"data_offsets":[0,8]}}"#.to_owned(),
            true,
        ),
        (
            r#"{"t":{"dtype":{"F32":{}},"shape":[2],"data_offsets":[0,8]}}"#.to_owned(),
            false,
        ),
        (entry(r#","x":1e309"#), false),
        (entry(r#","x":1.7976931348623157e308"#), true),
        (entry(r#","x":0e99999999999"#), true),
        (entry(&format!(r#","x":{}"#, "9".repeat(308))), true),
        (entry(&format!(r#","x":{}"#, "9".repeat(309))), false),
        (entry(r#","x":1,"x":2"#), true),
        (deep("[", "]", 125), true),
        (deep("[", "]", 126), false),
        (deep("{\"a\":", "}", 125), true),
        (deep("{\"a\":", "}", 126), false),
    ];
    for (header, want) in &cases {
        let file = file_of(header, 8);
        assert_eq!(
            SafeTensors::read_metadata(&file).is_ok(),
            *want,
            "safetensors on {header}"
        );
        assert_eq!(compare(&file), Ok(()), "{header}");
        assert_eq!(parse_file(&file).is_ok(), *want, "lorafast on {header}");
    }
}

#[test]
fn duplicates_are_our_extra_rule() {
    let dup = r#"{"t":{"dtype":"F32","shape":[2],"data_offsets":[4,8]},"t":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}}"#;
    let file = file_of(dup, 8);
    assert!(SafeTensors::read_metadata(&file).is_ok());
    assert_eq!(parse_file(&file).unwrap_err().code(), "duplicate_tensor");
    let meta = r#"{"__metadata__":{"a":"b","a":"c"}}"#;
    let file = file_of(meta, 0);
    assert!(SafeTensors::read_metadata(&file).is_ok());
    assert_eq!(parse_file(&file).unwrap_err().code(), "duplicate_key");
}
