//! Discovery: the adapters under a set of paths, by these rules (documented in docs/scan.md):
//! - a `.safetensors` file given directly is one adapter (a `.bin` / `.pt` / `.pth` one is read as
//!   torch weights, `crate::torch`);
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

use std::fs;
use std::io::Read;
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};
use std::sync::{Mutex, PoisonError};

use crate::error::{AdapterErrorCode, Error};
use crate::open::{not_regular, open_error, open_unchecked, stat};
use crate::torch;

use super::load::{config_too_large, MAX_CONFIG_BYTES};
use super::{Target, CONFIG_NAME, PEFT_WEIGHTS};

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
/// `adapter_model.pt`, as vLLM picks them (`crate::torch`); else `missing` is its error.
pub(super) fn torch_fallback(t: Target, missing: Error) -> Result<Target, Error> {
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
pub(super) fn weights_error(t: &Target, e: std::io::Error) -> Error {
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
pub(super) enum Found {
    Target(Target),
    Folder(PathBuf),
}

/// The bytes of a config file, read while deciding what its folder is.
pub(super) type ConfigBytes = Vec<u8>;

/// What a walk kept of a PEFT folder's config while telling the folder's kind. A scan reads it (its load
/// needs the bytes next); discovery alone `stat`s it, which tells the same (see `stat_config_file`) in one
/// syscall instead of an open, two reads and a close, and keeps the stat (`lorafast.Index` signs it).
pub(super) enum Probed {
    Bytes(ConfigBytes),
    Stat(fs::Metadata),
}

impl Probed {
    pub(super) fn bytes(self) -> Option<ConfigBytes> {
        match self {
            Probed::Bytes(b) => Some(b),
            Probed::Stat(_) => None,
        }
    }
}

/// What a folder holds, by the discovery rules.
pub(super) enum Folder {
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
pub(super) fn read_config_file(path: &Path) -> Result<Option<ConfigBytes>, Error> {
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
pub(super) fn missing_weights(dir: &Path) -> Error {
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
pub(super) type Key = Vec<u32>;

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
pub(super) fn walk<R: Send>(
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

pub(super) fn expand_inputs(paths: &[PathBuf], recursive: bool, stat: bool) -> Vec<Result<Found, Error>> {
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
