//! Adapters in object stores and on web servers: `s3://`, `gs://`, `az://`, `http(s)://` and
//! `hf://org/repo[@revision]/path`, read through the `object_store` crate (feature `remote`).
//!
//! Only headers are fetched. The first request asks for the start of the weights, sized by
//! [`first_read_size`] from what is known (the longest header seen in the store, the object's size
//! when a listing gave it), which also tells the object's size (`Content-Range`); a second range
//! request, to the header's exact end, follows only when the header is longer. `adapter_config.json` is fetched whole (at most 16 MiB), in
//! parallel with the header. Kohya `.alpha` scalars, the only tensor data a scan reads, are
//! fetched with small range requests (nearby ones merged) so that remote results equal local ones.
//!
//! Discovery: an object store prefix is listed and the local rules apply to the listing (see
//! `crate::scan`). Web servers (`http(s)://`, `hf://`) cannot be listed: a URL there names either a
//! `.safetensors` file or a PEFT folder (`adapter_config.json` + `adapter_model.safetensors`).
//!
//! Requests run in a [`Session`]: one per call, with one tokio runtime, one store (connection pool)
//! per bucket or origin and the call's permits, shared by listing and loading; at most
//! `concurrency` requests are in flight at once. A listing also records each object's size, ETag
//! and last-modified time ([`Session::discover_stat`], which `lorafast.Index` keys remote rows by).
//! Transient failures (5xx, 429, dropped connections, timeouts) are retried with exponential
//! backoff; each request is bounded by `timeout`, and a store that times out [`STALL_LIMIT`] times
//! in a row is given up for the rest of the call, so one stalled server cannot hold a scan for
//! minutes.
//! Failures become per-adapter errors with these codes (besides the local ones): `timeout`,
//! `connection_error` (the connection was refused, reset or closed early), `remote_error` (HTTP
//! or other network error), `short_read` (fewer bytes than the server announced),
//! `file_changed` (the object changed between two requests), `invalid_url`, `store_config`
//! (storage options the store rejects) and `remote_unsupported` (a build without this feature).

use std::path::{Path, PathBuf};
use std::time::Duration;

use crate::error::{AdapterErrorCode, Error};
use crate::scan::{self, is_url, AdapterResult, ScanOptions, Target};

/// The most a first range request asks for: the header of almost every adapter fits (500 PEFT
/// modules take ~60 KiB).
pub const SPECULATIVE_BYTES: u64 = 64 << 10;
/// The first read while nothing is known of a store's headers (and the object is larger than
/// [`SPECULATIVE_BYTES`] or of unknown size): room for ~100 tensors' entries, and small enough to
/// come, response headers included, in the first flight of a new TCP connection (10 segments), so
/// the call's first wave of requests, all sent before any answer, does not fetch `concurrency` x
/// 64 KiB of tensor data. A longer header costs one more request, to its exact end.
pub const FIRST_GUESS_BYTES: u64 = 12 << 10;
/// The smallest first read: a few KiB more cost little next to the round trip.
pub const MIN_SPECULATIVE_BYTES: u64 = 4 << 10;

/// Bytes to ask for first, given the longest header (with its 8-byte length) seen in this store so
/// far (0: none yet) and the object's size if a listing gave it.
/// - Nothing seen yet: an object of at most [`SPECULATIVE_BYTES`] is read whole (one request,
///   whatever its header); another, [`FIRST_GUESS_BYTES`].
/// - Else a quarter more than the longest header seen, in 4 KiB steps, between
///   [`MIN_SPECULATIVE_BYTES`] and [`SPECULATIVE_BYTES`]. It only grows during a call, so a fleet
///   of headers of one recipe costs one request each after the first answer, and a longer header
///   than any seen costs one more request (as a header over 64 KiB always does).
///
/// Never more than the object's known size (at least the 8-byte length prefix): a listing's size
/// can be stale, which costs at most a second request, never a wrong result.
pub fn first_read_size(longest_seen: u64, object_size: Option<u64>) -> u64 {
    let want = match (longest_seen, object_size) {
        (0, Some(size)) if size <= SPECULATIVE_BYTES => size,
        (0, _) => FIRST_GUESS_BYTES,
        (seen, _) => seen
            .saturating_add(seen / 4)
            .div_ceil(4 << 10)
            .saturating_mul(4 << 10)
            .clamp(MIN_SPECULATIVE_BYTES, SPECULATIVE_BYTES),
    };
    want.min(object_size.unwrap_or(u64::MAX)).max(crate::header::N_LEN)
}

