//! Finding adapters on disk, loading one (config + header + classification), and the parallel
//! bulk scan.
//!
//! Discovery rules (documented in docs/scan.md):
//! - a `.safetensors` file given directly is one adapter (a `.bin` / `.pt` / `.pth` one is read as
//!   torch weights, `torch.rs`);
//! - a folder with `adapter_config.json` is one PEFT adapter (weights: `adapter_model.safetensors`,
//!   else `adapter_model.bin`, else `adapter_model.pt`, vLLM's order);
//! - a folder without a config that holds exactly one `.safetensors` file and no sub-folders is one
//!   adapter (the diffusers / kohya "folder with one file" form);
//! - any other folder: each `.safetensors` file in it is an adapter, and with `recursive` its
//!   sub-folders are searched by the same rules. Hidden entries (`.name`) are skipped and symlinked
//!   folders are not followed, so a scan cannot loop.
//!
//! Every other entry named `*.safetensors` (a FIFO, a device, a dangling link) gets a row with
//! its error. The walk keeps its own work queue, so a deep tree cannot overflow a thread's stack.

use std::cell::RefCell;
use std::fs;
use std::io::Read;
use std::os::unix::ffi::OsStrExt;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::path::{Path, PathBuf};
use std::rc::Rc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Mutex, OnceLock, PoisonError, RwLock};
use std::time::{Duration, Instant};

use rayon::prelude::*;
use sha2::{Digest, Sha256};

use crate::classify::{classify, Classification, Configs, Options};
use crate::config::LoraConfig;
use crate::error::{AdapterErrorCode, Error, HeaderError};
use crate::header::{header_bytes, parse_header_unchecked_names, read_header_from, Header, ReadMode, N_LEN};
use crate::memo;
use crate::open::{not_regular, open_error, open_nonblocking, open_unchecked, stat};
use crate::torch;

/// The PEFT config file whose presence makes a folder one PEFT adapter.
pub const CONFIG_NAME: &str = "adapter_config.json";
/// A PEFT folder's weights file.
pub const PEFT_WEIGHTS: &str = "adapter_model.safetensors";
/// A config larger than this is not an adapter config; refuse rather than read it whole.
const MAX_CONFIG_BYTES: u64 = 16 << 20;

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
    /// What the adapter is.
    pub class: Classification,
    /// sha256 of the data section, with `content_hash`.
    pub content_hash: Option<String>,
}

fn is_safetensors(p: &Path) -> bool {
    p.extension().is_some_and(|e| e == "safetensors")
}

/// Bytes, not text: a name that is not UTF-8 (`.\xff...`) is hidden all the same.
fn hidden(p: &Path) -> bool {
    p.file_name().is_some_and(|n| n.as_bytes().first() == Some(&b'.'))
}

/// The single adapter at `path` (the rules `inspect` uses).
pub fn locate(path: &Path) -> Result<Target, Error> {
    let meta = stat(path)?;
    if !meta.is_file() && !meta.is_dir() {
        return Err(not_regular(path, &meta));
    }
    if meta.is_file() {
        return Ok(Target {
            path: path.to_path_buf(),
            weights: path.to_path_buf(),
            config: None,
        });
    }
    let config = path.join(CONFIG_NAME);
    // Any config but a folder makes a PEFT folder: one that is a FIFO, say, is its load's error.
    if fs::metadata(&config).is_ok_and(|m| !m.is_dir()) {
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
            AdapterErrorCode::NoAdapter,
            "no adapter_config.json and no .safetensors file in this folder",
        )),
        _ => Err(Error::adapter(
            path,
            AdapterErrorCode::AmbiguousAdapter,
            format!(
                "{} .safetensors files and no adapter_config.json; inspect one file, or scan the folder",
                files.len()
            ),
        )),
    }
}

fn peft_target(dir: &Path, config: PathBuf) -> Result<Target, Error> {
    with_weights(peft_paths(dir, config))
}

/// A PEFT target whose weights file is there (checked by `stat`, where nothing opens it).
fn with_weights(t: Target) -> Result<Target, Error> {
    with_weights_stat(t).map(|(t, _)| t)
}

/// `with_weights`, with the weights' metadata where it was the `stat` that checked them.
fn with_weights_stat(t: Target) -> Result<(Target, Option<fs::Metadata>), Error> {
    if t.config.is_none() {
        return Ok((t, None));
    }
    let missing = match fs::metadata(&t.weights) {
        Ok(m) if m.is_file() => return Ok((t, Some(m))),
        Ok(m) if !m.is_dir() => return Err(not_regular(&t.weights, &m)),
        Ok(_) => missing_weights(&t.path),
        Err(e) => weights_error(&t, e),
    };
    torch_fallback(t, missing).map(|t| (t, None))
}

