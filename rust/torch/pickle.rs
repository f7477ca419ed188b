//! A restricted reader of the pickle `torch.save` writes (`data.pkl`, protocol 2). It runs nothing:
//! it interprets only the opcodes and the few globals torch's tensor rebuild uses, models each
//! allowed call by its effect, and refuses every other opcode or global by name. What it gives is
//! each tensor's storage reference, dtype, offset, shape and stride.
//!
//! Work and memory are bounded (`Limits`): every opcode consumes input; the stack, the memo and
//! the values built and held are capped, and so is nesting (a deep value would overflow the
//! native stack when dropped). Memo indices must be dense, as the pickler writes them, so a huge
//! index cannot make the memo grow. What is shared stays shared: a tensor memoized once and listed
//! under many keys is one `Rc`, and so is a storage declared by many tensors.
//!
//! Mutable containers (dicts, lists) are frozen once placed inside another value, and a frozen one
//! cannot be changed again. Every value a container holds is then frozen too, so no container can
//! come to hold itself: values form a DAG, never a cycle, and only the state dict's top level and
//! tensor arguments are ever walked.

use std::cell::{Cell, RefCell};
use std::rc::Rc;

use rustc_hash::FxHashMap;

use crate::codes::TorchErrorCode;
use crate::header::Dtype;
use crate::torch::TorchError;

/// Bounds on the work and memory one pickle may take. Every opcode consumes input as well.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Limits {
    /// Nesting of values (tuples, dicts, lists); torch's state dicts need 4.
    pub depth: u32,
    /// Items on the stack at once, and open MARKs; the pickler batches dict items by 1,000.
    pub stack: usize,
    /// Memo entries; a state dict memoizes about 10 objects per tensor.
    pub memo: usize,
    /// Values built and held, in units of about 24 bytes (`VALUES_FLOOR` says what counts); about
    /// 40 per tensor. A pickle of `n` bytes may also have at most `n + VALUES_FLOOR`.
    pub values: usize,
}

/// About 400,000 tensors; reading the largest pickle takes at most about 600 MB (a value is a
/// 24-byte `Value` or about that, and a growing container briefly holds its old room too).
pub const LIMITS: Limits = Limits {
    depth: 64,
    stack: 1 << 16,
    memo: 1 << 22,
    values: 1 << 24,
};
/// A pickle of `n` bytes may have `n` values plus this many. What counts: each string, tuple,
/// container, storage and tensor built is 1, each item a tuple holds and each slot a container
/// allocates is 1 (one `Value`), each dimension a tensor holds is 1 (its size and stride), and
/// each entry of the state dict is `ENTRY_VALUES` plus its dimensions (what the header and its
/// readers keep of it). torch's own files need about one value per 4 bytes; a tensor memoized
/// once and listed under many keys, or a size memoized once and used by many tensors, needs more
/// than one per byte and is refused.
pub const VALUES_FLOOR: usize = 1 << 16;
/// The values an entry of the state dict counts for, besides its dimensions.
pub const ENTRY_VALUES: usize = 8;
/// Dimensions of one tensor.
pub const MAX_DIMS: usize = 64;
/// Length of a GLOBAL's module or name line.
const MAX_GLOBAL_LINE: usize = 256;

/// A torch element type, as an index into `DTYPES`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TorchDtype(u8);

/// (torch name, legacy storage class, bytes per element, safetensors dtype).
const DTYPES: &[(&str, Option<&str>, u64, Option<Dtype>)] = &[
    ("float64", Some("DoubleStorage"), 8, Some(Dtype::F64)),
    ("float32", Some("FloatStorage"), 4, Some(Dtype::F32)),
    ("float16", Some("HalfStorage"), 2, Some(Dtype::F16)),
    ("bfloat16", Some("BFloat16Storage"), 2, Some(Dtype::BF16)),
    ("int64", Some("LongStorage"), 8, Some(Dtype::I64)),
    ("int32", Some("IntStorage"), 4, Some(Dtype::I32)),
    ("int16", Some("ShortStorage"), 2, Some(Dtype::I16)),
    ("int8", Some("CharStorage"), 1, Some(Dtype::I8)),
    ("uint8", Some("ByteStorage"), 1, Some(Dtype::U8)),
    ("bool", Some("BoolStorage"), 1, Some(Dtype::BOOL)),
    ("complex64", Some("ComplexFloatStorage"), 8, Some(Dtype::C64)),
    ("complex128", Some("ComplexDoubleStorage"), 16, None),
    // Since torch 2.1 these are saved as an UntypedStorage plus the dtype (`_rebuild_tensor_v3`).
    ("uint16", None, 2, Some(Dtype::U16)),
    ("uint32", None, 4, Some(Dtype::U32)),
    ("uint64", None, 8, Some(Dtype::U64)),
    ("float8_e5m2", None, 1, Some(Dtype::F8_E5M2)),
    ("float8_e4m3fn", None, 1, Some(Dtype::F8_E4M3)),
    ("float8_e5m2fnuz", None, 1, Some(Dtype::F8_E5M2FNUZ)),
    ("float8_e4m3fnuz", None, 1, Some(Dtype::F8_E4M3FNUZ)),
    ("float8_e8m0fnu", None, 1, Some(Dtype::F8_E8M0)),
    ("complex32", None, 4, None),
    ("float4_e2m1fn_x2", None, 1, None),
];

/// `UntypedStorage` holds bytes.
const UINT8: TorchDtype = TorchDtype(8);

