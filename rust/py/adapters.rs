//! `Adapter` objects for iterating a scan report, built here a batch at a time from what the scan
//! kept: no dict per adapter for Python to convert, and no Python-level constructor call.
//!
//! An object is `object.__new__(cls)` with its `__dict__` set to exactly its dataclass fields (what
//! `lorafast.scanner._adapter` builds through the dataclass `__init__`, which sets 28 fields one
//! `object.__setattr__` at a time). Adapters whose headers repeat share one classification (the
//! memo's `Arc`): its part of the dict (format, dtypes, flags, problems, ...: immutable values,
//! safely shared) and its module dicts are built once per batch and copied, a C-level dict copy.

use pyo3::intern;
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyFrozenSet, PyList, PyString, PyTuple};

use super::{metadata_dict, module_dict};
use crate::classify::{Classification, Modules};
use crate::codes::Flag;
use crate::error::Error;
use crate::scan::AdapterResult;

/// What the objects are made of, from `lorafast.scanner._ADAPTER_TYPES`: `object.__new__`,
/// `object.__setattr__`, the `Adapter`, `LoraModule` and `Problem` classes, and the
/// `AdapterFormat` and `MoeLayout` members in column-code order.
struct Types<'py> {
    new: Bound<'py, PyAny>,
    setattr: Bound<'py, PyAny>,
    adapter: Bound<'py, PyAny>,
    module: Bound<'py, PyAny>,
    problem: Bound<'py, PyAny>,
    formats: Bound<'py, PyTuple>,
    layouts: Bound<'py, PyTuple>,
}

impl<'py> Types<'py> {
    fn of(types: &Bound<'py, PyTuple>) -> PyResult<Self> {
        let (new, setattr, adapter, module, problem, formats, layouts) = types.extract()?;
        Ok(Types {
            new,
            setattr,
            adapter,
            module,
            problem,
            formats,
            layouts,
        })
    }

    /// An instance of `cls` whose `__dict__` is `fields`, bypassing the frozen dataclass `__init__`.
    fn object(&self, cls: &Bound<'py, PyAny>, fields: Bound<'py, PyDict>) -> PyResult<Bound<'py, PyAny>> {
        let obj = self.new.call1((cls,))?;
        self.setattr.call1((&obj, intern!(cls.py(), "__dict__"), fields))?;
        Ok(obj)
    }
}

/// Python strings for the names that repeat from adapter to adapter (dtypes, flags, target leaves,
/// problem codes): one object each per batch, shared, instead of one per use.
#[derive(Default)]
struct Names<'py, 'r> {
    strings: rustc_hash::FxHashMap<&'r str, Bound<'py, PyString>>,
}

impl<'py, 'r> Names<'py, 'r> {
    fn get(&mut self, py: Python<'py>, s: &'r str) -> Bound<'py, PyString> {
        self.strings.entry(s).or_insert_with(|| PyString::new(py, s)).clone()
    }

    fn tuple<I: IntoIterator<Item = &'r str>>(&mut self, py: Python<'py>, items: I) -> PyResult<Bound<'py, PyTuple>> {
        let items: Vec<_> = items.into_iter().map(|s| self.get(py, s)).collect();
        PyTuple::new(py, items)
    }
}

