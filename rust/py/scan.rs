//! `inspect`, `scan` and discovery for Python: each adapter as a dict, or a bulk scan as a `ScanResult`.

use std::ffi::OsString;
use std::path::{Path, PathBuf};

use pyo3::intern;
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyList, PyString};

use crate::codes::{AdapterErrorCode, ErrorCode, Flag};
use crate::error::Error;
use crate::header::ReadMode;
use crate::remote::{self};
use crate::scan::{self as core_scan, AdapterResult, Target};

use super::args::{any_url, load_options, remote_options, Concurrency, Timeout};
use super::report::ScanResult;
use super::{detach_contained, module_values, to_pyerr};

/// The header's `__metadata__` as a dict, in file order, so a report's JSON is the same text each time.
pub(super) fn metadata_dict<'py>(py: Python<'py>, r: &AdapterResult) -> PyResult<Option<Bound<'py, PyDict>>> {
    r.metadata
        .as_ref()
        .map(|m| pyo3::types::IntoPyDict::into_py_dict(m.iter().map(|(k, v)| (k, v)), py))
        .transpose()
}

/// An adapter's dict; without `with_modules` it has no `modules` key (a summary record).
pub(super) fn adapter_dict<'py>(
    py: Python<'py>,
    r: &AdapterResult,
    with_modules: bool,
) -> PyResult<Bound<'py, PyDict>> {
    let c = &r.class;
    let weight_file = r.target.weights.as_os_str().into_pyobject(py)?;
    let d = PyDict::new(py);
    d.set_item(intern!(py, "path"), r.target.path.as_os_str())?;
    d.set_item(intern!(py, "weight_files"), (&weight_file,))?;
    d.set_item(
        intern!(py, "config_path"),
        r.target.config.as_ref().map(|p| p.as_os_str()),
    )?;
    d.set_item(intern!(py, "config_json"), &r.config_json)?;
    d.set_item(intern!(py, "format"), c.format.code())?;
    d.set_item(intern!(py, "peft_type"), &c.peft_type)?;
    d.set_item(intern!(py, "num_tensors"), c.num_tensors)?;
    d.set_item(
        intern!(py, "dtypes"),
        c.dtypes.iter().map(|t| t.name()).collect::<Vec<_>>(),
    )?;
    d.set_item(intern!(py, "layers"), &c.layers)?;
    d.set_item(intern!(py, "base_model_name_or_path"), &c.base_model)?;
    d.set_item(intern!(py, "target_modules"), &c.target_modules)?;
    d.set_item(intern!(py, "rank"), c.rank)?;
    d.set_item(intern!(py, "moe_layout"), c.moe_layout.code())?;
    d.set_item(intern!(py, "num_experts"), c.num_experts)?;
    let names: Vec<&str> = Flag::set_in(c.flags).map(Flag::code).collect();
    d.set_item(intern!(py, "flags"), names)?;
    d.set_item(
        intern!(py, "variants"),
        c.variants.iter().map(|v| v.name()).collect::<Vec<_>>(),
    )?;
    d.set_item(intern!(py, "full_weight_tensors"), &c.full_weight_tensors)?;
    let problems: Vec<(&str, &str, Option<&str>)> = c
        .problems
        .iter()
        .map(|p| (p.code.code(), p.message.as_str(), p.tensor.as_deref()))
        .collect();
    d.set_item(intern!(py, "problems"), problems)?;
    d.set_item(intern!(py, "content_hash"), &r.content_hash)?;
    d.set_item(intern!(py, "metadata"), metadata_dict(py, r)?)?;
    d.set_item(intern!(py, "header_size"), r.header_size)?;
    d.set_item(intern!(py, "file_size"), r.file_size)?;
    if !with_modules {
        return Ok(d);
    }
    let weight_file = weight_file.cast_into::<PyString>()?;
    let mut values = module_values::Interned::default();
    let modules: Vec<Bound<'py, PyDict>> = c
        .modules
        .iter()
        .map(|m| module_values::module_dict(py, &m, &weight_file, &mut values))
        .collect::<PyResult<_>>()?;
    d.set_item(intern!(py, "modules"), modules)?;
    Ok(d)
}

