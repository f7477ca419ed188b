//! The entry points of a build with the `remote` feature: each call owns a tokio runtime and one
//! [`Remote`] (its stores and request permits), and runs its jobs there.

use std::io;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Once};

use futures_util::StreamExt;

use super::request::io_err;
use super::stores::Remote;
use super::RemoteOptions;
use crate::error::{AdapterErrorCode, Error};
use crate::scan::{self, AdapterResult, ScanOptions, Target};

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
            in_input_order(jobs, concurrency).await
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
        in_input_order(jobs, concurrency).await
    })
}

/// Runs `jobs` with at most `limit` in flight, starting the next one as soon as any finishes, and
/// returns their results in the input order. (`buffered` keeps a slot for every finished job
/// queued behind a slower one, so one slow answer would hold back the whole window.)
async fn in_input_order<T, F: std::future::Future<Output = T>>(jobs: impl Iterator<Item = F>, limit: usize) -> Vec<T> {
    let mut out: Vec<(usize, T)> =
        futures_util::stream::iter(jobs.enumerate().map(|(i, job)| async move { (i, job.await) }))
            .buffer_unordered(limit)
            .collect()
            .await;
    out.sort_unstable_by_key(|(i, _)| *i);
    out.into_iter().map(|(_, t)| t).collect()
}

/// Bytes `range` of one object (clipped to its end) and the object's size: the small reads of
/// `read_base` (safetensors headers, `config.json`, shard indexes) with the scan's stores, retries
/// and error codes.
pub fn read_range(url: &str, range: std::ops::Range<u64>, ropts: &RemoteOptions) -> Result<(Vec<u8>, u64), Error> {
    let remote = Remote::new(ropts);
    let urls = [url.to_owned()];
    let mut out = run(Some(1), &urls, |u, e| Err(io_err(u, e.kind(), e.to_string())), async {
        let got = async {
            let loc = remote.loc(url)?;
            remote.get_range(&loc, range).await
        };
        vec![got.await.map(|(bytes, size)| (bytes.to_vec(), size))]
    });
    out.pop().unwrap_or_else(|| {
        Err(Error::adapter(
            url,
            AdapterErrorCode::Internal,
            "read_range lost its result",
        ))
    })
}

fn join_error(url: &str, e: &tokio::task::JoinError) -> Error {
    Error::adapter(
        url,
        AdapterErrorCode::Internal,
        format!("reading this adapter panicked: {e}"),
    )
}
