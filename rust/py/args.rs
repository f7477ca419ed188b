//! The keyword arguments the functions of `_core` share: `mode`, `timeout`, `concurrency`, and the
//! load and remote options they make.

use std::path::PathBuf;

use pyo3::exceptions::{PyTypeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::PyString;

use crate::header::ReadMode;
use crate::remote::{self, RemoteOptions};
use crate::scan::{is_url, ScanOptions};

/// `mode="pread"` or `"mmap"`: any other string is a ValueError, anything else a TypeError. pyo3
/// shows a default that is no literal as `...`, so the functions taking a mode spell their
/// `text_signature` with `mode='pread'` (stubtest checks it against `_core.pyi`).
impl<'a, 'py> FromPyObject<'a, 'py> for ReadMode {
    type Error = PyErr;

    fn extract(obj: Borrowed<'a, 'py, PyAny>) -> PyResult<Self> {
        let name = obj.cast::<PyString>().map_err(|_| {
            PyTypeError::new_err(format!(
                "mode must be 'pread' or 'mmap', not {}",
                obj.get_type().name().map_or_else(|_| "?".into(), |n| n.to_string())
            ))
        })?;
        let name = name.to_cow()?;
        ReadMode::from_name(&name)
            .ok_or_else(|| PyValueError::new_err(format!("mode must be 'pread' or 'mmap', not {name:?}")))
    }
}

/// `timeout=` in seconds: positive, not NaN (a ValueError otherwise); huge values mean no limit.
pub(super) struct Timeout(pub(super) std::time::Duration);

impl<'a, 'py> FromPyObject<'a, 'py> for Timeout {
    type Error = PyErr;

    fn extract(obj: Borrowed<'a, 'py, PyAny>) -> PyResult<Self> {
        let seconds: f64 = obj.extract()?;
        remote::timeout_from_secs(seconds)
            .map(Timeout)
            .map_err(PyValueError::new_err)
    }
}

/// `concurrency=`: requests in flight at once, at least 1 (a ValueError otherwise).
pub(super) struct Concurrency(pub(super) usize);

impl<'a, 'py> FromPyObject<'a, 'py> for Concurrency {
    type Error = PyErr;

    fn extract(obj: Borrowed<'a, 'py, PyAny>) -> PyResult<Self> {
        match obj.extract::<usize>()? {
            0 => Err(PyValueError::new_err("concurrency must be at least 1")),
            // More requests in flight than this gain nothing, and tokio's semaphore panics past 2^61.
            c => Ok(Concurrency(c.min(remote::MAX_CONCURRENCY))),
        }
    }
}

/// Load options from the Python keywords. Every load keeps its modules; `fresh` (inspect) reads
/// without the per-thread memo, so `inspect` stays the reference a scan's rows are checked against.
pub(super) fn load_options(mode: ReadMode, content_hash: bool, fresh: bool) -> ScanOptions {
    ScanOptions {
        mode,
        keep_modules: true,
        content_hash,
        fresh,
    }
}

/// Remote access settings from the Python keywords, each already checked as it was extracted
/// (defaults: see `remote/mod.rs`).
pub(super) fn remote_options(
    storage_options: Option<Vec<(String, String)>>,
    timeout: Option<Timeout>,
    concurrency: Option<Concurrency>,
) -> RemoteOptions {
    let default = RemoteOptions::default();
    RemoteOptions {
        storage_options: storage_options.unwrap_or_default(),
        timeout: timeout.map_or(default.timeout, |t| t.0),
        concurrency: concurrency.map_or(default.concurrency, |c| c.0),
        ..default
    }
}

/// Does any input name a URL? (A path that is not UTF-8 never does.)
pub(super) fn any_url(paths: &[PathBuf]) -> bool {
    paths.iter().any(|p| p.to_str().is_some_and(is_url))
}