impl TorchDtype {
    /// torch's name (`bfloat16`, ...).
    pub fn name(self) -> &'static str {
        DTYPES[self.0 as usize].0
    }

    /// Bytes per element.
    pub fn itemsize(self) -> u64 {
        DTYPES[self.0 as usize].2
    }

    /// The safetensors dtype of the same element type, if there is one.
    pub fn safetensors(self) -> Option<Dtype> {
        DTYPES[self.0 as usize].3
    }

    /// Whether a tensor of it can require gradients (floating point and complex types).
    fn is_floating(self) -> bool {
        let name = self.name();
        name.starts_with("float") || name.starts_with("bfloat") || name.starts_with("complex")
    }

    fn by_name(name: &str) -> Option<Self> {
        DTYPES.iter().position(|d| d.0 == name).map(|i| TorchDtype(i as u8))
    }

    fn by_storage(class: &str) -> Option<Self> {
        DTYPES
            .iter()
            .position(|d| d.1 == Some(class))
            .map(|i| TorchDtype(i as u8))
    }
}

/// A storage as a persistent id names it: the record `data/<key>`, `numel` elements of `dtype`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Storage {
    /// The record's name under `data/`.
    pub key: String,
    /// The element type.
    pub dtype: TorchDtype,
    /// Elements it holds.
    pub numel: u64,
}

impl Storage {
    /// Its size in bytes (checked when it is read).
    pub fn nbytes(&self) -> u64 {
        self.numel * self.dtype.itemsize()
    }
}

/// One tensor as `set_(storage, offset, shape, stride)` would rebuild it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Tensor {
    /// Where its elements live (shared by views of one storage).
    pub storage: Rc<Storage>,
    /// Its element type.
    pub dtype: TorchDtype,
    /// In elements of `dtype`.
    pub offset: u64,
    /// Its dimensions.
    pub shape: Vec<u64>,
    /// Elements between neighbours along each dimension.
    pub stride: Vec<u64>,
}

impl Tensor {
    /// The elements of the storage it spans, from `offset` (0 when it has no elements).
    pub fn extent(&self) -> u64 {
        if self.shape.contains(&0) {
            return 0;
        }
        // Checked when the tensor was built.
        1 + self
            .shape
            .iter()
            .zip(&self.stride)
            .map(|(n, s)| (n - 1) * s)
            .sum::<u64>()
    }
}

/// The top-level dict: its tensors in insertion order (a repeated key keeps its first place and
/// its last value, as in Python), and the keys whose values are not tensors.
#[derive(Debug, Default)]
pub struct StateDict {
    /// (name, tensor) in insertion order; a tensor listed under several keys is shared, not copied.
    pub tensors: Vec<(String, Rc<Tensor>)>,
    /// Keys whose values are not tensors.
    pub skipped: Vec<String>,
    /// Every storage the pickle declares, each once, in order: torch reads each one's record, also
    /// when no tensor of the state dict uses it.
    pub storages: Vec<Rc<Storage>>,
}

/// The callables and types a torch state dict names.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Global {
    OrderedDict,
    RebuildV2,
    RebuildV3,
    RebuildParameter,
    RebuildParameterWithState,
    /// Builds a value a state dict may hold besides tensors (a layout, a device, bytes, a set...),
    /// as `torch.load(weights_only=True)` allows them. Modelled as an opaque value; never called.
    Value(&'static str),
    Size,
    StorageType(TorchDtype),
    Dtype(TorchDtype),
}

fn global(module: &str, name: &str) -> Option<Global> {
    Some(match (module, name) {
        ("collections", "OrderedDict") => Global::OrderedDict,
        ("torch._utils", "_rebuild_tensor_v2") => Global::RebuildV2,
        ("torch._utils", "_rebuild_tensor_v3") => Global::RebuildV3,
        ("torch._utils", "_rebuild_parameter") => Global::RebuildParameter,
        ("torch._utils", "_rebuild_parameter_with_state") => Global::RebuildParameterWithState,
        ("torch.serialization", "_get_layout") => Global::Value("torch.layout"),
        ("torch", "device") => Global::Value("torch.device"),
        ("_codecs", "encode") => Global::Value("bytes"),
        // Protocol 2 names Python 3's builtins by their Python 2 module.
        ("builtins" | "__builtin__", "bytearray") => Global::Value("bytearray"),
        ("builtins" | "__builtin__", "set") => Global::Value("set"),
        ("builtins" | "__builtin__", "complex") => Global::Value("complex"),
        ("collections", "Counter") => Global::Value("Counter"),
        ("torch", "Size") => Global::Size,
        ("torch" | "torch.storage", "UntypedStorage") => Global::StorageType(UINT8),
        ("torch", n) if n.ends_with("Storage") => Global::StorageType(TorchDtype::by_storage(n)?),
        ("torch", n) => Global::Dtype(TorchDtype::by_name(n)?),
        _ => return None,
    })
}

/// A dict (plain or ordered) or a list. Dict items are stored flat: key, value, key, value.
#[derive(Debug)]
struct Container {
    ordered: bool,
    depth: Cell<u32>,
    frozen: Cell<bool>,
    items: RefCell<Vec<Value>>,
}

#[derive(Debug)]
struct Tuple {
    depth: u32,
    /// Whether every item is hashable (a tuple is then a valid dict key or set item).
    hashable: bool,
    items: Vec<Value>,
}