/// A PEFT folder without `adapter_model.safetensors` is read from `adapter_model.bin`, else
/// `adapter_model.pt`, as vLLM picks them (`torch.rs`); else `missing` is its error.
fn torch_fallback(t: Target, missing: Error) -> Result<Target, Error> {
    if !missing.is(AdapterErrorCode::MissingWeights) {
        return Err(missing);
    }
    match torch::fallback_weights(&t.path) {
        Some(weights) => Ok(Target { weights, ..t }),
        None => Err(missing),
    }
}

/// A failure to open or stat a target's weights: `missing_weights` for a PEFT folder without
/// them, else the file's own error (a dangling link is not a missing file).
fn weights_error(t: &Target, e: std::io::Error) -> Error {
    match open_error(&t.weights, e) {
        Error::Io { source, code: None, .. } if t.config.is_some() && source.kind() == std::io::ErrorKind::NotFound => {
            missing_weights(&t.path)
        }
        other => other,
    }
}

/// (safetensors files, sub-folders) of a folder, sorted, hidden entries left out. A symlink to a
/// folder is not a sub-folder (the entry's own type is read, not its target's), so a walk cannot
/// loop. Any other entry named `*.safetensors` counts as a file, so that loading it reports what
/// it is (a FIFO, a device, a dangling link) instead of leaving it out silently.
fn list_dir(dir: &Path) -> Result<(Vec<PathBuf>, Vec<PathBuf>), Error> {
    let unlistable = |e| Error::io_context(dir, "cannot list this folder", e);
    let mut files = Vec::new();
    let mut dirs = Vec::new();
    for entry in fs::read_dir(dir).map_err(unlistable)? {
        let entry = entry.map_err(unlistable)?;
        let path = entry.path();
        if hidden(&path) {
            continue;
        }
        let Ok(kind) = entry.file_type() else { continue };
        if kind.is_dir() {
            dirs.push(path);
        } else if is_safetensors(&path) && !(kind.is_symlink() && path.is_dir()) {
            files.push(path);
        }
    }
    // Entries of one folder share their parent, so byte order is `Path`'s component order, and
    // cheaper to compute.
    files.sort_unstable_by(|a, b| a.as_os_str().cmp(b.as_os_str()));
    dirs.sort_unstable_by(|a, b| a.as_os_str().cmp(b.as_os_str()));
    Ok((files, dirs))
}

/// An entry of a walk: an adapter found, or a sub-folder whose kind is decided when the walk
/// reaches it. Deciding late costs nothing for a PEFT folder: opening its `adapter_config.json`
/// is both the test and the first step of reading it (a `stat` first would be a third syscall).
enum Found {
    Target(Target),
    Folder(PathBuf),
}

/// The bytes of a config file, read while deciding what its folder is.
type ConfigBytes = Vec<u8>;

/// What a walk kept of a PEFT folder's config while telling the folder's kind. A scan reads it (its load
/// needs the bytes next); discovery alone `stat`s it, which tells the same (see `stat_config_file`) in one
/// syscall instead of an open, two reads and a close, and keeps the stat (`lorafast.Index` signs it).
enum Probed {
    Bytes(ConfigBytes),
    Stat(fs::Metadata),
}

impl Probed {
    fn bytes(self) -> Option<ConfigBytes> {
        match self {
            Probed::Bytes(b) => Some(b),
            Probed::Stat(_) => None,
        }
    }
}

/// What a folder holds, by the discovery rules.
enum Folder {
    /// A PEFT adapter, with what telling it kept of its config (none when that failed: loading reports why).
    Peft(Target, Option<Probed>),
    /// One adapter file (a folder without a config holding one `.safetensors` file).
    Single(Target),
    /// Adapter files, and sub-folders to search (with `recursive`).
    Entries(Vec<Found>),
}

/// Reads the adapter config at `path`: None when there is no such file (or it is a folder).
/// Opening it is the test, so a PEFT folder costs no `stat`; it is opened without blocking, and
/// only a read that did not give plain text (an error, nothing, too much) asks with `fstat` what
/// the file is, so a FIFO or device is reported as `not_regular_file` at no cost to real configs.
fn read_config_file(path: &Path) -> Result<Option<ConfigBytes>, Error> {
    let file = match open_unchecked(path) {
        Ok(f) => f,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound || e.raw_os_error() == Some(libc::ENOTDIR) => {
            return Ok(None)
        }
        Err(e) => return Err(open_error(path, e)),
    };
    let mut bytes = Vec::with_capacity(4096);
    let read = (&file).take(MAX_CONFIG_BYTES + 1).read_to_end(&mut bytes);
    if matches!(read, Ok(n) if n > 0 && n as u64 <= MAX_CONFIG_BYTES) {
        return Ok(Some(bytes));
    }
    let meta = file.metadata().map_err(|e| Error::io(path, e))?;
    if meta.is_dir() {
        return Ok(None);
    }
    if !meta.is_file() {
        return Err(not_regular(path, &meta));
    }
    match read {
        Err(e) => Err(Error::io(path, e)),
        Ok(_) if bytes.len() as u64 > MAX_CONFIG_BYTES => {
            Err(config_too_large(path, meta.len().max(MAX_CONFIG_BYTES + 1)))
        }
        Ok(_) => Ok(Some(bytes)),
    }
}

