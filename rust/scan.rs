//! Finding adapters on disk, loading one (config + header + classification), and the parallel
//! bulk scan.
//!
//! Discovery rules (documented in the README):
//! - a `.safetensors` file given directly is one adapter;
//! - a folder with `adapter_config.json` is one PEFT adapter (weights: `adapter_model.safetensors`);
//! - a folder without a config that holds exactly one `.safetensors` file and no sub-folders is one
//!   adapter (the diffusers / kohya "folder with one file" form);
//! - any other folder: each `.safetensors` file in it is an adapter, and with `recursive` its
//!   sub-folders are searched by the same rules. Hidden entries (`.name`) are skipped and symlinked
//!   folders are not followed, so a scan cannot loop.

use std::cell::RefCell;
use std::fs;
use std::io::Read;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use rayon::prelude::*;
use sha2::{Digest, Sha256};

use crate::classify::{classify, Classification, Configs, Options};
use crate::config::LoraConfig;
use crate::error::{Error, HeaderError};
use crate::header::{read_header_unchecked_names, Header, ReadMode};

pub const CONFIG_NAME: &str = "adapter_config.json";
pub const PEFT_WEIGHTS: &str = "adapter_model.safetensors";
/// A config larger than this is not an adapter config; refuse rather than read it whole.
const MAX_CONFIG_BYTES: u64 = 16 << 20;

/// One adapter found on disk.
#[derive(Debug, Clone)]
pub struct Target {
    pub path: PathBuf,
    pub weights: PathBuf,
    pub config: Option<PathBuf>,
}

#[derive(Debug, Clone, Copy, Default)]
pub struct ScanOptions {
    pub mode: ReadMode,
    pub keep_modules: bool,
    pub content_hash: bool,
}

/// What a successful load gives.
#[derive(Debug, Clone)]
pub struct AdapterResult {
    pub target: Target,
    pub config_json: Option<String>,
    pub metadata: Option<Vec<(String, String)>>,
    pub header_size: u64,
    pub file_size: u64,
    pub class: Classification,
    pub content_hash: Option<String>,
}

fn is_safetensors(p: &Path) -> bool {
    p.extension().is_some_and(|e| e == "safetensors")
}

fn hidden(p: &Path) -> bool {
    p.file_name()
        .and_then(|n| n.to_str())
        .is_some_and(|n| n.starts_with('.'))
}

/// The single adapter at `path` (the rules `inspect` uses).
pub fn locate(path: &Path) -> Result<Target, Error> {
    let meta = fs::metadata(path).map_err(|e| Error::io(path, e))?;
    if meta.is_file() {
        return Ok(Target {
            path: path.to_path_buf(),
            weights: path.to_path_buf(),
            config: None,
        });
    }
    let config = path.join(CONFIG_NAME);
    if config.is_file() {
        return peft_target(path, config);
    }
    let (files, _dirs) = list_dir(path)?;
    match files.as_slice() {
        [one] => Ok(Target {
            path: path.to_path_buf(),
            weights: one.clone(),
            config: None,
        }),
        [] => Err(Error::adapter(
            path,
            "no_adapter",
            "no adapter_config.json and no .safetensors file in this folder",
        )),
        _ => Err(Error::adapter(
            path,
            "ambiguous_adapter",
            format!(
                "{} .safetensors files and no adapter_config.json; inspect one file, or scan the folder",
                files.len()
            ),
        )),
    }
}

fn peft_target(dir: &Path, config: PathBuf) -> Result<Target, Error> {
    let weights = dir.join(PEFT_WEIGHTS);
    if !weights.is_file() {
        let why = if dir.join("adapter_model.bin").is_file() {
            "adapter_model.bin is a pickle and is not read; convert it to adapter_model.safetensors"
        } else {
            "adapter_config.json but no adapter_model.safetensors"
        };
        return Err(Error::adapter(dir, "missing_weights", why));
    }
    Ok(Target {
        path: dir.to_path_buf(),
        weights,
        config: Some(config),
    })
}