/// Everything about one adapter, as a dict (lorafast.inspect wraps it in an `Adapter`).
#[pyfunction]
#[pyo3(signature = (path, mode = ReadMode::Pread, content_hash = false, storage_options = None, timeout = None))]
#[pyo3(text_signature = "(path, mode='pread', content_hash=False, storage_options=None, timeout=None)")]
pub(super) fn inspect<'py>(
    py: Python<'py>,
    path: PathBuf,
    mode: ReadMode,
    content_hash: bool,
    storage_options: Option<Vec<(String, String)>>,
    timeout: Option<Timeout>,
) -> PyResult<Bound<'py, PyDict>> {
    let opts = load_options(mode, content_hash, true);
    let ropts = remote_options(storage_options, timeout, None);
    let result = detach_contained(py, &path, || {
        if any_url(std::slice::from_ref(&path)) {
            let mut rows = remote::inspect_many(std::slice::from_ref(&path), opts, None, &ropts);
            rows.pop().unwrap_or_else(|| {
                Err(Error::adapter(
                    "",
                    AdapterErrorCode::Internal,
                    "inspect lost its result",
                ))
            })
        } else {
            core_scan::locate(&path).and_then(|t| core_scan::load(t, opts))
        }
    })?;
    adapter_dict(py, &result, true)
}

/// Full results for many adapter paths at once, in parallel; failures come back as exceptions in place.
#[pyfunction]
#[pyo3(signature = (paths, mode = ReadMode::Pread, content_hash = false, threads = None, storage_options = None, timeout = None, concurrency = None))]
#[pyo3(
    text_signature = "(paths, mode='pread', content_hash=False, threads=None, storage_options=None, timeout=None, concurrency=None)"
)]
#[allow(clippy::too_many_arguments)]
pub(super) fn inspect_many<'py>(
    py: Python<'py>,
    paths: Vec<PathBuf>,
    mode: ReadMode,
    content_hash: bool,
    threads: Option<usize>,
    storage_options: Option<Vec<(String, String)>>,
    timeout: Option<Timeout>,
    concurrency: Option<Concurrency>,
) -> PyResult<Bound<'py, PyList>> {
    let opts = load_options(mode, content_hash, true);
    let ropts = remote_options(storage_options, timeout, concurrency);
    let results = detach_contained(py, Path::new(""), || {
        use rayon::prelude::*;
        if any_url(&paths) {
            return Ok(remote::inspect_many(&paths, opts, threads, &ropts));
        }
        Ok(core_scan::with_pool(threads, || {
            paths
                .par_iter()
                .map(|p| core_scan::contain(p, || core_scan::locate(p).and_then(|t| core_scan::load(t, opts))))
                .collect::<Vec<_>>()
        }))
    })?;
    let items: Vec<Bound<'py, PyAny>> = results
        .iter()
        .map(|r| match r {
            Ok(a) => adapter_dict(py, a, true).map(Bound::into_any),
            Err(e) => Ok(to_pyerr(py, e).into_value(py).into_bound(py).into_any()),
        })
        .collect::<PyResult<_>>()?;
    PyList::new(py, items)
}

/// Rows in discovery order: failed discoveries in place, loaded targets between them.
fn fill_rows(
    found: Vec<Result<Target, Error>>,
    load: impl FnOnce(Vec<Target>) -> Vec<Result<AdapterResult, Error>>,
) -> Vec<Result<AdapterResult, Error>> {
    let mut targets: Vec<Target> = Vec::with_capacity(found.len());
    let mut slots: Vec<Option<Error>> = Vec::with_capacity(found.len());
    for f in found {
        match f {
            Ok(t) => {
                targets.push(t);
                slots.push(None);
            }
            Err(e) => slots.push(Some(e)),
        }
    }
    let mut loaded = load(targets).into_iter();
    slots
        .into_iter()
        .map(|s| match s {
            Some(e) => Err(e),
            None => loaded
                .next()
                .unwrap_or_else(|| Err(Error::adapter("", AdapterErrorCode::Internal, "scan lost a row"))),
        })
        .collect()
}

/// Scans files, folders and URLs in parallel with the GIL released.
#[pyfunction]
#[pyo3(signature = (paths, recursive = true, threads = None, mode = ReadMode::Pread, content_hash = false, progress = false, storage_options = None, timeout = None, concurrency = None))]
#[pyo3(
    text_signature = "(paths, recursive=True, threads=None, mode='pread', content_hash=False, progress=False, storage_options=None, timeout=None, concurrency=None)"
)]
#[allow(clippy::too_many_arguments)]
pub(super) fn scan(
    py: Python<'_>,
    paths: Vec<PathBuf>,
    recursive: bool,
    threads: Option<usize>,
    mode: ReadMode,
    content_hash: bool,
    progress: bool,
    storage_options: Option<Vec<(String, String)>>,
    timeout: Option<Timeout>,
    concurrency: Option<Concurrency>,
) -> PyResult<ScanResult> {
    // Rows keep their modules and metadata (shared between adapters whose headers repeat, see
    // `memo`), so iterating a report and its module table never read a file again.
    let opts = load_options(mode, content_hash, false);
    let ropts = remote_options(storage_options, timeout, concurrency);
    let rows = detach_contained(py, Path::new(""), || {
        if any_url(&paths) {
            // One session: the listing's connections carry the header reads, which start while the
            // listing is still coming.
            return Ok(remote::Session::new(threads, &ropts).scan(&paths, recursive, opts, progress));
        }
        Ok(core_scan::scan_paths(&paths, recursive, opts, threads, progress))
    })?;
    Ok(ScanResult { rows })
}

