//! A build without the `remote` feature: every URL input fails with `remote_unsupported`.

use super::{RemoteOptions, Stat, StatTarget};
use crate::error::{AdapterErrorCode, Error};
use crate::scan::{AdapterResult, ScanOptions, Target};

fn unsupported(url: &str) -> Error {
    Error::adapter(
        url,
        AdapterErrorCode::RemoteUnsupported,
        "this build of lorafast has no remote support (cargo feature `remote`)",
    )
}

/// A build without remote support: nothing to hold.
pub struct Session;

impl Session {
    pub fn new(_: Option<usize>, _: &RemoteOptions) -> Self {
        Session
    }

    pub fn discover_urls(&self, urls: &[String], _: bool) -> Vec<Vec<Result<Target, Error>>> {
        urls.iter().map(|u| vec![Err(unsupported(u))]).collect()
    }

    pub fn discover_stat_urls(&self, urls: &[String], recursive: bool) -> Vec<Vec<StatTarget>> {
        self.discover_urls(urls, recursive)
            .into_iter()
            .map(|v| v.into_iter().map(|t| (t, Stat::Unknown, Stat::Unknown)).collect())
            .collect()
    }

    pub fn load_urls(&self, targets: Vec<Target>, _: ScanOptions, _: bool) -> Vec<Result<AdapterResult, Error>> {
        targets
            .iter()
            .map(|t| Err(unsupported(&t.path.to_string_lossy())))
            .collect()
    }

    pub fn scan_urls(
        &self,
        urls: &[String],
        _: bool,
        _: ScanOptions,
        _: bool,
    ) -> Vec<Vec<Result<AdapterResult, Error>>> {
        urls.iter().map(|u| vec![Err(unsupported(u))]).collect()
    }

    pub fn inspect_urls(&self, urls: &[String], _: ScanOptions) -> Vec<Result<AdapterResult, Error>> {
        urls.iter().map(|u| Err(unsupported(u))).collect()
    }
}

pub fn read_range(url: &str, _: std::ops::Range<u64>, _: &RemoteOptions) -> Result<(Vec<u8>, u64), Error> {
    Err(unsupported(url))
}

pub fn read_header(url: &str, _: &RemoteOptions) -> Result<(Vec<u8>, u64), Error> {
    Err(unsupported(url))
}
