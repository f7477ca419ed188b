//! A fuzz driver on stable Rust: proptest generates inputs (seeded, so a default run is the same
//! every time), each input is checked under `catch_unwind` and the counting allocator, and the
//! saved inputs of `tests/fuzz-corpus/<harness>/` are replayed first. A failing input, shrunk,
//! is written there as `crash-<hash>` so that every later run replays it.
//!
//! `LORAFAST_FUZZ_CASES` sets the generated inputs per harness (default: a short pass for
//! `cargo test`); `LORAFAST_FUZZ_SEED` varies the inputs (`make fuzz` uses the clock).

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::path::PathBuf;

use proptest::strategy::Strategy;
use proptest::test_runner::{Config, RngAlgorithm, TestCaseError, TestError, TestRng, TestRunner};

use super::alloc::{memory_bound, peak_during};

/// Generated inputs per harness: `LORAFAST_FUZZ_CASES`, or `default`.
pub fn cases(default: u32) -> u32 {
    std::env::var("LORAFAST_FUZZ_CASES")
        .ok()
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or(default)
}

fn seed() -> u64 {
    std::env::var("LORAFAST_FUZZ_SEED")
        .ok()
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or(0x1f2e_3d4c_5b6a_7988)
}

pub fn corpus_dir(harness: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fuzz-corpus")
        .join(harness)
}

/// The saved inputs of a harness, sorted by name.
pub fn corpus(harness: &str) -> Vec<(String, Vec<u8>)> {
    let Ok(entries) = std::fs::read_dir(corpus_dir(harness)) else {
        return Vec::new();
    };
    let mut files: Vec<(String, Vec<u8>)> = entries
        .filter_map(Result::ok)
        .filter(|e| e.file_type().is_ok_and(|t| t.is_file()))
        .filter_map(|e| {
            Some((
                e.file_name().to_string_lossy().into_owned(),
                std::fs::read(e.path()).ok()?,
            ))
        })
        .collect();
    files.sort();
    files
}

/// Runs `check` on one input: a panic or a peak over 10x the input plus 64 MB is a failure.
pub fn guarded(check: &dyn Fn(&[u8]) -> Result<(), String>, input: &[u8]) -> Result<(), String> {
    let outcome = catch_unwind(AssertUnwindSafe(|| peak_during(|| check(input))));
    match outcome {
        Ok((result, peak)) => {
            result?;
            let bound = memory_bound(input.len());
            if peak > bound {
                return Err(format!(
                    "peak memory {peak} bytes over {bound} for a {}-byte input",
                    input.len()
                ));
            }
            Ok(())
        }
        Err(panic) => {
            let message = panic
                .downcast_ref::<String>()
                .cloned()
                .or_else(|| panic.downcast_ref::<&str>().map(|s| (*s).to_owned()))
                .unwrap_or_default();
            Err(format!("panic: {message}"))
        }
    }
}

fn fnv(bytes: &[u8]) -> u64 {
    bytes.iter().fold(0xcbf2_9ce4_8422_2325u64, |h, &b| {
        (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3)
    })
}

/// What one harness ran.
#[derive(Debug, Clone, Copy)]
pub struct Ran {
    pub corpus: usize,
    pub generated: u64,
}

/// Replays the corpus, then checks `cases` generated inputs. Panics (failing the test) with the
/// input's saved path on the first failure.
pub fn drive<S>(harness: &str, default_cases: u32, strategy: S, check: impl Fn(&[u8]) -> Result<(), String>) -> Ran
where
    S: Strategy<Value = Vec<u8>>,
{
    let check: &dyn Fn(&[u8]) -> Result<(), String> = &check;
    let saved = corpus(harness);
    for (name, bytes) in &saved {
        if let Err(e) = guarded(check, bytes) {
            panic!("{harness}: corpus input {name} fails: {e}");
        }
    }
    let config = Config {
        cases: cases(default_cases),
        failure_persistence: None,
        max_shrink_iters: 2048,
        ..Config::default()
    };
    let mut key = [0u8; 32];
    key[..8].copy_from_slice(&seed().to_le_bytes());
    let rng = TestRng::from_seed(RngAlgorithm::ChaCha, &key);
    let mut runner = TestRunner::new_with_rng(config, rng);
    let generated = std::cell::Cell::new(0u64);
    let result = runner.run(&strategy, |input| {
        generated.set(generated.get() + 1);
        guarded(check, &input).map_err(TestCaseError::fail)
    });
    match result {
        Ok(()) => {}
        Err(TestError::Fail(reason, input)) => {
            let dir = corpus_dir(harness);
            let path = dir.join(format!("crash-{:016x}", fnv(&input)));
            let saved = std::fs::create_dir_all(&dir).and_then(|()| std::fs::write(&path, &input));
            panic!("{harness}: {reason}; input saved as {} ({saved:?})", path.display());
        }
        Err(TestError::Abort(reason)) => panic!("{harness}: aborted: {reason}"),
    }
    let ran = Ran {
        corpus: saved.len(),
        generated: generated.get(),
    };
    eprintln!(
        "fuzz {harness}: {} corpus inputs, {} generated inputs",
        ran.corpus, ran.generated
    );
    ran
}