/// Consecutive timeouts after which a store is given up for the rest of the call.
pub const STALL_LIMIT: usize = 4;
/// Bound on each request, in seconds, when the caller gives none.
pub const DEFAULT_TIMEOUT_S: f64 = 10.0;
/// Requests in flight at once when the caller gives no `concurrency`.
pub const DEFAULT_CONCURRENCY: usize = 64;
/// Larger `concurrency` values are taken as this.
pub const MAX_CONCURRENCY: usize = 4096;
/// Retries of a request that failed with a transient error.
pub const DEFAULT_RETRIES: usize = 3;
/// Longer timeouts are taken as this (a year: no request waits that long), so that a huge value
/// such as `1e300` or `2**64` means "no limit" instead of overflowing a `Duration`.
pub const MAX_TIMEOUT_S: f64 = 365.0 * 86_400.0;

/// A timeout in seconds as a `Duration`: positive and not NaN (else why not), clamped to
/// [`MAX_TIMEOUT_S`].
pub fn timeout_from_secs(seconds: f64) -> Result<Duration, String> {
    if seconds.is_nan() || seconds <= 0.0 {
        return Err(format!("timeout must be a positive number of seconds, not {seconds}"));
    }
    Ok(Duration::from_secs_f64(seconds.min(MAX_TIMEOUT_S)))
}

/// How to reach remote inputs.
#[derive(Debug, Clone)]
pub struct RemoteOptions {
    /// Passed to the store builder (`endpoint`, `region`, `allow_http`, ...).
    pub storage_options: Vec<(String, String)>,
    /// Bound on each request (connect, headers and body).
    pub timeout: Duration,
    /// Requests in flight at once.
    pub concurrency: usize,
    /// Retries of a failed request (transient errors only).
    pub retries: usize,
}

impl Default for RemoteOptions {
    fn default() -> Self {
        RemoteOptions {
            storage_options: Vec::new(),
            timeout: Duration::from_secs_f64(DEFAULT_TIMEOUT_S),
            concurrency: DEFAULT_CONCURRENCY,
            retries: DEFAULT_RETRIES,
        }
    }
}

/// The URL an input names, if it is one. A path that is not UTF-8 is never a URL.
fn url_of(p: &Path) -> Option<&str> {
    p.to_str().filter(|s| is_url(s))
}

/// Input order kept: each entry is a local path's or a URL's discovery result, in turn. Local
/// paths stay OS bytes, so names that are not UTF-8 keep working.
fn split_inputs<T>(
    paths: &[PathBuf],
    mut local: impl FnMut(&[PathBuf]) -> Vec<T>,
    mut remote: impl FnMut(&[String]) -> Vec<Vec<T>>,
) -> Vec<T> {
    let urls: Vec<String> = paths.iter().filter_map(|p| url_of(p)).map(str::to_owned).collect();
    let mut remote_found = remote(&urls).into_iter();
    let mut out = Vec::new();
    let mut run: Vec<PathBuf> = Vec::new();
    for p in paths {
        if url_of(p).is_some() {
            if !run.is_empty() {
                out.extend(local(&run));
                run.clear();
            }
            out.extend(remote_found.next().unwrap_or_default());
        } else {
            run.push(p.clone());
        }
    }
    if !run.is_empty() {
        out.extend(local(&run));
    }
    out
}