#[derive(Debug, Clone)]
enum Value {
    None,
    Bool(bool),
    Int(i64),
    Float,
    Str(Rc<str>),
    Tuple(Rc<Tuple>),
    Dict(Rc<Container>),
    List(Rc<Container>),
    Global(Global),
    Storage(Rc<Storage>),
    Tensor(Rc<Tensor>),
    /// What an allowed non-tensor constructor built.
    Opaque(&'static str),
}

impl Value {
    fn kind(&self) -> &'static str {
        match self {
            Value::None => "None",
            Value::Bool(_) => "bool",
            Value::Int(_) => "int",
            Value::Float => "float",
            Value::Str(_) => "str",
            Value::Tuple(_) => "tuple",
            Value::Dict(c) if c.ordered => "OrderedDict",
            Value::Dict(_) => "dict",
            Value::List(_) => "list",
            Value::Global(_) => "global",
            Value::Storage(_) => "storage",
            Value::Tensor(_) => "tensor",
            Value::Opaque(kind) => kind,
        }
    }

    fn depth(&self) -> u32 {
        match self {
            Value::Tuple(t) => t.depth,
            Value::Dict(c) | Value::List(c) => c.depth.get(),
            _ => 0,
        }
    }

    /// Whether Python could hash it (use it as a dict key or set item).
    fn hashable(&self) -> bool {
        match self {
            Value::Tuple(t) => t.hashable,
            Value::Dict(_) | Value::List(_) => false,
            Value::Opaque(kind) => !matches!(*kind, "set" | "bytearray" | "Counter"),
            _ => true,
        }
    }

    /// Marks a container as held by another value: it cannot change from now on.
    fn freeze(&self) {
        if let Value::Dict(c) | Value::List(c) = self {
            c.frozen.set(true);
        }
    }
}

/// The device types `torch.device` accepts.
const DEVICE_TYPES: &[&str] = &[
    "cpu",
    "cuda",
    "ipu",
    "xpu",
    "mkldnn",
    "opengl",
    "opencl",
    "ideep",
    "hip",
    "ve",
    "fpga",
    "maia",
    "xla",
    "lazy",
    "vulkan",
    "mps",
    "meta",
    "hpu",
    "mtia",
    "privateuseone",
];
/// The layouts `torch.serialization._get_layout` knows.
const LAYOUTS: &[&str] = &[
    "torch.strided",
    "torch.sparse_coo",
    "torch.sparse_csr",
    "torch.sparse_csc",
    "torch.sparse_bsr",
    "torch.sparse_bsc",
    "torch._mkldnn",
    "torch.jagged",
];

/// Whether a storage's location is one `torch.save` writes and `torch.load` restores (given the
/// device, or a `map_location`): `cpu`, `meta`, or a backend with an optional index (`cuda:0`).
/// torch cannot restore any other without a `map_location`.
fn saved_location(location: &str) -> bool {
    let backend = |d: &str| matches!(d, "cuda" | "mps" | "hpu" | "xpu" | "mtia");
    match location.split_once(':') {
        None => matches!(location, "cpu" | "meta") || backend(location),
        Some((device, index)) => backend(device) && !index.is_empty() && index.bytes().all(|b| b.is_ascii_digit()),
    }
}

/// Whether `args` are what pickle's protocol 2 writes for a `kind` value (`Global::Value`), which
/// `torch.load` then builds without fail. Other arguments may fail there (`complex("x")`,
/// `torch.device("gpu")`, a list in a set), and the file would not load, so they are refused.
fn value_args(kind: &str, args: &[Value]) -> bool {
    let latin1 = |s: &str| s.chars().all(|c| u32::from(c) <= 0xFF);
    let known = |list: &[&str], s: &str| list.contains(&s);
    match (kind, args) {
        ("bytes", [Value::Str(s), Value::Str(codec)]) => &**codec == "latin1" && latin1(s),
        ("bytearray", [Value::Opaque("bytes")]) => true,
        ("bytearray", [Value::Str(s), Value::Str(codec)]) => &**codec == "latin-1" && latin1(s),
        ("set", [Value::List(c)]) => c.items.borrow().iter().all(Value::hashable),
        ("bytearray" | "set" | "Counter", []) | ("Counter", [Value::Dict(_)]) => true,
        ("complex", _) => {
            args.len() <= 2
                && args
                    .iter()
                    .all(|v| matches!(v, Value::Int(_) | Value::Float | Value::Bool(_)))
        }
        ("torch.device", [Value::Str(t)]) => known(DEVICE_TYPES, t),
        // An index past 127 is wrapped or refused, depending on torch's version.
        ("torch.device", [Value::Str(t), Value::Int(i)]) => known(DEVICE_TYPES, t) && (0..128).contains(i),
        ("torch.layout", [Value::Str(name)]) => known(LAYOUTS, name),
        _ => false,
    }
}

