//! `Adapter` objects for iterating a scan report, built here a batch at a time from what the scan
//! kept: no dict per adapter for Python to convert, and no Python-level constructor call.
//!
//! An object is `object.__new__(cls)` with its `__dict__` set to exactly its dataclass fields (what
//! `lorafast.scanner._adapter` builds through the dataclass `__init__`, which sets 28 fields one
//! `object.__setattr__` at a time), both done through the C functions they call (`instances.rs`).
//! Adapters whose headers repeat share one classification (the memo's `Arc`): its part of the dict
//! (format, dtypes, flags, problems, ...: immutable values, safely shared) is built once per batch
//! and copied, a C-level dict copy.
//!
//! Modules are built when first read, per adapter, with what its batch shares ([`ModuleCache`]):
//! a `LoraModule` has slots, filled straight from its fields (`instances.rs`). A shared
//! classification's fields are held once and copied; another adapter's module is copied from the
//! first equal module of the batch once one has been seen twice (headers that differ mostly name
//! the same modules); a module not seen before gets its values' Python objects shared
//! (`module_values.rs`). 224,000 modules of 1,000 adapters whose headers all differ: 245 -> 145 ms
//! as instances with a dict, 70-100 ms with slots.

use pyo3::intern;
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyFrozenSet, PyList, PyString, PyTuple};

use rustc_hash::FxHashMap;

use super::instances::{Maker, ModuleClass};
use super::module_values::{fields_dict, hold, module_fields, with_weight_file, Fields, HeldFields, Interned};
use super::scan::metadata_dict;
use crate::classify::{Classification, ModuleInfo, Modules};
use crate::codes::Flag;
use crate::error::Error;
use crate::scan::AdapterResult;

/// What the objects are made of, from `lorafast.scanner._ADAPTER_TYPES`: the `Adapter`,
/// `LoraModule` and `Problem` classes, and the `AdapterFormat` and `MoeLayout` members in
/// column-code order.
struct Types<'py> {
    adapter: Maker<'py>,
    module: ModuleClass<'py>,
    problem: Maker<'py>,
    formats: Bound<'py, PyTuple>,
    layouts: Bound<'py, PyTuple>,
    /// `Adapter`'s field names, in order.
    fields: Bound<'py, PyTuple>,
}

impl<'py> Types<'py> {
    fn of(types: &Bound<'py, PyTuple>) -> PyResult<Self> {
        let (adapter, module, problem, formats, layouts, fields) = types.extract()?;
        Ok(Types {
            adapter: Maker::of(adapter)?,
            module: ModuleClass::of(module)?,
            problem: Maker::of(problem)?,
            formats,
            layouts,
            fields,
        })
    }
}