/// One call's remote state: a tokio runtime, the stores of the URLs it meets (each with its own
/// connection pool) and the call's request permits. Discovery and loading through one session
/// share all three, so the connections a listing opened carry the header reads that follow. Made
/// on first use: a call with no URL starts no runtime.
pub struct Session {
    threads: Option<usize>,
    ropts: RemoteOptions,
    imp: std::sync::OnceLock<imp::Session>,
}

/// What a listing (or a `HEAD`, where a store cannot be listed) says about one object.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ObjectStat {
    /// Its size in bytes.
    pub size: u64,
    /// As the server sent it (quotes included); None when it sends none.
    pub etag: Option<String>,
    /// Nanoseconds since the Unix epoch.
    pub last_modified_ns: Option<i64>,
}

/// An object's state as discovery saw it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Stat {
    /// A local path (the caller stats it), or a store that would not say.
    Unknown,
    /// The store says there is no such object.
    Missing,
    /// The store says what it holds.
    Found(ObjectStat),
}

/// A discovered adapter with the state of its weights and config objects.
pub type StatTarget = (Result<Target, Error>, Stat, Stat);

impl Session {
    /// A session whose runtime takes its workers from `threads` (None: the scan's default), with
    /// `ropts`; nothing starts until a URL is met.
    pub fn new(threads: Option<usize>, ropts: &RemoteOptions) -> Self {
        Session {
            threads,
            ropts: ropts.clone(),
            imp: std::sync::OnceLock::new(),
        }
    }

    fn imp(&self) -> &imp::Session {
        self.imp.get_or_init(|| imp::Session::new(self.threads, &self.ropts))
    }

    /// Finds every adapter under `paths`, local paths and URLs mixed, in input order.
    pub fn discover(&self, paths: &[PathBuf], recursive: bool) -> Vec<Result<Target, Error>> {
        split_inputs(
            paths,
            |run| scan::with_pool(self.threads, || scan::discover(run, recursive)),
            |urls| self.imp().discover_urls(urls, recursive),
        )
    }

    /// `discover`, with the size, ETag and last-modified time of each remote adapter's weights and
    /// config: from the listing where the store lists, else from one `HEAD` each. Local adapters
    /// get `Stat::Unknown` (their files are the caller's to stat).
    pub fn discover_stat(&self, paths: &[PathBuf], recursive: bool) -> Vec<StatTarget> {
        split_inputs(
            paths,
            |run| {
                scan::with_pool(self.threads, || scan::discover(run, recursive))
                    .into_iter()
                    .map(|t| (t, Stat::Unknown, Stat::Unknown))
                    .collect()
            },
            |urls| self.imp().discover_stat_urls(urls, recursive),
        )
    }

    /// Loads and classifies `targets` (local and remote mixed), in order.
    pub fn load_all(
        &self,
        targets: Vec<Target>,
        opts: ScanOptions,
        progress: bool,
    ) -> Vec<Result<AdapterResult, Error>> {
        type Numbered = Vec<(usize, Target)>;
        let threads = self.threads;
        let (remote, local): (Numbered, Numbered) = targets
            .into_iter()
            .enumerate()
            .partition(|(_, t)| url_of(&t.weights).is_some());
        if remote.is_empty() {
            return scan::scan(local.into_iter().map(|(_, t)| t).collect(), opts, threads, progress);
        }
        let n = remote.len() + local.len();
        let (local_at, local): (Vec<usize>, Vec<Target>) = local.into_iter().unzip();
        let (remote_at, remote): (Vec<usize>, Vec<Target>) = remote.into_iter().unzip();
        let local_rows = if local.is_empty() {
            Vec::new()
        } else {
            scan::scan(local, opts, threads, false)
        };
        let remote_rows = self.imp().load_urls(remote, opts, progress);
        let mut slots: Vec<Option<Result<AdapterResult, Error>>> = (0..n).map(|_| None).collect();
        for (i, r) in local_at
            .into_iter()
            .zip(local_rows)
            .chain(remote_at.into_iter().zip(remote_rows))
        {
            slots[i] = Some(r);
        }
        slots
            .into_iter()
            .map(|s| s.unwrap_or_else(|| Err(Error::adapter("", AdapterErrorCode::Internal, "scan lost a row"))))
            .collect()
    }

