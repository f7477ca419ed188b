//! The request engine: range reads bounded by the call's permits and timeout, stalled stores
//! given up, servers that ignore `Range` streamed, and store errors mapped to adapter errors.

use std::io;
use std::ops::Range;
use std::sync::atomic::Ordering;

use bytes::Bytes;
use futures_util::StreamExt;
use object_store::{GetOptions, GetRange, ObjectStore, ObjectStoreExt};
use tokio::sync::SemaphorePermit;

use super::stores::{Loc, Remote};
use super::{SPECULATIVE_BYTES, STALL_LIMIT};
use crate::error::{AdapterErrorCode, Error};
use crate::header::MAX_HEADER_SIZE;

/// A server that ignores `Range` is read from the start; refuse to stream past this.
const NO_RANGE_LIMIT: u64 = MAX_HEADER_SIZE + (16 << 20);

pub(super) fn io_err(url: &str, kind: io::ErrorKind, message: impl Into<String>) -> Error {
    Error::io(url, io::Error::new(kind, message.into()))
}

impl Remote {
    /// Maps a store error to a per-adapter error, counting timeouts against the store.
    pub(super) fn fail(&self, loc: &Loc, e: &object_store::Error, body: bool) -> Error {
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
                AdapterErrorCode::ConnectionError,
                format!("the connection failed (refused, reset or aborted): {}", chain(e)),
            ),
            _ if timed_out => Error::adapter(
                &loc.url,
                AdapterErrorCode::Timeout,
                format!(
                    "no complete answer within the {:.3}s timeout: {}",
                    self.opts.timeout.as_secs_f64(),
                    chain(e)
                ),
            ),
            _ if body => Error::adapter(
                &loc.url,
                AdapterErrorCode::ShortRead,
                format!("the response body broke off: {}", chain(e)),
            ),
            _ => Error::adapter(&loc.url, AdapterErrorCode::RemoteError, chain(e)),
        }
    }

    /// One of the call's request permits, for a request to `loc` (an error only once the semaphore is closed).
    pub(super) async fn permit(&self, loc: &Loc) -> Result<SemaphorePermit<'_>, Error> {
        self.permits
            .acquire()
            .await
            .map_err(|e| Error::adapter(&loc.url, AdapterErrorCode::Internal, e.to_string()))
    }

    pub(super) fn check_stalled(&self, loc: &Loc) -> Result<(), Error> {
        let n = loc.store.stalls.load(Ordering::Relaxed);
        if n >= STALL_LIMIT {
            return Err(Error::adapter(
                &loc.url,
                AdapterErrorCode::Timeout,
                format!(
                    "skipped: this server timed out on {n} requests in a row (timeout {:.3}s)",
                    self.opts.timeout.as_secs_f64()
                ),
            ));
        }
        Ok(())
    }

    /// Bytes `range` of an object (clipped to its end) and the object's size.
    pub(super) async fn get_range(&self, loc: &Loc, range: Range<u64>) -> Result<(Bytes, u64), Error> {
        self.get_range_with(loc, || range).await
    }

    /// `get_range` of the range `range()` gives once a permit is held: a read that waited for its
    /// turn is sized from what is known when it goes out.
    pub(super) async fn get_range_with(
        &self,
        loc: &Loc,
        range: impl FnOnce() -> Range<u64>,
    ) -> Result<(Bytes, u64), Error> {
        let _permit = self.permit(loc).await?;
        self.check_stalled(loc)?;
        let range = range();
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
        let want = range.end.min(size).saturating_sub(range.start);
        let bytes = self
            .range_body(loc, result.into_stream(), want, range.start, size)
            .await?;
        loc.store.stalls.store(0, Ordering::Relaxed);
        Ok((bytes, size))
    }

    /// The body of a range answer, which must be the `want` bytes its `Content-Range` announced.
    /// Read chunk by chunk and refused as soon as it runs past them: a `Content-Length` larger
    /// than the range (a body that never ends) costs no more memory than the range.
    async fn range_body(
        &self,
        loc: &Loc,
        mut stream: futures_util::stream::BoxStream<'static, object_store::Result<Bytes>>,
        want: u64,
        at: u64,
        size: u64,
    ) -> Result<Bytes, Error> {
        // `want` comes from the server's sizes: reserve no more than a header read needs up front.
        let mut out = Vec::with_capacity(want.min(SPECULATIVE_BYTES) as usize);
        while let Some(chunk) = stream.next().await {
            let chunk = chunk.map_err(|e| self.fail(loc, &e, true))?;
            if (out.len() + chunk.len()) as u64 > want {
                return Err(Error::adapter(
                    &loc.url,
                    AdapterErrorCode::RemoteError,
                    format!(
                        "asked for {want} bytes at offset {at} of a {size}-byte object, the server sent more \
                         than its Content-Range announced"
                    ),
                ));
            }
            out.extend_from_slice(&chunk);
        }
        if out.len() as u64 != want {
            return Err(short(loc, want, out.len(), at, size));
        }
        Ok(Bytes::from(out))
    }

    /// For a server that ignores `Range`: stream the object from its start, keep `range`, hang up.
    async fn get_without_range(&self, loc: &Loc, range: Range<u64>) -> Result<(Bytes, u64), Error> {
        if range.end > NO_RANGE_LIMIT && range.start > 0 {
            return Err(Error::adapter(
                &loc.url,
                AdapterErrorCode::RemoteError,
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
}

pub(super) fn short(loc: &Loc, want: u64, got: usize, at: u64, size: u64) -> Error {
    Error::adapter(
        &loc.url,
        AdapterErrorCode::ShortRead,
        format!("asked for {want} bytes at offset {at} of a {size}-byte object, the server sent {got}"),
    )
}

pub(super) fn changed(loc: &Loc, before: u64, now: u64) -> Error {
    Error::adapter(
        &loc.url,
        AdapterErrorCode::FileChanged,
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