/// (safetensors files, sub-folders) of a folder, sorted, hidden entries left out.
fn list_dir(dir: &Path) -> Result<(Vec<PathBuf>, Vec<PathBuf>), Error> {
    let mut files = Vec::new();
    let mut dirs = Vec::new();
    for entry in fs::read_dir(dir).map_err(|e| Error::io(dir, e))? {
        let entry = entry.map_err(|e| Error::io(dir, e))?;
        let path = entry.path();
        if hidden(&path) {
            continue;
        }
        let Ok(kind) = entry.file_type() else { continue };
        if kind.is_dir() {
            dirs.push(path);
        } else if is_safetensors(&path) && (kind.is_file() || path.is_file()) {
            files.push(path);
        }
    }
    files.sort();
    dirs.sort();
    Ok((files, dirs))
}

/// Finds every adapter under `paths`; folders are searched in parallel.
pub fn discover(paths: &[PathBuf], recursive: bool) -> Vec<Result<Target, Error>> {
    paths.iter().flat_map(|p| discover_one(p, recursive, true)).collect()
}

fn discover_one(path: &Path, recursive: bool, top: bool) -> Vec<Result<Target, Error>> {
    let meta = match fs::metadata(path) {
        Ok(m) => m,
        Err(e) => return vec![Err(Error::io(path, e))],
    };
    if meta.is_file() {
        return if top || is_safetensors(path) {
            vec![Ok(Target {
                path: path.to_path_buf(),
                weights: path.to_path_buf(),
                config: None,
            })]
        } else {
            Vec::new()
        };
    }
    let config = path.join(CONFIG_NAME);
    if config.is_file() {
        return vec![peft_target(path, config)];
    }
    let (files, dirs) = match list_dir(path) {
        Ok(x) => x,
        Err(e) => return vec![Err(e)],
    };
    if files.len() == 1 && dirs.is_empty() && !top {
        return vec![Ok(Target {
            path: path.to_path_buf(),
            weights: files[0].clone(),
            config: None,
        })];
    }
    let mut found: Vec<Result<Target, Error>> = files
        .into_iter()
        .map(|f| {
            Ok(Target {
                path: f.clone(),
                weights: f,
                config: None,
            })
        })
        .collect();
    if recursive {
        let dirs: Vec<PathBuf> = dirs.into_iter().filter(|d| !d.is_symlink()).collect();
        let nested: Vec<Vec<Result<Target, Error>>> = dirs.par_iter().map(|d| discover_one(d, true, false)).collect();
        found.extend(nested.into_iter().flatten());
    }
    found
}

fn read_config(path: &Path) -> Result<(String, LoraConfig), Error> {
    let mut file = fs::File::open(path).map_err(|e| Error::io(path, e))?;
    let len = file.metadata().map_err(|e| Error::io(path, e))?.len();
    check_config_size(path, len)?;
    let mut bytes = Vec::with_capacity(len as usize);
    file.read_to_end(&mut bytes).map_err(|e| Error::io(path, e))?;
    parse_config(path, bytes)
}

/// Refuses a config too large to be one (before it is read whole).
pub fn check_config_size(path: &Path, len: u64) -> Result<(), Error> {
    if len > MAX_CONFIG_BYTES {
        return Err(Error::adapter(
            path,
            "invalid_config",
            format!("{len} bytes is too large for an adapter config"),
        ));
    }
    Ok(())
}

/// Parses the bytes of an `adapter_config.json` (read from disk or fetched from a store).
pub fn parse_config(path: &Path, bytes: Vec<u8>) -> Result<(String, LoraConfig), Error> {
    let text = String::from_utf8(bytes).map_err(|_| {
        Error::adapter(
            path,
            "invalid_config",
            "not UTF-8 text: stream did not contain valid UTF-8",
        )
    })?;
    let config = LoraConfig::from_json(&text).map_err(|message| Error::adapter(path, "invalid_config", message))?;
    Ok((text, config))
}

