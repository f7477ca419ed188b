//! `LoraModule`s (and module dicts) from the core's modules, with the values that repeat from
//! module to module (names, tensor names, dtypes, sizes, shapes, alphas) made once per batch and
//! shared.
//!
//! A fleet's adapters name the same modules with the same shapes: 224,000 modules of 1,000 adapters
//! hold a few hundred distinct strings and numbers. A fresh object for each value was a dozen
//! allocations per module (and as many frees when it died), most of the time of building one.
//! The values are immutable, so sharing them is not seen from Python. Report iteration's adapters
//! share their repeated names (dtypes, flags, target leaves, problem codes) through it too.

use pyo3::prelude::*;
use pyo3::sync::PyOnceLock;
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

/// `LoraModule`'s fields, in order (`lorafast.adapter.LoraModule`).
pub(super) const MODULE_FIELDS: [&str; 23] = [
    "name",
    "key",
    "kind",
    "leaf",
    "layer",
    "expert",
    "num_experts",
    "rank",
    "in_features",
    "out_features",
    "dtype",
    "a_key",
    "b_key",
    "a_shape",
    "b_shape",
    "alpha",
    "alpha_key",
    "bias_key",
    "magnitude_key",
    "extra_keys",
    "config_rank",
    "use_rslora",
    "weight_file",
];
pub(super) const WEIGHT_FILE: usize = MODULE_FIELDS.len() - 1;

/// One module's field values, in [`MODULE_FIELDS`] order.
pub(super) type Fields<'py> = [Bound<'py, PyAny>; MODULE_FIELDS.len()];
/// The same, held (a module equal to others of the batch, which are made from it).
pub(super) type HeldFields = [Py<PyAny>; MODULE_FIELDS.len()];

/// One module's field values, with its values' Python objects shared through `v`.
pub(super) fn module_fields<'py>(
    py: Python<'py>,
    m: &ModuleInfo<'_>,
    weight_file: &Bound<'py, PyString>,
    v: &mut Interned,
) -> PyResult<Fields<'py>> {
    let none = || py.None().into_bound(py);
    let opt = |o: Option<Bound<'py, PyAny>>| o.unwrap_or_else(none);
    let extra: Vec<_> = m.extra_keys.iter().map(|k| v.str(py, k)).collect();
    Ok([
        v.str(py, m.name).into_any(),
        v.str(py, m.key).into_any(),
        v.str(py, m.kind.name()).into_any(),
        v.str(py, m.leaf).into_any(),
        opt(v.int(py, m.layer.map(u64::from))),
        opt(v.int(py, m.expert.map(u64::from))),
        opt(v.int(py, m.num_experts)),
        opt(v.int(py, m.rank)),
        opt(v.int(py, m.in_features)),
        opt(v.int(py, m.out_features)),
        opt(v.opt_str(py, m.dtype.map(Dtype::name))),
        opt(v.opt_str(py, m.a_key)),
        opt(v.opt_str(py, m.b_key)),
        opt(v.shape(py, m.a_shape)?),
        opt(v.shape(py, m.b_shape)?),
        opt(v.float(py, m.alpha)),
        opt(v.opt_str(py, m.alpha_key)),
        opt(v.opt_str(py, m.bias_key)),
        opt(v.opt_str(py, m.magnitude_key)),
        PyTuple::new(py, extra)?.into_any(),
        opt(v.int(py, m.config_rank)),
        PyBool::new(py, m.use_rslora).to_owned().into_any(),
        weight_file.clone().into_any(),
    ])
}

/// Held fields, to make other modules from.
pub(super) fn hold(fields: &Fields<'_>) -> HeldFields {
    fields.each_ref().map(|v| v.clone().unbind())
}

/// The fields of a module equal to `held`'s but for its weights file.
pub(super) fn with_weight_file<'py>(held: &HeldFields, weight_file: &Bound<'py, PyString>) -> Fields<'py> {
    let py = weight_file.py();
    let mut fields = held.each_ref().map(|v| v.bind(py).clone());
    fields[WEIGHT_FILE] = weight_file.clone().into_any();
    fields
}

/// A module's fields as a dict, in field order. The keys are interned once: a fresh key string
/// each time was once most of the cost of a module dict.
pub(super) fn fields_dict<'py>(py: Python<'py>, fields: Fields<'py>) -> PyResult<Bound<'py, PyDict>> {
    let d = PyDict::new(py);
    for (k, value) in field_keys(py).iter().zip(fields) {
        d.set_item(k.bind(py), value)?;
    }
    Ok(d)
}

/// [`MODULE_FIELDS`] as interned `str`s, made once.
pub(super) fn field_keys(py: Python<'_>) -> &[Py<PyString>; MODULE_FIELDS.len()] {
    static KEYS: PyOnceLock<[Py<PyString>; MODULE_FIELDS.len()]> = PyOnceLock::new();
    KEYS.get_or_init(py, || MODULE_FIELDS.map(|k| PyString::intern(py, k).unbind()))
}

/// The dict of one module's `LoraModule` fields, in field order.
pub(super) fn module_dict<'py>(
    py: Python<'py>,
    m: &ModuleInfo<'_>,
    weight_file: &Bound<'py, PyString>,
    v: &mut Interned,
) -> PyResult<Bound<'py, PyDict>> {
    fields_dict(py, module_fields(py, m, weight_file, v)?)
}