    /// Finds and loads every adapter under `paths`, local paths and URLs mixed, in input order:
    /// what `load_all(discover(paths))` gives (discovery failures as rows, in place). Header reads
    /// of a listed prefix start while its listing is still coming.
    pub fn scan(
        &self,
        paths: &[PathBuf],
        recursive: bool,
        opts: ScanOptions,
        progress: bool,
    ) -> Vec<Result<AdapterResult, Error>> {
        let any_url = paths.iter().any(|p| url_of(p).is_some());
        split_inputs(
            paths,
            |run| scan::scan_paths(run, recursive, opts, self.threads, progress && !any_url),
            |urls| self.imp().scan_urls(urls, recursive, opts, progress),
        )
    }

    /// `inspect` for each path or URL: the single adapter there (the `locate` rules), loaded in full.
    pub fn inspect_many(&self, paths: &[PathBuf], opts: ScanOptions) -> Vec<Result<AdapterResult, Error>> {
        use rayon::prelude::*;
        split_inputs(
            paths,
            |run| {
                scan::with_pool(self.threads, || {
                    run.par_iter()
                        .map(|p| scan::locate(p).and_then(|t| scan::load(t, opts)))
                        .collect::<Vec<_>>()
                })
            },
            |urls| {
                self.imp()
                    .inspect_urls(urls, opts)
                    .into_iter()
                    .map(|r| vec![r])
                    .collect()
            },
        )
    }
}

/// Finds every adapter under `paths`, local paths and URLs mixed, in input order.
pub fn discover(
    paths: &[PathBuf],
    recursive: bool,
    threads: Option<usize>,
    ropts: &RemoteOptions,
) -> Vec<Result<Target, Error>> {
    Session::new(threads, ropts).discover(paths, recursive)
}

/// Loads and classifies `targets` (local and remote mixed), in order.
pub fn load_all(
    targets: Vec<Target>,
    opts: ScanOptions,
    threads: Option<usize>,
    progress: bool,
    ropts: &RemoteOptions,
) -> Vec<Result<AdapterResult, Error>> {
    Session::new(threads, ropts).load_all(targets, opts, progress)
}

/// `inspect` for each path or URL: the single adapter there (the `locate` rules), loaded in full.
pub fn inspect_many(
    paths: &[PathBuf],
    opts: ScanOptions,
    threads: Option<usize>,
    ropts: &RemoteOptions,
) -> Vec<Result<AdapterResult, Error>> {
    Session::new(threads, ropts).inspect_many(paths, opts)
}

/// Bytes `range` of the object at `url` (clipped to its end) and the object's size.
pub fn read_range(url: &str, range: std::ops::Range<u64>, ropts: &RemoteOptions) -> Result<(Vec<u8>, u64), Error> {
    imp::read_range(url, range, ropts)
}

/// The safetensors header bytes (after the 8-byte length) of the object at `url` and its size,
/// fetched and checked as a scan fetches a weights file's (`parse_header` validates the rest).
pub fn read_header(url: &str, ropts: &RemoteOptions) -> Result<(Vec<u8>, u64), Error> {
    imp::read_header(url, ropts)
}

#[cfg(not(feature = "remote"))]
mod disabled;
#[cfg(not(feature = "remote"))]
use disabled as imp;

#[cfg(feature = "remote")]
mod credentials;
#[cfg(feature = "remote")]
mod enabled;
#[cfg(feature = "remote")]
mod listing;
#[cfg(feature = "remote")]
mod loading;
#[cfg(feature = "remote")]
mod redirect;
#[cfg(feature = "remote")]
mod request;
#[cfg(feature = "remote")]
mod shadow;
#[cfg(feature = "remote")]
mod stores;
#[cfg(feature = "remote")]
mod url;
#[cfg(feature = "remote")]
use enabled as imp;

#[cfg(all(test, feature = "remote"))]
mod tests;
