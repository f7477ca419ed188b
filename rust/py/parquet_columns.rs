//! `_core.write_parquet`: a report's table, as `lorafast.report` holds its columns (numpy arrays,
//! dictionary codes with their names, Arrow's string buffers), written by `crate::report::parquet` with the
//! GIL released. The arrays are read in place, not copied.

use std::fs::File;
use std::io::{self, BufWriter};
use std::path::PathBuf;

use numpy::PyReadonlyArray1;
use pyo3::exceptions::{PyTypeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::{PyList, PyTuple};

use crate::error::Error;
use crate::report::parquet::{self, Column, Offsets, Values};

/// A numpy array held (read-only) while the file is written.
enum Held<'py> {
    Bool(PyReadonlyArray1<'py, bool>),
    U8(PyReadonlyArray1<'py, u8>),
    U32(PyReadonlyArray1<'py, u32>),
    U64(PyReadonlyArray1<'py, u64>),
    I32(PyReadonlyArray1<'py, i32>),
    I64(PyReadonlyArray1<'py, i64>),
    F32(PyReadonlyArray1<'py, f32>),
    F64(PyReadonlyArray1<'py, f64>),
}

fn hold<'py>(obj: &Bound<'py, PyAny>) -> PyResult<Held<'py>> {
    macro_rules! first_of {
        ($($t:ty => $v:ident),*) => {
            $(if let Ok(a) = obj.extract::<PyReadonlyArray1<'py, $t>>() {
                return Ok(Held::$v(a));
            })*
        };
    }
    first_of!(bool => Bool, u8 => U8, u32 => U32, u64 => U64, i32 => I32, i64 => I64, f32 => F32, f64 => F64);
    Err(PyTypeError::new_err(format!(
        "a column must be a 1-D numpy array of bool, uint8/32/64, int32/64 or float32/64, not {}",
        obj.repr()?
    )))
}

fn slice<'a, T: numpy::Element>(a: &'a PyReadonlyArray1<'_, T>) -> PyResult<&'a [T]> {
    a.as_slice()
        .map_err(|_| PyValueError::new_err("a column's array must be contiguous"))
}

/// One column's arrays and dictionary, as given.
struct HeldColumn<'py> {
    name: String,
    kind: String,
    values: Held<'py>,
    /// A string column's bytes.
    data: Option<Held<'py>>,
    valid: Option<PyReadonlyArray1<'py, bool>>,
    names: Vec<String>,
}

impl<'py> HeldColumn<'py> {
    /// `(name, "num", values)`, `(name, "nullable", values, valid)`, `(name, "dict", codes, names)`
    /// or `(name, "utf8", offsets, data, valid)`.
    fn extract(item: &Bound<'py, PyAny>) -> PyResult<Self> {
        let t = item.cast::<PyTuple>()?;
        let name: String = t.get_item(0)?.extract()?;
        let kind: String = t.get_item(1)?.extract()?;
        let mut c = HeldColumn {
            name,
            values: hold(&t.get_item(2)?)?,
            data: None,
            valid: None,
            names: Vec::new(),
            kind,
        };
        match (c.kind.as_str(), t.len()) {
            ("num", 3) => {}
            ("nullable", 4) => c.valid = Some(t.get_item(3)?.extract()?),
            ("dict", 4) => c.names = t.get_item(3)?.extract()?,
            ("utf8", 5) => {
                c.data = Some(hold(&t.get_item(3)?)?);
                c.valid = Some(t.get_item(4)?.extract()?);
            }
            _ => {
                return Err(PyValueError::new_err(format!(
                    "column {:?}: not a column: {}",
                    c.name,
                    t.repr()?
                )))
            }
        }
        Ok(c)
    }

    fn column(&self, statistics: bool) -> PyResult<Column<'_>> {
        let wrong = |what: &str| PyTypeError::new_err(format!("column {:?}: {what}", self.name));
        let values = match (self.kind.as_str(), &self.values) {
            ("dict", Held::I32(codes)) => Values::Dict {
                codes: slice(codes)?,
                names: self.names.iter().map(|n| n.as_bytes()).collect(),
            },
            ("dict", _) => return Err(wrong("dictionary codes must be int32")),
            ("utf8", offsets) => {
                let offsets = match offsets {
                    Held::I32(o) => Offsets::I32(slice(o)?),
                    Held::I64(o) => Offsets::I64(slice(o)?),
                    _ => return Err(wrong("string offsets must be int32 or int64")),
                };
                let Some(Held::U8(data)) = &self.data else {
                    return Err(wrong("string data must be uint8"));
                };
                Values::Utf8 {
                    offsets,
                    data: slice(data)?,
                }
            }
            (_, Held::Bool(a)) => Values::Bool(slice(a)?),
            (_, Held::U32(a)) => Values::U32(slice(a)?),
            (_, Held::U64(a)) => Values::U64(slice(a)?),
            (_, Held::I32(a)) => Values::I32(slice(a)?),
            (_, Held::I64(a)) => Values::I64(slice(a)?),
            (_, Held::F32(a)) => Values::F32(slice(a)?),
            (_, Held::F64(a)) => Values::F64(slice(a)?),
            (_, Held::U8(_)) => return Err(wrong("uint8 is only a string column's data")),
        };
        let valid = self.valid.as_ref().map(|v| slice(v)).transpose()?;
        Ok(Column {
            name: &self.name,
            values,
            valid,
            statistics,
        })
    }
}

/// Writes `columns` (see `HeldColumn::extract`) to `path` as Parquet, with min/max statistics for
/// the columns named in `statistics` and `metadata` as the footer's key-value pairs.
#[pyfunction]
pub(super) fn write_parquet(
    py: Python<'_>,
    path: PathBuf,
    columns: &Bound<'_, PyList>,
    metadata: Vec<(String, Vec<u8>)>,
    statistics: Vec<String>,
) -> PyResult<()> {
    let held: Vec<HeldColumn> = columns
        .iter()
        .map(|c| HeldColumn::extract(&c))
        .collect::<PyResult<_>>()?;
    let cols: Vec<Column> = held
        .iter()
        .map(|c| c.column(statistics.contains(&c.name)))
        .collect::<PyResult<_>>()?;
    // Checked before the file is created, so that refused columns leave what is at `path` as it was.
    let table = parquet::Table::new(&cols).map_err(PyValueError::new_err)?;
    let metadata: Vec<(&str, &[u8])> = metadata.iter().map(|(k, v)| (k.as_str(), v.as_slice())).collect();
    py.detach(|| {
        crate::scan::with_pool(None, || -> io::Result<()> {
            let mut out = BufWriter::new(File::create(&path)?);
            table.write(&mut out, &metadata)
        })
    })
    .map_err(|e| super::to_pyerr(py, &Error::io(path, e)))
}
