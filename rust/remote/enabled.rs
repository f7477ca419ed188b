//! The entry points of a build with the `remote` feature: a [`Session`] (one per call) owns a tokio
//! runtime and one [`Remote`] (its stores, with their connection pools, and request permits), and
//! runs every job of the call there: listing, `HEAD`s and header reads alike.

use std::collections::HashMap;
use std::io;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Once};

use futures_util::StreamExt;

use super::listing::target_key;
use super::request::io_err;
use super::stores::Remote;
use super::{RemoteOptions, Stat, StatTarget};
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

/// A call's runtime and [`Remote`]; if no runtime can be made, every item fails with that reason.
pub struct Session {
    rt: Result<tokio::runtime::Runtime, io::Error>,
    remote: Arc<Remote>,
}

impl Session {
    pub fn new(threads: Option<usize>, ropts: &RemoteOptions) -> Self {
        Session {
            rt: runtime(threads),
            remote: Arc::new(Remote::new(ropts)),
        }
    }

    fn run<T>(
        &self,
        items: &[String],
        fail: impl Fn(&str, &io::Error) -> T,
        f: impl std::future::Future<Output = Vec<T>>,
    ) -> Vec<T> {
        match &self.rt {
            Ok(rt) => rt.block_on(f),
            Err(e) => items.iter().map(|u| fail(u, e)).collect(),
        }
    }

    pub fn discover_urls(&self, urls: &[String], recursive: bool) -> Vec<Vec<Result<Target, Error>>> {
        let remote = &self.remote;
        self.run(urls, |u, e| vec![Err(io_err(u, e.kind(), e.to_string()))], async {
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
        })
    }

    /// `discover_urls` with each target's weights and config [`Stat`]: the listing's answer where
    /// the object was listed, else a `HEAD` (all of them at once, within the permits).
    pub fn discover_stat_urls(&self, urls: &[String], recursive: bool) -> Vec<Vec<StatTarget>> {
        self.remote.keep_listed.store(true, Ordering::Relaxed);
        let found = self.discover_urls(urls, recursive);
        let remote = &self.remote;
        let concurrency = remote.opts.concurrency.max(1);
        let all: Vec<String> = found.iter().flatten().map(target_url).collect();
        let stats = self.run(&all, |_, _| (Stat::Unknown, Stat::Unknown), async {
            let jobs = found.iter().flatten().map(|t| {
                let files = t.as_ref().ok().map(|t| {
                    let name = |p: &std::path::Path| p.to_string_lossy().into_owned();
                    (name(&t.weights), t.config.as_deref().map(name))
                });
                let remote = remote.clone();
                async move {
                    let Some((weights, config)) = files else {
                        return (Stat::Unknown, Stat::Unknown);
                    };
                    let job = tokio::spawn(async move {
                        let config = async {
                            match &config {
                                Some(c) => remote.stat(c).await,
                                None => Stat::Unknown,
                            }
                        };
                        futures_util::join!(remote.stat(&weights), config)
                    });
                    job.await.unwrap_or((Stat::Unknown, Stat::Unknown))
                }
            });
            in_input_order(jobs, concurrency).await
        });
        let mut stats = stats.into_iter();
        found
            .into_iter()
            .map(|targets| {
                targets
                    .into_iter()
                    .map(|t| {
                        let (w, c) = stats.next().unwrap_or((Stat::Unknown, Stat::Unknown));
                        (t, w, c)
                    })
                    .collect()
            })
            .collect()
    }