/// The part of an adapter's fields its classification decides, with None for the adapter's own
/// fields, in dataclass field order (`Adapter`'s `repr` and equality use the fields, not the dict's
/// order, but `vars()` then reads as from `__init__`).
fn class_fields<'py, 'r>(
    py: Python<'py>,
    c: &'r Classification,
    t: &Types<'py>,
    names: &mut Names<'py, 'r>,
) -> PyResult<Bound<'py, PyDict>> {
    let none = py.None();
    let d = PyDict::new(py);
    d.set_item(intern!(py, "path"), &none)?;
    d.set_item(intern!(py, "weight_files"), &none)?;
    d.set_item(intern!(py, "config_path"), &none)?;
    d.set_item(intern!(py, "format"), t.formats.get_item(c.format as usize)?)?;
    d.set_item(intern!(py, "peft_type"), &c.peft_type)?;
    d.set_item(intern!(py, "num_tensors"), c.num_tensors)?;
    d.set_item(
        intern!(py, "dtypes"),
        names.tuple(py, c.dtypes.iter().map(|t| t.name()))?,
    )?;
    d.set_item(intern!(py, "layers"), PyTuple::new(py, &c.layers)?)?;
    d.set_item(intern!(py, "base_model_name_or_path"), &c.base_model)?;
    d.set_item(
        intern!(py, "target_modules"),
        names.tuple(py, c.target_modules.iter().map(String::as_str))?,
    )?;
    d.set_item(intern!(py, "config"), &none)?;
    d.set_item(intern!(py, "r"), &none)?;
    d.set_item(intern!(py, "lora_alpha"), &none)?;
    d.set_item(intern!(py, "use_rslora"), &none)?;
    d.set_item(intern!(py, "rank_pattern"), &none)?;
    d.set_item(intern!(py, "alpha_pattern"), &none)?;
    d.set_item(intern!(py, "modules"), &none)?;
    d.set_item(intern!(py, "rank"), c.rank)?;
    d.set_item(intern!(py, "moe_layout"), t.layouts.get_item(c.moe_layout as usize)?)?;
    d.set_item(intern!(py, "num_experts"), c.num_experts)?;
    let flags: Vec<_> = Flag::set_in(c.flags).map(|f| names.get(py, f.code())).collect();
    d.set_item(intern!(py, "flags"), PyFrozenSet::new(py, flags)?)?;
    d.set_item(
        intern!(py, "variants"),
        names.tuple(py, c.variants.iter().map(|v| v.name()))?,
    )?;
    d.set_item(
        intern!(py, "full_weight_tensors"),
        PyTuple::new(py, &c.full_weight_tensors)?,
    )?;
    let problems = c
        .problems
        .iter()
        .map(|p| {
            let f = PyDict::new(py);
            f.set_item(intern!(py, "code"), names.get(py, p.code.code()))?;
            f.set_item(intern!(py, "message"), &p.message)?;
            f.set_item(intern!(py, "tensor"), &p.tensor)?;
            t.object(&t.problem, f)
        })
        .collect::<PyResult<Vec<_>>>()?;
    d.set_item(intern!(py, "problems"), PyTuple::new(py, problems)?)?;
    d.set_item(intern!(py, "content_hash"), &none)?;
    d.set_item(intern!(py, "metadata"), &none)?;
    d.set_item(intern!(py, "extra"), &none)?;
    Ok(d)
}

