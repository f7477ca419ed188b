//! `ScanResult`: a bulk scan's rows, kept in Rust, which Python reads as columns, records or JSON text.

use std::ffi::OsStr;
use std::os::unix::ffi::OsStrExt;

use numpy::IntoPyArray;
use pyo3::exceptions::PyValueError;
use pyo3::intern;
use pyo3::prelude::*;
use pyo3::types::{PyBool, PyDict, PyList, PyString, PyTuple};

use crate::classify::{Format, MoeLayout};
use crate::error::Error;
use crate::report::module_table::{ModuleTable, StringColumn};
use crate::report::records;
use crate::scan::{self as core_scan, AdapterResult};

use super::adapters;
use super::columns::{arena_column, arena_nullable, ascii_str, push_utf8_escaped, ColumnMemory, Interner, Nullable};
use super::scan::adapter_dict;

/// Status codes of the `status` column.
const STATUS_OK: u8 = 0;
const STATUS_PROBLEMS: u8 = 1;
const STATUS_ERROR: u8 = 2;

/// The result of a bulk scan, kept in Rust; Python reads it as columns or per row.
#[pyclass(frozen, module = "lorafast._core")]
pub(super) struct ScanResult {
    pub(super) rows: Vec<Result<AdapterResult, Error>>,
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
    /// and a list per row is a Python object per row).
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
