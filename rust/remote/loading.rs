//! Loading one adapter: its config and header fetched in parallel, the content hash, and the kohya
//! `.alpha` scalars in a sparse shadow file, then the local scan's classification.

use std::io;
use std::ops::Range;
use std::path::{Path, PathBuf};
use std::sync::atomic::Ordering;

use bytes::Bytes;
use futures_util::StreamExt;
use object_store::ObjectStoreExt;
use sha2::{Digest, Sha256};

use super::first_read_size;
use super::listing::join;
use super::request::{changed, io_err, short};
use super::shadow::Shadow;
use super::stores::{Loc, Remote};
use crate::error::{AdapterErrorCode, Error, HeaderError};
use crate::header::{parse_header, Header, MAX_HEADER_SIZE, N_LEN};
use crate::names::{self, Role};
use crate::scan::{self, AdapterResult, ScanOptions, Target};

/// A PEFT folder with no weights: the local scan's words.
pub(super) const NO_WEIGHTS_WHY: &str = crate::scan::MISSING_WEIGHTS_WHY;
/// The torch reader works on local files only (it needs random access to the zip's central directory).
pub(super) const REMOTE_PICKLE_WHY: &str =
    "adapter_model.bin is a torch pickle; remote stores are read for safetensors weights only";
/// Merge alpha ranges closer than this into one request.
const ALPHA_GAP: u64 = 64 << 10;
/// Content hashes are read in ranges of this size, each bounded by the timeout.
const HASH_CHUNK: u64 = 8 << 20;

impl Remote {
    pub(super) async fn load(&self, target: Target, opts: ScanOptions) -> Result<AdapterResult, Error> {
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
            Err(e) if guessed && e.is(AdapterErrorCode::NotFound) => {
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
            Err(e) if guessed && e.is(AdapterErrorCode::NotFound) => {
                let pickle = self.loc(&join(&target.path.to_string_lossy(), "adapter_model.bin"))?;
                let why = if pickle.store.inner.head(&pickle.key).await.is_ok() {
                    REMOTE_PICKLE_WHY
                } else {
                    NO_WEIGHTS_WHY
                };
                return Err(Error::adapter(
                    target.path.clone(),
                    AdapterErrorCode::MissingWeights,
                    why,
                ));
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
    pub(super) async fn fetch_header(&self, loc: &Loc) -> Result<(Vec<u8>, u64), Error> {
        let header_err = |kind| Error::Header {
            path: PathBuf::from(&loc.url),
            kind,
        };
        let longest = &loc.store.longest_header;
        let listed_size = self
            .small_objects
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .get(&loc.url)
            .copied();
        let (first, size) = self
            .get_range_with(loc, || 0..first_read_size(longest.load(Ordering::Relaxed), listed_size))
            .await?;
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
        longest.fetch_max(N_LEN + n, Ordering::Relaxed);
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
