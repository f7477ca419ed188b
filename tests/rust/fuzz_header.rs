//! Fuzz harness (a): header parsing, differential with the safetensors crate. Inputs are whole
//! files: near-valid ones from the shared generators, and raw or mutated bytes. Both readers
//! must accept and reject the same files, agree on what they accept, and report an error from
//! the stage the crate fails in (`common::headers::compare`). The scan's reading (names left to
//! the classifier) must give the same verdict.

mod common;

use _core::header::{parse_file, parse_header_unchecked_names};
use common::alloc::CountingAlloc;
use common::headers::{build, case_strategy, compare};
use proptest::prelude::*;

#[global_allocator]
static ALLOC: CountingAlloc = CountingAlloc;

/// Bytes that are not a generated file: raw noise, or a generated one with random bytes written over.
fn mutated() -> impl Strategy<Value = Vec<u8>> {
    let generated = case_strategy().prop_map(|(t, o, m, w, s)| build(&t, &o, &m, &w, s));
    prop_oneof![
        1 => prop::collection::vec(any::<u8>(), 0..64),
        3 => (generated, prop::collection::vec((any::<usize>(), any::<u8>()), 1..4)).prop_map(|(mut file, edits)| {
            if !file.is_empty() {
                for (at, b) in edits {
                    let n = file.len();
                    file[at % n] = b;
                }
            }
            file
        }),
    ]
}

fn check(file: &[u8]) -> Result<(), String> {
    compare(file)?;
    // The scan's read: same verdict, except that repeated names are found later (by the classifier).
    let full = parse_file(file).map(|_| ()).map_err(|e| e.code());
    if let (Some(prefix), Ok(())) = (file.first_chunk::<8>(), &full) {
        let n = u64::from_le_bytes(*prefix) as usize;
        let unchecked = parse_header_unchecked_names(&file[8..8 + n], file.len() as u64);
        if unchecked.is_err() {
            return Err(format!("the scan's read rejects a valid header: {:?}", unchecked.err()));
        }
    }
    Ok(())
}

#[test]
fn fuzz_header() {
    let files = prop_oneof![
        3 => case_strategy().prop_map(|(t, o, m, w, s)| build(&t, &o, &m, &w, s)),
        1 => mutated(),
    ];
    common::fuzz::drive("header", 3000, files, check);
}
