//! The only file that uses pyo3: converts core results to Python objects and core errors to the
//! exception tree of `lorafast.errors`. All I/O and parsing run with the GIL released.

use std::ffi::{OsStr, OsString};
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};

use numpy::ndarray::ArrayView1;
use numpy::{IntoPyArray, PyArray1};
use pyo3::exceptions::{PyFileNotFoundError, PyOSError, PyPermissionError, PyTypeError, PyValueError};
use pyo3::intern;
use pyo3::prelude::*;
use pyo3::types::{PyBool, PyBytes, PyDict, PyList, PyString, PyTuple, PyType};

use crate::classify::{Format, MoeLayout};
use crate::codes::{AdapterErrorCode, ErrorCode, Flag, HeaderErrorCode, ProblemCode, TorchErrorCode};
use crate::error::Error;
use crate::header::{self, Dtype, ReadMode};
use crate::remote::{self, RemoteOptions};
use crate::report::module_table::{self, ModuleTable, StringColumn};
use crate::report::records;
use crate::scan::{self as core_scan, is_url, AdapterResult, ScanOptions, Target};
use crate::torch;

mod adapters;
mod index;
mod instances;
mod module_values;
mod parquet_columns;

/// Paths go to Python as `str` decoded the way `os.fsdecode` does (surrogateescape), so a name
/// that is not UTF-8 round-trips to the same bytes.
fn to_pyerr(py: Python<'_>, err: &Error) -> PyErr {
    let path: OsString = err.path().as_os_str().to_owned();
    match err {
        Error::Io { source, .. } => {
            let args = (Error::errno(source), source.to_string(), path);
            match source.kind() {
                std::io::ErrorKind::NotFound => PyFileNotFoundError::new_err(args),
                std::io::ErrorKind::PermissionDenied => PyPermissionError::new_err(args),
                _ => PyOSError::new_err(args),
            }
        }
        Error::Header { .. } | Error::Adapter { .. } => {
            // By code, so that a header error read back from an index is a HeaderError too.
            let class = match err.error_code() {
                ErrorCode::Header(_) => "HeaderError",
                ErrorCode::Adapter(AdapterErrorCode::Internal) => "InternalError",
                _ => "AdapterError",
            };
            let build = || -> PyResult<PyErr> {
                let cls = py.import("lorafast.errors")?.getattr(class)?;
                let exc = cls.call1((err.to_string(), err.code(), path.clone()))?;
                Ok(PyErr::from_value(exc))
            };
            build().unwrap_or_else(|e| e)
        }
    }
}

/// Core work with the GIL released. A panic in it becomes `path`'s `internal` error, raised as
/// `lorafast.InternalError`, never pyo3's `PanicException` (a BaseException that `except
/// Exception` misses).
fn detach_contained<T: Send>(py: Python<'_>, path: &Path, f: impl FnOnce() -> Result<T, Error> + Send) -> PyResult<T> {
    py.detach(|| core_scan::contain(path, f)).map_err(|e| to_pyerr(py, &e))
}

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
struct Timeout(std::time::Duration);

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
struct Concurrency(usize);

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

/// (name, dtype, shape, (begin, end)) of one tensor.
type TensorRow = (String, &'static str, Vec<u64>, (u64, u64));

/// Header as a dict: tensors as (name, dtype, shape, (begin, end)) in file order.
#[pyfunction]
#[pyo3(signature = (path, mode = ReadMode::Pread))]
#[pyo3(text_signature = "(path, mode='pread')")]
fn read_header<'py>(py: Python<'py>, path: PathBuf, mode: ReadMode) -> PyResult<Bound<'py, PyDict>> {
    let result = detach_contained(py, &path, || {
        core_scan::debug_hook(&path);
        let mut buf = Vec::new();
        header::read_header(&path, mode, &mut buf).map(|h| safetensors_parts(&h))
    });
    header_dict(py, result?)
}

/// A safetensors header's parts, as `read_header` returns them.
fn safetensors_parts(h: &header::Header<'_>) -> HeaderParts {
    let tensors: Vec<TensorRow> = h
        .tensors
        .iter()
        .map(|t| {
            (
                t.name.to_string(),
                t.dtype.name(),
                h.shape(t).to_vec(),
                (t.begin, t.end),
            )
        })
        .collect();
    let metadata: Option<Vec<(String, String)>> = h
        .metadata
        .as_ref()
        .map(|m| m.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect());
    let warnings: Vec<(&'static str, String)> = h.warnings.iter().map(|w| (w.code.code(), w.message.clone())).collect();
    (tensors, metadata, h.header_size, h.file_size, warnings)
}

/// `read_torch_header`'s dict has `read_header`'s shape. Offsets are file offsets of each tensor's
/// bytes (its extent in its storage record), and `header_size` is the size of `data.pkl`.
#[pyfunction]
fn read_torch_header<'py>(py: Python<'py>, path: PathBuf) -> PyResult<Bound<'py, PyDict>> {
    let result = detach_contained(py, &path, || {
        torch::read_torch_header(&path).map(|t| {
            let h = &t.header;
            let tensors: Vec<TensorRow> = h
                .tensors
                .iter()
                .map(|e| {
                    let at = h.data_start();
                    (
                        e.name.to_string(),
                        e.dtype.name(),
                        h.shape(e).to_vec(),
                        (at + e.begin, at + e.end),
                    )
                })
                .collect();
            let warnings = h.warnings.iter().map(|w| (w.code.code(), w.message.clone())).collect();
            (tensors, None, t.pickle_size, h.file_size, warnings)
        })
    });
    header_dict(py, result?)
}

