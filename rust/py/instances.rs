//! Instances of the result classes (`Adapter`, `LoraModule`, `Problem`: frozen dataclasses) made
//! with their fields as given, bypassing the dataclass `__init__`, which sets each field through a
//! Python-level `object.__setattr__` call.

use std::sync::Mutex;

use pyo3::exceptions::{PyKeyError, PyTypeError};
use pyo3::ffi;
use pyo3::intern;
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyList, PyString, PyTuple, PyType};

use super::module_values::{field_keys, Fields, HeldFields, MODULE_FIELDS, WEIGHT_FILE};

/// Makes instances of one class whose `__dict__` is given, bypassing the frozen dataclass
/// `__init__`: `object.__new__(cls)` then `object.__setattr__(obj, "__dict__", fields)`, done
/// through the C functions those two call (the class's `tp_new` slot, `PyObject_GenericSetAttr`).
/// As two Python-level calls they were a third of the time of building a module.
pub(super) struct Maker<'py> {
    cls: Bound<'py, PyType>,
    new: ffi::newfunc,
    no_args: Bound<'py, PyTuple>,
}

impl<'py> Maker<'py> {
    pub(super) fn of(cls: Bound<'py, PyType>) -> PyResult<Self> {
        // SAFETY: `cls` is a live type object; its `tp_new` slot is a `newfunc` or null.
        let slot = unsafe { ffi::PyType_GetSlot(cls.as_type_ptr(), ffi::Py_tp_new) };
        if slot.is_null() {
            return Err(PyTypeError::new_err(format!("{cls} cannot be instantiated")));
        }
        // SAFETY: the slot's type is `newfunc` (CPython's `PyTypeObject.tp_new`).
        let new = unsafe { std::mem::transmute::<*mut std::ffi::c_void, ffi::newfunc>(slot) };
        Ok(Maker {
            no_args: PyTuple::empty(cls.py()),
            cls,
            new,
        })
    }

    /// An instance whose `__dict__` is `fields`.
    pub(super) fn make(&self, fields: Bound<'py, PyDict>) -> PyResult<Bound<'py, PyAny>> {
        let obj = self.instance()?;
        self.set_dict(&obj, fields)?;
        Ok(obj)
    }

    /// `object.__setattr__(obj, "__dict__", fields)`.
    pub(super) fn set_dict(&self, obj: &Bound<'py, PyAny>, fields: Bound<'py, PyDict>) -> PyResult<()> {
        set_attr(obj, intern!(self.cls.py(), "__dict__"), fields.as_any())
    }

    /// `object.__new__(cls)`: the class's own `tp_new` with no arguments.
    fn instance(&self) -> PyResult<Bound<'py, PyAny>> {
        // SAFETY: a new reference, or null with an exception set.
        unsafe {
            let raw = (self.new)(self.cls.as_type_ptr(), self.no_args.as_ptr(), std::ptr::null_mut());
            Bound::from_owned_ptr_or_err(self.cls.py(), raw)
        }
    }
}

/// `object.__setattr__(obj, name, value)`, which a frozen dataclass `__init__` sets its fields with.
fn set_attr(obj: &Bound<'_, PyAny>, name: &Bound<'_, PyString>, value: &Bound<'_, PyAny>) -> PyResult<()> {
    // SAFETY: all three are live objects; 0, or -1 with an exception set.
    match unsafe { ffi::PyObject_GenericSetAttr(obj.as_ptr(), name.as_ptr(), value.as_ptr()) } {
        0 => Ok(()),
        _ => Err(PyErr::fetch(obj.py())),
    }
}

/// The `LoraModule` class, whose instances keep their fields in slots (a frozen dataclass with
/// `slots=True`). An instance is made by the class's `tp_new` (`object.__new__`) and its slots
/// filled at the offsets the class lists (`tp_members`), as each slot's descriptor does when the
/// dataclass `__init__` sets it through `object.__setattr__`: 23 attribute lookups and descriptor
/// calls became 23 stores. A module of a dense fleet cost 0.35 µs as an instance with a dict.
pub(super) struct ModuleClass<'py> {
    maker: Maker<'py>,
    offsets: Offsets,
}

/// The byte offset in an instance of each field's slot, in [`MODULE_FIELDS`] order.
type Offsets = [ffi::Py_ssize_t; MODULE_FIELDS.len()];

impl<'py> ModuleClass<'py> {
    /// Checks that `cls`'s slots are exactly the fields, each an object slot that may be set.
    pub(super) fn of(cls: Bound<'py, PyType>) -> PyResult<Self> {
        // The class checked last, and its offsets: modules are built an adapter at a time, and
        // matching the members again for each (23 names against 23 fields) cost 5 µs. The class is
        // held, so its address cannot be another's.
        static CHECKED: Mutex<Option<(Py<PyType>, Offsets)>> = Mutex::new(None);
        let checked = CHECKED.lock().ok().and_then(|c| match &*c {
            Some((known, offsets)) if known.is(&cls) => Some(*offsets),
            _ => None,
        });
        let offsets = match checked {
            Some(offsets) => offsets,
            None => {
                let offsets = Self::offsets(&cls)?;
                if let Ok(mut c) = CHECKED.lock() {
                    *c = Some((cls.clone().unbind(), offsets));
                }
                offsets
            }
        };
        Ok(ModuleClass {
            maker: Maker::of(cls)?,
            offsets,
        })
    }