/// `read_config_file`'s answer without the read: the config's metadata, None when there is no such file
/// (or it is a folder). Any other file, or a failure that is not its absence, makes the folder a PEFT one
/// either way: the read would only pass the bytes, or the error, on to the load.
fn stat_config_file(path: &Path) -> Result<Option<fs::Metadata>, Error> {
    match fs::metadata(path) {
        Ok(m) if m.is_dir() => Ok(None),
        Ok(m) => Ok(Some(m)),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound || e.raw_os_error() == Some(libc::ENOTDIR) => Ok(None),
        Err(e) => Err(Error::io(path, e)),
    }
}

/// The kind of folder `dir` is; with `stat`, its config is told by a `stat` rather than read (`Probed`).
fn resolve_folder(dir: &Path, recursive: bool, top: bool, stat: bool) -> Result<Folder, Error> {
    let config = dir.join(CONFIG_NAME);
    let probed = if stat {
        stat_config_file(&config).map(|m| m.map(Probed::Stat))
    } else {
        read_config_file(&config).map(|b| b.map(Probed::Bytes))
    };
    match probed {
        Ok(Some(probed)) => return Ok(Folder::Peft(peft_paths(dir, config), Some(probed))),
        Ok(None) => {}
        // The folder cannot be searched (no `x` permission): say so of the folder, not of a file
        // in it. Told apart from an unreadable config by one `lstat`, on this failure path only.
        Err(Error::Io { source, .. })
            if source.kind() == std::io::ErrorKind::PermissionDenied
                && fs::symlink_metadata(&config).is_err_and(|e| e.kind() == std::io::ErrorKind::PermissionDenied) =>
        {
            return Err(Error::io_context(dir, "cannot search this folder", source));
        }
        // It exists but cannot be read: still a PEFT folder, whose load reports the error.
        Err(_) => return Ok(Folder::Peft(peft_paths(dir, config), None)),
    }
    let (files, dirs) = list_dir(dir)?;
    if files.len() == 1 && dirs.is_empty() && !top {
        return Ok(Folder::Single(Target {
            path: dir.to_path_buf(),
            weights: files[0].clone(),
            config: None,
        }));
    }
    let mut found: Vec<Found> = files
        .into_iter()
        .map(|f| {
            Found::Target(Target {
                path: f.clone(),
                weights: f,
                config: None,
            })
        })
        .collect();
    if recursive {
        found.extend(dirs.into_iter().map(Found::Folder));
    }
    Ok(Folder::Entries(found))
}

fn peft_paths(dir: &Path, config: PathBuf) -> Target {
    Target {
        path: dir.to_path_buf(),
        weights: dir.join(PEFT_WEIGHTS),
        config: Some(config),
    }
}

/// Why a PEFT folder is `missing_weights`; remote scans say the same.
pub(crate) const MISSING_WEIGHTS_WHY: &str =
    "adapter_config.json but no adapter_model.safetensors, adapter_model.bin or adapter_model.pt";

/// The error for a PEFT folder whose weights file is missing.
fn missing_weights(dir: &Path) -> Error {
    Error::adapter(dir, AdapterErrorCode::MissingWeights, MISSING_WEIGHTS_WHY)
}

/// The entries of one input path; its sub-folders are left for the walk.
fn expand_input(path: &Path, recursive: bool, stat_configs: bool) -> Vec<Result<Found, Error>> {
    let meta = match stat(path) {
        Ok(m) => m,
        Err(e) => return vec![Err(e)],
    };
    if !meta.is_file() && !meta.is_dir() {
        return vec![Err(not_regular(path, &meta))];
    }
    if meta.is_file() {
        return vec![Ok(Found::Target(Target {
            path: path.to_path_buf(),
            weights: path.to_path_buf(),
            config: None,
        }))];
    }
    match resolve_folder(path, recursive, true, stat_configs) {
        Ok(Folder::Peft(t, _)) => vec![with_weights(t).map(Found::Target)],
        Ok(Folder::Single(t)) => vec![Ok(Found::Target(t))],
        Ok(Folder::Entries(found)) => found.into_iter().map(Ok).collect(),
        Err(e) => vec![Err(e)],
    }
}

/// Where a row belongs in the walk's order: its index in each folder on the way down to it.
type Key = Vec<u32>;