/// Opcode names, for messages; None for a byte that is no pickle opcode.
fn opcode_name(op: u8) -> Option<&'static str> {
    Some(match op {
        b'(' => "MARK",
        b'.' => "STOP",
        b'0' => "POP",
        b'1' => "POP_MARK",
        b'2' => "DUP",
        b'F' => "FLOAT",
        b'I' => "INT",
        b'J' => "BININT",
        b'K' => "BININT1",
        b'L' => "LONG",
        b'M' => "BININT2",
        b'N' => "NONE",
        b'P' => "PERSID",
        b'Q' => "BINPERSID",
        b'R' => "REDUCE",
        b'S' => "STRING",
        b'T' => "BINSTRING",
        b'U' => "SHORT_BINSTRING",
        b'V' => "UNICODE",
        b'X' => "BINUNICODE",
        b'a' => "APPEND",
        b'b' => "BUILD",
        b'c' => "GLOBAL",
        b'd' => "DICT",
        b'}' => "EMPTY_DICT",
        b'e' => "APPENDS",
        b'g' => "GET",
        b'h' => "BINGET",
        b'i' => "INST",
        b'j' => "LONG_BINGET",
        b'l' => "LIST",
        b']' => "EMPTY_LIST",
        b'o' => "OBJ",
        b'p' => "PUT",
        b'q' => "BINPUT",
        b'r' => "LONG_BINPUT",
        b's' => "SETITEM",
        b't' => "TUPLE",
        b')' => "EMPTY_TUPLE",
        b'u' => "SETITEMS",
        b'G' => "BINFLOAT",
        0x80 => "PROTO",
        0x81 => "NEWOBJ",
        0x82 => "EXT1",
        0x83 => "EXT2",
        0x84 => "EXT4",
        0x85 => "TUPLE1",
        0x86 => "TUPLE2",
        0x87 => "TUPLE3",
        0x88 => "NEWTRUE",
        0x89 => "NEWFALSE",
        0x8a => "LONG1",
        0x8b => "LONG4",
        b'B' => "BINBYTES",
        b'C' => "SHORT_BINBYTES",
        0x8c => "SHORT_BINUNICODE",
        0x8d => "BINUNICODE8",
        0x8e => "BINBYTES8",
        0x8f => "EMPTY_SET",
        0x90 => "ADDITEMS",
        0x91 => "FROZENSET",
        0x92 => "NEWOBJ_EX",
        0x93 => "STACK_GLOBAL",
        0x94 => "MEMOIZE",
        0x95 => "FRAME",
        0x96 => "BYTEARRAY8",
        0x97 => "NEXT_BUFFER",
        0x98 => "READONLY_BUFFER",
        _ => return None,
    })
}

fn invalid(at: usize, message: impl std::fmt::Display) -> TorchError {
    TorchError::new(
        TorchErrorCode::InvalidPickle,
        format!("{message} (byte {at} of data.pkl)"),
    )
}

fn unsafe_at(at: usize, message: impl std::fmt::Display) -> TorchError {
    TorchError::new(
        TorchErrorCode::UnsafePickle,
        format!("{message} (byte {at} of data.pkl); nothing was run"),
    )
}

fn limit(at: usize, message: impl std::fmt::Display) -> TorchError {
    TorchError::new(
        TorchErrorCode::PickleLimit,
        format!("{message} (byte {at} of data.pkl)"),
    )
}

fn bad_tensor(message: impl std::fmt::Display) -> TorchError {
    TorchError::new(TorchErrorCode::InvalidTorchTensor, message.to_string())
}

struct Machine<'p> {
    data: &'p [u8],
    pos: usize,
    /// Where the opcode being run started, for messages.
    at: usize,
    stack: Vec<Value>,
    marks: Vec<usize>,
    memo: Vec<Value>,
    /// Values counted so far, and how many this pickle may have (`Limits::values`).
    values: usize,
    max_values: usize,
    limits: Limits,
    /// Each storage key's first declaration (torch reuses it for every later one), and the keys in
    /// the order they were declared.
    storages: FxHashMap<String, Rc<Storage>>,
    declared: Vec<Rc<Storage>>,
}