/// The `Adapter`s of the successful rows in `rows` (the report's rows from `first`), and `(position,
/// config text)` for each whose config fields (`config`, `r`, `lora_alpha`, `use_rslora`,
/// `rank_pattern`, `alpha_pattern`) the caller fills from the text, as `inspect` does
/// (`lorafast.scanner._config_fields`); the others get the fields of no config.
///
/// Modules are built on first access (`Adapter.__getattr__`): a dense adapter has hundreds, and
/// building them all cost several times a memo-assisted scan. An adapter with modules gets, in
/// place of its `modules` field, `_modules_pending`: `(report, row, templates)` for
/// `module_objects`, where `templates` is a dict the batch's adapters that share a classification
/// share (None for the others), so that classification's module dicts are built once and copied.
#[allow(clippy::type_complexity)]
pub(super) fn build<'py, 'r>(
    py: Python<'py>,
    report: &Bound<'py, PyAny>,
    rows: &'r [Result<AdapterResult, Error>],
    first: usize,
    types: &Bound<'py, PyTuple>,
) -> PyResult<(Bound<'py, PyList>, Vec<(usize, &'r str)>)> {
    let t = Types::of(types)?;
    let ok = || {
        rows.iter()
            .enumerate()
            .filter_map(|(i, r)| r.as_ref().ok().map(|a| (first + i, a)))
    };
    // Only a classification that more than one adapter of the batch shares is worth a template:
    // building one and copying it costs more than building the dict once.
    let mut uses: rustc_hash::FxHashMap<*const Modules, usize> = Default::default();
    for (_, a) in ok() {
        *uses.entry(std::sync::Arc::as_ptr(&a.class.modules)).or_default() += 1;
    }
    let mut templates: rustc_hash::FxHashMap<*const Modules, Bound<'py, PyDict>> = Default::default();
    let mut names = Names::default();
    let mut out = Vec::with_capacity(uses.values().sum());
    let module_templates = PyDict::new(py);
    let mut configs = Vec::new();
    for (row, a) in ok() {
        let shared = std::sync::Arc::as_ptr(&a.class.modules);
        let is_shared = uses[&shared] > 1;
        let d = if is_shared {
            match templates.entry(shared) {
                std::collections::hash_map::Entry::Occupied(e) => e.get().copy()?,
                std::collections::hash_map::Entry::Vacant(e) => {
                    e.insert(class_fields(py, &a.class, &t, &mut names)?).copy()?
                }
            }
        } else {
            class_fields(py, &a.class, &t, &mut names)?
        };
        let weight_file = a.target.weights.as_os_str();
        d.set_item(intern!(py, "path"), a.target.path.as_os_str())?;
        d.set_item(intern!(py, "weight_files"), (weight_file,))?;
        d.set_item(
            intern!(py, "config_path"),
            a.target.config.as_ref().map(|p| p.as_os_str()),
        )?;
        d.set_item(intern!(py, "content_hash"), &a.content_hash)?;
        d.set_item(intern!(py, "metadata"), metadata_dict(py, a)?)?;
        d.set_item(intern!(py, "extra"), PyDict::new(py))?;
        match a.config_json.as_deref() {
            Some(text) if !text.is_empty() => configs.push((out.len(), text)),
            _ => {
                // No config: `_config_fields(None, ...)`. The two patterns are each adapter's own dict.
                d.set_item(intern!(py, "use_rslora"), false)?;
                d.set_item(intern!(py, "rank_pattern"), PyDict::new(py))?;
                d.set_item(intern!(py, "alpha_pattern"), PyDict::new(py))?;
            }
        }
        if a.class.modules.is_empty() {
            d.set_item(intern!(py, "modules"), PyTuple::empty(py))?;
        } else {
            d.del_item(intern!(py, "modules"))?;
            let templates = is_shared.then_some(&module_templates);
            d.set_item(intern!(py, "_modules_pending"), (report, row, templates))?;
        }
        out.push(t.object(&t.adapter, d)?);
    }
    Ok((PyList::new(py, out)?, configs))
}

/// The `LoraModule`s of one adapter, as `inspect` gives them. With `templates` (see `build`), its
/// classification's module dicts are copied from there, or built and left there for the others.
pub(super) fn modules<'py>(
    py: Python<'py>,
    a: &AdapterResult,
    types: &Bound<'py, PyTuple>,
    templates: Option<&Bound<'py, PyDict>>,
) -> PyResult<Bound<'py, PyTuple>> {
    let t = Types::of(types)?;
    let modules = module_dicts(py, a, templates)?
        .into_iter()
        .map(|d| t.object(&t.module, d))
        .collect::<PyResult<Vec<_>>>()?;
    PyTuple::new(py, modules)
}

/// The module dicts of one adapter. With `templates`, adapters whose headers repeat (one shared
/// `Arc` of modules) build them once: the others copy the first's dicts (a C-level copy) and set
/// only `weight_file` anew.
pub(super) fn module_dicts<'py>(
    py: Python<'py>,
    a: &AdapterResult,
    templates: Option<&Bound<'py, PyDict>>,
) -> PyResult<Vec<Bound<'py, PyDict>>> {
    let weight_file = a
        .target
        .weights
        .as_os_str()
        .into_pyobject(py)?
        .cast_into::<PyString>()?;
    let key = std::sync::Arc::as_ptr(&a.class.modules) as usize;
    if let Some(cached) = templates.map(|t| t.get_item(key)).transpose()?.flatten() {
        let weight_file_key = intern!(py, "weight_file");
        return cached
            .cast_into::<PyTuple>()?
            .iter()
            .map(|m| {
                let m = m.cast_into::<PyDict>()?.copy()?;
                m.set_item(weight_file_key, &weight_file)?;
                Ok(m)
            })
            .collect();
    }
    let dicts = a
        .class
        .modules
        .iter()
        .map(|m| module_dict(py, &m, &weight_file))
        .collect::<PyResult<Vec<_>>>()?;
    if let Some(templates) = templates {
        let copies = dicts.iter().map(|d| d.copy()).collect::<PyResult<Vec<_>>>()?;
        templates.set_item(key, PyTuple::new(py, copies)?)?;
    }
    Ok(dicts)
}