/// Entries per job of a walk: enough to pay for the job, few enough to share a folder's work.
const WALK_CHUNK: usize = 8;

/// One walk: what to do with each adapter (`visit`, given its config's bytes when already read)
/// and each error (`failed`), and the rows so far, each with its `Key`.
struct Walk<'a, V, F, R> {
    recursive: bool,
    /// Tell PEFT folders by a `stat` of their config (`Probed`).
    stat: bool,
    visit: &'a V,
    failed: &'a F,
    rows: Mutex<Vec<(Key, R)>>,
}

impl<V, F, R> Walk<'_, V, F, R>
where
    V: Fn(Target, Option<Probed>) -> R + Sync,
    F: Fn(Error) -> R + Sync,
    R: Send,
{
    fn push(&self, key: Key, row: R) {
        self.rows
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .push((key, row));
    }

    /// A sub-folder reached: its one row, or the entries in it to walk next.
    fn enter(&self, dir: &Path) -> Result<R, Vec<Found>> {
        match resolve_folder(dir, self.recursive, false, self.stat) {
            Err(e) => Ok((self.failed)(e)),
            Ok(Folder::Peft(t, config)) => Ok((self.visit)(t, config)),
            Ok(Folder::Single(t)) => Ok((self.visit)(t, None)),
            Ok(Folder::Entries(found)) => Err(found),
        }
    }

    /// The entries of one folder in parallel: jobs of up to `WALK_CHUNK` entries on the pool's
    /// queue. A job never waits for another (no `join`), so no job runs nested on top of a waiting
    /// one, and the stack stays flat however deep the tree is; a sub-folder's entries become jobs
    /// of their own.
    fn entries<'s>(&'s self, s: &rayon::Scope<'s>, key: &[u32], found: Vec<Result<Found, Error>>) {
        let mut found = found.into_iter().enumerate().peekable();
        while found.peek().is_some() {
            let chunk: Vec<_> = found.by_ref().take(WALK_CHUNK).collect();
            let key = key.to_vec();
            s.spawn(move |s| {
                for (i, f) in chunk {
                    self.entry(s, &key, i, f);
                }
            });
        }
    }

    fn entry<'s>(&'s self, s: &rayon::Scope<'s>, parent: &[u32], i: usize, f: Result<Found, Error>) {
        let mut key = Key::with_capacity(parent.len() + 1);
        key.extend_from_slice(parent);
        key.push(u32::try_from(i).unwrap_or(u32::MAX));
        match f {
            Err(e) => self.push(key, (self.failed)(e)),
            Ok(Found::Target(t)) => self.push(key, (self.visit)(t, None)),
            Ok(Found::Folder(dir)) => match self.enter(&dir) {
                Ok(row) => self.push(key, row),
                Err(found) => self.entries(s, &key, found.into_iter().map(Ok).collect()),
            },
        }
    }

    /// The rows in order: a folder's rows in its place, as a depth-first walk gives them.
    fn into_rows(self) -> Vec<R> {
        let mut rows = self.rows.into_inner().unwrap_or_else(PoisonError::into_inner);
        rows.sort_unstable_by(|a, b| a.0.cmp(&b.0));
        rows.into_iter().map(|(_, r)| r).collect()
    }
}

/// Walks `found` in parallel and in order, resolving sub-folders on the way (`stat`: see `Probed`):
/// `visit` gets each adapter (with what telling its folder kept of its config), `failed` each error.
/// Runs on the pool of the caller's `with_pool` (never rayon's global pool, which hangs in a forked
/// child).
fn walk<R: Send>(
    found: Vec<Result<Found, Error>>,
    recursive: bool,
    stat: bool,
    visit: &(impl Fn(Target, Option<Probed>) -> R + Sync),
    failed: &(impl Fn(Error) -> R + Sync),
) -> Vec<R> {
    let walk = Walk {
        recursive,
        stat,
        visit,
        failed,
        rows: Mutex::new(Vec::with_capacity(found.len())),
    };
    rayon::scope(|s| walk.entries(s, &[], found));
    walk.into_rows()
}

fn expand_inputs(paths: &[PathBuf], recursive: bool, stat: bool) -> Vec<Result<Found, Error>> {
    paths.iter().flat_map(|p| expand_input(p, recursive, stat)).collect()
}

/// Finds every adapter under `paths`; folders are searched in parallel, and configs are not read.
pub fn discover(paths: &[PathBuf], recursive: bool) -> Vec<Result<Target, Error>> {
    let visit = |t: Target, _config: Option<Probed>| with_weights(t);
    walk(expand_inputs(paths, recursive, true), recursive, true, &visit, &Err)
}

/// A discovered adapter with the metadata of its weights and config where discovery had them (None
/// where it had no need to look), for `lorafast.Index`'s signatures.
pub type Stated = Result<(Target, Option<fs::Metadata>, Option<fs::Metadata>), Error>;