/// The part of an adapter's fields its classification decides, with None for the adapter's own
/// fields, in dataclass field order (`Adapter`'s `repr` and equality use the fields, not the dict's
/// order, but `vars()` then reads as from `__init__`).
fn class_fields<'py>(
    py: Python<'py>,
    c: &Classification,
    t: &Types<'py>,
    names: &mut Interned,
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
        names.str_tuple(py, c.dtypes.iter().map(|t| t.name()))?,
    )?;
    d.set_item(intern!(py, "layers"), PyTuple::new(py, &c.layers)?)?;
    d.set_item(intern!(py, "base_model_name_or_path"), &c.base_model)?;
    d.set_item(
        intern!(py, "target_modules"),
        names.str_tuple(py, c.target_modules.iter().map(String::as_str))?,
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
    let flags: Vec<_> = Flag::set_in(c.flags).map(|f| names.str(py, f.code())).collect();
    d.set_item(intern!(py, "flags"), PyFrozenSet::new(py, flags)?)?;
    d.set_item(
        intern!(py, "variants"),
        names.str_tuple(py, c.variants.iter().map(|v| v.name()))?,
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
            f.set_item(intern!(py, "code"), names.str(py, p.code.code()))?;
            f.set_item(intern!(py, "message"), &p.message)?;
            f.set_item(intern!(py, "tensor"), &p.tensor)?;
            t.problem.make(f)
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
/// place of its `modules` field, `_modules_pending`: `(report, row, cache)` for `adapter_modules`,
/// where `cache` is the batch's [`ModuleCache`].
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
    let batch = Batch::of(ok().map(|(_, a)| a));
    let mut templates: FxHashMap<usize, Bound<'py, PyDict>> = Default::default();
    // The names that repeat from adapter to adapter (dtypes, flags, target leaves, problem codes):
    // one object each per batch, shared.
    let mut names = Interned::default();
    let mut out = Vec::new();
    let mut configs = Vec::new();
    let mut cache = None;
    for (row, a) in ok() {
        let shared = batch.is_shared(a);
        let d = if shared {
            match templates.entry(class_key(a)) {
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
            let cache = match &cache {
                Some(c) => c,
                None => cache.insert(Bound::new(py, ModuleCache::new(batch.clone()))?),
            };
            d.set_item(intern!(py, "_modules_pending"), (report, row, cache))?;
        }
        out.push(t.adapter.make(d)?);
    }
    Ok((PyList::new(py, out)?, configs))
}

/// The key of an adapter's classification: adapters whose headers repeat share one (the memo's
/// `Arc`), and the report's rows keep it alive while anything built from it is.
fn class_key(a: &AdapterResult) -> usize {
    std::sync::Arc::as_ptr(&a.class.modules) as usize
}

/// Which classifications more than one adapter of a batch shares. Only those are worth a template
/// (their dicts built once and copied): building one and copying it costs more than building the
/// dicts once.
#[derive(Clone, Default)]
pub(super) struct Batch {
    shared: rustc_hash::FxHashSet<usize>,
}

impl Batch {
    pub(super) fn of<'a>(adapters: impl Iterator<Item = &'a AdapterResult>) -> Self {
        let mut uses: FxHashMap<usize, usize> = Default::default();
        for a in adapters {
            *uses.entry(class_key(a)).or_default() += 1;
        }
        let shared = uses.into_iter().filter(|&(_, n)| n > 1).map(|(k, _)| k).collect();
        Batch { shared }
    }

    fn is_shared(&self, a: &AdapterResult) -> bool {
        self.shared.contains(&class_key(a))
    }
}

/// What building one batch's modules shares: the values' Python objects, the module fields of
/// each shared classification (given to every adapter that has it, with its own `weight_file`),
/// and the modules seen so far of the others.
#[derive(Default)]
pub(super) struct BatchModules {
    batch: Batch,
    values: Interned,
    templates: FxHashMap<usize, Vec<HeldFields>>,
    /// The modules of classifications no other adapter shares, by key: where each distinct one was
    /// first seen, and its fields once a second one equal to it was (adapters whose headers differ
    /// mostly still name the same modules, with one of a few ranks).
    seen: FxHashMap<Box<str>, Vec<SeenModule>>,
}

/// Distinct modules remembered per key: enough for a fleet's few ranks, and a bound on the
/// comparisons a module that matches none of them costs.
const SEEN_PER_KEY: usize = 8;

/// A module of the batch, to compare others with its key against.
struct SeenModule {
    modules: std::sync::Arc<Modules>,
    index: usize,
    /// Its rank: what tells a key's variants apart, compared before the whole module.
    rank: Option<u64>,
    template: Option<HeldFields>,
}

impl SeenModule {
    fn is(&self, m: &ModuleInfo<'_>) -> bool {
        self.rank == m.rank && self.modules.get(self.index).as_ref() == Some(m)
    }
}

impl BatchModules {
    pub(super) fn new(batch: Batch) -> Self {
        BatchModules {
            batch,
            ..Default::default()
        }
    }

    /// Hands `put` the fields of each of one adapter's modules, in order: a shared classification's
    /// from its template; another's from an equal module of the batch seen twice before; else made
    /// from the module's values.
    fn each<'py>(
        &mut self,
        py: Python<'py>,
        a: &AdapterResult,
        mut put: impl FnMut(Made<'_, 'py>) -> PyResult<()>,
    ) -> PyResult<()> {
        let weight_file = weight_file(py, a)?;
        let key = class_key(a);
        if let Some(template) = self.templates.get(&key) {
            return template.iter().try_for_each(|t| put(Made::Like(t, &weight_file)));
        }
        if self.batch.is_shared(a) {
            let mut template = Vec::with_capacity(a.class.modules.len());
            for m in a.class.modules.iter() {
                let fields = module_fields(py, &m, &weight_file, &mut self.values)?;
                template.push(hold(&fields));
                put(Made::New(fields))?;
            }
            self.templates.insert(key, template);
            return Ok(());
        }
        for (index, m) in a.class.modules.iter().enumerate() {
            let Some(earlier) = earlier(&mut self.seen, a, index, &m) else {
                put(Made::New(module_fields(py, &m, &weight_file, &mut self.values)?))?;
                continue;
            };
            match &earlier.template {
                Some(template) => put(Made::Like(template, &weight_file))?,
                None => {
                    let fields = module_fields(py, &m, &weight_file, &mut self.values)?;
                    earlier.template = Some(hold(&fields));
                    put(Made::New(fields))?;
                }
            }
        }
        Ok(())
    }

    /// The module dicts of one adapter (the fields of `inspect`'s raw result).
    pub(super) fn dicts<'py>(&mut self, py: Python<'py>, a: &AdapterResult) -> PyResult<Vec<Bound<'py, PyDict>>> {
        let mut out = Vec::with_capacity(a.class.modules.len());
        self.each(py, a, |made| {
            let fields = match made {
                Made::New(fields) => fields,
                Made::Like(held, weight_file) => with_weight_file(held, weight_file),
            };
            out.push(fields_dict(py, fields)?);
            Ok(())
        })?;
        Ok(out)
    }

    /// The `LoraModule`s of one adapter.
    fn objects<'py>(&mut self, py: Python<'py>, a: &AdapterResult, t: &Types<'py>) -> PyResult<Vec<Bound<'py, PyAny>>> {
        let mut out = Vec::with_capacity(a.class.modules.len());
        self.each(py, a, |made| {
            out.push(match made {
                Made::New(fields) => t.module.make(fields)?,
                Made::Like(held, weight_file) => t.module.make_like(held, weight_file)?,
            });
            Ok(())
        })?;
        Ok(out)
    }
}

