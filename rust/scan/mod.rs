//! Finding adapters on disk (`discover`), loading one (config + header + classification, `load`),
//! and the parallel bulk scan, on the core's thread pools (`pool`).

use std::path::PathBuf;
use std::sync::atomic::Ordering;
use std::sync::Arc;

use rayon::prelude::*;

use crate::classify::Classification;
use crate::error::Error;
use crate::header::ReadMode;

mod discover;
mod load;
pub mod memo;
mod pool;
mod progress;

#[cfg(feature = "remote")]
pub(crate) use discover::MISSING_WEIGHTS_WHY;
pub use discover::{discover, discover_stated, locate, Stated};
pub use load::{
    build_result, check_config_size, contain, debug_hook, debug_panic_on, load, parse_config, KEEP_BUF_BYTES,
};
pub use pool::{default_threads, install_fork_guard, with_pool, MAX_THREADS};
pub(crate) use progress::with_progress;

use discover::{expand_inputs, walk, Found, Probed};
use load::load_read;

/// The PEFT config file whose presence makes a folder one PEFT adapter.
pub const CONFIG_NAME: &str = "adapter_config.json";
/// A PEFT folder's weights file.
pub const PEFT_WEIGHTS: &str = "adapter_model.safetensors";

/// One adapter found on disk.
#[derive(Debug, Clone)]
pub struct Target {
    /// The adapter as found: its folder, or the file itself.
    pub path: PathBuf,
    /// The weights file.
    pub weights: PathBuf,
    /// `adapter_config.json`, for a PEFT folder.
    pub config: Option<PathBuf>,
}

/// How to load each adapter.
#[derive(Debug, Clone, Copy, Default)]
pub struct ScanOptions {
    /// How header bytes are read.
    pub mode: ReadMode,
    /// Keep each module's record (`Classification::modules`) and the header's metadata.
    pub keep_modules: bool,
    /// Hash the data section (sha256), as kohya's `sshs_model_hash` does.
    pub content_hash: bool,
    /// Parse and classify every adapter anew, even one whose header and config equal one this
    /// thread has seen (see `memo`); for measuring the full path.
    pub fresh: bool,
}

/// What a successful load gives.
#[derive(Debug, Clone)]
pub struct AdapterResult {
    /// Where the adapter is.
    pub target: Target,
    /// The config's text: the file's, or the one a diffusers header carries in its metadata.
    pub config_json: Option<String>,
    /// The header's `__metadata__` pairs in file order (kept with `keep_modules`).
    pub metadata: Option<Vec<(String, String)>>,
    /// The header's length in bytes.
    pub header_size: u64,
    /// The weights file's size in bytes.
    pub file_size: u64,
    /// What the adapter is: shared with the adapters whose headers the scan thread's memo matched (an
    /// `Arc`, so a memo hit costs one count, not a copy of every list and name in it).
    pub class: Arc<Classification>,
    /// sha256 of the data section, with `content_hash`.
    pub content_hash: Option<String>,
}

/// Finds and loads every adapter under `paths` in one parallel walk, in `discover`'s order:
/// what `scan(discover(paths))` gives, with fewer syscalls per adapter.
pub fn scan_paths(
    paths: &[PathBuf],
    recursive: bool,
    opts: ScanOptions,
    threads: Option<usize>,
    progress: bool,
) -> Vec<Result<AdapterResult, Error>> {
    with_progress(progress, |done| {
        let found = expand_inputs(paths, recursive, false);
        // Without folders to walk, the inputs are all the work there is.
        let work = if found.iter().any(|f| matches!(f, Ok(Found::Folder(_)))) {
            usize::MAX
        } else {
            found.len()
        };
        with_pool(threads.map(|n| n.min(work.max(1))), || {
            done.total.store(found.len(), Ordering::Relaxed);
            let visit = |t: Target, config: Option<Probed>| {
                let r = load_read(t, config.and_then(Probed::bytes), opts);
                done.count.fetch_add(1, Ordering::Relaxed);
                r
            };
            walk(found, recursive, false, &visit, &Err)
        })
    })
}

/// Does this input name a remote object (`s3://...`, `https://...`, `hf://...`) rather than a local
/// path? Any `scheme://` counts, so that an unsupported one (`ftp://`) is reported as `invalid_url`
/// instead of being looked for on disk as `not_found`.
pub fn is_url(s: &str) -> bool {
    s.split_once("://").is_some_and(|(scheme, _)| {
        scheme.as_bytes().first().is_some_and(u8::is_ascii_alphabetic)
            && scheme
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'+' | b'-' | b'.'))
    })
}

/// Loads every target in parallel, in order. With `progress`, a bar on stderr is refreshed by a
/// side thread (the caller decides whether stderr is a terminal).
pub fn scan(
    targets: Vec<Target>,
    opts: ScanOptions,
    threads: Option<usize>,
    progress: bool,
) -> Vec<Result<AdapterResult, Error>> {
    with_progress(progress, |done| {
        done.total.store(targets.len(), Ordering::Relaxed);
        let load_one = |t| {
            let r = load(t, opts);
            done.count.fetch_add(1, Ordering::Relaxed);
            r
        };
        let work = targets.len().max(1);
        with_pool(threads.map(|n| n.min(work)), || {
            targets.into_par_iter().with_min_len(16).map(load_one).collect()
        })
    })
}
