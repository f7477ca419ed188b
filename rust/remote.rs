//! Adapters in object stores and on web servers: `s3://`, `gs://`, `az://`, `http(s)://` and
//! `hf://org/repo[@revision]/path`, read through the `object_store` crate (feature `remote`).
//!
//! Only headers are fetched. The first request asks for the first [`SPECULATIVE_BYTES`] of the
//! weights, which also tells the object's size (`Content-Range`); a second range request follows
//! only when the header is longer. `adapter_config.json` is fetched whole (at most 16 MiB), in
//! parallel with the header. Kohya `.alpha` scalars, the only tensor data a scan reads, are
//! fetched with small range requests (nearby ones merged) so that remote results equal local ones.
//!
//! Discovery: an object store prefix is listed and the local rules apply to the listing (see
//! `scan.rs`). Web servers (`http(s)://`, `hf://`) cannot be listed: a URL there names either a
//! `.safetensors` file or a PEFT folder (`adapter_config.json` + `adapter_model.safetensors`).
//!
//! Requests run on a tokio runtime owned by the call, at most `concurrency` at once. Transient
//! failures (5xx, 429, dropped connections, timeouts) are retried with exponential backoff; each
//! request is bounded by `timeout`, and a store that times out [`STALL_LIMIT`] times in a row is
//! given up for the rest of the call, so one stalled server cannot hold a scan for minutes.
//! Failures become per-adapter errors with these codes (besides the local ones): `timeout`,
//! `connection_error` (the connection was refused, reset or closed early), `remote_error` (HTTP
//! or other network error), `short_read` (fewer bytes than the server announced),
//! `file_changed` (the object changed between two requests), `invalid_url`, `store_config`
//! (storage options the store rejects) and `remote_unsupported` (a build without this feature).

use std::path::{Path, PathBuf};
use std::time::Duration;

use crate::error::Error;
use crate::scan::{self, is_url, AdapterResult, ScanOptions, Target};

/// First range request: the header of almost every adapter fits (500 PEFT modules take ~60 KiB).
pub const SPECULATIVE_BYTES: u64 = 64 << 10;
/// Consecutive timeouts after which a store is given up for the rest of the call.
pub const STALL_LIMIT: usize = 4;
pub const DEFAULT_TIMEOUT_S: f64 = 10.0;
pub const DEFAULT_CONCURRENCY: usize = 64;
/// Larger `concurrency` values are taken as this.
pub const MAX_CONCURRENCY: usize = 4096;
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

/// Finds every adapter under `paths`, local paths and URLs mixed, in input order.
pub fn discover(
    paths: &[PathBuf],
    recursive: bool,
    threads: Option<usize>,
    ropts: &RemoteOptions,
) -> Vec<Result<Target, Error>> {
    split_inputs(
        paths,
        |run| scan::with_pool(threads, || scan::discover(run, recursive)),
        |urls| imp::discover_urls(urls, recursive, threads, ropts),
    )
}

/// Loads and classifies `targets` (local and remote mixed), in order.
pub fn load_all(
    targets: Vec<Target>,
    opts: ScanOptions,
    threads: Option<usize>,
    progress: bool,
    ropts: &RemoteOptions,
) -> Vec<Result<AdapterResult, Error>> {
    type Numbered = Vec<(usize, Target)>;
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
    let remote_rows = imp::load_urls(remote, opts, threads, progress, ropts);
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
        .map(|s| s.unwrap_or_else(|| Err(Error::adapter("", "internal", "scan lost a row"))))
        .collect()
}

/// `inspect` for each path or URL: the single adapter there (the `locate` rules), loaded in full.
pub fn inspect_many(
    paths: &[PathBuf],
    opts: ScanOptions,
    threads: Option<usize>,
    ropts: &RemoteOptions,
) -> Vec<Result<AdapterResult, Error>> {
    use rayon::prelude::*;
    split_inputs(
        paths,
        |run| {
            scan::with_pool(threads, || {
                run.par_iter()
                    .map(|p| scan::locate(p).and_then(|t| scan::load(t, opts)))
                    .collect::<Vec<_>>()
            })
        },
        |urls| {
            imp::inspect_urls(urls, opts, threads, ropts)
                .into_iter()
                .map(|r| vec![r])
                .collect()
        },
    )
}

#[cfg(not(feature = "remote"))]
mod imp {
    use super::*;

    fn unsupported(url: &str) -> Error {
        Error::adapter(
            url,
            "remote_unsupported",
            "this build of lorafast has no remote support (cargo feature `remote`)",
        )
    }

    pub fn discover_urls(
        urls: &[String],
        _: bool,
        _: Option<usize>,
        _: &RemoteOptions,
    ) -> Vec<Vec<Result<Target, Error>>> {
        urls.iter().map(|u| vec![Err(unsupported(u))]).collect()
    }

    pub fn load_urls(
        targets: Vec<Target>,
        _: ScanOptions,
        _: Option<usize>,
        _: bool,
        _: &RemoteOptions,
    ) -> Vec<Result<AdapterResult, Error>> {
        targets
            .iter()
            .map(|t| Err(unsupported(&t.path.to_string_lossy())))
            .collect()
    }

    pub fn inspect_urls(
        urls: &[String],
        _: ScanOptions,
        _: Option<usize>,
        _: &RemoteOptions,
    ) -> Vec<Result<AdapterResult, Error>> {
        urls.iter().map(|u| Err(unsupported(u))).collect()
    }
}

#[cfg(feature = "remote")]
mod imp {
    /// A PEFT folder with no weights: the local scan's words.
    const NO_WEIGHTS_WHY: &str = crate::scan::MISSING_WEIGHTS_WHY;
    /// The torch reader works on local files only (it needs random access to the zip's central directory).
    const REMOTE_PICKLE_WHY: &str =
        "adapter_model.bin is a torch pickle; remote stores are read for safetensors weights only";

    use std::collections::{BTreeMap, BTreeSet, HashMap};
    use std::io;
    use std::ops::Range;
    use std::path::{Path, PathBuf};
    use std::str::FromStr;
    use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
    use std::sync::{Arc, Mutex, Once};
    use std::time::Duration;