/// A module's fields: made for it, or those held of an equal module of the batch with its own
/// weights file (copied straight into a new object, with no array of them made in between).
enum Made<'a, 'py> {
    New(Fields<'py>),
    Like(&'a HeldFields, &'a Bound<'py, PyString>),
}

/// The adapter's weights file as the `str` its modules' `weight_file` share.
fn weight_file<'py>(py: Python<'py>, a: &AdapterResult) -> PyResult<Bound<'py, PyString>> {
    Ok(a.target
        .weights
        .as_os_str()
        .into_pyobject(py)?
        .cast_into::<PyString>()?)
}

/// The batch's earlier module equal to `m` (module `index` of `a`), if there is one; else `m` is
/// remembered for the modules after it to be compared with (up to [`SEEN_PER_KEY`] per key).
fn earlier<'s>(
    seen: &'s mut FxHashMap<Box<str>, Vec<SeenModule>>,
    a: &AdapterResult,
    index: usize,
    m: &ModuleInfo<'_>,
) -> Option<&'s mut SeenModule> {
    let this = || SeenModule {
        modules: a.class.modules.clone(),
        index,
        rank: m.rank,
        template: None,
    };
    if !seen.contains_key(m.key) {
        seen.insert(m.key.into(), vec![this()]);
        return None;
    }
    let same = seen.get_mut(m.key)?;
    match same.iter().position(|s| s.is(m)) {
        Some(at) => Some(&mut same[at]),
        None => {
            if same.len() < SEEN_PER_KEY {
                same.push(this());
            }
            None
        }
    }
}

/// One batch's [`BatchModules`], held by its adapters until each has built its modules (then freed
/// with the last). Whoever finds it locked builds without it (see `modules`).
#[pyclass(frozen, module = "lorafast._core")]
pub(super) struct ModuleCache {
    modules: std::sync::Mutex<BatchModules>,
}

impl ModuleCache {
    fn new(batch: Batch) -> Self {
        ModuleCache {
            modules: std::sync::Mutex::new(BatchModules::new(batch)),
        }
    }
}

/// The `LoraModule`s of one adapter, as `inspect` gives them, with its batch's `cache` (see
/// `build`); `adapter`, its `Adapter`, gets its instance dict as `__init__` leaves it: every field
/// in field order, `modules` among them, and not `_modules_pending` (rebuilt in Python, a dict
/// comprehension per adapter was a tenth of reading a dense fleet's modules).
pub(super) fn modules<'py>(
    py: Python<'py>,
    a: &AdapterResult,
    adapter: &Bound<'py, PyAny>,
    types: &Bound<'py, PyTuple>,
    cache: Option<&Bound<'py, ModuleCache>>,
) -> PyResult<Bound<'py, PyTuple>> {
    let t = Types::of(types)?;
    // Modules built while others are, by another thread (a free-threaded build) or by this one (a
    // finalizer that reads `modules`, run by the collector mid-build), find the lock taken and are
    // built without the cache: never a wait, so never a wait on itself.
    let mut guard = cache.and_then(|c| c.get().modules.try_lock().ok());
    let mut own = None;
    let batch = match guard.as_deref_mut() {
        Some(m) => m,
        None => own.insert(BatchModules::default()),
    };
    let modules = PyTuple::new(py, batch.objects(py, a, &t)?)?;
    drop(guard);
    let old = adapter.getattr(intern!(py, "__dict__"))?.cast_into::<PyDict>()?;
    let fields = PyDict::new(py);
    let modules_key = intern!(py, "modules");
    for name in t.fields.iter() {
        if name.eq(modules_key)? {
            fields.set_item(&name, &modules)?;
        } else {
            let value = old
                .get_item(&name)?
                .ok_or_else(|| pyo3::exceptions::PyKeyError::new_err(name.clone().unbind()))?;
            fields.set_item(&name, value)?;
        }
    }
    t.adapter.set_dict(adapter, fields)?;
    Ok(modules)
}