/// (tensors, metadata, header size, file size, warnings) of a read header.
type HeaderParts = (
    Vec<TensorRow>,
    Option<Vec<(String, String)>>,
    u64,
    u64,
    Vec<(&'static str, String)>,
);

fn header_dict<'py>(py: Python<'py>, parts: HeaderParts) -> PyResult<Bound<'py, PyDict>> {
    let (tensors, metadata, header_size, file_size, warnings) = parts;
    let d = PyDict::new(py);
    let tensors: Vec<Bound<'py, PyTuple>> = tensors
        .into_iter()
        .map(|(n, dt, shape, off)| {
            PyTuple::new(
                py,
                [
                    n.into_pyobject(py)?.into_any(),
                    dt.into_pyobject(py)?.into_any(),
                    PyTuple::new(py, shape)?.into_any(),
                    off.into_pyobject(py)?.into_any(),
                ],
            )
        })
        .collect::<PyResult<_>>()?;
    d.set_item("tensors", tensors)?;
    d.set_item(
        "metadata",
        metadata.map(|m| m.into_iter().collect::<std::collections::HashMap<_, _>>()),
    )?;
    d.set_item("header_size", header_size)?;
    d.set_item("file_size", file_size)?;
    d.set_item("warnings", warnings)?;
    Ok(d)
}

/// The header's `__metadata__` as a dict, in file order, so a report's JSON is the same text each time.
fn metadata_dict<'py>(py: Python<'py>, r: &AdapterResult) -> PyResult<Option<Bound<'py, PyDict>>> {
    r.metadata
        .as_ref()
        .map(|m| pyo3::types::IntoPyDict::into_py_dict(m.iter().map(|(k, v)| (k, v)), py))
        .transpose()
}

/// An adapter's dict; without `with_modules` it has no `modules` key (a summary record).
fn adapter_dict<'py>(py: Python<'py>, r: &AdapterResult, with_modules: bool) -> PyResult<Bound<'py, PyDict>> {
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
    d.set_item(intern!(py, "format"), c.format.name())?;
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
    d.set_item(intern!(py, "moe_layout"), c.moe_layout.name())?;
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

/// Load options from the Python keywords. Every load keeps its modules; `fresh` (inspect) reads
/// without the per-thread memo, so `inspect` stays the reference a scan's rows are checked against.
fn load_options(mode: ReadMode, content_hash: bool, fresh: bool) -> ScanOptions {
    ScanOptions {
        mode,
        keep_modules: true,
        content_hash,
        fresh,
    }
}

/// Remote access settings from the Python keywords, each already checked as it was extracted
/// (defaults: see `remote/mod.rs`).
fn remote_options(
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
fn any_url(paths: &[PathBuf]) -> bool {
    paths.iter().any(|p| p.to_str().is_some_and(is_url))
}

/// Everything about one adapter, as a dict (lorafast.inspect wraps it in an `Adapter`).
#[pyfunction]
#[pyo3(signature = (path, mode = ReadMode::Pread, content_hash = false, storage_options = None, timeout = None))]
#[pyo3(text_signature = "(path, mode='pread', content_hash=False, storage_options=None, timeout=None)")]
fn inspect<'py>(
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

/// Bytes `start..end` of the object at a URL (clipped to its end) and the object's size, through the
/// remote layer (same stores, retries and errors as scan): `read_base`'s headers and JSON files.
#[pyfunction]
#[pyo3(signature = (url, start, end, storage_options = None, timeout = None))]
fn read_url_range<'py>(
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
fn read_url_header<'py>(
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

/// Full results for many adapter paths at once, in parallel; failures come back as exceptions in place.
#[pyfunction]
#[pyo3(signature = (paths, mode = ReadMode::Pread, content_hash = false, threads = None, storage_options = None, timeout = None, concurrency = None))]
#[pyo3(
    text_signature = "(paths, mode='pread', content_hash=False, threads=None, storage_options=None, timeout=None, concurrency=None)"
)]
#[allow(clippy::too_many_arguments)]
fn inspect_many<'py>(
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

/// Status codes of the `status` column.
const STATUS_OK: u8 = 0;
const STATUS_PROBLEMS: u8 = 1;
const STATUS_ERROR: u8 = 2;

