//! Header reading for Python: `read_header`, `read_torch_header`, and `map_file` for zero-copy reads.

use std::ffi::OsStr;
use std::path::PathBuf;

use numpy::ndarray::ArrayView1;
use numpy::PyArray1;
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyTuple};

use crate::codes::AdapterErrorCode;
use crate::error::Error;
use crate::header::{self, ReadMode};
use crate::scan::{self as core_scan};
use crate::torch;

use super::detach_contained;

/// (name, dtype, shape, (begin, end)) of one tensor.
type TensorRow = (String, &'static str, Vec<u64>, (u64, u64));

/// Header as a dict: tensors as (name, dtype, shape, (begin, end)) in file order.
#[pyfunction]
#[pyo3(signature = (path, mode = ReadMode::Pread))]
#[pyo3(text_signature = "(path, mode='pread')")]
pub(super) fn read_header<'py>(py: Python<'py>, path: PathBuf, mode: ReadMode) -> PyResult<Bound<'py, PyDict>> {
    let result = detach_contained(py, &path, || {
        core_scan::debug_hook(&path);
        let mut buf = Vec::new();
        header::read_header(&path, mode, &mut buf).map(|h| safetensors_parts(&h))
    });
    header_dict(py, result?)
}

/// A safetensors header's parts, as `read_header` returns them.
pub(super) fn safetensors_parts(h: &header::Header<'_>) -> HeaderParts {
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
    let metadata: Option<Vec<(String, String)>> = h.metadata.as_ref().map(header::owned_metadata);
    let warnings: Vec<(&'static str, String)> = h.warnings.iter().map(|w| (w.code.code(), w.message.clone())).collect();
    (tensors, metadata, h.header_size, h.file_size, warnings)
}

/// `read_torch_header`'s dict has `read_header`'s shape. Offsets are file offsets of each tensor's
/// bytes (its extent in its storage record), and `header_size` is the size of `data.pkl`.
#[pyfunction]
pub(super) fn read_torch_header<'py>(py: Python<'py>, path: PathBuf) -> PyResult<Bound<'py, PyDict>> {
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

pub(super) fn header_dict<'py>(py: Python<'py>, parts: HeaderParts) -> PyResult<Bound<'py, PyDict>> {
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

/// A read-only memory map of a validated safetensors file, for zero-copy tensor reads.
#[pyclass(frozen, module = "lorafast._core")]
pub(super) struct MappedFile {
    pub(super) map: memmap2::Mmap,
    #[pyo3(get)]
    data_start: u64,
    #[pyo3(get)]
    pub(super) file_size: u64,
    pub(super) path: PathBuf,
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
pub(super) fn map_file(py: Python<'_>, path: PathBuf) -> PyResult<MappedFile> {
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