/// One discovered adapter as plain data: (path, weights, config, error code, error message).
type TargetItem = (
    OsString,
    Option<OsString>,
    Option<OsString>,
    Option<String>,
    Option<String>,
);

/// Discovery only, with the targets' files (for a distributed scan: discover once, load in shards).
#[pyfunction]
#[pyo3(signature = (paths, recursive = true, threads = None, storage_options = None, timeout = None, concurrency = None))]
pub(super) fn discover_targets(
    py: Python<'_>,
    paths: Vec<PathBuf>,
    recursive: bool,
    threads: Option<usize>,
    storage_options: Option<Vec<(String, String)>>,
    timeout: Option<Timeout>,
    concurrency: Option<Concurrency>,
) -> PyResult<Vec<TargetItem>> {
    let ropts = remote_options(storage_options, timeout, concurrency);
    detach_contained(py, Path::new(""), || {
        Ok(remote::discover(&paths, recursive, threads, &ropts)
            .into_iter()
            .map(target_item)
            .collect())
    })
}

fn target_item(r: Result<Target, Error>) -> TargetItem {
    match r {
        Ok(t) => (
            t.path.into_os_string(),
            Some(t.weights.into_os_string()),
            t.config.map(PathBuf::into_os_string),
            None,
            None,
        ),
        Err(e) => (
            e.path().as_os_str().to_owned(),
            None,
            None,
            Some(e.code().to_owned()),
            Some(e.detail()),
        ),
    }
}

/// Loads `discover_targets` items (a shard of them); failed items stay failed rows, in place.
#[pyfunction]
#[pyo3(signature = (items, threads = None, mode = ReadMode::Pread, content_hash = false, progress = false, storage_options = None, timeout = None, concurrency = None))]
#[pyo3(
    text_signature = "(items, threads=None, mode='pread', content_hash=False, progress=False, storage_options=None, timeout=None, concurrency=None)"
)]
#[allow(clippy::too_many_arguments)]
pub(super) fn scan_targets(
    py: Python<'_>,
    items: Vec<TargetItem>,
    threads: Option<usize>,
    mode: ReadMode,
    content_hash: bool,
    progress: bool,
    storage_options: Option<Vec<(String, String)>>,
    timeout: Option<Timeout>,
    concurrency: Option<Concurrency>,
) -> PyResult<ScanResult> {
    let opts = load_options(mode, content_hash, false);
    let ropts = remote_options(storage_options, timeout, concurrency);
    let rows = detach_contained(py, Path::new(""), || {
        let found = items
            .into_iter()
            .map(|(path, weights, config, code, message)| match (weights, code) {
                (Some(w), None) => Ok(Target {
                    path: path.into(),
                    weights: w.into(),
                    config: config.map(PathBuf::from),
                }),
                (_, code) => {
                    let code = code.as_deref().unwrap_or("internal");
                    // A code that crossed into Python and back is one of the core's; any other text is a bug.
                    let (code, message) = match ErrorCode::from_code(code) {
                        Some(known) => (known, message.unwrap_or_default()),
                        None => (
                            AdapterErrorCode::Internal.into(),
                            format!("unknown error code {code:?}: {}", message.unwrap_or_default()),
                        ),
                    };
                    Err(Error::adapter(PathBuf::from(path), code, message))
                }
            })
            .collect();
        Ok(fill_rows(found, |t| {
            remote::load_all(t, opts, threads, progress, &ropts)
        }))
    })?;
    Ok(ScanResult { rows })
}

/// Discovery only: the adapter paths `scan` would read (for tools and tests).
#[pyfunction]
#[pyo3(signature = (paths, recursive = true))]
pub(super) fn discover(
    py: Python<'_>,
    paths: Vec<PathBuf>,
    recursive: bool,
) -> PyResult<Vec<(OsString, Option<&'static str>)>> {
    detach_contained(py, Path::new(""), || {
        Ok(core_scan::with_pool(None, || core_scan::discover(&paths, recursive))
            .into_iter()
            .map(|r| match r {
                Ok(t) => (t.path.into_os_string(), None),
                Err(e) => (e.path().as_os_str().to_owned(), Some(e.code())),
            })
            .collect())
    })
}