/// The result of a bulk scan, kept in Rust; Python reads it as columns or per row.
#[pyclass(frozen, module = "lorafast._core")]
struct ScanResult {
    rows: Vec<Result<AdapterResult, Error>>,
}

#[pymethods]
impl ScanResult {
    fn __len__(&self) -> usize {
        self.rows.len()
    }

    /// The adapter path of each row (as `os.fsdecode` gives it: the file's own bytes).
    fn paths(&self) -> Vec<&OsStr> {
        self.rows
            .iter()
            .map(|r| match r {
                Ok(a) => a.target.path.as_os_str(),
                Err(e) => e.path().as_os_str(),
            })
            .collect()
    }

    /// (row, path, code, message) for each row that failed.
    fn errors(&self) -> Vec<(usize, &OsStr, &'static str, String)> {
        self.rows
            .iter()
            .enumerate()
            .filter_map(|(i, r)| {
                r.as_ref()
                    .err()
                    .map(|e| (i, e.path().as_os_str(), e.code(), e.detail()))
            })
            .collect()
    }

    /// One numpy array per column, one row per adapter, built without a Python object per row.
    fn columns<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let n = self.rows.len();
        let mut path_index = Vec::with_capacity(n);
        let mut status = Vec::with_capacity(n);
        let mut format = Vec::with_capacity(n);
        let mut rank = Vec::with_capacity(n);
        let mut num_tensors = Vec::with_capacity(n);
        let mut moe_layout = Vec::with_capacity(n);
        let mut num_experts = Vec::with_capacity(n);
        let mut num_layers = Vec::with_capacity(n);
        let mut flag_bits = Vec::with_capacity(n);
        let mut num_problems = Vec::with_capacity(n);
        for (i, row) in self.rows.iter().enumerate() {
            path_index.push(i as u32);
            match row {
                Ok(a) => {
                    let c = &a.class;
                    status.push(if c.problems.is_empty() {
                        STATUS_OK
                    } else {
                        STATUS_PROBLEMS
                    });
                    format.push(c.format as u8);
                    rank.push(c.rank as u32);
                    num_tensors.push(c.num_tensors);
                    moe_layout.push(c.moe_layout as u8);
                    num_experts.push(c.num_experts as u32);
                    num_layers.push(c.layers.len() as u32);
                    flag_bits.push(c.flags);
                    num_problems.push(c.problems.len() as u32);
                }
                Err(_) => {
                    status.push(STATUS_ERROR);
                    format.push(Format::Unknown as u8);
                    rank.push(0);
                    num_tensors.push(0);
                    moe_layout.push(MoeLayout::Dense as u8);
                    num_experts.push(0);
                    num_layers.push(0);
                    flag_bits.push(0);
                    num_problems.push(0);
                }
            }
        }
        let d = PyDict::new(py);
        d.set_item("path_index", path_index.into_pyarray(py))?;
        d.set_item("status", status.into_pyarray(py))?;
        d.set_item("format", format.into_pyarray(py))?;
        d.set_item("rank", rank.into_pyarray(py))?;
        d.set_item("num_tensors", num_tensors.into_pyarray(py))?;
        d.set_item("moe_layout", moe_layout.into_pyarray(py))?;
        d.set_item("num_experts", num_experts.into_pyarray(py))?;
        d.set_item("num_layers", num_layers.into_pyarray(py))?;
        d.set_item("flags", flag_bits.into_pyarray(py))?;
        d.set_item("num_problems", num_problems.into_pyarray(py))?;
        Ok(d)
    }

    /// The summary record of row `i` (no per-module detail), or None for a failed row.
    fn record<'py>(&self, py: Python<'py>, i: usize) -> PyResult<Option<Bound<'py, PyDict>>> {
        match self.rows.get(i) {
            Some(Ok(a)) => adapter_dict(py, a, false).map(Some),
            Some(Err(_)) => Ok(None),
            None => Err(pyo3::exceptions::PyIndexError::new_err(i)),
        }
    }

    /// Full adapter dicts (modules included) of the successful rows in `start..stop`, built from
    /// what the scan kept: no file is read.
    fn adapters<'py>(&self, py: Python<'py>, start: usize, stop: usize) -> PyResult<Bound<'py, PyList>> {
        let stop = stop.min(self.rows.len());
        let ok = || self.rows[start.min(stop)..stop].iter().filter_map(|r| r.as_ref().ok());
        let mut modules = adapters::BatchModules::new(adapters::Batch::of(ok()));
        let items = ok()
            .map(|a| {
                let d = adapter_dict(py, a, false)?;
                d.set_item(intern!(py, "modules"), modules.dicts(py, a)?)?;
                Ok(d)
            })
            .collect::<PyResult<Vec<_>>>()?;
        PyList::new(py, items)
    }

    /// `Adapter` objects of the successful rows in `start..stop`, and the config texts Python
    /// parses into them (`py/adapters.rs`; `types` is `lorafast.scanner._ADAPTER_TYPES`).
    #[allow(clippy::type_complexity)]
    fn adapter_objects<'py, 'r>(
        slf: &'r Bound<'py, Self>,
        start: usize,
        stop: usize,
        types: &Bound<'py, PyTuple>,
    ) -> PyResult<(Bound<'py, PyList>, Vec<(usize, &'r str)>)> {
        let rows = &slf.get().rows;
        let (start, stop) = (start.min(rows.len()), stop.min(rows.len()));
        adapters::build(slf.py(), slf.as_any(), &rows[start.min(stop)..stop], start, types)
    }

    /// The `LoraModule` objects of row `row` for `adapter`, which `adapter_objects` gave without
    /// them, with the cache of its batch; `adapter`'s instance dict becomes its fields, in field
    /// order, `modules` among them.
    #[pyo3(signature = (adapter, row, types, cache = None))]
    fn adapter_modules<'py>(
        &self,
        py: Python<'py>,
        adapter: &Bound<'py, PyAny>,
        row: usize,
        types: &Bound<'py, PyTuple>,
        cache: Option<&Bound<'py, adapters::ModuleCache>>,
    ) -> PyResult<Bound<'py, PyTuple>> {
        match self.rows.get(row) {
            Some(Ok(a)) => adapters::modules(py, a, adapter, types, cache),
            _ => Err(pyo3::exceptions::PyIndexError::new_err(row)),
        }
    }

    /// Summary records (no modules) of the successful rows in `start..stop`.
    fn records<'py>(&self, py: Python<'py>, start: usize, stop: usize) -> PyResult<Bound<'py, PyList>> {
        let stop = stop.min(self.rows.len());
        let items = self.rows[start.min(stop)..stop]
            .iter()
            .filter_map(|r| r.as_ref().ok())
            .map(|a| adapter_dict(py, a, false))
            .collect::<PyResult<Vec<_>>>()?;
        PyList::new(py, items)
    }

    /// The summary records of `records` (without `config_json`) as the JSON text `json.dumps` gives
    /// for their list, less its brackets: `to_json`'s adapters without a Python object per row.
    fn records_json(&self, py: Python<'_>, start: usize, stop: usize) -> String {
        let stop = stop.min(self.rows.len());
        let rows: Vec<&AdapterResult> = self.rows[start.min(stop)..stop]
            .iter()
            .filter_map(|r| r.as_ref().ok())
            .collect();
        py.detach(|| records::records_text(&rows))
    }

    /// `prefix`, the summary records of every successful row as `records_json` writes them (joined
    /// by ", "), then `suffix`: `to_json()`'s whole text, made as one `str` of its final length and
    /// written in place on the scan's threads, so that the text is held once (joining batches held
    /// it twice; growing it by `+=` held it twice whenever the allocator moved it).
    fn json_text<'py>(&self, py: Python<'py>, prefix: &str, suffix: &str) -> PyResult<Bound<'py, PyString>> {
        if !prefix.is_ascii() || !suffix.is_ascii() {
            return Err(PyValueError::new_err(
                "json_text: prefix and suffix must be ASCII (json.dumps output)",
            ));
        }
        let ok: Vec<&AdapterResult> = self.rows.iter().filter_map(|r| r.as_ref().ok()).collect();
        // Each record is written twice: once to learn its length, once into the text.
        let lens = py.detach(|| core_scan::with_pool(None, || records::record_lengths(&ok)));
        let total = prefix.len() + records::joined_len(&lens) + suffix.len();
        let (text, data) = ascii_str(py, total)?;
        // SAFETY: `data` is the `total` bytes of the str just made, which nothing else refers to
        // until it is returned.
        let out = unsafe { std::slice::from_raw_parts_mut(data, total) };
        let (head, rest) = out.split_at_mut(prefix.len());
        head.copy_from_slice(prefix.as_bytes());
        let (body, tail) = rest.split_at_mut(rest.len() - suffix.len());
        tail.copy_from_slice(suffix.as_bytes());
        py.detach(|| core_scan::with_pool(None, || records::write_records(&ok, &lens, body)));
        // `record_json` escapes as `ensure_ascii` does; a str of maxchar 127 must hold nothing else.
        if !out.is_ascii() {
            return Err(PyValueError::new_err("json_text: a record was not ASCII"));
        }
        Ok(text)
    }

    /// The adapter table's columns, one row per adapter: numpy arrays; `(values, valid)` pairs for
    /// nullable numbers; `(codes, dictionary)` pairs for repeated strings (code -1: null); lists of
    /// `str` for unique strings, left out without `strings` (`string_buffers` gives them).
    #[pyo3(signature = (strings = true))]
    fn table<'py>(&self, py: Python<'py>, strings: bool) -> PyResult<Bound<'py, PyDict>> {
        let n = self.rows.len();
        let mut peft_type = Interner::default();
        let mut base_model = Interner::default();
        let mut error_code = Interner::default();
        let mut weight_file: Vec<Option<&OsStr>> = Vec::with_capacity(n);
        let mut config_path: Vec<Option<&OsStr>> = Vec::with_capacity(n);
        let mut content_hash: Vec<Option<&str>> = Vec::with_capacity(n);
        let mut error_message: Vec<Option<String>> = Vec::with_capacity(n);
        let mut header_size = Nullable::<u64>::with_capacity(n);
        let mut file_size = Nullable::<u64>::with_capacity(n);
        for row in &self.rows {
            match row {
                Ok(a) => {
                    peft_type.push(a.class.peft_type.as_deref());
                    base_model.push(a.class.base_model.as_deref());
                    error_code.push(None);
                    weight_file.push(Some(a.target.weights.as_os_str()));
                    config_path.push(a.target.config.as_ref().map(|p| p.as_os_str()));
                    content_hash.push(a.content_hash.as_deref());
                    error_message.push(None);
                    header_size.push(Some(a.header_size));
                    file_size.push(Some(a.file_size));
                }
                Err(e) => {
                    peft_type.push(None);
                    base_model.push(None);
                    error_code.push(Some(e.code()));
                    weight_file.push(None);
                    config_path.push(None);
                    content_hash.push(None);
                    error_message.push(Some(e.detail()));
                    header_size.push(None);
                    file_size.push(None);
                }
            }
        }
        let d = PyDict::new(py);
        d.set_item("peft_type", peft_type.into_py(py)?)?;
        d.set_item("base_model_name_or_path", base_model.into_py(py)?)?;
        d.set_item("header_size", header_size.into_py(py)?)?;
        d.set_item("file_size", file_size.into_py(py)?)?;
        d.set_item("error_code", error_code.into_py(py)?)?;
        if strings {
            d.set_item("weight_file", weight_file)?;
            d.set_item("config_path", config_path)?;
            d.set_item("content_hash", content_hash)?;
            d.set_item("error_message", error_message)?;
        }
        Ok(d)
    }

    /// One string column of the adapter table (`path`, `weight_file`, `config_path`,
    /// `content_hash`, `error_message`) as Arrow's utf8 buffers: (int32 offsets, bytes, valid,
    /// escaped), no `str` per row. Bytes of a path that are not UTF-8 are written `\xNN`, as
    /// `os.fsdecode(p).encode("utf-8", "surrogateescape").decode("utf-8", "backslashreplace")` gives
    /// them, since Arrow strings are UTF-8; `escaped` says whether any was. None past 2 GiB of
    /// text (int32 offsets).
    fn string_buffers<'py>(&self, py: Python<'py>, name: &str) -> PyResult<Option<Bound<'py, PyTuple>>> {
        if !matches!(
            name,
            "path" | "weight_file" | "config_path" | "content_hash" | "error_message"
        ) {
            return Err(PyValueError::new_err(format!("no string column {name:?}")));
        }
        let n = self.rows.len();
        let mut offsets: Vec<i32> = Vec::with_capacity(n + 1);
        let mut data: Vec<u8> = Vec::new();
        let mut valid: Vec<bool> = Vec::with_capacity(n);
        offsets.push(0);
        let mut escaped = false;
        let mut detail: String;
        for row in &self.rows {
            let value: Option<&[u8]> = match (name, row) {
                ("path", Ok(a)) => Some(a.target.path.as_os_str().as_bytes()),
                ("path", Err(e)) => Some(e.path().as_os_str().as_bytes()),
                ("weight_file", Ok(a)) => Some(a.target.weights.as_os_str().as_bytes()),
                ("config_path", Ok(a)) => a.target.config.as_ref().map(|p| p.as_os_str().as_bytes()),
                ("content_hash", Ok(a)) => a.content_hash.as_deref().map(str::as_bytes),
                ("error_message", Err(e)) => {
                    detail = e.detail();
                    Some(detail.as_bytes())
                }
                _ => None, // weight_file, config_path, content_hash of a failed row; error_message of a loaded one
            };
            if let Some(bytes) = value {
                escaped |= push_utf8_escaped(&mut data, bytes);
            }
            valid.push(value.is_some());
            let Ok(end) = i32::try_from(data.len()) else {
                return Ok(None);
            };
            offsets.push(end);
        }
        let columns = [
            offsets.into_pyarray(py).into_any(),
            data.into_pyarray(py).into_any(),
            valid.into_pyarray(py).into_any(),
            PyBool::new(py, escaped).to_owned().into_any(),
        ];
        Ok(Some(PyTuple::new(py, columns)?))
    }

    /// The module table's columns, one row per module of every successful adapter, `row` naming
    /// the adapter's row; encoded as in `table`, with `scale` (`LoraModule.scale`) after `alpha`.
    /// Built on the scan's threads with the GIL released (`rust/report/module_table.rs`).
    fn module_table<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let t = py
            .detach(|| core_scan::with_pool(None, || ModuleTable::build(&self.rows)))
            .map_err(|e| pyo3::exceptions::PyMemoryError::new_err(format!("module table: {e}")))?;
        let [name, key, leaf, kind, dtype, a_key, b_key] = t.strings;
        let [num_experts, rank, in_features, out_features, config_rank] = t.numbers;
        // Every column is a numpy view of the one arena, which lives as long as any of them.
        let owner = Bound::new(py, ColumnMemory(t.arena))?;
        let strings = |c: StringColumn<'_>| -> PyResult<Bound<'py, PyTuple>> {
            PyTuple::new(
                py,
                [arena_column(&owner, &c.codes), PyList::new(py, c.names)?.into_any()],
            )
        };
        let d = PyDict::new(py);
        d.set_item("row", arena_column(&owner, &t.row))?;
        d.set_item("name", strings(name)?)?;
        d.set_item("key", strings(key)?)?;
        d.set_item("leaf", strings(leaf)?)?;
        d.set_item("kind", strings(kind)?)?;
        d.set_item("layer", arena_nullable(&owner, &t.layer)?)?;
        d.set_item("expert", arena_nullable(&owner, &t.expert)?)?;
        d.set_item("num_experts", arena_nullable(&owner, &num_experts)?)?;
        d.set_item("rank", arena_nullable(&owner, &rank)?)?;
        d.set_item("in_features", arena_nullable(&owner, &in_features)?)?;
        d.set_item("out_features", arena_nullable(&owner, &out_features)?)?;
        d.set_item("dtype", strings(dtype)?)?;
        d.set_item("alpha", arena_nullable(&owner, &t.alpha)?)?;
        d.set_item("scale", arena_column(&owner, &t.scale))?;
        d.set_item("config_rank", arena_nullable(&owner, &config_rank)?)?;
        d.set_item("use_rslora", arena_column(&owner, &t.use_rslora))?;
        d.set_item("a_key", strings(a_key)?)?;
        d.set_item("b_key", strings(b_key)?)?;
        Ok(d)
    }

    /// Target-module leaves of every successful row: (unique names, in order of first use, and
    /// per-row lists of indices; with `per_row` false, no lists: the summary needs only the names,
    /// and 20,000 one-item lists were 1.7 MB of Python objects).
    #[pyo3(signature = (per_row = true))]
    fn target_modules(&self, per_row: bool) -> (Vec<String>, Vec<Vec<u32>>) {
        let mut names: Vec<String> = Vec::new();
        let mut index: rustc_hash::FxHashMap<&str, u32> = rustc_hash::FxHashMap::default();
        let mut rows = Vec::with_capacity(if per_row { self.rows.len() } else { 0 });
        for r in &self.rows {
            let targets = match r {
                Ok(a) => a.class.target_modules.as_slice(),
                Err(_) => &[],
            };
            let row = targets.iter().map(|t| {
                *index.entry(t).or_insert_with(|| {
                    names.push(t.clone());
                    (names.len() - 1) as u32
                })
            });
            if per_row {
                rows.push(row.collect());
            } else {
                row.for_each(|_| ());
            }
        }
        (names, rows)
    }
}