impl<'p> Machine<'p> {
    fn take(&mut self, n: usize) -> Result<&'p [u8], TorchError> {
        let data: &'p [u8] = self.data;
        let end = self.pos.checked_add(n).filter(|&e| e <= data.len());
        let end = end.ok_or_else(|| invalid(self.at, "pickle ends inside an opcode's argument"))?;
        let out = &data[self.pos..end];
        self.pos = end;
        Ok(out)
    }

    fn u8(&mut self) -> Result<u8, TorchError> {
        Ok(self.take(1)?[0])
    }

    fn u32(&mut self) -> Result<u32, TorchError> {
        Ok(u32::from_le_bytes(self.take(4)?.try_into().expect("4 bytes")))
    }

    fn line(&mut self) -> Result<&'p str, TorchError> {
        let rest = &self.data[self.pos..];
        let n = rest
            .iter()
            .take(MAX_GLOBAL_LINE + 1)
            .position(|&b| b == b'\n')
            .ok_or_else(|| invalid(self.at, "GLOBAL argument is not a short line"))?;
        let line = self.take(n + 1)?;
        std::str::from_utf8(&line[..n])
            .ok()
            .filter(|s| s.bytes().all(|b| b.is_ascii_graphic()))
            .ok_or_else(|| invalid(self.at, "GLOBAL argument is not a dotted name"))
    }

    /// Counts `n` more values built or held (`VALUES_FLOOR` says what counts).
    fn count(&mut self, n: usize) -> Result<(), TorchError> {
        self.values += n;
        if self.values > self.max_values {
            return Err(limit(
                self.at,
                format!(
                    "more than {} values (strings, items, dimensions, entries) for a {}-byte pickle",
                    self.max_values,
                    self.data.len()
                ),
            ));
        }
        Ok(())
    }

    fn push(&mut self, v: Value) -> Result<(), TorchError> {
        if self.stack.len() >= self.limits.stack {
            return Err(limit(
                self.at,
                format!("more than {} items on the stack", self.limits.stack),
            ));
        }
        self.stack.push(v);
        Ok(())
    }

    /// The lowest stack index the current opcode may pop (above the innermost MARK).
    fn fence(&self) -> usize {
        self.marks.last().copied().unwrap_or(0)
    }

    fn pop(&mut self) -> Result<Value, TorchError> {
        if self.stack.len() <= self.fence() {
            return Err(invalid(self.at, "stack underflow"));
        }
        Ok(self.stack.pop().expect("checked"))
    }

    fn top(&self) -> Result<&Value, TorchError> {
        if self.stack.len() <= self.fence() {
            return Err(invalid(self.at, "stack underflow"));
        }
        Ok(self.stack.last().expect("checked"))
    }

    /// The items above the innermost MARK, which is removed.
    fn pop_mark(&mut self) -> Result<Vec<Value>, TorchError> {
        let mark = self.marks.pop().ok_or_else(|| invalid(self.at, "no MARK to pop to"))?;
        Ok(self.stack.split_off(mark))
    }

    fn tuple(&mut self, items: Vec<Value>) -> Result<Value, TorchError> {
        self.count(1 + items.len())?;
        let depth = 1 + items.iter().map(Value::depth).max().unwrap_or(0);
        self.check_depth(depth)?;
        items.iter().for_each(Value::freeze);
        let hashable = items.iter().all(Value::hashable);
        Ok(Value::Tuple(Rc::new(Tuple { depth, hashable, items })))
    }

    fn check_depth(&self, depth: u32) -> Result<(), TorchError> {
        if depth > self.limits.depth {
            return Err(limit(
                self.at,
                format!("values nested deeper than {}", self.limits.depth),
            ));
        }
        Ok(())
    }

    fn container(&mut self, ordered: bool) -> Result<Rc<Container>, TorchError> {
        self.count(1)?;
        Ok(Rc::new(Container {
            ordered,
            depth: Cell::new(1),
            frozen: Cell::new(false),
            items: RefCell::new(Vec::new()),
        }))
    }

    /// Adds `items` to the container on top of the stack (a dict when `dict`, else a list).
    fn extend(&mut self, items: Vec<Value>, dict: bool) -> Result<(), TorchError> {
        let at = self.at;
        let c = match (self.top()?, dict) {
            (Value::Dict(c), true) | (Value::List(c), false) => Rc::clone(c),
            (other, _) => {
                let what = if dict { "SETITEM(S)" } else { "APPEND(S)" };
                return Err(unsafe_at(at, format!("{what} on a {}", other.kind())));
            }
        };
        if dict && items.len() % 2 != 0 {
            return Err(invalid(at, "SETITEMS with an odd number of items"));
        }
        if dict {
            for key in items.iter().step_by(2) {
                if !key.hashable() {
                    return Err(invalid(at, format!("unhashable {} used as a dict key", key.kind())));
                }
            }
        }
        items.iter().for_each(Value::freeze);
        // Checked after freezing the items, so a container given itself is refused too.
        if c.frozen.get() {
            return Err(unsafe_at(
                at,
                "a container is changed after being placed in another value",
            ));
        }
        let depth = 1 + items.iter().map(Value::depth).max().unwrap_or(0);
        self.check_depth(depth)?;
        c.depth.set(c.depth.get().max(depth));
        // A container counts what it allocates (it grows by doubling), before it allocates it.
        let mut held = c.items.borrow_mut();
        if held.capacity() - held.len() < items.len() {
            let grow = held.capacity().max(items.len());
            self.count(held.len() + grow - held.capacity())?;
            held.reserve_exact(grow);
        }
        held.extend(items);
        Ok(())
    }

    fn memo_index(&self, idx: u32) -> Result<usize, TorchError> {
        let idx = idx as usize;
        if idx >= self.memo.len() {
            return Err(invalid(
                self.at,
                format!("memo index {idx} was never stored (memo holds {})", self.memo.len()),
            ));
        }
        Ok(idx)
    }

    fn put(&mut self, idx: u32) -> Result<(), TorchError> {
        let v = self.top()?.clone();
        let idx = idx as usize;
        match idx.cmp(&self.memo.len()) {
            std::cmp::Ordering::Less => self.memo[idx] = v,
            std::cmp::Ordering::Equal if idx < self.limits.memo => self.memo.push(v),
            std::cmp::Ordering::Equal => {
                return Err(limit(self.at, format!("more than {} memo entries", self.limits.memo)))
            }
            // The pickler numbers memo entries densely; a gap is how a huge index attacks memory.
            std::cmp::Ordering::Greater => {
                return Err(invalid(
                    self.at,
                    format!("memo index {idx} skips ahead of the {} entries stored", self.memo.len()),
                ))
            }
        }
        Ok(())
    }

    fn persistent(&mut self, pid: Value) -> Result<Value, TorchError> {
        let at = self.at;
        let not_storage = || invalid(at, "persistent id is not a torch storage");
        let Value::Tuple(t) = &pid else {
            return Err(not_storage());
        };
        let storage = match t.items.as_slice() {
            [Value::Str(tag), Value::Global(Global::StorageType(dtype)), Value::Str(key), Value::Str(location), Value::Int(numel)]
                if &**tag == "storage" && *numel >= 0 =>
            {
                if !saved_location(location) {
                    return Err(bad_tensor(format!(
                        "storage {key:?}: location {location:?} is no device torch.save names"
                    )));
                }
                let numel = *numel as u64;
                if numel.checked_mul(dtype.itemsize()).is_none() {
                    return Err(bad_tensor(format!(
                        "storage {key:?}: {numel} elements overflow 64 bits"
                    )));
                }
                Storage {
                    key: key.to_string(),
                    dtype: *dtype,
                    numel,
                }
            }
            _ => return Err(not_storage()),
        };
        self.count(1)?;
        // torch keeps a key's first storage and ignores later declarations: one that disagrees
        // would make torch read other elements than it says, so it is refused.
        if let Some(first) = self.storages.get(&storage.key) {
            if **first != storage {
                return Err(bad_tensor(format!(
                    "storage {:?} is declared as {} {} elements, then as {} {}",
                    storage.key,
                    first.numel,
                    first.dtype.name(),
                    storage.numel,
                    storage.dtype.name()
                )));
            }
            return Ok(Value::Storage(Rc::clone(first)));
        }
        let storage = Rc::new(storage);
        self.storages.insert(storage.key.clone(), Rc::clone(&storage));
        self.declared.push(Rc::clone(&storage));
        Ok(Value::Storage(storage))
    }

    fn reduce(&mut self, callable: Value, args: Value) -> Result<Value, TorchError> {
        let at = self.at;
        let Value::Global(g) = callable else {
            return Err(unsafe_at(at, format!("REDUCE calls a {}", callable.kind())));
        };
        let Value::Tuple(args) = args else {
            return Err(invalid(at, "REDUCE arguments are not a tuple"));
        };
        let args = args.items.as_slice();
        match (g, args) {
            (Global::OrderedDict, []) => Ok(Value::Dict(self.container(true)?)),
            (Global::RebuildV2, _) if matches!(args.len(), 6 | 7) => self.rebuild(&args[..6], None, args.get(6)),
            (Global::RebuildV3, [.., Value::Global(Global::Dtype(d))]) if args.len() == 7 => {
                self.rebuild(&args[..6], Some(*d), None)
            }
            (Global::RebuildV3, [.., Value::Global(Global::Dtype(d)), metadata]) if args.len() == 8 => {
                self.rebuild(&args[..6], Some(*d), Some(metadata))
            }
            (Global::RebuildParameter, [Value::Tensor(t), Value::Bool(grad), Value::Dict(_)]) => {
                grad_ok(at, t.dtype, *grad)?;
                Ok(Value::Tensor(Rc::clone(t)))
            }
            // A parameter's Python attributes are set by name, which can fail: only none are read.
            (Global::RebuildParameterWithState, [Value::Tensor(t), Value::Bool(grad), Value::Dict(_), state])
                if no_state(state) =>
            {
                grad_ok(at, t.dtype, *grad)?;
                Ok(Value::Tensor(Rc::clone(t)))
            }
            (Global::Value(kind), args) => {
                if !value_args(kind, args) {
                    return Err(invalid(
                        at,
                        format!("{kind} built from arguments torch.save does not write"),
                    ));
                }
                self.count(1)?;
                Ok(Value::Opaque(kind))
            }
            (Global::Size, [Value::Tuple(t)]) if t.items.iter().all(|v| matches!(v, Value::Int(_))) => {
                Ok(Value::Tuple(Rc::clone(t)))
            }
            (Global::StorageType(_) | Global::Dtype(_), _) => Err(unsafe_at(at, "REDUCE calls a type or dtype")),
            (g, _) => Err(invalid(at, format!("{g:?} called with unexpected arguments"))),
        }
    }

    /// `_rebuild_tensor_v2/v3(storage, offset, size, stride, requires_grad, hooks[, dtype][, metadata])`.
    fn rebuild(
        &mut self,
        args: &[Value],
        dtype: Option<TorchDtype>,
        metadata: Option<&Value>,
    ) -> Result<Value, TorchError> {
        let at = self.at;
        let (storage, offset, size, stride, grad) = match args {
            [Value::Storage(s), Value::Int(o), Value::Tuple(size), Value::Tuple(stride), Value::Bool(grad), Value::Dict(_)] => {
                (s, *o, size, stride, *grad)
            }
            _ => return Err(invalid(at, "tensor rebuilt from unexpected arguments")),
        };
        let ints = |t: &Tuple| -> Option<Vec<u64>> {
            t.items
                .iter()
                .map(|v| match v {
                    Value::Int(i) if *i >= 0 => Some(*i as u64),
                    _ => None,
                })
                .collect()
        };
        let (Some(shape), Some(stride)) = (ints(size), ints(stride)) else {
            return Err(invalid(at, "tensor size or stride is not a tuple of non-negative ints"));
        };
        if offset < 0 || shape.len() != stride.len() || shape.len() > MAX_DIMS {
            return Err(bad_tensor(format!(
                "storage {:?}: offset {offset}, size {shape:?} and stride {stride:?} do not describe a tensor",
                storage.key
            )));
        }
        let dtype = dtype.unwrap_or(storage.dtype);
        grad_ok(at, dtype, grad)?;
        if !metadata_ok(metadata, dtype) {
            return Err(invalid(at, "tensor metadata is not what torch.save writes"));
        }
        let tensor = Tensor {
            storage: Rc::clone(storage),
            dtype,
            offset: offset as u64,
            shape,
            stride,
        };
        check_bounds(&tensor)?;
        self.count(1 + tensor.shape.len())?;
        Ok(Value::Tensor(Rc::new(tensor)))
    }

    fn run(&mut self) -> Result<Value, TorchError> {
        loop {
            self.at = self.pos;
            let op = *self
                .data
                .get(self.pos)
                .ok_or_else(|| invalid(self.at, "pickle ends without STOP"))?;
            self.pos += 1;
            if self.at == 0 && op != 0x80 {
                return Err(invalid(0, "not a protocol-2 pickle (no PROTO opcode)"));
            }
            match op {
                0x80 => {
                    let proto = self.u8()?;
                    if self.at != 0 || proto != 2 {
                        return Err(unsafe_at(
                            self.at,
                            format!("PROTO {proto}: only torch.save's protocol 2 is read"),
                        ));
                    }
                }
                b'.' => {
                    if !self.marks.is_empty() || self.stack.len() != 1 {
                        return Err(invalid(self.at, "STOP with an unbalanced stack"));
                    }
                    if self.pos != self.data.len() {
                        return Err(invalid(self.at, "bytes after STOP"));
                    }
                    return Ok(self.stack.pop().expect("checked"));
                }
                b'(' => {
                    if self.marks.len() >= self.limits.stack {
                        return Err(limit(self.at, format!("more than {} open MARKs", self.limits.stack)));
                    }
                    self.marks.push(self.stack.len());
                }
                b'}' => {
                    let c = self.container(false)?;
                    self.push(Value::Dict(c))?;
                }
                b']' => {
                    let c = self.container(false)?;
                    self.push(Value::List(c))?;
                }
                b')' => {
                    let t = self.tuple(Vec::new())?;
                    self.push(t)?;
                }
                b'N' => self.push(Value::None)?,
                0x88 | 0x89 => self.push(Value::Bool(op == 0x88))?,
                b'J' => {
                    let v = self.u32()? as i32;
                    self.push(Value::Int(v.into()))?;
                }
                b'K' => {
                    let v = self.u8()?;
                    self.push(Value::Int(v.into()))?;
                }
                b'M' => {
                    let b = self.take(2)?;
                    self.push(Value::Int(u16::from_le_bytes([b[0], b[1]]).into()))?;
                }
                0x8a => {
                    let n = self.u8()? as usize;
                    if n > 8 {
                        return Err(limit(self.at, format!("LONG1 of {n} bytes is wider than 64 bits")));
                    }
                    let b = self.take(n)?;
                    let v = match b.last() {
                        None => 0,
                        Some(&last) => {
                            let fill = if last & 0x80 != 0 { 0xFF } else { 0 };
                            let mut w = [fill; 8];
                            w[..n].copy_from_slice(b);
                            i64::from_le_bytes(w)
                        }
                    };
                    self.push(Value::Int(v))?;
                }
                b'G' => {
                    self.take(8)?;
                    self.push(Value::Float)?;
                }
                b'X' => {
                    let n = self.u32()? as usize;
                    let b = self.take(n)?;
                    let s = std::str::from_utf8(b).map_err(|_| invalid(self.at, "BINUNICODE is not UTF-8"))?;
                    self.count(1)?;
                    self.push(Value::Str(Rc::from(s)))?;
                }
                b'q' | b'r' => {
                    let idx = if op == b'q' { self.u8()?.into() } else { self.u32()? };
                    self.put(idx)?;
                }
                b'h' | b'j' => {
                    let idx = if op == b'h' { self.u8()?.into() } else { self.u32()? };
                    let idx = self.memo_index(idx)?;
                    let v = self.memo[idx].clone();
                    self.push(v)?;
                }
                b'c' => {
                    let module = self.line()?;
                    let name = self.line()?;
                    let g = global(module, name)
                        .ok_or_else(|| unsafe_at(self.at, format!("global {module}.{name} is not allowed")))?;
                    self.push(Value::Global(g))?;
                }
                b'Q' => {
                    let pid = self.pop()?;
                    let storage = self.persistent(pid)?;
                    self.push(storage)?;
                }
                b't' => {
                    let items = self.pop_mark()?;
                    let t = self.tuple(items)?;
                    self.push(t)?;
                }
                0x85..=0x87 => {
                    let n = (op - 0x84) as usize;
                    if self.stack.len() < self.fence() + n {
                        return Err(invalid(self.at, "stack underflow"));
                    }
                    let items = self.stack.split_off(self.stack.len() - n);
                    let t = self.tuple(items)?;
                    self.push(t)?;
                }
                b'R' => {
                    let args = self.pop()?;
                    let callable = self.pop()?;
                    args.freeze();
                    let v = self.reduce(callable, args)?;
                    self.push(v)?;
                }
                b'b' => {
                    let state = self.pop()?;
                    state.freeze();
                    match (self.top()?, &state) {
                        // OrderedDict's attributes (`state_dict._metadata`): read, then ignored.
                        (Value::Dict(c), Value::Dict(_)) if c.ordered => {}
                        (target, _) => {
                            return Err(unsafe_at(
                                self.at,
                                format!("BUILD sets a {} on a {}", state.kind(), target.kind()),
                            ))
                        }
                    }
                }
                b's' => {
                    let v = self.pop()?;
                    let k = self.pop()?;
                    self.extend(vec![k, v], true)?;
                }
                b'u' => {
                    let items = self.pop_mark()?;
                    self.extend(items, true)?;
                }
                b'a' => {
                    let v = self.pop()?;
                    self.extend(vec![v], false)?;
                }
                b'e' => {
                    let items = self.pop_mark()?;
                    self.extend(items, false)?;
                }
                _ => {
                    return Err(match opcode_name(op) {
                        Some(name) => unsafe_at(self.at, format!("opcode {name} (0x{op:02x}) is not allowed")),
                        None => invalid(self.at, format!("unknown opcode 0x{op:02x}")),
                    })
                }
            }
        }
    }
}