    use bytes::Bytes;
    use futures_util::{StreamExt, TryStreamExt};
    use object_store::aws::{AmazonS3Builder, AmazonS3ConfigKey};
    use object_store::azure::{AzureConfigKey, MicrosoftAzureBuilder};
    use object_store::gcp::{GoogleCloudStorageBuilder, GoogleConfigKey};
    use object_store::http::HttpBuilder;
    use object_store::path::Path as Key;
    use object_store::{
        BackoffConfig, ClientConfigKey, ClientOptions, GetOptions, GetRange, ObjectStore, ObjectStoreExt, RetryConfig,
    };
    use sha2::{Digest, Sha256};
    use tokio::sync::Semaphore;

    use super::*;
    use crate::error::HeaderError;
    use crate::header::{parse_header, Header, MAX_HEADER_SIZE, N_LEN};
    use crate::names::{self, Role};
    use crate::scan::{CONFIG_NAME, PEFT_WEIGHTS};

    /// Token and AWS settings files longer than this are not read.
    const SETTINGS_FILE_LIMIT: u64 = 1 << 20;
    /// Merge alpha ranges closer than this into one request.
    const ALPHA_GAP: u64 = 64 << 10;
    /// Content hashes are read in ranges of this size, each bounded by the timeout.
    const HASH_CHUNK: u64 = 8 << 20;
    /// A server that ignores `Range` is read from the start; refuse to stream past this.
    const NO_RANGE_LIMIT: u64 = MAX_HEADER_SIZE + (16 << 20);

    /// One store (bucket, container or web origin) of a call.
    struct Store {
        inner: Arc<dyn ObjectStore>,
        /// Object stores list prefixes; web servers cannot.
        listable: bool,
        /// Timeouts in a row, with no success in between.
        stalls: AtomicUsize,
        /// Set once the server answered a range request with the whole object.
        ignores_range: AtomicBool,
    }

    /// An object: its store, its key there and its URL (as shown in results).
    struct Loc {
        store: Arc<Store>,
        key: Key,
        url: String,
    }

