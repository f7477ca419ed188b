//! Columns as Python receives them: dictionary-coded strings, nullable numbers, numpy views of the
//! module table's memory, Arrow string buffers, and a `str` written in place.

use numpy::IntoPyArray;
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use pyo3::types::{PyList, PyString, PyTuple};

use crate::report::module_table::{self};

/// A string column as dictionary codes: each distinct string once, a code per row (-1: null).
#[derive(Default)]
pub(super) struct Interner {
    pub(super) codes: Vec<i32>,
    pub(super) names: Vec<String>,
    pub(super) index: rustc_hash::FxHashMap<String, i32>,
}

impl Interner {
    pub(super) fn push(&mut self, s: Option<&str>) {
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

    pub(super) fn into_py(self, py: Python<'_>) -> PyResult<Bound<'_, PyTuple>> {
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
pub(super) fn push_utf8_escaped(out: &mut Vec<u8>, bytes: &[u8]) -> bool {
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
pub(super) fn ascii_str(py: Python<'_>, len: usize) -> PyResult<(Bound<'_, PyString>, *mut u8)> {
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
pub(super) struct ColumnMemory(pub(super) module_table::Arena);

/// A numpy view of one of the arena's columns, which keeps the arena alive.
pub(super) fn arena_column<'py, T: numpy::Element + module_table::Plain>(
    owner: &Bound<'py, ColumnMemory>,
    column: &module_table::Column<T>,
) -> Bound<'py, PyAny> {
    let rows = numpy::ndarray::ArrayView1::from(owner.get().0.get(column));
    // SAFETY: the rows are in the arena, which `owner` holds and never changes or moves (a
    // mapping), for as long as the array refers to `owner`.
    unsafe { numpy::PyArray1::borrow_from_array(&rows, owner.clone().into_any()) }.into_any()
}

/// A nullable column of the arena as `(values, valid)`.
pub(super) fn arena_nullable<'py, T: numpy::Element + module_table::Plain>(
    owner: &Bound<'py, ColumnMemory>,
    column: &module_table::NullableColumn<T>,
) -> PyResult<Bound<'py, PyTuple>> {
    PyTuple::new(
        owner.py(),
        [arena_column(owner, &column.values), arena_column(owner, &column.valid)],
    )
}

/// A nullable number column: values (0 where null) and a validity mask.
pub(super) struct Nullable<T> {
    pub(super) values: Vec<T>,
    pub(super) valid: Vec<bool>,
}

impl<T: numpy::Element + Default + Copy> Nullable<T> {
    pub(super) fn with_capacity(n: usize) -> Self {
        Nullable {
            values: Vec::with_capacity(n),
            valid: Vec::with_capacity(n),
        }
    }

    pub(super) fn push(&mut self, v: Option<T>) {
        self.values.push(v.unwrap_or_default());
        self.valid.push(v.is_some());
    }

    pub(super) fn into_py(self, py: Python<'_>) -> PyResult<Bound<'_, PyTuple>> {
        PyTuple::new(
            py,
            [
                self.values.into_pyarray(py).into_any(),
                self.valid.into_pyarray(py).into_any(),
            ],
        )
    }
}