/// `discover`, each adapter with the metadata its discovery got: a PEFT folder's weights and config
/// cost two `stat`s in all, which are its signature's too.
pub fn discover_stated(paths: &[PathBuf], recursive: bool) -> Vec<Stated> {
    let visit = |t: Target, config: Option<Probed>| {
        let config = match config {
            Some(Probed::Stat(m)) => Some(m),
            _ => None,
        };
        with_weights_stat(t).map(|(t, weights)| (t, weights, config))
    };
    walk(expand_inputs(paths, recursive, true), recursive, true, &visit, &Err)
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

/// Refuses a config too large to be one (before it is read whole).
pub fn check_config_size(path: &Path, len: u64) -> Result<(), Error> {
    if len > MAX_CONFIG_BYTES {
        return Err(config_too_large(path, len));
    }
    Ok(())
}

fn config_too_large(path: &Path, len: u64) -> Error {
    Error::adapter(
        path,
        AdapterErrorCode::InvalidConfig,
        format!("{len} bytes is too large for an adapter config"),
    )
}

/// Parses the bytes of an `adapter_config.json` (read from disk or fetched from a store).
pub fn parse_config(path: &Path, bytes: Vec<u8>) -> Result<(String, LoraConfig), Error> {
    let text = config_text(path, bytes)?;
    let config = parse_config_text(path, &text)?;
    Ok((text, config))
}

fn config_text(path: &Path, bytes: Vec<u8>) -> Result<String, Error> {
    String::from_utf8(bytes).map_err(|_| {
        Error::adapter(
            path,
            AdapterErrorCode::InvalidConfig,
            "not UTF-8 text: stream did not contain valid UTF-8",
        )
    })
}

fn parse_config_text(path: &Path, text: &str) -> Result<LoraConfig, Error> {
    LoraConfig::from_json(text).map_err(|message| Error::adapter(path, AdapterErrorCode::InvalidConfig, message))
}

/// Configs a scan thread keeps parsed, by text (see `parse_config_kept`).
const CONFIGS_KEPT: usize = 8;
/// The longest config text kept: memory per thread stays bounded.
const MAX_KEPT_CONFIG: usize = 64 << 10;

thread_local! {
    /// The configs this thread parsed last, most recent first: the adapters of a fleet share a
    /// few configs, and parsing one costs about as much as a tenth of a 448-tensor header.
    static CONFIGS: RefCell<Vec<(String, Rc<LoraConfig>)>> = const { RefCell::new(Vec::new()) };
}

/// `parse_config_text`, answered from this thread's parsed configs when `text` is one of them.
/// A config is a pure function of its text, so a kept one is exactly what a new parse gives.
fn parse_config_kept(path: &Path, text: &str) -> Result<Rc<LoraConfig>, Error> {
    let kept = CONFIGS.with(|cell| {
        let mut configs = cell.borrow_mut();
        let i = configs.iter().position(|(t, _)| t == text)?;
        configs[..=i].rotate_right(1);
        Some(Rc::clone(&configs[0].1))
    });
    if let Some(config) = kept {
        return Ok(config);
    }
    let config = Rc::new(parse_config_text(path, text)?);
    if text.len() <= MAX_KEPT_CONFIG {
        CONFIGS.with(|cell| {
            let mut configs = cell.borrow_mut();
            configs.truncate(CONFIGS_KEPT - 1);
            configs.insert(0, (text.to_owned(), Rc::clone(&config)));
        });
    }
    Ok(config)
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

/// A thread keeps its header buffer between files up to this size. A larger one (a rare header
/// of many megabytes) is freed after its file, not held for the life of the thread.
pub const KEEP_BUF_BYTES: usize = 4 << 20;

/// Loads and classifies one adapter. A panic while doing so becomes its `internal` error.
pub fn load(target: Target, opts: ScanOptions) -> Result<AdapterResult, Error> {
    load_read(target, None, opts)
}

/// `load` with the config's bytes already read (None: read them here, if the target has a config).
fn load_read(target: Target, config: Option<ConfigBytes>, opts: ScanOptions) -> Result<AdapterResult, Error> {
    let at = target.weights.clone();
    contain(&at, || load_inner(target, config, opts))
}

/// Runs `f`, the work for `path`; a panic in it becomes `path`'s error (code `internal`) instead
/// of unwinding through a scan and losing every other row.
pub fn contain<T>(path: &Path, f: impl FnOnce() -> Result<T, Error>) -> Result<T, Error> {
    catch_unwind(AssertUnwindSafe(f)).unwrap_or_else(|payload| Err(Error::panicked(path, &*payload)))
}

/// Test hook behind `_core._debug_panic_on`: loading these weights panics, so that tests can show
/// a panic becoming an error row or exception. Not public API.
static PANIC_ON: RwLock<Option<PathBuf>> = RwLock::new(None);
static PANIC_ARMED: AtomicBool = AtomicBool::new(false);

/// Arms (`Some`) or disarms (`None`) the test hook that makes loading `path` panic.
pub fn debug_panic_on(path: Option<PathBuf>) {
    PANIC_ARMED.store(path.is_some(), Ordering::SeqCst);
    *PANIC_ON.write().unwrap_or_else(PoisonError::into_inner) = path;
}

/// Panics when the test hook is armed for `path` (see `debug_panic_on`); else does nothing.
pub fn debug_hook(path: &Path) {
    if PANIC_ARMED.load(Ordering::Relaxed) && PANIC_ON.read().is_ok_and(|p| p.as_deref() == Some(path)) {
        panic!("debug hook: forced panic while classifying {}", path.display());
    }
}

fn load_inner(target: Target, config: Option<ConfigBytes>, opts: ScanOptions) -> Result<AdapterResult, Error> {
    debug_hook(&target.weights);
    // The weights first: a PEFT folder without them is `missing_weights`, whatever its config holds.
    // Opened without blocking and checked to be a regular file: a FIFO or device is reported.
    if torch::is_torch_weights(&target.weights) {
        return torch::load(target, config, opts);
    }
    let (weights, meta) = match open_nonblocking(&target.weights) {
        Ok((_, meta)) if target.config.is_some() && meta.is_dir() => {
            let missing = missing_weights(&target.path);
            return torch::load(torch_fallback(target, missing)?, config, opts);
        }
        Ok(opened) => opened,
        Err(e) => {
            let missing = weights_error(&target, e);
            return torch::load(torch_fallback(target, missing)?, config, opts);
        }
    };
    if !meta.is_file() {
        return Err(not_regular(&target.weights, &meta));
    }
    let text = match (config, &target.config) {
        (Some(bytes), Some(path)) => Some(config_text(path, bytes)?),
        (None, Some(path)) => match read_config_file(path)? {
            Some(bytes) => Some(config_text(path, bytes)?),
            None => return Err(Error::io(path, std::io::ErrorKind::NotFound.into())),
        },
        _ => None,
    };
    BUF.with(|cell| {
        let mut buf = cell.borrow_mut();
        let result = load_header(target, &weights, meta.len(), text, opts, &mut buf);
        if buf.capacity() > KEEP_BUF_BYTES {
            *buf = Vec::new();
        }
        result
    })
}

/// The rest of a load, with the weights open and the config's text read: header, memo, classification.
fn load_header(
    target: Target,
    weights: &fs::File,
    len: u64,
    text: Option<String>,
    opts: ScanOptions,
    buf: &mut Vec<u8>,
) -> Result<AdapterResult, Error> {
    let config_path = target.config.clone().unwrap_or_default();
    let parse_config = |text: &String| parse_config_text(&config_path, text);
    let (file_size, n) = match read_header_from(weights, &target.weights, len, opts.mode, buf) {
        Ok(x) => x,
        Err(e) => {
            // A bad config is reported before a bad header, as when it is read first.
            text.as_ref().map(parse_config).transpose()?;
            return Err(e);
        }
    };
    let bytes = header_bytes(buf, n);
    let content_hash = if opts.content_hash {
        Some(hash_data(weights, &target.weights, N_LEN + n as u64)?)
    } else {
        None
    };
    let remember = !opts.fresh;
    let key = remember.then(|| memo::Key::of(bytes, file_size, text.as_deref()).with_modules(opts.keep_modules));
    // A remembered classification shares its modules (an `Arc`); the metadata is the adapter's own.
    let hit = key.as_ref().and_then(memo::get).and_then(|(class, config_json)| {
        if !opts.keep_modules {
            return Some((class, config_json, None));
        }
        leading_metadata(bytes).map(|metadata| (class, config_json, metadata))
    });
    let result = match hit {
        Some((class, config_json, metadata)) => AdapterResult {
            config_json,
            metadata,
            header_size: n as u64,
            file_size,
            class,
            content_hash,
            target,
        },
        None => {
            let config = text.as_ref().map(|t| parse_config_kept(&config_path, t)).transpose()?;
            // Repeated tensor names are found by `classify` while it groups tensors (cheaper
            // than a separate pass); `duplicate_tensor` turns them back into the header error.
            let header = parse_header_unchecked_names(bytes, file_size).map_err(|kind| Error::Header {
                path: target.weights.clone(),
                kind,
            })?;
            let alphas = target.weights.clone();
            let result = build_result_of(
                target,
                text.clone(),
                config.as_deref(),
                &header,
                &alphas,
                opts,
                content_hash,
            );
            if let Some(key) = &key {
                memo::put(key, &result.class, result.config_json.as_deref());
            }
            result
        }
    };
    match result.class.duplicate_tensor {
        Some(ref name) => Err(Error::Header {
            path: result.target.weights.clone(),
            kind: HeaderError::DuplicateTensor(name.clone()),
        }),
        None => Ok(result),
    }
}

/// The `__metadata__` of a header that opens with it, as a full read keeps it (`Some(None)` when
/// the header has none). None when it is elsewhere in the header: the caller then parses it whole.
fn leading_metadata(bytes: &[u8]) -> Option<Option<Vec<(String, String)>>> {
    match crate::header::split_leading_metadata(bytes) {
        Some((metadata, _)) => Some(metadata.map(|m| m.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect())),
        // No key spells `__metadata__`, not even with escapes: the header has none.
        None if memchr::memmem::find(bytes, b"__metadata__").is_none()
            && memchr::memmem::find(bytes, b"\\u").is_none() =>
        {
            Some(None)
        }
        None => None,
    }
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
    let (text, config) = config.unzip();
    build_result_of(target, text, config.as_ref(), header, alpha_file, opts, content_hash)
}

/// `build_result` with the config's text and the config it parses to apart.
fn build_result_of(
    target: Target,
    text: Option<String>,
    config: Option<&LoraConfig>,
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
        file: config,
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
        config_json: text.or(meta_config.map(|(text, _)| text)),
        metadata: if opts.keep_modules { metadata } else { None },
        header_size: header.header_size,
        file_size: header.file_size,
        class,
        content_hash,
        target,
    }
}

/// sha256 of the data section only, so metadata edits do not change it (kohya's `sshs_model_hash`).
/// Reads the already open (and checked) `file`, so the path cannot be swapped for a FIFO meanwhile.
fn hash_data(mut file: &fs::File, path: &Path, data_start: u64) -> Result<String, Error> {
    use std::io::{Seek, SeekFrom};
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

/// Set in a forked child: the pools' threads did not survive the fork (see `with_pool`).
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

/// The most threads a pool has, whatever is asked: a pool of 3,000 took 23-30 s to make and end
/// for a one-file scan, and reading headers gains nothing from that many.
pub const MAX_THREADS: usize = 256;

/// Threads to use: `LORAFAST_NUM_THREADS`, else the available cores (at most `MAX_THREADS`).
pub fn default_threads() -> usize {
    std::env::var("LORAFAST_NUM_THREADS")
        .ok()
        .and_then(|v| v.trim().parse::<usize>().ok())
        .filter(|&n| n > 0)
        .unwrap_or_else(|| std::thread::available_parallelism().map_or(1, |n| n.get()))
        .min(MAX_THREADS)
}

fn build_pool(threads: usize) -> Option<rayon::ThreadPool> {
    rayon::ThreadPoolBuilder::new()
        .num_threads(threads)
        .thread_name(|i| format!("lorafast-{i}"))
        .build()
        .ok()
}

/// Runs `f` on a pool of `threads`, at most `MAX_THREADS` (None: the shared default pool). Every
/// parallel loop of the core runs inside this, never on rayon's global pool.
///
/// In a forked child the inherited pools have no threads, and waiting on one hangs: there `f`
/// runs on a pool made for the call (inline if none can be made). Not inline on the caller's
/// thread: a parallel loop outside any pool goes to rayon's global one, which hangs the same way
/// once the parent has used it.
pub fn with_pool<R: Send>(threads: Option<usize>, f: impl FnOnce() -> R + Send) -> R {
    let threads = threads.map(|n| n.clamp(1, MAX_THREADS));
    let own = FORKED.load(Ordering::SeqCst) || threads.is_some_and(|n| n != default_threads());
    let made;
    let pool = if own {
        made = build_pool(threads.unwrap_or_else(default_threads));
        made.as_ref()
    } else {
        POOL.get_or_init(|| build_pool(default_threads())).as_ref()
    };
    match pool {
        Some(pool) => pool.install(f),
        None => f(),
    }
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

/// What a progress bar shows: adapters done, of about `total`.
#[derive(Default)]
pub(crate) struct Progress {
    pub count: AtomicUsize,
    pub total: AtomicUsize,
}

/// Runs `work`, with a bar on stderr refreshed from its `Progress` by a side thread when `show`.
pub(crate) fn with_progress<R>(show: bool, work: impl FnOnce(&Progress) -> R) -> R {
    let done = Progress::default();
    if !show {
        return work(&done);
    }
    let draw = |start: Instant| {
        let count = done.count.load(Ordering::Relaxed);
        // Sub-folders found on the way can add adapters to the first estimate.
        draw_progress(count, done.total.load(Ordering::Relaxed).max(count), start.elapsed());
    };
    // The drawer waits on a channel, not a sleep, so the end of the work wakes it at once.
    let (finished, wait) = std::sync::mpsc::channel::<()>();
    std::thread::scope(|s| {
        s.spawn(move || {
            let start = Instant::now();
            while let Err(std::sync::mpsc::RecvTimeoutError::Timeout) = wait.recv_timeout(Duration::from_millis(100)) {
                draw(start);
            }
            draw(start);
            eprintln!();
        });
        let out = work(&done);
        drop(finished);
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

#[cfg(test)]
mod tests {
    use super::*;

    fn temp_dir(name: &str) -> PathBuf {
        let dir = std::env::temp_dir().join(format!("lorafast-scan-{name}-{}", std::process::id()));
        let _ = fs::remove_dir_all(&dir);
        fs::create_dir_all(&dir).unwrap();
        dir
    }

    /// A kept config is the config its text parses to, and the thread keeps at most
    /// `CONFIGS_KEPT`, the most recently used.
    #[test]
    fn kept_configs_are_what_their_text_parses_to() {
        let path = Path::new("adapter_config.json");
        let text = |r: usize| format!(r#"{{"r": {r}, "lora_alpha": {}, "target_modules": ["q_proj"]}}"#, 2 * r);
        for round in 0..3 {
            for r in 0..CONFIGS_KEPT + 2 {
                let kept = parse_config_kept(path, &text(r)).unwrap();
                let fresh = parse_config_text(path, &text(r)).unwrap();
                assert_eq!(format!("{kept:?}"), format!("{fresh:?}"), "round {round}, r {r}");
            }
        }
        CONFIGS.with(|c| assert_eq!(c.borrow().len(), CONFIGS_KEPT));
        let bad = parse_config_kept(path, "{").unwrap_err();
        assert_eq!(
            format!("{bad:?}"),
            format!("{:?}", parse_config_text(path, "{").unwrap_err())
        );
    }

    /// A one-tensor safetensors file whose header carries `pad` bytes of metadata.
    fn write_adapter(path: &Path, pad: usize) {
        let mut header = format!(
            r#"{{"__metadata__":{{"pad":"{}"}},"t.lora_A.weight":{{"dtype":"F32","shape":[1],"data_offsets":[0,4]}}}}"#,
            "x".repeat(pad)
        )
        .into_bytes();
        header.resize(header.len().next_multiple_of(8), b' ');
        let mut bytes = (header.len() as u64).to_le_bytes().to_vec();
        bytes.extend_from_slice(&header);
        bytes.extend_from_slice(&[0; 4]);
        fs::write(path, bytes).unwrap();
    }

    fn buffer_capacity() -> usize {
        BUF.with(|b| b.borrow().capacity())
    }

    #[test]
    fn oversized_header_buffer_is_released_after_its_file() {
        let dir = temp_dir("buf");
        let (small, big) = (dir.join("small.safetensors"), dir.join("big.safetensors"));
        write_adapter(&small, 100);
        write_adapter(&big, 3 * KEEP_BUF_BYTES);
        let target = |p: &Path| Target {
            path: p.to_path_buf(),
            weights: p.to_path_buf(),
            config: None,
        };
        load(target(&small), ScanOptions::default()).unwrap();
        let kept = buffer_capacity();
        assert!(
            kept > 0 && kept <= KEEP_BUF_BYTES,
            "a small header's buffer is kept for reuse"
        );
        let result = load(target(&big), ScanOptions::default()).unwrap();
        assert!(result.header_size > 3 * KEEP_BUF_BYTES as u64);
        assert_eq!(
            buffer_capacity(),
            0,
            "the big header's buffer is freed once its file is done"
        );
        fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn a_pool_has_at_most_max_threads() {
        assert_eq!(with_pool(Some(1000), rayon::current_num_threads), MAX_THREADS);
        assert_eq!(with_pool(Some(3), rayon::current_num_threads), 3);
        assert!(default_threads() <= MAX_THREADS);
    }

    #[test]
    fn a_panic_while_loading_becomes_that_adapters_internal_error() {
        let dir = temp_dir("panic");
        let (ok, bad) = (dir.join("a.safetensors"), dir.join("b.safetensors"));
        write_adapter(&ok, 8);
        write_adapter(&bad, 8);
        debug_panic_on(Some(bad.clone()));
        let rows = scan_paths(std::slice::from_ref(&dir), true, ScanOptions::default(), Some(2), false);
        debug_panic_on(None);
        assert_eq!(rows.len(), 2);
        assert!(rows[0].is_ok());
        let err = rows[1].as_ref().unwrap_err();
        assert_eq!(
            (err.error_code(), err.path()),
            (AdapterErrorCode::Internal.into(), &bad)
        );
        assert!(err.detail().contains("forced panic"), "{}", err.detail());
        fs::remove_dir_all(&dir).unwrap();
    }
}