    fn offsets(cls: &Bound<'py, PyType>) -> PyResult<Offsets> {
        let wrong = |why: &str| PyTypeError::new_err(format!("{cls} cannot hold LoraModule fields: {why}"));
        // SAFETY: the slot is the class's null-terminated `PyMemberDef` array (or null); a heap
        // type's (a class statement's) lives as long as the class.
        let members = unsafe { ffi::PyType_GetSlot(cls.as_type_ptr(), ffi::Py_tp_members) }.cast::<ffi::PyMemberDef>();
        let mut offsets = [None; MODULE_FIELDS.len()];
        let mut count = 0;
        let mut at = members;
        while !at.is_null() {
            // SAFETY: `at` points into the array, which ends with an entry whose name is null.
            let member = unsafe { &*at };
            if member.name.is_null() {
                break;
            }
            // SAFETY: a member's name is a NUL-terminated C string.
            let name = unsafe { std::ffi::CStr::from_ptr(member.name) }.to_string_lossy();
            let field = MODULE_FIELDS.iter().position(|f| *f == name);
            match field {
                Some(i) if member.type_code == ffi::Py_T_OBJECT_EX && member.flags & ffi::Py_READONLY == 0 => {
                    offsets[i] = Some(member.offset);
                }
                _ => return Err(wrong(&format!("slot {name:?} is not a settable field slot"))),
            }
            count += 1;
            // SAFETY: not past the terminating entry, checked above.
            at = unsafe { at.add(1) };
        }
        let Some(offsets) = offsets.iter().copied().collect::<Option<Vec<_>>>() else {
            return Err(wrong("a field has no slot"));
        };
        if count != MODULE_FIELDS.len() {
            return Err(wrong("a field has two slots"));
        }
        Ok(offsets.try_into().expect("one offset per field"))
    }

    /// An instance with these fields.
    pub(super) fn make(&self, fields: Fields<'py>) -> PyResult<Bound<'py, PyAny>> {
        let obj = self.instance()?;
        for (&offset, value) in self.offsets.iter().zip(fields) {
            // SAFETY: see `set`.
            unsafe { set(&obj, offset, value.into_ptr()) };
        }
        Ok(obj)
    }

    /// An instance with the fields of `held` but its own weights file.
    pub(super) fn make_like(
        &self,
        held: &HeldFields,
        weight_file: &Bound<'py, PyString>,
    ) -> PyResult<Bound<'py, PyAny>> {
        let obj = self.instance()?;
        for (field, (&offset, value)) in self.offsets.iter().zip(held).enumerate() {
            let value = if field == WEIGHT_FILE {
                weight_file.as_ptr()
            } else {
                value.as_ptr()
            };
            // SAFETY: `value` is a live object, whose new reference the slot takes (see `set`).
            unsafe {
                ffi::Py_IncRef(value);
                set(&obj, offset, value);
            }
        }
        Ok(obj)
    }

    /// `object.__new__(cls)`, checked to be exactly the class whose slots the offsets are.
    fn instance(&self) -> PyResult<Bound<'py, PyAny>> {
        let obj = self.maker.instance()?;
        if !obj.is_exact_instance(&self.maker.cls) {
            let cls = &self.maker.cls;
            return Err(PyTypeError::new_err(format!("{cls} made an instance of another class")));
        }
        Ok(obj)
    }

    /// Instances of the fields of `dicts` (module dicts of the core, keyed by field name).
    pub(super) fn make_from_dicts(&self, dicts: &Bound<'py, PyList>) -> PyResult<Bound<'py, PyTuple>> {
        let py = self.maker.cls.py();
        let keys = field_keys(py);
        let modules = dicts
            .iter()
            .map(|d| {
                let d = d.cast_into::<PyDict>()?;
                let mut fields = Vec::with_capacity(MODULE_FIELDS.len());
                for key in keys {
                    match d.get_item(key.bind(py))? {
                        Some(v) => fields.push(v),
                        None => return Err(PyKeyError::new_err(key.clone_ref(py))),
                    }
                }
                self.make(fields.try_into().expect("one value per field"))
            })
            .collect::<PyResult<Vec<_>>>()?;
        PyTuple::new(py, modules)
    }
}

/// Sets the object slot at `offset` of `obj` to `value`, taking its reference and dropping the one
/// the slot held (none: a new instance's slots are null), as `PyMember_SetOne` does.
///
/// SAFETY: `obj` is an instance of exactly the class whose members gave `offset`, so that it is an
/// object slot inside it; `value` is a live object's new reference.
unsafe fn set(obj: &Bound<'_, PyAny>, offset: ffi::Py_ssize_t, value: *mut ffi::PyObject) {
    let slot = obj.as_ptr().cast::<u8>().offset(offset).cast::<*mut ffi::PyObject>();
    let old = std::ptr::replace(slot, value);
    ffi::Py_XDECREF(old);
}