/// diffusers keeps the PEFT config of each component in `lora_adapter_metadata`, keys prefixed
/// by the component (`unet.r`, `text_encoder.r`): one config per component.
fn metadata_configs(header: &Header<'_>) -> Option<(String, Vec<(String, LoraConfig)>)> {
    let text = header.metadata_value("lora_adapter_metadata")?;
    let configs = LoraConfig::components_from_json(text)?;
    Some((text.to_owned(), configs))
}

thread_local! {
    /// Header bytes, reused across the files one thread reads.
    static BUF: RefCell<Vec<u8>> = const { RefCell::new(Vec::new()) };
}

/// Loads and classifies one adapter.
pub fn load(target: Target, opts: ScanOptions) -> Result<AdapterResult, Error> {
    let config = match &target.config {
        Some(p) => Some(read_config(p)?),
        None => None,
    };
    BUF.with(|buf| {
        let mut buf = buf.borrow_mut();
        // Repeated tensor names are found by `classify` while it groups tensors (cheaper than a
        // separate pass); `duplicate_tensor` turns them back into the header error.
        let header = read_header_unchecked_names(&target.weights, opts.mode, &mut buf)?;
        let content_hash = if opts.content_hash {
            Some(hash_data(&target.weights, header.data_start())?)
        } else {
            None
        };
        let alphas = target.weights.clone();
        let result = build_result(target, config, &header, &alphas, opts, content_hash);
        match result.class.duplicate_tensor {
            Some(name) => Err(Error::Header {
                path: alphas,
                kind: HeaderError::DuplicateTensor(name),
            }),
            None => Ok(result),
        }
    })
}

/// Classifies a read header: the part of a load that local files and remote objects share.
/// `alpha_file` is where `classify` reads kohya `.alpha` scalars from (the weights, or a local
/// stand-in holding the fetched bytes of a remote file).
pub fn build_result(
    target: Target,
    config: Option<(String, LoraConfig)>,
    header: &Header<'_>,
    alpha_file: &Path,
    opts: ScanOptions,
    content_hash: Option<String>,
) -> AdapterResult {
    let meta_config = if config.is_none() {
        metadata_configs(header)
    } else {
        None
    };
    let configs = Configs {
        file: config.as_ref().map(|(_, c)| c),
        components: meta_config.as_ref().map_or(&[], |(_, c)| c.as_slice()),
    };
    let class = classify(
        header,
        configs,
        alpha_file,
        Options {
            keep_modules: opts.keep_modules,
        },
    );
    let metadata = header
        .metadata
        .as_ref()
        .map(|m| m.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect());
    AdapterResult {
        config_json: config.map(|(text, _)| text).or(meta_config.map(|(text, _)| text)),
        metadata: if opts.keep_modules { metadata } else { None },
        header_size: header.header_size,
        file_size: header.file_size,
        class,
        content_hash,
        target,
    }
}

/// sha256 of the data section only, so metadata edits do not change it (kohya's `sshs_model_hash`).
fn hash_data(path: &Path, data_start: u64) -> Result<String, Error> {
    use std::io::{Seek, SeekFrom};
    let mut file = fs::File::open(path).map_err(|e| Error::io(path, e))?;
    file.seek(SeekFrom::Start(data_start)).map_err(|e| Error::io(path, e))?;
    let mut hasher = Sha256::new();
    let mut chunk = vec![0u8; 1 << 20];
    loop {
        let n = file.read(&mut chunk).map_err(|e| Error::io(path, e))?;
        if n == 0 {
            break;
        }
        hasher.update(&chunk[..n]);
    }
    Ok(hasher.finalize().iter().map(|b| format!("{b:02x}")).collect())
}

/// Set in a forked child: rayon's threads did not survive the fork, so run serially there.
static FORKED: AtomicBool = AtomicBool::new(false);
static POOL: OnceLock<Option<rayon::ThreadPool>> = OnceLock::new();