    /// Why a store could not be built: (error code, message), given to every adapter in it.
    type StoreError = (&'static str, String);

    /// State shared by the requests of one call.
    struct Remote {
        opts: RemoteOptions,
        stores: Mutex<HashMap<String, Result<Arc<Store>, StoreError>>>,
        permits: Semaphore,
    }

    fn io_err(url: &str, kind: io::ErrorKind, message: impl Into<String>) -> Error {
        Error::io(url, io::Error::new(kind, message.into()))
    }

    fn runtime(threads: Option<usize>) -> io::Result<tokio::runtime::Runtime> {
        static TLS: Once = Once::new();
        // reqwest is built without a TLS crypto provider of its own (no aws-lc build): use ring.
        TLS.call_once(|| {
            let _ = rustls::crypto::ring::default_provider().install_default();
        });
        let workers = threads.unwrap_or_else(scan::default_threads).clamp(1, 16);
        tokio::runtime::Builder::new_multi_thread()
            .worker_threads(workers)
            .thread_name("lorafast-io")
            .enable_all()
            .build()
    }

    /// Runs `f` on a fresh runtime; if none can be made, every item fails with that reason.
    fn run<T>(
        threads: Option<usize>,
        items: &[String],
        fail: impl Fn(&str, &io::Error) -> T,
        f: impl std::future::Future<Output = Vec<T>>,
    ) -> Vec<T> {
        match runtime(threads) {
            Ok(rt) => rt.block_on(f),
            Err(e) => items.iter().map(|u| fail(u, &e)).collect(),
        }
    }

    pub fn discover_urls(
        urls: &[String],
        recursive: bool,
        threads: Option<usize>,
        ropts: &RemoteOptions,
    ) -> Vec<Vec<Result<Target, Error>>> {
        let remote = Arc::new(Remote::new(ropts));
        run(
            threads,
            urls,
            |u, e| vec![Err(io_err(u, e.kind(), e.to_string()))],
            async {
                let jobs = urls.iter().map(|u| {
                    let remote = remote.clone();
                    let u = u.clone();
                    tokio::spawn(async move { remote.discover(&u, recursive).await })
                });
                let joined = futures_util::future::join_all(jobs).await;
                joined
                    .into_iter()
                    .zip(urls)
                    .map(|(r, u)| r.unwrap_or_else(|e| vec![Err(join_error(u, &e))]))
                    .collect()
            },
        )
    }

    pub fn load_urls(
        targets: Vec<Target>,
        opts: ScanOptions,
        threads: Option<usize>,
        progress: bool,
        ropts: &RemoteOptions,
    ) -> Vec<Result<AdapterResult, Error>> {
        let remote = Arc::new(Remote::new(ropts));
        let urls: Vec<String> = targets.iter().map(|t| t.path.to_string_lossy().into_owned()).collect();
        let concurrency = ropts.concurrency.max(1);
        let rows = scan::with_progress(progress, |done| {
            done.total.store(targets.len(), Ordering::Relaxed);
            run(threads, &urls, |u, e| Err(io_err(u, e.kind(), e.to_string())), async {
                let jobs = targets.into_iter().map(|t| {
                    let remote = remote.clone();
                    let url = t.path.to_string_lossy().into_owned();
                    async move {
                        let r = tokio::spawn(async move { remote.load(t, opts).await }).await;
                        done.count.fetch_add(1, Ordering::Relaxed);
                        r.unwrap_or_else(|e| Err(join_error(&url, &e)))
                    }
                });
                futures_util::stream::iter(jobs)
                    .buffered(concurrency)
                    .collect::<Vec<_>>()
                    .await
            })
        });
        rows
    }

    pub fn inspect_urls(
        urls: &[String],
        opts: ScanOptions,
        threads: Option<usize>,
        ropts: &RemoteOptions,
    ) -> Vec<Result<AdapterResult, Error>> {
        let remote = Arc::new(Remote::new(ropts));
        let concurrency = ropts.concurrency.max(1);
        run(threads, urls, |u, e| Err(io_err(u, e.kind(), e.to_string())), async {
            let jobs = urls.iter().map(|u| {
                let remote = remote.clone();
                let u = u.clone();
                async move {
                    let url = u.clone();
                    let job = tokio::spawn(async move {
                        let target = remote.locate(&u).await?;
                        remote.load(target, opts).await
                    });
                    job.await.unwrap_or_else(|e| Err(join_error(&url, &e)))
                }
            });
            futures_util::stream::iter(jobs)
                .buffered(concurrency)
                .collect::<Vec<_>>()
                .await
        })
    }

    fn join_error(url: &str, e: &tokio::task::JoinError) -> Error {
        Error::adapter(url, "internal", format!("reading this adapter panicked: {e}"))
    }

    // ---------------------------------------------------------------- URLs and stores

    /// What a URL names: the store's cache key and how to build it, and the key inside it.
    #[derive(Debug, Clone, PartialEq, Eq)]
    pub(super) struct Parsed {
        pub kind: Kind,
        /// `s3://bucket`, `http://host:port`, or for hf the resolve URL of the repo revision.
        pub base: String,
        pub key: String,
    }

    #[derive(Debug, Clone, Copy, PartialEq, Eq)]
    pub(super) enum Kind {
        S3,
        Gcs,
        Azure,
        Http,
        HuggingFace,
    }

    fn invalid(url: &str, why: impl Into<String>) -> Error {
        Error::adapter(url, "invalid_url", why.into())
    }

    pub(super) fn parse_url(url: &str) -> Result<Parsed, Error> {
        let (scheme, rest) = url.split_once("://").ok_or_else(|| invalid(url, "not a URL"))?;
        if scheme == "hf" {
            return parse_hf(url, rest);
        }
        let parsed = url::Url::parse(url).map_err(|e| invalid(url, format!("cannot parse this URL: {e}")))?;
        if parsed.query().is_some() || parsed.fragment().is_some() {
            return Err(invalid(
                url,
                "query strings and fragments are not supported in adapter URLs",
            ));
        }
        let kind = match scheme {
            "s3" | "s3a" => Kind::S3,
            "gs" | "gcs" => Kind::Gcs,
            "az" | "azure" | "abfs" | "abfss" => Kind::Azure,
            "http" | "https" => Kind::Http,
            _ => return Err(invalid(url, format!("unsupported scheme {scheme:?}"))),
        };
        if parsed.authority().is_empty() {
            return Err(invalid(url, "no bucket, container or host in this URL"));
        }
        let base = format!("{scheme}://{}", parsed.authority());
        Ok(Parsed {
            kind,
            base,
            key: parsed.path().trim_start_matches('/').to_owned(),
        })
    }

    /// `hf://[datasets/|spaces/]org/repo[@revision]/path` -> `{HF_ENDPOINT}/[datasets/]org/repo/resolve/{revision}`.
    fn parse_hf(url: &str, rest: &str) -> Result<Parsed, Error> {
        let (kind, rest) = match rest.split_once('/') {
            Some((k @ ("datasets" | "spaces" | "models"), r)) => (if k == "models" { "" } else { k }, r),
            _ => ("", rest),
        };
        let mut parts = rest.splitn(3, '/');
        let (Some(org), Some(repo)) = (parts.next(), parts.next()) else {
            return Err(invalid(url, "expected hf://org/repo[@revision]/path"));
        };
        let (repo, revision) = repo.split_once('@').unwrap_or((repo, "main"));
        if org.is_empty() || repo.is_empty() || revision.is_empty() {
            return Err(invalid(url, "expected hf://org/repo[@revision]/path"));
        }
        let endpoint = std::env::var("HF_ENDPOINT").unwrap_or_else(|_| "https://huggingface.co".to_owned());
        let endpoint = endpoint.trim_end_matches('/');
        let repo_path = if kind.is_empty() {
            format!("{org}/{repo}")
        } else {
            format!("{kind}/{org}/{repo}")
        };
        let base = format!("{endpoint}/{repo_path}/resolve/{revision}");
        Ok(Parsed {
            kind: Kind::HuggingFace,
            base,
            key: parts.next().unwrap_or("").to_owned(),
        })
    }

    /// The Hugging Face token from the standard places, for private repos.
    fn hf_token() -> Option<String> {
        for var in ["HF_TOKEN", "HUGGING_FACE_HUB_TOKEN"] {
            if let Ok(t) = std::env::var(var) {
                if !t.trim().is_empty() {
                    return Some(t.trim().to_owned());
                }
            }
        }
        let file = match std::env::var("HF_TOKEN_PATH") {
            Ok(p) => PathBuf::from(p),
            Err(_) => {
                let home = std::env::var("HF_HOME").map(PathBuf::from).ok().or_else(|| {
                    std::env::var("HOME")
                        .ok()
                        .map(|h| PathBuf::from(h).join(".cache").join("huggingface"))
                })?;
                home.join("token")
            }
        };
        crate::open::read_small_text(&file, SETTINGS_FILE_LIMIT)
            .map(|t| t.trim().to_owned())
            .filter(|t| !t.is_empty())
    }

    /// `key = value` pairs of one section of an AWS-style INI file.
    fn ini_section(path: &Path, section: &str) -> Vec<(String, String)> {
        let Some(text) = crate::open::read_small_text(path, SETTINGS_FILE_LIMIT) else {
            return Vec::new();
        };
        let mut inside = false;
        let mut out = Vec::new();
        for line in text.lines().map(str::trim) {
            if let Some(name) = line.strip_prefix('[').and_then(|l| l.strip_suffix(']')) {
                inside = name.trim() == section;
            } else if inside {
                if let Some((k, v)) = line.split_once('=') {
                    out.push((k.trim().to_owned(), v.trim().to_owned()));
                }
            }
        }
        out
    }

    /// Credentials and region of the AWS profile (`~/.aws/credentials`, `~/.aws/config`), which
    /// object_store does not read itself; environment variables and storage options win.
    fn aws_profile() -> Vec<(AmazonS3ConfigKey, String)> {
        let Some(home) = std::env::var_os("HOME").map(PathBuf::from) else {
            return Vec::new();
        };
        let profile = std::env::var("AWS_PROFILE").unwrap_or_else(|_| "default".to_owned());
        let creds = std::env::var_os("AWS_SHARED_CREDENTIALS_FILE")
            .map_or_else(|| home.join(".aws").join("credentials"), PathBuf::from);
        let config =
            std::env::var_os("AWS_CONFIG_FILE").map_or_else(|| home.join(".aws").join("config"), PathBuf::from);
        let config_section = if profile == "default" {
            profile.clone()
        } else {
            format!("profile {profile}")
        };
        let mut out = Vec::new();
        for (k, v) in ini_section(&creds, &profile)
            .into_iter()
            .chain(ini_section(&config, &config_section))
        {
            let key = match k.as_str() {
                "aws_access_key_id" => AmazonS3ConfigKey::AccessKeyId,
                "aws_secret_access_key" => AmazonS3ConfigKey::SecretAccessKey,
                "aws_session_token" => AmazonS3ConfigKey::Token,
                "region" => AmazonS3ConfigKey::Region,
                "endpoint_url" => AmazonS3ConfigKey::Endpoint,
                _ => continue,
            };
            out.push((key, v));
        }
        out
    }

    fn store_error(e: impl std::fmt::Display) -> StoreError {
        ("store_config", e.to_string())
    }

    impl Remote {
        fn new(opts: &RemoteOptions) -> Self {
            Remote {
                opts: opts.clone(),
                stores: Mutex::new(HashMap::new()),
                permits: Semaphore::new(opts.concurrency.max(1)),
            }
        }

        fn retry(&self) -> RetryConfig {
            RetryConfig {
                backoff: BackoffConfig {
                    init_backoff: Duration::from_millis(50),
                    max_backoff: Duration::from_secs(2),
                    base: 2.0,
                },
                max_retries: self.opts.retries,
                // One retry after a timeout at most: a stalled server costs ~2 timeouts, not minutes.
                retry_timeout: self.opts.timeout.saturating_mul(2),
            }
        }

        fn millis(d: Duration) -> String {
            format!("{}ms", d.as_millis().max(1))
        }

        fn client_defaults(&self) -> [(ClientConfigKey, String); 2] {
            let connect = self.opts.timeout.min(Duration::from_secs(5));
            [
                (ClientConfigKey::Timeout, Self::millis(self.opts.timeout)),
                (ClientConfigKey::ConnectTimeout, Self::millis(connect)),
            ]
        }

        fn build(&self, p: &Parsed) -> Result<Arc<dyn ObjectStore>, StoreError> {
            let user = &self.opts.storage_options;
            let user_sets = |names: &[&str]| user.iter().any(|(k, _)| names.contains(&k.as_str()));
            match p.kind {
                Kind::S3 => {
                    let mut b = AmazonS3Builder::from_env().with_url(&p.base).with_retry(self.retry());
                    for (k, v) in self.client_defaults() {
                        b = b.with_config(AmazonS3ConfigKey::Client(k), v);
                    }
                    if b.get_config_value(&AmazonS3ConfigKey::AccessKeyId).is_none() {
                        for (k, v) in aws_profile() {
                            if b.get_config_value(&k).is_none() {
                                b = b.with_config(k, v);
                            }
                        }
                    }
                    for (k, v) in user {
                        b = b.with_config(AmazonS3ConfigKey::from_str(k).map_err(store_error)?, v);
                    }
                    // An endpoint the user wrote as http:// is meant: allow it.
                    let http_endpoint = b
                        .get_config_value(&AmazonS3ConfigKey::Endpoint)
                        .is_some_and(|e| e.starts_with("http://"));
                    if http_endpoint && !user_sets(&["allow_http", "aws_allow_http"]) {
                        b = b.with_allow_http(true);
                    }
                    Ok(Arc::new(b.build().map_err(store_error)?))
                }
                Kind::Gcs => {
                    let mut b = GoogleCloudStorageBuilder::from_env()
                        .with_url(&p.base)
                        .with_retry(self.retry());
                    for (k, v) in self.client_defaults() {
                        b = b.with_config(GoogleConfigKey::Client(k), v);
                    }
                    for (k, v) in user {
                        b = b.with_config(GoogleConfigKey::from_str(k).map_err(store_error)?, v);
                    }
                    Ok(Arc::new(b.build().map_err(store_error)?))
                }
                Kind::Azure => {
                    let mut b = MicrosoftAzureBuilder::from_env()
                        .with_url(&p.base)
                        .with_retry(self.retry());
                    for (k, v) in self.client_defaults() {
                        b = b.with_config(AzureConfigKey::Client(k), v);
                    }
                    for (k, v) in user {
                        b = b.with_config(AzureConfigKey::from_str(k).map_err(store_error)?, v);
                    }
                    Ok(Arc::new(b.build().map_err(store_error)?))
                }
                Kind::Http | Kind::HuggingFace => {
                    let mut options = ClientOptions::new().with_allow_http(p.base.starts_with("http://"));
                    for (k, v) in self.client_defaults() {
                        options = options.with_config(k, v);
                    }
                    if p.kind == Kind::HuggingFace {
                        if let Some(token) = hf_token() {
                            let mut headers = reqwest::header::HeaderMap::new();
                            if let Ok(mut value) = reqwest::header::HeaderValue::from_str(&format!("Bearer {token}")) {
                                value.set_sensitive(true);
                                headers.insert(reqwest::header::AUTHORIZATION, value);
                            }
                            options = options.with_default_headers(headers);
                        }
                    }
                    // Store-specific keys (endpoint, region, ...) do not apply to a web server.
                    for (k, v) in user {
                        if let Ok(key) = ClientConfigKey::from_str(k) {
                            options = options.with_config(key, v);
                        }
                    }
                    let b = HttpBuilder::new()
                        .with_url(&p.base)
                        .with_retry(self.retry())
                        .with_client_options(options);
                    Ok(Arc::new(b.build().map_err(store_error)?))
                }
            }
        }

        fn loc(&self, url: &str) -> Result<Loc, Error> {
            let p = parse_url(url)?;
            let key = Key::from_url_path(&p.key).map_err(|e| invalid(url, format!("bad object path: {e}")))?;
            let store = {
                let mut stores = self.stores.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
                stores
                    .entry(p.base.clone())
                    .or_insert_with(|| {
                        self.build(&p).map(|inner| {
                            Arc::new(Store {
                                inner,
                                listable: !matches!(p.kind, Kind::Http | Kind::HuggingFace),
                                stalls: AtomicUsize::new(0),
                                ignores_range: AtomicBool::new(false),
                            })
                        })
                    })
                    .clone()
            };
            let store = store.map_err(|(code, message)| Error::adapter(url, code, message))?;
            Ok(Loc {
                store,
                key,
                url: url.to_owned(),
            })
        }

        // ------------------------------------------------------------ requests

        /// Maps a store error to a per-adapter error, counting timeouts against the store.
        fn fail(&self, loc: &Loc, e: &object_store::Error, body: bool) -> Error {
            use object_store::Error as E;
            let timed_out = is_timeout(e);
            if timed_out {
                loc.store.stalls.fetch_add(1, Ordering::Relaxed);
            }
            match e {
                E::NotFound { .. } => io_err(&loc.url, io::ErrorKind::NotFound, "no such object"),
                E::PermissionDenied { .. } | E::Unauthenticated { .. } => io_err(
                    &loc.url,
                    io::ErrorKind::PermissionDenied,
                    format!("access denied: {}", chain(e)),
                ),
                // Before timeouts and body errors: a reset is no timeout and no short answer.
                _ if is_connection_failure(e) => Error::adapter(
                    &loc.url,
                    "connection_error",
                    format!("the connection failed (refused, reset or aborted): {}", chain(e)),
                ),
                _ if timed_out => Error::adapter(
                    &loc.url,
                    "timeout",
                    format!(
                        "no complete answer within the {:.3}s timeout: {}",
                        self.opts.timeout.as_secs_f64(),
                        chain(e)
                    ),
                ),
                _ if body => Error::adapter(
                    &loc.url,
                    "short_read",
                    format!("the response body broke off: {}", chain(e)),
                ),
                _ => Error::adapter(&loc.url, "remote_error", chain(e)),
            }
        }

        fn check_stalled(&self, loc: &Loc) -> Result<(), Error> {
            let n = loc.store.stalls.load(Ordering::Relaxed);
            if n >= STALL_LIMIT {
                return Err(Error::adapter(
                    &loc.url,
                    "timeout",
                    format!(
                        "skipped: this server timed out on {n} requests in a row (timeout {:.3}s)",
                        self.opts.timeout.as_secs_f64()
                    ),
                ));
            }
            Ok(())
        }

        /// Bytes `range` of an object (clipped to its end) and the object's size.
        async fn get_range(&self, loc: &Loc, range: Range<u64>) -> Result<(Bytes, u64), Error> {
            let _permit = self
                .permits
                .acquire()
                .await
                .map_err(|e| Error::adapter(&loc.url, "internal", e.to_string()))?;
            self.check_stalled(loc)?;
            if loc.store.ignores_range.load(Ordering::Relaxed) {
                return self.get_without_range(loc, range).await;
            }
            let options = GetOptions {
                range: Some(GetRange::Bounded(range.clone())),
                ..GetOptions::default()
            };
            let result = match loc.store.inner.get_opts(&loc.key, options).await {
                Ok(r) => r,
                Err(e) if ignores_range(&e) => {
                    loc.store.ignores_range.store(true, Ordering::Relaxed);
                    return self.get_without_range(loc, range).await;
                }
                Err(e) if status_is(&e, 416) => {
                    // Range not satisfiable: the object is shorter than the range's start (e.g. empty).
                    let size = loc
                        .store
                        .inner
                        .head(&loc.key)
                        .await
                        .map_err(|e| self.fail(loc, &e, false))?
                        .size;
                    if range.start >= size {
                        return Ok((Bytes::new(), size));
                    }
                    return Err(self.fail(loc, &e, false));
                }
                Err(e) => return Err(self.fail(loc, &e, false)),
            };
            let size = result.meta.size;
            let bytes = result.bytes().await.map_err(|e| self.fail(loc, &e, true))?;
            let want = range.end.min(size).saturating_sub(range.start);
            if bytes.len() as u64 != want {
                return Err(short(loc, want, bytes.len(), range.start, size));
            }
            loc.store.stalls.store(0, Ordering::Relaxed);
            Ok((bytes, size))
        }

        /// For a server that ignores `Range`: stream the object from its start, keep `range`, hang up.
        async fn get_without_range(&self, loc: &Loc, range: Range<u64>) -> Result<(Bytes, u64), Error> {
            if range.end > NO_RANGE_LIMIT && range.start > 0 {
                return Err(Error::adapter(
                    &loc.url,
                    "remote_error",
                    format!(
                        "the server ignores Range requests; refusing to stream {} bytes to reach byte {}",
                        range.start, range.start
                    ),
                ));
            }
            let result = loc
                .store
                .inner
                .get_opts(&loc.key, GetOptions::default())
                .await
                .map_err(|e| self.fail(loc, &e, false))?;
            let size = result.meta.size;
            let end = range.end.min(size);
            let mut stream = result.into_stream();
            let mut out = Vec::with_capacity(end.saturating_sub(range.start) as usize);
            let mut at = 0u64;
            while at < end {
                let Some(chunk) = stream.next().await else { break };
                let chunk = chunk.map_err(|e| self.fail(loc, &e, true))?;
                let (lo, hi) = (at, at + chunk.len() as u64);
                if hi > range.start {
                    let from = range.start.saturating_sub(lo) as usize;
                    let to = (end.min(hi) - lo) as usize;
                    out.extend_from_slice(&chunk[from..to]);
                }
                at = hi;
            }
            drop(stream); // closes the connection: the rest of the object is not wanted
            let want = end.saturating_sub(range.start);
            if out.len() as u64 != want {
                return Err(short(loc, want, out.len(), range.start, size));
            }
            loc.store.stalls.store(0, Ordering::Relaxed);
            Ok((Bytes::from(out), size))
        }

        // ------------------------------------------------------------ discovery

        async fn discover(&self, url: &str, recursive: bool) -> Vec<Result<Target, Error>> {
            let loc = match self.loc(url) {
                Ok(l) => l,
                Err(e) => return vec![Err(e)],
            };
            if names_file(&loc.key) || !loc.store.listable {
                return vec![Ok(guess_target(url, &loc))];
            }
            let listed = match self.list(&loc).await {
                Ok(l) => l,
                Err(e) => return vec![Err(e)],
            };
            if listed.is_empty() {
                return vec![self.lone_object(&loc).await];
            }
            let mut tree = Dir::default();
            for parts in listed {
                tree.insert(&parts);
            }
            let mut out = Vec::new();
            tree.walk(url, recursive, true, &mut out);
            out
        }

        /// Every object under a prefix, as key parts relative to it.
        async fn list(&self, loc: &Loc) -> Result<Vec<Vec<String>>, Error> {
            let _permit = self
                .permits
                .acquire()
                .await
                .map_err(|e| Error::adapter(&loc.url, "internal", e.to_string()))?;
            self.check_stalled(loc)?;
            let prefix = (!loc.key.as_ref().is_empty()).then_some(&loc.key);
            let depth = loc.key.parts().count();
            let objects: Vec<object_store::ObjectMeta> = loc
                .store
                .inner
                .list(prefix)
                .try_collect()
                .await
                .map_err(|e| self.fail(loc, &e, false))?;
            loc.store.stalls.store(0, Ordering::Relaxed);
            Ok(objects
                .into_iter()
                .map(|o| {
                    o.location
                        .parts()
                        .skip(depth)
                        .map(|p| p.as_ref().to_owned())
                        .collect::<Vec<_>>()
                })
                .filter(|parts| !parts.is_empty())
                .collect())
        }

        /// A URL with nothing under it as a prefix: the object itself, or not found.
        async fn lone_object(&self, loc: &Loc) -> Result<Target, Error> {
            let _permit = self
                .permits
                .acquire()
                .await
                .map_err(|e| Error::adapter(&loc.url, "internal", e.to_string()))?;
            match loc.store.inner.head(&loc.key).await {
                Ok(_) => Ok(guess_target(&loc.url, loc)),
                Err(object_store::Error::NotFound { .. }) => Err(io_err(
                    &loc.url,
                    io::ErrorKind::NotFound,
                    "no such object, and no objects under this prefix",
                )),
                Err(e) => Err(self.fail(loc, &e, false)),
            }
        }

        /// The single adapter at a URL (`scan::locate`'s rules on a listing of one level).
        async fn locate(&self, url: &str) -> Result<Target, Error> {
            let loc = self.loc(url)?;
            if names_file(&loc.key) || !loc.store.listable {
                return Ok(guess_target(url, &loc));
            }
            let listing = {
                let _permit = self
                    .permits
                    .acquire()
                    .await
                    .map_err(|e| Error::adapter(url, "internal", e.to_string()))?;
                self.check_stalled(&loc)?;
                let prefix = (!loc.key.as_ref().is_empty()).then_some(&loc.key);
                loc.store
                    .inner
                    .list_with_delimiter(prefix)
                    .await
                    .map_err(|e| self.fail(&loc, &e, false))?
            };
            let mut dir = Dir::default();
            for o in &listing.objects {
                if let Some(name) = o.location.filename() {
                    dir.insert(&[name.to_owned()]);
                }
            }
            if dir.files.contains(CONFIG_NAME) {
                return dir.peft(url);
            }
            let files: Vec<&String> = dir.safetensors().collect();
            match files.as_slice() {
                [one] => Ok(Target {
                    path: url.into(),
                    weights: join(url, one).into(),
                    config: None,
                }),
                [] if listing.objects.is_empty() && listing.common_prefixes.is_empty() => self.lone_object(&loc).await,
                [] => Err(Error::adapter(
                    url,
                    "no_adapter",
                    "no adapter_config.json and no .safetensors file in this folder",
                )),
                _ => Err(Error::adapter(
                    url,
                    "ambiguous_adapter",
                    format!(
                        "{} .safetensors files and no adapter_config.json; inspect one file, or scan the folder",
                        files.len()
                    ),
                )),
            }
        }

        // ------------------------------------------------------------ loading

        async fn load(&self, target: Target, opts: ScanOptions) -> Result<AdapterResult, Error> {
            let weights_url = target.weights.to_string_lossy().into_owned();
            let weights = self.loc(&weights_url)?;
            // Web servers cannot be listed, so a folder URL there is taken for a PEFT folder: say
            // so when it is not one.
            let guessed = !weights.store.listable && target.config.is_some();
            let config = async {
                match &target.config {
                    Some(p) => Some(self.fetch_config(&p.to_string_lossy()).await),
                    None => None,
                }
            };
            let (config, header) = futures_util::join!(config, self.fetch_header(&weights));
            let config = match config.transpose() {
                Err(e) if guessed && e.code() == "not_found" => {
                    return Err(io_err(
                        &target.path.to_string_lossy(),
                        io::ErrorKind::NotFound,
                        "no adapter_config.json here; http(s):// and hf:// folders cannot be listed, so name a \
                         .safetensors file or a folder that holds adapter_config.json",
                    ))
                }
                other => other?,
            };
            let (bytes, file_size) = match header {
                Err(e) if guessed && e.code() == "not_found" => {
                    let pickle = self.loc(&join(&target.path.to_string_lossy(), "adapter_model.bin"))?;
                    let why = if pickle.store.inner.head(&pickle.key).await.is_ok() {
                        REMOTE_PICKLE_WHY
                    } else {
                        NO_WEIGHTS_WHY
                    };
                    return Err(Error::adapter(target.path.clone(), "missing_weights", why));
                }
                other => other?,
            };
            let header = parse_header(&bytes, file_size).map_err(|kind| Error::Header {
                path: target.weights.clone(),
                kind,
            })?;
            let content_hash = if opts.content_hash {
                Some(self.hash_data(&weights, header.data_start(), file_size).await?)
            } else {
                None
            };
            let shadow = self.alpha_shadow(&weights, &header, file_size).await?;
            let alpha_file = shadow
                .as_ref()
                .map_or_else(|| target.weights.clone(), |s| s.path.clone());
            Ok(scan::build_result(
                target,
                config,
                &header,
                &alpha_file,
                opts,
                content_hash,
            ))
        }

        async fn fetch_config(&self, url: &str) -> Result<(String, crate::config::LoraConfig), Error> {
            let loc = self.loc(url)?;
            // One byte past the limit tells "too large" without reading a huge object.
            let (bytes, size) = self.get_range(&loc, 0..(16 << 20) + 1).await?;
            scan::check_config_size(Path::new(url), size)?;
            scan::parse_config(Path::new(url), bytes.to_vec())
        }

        /// Header bytes (after the length prefix) and the object's size.
        async fn fetch_header(&self, loc: &Loc) -> Result<(Vec<u8>, u64), Error> {
            let header_err = |kind| Error::Header {
                path: PathBuf::from(&loc.url),
                kind,
            };
            let (first, size) = self.get_range(loc, 0..SPECULATIVE_BYTES).await?;
            if size < N_LEN {
                return Err(header_err(HeaderError::HeaderTooSmall(size)));
            }
            let n = u64::from_le_bytes(first[..8].try_into().map_err(|_| short(loc, 8, first.len(), 0, size))?);
            if n > MAX_HEADER_SIZE {
                return Err(header_err(HeaderError::HeaderTooLarge(n)));
            }
            if n + N_LEN > size {
                return Err(header_err(HeaderError::InvalidHeaderLength { n, file_size: size }));
            }
            let end = (N_LEN + n) as usize;
            if end <= first.len() {
                return Ok((first[8..end].to_vec(), size));
            }
            let (rest, size_now) = self.get_range(loc, first.len() as u64..end as u64).await?;
            if size_now != size {
                return Err(changed(loc, size, size_now));
            }
            let mut bytes = Vec::with_capacity(end - 8);
            bytes.extend_from_slice(&first[8..]);
            bytes.extend_from_slice(&rest);
            Ok((bytes, size))
        }

        /// sha256 of the data section, read in bounded ranges.
        async fn hash_data(&self, loc: &Loc, start: u64, size: u64) -> Result<String, Error> {
            let mut hasher = Sha256::new();
            let mut at = start;
            while at < size {
                let end = (at + HASH_CHUNK).min(size);
                let (chunk, size_now) = self.get_range(loc, at..end).await?;
                if size_now != size {
                    return Err(changed(loc, size, size_now));
                }
                hasher.update(&chunk);
                at = end;
            }
            Ok(hasher.finalize().iter().map(|b| format!("{b:02x}")).collect())
        }

        /// `classify` reads kohya `.alpha` scalars from the weight file by path. Fetch those few
        /// bytes and place them, at their offsets, in a sparse local stand-in file.
        async fn alpha_shadow(&self, loc: &Loc, header: &Header<'_>, size: u64) -> Result<Option<Shadow>, Error> {
            let mut ranges: Vec<Range<u64>> = header
                .tensors
                .iter()
                .filter(|t| t.end > t.begin && names::split(&t.name).is_some_and(|(_, role, _)| role == Role::Alpha))
                .map(|t| {
                    let at = header.data_start() + t.begin;
                    at..at + (t.end - t.begin).min(8)
                })
                .collect();
            if ranges.is_empty() {
                return Ok(None);
            }
            ranges.sort_by_key(|r| r.start);
            let merged = merge_ranges(&ranges, ALPHA_GAP);
            let requests: Vec<_> = merged.iter().cloned().map(|r| self.get_range(loc, r)).collect();
            let fetched: Vec<Result<(Bytes, u64), Error>> =
                futures_util::stream::iter(requests).buffered(8).collect().await;
            let mut pieces: Vec<(u64, Bytes)> = Vec::with_capacity(merged.len());
            for (r, got) in merged.iter().zip(fetched) {
                let (bytes, size_now) = got?;
                if size_now != size {
                    return Err(changed(loc, size, size_now));
                }
                pieces.push((r.start, bytes));
            }
            let shadow = Shadow::new(&pieces).map_err(|e| Error::io(&loc.url, e))?;
            Ok(Some(shadow))
        }
    }

    fn short(loc: &Loc, want: u64, got: usize, at: u64, size: u64) -> Error {
        Error::adapter(
            &loc.url,
            "short_read",
            format!("asked for {want} bytes at offset {at} of a {size}-byte object, the server sent {got}"),
        )
    }

    fn changed(loc: &Loc, before: u64, now: u64) -> Error {
        Error::adapter(
            &loc.url,
            "file_changed",
            format!("object size changed from {before} to {now} bytes while it was read"),
        )
    }

    /// The error and its sources, one line.
    fn chain(e: &(dyn std::error::Error + 'static)) -> String {
        let mut out = e.to_string();
        let mut cur = e.source();
        while let Some(s) = cur {
            let s_text = s.to_string();
            if !out.contains(&s_text) {
                out.push_str(": ");
                out.push_str(&s_text);
            }
            cur = s.source();
        }
        out
    }

    fn sources<'e>(
        e: &'e (dyn std::error::Error + 'static),
    ) -> impl Iterator<Item = &'e (dyn std::error::Error + 'static)> {
        std::iter::successors(Some(e), |e| e.source())
    }

    fn is_timeout(e: &object_store::Error) -> bool {
        sources(e).any(|s| {
            s.downcast_ref::<object_store::client::HttpError>()
                .is_some_and(|h| matches!(h.kind(), object_store::client::HttpErrorKind::Timeout))
                || s.downcast_ref::<reqwest::Error>()
                    .is_some_and(reqwest::Error::is_timeout)
                || s.downcast_ref::<io::Error>()
                    .is_some_and(|i| i.kind() == io::ErrorKind::TimedOut)
        })
    }

    /// The connection itself failed: it could not be made, or the server reset or aborted it.
    fn is_connection_failure(e: &object_store::Error) -> bool {
        sources(e).any(|s| {
            s.downcast_ref::<reqwest::Error>()
                .is_some_and(reqwest::Error::is_connect)
                || s.downcast_ref::<io::Error>().is_some_and(|i| {
                    matches!(
                        i.kind(),
                        io::ErrorKind::ConnectionRefused
                            | io::ErrorKind::ConnectionReset
                            | io::ErrorKind::ConnectionAborted
                            | io::ErrorKind::BrokenPipe
                    )
                })
        })
    }

    /// The server answered a range request with the whole object (HTTP 200).
    fn ignores_range(e: &object_store::Error) -> bool {
        sources(e).any(|s| {
            let text = s.to_string();
            text.starts_with("Range request not supported") || text.starts_with("Received non-partial response")
        })
    }

    fn status_is(e: &object_store::Error, code: u16) -> bool {
        let needle = format!("status code: {code}");
        sources(e).any(|s| s.to_string().contains(&needle))
    }

    fn names_file(key: &Key) -> bool {
        key.filename().is_some_and(|n| n.ends_with(".safetensors"))
    }

    fn join(url: &str, name: &str) -> String {
        format!("{}/{name}", url.trim_end_matches('/'))
    }

    /// A URL that cannot be listed: a `.safetensors` file, else a PEFT folder.
    fn guess_target(url: &str, loc: &Loc) -> Target {
        if names_file(&loc.key) || loc.store.listable {
            return Target {
                path: url.into(),
                weights: url.into(),
                config: None,
            };
        }
        Target {
            path: url.into(),
            weights: join(url, PEFT_WEIGHTS).into(),
            config: Some(join(url, CONFIG_NAME).into()),
        }
    }

    pub(super) fn merge_ranges(sorted: &[Range<u64>], gap: u64) -> Vec<Range<u64>> {
        let mut out: Vec<Range<u64>> = Vec::new();
        for r in sorted {
            match out.last_mut() {
                Some(last) if r.start <= last.end.saturating_add(gap) => last.end = last.end.max(r.end),
                _ => out.push(r.clone()),
            }
        }
        out
    }

    /// A listing as folders, to apply the local discovery rules to.
    #[derive(Debug, Default)]
    pub(super) struct Dir {
        pub files: BTreeSet<String>,
        pub dirs: BTreeMap<String, Dir>,
    }

    impl Dir {
        /// Adds one object; hidden entries (and anything under them) are left out, as on disk.
        pub fn insert(&mut self, parts: &[String]) {
            if parts.iter().any(|p| p.starts_with('.') || p.is_empty()) {
                return;
            }
            let Some((file, folders)) = parts.split_last() else {
                return;
            };
            let mut dir = self;
            for f in folders {
                dir = dir.dirs.entry(f.clone()).or_default();
            }
            dir.files.insert(file.clone());
        }

        fn safetensors(&self) -> impl Iterator<Item = &String> {
            self.files.iter().filter(|f| f.ends_with(".safetensors"))
        }

        fn peft(&self, url: &str) -> Result<Target, Error> {
            if self.files.contains(PEFT_WEIGHTS) {
                return Ok(Target {
                    path: url.into(),
                    weights: join(url, PEFT_WEIGHTS).into(),
                    config: Some(join(url, CONFIG_NAME).into()),
                });
            }
            let why = if self.files.contains("adapter_model.bin") {
                REMOTE_PICKLE_WHY
            } else {
                NO_WEIGHTS_WHY
            };
            Err(Error::adapter(url, "missing_weights", why))
        }

        /// `scan::discover_one` for a folder, on the listing.
        pub fn walk(&self, url: &str, recursive: bool, top: bool, out: &mut Vec<Result<Target, Error>>) {
            if self.files.contains(CONFIG_NAME) {
                out.push(self.peft(url));
                return;
            }
            let files: Vec<&String> = self.safetensors().collect();
            if files.len() == 1 && self.dirs.is_empty() && !top {
                out.push(Ok(Target {
                    path: url.into(),
                    weights: join(url, files[0]).into(),
                    config: None,
                }));
                return;
            }
            for f in files {
                let u = join(url, f);
                out.push(Ok(Target {
                    path: u.clone().into(),
                    weights: u.into(),
                    config: None,
                }));
            }
            if recursive {
                for (name, sub) in &self.dirs {
                    sub.walk(&join(url, name), true, false, out);
                }
            }
        }
    }

    /// A sparse local file holding a remote object's fetched bytes at their offsets (an
    /// in-memory file on Linux, a removed-after-use temporary file elsewhere).
    struct Shadow {
        path: PathBuf,
        _file: std::fs::File,
        remove: bool,
    }

    impl Shadow {
        fn new(pieces: &[(u64, Bytes)]) -> io::Result<Shadow> {
            use std::os::unix::fs::FileExt;
            let shadow = Self::create()?;
            for (at, bytes) in pieces {
                shadow._file.write_all_at(bytes, *at)?;
            }
            Ok(shadow)
        }

        #[cfg(target_os = "linux")]
        fn create() -> io::Result<Shadow> {
            use std::os::fd::FromRawFd;
            // SAFETY: memfd_create takes a NUL-terminated name and returns a new descriptor we own.
            let fd = unsafe { libc::memfd_create(c"lorafast-alpha".as_ptr(), libc::MFD_CLOEXEC) };
            if fd < 0 {
                return Err(io::Error::last_os_error());
            }
            // SAFETY: fd is a fresh, valid descriptor that nothing else owns.
            let file = unsafe { std::fs::File::from_raw_fd(fd) };
            Ok(Shadow {
                path: PathBuf::from(format!("/proc/self/fd/{fd}")),
                _file: file,
                remove: false,
            })
        }

        #[cfg(not(target_os = "linux"))]
        fn create() -> io::Result<Shadow> {
            static NEXT: AtomicUsize = AtomicUsize::new(0);
            let name = format!(
                "lorafast-alpha-{}-{}",
                std::process::id(),
                NEXT.fetch_add(1, Ordering::Relaxed)
            );
            let path = std::env::temp_dir().join(name);
            let file = std::fs::OpenOptions::new()
                .read(true)
                .write(true)
                .create_new(true)
                .open(&path)?;
            Ok(Shadow {
                path,
                _file: file,
                remove: true,
            })
        }
    }

    impl Drop for Shadow {
        fn drop(&mut self) {
            if self.remove {
                let _ = std::fs::remove_file(&self.path);
            }
        }
    }
}

#[cfg(all(test, feature = "remote"))]
mod tests {
    use super::imp::*;

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
        assert!(p.base.ends_with("/org/repo/resolve/v1"), "{}", p.base);
        assert_eq!(p.key, "sub/adapter_model.safetensors");
        let p = parse_url("hf://datasets/org/repo/x.safetensors").unwrap();
        assert!(p.base.ends_with("/datasets/org/repo/resolve/main"), "{}", p.base);
        assert_eq!(p.key, "x.safetensors");
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
}