/// A string column as dictionary codes: each distinct string once, a code per row (-1: null).
#[derive(Default)]
struct Interner {
    codes: Vec<i32>,
    names: Vec<String>,
    index: rustc_hash::FxHashMap<String, i32>,
}

impl Interner {
    fn push(&mut self, s: Option<&str>) {
        let code = match s {
            None => -1,
            Some(s) => match self.index.get(s) {
                Some(&c) => c,
                None => {
                    let c = self.names.len() as i32;
                    self.names.push(s.to_owned());
                    self.index.insert(s.to_owned(), c);
                    c
                }
            },
        };
        self.codes.push(code);
    }

    fn into_py(self, py: Python<'_>) -> PyResult<Bound<'_, PyTuple>> {
        PyTuple::new(
            py,
            [
                self.codes.into_pyarray(py).into_any(),
                PyList::new(py, self.names)?.into_any(),
            ],
        )
    }
}

/// `bytes` as UTF-8, each byte of an invalid sequence written as `\xNN` (Python's backslashreplace);
/// whether there was one.
fn push_utf8_escaped(out: &mut Vec<u8>, bytes: &[u8]) -> bool {
    let mut escaped = false;
    for chunk in bytes.utf8_chunks() {
        out.extend_from_slice(chunk.valid().as_bytes());
        for b in chunk.invalid() {
            out.extend_from_slice(format!("\\x{b:02x}").as_bytes());
            escaped = true;
        }
    }
    escaped
}

/// A new `str` of `len` ASCII characters, not yet written, and its bytes.
///
/// `PyUnicode_New` is the one way to make a `str` and then write it: CPython's own encoders,
/// `json.dumps` among them, do so. It is not in the limited API this module is built against (abi3),
/// but every CPython since 3.3 exports it unchanged; `PyUnicode_AsUTF8AndSize` (limited API) gives
/// the bytes of an ASCII `str` without copying them.
fn ascii_str(py: Python<'_>, len: usize) -> PyResult<(Bound<'_, PyString>, *mut u8)> {
    extern "C" {
        fn PyUnicode_New(size: pyo3::ffi::Py_ssize_t, maxchar: pyo3::ffi::Py_UCS4) -> *mut pyo3::ffi::PyObject;
    }
    let size = pyo3::ffi::Py_ssize_t::try_from(len).map_err(|_| PyValueError::new_err("text too long"))?;
    // SAFETY: called with the GIL held; a NULL result is the raised MemoryError.
    let obj = unsafe { Bound::from_owned_ptr_or_err(py, PyUnicode_New(size, 127))? };
    let text = obj.cast_into::<PyString>()?;
    let mut got: pyo3::ffi::Py_ssize_t = 0;
    // SAFETY: `text` is a live str; for an ASCII str this returns its own buffer.
    let data = unsafe { pyo3::ffi::PyUnicode_AsUTF8AndSize(text.as_ptr(), &mut got) };
    if data.is_null() {
        return Err(PyErr::fetch(py));
    }
    if got != size {
        return Err(PyValueError::new_err("json_text: the new str has the wrong length"));
    }
    Ok((text, data.cast_mut().cast()))
}

/// The memory of a module table's columns, which its numpy arrays view.
#[pyclass(frozen)]
struct ColumnMemory(module_table::Arena);

/// A numpy view of one of the arena's columns, which keeps the arena alive.
fn arena_column<'py, T: numpy::Element + module_table::Plain>(
    owner: &Bound<'py, ColumnMemory>,
    column: &module_table::Column<T>,
) -> Bound<'py, PyAny> {
    let rows = numpy::ndarray::ArrayView1::from(owner.get().0.get(column));
    // SAFETY: the rows are in the arena, which `owner` holds and never changes or moves (a
    // mapping), for as long as the array refers to `owner`.
    unsafe { numpy::PyArray1::borrow_from_array(&rows, owner.clone().into_any()) }.into_any()
}

