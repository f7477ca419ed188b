//! The Python binding, the only module that uses pyo3: converts core results to Python objects and
//! core errors to the exception tree of `lorafast.errors`. All I/O and parsing run with the GIL
//! released. Each submodule is one part of `lorafast._core`; `_core` below lists what it exports.

use std::ffi::OsString;
use std::path::{Path, PathBuf};

use pyo3::exceptions::{PyFileNotFoundError, PyOSError, PyPermissionError};
use pyo3::prelude::*;
use pyo3::types::{PyList, PyTuple, PyType};

use crate::classify::{Format, MoeLayout};
use crate::codes::{AdapterErrorCode, ErrorCode, Flag, HeaderErrorCode, ProblemCode, TorchErrorCode};
use crate::error::Error;
use crate::header::Dtype;
use crate::scan as core_scan;

mod adapters;
mod args;
mod columns;
mod header;
mod index;
mod instances;
mod module_values;
mod parquet_columns;
mod remote;
mod report;
mod scan;

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
    use super::header::{map_file, read_header, read_torch_header, MappedFile};
    #[pymodule_export]
    use super::index::{index_paths, IndexScan};
    #[pymodule_export]
    use super::parquet_columns::write_parquet;
    #[pymodule_export]
    use super::remote::{read_url_header, read_url_range};
    #[pymodule_export]
    use super::report::ScanResult;
    #[pymodule_export]
    use super::scan::{discover, discover_targets, inspect, inspect_many, scan, scan_targets};
    #[pymodule_export]
    use super::{_debug_panic_on, make_modules};

    #[pymodule_init]
    fn init(m: &pyo3::Bound<'_, pyo3::types::PyModule>) -> pyo3::PyResult<()> {
        use pyo3::types::{PyModuleMethods, PyTuple};

        use super::{AdapterErrorCode, Dtype, Flag, Format, HeaderErrorCode, MoeLayout, ProblemCode, TorchErrorCode};
        use crate::classify::ModuleKind;

        crate::scan::install_fork_guard();
        let py = m.py();
        let lists = [
            (
                "HEADER_ERROR_CODES",
                super::codes(py, HeaderErrorCode::ALL, HeaderErrorCode::code)?,
            ),
            (
                "ADAPTER_ERROR_CODES",
                super::codes(py, AdapterErrorCode::ALL, AdapterErrorCode::code)?,
            ),
            ("PROBLEM_CODES", super::codes(py, ProblemCode::ALL, ProblemCode::code)?),
            (
                "TORCH_ERROR_CODES",
                super::codes(py, TorchErrorCode::ALL, TorchErrorCode::code)?,
            ),
            ("FORMATS", super::codes(py, Format::ALL, Format::code)?),
            ("MOE_LAYOUTS", super::codes(py, MoeLayout::ALL, MoeLayout::code)?),
            ("FLAGS", super::codes(py, Flag::ALL, Flag::code)?),
            ("MODULE_KINDS", PyTuple::new(py, ModuleKind::NAMES)?),
            ("DTYPES", PyTuple::new(py, Dtype::ALL.iter().map(|d| d.name()))?),
        ];
        for (name, list) in lists {
            m.add(name, list)?;
        }
        m.add("__version__", env!("CARGO_PKG_VERSION"))?;
        m.add(
            "build_profile",
            if cfg!(debug_assertions) { "debug" } else { "release" },
        )?;
        Ok(())
    }
}