/// Refuses `requires_grad` on a tensor whose dtype cannot have gradients, as torch does.
fn grad_ok(at: usize, dtype: TorchDtype, grad: bool) -> Result<(), TorchError> {
    if grad && !dtype.is_floating() {
        return Err(invalid(
            at,
            format!("a {} tensor cannot require gradients", dtype.name()),
        ));
    }
    Ok(())
}

/// Whether a tensor's metadata is one torch sets: none, or a dict of str to bool whose `conj`, if
/// any, is on a complex tensor (torch asserts it).
fn metadata_ok(metadata: Option<&Value>, dtype: TorchDtype) -> bool {
    match metadata {
        None | Some(Value::None) => true,
        Some(Value::Dict(c)) => c.items.borrow().chunks_exact(2).all(|kv| match kv {
            [Value::Str(k), Value::Bool(_)] => &**k != "conj" || dtype.name().starts_with("complex"),
            _ => false,
        }),
        _ => false,
    }
}

/// Whether a parameter's state sets no attribute: None or `{}`, alone or as `(dict, slots)`.
fn no_state(state: &Value) -> bool {
    let empty = |v: &Value| match v {
        Value::None => true,
        Value::Dict(c) => c.items.borrow().is_empty(),
        _ => false,
    };
    match state {
        Value::Tuple(t) => t.items.len() == 2 && t.items.iter().all(empty),
        other => empty(other),
    }
}