    pub fn load_urls(
        &self,
        targets: Vec<Target>,
        opts: ScanOptions,
        progress: bool,
    ) -> Vec<Result<AdapterResult, Error>> {
        let remote = &self.remote;
        let urls: Vec<String> = targets.iter().map(|t| t.path.to_string_lossy().into_owned()).collect();
        // Twice as many adapters under way as request permits: the next adapter's request waits on
        // a permit, not on the previous adapter's parsing and classification, so `concurrency`
        // requests stay in flight.
        let concurrency = remote.opts.concurrency.max(1).saturating_mul(2);
        scan::with_progress(progress, |done| {
            done.total.store(targets.len(), Ordering::Relaxed);
            self.run(&urls, |u, e| Err(io_err(u, e.kind(), e.to_string())), async {
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
        })
    }

    /// `discover_urls` and `load_urls` in one: header reads start as soon as the listing settles
    /// folders (see `Remote::discover_streaming`), while its later pages are still coming. Each
    /// URL's rows are its discovery's, in order, with every target loaded once.
    pub fn scan_urls(
        &self,
        urls: &[String],
        recursive: bool,
        opts: ScanOptions,
        progress: bool,
    ) -> Vec<Vec<Result<AdapterResult, Error>>> {
        let remote = &self.remote;
        // As in `load_urls`: twice as many adapters under way as request permits.
        let limit = remote.opts.concurrency.max(1).saturating_mul(2);
        scan::with_progress(progress, |done| {
            self.run(urls, |u, e| vec![Err(io_err(u, e.kind(), e.to_string()))], async {
                let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel::<(usize, Target)>();
                // URLs that need no listing are queued at once, in input order (the order the
                // local scan and a stalled store's "skipped" rows follow); prefixes are listed
                // all at once, each queueing its targets as its listing settles them.
                let mut jobs = Vec::with_capacity(urls.len());
                for (i, u) in urls.iter().enumerate() {
                    if let Some(found) = remote.unlisted(u) {
                        if let Ok(t) = &found {
                            let _ = tx.send((i, t.clone())); // the loader outlives every sender
                        }
                        jobs.push(futures_util::future::Either::Left(async move { vec![found] }));
                        continue;
                    }
                    let remote = remote.clone();
                    let u = u.clone();
                    let tx = tx.clone();
                    let job = tokio::spawn(async move {
                        let mut emit = |t: Target| {
                            let _ = tx.send((i, t));
                        };
                        remote.discover_streaming(&u, recursive, Some(&mut emit)).await
                    });
                    let url = urls[i].clone();
                    jobs.push(futures_util::future::Either::Right(async move {
                        job.await.unwrap_or_else(|e| vec![Err(join_error(&url, &e))])
                    }));
                }
                drop(tx); // the listings hold the other senders: the loader ends once all are done
                let discovery = futures_util::future::join_all(jobs);
                let queued = futures_util::stream::poll_fn(|cx| rx.poll_recv(cx));
                let loading = queued
                    .map(|(i, t)| {
                        done.total.fetch_add(1, Ordering::Relaxed);
                        let remote = remote.clone();
                        let key = (i, target_key(&t));
                        let url = t.path.to_string_lossy().into_owned();
                        async move {
                            let r = tokio::spawn(async move { remote.load(t, opts).await }).await;
                            done.count.fetch_add(1, Ordering::Relaxed);
                            (key, r.unwrap_or_else(|e| Err(join_error(&url, &e))))
                        }
                    })
                    .buffer_unordered(limit)
                    .collect::<HashMap<_, _>>();
                let (found, mut loaded) = futures_util::join!(discovery, loading);
                found
                    .into_iter()
                    .enumerate()
                    .map(|(i, targets)| {
                        targets
                            .into_iter()
                            .map(|t| {
                                let t = t?;
                                loaded.remove(&(i, target_key(&t))).unwrap_or_else(|| {
                                    Err(Error::adapter(t.path, AdapterErrorCode::Internal, "scan lost a row"))
                                })
                            })
                            .collect()
                    })
                    .collect()
            })
        })
    }

    pub fn inspect_urls(&self, urls: &[String], opts: ScanOptions) -> Vec<Result<AdapterResult, Error>> {
        let remote = &self.remote;
        let concurrency = remote.opts.concurrency.max(1);
        self.run(urls, |u, e| Err(io_err(u, e.kind(), e.to_string())), async {
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
}

fn target_url(t: &Result<Target, Error>) -> String {
    match t {
        Ok(t) => t.path.to_string_lossy().into_owned(),
        Err(e) => e.path().to_string_lossy().into_owned(),
    }
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
/// `read_base` (`config.json`, shard indexes) with the scan's stores, retries and error codes.
pub fn read_range(url: &str, range: std::ops::Range<u64>, ropts: &RemoteOptions) -> Result<(Vec<u8>, u64), Error> {
    read_one(url, ropts, |remote, loc| async move {
        let (bytes, size) = remote.get_range(&loc, range).await?;
        Ok((bytes.to_vec(), size))
    })
}

/// The safetensors header bytes (after the length prefix) of one object and the object's size,
/// read and checked as a scan reads a weights file (`Remote::fetch_header`): `read_base`'s shards.
pub fn read_header(url: &str, ropts: &RemoteOptions) -> Result<(Vec<u8>, u64), Error> {
    read_one(url, ropts, |remote, loc| async move { remote.fetch_header(&loc).await })
}

/// `f` on one object, in a session of its own.
fn read_one<T, F, Fut>(url: &str, ropts: &RemoteOptions, f: F) -> Result<T, Error>
where
    F: FnOnce(Arc<Remote>, super::stores::Loc) -> Fut,
    Fut: std::future::Future<Output = Result<T, Error>>,
{
    let session = Session::new(Some(1), ropts);
    let urls = [url.to_owned()];
    let remote = session.remote.clone();
    let mut out = session.run(&urls, |u, e| Err(io_err(u, e.kind(), e.to_string())), async {
        let got = match remote.loc(url) {
            Ok(loc) => f(remote.clone(), loc).await,
            Err(e) => Err(e),
        };
        vec![got]
    });
    out.pop().unwrap_or_else(|| {
        Err(Error::adapter(
            url,
            AdapterErrorCode::Internal,
            "a remote read lost its result",
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
