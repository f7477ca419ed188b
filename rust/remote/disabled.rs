//! A build without the `remote` feature: every URL input fails with `remote_unsupported`.

use super::RemoteOptions;
use crate::error::{AdapterErrorCode, Error};
use crate::scan::{AdapterResult, ScanOptions, Target};

fn unsupported(url: &str) -> Error {
    Error::adapter(
        url,
        AdapterErrorCode::RemoteUnsupported,
        "this build of lorafast has no remote support (cargo feature `remote`)",
    )
}

pub fn discover_urls(urls: &[String], _: bool, _: Option<usize>, _: &RemoteOptions) -> Vec<Vec<Result<Target, Error>>> {
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

pub fn read_range(url: &str, _: std::ops::Range<u64>, _: &RemoteOptions) -> Result<(Vec<u8>, u64), Error> {
    Err(unsupported(url))
}