/// Refuses a tensor that reaches past its storage, as `set_` would, or whose element count
/// overflows (torch's `numel` is an i64). Zero dims are left out of the count, so a product of the
/// shape in any order fits in 64 bits, as the safetensors rules guarantee for their headers.
fn check_bounds(t: &Tensor) -> Result<(), TorchError> {
    let overflow = || bad_tensor(format!("storage {:?}: tensor size overflows 64 bits", t.storage.key));
    t.shape
        .iter()
        .filter(|&&n| n != 0)
        .try_fold(1u64, |acc, &n| acc.checked_mul(n).filter(|&p| p <= i64::MAX as u64))
        .ok_or_else(overflow)?;
    let mut extent: u64 = 1;
    for (&n, &s) in t.shape.iter().zip(&t.stride) {
        if n == 0 {
            return Ok(());
        }
        extent = (n - 1)
            .checked_mul(s)
            .and_then(|x| x.checked_add(extent))
            .ok_or_else(overflow)?;
    }
    let needed = t
        .offset
        .checked_add(extent)
        .and_then(|e| e.checked_mul(t.dtype.itemsize()))
        .ok_or_else(overflow)?;
    let has = t.storage.nbytes();
    if needed > has {
        return Err(bad_tensor(format!(
            "storage {:?}: a {} tensor of size {:?}, stride {:?} at offset {} needs {needed} bytes, the storage has {has}",
            t.storage.key,
            t.dtype.name(),
            t.shape,
            t.stride,
            t.offset
        )));
    }
    Ok(())
}