/// A nullable column of the arena as `(values, valid)`.
fn arena_nullable<'py, T: numpy::Element + module_table::Plain>(
    owner: &Bound<'py, ColumnMemory>,
    column: &module_table::NullableColumn<T>,
) -> PyResult<Bound<'py, PyTuple>> {
    PyTuple::new(
        owner.py(),
        [arena_column(owner, &column.values), arena_column(owner, &column.valid)],
    )
}

/// A nullable number column: values (0 where null) and a validity mask.
struct Nullable<T> {
    values: Vec<T>,
    valid: Vec<bool>,
}

impl<T: numpy::Element + Default + Copy> Nullable<T> {
    fn with_capacity(n: usize) -> Self {
        Nullable {
            values: Vec::with_capacity(n),
            valid: Vec::with_capacity(n),
        }
    }

    fn push(&mut self, v: Option<T>) {
        self.values.push(v.unwrap_or_default());
        self.valid.push(v.is_some());
    }

    fn into_py(self, py: Python<'_>) -> PyResult<Bound<'_, PyTuple>> {
        PyTuple::new(
            py,
            [
                self.values.into_pyarray(py).into_any(),
                self.valid.into_pyarray(py).into_any(),
            ],
        )
    }
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
fn scan(
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
fn discover_targets(
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
fn scan_targets(
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

/// A read-only memory map of a validated safetensors file, for zero-copy tensor reads.
#[pyclass(frozen, module = "lorafast._core")]
struct MappedFile {
    map: memmap2::Mmap,
    #[pyo3(get)]
    data_start: u64,
    #[pyo3(get)]
    file_size: u64,
    path: PathBuf,
}

#[pymethods]
impl MappedFile {
    #[getter]
    fn path(&self) -> &OsStr {
        self.path.as_os_str()
    }

    /// The whole file as a read-only numpy uint8 array that keeps this map alive.
    fn array<'py>(slf: Bound<'py, Self>) -> Bound<'py, PyArray1<u8>> {
        let this = slf.get();
        // SAFETY: the map lives as long as the array's base object (this MappedFile), and the
        // array is marked read-only by the Python wrapper before anyone can write through it.
        unsafe {
            let view = ArrayView1::from_shape_ptr(this.map.len(), this.map.as_ptr());
            PyArray1::borrow_from_array(&view, slf.into_any())
        }
    }

    /// Is the file still as long as when it was mapped? (a truncated file would SIGBUS on access)
    fn intact(&self) -> bool {
        std::fs::metadata(&self.path).is_ok_and(|m| m.len() == self.file_size)
    }
}

/// Maps `path` after validating its header and checking that its length covers every tensor.
#[pyfunction]
fn map_file(py: Python<'_>, path: PathBuf) -> PyResult<MappedFile> {
    detach_contained(py, &path, || -> Result<MappedFile, Error> {
        let mut buf = Vec::new();
        let (data_start, file_size) = {
            let h = header::read_header(&path, ReadMode::Pread, &mut buf)?;
            (h.data_start(), h.file_size)
        };
        let (file, len) = crate::open::open_regular(&path)?;
        if len != file_size {
            return Err(Error::adapter(
                &path,
                AdapterErrorCode::FileChanged,
                "file length changed while it was being opened",
            ));
        }
        // SAFETY: read-only private map of a file whose length we just checked; see header.rs for
        // the truncation race, which callers narrow by copying tensors out promptly.
        let map = unsafe { memmap2::MmapOptions::new().len(len as usize).map_copy_read_only(&file) }
            .map_err(|e| Error::io(&path, e))?;
        Ok(MappedFile {
            map,
            data_start,
            file_size,
            path: path.clone(),
        })
    })
}

/// Discovery only: the adapter paths `scan` would read (for tools and tests).
#[pyfunction]
#[pyo3(signature = (paths, recursive = true))]
fn discover(py: Python<'_>, paths: Vec<PathBuf>, recursive: bool) -> PyResult<Vec<(OsString, Option<&'static str>)>> {
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

/// A code list as a Python tuple of strings, in `all`'s (documentation) order.
fn codes<'py, T: Copy>(py: Python<'py>, all: &[T], code: fn(T) -> &'static str) -> PyResult<Bound<'py, PyTuple>> {
    PyTuple::new(py, all.iter().map(|&c| code(c)))
}

/// The `LoraModule`s (`cls`) of module dicts, as `inspect` and a merged distributed result give them.
#[pyfunction]
fn make_modules<'py>(cls: Bound<'py, PyType>, dicts: &Bound<'py, PyList>) -> PyResult<Bound<'py, PyTuple>> {
    instances::ModuleClass::of(cls)?.make_from_dicts(dicts)
}

/// Test hook, not public API: loading or reading `path` panics (None disarms it), so tests can
/// show a panic becoming an `internal` row or an `InternalError`.
#[pyfunction]
#[pyo3(signature = (path))]
fn _debug_panic_on(path: Option<PathBuf>) {
    core_scan::debug_panic_on(path);
}

#[pymodule(gil_used = false)]
mod _core {
    #[pymodule_export]
    use super::adapters::ModuleCache;
    #[pymodule_export]
    use super::index::IndexScan;
    #[pymodule_export]
    use super::parquet_columns::write_parquet;
    #[pymodule_export]
    use super::{
        _debug_panic_on, discover, discover_targets, inspect, inspect_many, make_modules, map_file, read_header,
        read_torch_header, read_url_header, read_url_range, scan, scan_targets, MappedFile, ScanResult,
    };

    #[pymodule_init]
    fn init(m: &pyo3::Bound<'_, pyo3::types::PyModule>) -> pyo3::PyResult<()> {
        use pyo3::types::{PyModuleMethods, PyTuple};
        crate::scan::install_fork_guard();
        m.add(
            "HEADER_ERROR_CODES",
            super::codes(m.py(), super::HeaderErrorCode::ALL, super::HeaderErrorCode::code)?,
        )?;
        m.add(
            "ADAPTER_ERROR_CODES",
            super::codes(m.py(), super::AdapterErrorCode::ALL, super::AdapterErrorCode::code)?,
        )?;
        m.add(
            "PROBLEM_CODES",
            super::codes(m.py(), super::ProblemCode::ALL, super::ProblemCode::code)?,
        )?;
        m.add(
            "TORCH_ERROR_CODES",
            super::codes(m.py(), super::TorchErrorCode::ALL, super::TorchErrorCode::code)?,
        )?;
        m.add("FORMATS", PyTuple::new(m.py(), super::Format::NAMES)?)?;
        m.add("MOE_LAYOUTS", PyTuple::new(m.py(), super::MoeLayout::NAMES)?)?;
        m.add("FLAGS", super::codes(m.py(), super::Flag::ALL, super::Flag::code)?)?;
        m.add(
            "MODULE_KINDS",
            PyTuple::new(m.py(), crate::classify::ModuleKind::NAMES)?,
        )?;
        m.add("__version__", env!("CARGO_PKG_VERSION"))?;
        m.add(
            "DTYPES",
            PyTuple::new(m.py(), super::Dtype::ALL.iter().map(|d| d.name()))?,
        )?;
        m.add(
            "build_profile",
            if cfg!(debug_assertions) { "debug" } else { "release" },
        )?;
        Ok(())
    }
}
