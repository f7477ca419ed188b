//! Reads of one remote object for Python: a byte range, and a safetensors header.

use std::path::{Path, PathBuf};

use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict};

use crate::error::Error;
use crate::header::{self};
use crate::remote::{self};

use super::args::{remote_options, Timeout};
use super::detach_contained;
use super::header::{header_dict, safetensors_parts};

/// Bytes `start..end` of the object at a URL (clipped to its end) and the object's size, through the
/// remote layer (same stores, retries and errors as scan): `read_base`'s headers and JSON files.
#[pyfunction]
#[pyo3(signature = (url, start, end, storage_options = None, timeout = None))]
pub(super) fn read_url_range<'py>(
    py: Python<'py>,
    url: String,
    start: u64,
    end: u64,
    storage_options: Option<Vec<(String, String)>>,
    timeout: Option<Timeout>,
) -> PyResult<(Bound<'py, PyBytes>, u64)> {
    if end < start {
        return Err(PyValueError::new_err(format!("end {end} is before start {start}")));
    }
    let ropts = remote_options(storage_options, timeout, None);
    let (bytes, size) = detach_contained(py, Path::new(&url), || remote::read_range(&url, start..end, &ropts))?;
    Ok((PyBytes::new(py, &bytes), size))
}

/// `read_header` of the safetensors object at a URL: its header fetched with range requests and
/// checked as a scan checks a remote weights file (same stores, retries, bounds and errors).
#[pyfunction]
#[pyo3(signature = (url, storage_options = None, timeout = None))]
pub(super) fn read_url_header<'py>(
    py: Python<'py>,
    url: String,
    storage_options: Option<Vec<(String, String)>>,
    timeout: Option<Timeout>,
) -> PyResult<Bound<'py, PyDict>> {
    let ropts = remote_options(storage_options, timeout, None);
    let parts = detach_contained(py, Path::new(&url), || {
        let (bytes, size) = remote::read_header(&url, &ropts)?;
        header::parse_header(&bytes, size)
            .map(|h| safetensors_parts(&h))
            .map_err(|kind| Error::Header {
                path: PathBuf::from(&url),
                kind,
            })
    })?;
    header_dict(py, parts)
}