/// A key of the state dict, which must be a string.
fn state_key(key: &Value) -> Result<&Rc<str>, TorchError> {
    match key {
        Value::Str(key) => Ok(key),
        other => Err(TorchError::new(
            TorchErrorCode::NotAStateDict,
            format!("a key of the state dict is a {}, not a str", other.kind()),
        )),
    }
}

/// Reads the state dict pickled in `data` (the bytes of `data.pkl`).
pub fn read_state_dict(data: &[u8]) -> Result<StateDict, TorchError> {
    read_state_dict_with(data, LIMITS)
}

/// `read_state_dict` within other bounds (tests use small ones).
pub fn read_state_dict_with(data: &[u8], limits: Limits) -> Result<StateDict, TorchError> {
    let mut m = Machine {
        limits,
        data,
        pos: 0,
        at: 0,
        stack: Vec::new(),
        marks: Vec::new(),
        memo: Vec::new(),
        values: 0,
        max_values: limits.values.min(data.len().saturating_add(VALUES_FLOOR)),
        storages: FxHashMap::default(),
        declared: Vec::new(),
    };
    let top = m.run()?;
    let Value::Dict(c) = &top else {
        return Err(TorchError::new(
            TorchErrorCode::NotAStateDict,
            format!("the pickle holds a {}, not a dict of tensors", top.kind()),
        ));
    };
    let items = c.items.borrow();
    // Counted before any entry is made: one tensor memoized once can be listed under millions of keys.
    let mut cost = 0;
    for pair in items.chunks_exact(2) {
        state_key(&pair[0])?;
        cost += ENTRY_VALUES
            + if let Value::Tensor(t) = &pair[1] {
                t.shape.len()
            } else {
                0
            };
    }
    m.count(cost)?;
    let mut order: Vec<(&Rc<str>, &Value)> = Vec::with_capacity(items.len() / 2);
    let mut seen: FxHashMap<&str, usize> = FxHashMap::default();
    for pair in items.chunks_exact(2) {
        let key = state_key(&pair[0])?;
        match seen.get(&**key) {
            Some(&i) => order[i].1 = &pair[1],
            None => {
                seen.insert(key, order.len());
                order.push((key, &pair[1]));
            }
        }
    }
    let mut out = StateDict::default();
    for (key, value) in order {
        match value {
            Value::Tensor(t) => out.tensors.push((key.to_string(), Rc::clone(t))),
            _ => out.skipped.push(key.to_string()),
        }
    }
    out.storages = std::mem::take(&mut m.declared);
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_allowed_global_is_known() {
        assert_eq!(
            global("torch", "BFloat16Storage"),
            Some(Global::StorageType(TorchDtype(3)))
        );
        assert_eq!(global("torch", "float8_e4m3fn").map(|_| ()), Some(()));
        assert_eq!(global("torch", "QInt8Storage"), None);
        assert_eq!(global("os", "system"), None);
        assert_eq!(global("torch", "load"), None);
        assert_eq!(TorchDtype::by_name("uint8"), Some(UINT8));
    }

    #[test]
    fn storage_locations_are_the_ones_torch_save_writes() {
        for ok in ["cpu", "meta", "cuda", "cuda:0", "cuda:12", "mps", "xpu:1"] {
            assert!(saved_location(ok), "{ok}");
        }
        for bad in ["cpX", "cpu:0", "meta:1", "cuda:", "cuda:x", "cuda:-1", "gpu", ""] {
            assert!(!saved_location(bad), "{bad}");
        }
    }
}
