//! A fuzz driver on stable Rust: proptest generates inputs (seeded, so a default run is the same
//! every time), each input is checked under `catch_unwind` and the counting allocator, and the
//! saved inputs of `tests/fuzz-corpus/<harness>/` are replayed first. A failing input, shrunk,
//! is written there as `crash-<hash>` so that every later run replays it. A watchdog thread,
//! armed for each input, ends the process when one input runs over the hang limit, after saving
//! that input as `hang-<hash>` (not shrunk: each try would take the whole limit).
//!
//! `LORAFAST_FUZZ_CASES` sets the generated inputs per harness (default: a short pass for
//! `cargo test`); `LORAFAST_FUZZ_SEED` varies the inputs (`make fuzz` uses the clock);
//! `LORAFAST_FUZZ_HANG_SECS` the hang limit in seconds (default 5, fractions allowed);
//! `LORAFAST_FUZZ_CORPUS` the corpus root (default `tests/fuzz-corpus`).

use std::io::Write;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::path::PathBuf;
use std::sync::{Arc, Condvar, Mutex, MutexGuard, PoisonError};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

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

/// Wall time one input may take: `LORAFAST_FUZZ_HANG_SECS` (seconds, > 0), or 5 s.
pub fn hang_limit() -> Duration {
    std::env::var("LORAFAST_FUZZ_HANG_SECS")
        .ok()
        .and_then(|v| v.trim().parse::<f64>().ok())
        .and_then(|secs| Duration::try_from_secs_f64(secs).ok())
        .filter(|limit| !limit.is_zero())
        .unwrap_or(Duration::from_secs(5))
}

/// Where a harness's saved inputs live: `<root>/<harness>`, the root being
/// `LORAFAST_FUZZ_CORPUS` or `tests/fuzz-corpus`.
pub fn corpus_dir(harness: &str) -> PathBuf {
    std::env::var_os("LORAFAST_FUZZ_CORPUS")
        .filter(|root| !root.is_empty())
        .map_or_else(
            || PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fuzz-corpus"),
            PathBuf::from,
        )
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

/// Saves `input` in the harness's corpus as `<kind>-<hash>`; returns the path and how the write went.
fn save(harness: &str, kind: &str, input: &[u8]) -> (PathBuf, std::io::Result<()>) {
    let dir = corpus_dir(harness);
    let path = dir.join(format!("{kind}-{:016x}", fnv(input)));
    let saved = std::fs::create_dir_all(&dir).and_then(|()| std::fs::write(&path, input));
    (path, saved)
}

#[derive(Default)]
struct WatchState {
    /// The input now running and when its time is up; `None` between inputs.
    armed: Option<(Instant, Vec<u8>)>,
    stop: bool,
}

struct Shared {
    state: Mutex<WatchState>,
    wake: Condvar,
}

impl Shared {
    fn lock(&self) -> MutexGuard<'_, WatchState> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

/// A thread that ends the process when an armed input runs past the limit. Panicking would not
/// do: the hung input holds the test's thread, so only the process can be ended. It saves the
/// input as `hang-<hash>` first and writes why to stderr (not through `eprintln!`, which the
/// test harness captures and would never print).
pub struct Watchdog {
    shared: Arc<Shared>,
    limit: Duration,
    thread: Option<JoinHandle<()>>,
}

impl Watchdog {
    pub fn start(harness: &str, limit: Duration) -> Self {
        let shared = Arc::new(Shared {
            state: Mutex::new(WatchState::default()),
            wake: Condvar::new(),
        });
        let watched = Arc::clone(&shared);
        let harness = harness.to_owned();
        let thread = std::thread::Builder::new()
            .name(format!("fuzz-watchdog-{harness}"))
            .spawn(move || watch(&watched, &harness, limit))
            .expect("start the fuzz watchdog thread");
        Watchdog {
            shared,
            limit,
            thread: Some(thread),
        }
    }

    /// Starts the clock for `input`, which takes over from any input armed before.
    pub fn arm(&self, input: &[u8]) {
        self.shared.lock().armed = Some((Instant::now() + self.limit, input.to_vec()));
        self.shared.wake.notify_one();
    }

    pub fn disarm(&self) {
        self.shared.lock().armed = None;
    }
}

impl Drop for Watchdog {
    fn drop(&mut self) {
        self.shared.lock().stop = true;
        self.shared.wake.notify_one();
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

fn watch(shared: &Shared, harness: &str, limit: Duration) {
    let mut state = shared.lock();
    loop {
        if state.stop {
            return;
        }
        let Some((deadline, input)) = &state.armed else {
            state = shared.wake.wait(state).unwrap_or_else(PoisonError::into_inner);
            continue;
        };
        let now = Instant::now();
        if now >= *deadline {
            let (path, saved) = save(harness, "hang", input);
            let _ = writeln!(
                std::io::stderr(),
                "{harness}: an input ran over the hang limit of {:.3} s (LORAFAST_FUZZ_HANG_SECS); \
                 input ({} bytes) saved as {} ({saved:?}); ending the test process",
                limit.as_secs_f64(),
                input.len(),
                path.display(),
            );
            std::process::exit(1);
        }
        let wait = *deadline - now;
        state = shared
            .wake
            .wait_timeout(state, wait)
            .unwrap_or_else(PoisonError::into_inner)
            .0;
    }
}

/// Runs `check` on one input, armed on `watchdog`: a panic or a peak over 10x the input plus
/// 64 MB is a failure, and a run over the hang limit ends the process.
pub fn guarded(check: &dyn Fn(&[u8]) -> Result<(), String>, input: &[u8], watchdog: &Watchdog) -> Result<(), String> {
    watchdog.arm(input);
    let outcome = catch_unwind(AssertUnwindSafe(|| peak_during(|| check(input))));
    watchdog.disarm();
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

/// Replays the corpus, then checks `cases` generated inputs, each under the watchdog. Panics
/// (failing the test) with the input's saved path on the first failure; ends the process on a
/// hang.
pub fn drive<S>(harness: &str, default_cases: u32, strategy: S, check: impl Fn(&[u8]) -> Result<(), String>) -> Ran
where
    S: Strategy<Value = Vec<u8>>,
{
    let check: &dyn Fn(&[u8]) -> Result<(), String> = &check;
    let watchdog = Watchdog::start(harness, hang_limit());
    let saved = corpus(harness);
    for (name, bytes) in &saved {
        if let Err(e) = guarded(check, bytes, &watchdog) {
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
        guarded(check, &input, &watchdog).map_err(TestCaseError::fail)
    });
    match result {
        Ok(()) => {}
        Err(TestError::Fail(reason, input)) => {
            let (path, saved) = save(harness, "crash", &input);
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