extern "C" fn child_after_fork() {
    FORKED.store(true, Ordering::SeqCst);
}

/// Registers the fork guard; called once when the module loads.
pub fn install_fork_guard() {
    // SAFETY: registers a plain function that only stores to an atomic, which is async-signal-safe.
    unsafe {
        libc::pthread_atfork(None, None, Some(child_after_fork));
    }
}

/// Threads to use: `LORAFAST_NUM_THREADS`, else the available cores.
pub fn default_threads() -> usize {
    std::env::var("LORAFAST_NUM_THREADS")
        .ok()
        .and_then(|v| v.trim().parse::<usize>().ok())
        .filter(|&n| n > 0)
        .unwrap_or_else(|| std::thread::available_parallelism().map_or(1, |n| n.get()))
}

fn build_pool(threads: usize) -> Option<rayon::ThreadPool> {
    rayon::ThreadPoolBuilder::new()
        .num_threads(threads)
        .thread_name(|i| format!("lorafast-{i}"))
        .build()
        .ok()
}

/// Runs `f` on a pool of `threads` (None: the shared default pool), or inline after a fork.
pub fn with_pool<R: Send>(threads: Option<usize>, f: impl FnOnce() -> R + Send) -> R {
    if FORKED.load(Ordering::SeqCst) {
        return f();
    }
    match threads {
        Some(n) if n != default_threads() => match build_pool(n) {
            Some(pool) => pool.install(f),
            None => f(),
        },
        _ => match POOL.get_or_init(|| build_pool(default_threads())) {
            Some(pool) => pool.install(f),
            None => f(),
        },
    }
}

/// Does this input name a remote object (`s3://...`, `https://...`, `hf://...`) rather than a local path?
pub fn is_url(s: &str) -> bool {
    s.split_once("://").is_some_and(|(scheme, _)| {
        matches!(
            scheme,
            "s3" | "s3a" | "gs" | "gcs" | "az" | "azure" | "abfs" | "abfss" | "http" | "https" | "hf"
        )
    })
}

pub fn is_forked() -> bool {
    FORKED.load(Ordering::SeqCst)
}

/// Loads every target in parallel, in order. With `progress`, a bar on stderr is refreshed by a
/// side thread (the caller decides whether stderr is a terminal).
pub fn scan(
    targets: Vec<Target>,
    opts: ScanOptions,
    threads: Option<usize>,
    progress: bool,
) -> Vec<Result<AdapterResult, Error>> {
    let total = targets.len();
    let done = AtomicUsize::new(0);
    let finished = AtomicBool::new(false);
    let work = || {
        if is_forked() {
            targets.into_iter().map(|t| load(t, opts)).collect::<Vec<_>>()
        } else {
            targets
                .into_par_iter()
                .with_min_len(16)
                .map(|t| {
                    let r = load(t, opts);
                    done.fetch_add(1, Ordering::Relaxed);
                    r
                })
                .collect()
        }
    };
    if !progress {
        return with_pool(threads, work);
    }
    std::thread::scope(|s| {
        s.spawn(|| {
            let start = Instant::now();
            while !finished.load(Ordering::Relaxed) {
                std::thread::sleep(Duration::from_millis(100));
                draw_progress(done.load(Ordering::Relaxed), total, start.elapsed());
            }
            draw_progress(done.load(Ordering::Relaxed), total, start.elapsed());
            eprintln!();
        });
        let out = with_pool(threads, work);
        finished.store(true, Ordering::Relaxed);
        out
    })
}

#[allow(clippy::cast_precision_loss)]
pub(crate) fn draw_progress(done: usize, total: usize, elapsed: Duration) {
    let width = 30;
    let filled = (done * width).checked_div(total).unwrap_or(width);
    let rate = done as f64 / elapsed.as_secs_f64().max(1e-3);
    eprint!(
        "\rscanning [{}{}] {done}/{total} adapters, {rate:.0}/s",
        "#".repeat(filled),
        "-".repeat(width - filled)
    );
}
