//! `LoraModule` fields as a dict of Python objects, with the values that repeat from module to
//! module (names, tensor names, dtypes, sizes, shapes, alphas) made once per batch and shared.
//!
//! A fleet's adapters name the same modules with the same shapes: 224,000 modules of 1,000 adapters
//! hold a few hundred distinct strings and numbers. A fresh object for each value was a dozen
//! allocations per module (and as many frees when it died), most of the time of building one.
//! The values are immutable, so sharing them is not seen from Python. Report iteration's adapters
//! share their repeated names (dtypes, flags, target leaves, problem codes) through it too.

use pyo3::intern;
use pyo3::prelude::*;
use pyo3::types::{PyBool, PyDict, PyFloat, PyInt, PyString, PyTuple};
use rustc_hash::FxHashMap;

use crate::classify::ModuleInfo;
use crate::header::Dtype;

/// The Python objects of the values seen so far.
#[derive(Default)]
pub(super) struct Interned {
    strings: FxHashMap<Box<str>, Py<PyString>>,
    ints: FxHashMap<u64, Py<PyInt>>,
    /// Keyed by the bits, so 0.0 and -0.0 (and NaNs) stay what they are.
    floats: FxHashMap<u64, Py<PyFloat>>,
    shapes: FxHashMap<Box<[u64]>, Py<PyTuple>>,
}

impl Interned {
    pub(super) fn str<'py>(&mut self, py: Python<'py>, s: &str) -> Bound<'py, PyString> {
        match self.strings.get(s) {
            Some(o) => o.bind(py).clone(),
            None => {
                let o = PyString::new(py, s);
                self.strings.insert(s.into(), o.clone().unbind());
                o
            }
        }
    }

    /// A tuple of the strings.
    pub(super) fn str_tuple<'py, 'a>(
        &mut self,
        py: Python<'py>,
        items: impl IntoIterator<Item = &'a str>,
    ) -> PyResult<Bound<'py, PyTuple>> {
        let items: Vec<_> = items.into_iter().map(|s| self.str(py, s)).collect();
        PyTuple::new(py, items)
    }

    fn opt_str<'py>(&mut self, py: Python<'py>, s: Option<&str>) -> Option<Bound<'py, PyAny>> {
        s.map(|s| self.str(py, s).into_any())
    }

    fn int<'py>(&mut self, py: Python<'py>, n: Option<u64>) -> Option<Bound<'py, PyAny>> {
        n.map(|n| {
            self.ints
                .entry(n)
                .or_insert_with(|| PyInt::new(py, n).unbind())
                .bind(py)
                .clone()
                .into_any()
        })
    }

    fn float<'py>(&mut self, py: Python<'py>, x: Option<f64>) -> Option<Bound<'py, PyAny>> {
        x.map(|x| {
            self.floats
                .entry(x.to_bits())
                .or_insert_with(|| PyFloat::new(py, x).unbind())
                .bind(py)
                .clone()
                .into_any()
        })
    }

    fn shape<'py>(&mut self, py: Python<'py>, s: Option<&[u64]>) -> PyResult<Option<Bound<'py, PyAny>>> {
        let Some(s) = s else { return Ok(None) };
        if let Some(o) = self.shapes.get(s) {
            return Ok(Some(o.bind(py).clone().into_any()));
        }
        let o = PyTuple::new(py, s.iter().map(|&n| self.int(py, Some(n))))?;
        self.shapes.insert(s.into(), o.clone().unbind());
        Ok(Some(o.into_any()))
    }
}

/// One module's `LoraModule` fields, in field order, each handed to `put` as (name, value). The
/// names are interned: a fresh key string each time was once most of the cost of a module dict.
pub(super) fn module_fields<'py>(
    py: Python<'py>,
    m: &ModuleInfo<'_>,
    weight_file: &Bound<'py, PyString>,
    v: &mut Interned,
    mut put: impl FnMut(&Bound<'py, PyString>, Bound<'py, PyAny>) -> PyResult<()>,
) -> PyResult<()> {
    let none = || py.None().into_bound(py);
    let opt = |o: Option<Bound<'py, PyAny>>| o.unwrap_or_else(none);
    put(intern!(py, "name"), v.str(py, m.name).into_any())?;
    put(intern!(py, "key"), v.str(py, m.key).into_any())?;
    put(intern!(py, "kind"), v.str(py, m.kind.name()).into_any())?;
    put(intern!(py, "leaf"), v.str(py, m.leaf).into_any())?;
    put(intern!(py, "layer"), opt(v.int(py, m.layer.map(u64::from))))?;
    put(intern!(py, "expert"), opt(v.int(py, m.expert.map(u64::from))))?;
    put(intern!(py, "num_experts"), opt(v.int(py, m.num_experts)))?;
    put(intern!(py, "rank"), opt(v.int(py, m.rank)))?;
    put(intern!(py, "in_features"), opt(v.int(py, m.in_features)))?;
    put(intern!(py, "out_features"), opt(v.int(py, m.out_features)))?;
    put(intern!(py, "dtype"), opt(v.opt_str(py, m.dtype.map(Dtype::name))))?;
    put(intern!(py, "a_key"), opt(v.opt_str(py, m.a_key)))?;
    put(intern!(py, "b_key"), opt(v.opt_str(py, m.b_key)))?;
    put(intern!(py, "a_shape"), opt(v.shape(py, m.a_shape)?))?;
    put(intern!(py, "b_shape"), opt(v.shape(py, m.b_shape)?))?;
    put(intern!(py, "alpha"), opt(v.float(py, m.alpha)))?;
    put(intern!(py, "alpha_key"), opt(v.opt_str(py, m.alpha_key)))?;
    put(intern!(py, "bias_key"), opt(v.opt_str(py, m.bias_key)))?;
    put(intern!(py, "magnitude_key"), opt(v.opt_str(py, m.magnitude_key)))?;
    let extra: Vec<_> = m.extra_keys.iter().map(|k| v.str(py, k)).collect();
    put(intern!(py, "extra_keys"), PyTuple::new(py, extra)?.into_any())?;
    put(intern!(py, "config_rank"), opt(v.int(py, m.config_rank)))?;
    put(
        intern!(py, "use_rslora"),
        PyBool::new(py, m.use_rslora).to_owned().into_any(),
    )?;
    put(intern!(py, "weight_file"), weight_file.clone().into_any())
}

/// The dict of one module's `LoraModule` fields, in field order.
pub(super) fn module_dict<'py>(
    py: Python<'py>,
    m: &ModuleInfo<'_>,
    weight_file: &Bound<'py, PyString>,
    v: &mut Interned,
) -> PyResult<Bound<'py, PyDict>> {
    let d = PyDict::new(py);
    module_fields(py, m, weight_file, v, |k, value| d.set_item(k, value))?;
    Ok(d)
}
