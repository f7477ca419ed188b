//! The restricted torch reader (`rust/torch*.rs`): a real `torch.save` file read back as
//! `torch.load(weights_only=True)` reads it, hand-built hostile pickles and broken zips refused
//! with their codes, and a proptest over mutated pickles and archives (no panic, only known
//! codes, bounded work). Nothing here needs torch: the fixture was written by
//! `tests/fixtures/make_torch_fixtures.py`.

mod common;

use std::fs;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};

use _core::scan::{load, ScanOptions, Target};
use _core::torch::pickle::{read_state_dict, read_state_dict_with, Limits};
use _core::torch::{read_torch_file, read_torch_header, TorchError};
use _core::ErrorCode;
use common::alloc::{memory_bound, peak_during, CountingAlloc};
use proptest::prelude::*;

#[global_allocator]
static ALLOC: CountingAlloc = CountingAlloc;

fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures/torch")
        .join(name)
}

// ---- a tiny pickle assembler ----

struct P(Vec<u8>);

impl P {
    fn new() -> Self {
        P(vec![0x80, 2])
    }
    fn op(mut self, b: &[u8]) -> Self {
        self.0.extend_from_slice(b);
        self
    }
    fn str(self, s: &str) -> Self {
        let mut b = vec![b'X'];
        b.extend_from_slice(&(s.len() as u32).to_le_bytes());
        b.extend_from_slice(s.as_bytes());
        self.op(&b)
    }
    fn int(self, i: u8) -> Self {
        self.op(&[b'K', i])
    }
    fn global(self, module: &str, name: &str) -> Self {
        self.op(format!("c{module}\n{name}\n").as_bytes())
    }
    fn ints(mut self, v: &[u8]) -> Self {
        self = self.op(b"(");
        for &i in v {
            self = self.int(i);
        }
        self.op(b"t")
    }
    /// `_rebuild_tensor_v2(storage('0', FloatStorage, numel), offset, size, stride, False, OrderedDict())`.
    fn tensor(self, key: &str, numel: u8, offset: u8, size: &[u8], stride: &[u8]) -> Self {
        self.global("torch._utils", "_rebuild_tensor_v2")
            .op(b"((")
            .str("storage")
            .global("torch", "FloatStorage")
            .str(key)
            .str("cpu")
            .int(numel)
            .op(b"tQ")
            .int(offset)
            .ints(size)
            .ints(stride)
            .op(&[0x89])
            .global("collections", "OrderedDict")
            .op(b")Rt")
            .op(b"R")
    }
    fn done(self) -> Vec<u8> {
        self.op(b".").0
    }
}

/// `{name: tensor}` as torch pickles it (a plain dict, one SETITEMS batch).
/// (name, storage key, storage numel, offset, size, stride) of one float tensor.
type Item<'a> = (&'a str, &'a str, u8, u8, &'a [u8], &'a [u8]);

fn state_pickle(items: &[Item<'_>]) -> Vec<u8> {
    let mut p = P::new().op(b"}q\x00(");
    for &(name, key, numel, offset, size, stride) in items {
        p = p.str(name).tensor(key, numel, offset, size, stride);
    }
    p.op(b"u").done()
}

// ---- a stored-only zip writer shaped like torch's (zip64 end records included) ----

fn zip(prefix: &str, records: &[(&str, &[u8])]) -> Vec<u8> {
    let mut out = Vec::new();
    let mut central = Vec::new();
    for (name, data) in records {
        let full = if prefix.is_empty() {
            name.to_string()
        } else {
            format!("{prefix}/{name}")
        };
        let offset = out.len() as u32;
        out.extend_from_slice(b"PK\x03\x04");
        out.extend_from_slice(&[20, 0, 0, 0, 0, 0, 0, 0, 0, 0]);
        out.extend_from_slice(&[0; 4]); // crc (not checked)
        out.extend_from_slice(&(data.len() as u32).to_le_bytes());
        out.extend_from_slice(&(data.len() as u32).to_le_bytes());
        out.extend_from_slice(&(full.len() as u16).to_le_bytes());
        out.extend_from_slice(&0u16.to_le_bytes());
        out.extend_from_slice(full.as_bytes());
        out.extend_from_slice(data);
        central.extend_from_slice(b"PK\x01\x02");
        central.extend_from_slice(&[20, 3, 20, 0, 0, 0, 0, 0, 0, 0, 0, 0]);
        central.extend_from_slice(&[0; 4]);
        central.extend_from_slice(&(data.len() as u32).to_le_bytes());
        central.extend_from_slice(&(data.len() as u32).to_le_bytes());
        central.extend_from_slice(&(full.len() as u16).to_le_bytes());
        central.extend_from_slice(&[0; 12]); // extra, comment, disk, attributes
        central.extend_from_slice(&offset.to_le_bytes());
        central.extend_from_slice(full.as_bytes());
    }
    let cd_offset = out.len() as u64;
    out.extend_from_slice(&central);
    let n = records.len() as u64;
    let z64 = out.len() as u64;
    out.extend_from_slice(b"PK\x06\x06");
    out.extend_from_slice(&44u64.to_le_bytes());
    out.extend_from_slice(&[30, 3, 45, 0, 0, 0, 0, 0, 0, 0, 0, 0]);
    out.extend_from_slice(&n.to_le_bytes());
    out.extend_from_slice(&n.to_le_bytes());
    out.extend_from_slice(&(central.len() as u64).to_le_bytes());
    out.extend_from_slice(&cd_offset.to_le_bytes());
    out.extend_from_slice(b"PK\x06\x07");
    out.extend_from_slice(&0u32.to_le_bytes());
    out.extend_from_slice(&z64.to_le_bytes());
    out.extend_from_slice(&1u32.to_le_bytes());
    out.extend_from_slice(b"PK\x05\x06");
    out.extend_from_slice(&[0, 0, 0, 0]);
    out.extend_from_slice(&(n as u16).to_le_bytes());
    out.extend_from_slice(&(n as u16).to_le_bytes());
    out.extend_from_slice(&(central.len() as u32).to_le_bytes());
    out.extend_from_slice(&(cd_offset as u32).to_le_bytes());
    out.extend_from_slice(&0u16.to_le_bytes());
    out
}

/// A torch-like archive holding `pickle` and one float storage per `(key, numel)`.
fn archive(pickle: &[u8], storages: &[(&str, usize)]) -> Vec<u8> {
    let data: Vec<(String, Vec<u8>)> = storages
        .iter()
        .map(|(k, n)| (format!("data/{k}"), vec![0u8; n * 4]))
        .collect();
    let mut records: Vec<(&str, &[u8])> = vec![("data.pkl", pickle), ("byteorder", b"little"), ("version", b"3\n")];
    records.extend(data.iter().map(|(n, d)| (n.as_str(), d.as_slice())));
    zip("archive", &records)
}

static SEQ: AtomicUsize = AtomicUsize::new(0);

fn temp_file(bytes: &[u8]) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("lorafast-torch-{}", std::process::id()));
    fs::create_dir_all(&dir).unwrap();
    let path = dir.join(format!("{}.pt", SEQ.fetch_add(1, Ordering::Relaxed)));
    fs::write(&path, bytes).unwrap();
    path
}

fn read_bytes(bytes: &[u8]) -> Result<Vec<(String, String, Vec<u64>)>, TorchError> {
    let path = temp_file(bytes);
    let file = fs::File::open(&path).unwrap();
    let result = read_torch_file(&file, bytes.len() as u64).map(|t| {
        let h = &t.header;
        h.tensors
            .iter()
            .map(|e| (e.name.to_string(), e.dtype.name().to_owned(), h.shape(e).to_vec()))
            .collect()
    });
    fs::remove_file(&path).unwrap();
    result
}

fn code_of(bytes: &[u8]) -> &'static str {
    match read_bytes(bytes) {
        Ok(t) => panic!("accepted: {t:?}"),
        Err(e) => e.code(),
    }
}

fn pickle_code(pickle: &[u8]) -> (&'static str, String) {
    match read_state_dict(pickle) {
        Ok(s) => panic!("accepted: {s:?}"),
        Err(e) => {
            let message = match &e {
                TorchError::Format { message, .. } => message.clone(),
                TorchError::Io(io) => io.to_string(),
            };
            (e.code(), message)
        }
    }
}

// ---- real torch output ----

#[test]
fn reads_the_torch_save_fixture_as_torch_load_does() {
    let h = read_torch_header(&fixture("state.pt")).unwrap();
    let expected: Vec<(String, String, Vec<u64>)> =
        serde_json::from_str(&fs::read_to_string(fixture("state.json")).unwrap()).unwrap();
    let got: Vec<(String, String, Vec<u64>)> = h
        .header
        .tensors
        .iter()
        .map(|e| {
            (
                e.name.to_string(),
                e.dtype.name().to_owned(),
                h.header.shape(e).to_vec(),
            )
        })
        .collect();
    assert_eq!(got, expected);
    assert_eq!(h.prefix, "state");
    assert!(h.header.warnings.is_empty(), "{:?}", h.header.warnings);
}

#[test]
fn fixture_offsets_point_at_the_tensor_bytes() {
    // The 0-d f16 alpha holds 8.0; `data_start() + begin` must land on it, as classify reads it.
    let h = read_torch_header(&fixture("state.pt")).unwrap();
    let bytes = fs::read(fixture("state.pt")).unwrap();
    let alpha = h.header.tensors.iter().find(|t| t.name == "scalar.alpha").unwrap();
    let at = (h.header.data_start() + alpha.begin) as usize;
    assert_eq!(alpha.end - alpha.begin, 2);
    assert_eq!(&bytes[at..at + 2], &0x4800u16.to_le_bytes()); // 8.0 in f16
                                                              // The slice [1:, 2:] of a 4x6 float32 starts 8 elements into the shared storage.
    let a = &h.header.tensors[0];
    let k = h.header.tensors.iter().find(|t| t.name.contains("k_proj")).unwrap();
    assert_eq!(k.begin - a.begin, 8 * 4);
    assert_eq!(a.end - a.begin, 24 * 4);
}

// ---- hand-built files that are fine ----

#[test]
fn accepts_a_hand_built_state_dict() {
    let p = state_pickle(&[("a", "0", 6, 0, &[2, 3], &[3, 1]), ("b", "0", 6, 2, &[2, 2], &[1, 2])]);
    let got = read_bytes(&archive(&p, &[("0", 6)])).unwrap();
    assert_eq!(got[0], ("a".into(), "F32".into(), vec![2, 3]));
    assert_eq!(got[1], ("b".into(), "F32".into(), vec![2, 2]));
}

#[test]
fn a_repeated_key_keeps_its_place_and_last_value_as_python_does() {
    let p = state_pickle(&[
        ("a", "0", 6, 0, &[6], &[1]),
        ("b", "0", 6, 0, &[1], &[1]),
        ("a", "0", 6, 0, &[2], &[1]),
    ]);
    let got = read_bytes(&archive(&p, &[("0", 6)])).unwrap();
    assert_eq!(
        got,
        vec![("a".into(), "F32".into(), vec![2]), ("b".into(), "F32".into(), vec![1])]
    );
}

#[test]
fn non_tensor_values_are_skipped_with_a_warning() {
    let p = P::new()
        .op(b"}(")
        .str("w")
        .tensor("0", 1, 0, &[1], &[1])
        .str("step")
        .int(3)
        .op(b"u")
        .done();
    let path = temp_file(&archive(&p, &[("0", 1)]));
    let h = read_torch_header(&path).unwrap();
    assert_eq!(h.header.tensors.len(), 1);
    assert_eq!(h.header.warnings[0].code.code(), "non_tensor_value");
    assert!(h.header.warnings[0].message.contains("step"));
}

// ---- hostile pickles: refused, nothing run ----

#[test]
fn os_system_through_global_and_reduce_is_refused() {
    let p = P::new()
        .global("os", "system")
        .str("touch /tmp/pwned")
        .op(&[0x85])
        .op(b"R")
        .done();
    let (code, message) = pickle_code(&p);
    assert_eq!(code, "unsafe_pickle");
    assert!(message.contains("global os.system is not allowed"), "{message}");
    // The same payload inside a torch archive.
    assert_eq!(code_of(&archive(&p, &[])), "unsafe_pickle");
}

#[test]
fn reduce_payloads_hidden_in_allowed_shapes_are_refused() {
    // builtins.eval, getattr chains, a torch global that is not a rebuild function.
    for (m, n) in [
        ("builtins", "eval"),
        ("builtins", "getattr"),
        ("torch", "load"),
        ("torch.storage", "_load_from_bytes"),
        ("torch._utils", "_rebuild_qtensor"),
        ("torch", "QInt8Storage"),
        ("__builtin__", "exec"),
        ("subprocess", "Popen"),
    ] {
        let p = P::new().op(b"}(").str("x").global(m, n).op(b")R").op(b"u").done();
        let (code, message) = pickle_code(&p);
        assert_eq!(code, "unsafe_pickle", "{m}.{n}");
        assert!(message.contains(&format!("{m}.{n}")), "{message}");
    }
    // An allowed type or dtype is not callable either.
    let p = P::new().global("torch", "FloatStorage").op(b")R").done();
    assert_eq!(pickle_code(&p).0, "unsafe_pickle");
    // REDUCE of a non-global (a string) is refused before anything.
    let p = P::new().str("os.system").op(b")R").done();
    assert_eq!(pickle_code(&p).0, "unsafe_pickle");
}

#[test]
fn object_building_opcodes_are_refused_by_name() {
    let cases: &[(&[u8], &str)] = &[
        (b"\x93", "STACK_GLOBAL"),
        (b"ios\nsystem\n", "INST"),
        (b"o", "OBJ"),
        (b"\x81", "NEWOBJ"),
        (b"\x92", "NEWOBJ_EX"),
        (b"\x82\x01", "EXT1"),
        (b"Pfoo\n", "PERSID"),
        (b"S'x'\n", "STRING"),
        (b"C\x01x", "SHORT_BINBYTES"),
        (b"\x95\x00\x00\x00\x00\x00\x00\x00\x00", "FRAME"),
    ];
    for (body, name) in cases {
        let p = P::new().str("a").str("b").op(body).done();
        let (code, message) = pickle_code(&p);
        assert_eq!(code, "unsafe_pickle", "{name}");
        assert!(message.contains(name), "{message}");
    }
    // STACK_GLOBAL with an allowed-looking name is refused all the same.
    let p = P::new()
        .str("collections")
        .str("OrderedDict")
        .op(&[0x93])
        .op(b")R")
        .done();
    assert!(pickle_code(&p).1.contains("STACK_GLOBAL"));
    // Only protocol 2.
    let mut p4 = P::new().op(b"}").done();
    p4[1] = 4;
    assert_eq!(pickle_code(&p4).0, "unsafe_pickle");
    assert_eq!(pickle_code(b"}.").0, "invalid_pickle");
    assert_eq!(pickle_code(&P::new().op(&[0xff]).done()).0, "invalid_pickle");
}

#[test]
fn huge_memo_indices_are_refused_without_allocating() {
    let p = P::new().op(b"}r\xff\xff\xff\xff").done();
    let (code, message) = pickle_code(&p);
    assert_eq!(code, "invalid_pickle");
    assert!(message.contains("4294967295"), "{message}");
    let p = P::new().op(b"j\xff\xff\xff\x7f").done();
    assert_eq!(pickle_code(&p).0, "invalid_pickle");
    // Reusing an index is fine (Python allows it); skipping ahead is not.
    let p = P::new().op(b"}q\x00q\x00q\x02").done();
    assert_eq!(pickle_code(&p).0, "invalid_pickle");
}

#[test]
fn deep_nesting_and_long_stacks_hit_limits() {
    // 100,000 nested one-tuples: refused at depth 64, not a stack overflow on drop.
    let mut p = P::new().op(b")");
    for _ in 0..100_000 {
        p = p.op(&[0x85]);
    }
    assert_eq!(pickle_code(&p.done()).0, "pickle_limit");
    // Nested lists through APPEND.
    let mut p = P::new().op(b"]");
    for _ in 0..100 {
        p = p.op(b"]");
    }
    for _ in 0..100 {
        p = p.op(b"a");
    }
    assert_eq!(pickle_code(&p.done()).0, "pickle_limit");
    // A million pushes without a pop.
    let p = P::new().op(&vec![b'N'; 1 << 20]).done();
    assert_eq!(pickle_code(&p).0, "pickle_limit");
    let p = P::new().op(&vec![b'('; 1 << 20]).done();
    assert_eq!(pickle_code(&p).0, "pickle_limit");
    // Values and memo entries, against small limits (the defaults are about 400,000 tensors). The
    // dict is 1 value and each `int: ()` pair 3 (the tuple and the two items the dict holds).
    let small = Limits {
        depth: 8,
        stack: 1024,
        memo: 100,
        values: 1000,
    };
    let pairs = |n: u32| {
        let mut body = b"}(".to_vec();
        for i in 0..n {
            body.push(b'J');
            body.extend_from_slice(&i.to_le_bytes());
            body.push(b')');
        }
        body.push(b'u');
        body
    };
    let code = |b: &[u8]| read_state_dict_with(&P::new().op(b).done(), small).unwrap_err().code();
    assert_eq!(code(&pairs(334)), "pickle_limit");
    // One pair fewer fits: the pickle is read to the end (and refused for its int keys).
    assert_eq!(code(&pairs(333)), "not_a_state_dict");
    let mut memo = b"}".to_vec();
    for i in 0..=100u32 {
        memo.push(b'r');
        memo.extend_from_slice(&i.to_le_bytes());
    }
    assert_eq!(code(&memo), "pickle_limit");
    assert_eq!(code(&[b'N'; 1025]), "pickle_limit");
    // A list grown one APPEND at a time counts the room it allocates: its 513th item doubles it
    // to 1,024.
    let mut appends = b"]".to_vec();
    appends.extend(std::iter::repeat_n(*b"Na", 513).flatten());
    assert_eq!(code(&appends), "pickle_limit");
    assert_eq!(code(&appends[..appends.len() - 2]), "not_a_state_dict");
}

#[test]
fn an_ordered_dict_takes_only_a_dict_of_attributes() {
    // OrderedDict's BUILD updates its __dict__: a dict works, None fails in torch.load.
    let od = |state: &[u8]| {
        P::new()
            .global("collections", "OrderedDict")
            .op(b")R")
            .op(state)
            .op(b"b")
            .done()
    };
    assert!(read_state_dict(&od(b"}")).is_ok());
    let (code, message) = pickle_code(&od(b"N"));
    assert_eq!(code, "unsafe_pickle");
    assert!(message.contains("BUILD sets a None on a OrderedDict"), "{message}");
}

#[test]
fn unhashable_dict_keys_are_refused() {
    // {"k": {(1, [2]): 3}}: Python cannot hash a tuple holding a list, so torch.load fails.
    let p = P::new().op(b"}(").str("k").op(b"}((K\x01]K\x02atK\x03uu").done();
    let (code, message) = pickle_code(&p);
    assert_eq!(code, "invalid_pickle");
    assert!(message.contains("unhashable tuple"), "{message}");
    // A tuple of hashable items is a fine key.
    let p = P::new().op(b"}(").str("k").op(b"}((K\x01K\x02tK\x03uu").done();
    assert!(read_state_dict(&p).is_ok());
}

#[test]
fn containers_cannot_be_made_to_hold_themselves() {
    // d = {}; d['x'] = d
    let p = P::new().op(b"}q\x00X\x01\x00\x00\x00xh\x00s").done();
    assert_eq!(pickle_code(&p).0, "unsafe_pickle");
    // l = []; t = (l,); l.append(t)
    let p = P::new().op(b"]q\x00h\x00\x85a").done();
    assert_eq!(pickle_code(&p).0, "unsafe_pickle");
    // A dict changed after being placed in a tuple.
    let p = P::new().op(b"}q\x00\x85h\x00(KxK\x01u").done();
    assert_eq!(pickle_code(&p).0, "unsafe_pickle");
}

#[test]
fn malformed_pickles_are_invalid() {
    let cases: &[&[u8]] = &[
        b"\x80\x02",                                              // no STOP
        b"\x80\x02X\xff\x00\x00\x00ab.",                          // string past the end
        b"\x80\x02X\x02\x00\x00\x00\xff\xfe.",                    // not UTF-8
        b"\x80\x02s.",                                            // SETITEM on an empty stack
        b"\x80\x02(K\x01t0.",                                     // POP is not allowed -> unsafe, checked below
        b"\x80\x02K\x01K\x01.",                                   // two values at STOP
        b"\x80\x02}.junk",                                        // bytes after STOP
        b"\x80\x02(}u.",                                          // MARK left open
        b"\x80\x02}(K\x01u.",                                     // odd SETITEMS
        b"\x80\x02h\x00.",                                        // memo never stored
        b"\x80\x02(Q.",                                           // BINPERSID with nothing above the MARK
        b"\x80\x02\x8a\x09\x01\x02\x03\x04\x05\x06\x07\x08\x09.", // LONG1 wider than i64
        b"\x80\x02ccollections OrderedDict\n.",                   // GLOBAL argument not two lines
    ];
    for bytes in cases {
        let code = pickle_code(bytes).0;
        assert!(
            ["invalid_pickle", "unsafe_pickle", "pickle_limit"].contains(&code),
            "{bytes:?}: {code}"
        );
    }
    assert_eq!(pickle_code(b"\x80\x02}(K\x01u.").0, "invalid_pickle");
    assert_eq!(pickle_code(b"\x80\x02}.junk").0, "invalid_pickle");
    // A persistent id that is not torch's storage tuple.
    let p = P::new().str("storage").op(b"Q").done();
    assert_eq!(pickle_code(&p).0, "invalid_pickle");
}

#[test]
fn not_a_state_dict() {
    assert_eq!(pickle_code(&P::new().op(b"]").done()).0, "not_a_state_dict");
    assert_eq!(pickle_code(&P::new().op(b"}(K\x01K\x02u").done()).0, "not_a_state_dict");
}

#[test]
fn tensors_past_their_storage_or_missing_records_are_refused() {
    // 2x3 at offset 1 needs 7 elements of a 6-element storage.
    let p = state_pickle(&[("a", "0", 6, 1, &[2, 3], &[3, 1])]);
    assert_eq!(pickle_code(&p).0, "invalid_torch_tensor");
    // Stride 0 and empty tensors need nothing past their offset.
    let p = state_pickle(&[("a", "0", 1, 0, &[5, 4], &[0, 0]), ("e", "1", 0, 9, &[0, 3], &[3, 1])]);
    assert!(read_bytes(&archive(&p, &[("0", 1), ("1", 0)])).is_ok());
    // An empty tensor at an offset far past its storage (`set_` allows it) spans no bytes.
    let mut huge = P::new()
        .op(b"}(")
        .str("e")
        .global("torch._utils", "_rebuild_tensor_v2")
        .op(b"((");
    huge = huge
        .str("storage")
        .global("torch", "DoubleStorage")
        .str("0")
        .str("cpu")
        .int(1)
        .op(b"tQ");
    huge = huge
        .op(b"\x8a\x08\xff\xff\xff\xff\xff\xff\xff\x7f")
        .ints(&[0])
        .ints(&[1]);
    let p = huge
        .op(&[0x89])
        .global("collections", "OrderedDict")
        .op(b")Rt")
        .op(b"R")
        .op(b"u")
        .done();
    let path = temp_file(&archive(&p, &[("0", 2)]));
    let h = read_torch_header(&path).unwrap();
    assert_eq!(h.header.tensors[0].begin, h.header.tensors[0].end);
    // Size and stride of different lengths.
    let p = state_pickle(&[("a", "0", 6, 0, &[6], &[1, 1])]);
    assert_eq!(pickle_code(&p).0, "invalid_torch_tensor");
    // The record is missing, or shorter than the persistent id says.
    let p = state_pickle(&[("a", "0", 6, 0, &[6], &[1])]);
    assert_eq!(code_of(&archive(&p, &[])), "invalid_torch_tensor");
    assert_eq!(code_of(&archive(&p, &[("0", 5)])), "invalid_torch_tensor");
}

// ---- memory follows the pickle ----

/// A state dict whose first entry is a `ndim`-dimensional float tensor (every dim 1), memoized,
/// then listed again under `keys - 1` more names (`{prefix}{i}`) by BINGET, in SETITEMS batches
/// of 1,000.
fn shared_tensor_pickle(keys: usize, ndim: usize, prefix: &str) -> Vec<u8> {
    let ones = vec![1u8; ndim];
    let mut p = P::new()
        .op(b"}(")
        .str(&format!("{prefix}0"))
        .tensor("0", 1, 0, &ones, &ones)
        .op(b"q\x00");
    for i in 1..keys {
        if i % 1000 == 0 {
            p = p.op(b"u(");
        }
        p = p.str(&format!("{prefix}{i}")).op(b"h\x00");
    }
    p.op(b"u").done()
}

#[test]
fn a_tensor_listed_under_many_keys_shares_its_shape() {
    // 8 dims under 100,000 keys: each entry points at the one shape, nothing is copied per key.
    let keys = 100_000;
    let p = shared_tensor_pickle(keys, 8, "base_model.model.layers.0.mlp.lora_A.weight.");
    let file = archive(&p, &[("0", 1)]);
    let path = temp_file(&file);
    let (h, peak) = peak_during(|| read_torch_header(&path).unwrap());
    assert_eq!(h.header.tensors.len(), keys);
    assert_eq!(h.header.dims, vec![1; 8]);
    assert!(h.header.tensors.iter().all(|t| h.header.shape(t) == [1; 8]));
    assert!(h.header.tensors[keys - 1].name.ends_with(&format!(".{}", keys - 1)));
    // Memory follows the pickle: one shape and stride shared by every key, the dims not copied per key.
    assert!(peak < 25 * p.len(), "peak {peak} bytes for a {}-byte pickle", p.len());
    fs::remove_file(&path).unwrap();
}

#[test]
fn dimensions_beyond_the_pickles_size_are_refused() {
    // A 64-dim tensor under 250,000 keys, a 3.4 MB file: its dims would take far more than the file.
    let p = shared_tensor_pickle(250_000, 64, "k");
    let file = archive(&p, &[("0", 1)]);
    let path = temp_file(&file);
    let (result, peak) = peak_during(|| read_torch_header(&path));
    let err = result.unwrap_err();
    assert_eq!(err.code(), "pickle_limit");
    assert_eq!(err.path(), &path);
    assert!(err.to_string().contains("dimensions"), "{err}");
    assert!(
        peak < memory_bound(file.len()),
        "peak {peak} bytes for a {}-byte file",
        file.len()
    );
    // One size and one stride tuple, memoized, shared by 100,000 distinct tensors.
    let ones = [1u8; 64];
    let mut p = P::new()
        .op(b"}(")
        .str("t0")
        .global("torch._utils", "_rebuild_tensor_v2")
        .op(b"q\x00((")
        .str("storage")
        .global("torch", "FloatStorage")
        .str("0")
        .str("cpu")
        .int(1)
        .op(b"tQq\x01")
        .int(0)
        .ints(&ones)
        .op(b"q\x02h\x02")
        .op(&[0x89])
        .global("collections", "OrderedDict")
        .op(b")Rq\x03tR");
    for i in 1..100_000 {
        if i % 1000 == 0 {
            p = p.op(b"u(");
        }
        p = p.str(&format!("t{i}")).op(b"h\x00(h\x01K\x00h\x02h\x02\x89h\x03tR");
    }
    let p = p.op(b"u").done();
    let (result, peak) = peak_during(|| read_state_dict(&p));
    assert_eq!(result.unwrap_err().code(), "pickle_limit");
    assert!(
        peak < memory_bound(p.len()),
        "peak {peak} bytes for a {}-byte pickle",
        p.len()
    );
}

#[test]
fn torch_files_stay_within_the_dimension_budget() {
    // The budget counts one dimension per pickle byte; torch's own output needs a fraction.
    let h = read_torch_header(&fixture("state.pt")).unwrap();
    let dims: usize = h.header.tensors.iter().map(|t| 3 * t.shape_len as usize).sum();
    assert!(
        dims * 2 < h.pickle_size as usize,
        "{dims} dims in {} bytes",
        h.pickle_size
    );
}

// ---- storages declared twice ----

#[test]
fn a_storage_declared_again_must_agree_with_its_first_declaration() {
    // torch reuses the first storage of a key: a later declaration of another size or dtype is refused.
    let p = state_pickle(&[("a", "0", 4, 0, &[4], &[1]), ("b", "0", 4, 0, &[2, 2], &[2, 1])]);
    assert_eq!(read_bytes(&archive(&p, &[("0", 4)])).unwrap().len(), 2);
    let p = state_pickle(&[("a", "0", 4, 0, &[4], &[1]), ("b", "0", 64, 0, &[64], &[1])]);
    let (code, message) = pickle_code(&p);
    assert_eq!(code, "invalid_torch_tensor");
    assert!(
        message.contains("declared as 4 float32 elements, then as 64 float32"),
        "{message}"
    );
    assert_eq!(code_of(&archive(&p, &[("0", 4)])), "invalid_torch_tensor");
}

// ---- containers ----

#[test]
fn legacy_and_non_zip_files_are_refused() {
    // A pre-1.6 torch file starts with a pickled magic number.
    let legacy = b"\x80\x02\x8a\x0al\xfc\x9cF\xf9 j\xa8P\x19.";
    assert_eq!(code_of(legacy), "legacy_torch_format");
    assert_eq!(code_of(b"{\"not\": \"torch\"}"), "invalid_zip");
    assert_eq!(code_of(b""), "invalid_zip");
}

#[test]
fn broken_archives_are_refused() {
    let p = state_pickle(&[("a", "0", 6, 0, &[6], &[1])]);
    let good = archive(&p, &[("0", 6)]);
    assert!(read_bytes(&good).is_ok());
    // Truncated anywhere: the end records go first.
    for cut in [good.len() - 1, good.len() - 30, good.len() / 2, 10] {
        assert_eq!(code_of(&good[..cut]), "invalid_zip", "cut at {cut}");
    }
    // No data.pkl, records outside a folder, a big-endian file.
    assert_eq!(code_of(&zip("archive", &[("version", b"3")])), "invalid_zip");
    assert_eq!(code_of(&zip("", &[("data.pkl", &p)])), "invalid_zip");
    assert_eq!(code_of(&zip("archive", &[])), "invalid_zip");
    // A local header naming another record than the directory does.
    let mut renamed = good.clone();
    renamed[30 + "archive/".len()] = b'D';
    assert_eq!(code_of(&renamed), "invalid_zip");
    let big = zip(
        "archive",
        &[("data.pkl", &p), ("byteorder", b"big"), ("data/0", &[0; 24])],
    );
    assert_eq!(code_of(&big), "unsupported_byteorder");
    // The same name twice.
    let twice = zip("archive", &[("data.pkl", &p), ("data.pkl", &p)]);
    assert_eq!(code_of(&twice), "invalid_zip");
    // No version record, or a format version torch does not read (a good pickle is read first).
    let data: &[u8] = &[0; 24];
    let versioned = |v: Option<&[u8]>| {
        let mut records = vec![("data.pkl", p.as_slice()), ("data/0", data)];
        records.extend(v.map(|v| ("version", v)));
        zip("archive", &records)
    };
    assert!(read_bytes(&versioned(Some(b"10\n"))).is_ok());
    for bad in [None, Some(&b"0"[..]), Some(b"11"), Some(b"abc"), Some(b"")] {
        let Err(TorchError::Format { code, message }) = read_bytes(&versioned(bad)) else {
            panic!("{bad:?} accepted");
        };
        assert_eq!(code.code(), "invalid_zip", "{bad:?}");
        assert!(message.contains("version"), "{message}");
    }
}

#[test]
fn compressed_records_are_refused_not_inflated() {
    // A zip bomb's record: method 8 (deflate) claiming 4 GiB. Never inflated.
    let p = state_pickle(&[]);
    let mut z = archive(&p, &[]);
    let cd = find(&z, b"PK\x01\x02");
    z[cd + 10] = 8;
    z[cd + 24..cd + 28].copy_from_slice(&u32::MAX.to_le_bytes());
    let (code, message) = match read_bytes(&z) {
        Err(TorchError::Format { code, message }) => (code, message),
        other => panic!("{other:?}"),
    };
    assert_eq!(code.code(), "invalid_zip");
    assert!(message.contains("compressed"), "{message}");
}

#[test]
fn records_pointing_outside_the_archive_are_refused() {
    let p = state_pickle(&[]);
    let mut z = archive(&p, &[]);
    let cd = find(&z, b"PK\x01\x02");
    z[cd + 42..cd + 46].copy_from_slice(&0x7fff_0000u32.to_le_bytes());
    assert_eq!(code_of(&z), "invalid_zip");
    // A size larger than the file.
    let mut z = archive(&p, &[]);
    z[cd + 20..cd + 28].copy_from_slice(&[0xf0, 0xff, 0xff, 0x0f, 0xf0, 0xff, 0xff, 0x0f]);
    assert_eq!(code_of(&z), "invalid_zip");
    // A central directory that claims more records than it can hold.
    let mut z = archive(&p, &[]);
    let z64 = find(&z, b"PK\x06\x06");
    z[z64 + 24..z64 + 40].copy_from_slice(&[0xff; 16]);
    assert_eq!(code_of(&z), "invalid_zip");
}

fn find(hay: &[u8], needle: &[u8]) -> usize {
    hay.windows(needle.len()).position(|w| w == needle).unwrap()
}

// ---- fuzzing: mutated pickles and archives never panic and give known codes ----

/// A refusal says what is wrong (its code is a `TorchErrorCode` by type).
fn known(r: Result<impl std::fmt::Debug, TorchError>) {
    if let Err(TorchError::Format { code, message }) = r {
        assert!(!message.is_empty(), "{code} without a message");
    }
}

fn seed_pickle() -> Vec<u8> {
    let base = fs::read(fixture("state.pt")).unwrap();
    let file = fs::File::open(fixture("state.pt")).unwrap();
    let zip = _core::torch::zip::Archive::open(&file, base.len() as u64).unwrap();
    let rec = zip.record("data.pkl").unwrap().clone();
    zip.read(&rec, 1 << 20).unwrap()
}

#[derive(Debug, Clone)]
enum Edit {
    Flip(usize, u8),
    Insert(usize, Vec<u8>),
    Delete(usize, usize),
    Truncate(usize),
}

fn apply(mut b: Vec<u8>, edits: &[Edit]) -> Vec<u8> {
    for e in edits {
        let n = b.len().max(1);
        match e {
            Edit::Flip(i, x) => {
                if !b.is_empty() {
                    b[i % n] ^= x | 1;
                }
            }
            Edit::Insert(i, bytes) => {
                let at = i % (b.len() + 1);
                b.splice(at..at, bytes.iter().copied());
            }
            Edit::Delete(i, len) => {
                let at = i % n;
                let end = (at + len).min(b.len());
                if at < end {
                    b.drain(at..end);
                }
            }
            Edit::Truncate(i) => b.truncate(i % n),
        }
    }
    b
}

fn edit() -> impl Strategy<Value = Edit> {
    prop_oneof![
        (any::<usize>(), any::<u8>()).prop_map(|(i, x)| Edit::Flip(i, x)),
        (any::<usize>(), prop::collection::vec(any::<u8>(), 1..8)).prop_map(|(i, v)| Edit::Insert(i, v)),
        // Opcodes torch writes, so insertions keep the pickle mostly well-formed.
        (
            any::<usize>(),
            prop::sample::select(b"()}qhXKtRuQs.\x85\x86\x87\x89\x88".to_vec())
        )
            .prop_map(|(i, op)| Edit::Insert(i, vec![op])),
        (any::<usize>(), 1usize..16).prop_map(|(i, n)| Edit::Delete(i, n)),
        any::<usize>().prop_map(Edit::Truncate),
    ]
}

/// A LONG1 opcode holding `v`.
fn long1(v: i64) -> Vec<u8> {
    let mut b = vec![0x8a, 8];
    b.extend_from_slice(&v.to_le_bytes());
    b
}

/// One tensor of `dtype` storage with arbitrary numel, offset, size and stride.
fn arbitrary_tensor(storage: &str, numel: i64, offset: i64, size: &[i64], stride: &[i64]) -> Vec<u8> {
    let mut p = P::new()
        .op(b"}(")
        .str("t")
        .global("torch._utils", "_rebuild_tensor_v2")
        .op(b"((");
    p = p
        .str("storage")
        .global("torch", storage)
        .str("0")
        .str("cpu")
        .op(&long1(numel))
        .op(b"tQ");
    p = p.op(&long1(offset)).op(b"(");
    for &d in size {
        p = p.op(&long1(d));
    }
    p = p.op(b"t(");
    for &d in stride {
        p = p.op(&long1(d));
    }
    p = p
        .op(b"t")
        .op(&[0x89])
        .global("collections", "OrderedDict")
        .op(b")Rt")
        .op(b"R");
    p.op(b"u").done()
}

fn dim() -> impl Strategy<Value = i64> {
    prop_oneof![8 => 0i64..5, 1 => any::<i64>(), 1 => Just(i64::MAX), 1 => Just(-1)]
}

// 256 cases by default; PROPTEST_CASES=100000 for a long run.
proptest! {
    /// Whatever the numbers, a tensor is refused or lies inside its storage record and the file.
    #[test]
    fn accepted_tensors_lie_inside_the_file(
        storage in prop::sample::select(vec!["FloatStorage", "ByteStorage", "DoubleStorage", "UntypedStorage"]),
        numel in prop_oneof![4 => 0i64..64, 1 => any::<i64>()],
        wrong_record in prop::option::weighted(0.2, 0usize..512),
        offset in dim(),
        shape in prop::collection::vec((dim(), dim()), 0..4),
    ) {
        let (size, stride): (Vec<i64>, Vec<i64>) = shape.into_iter().unzip();
        let p = arbitrary_tensor(storage, numel, offset, &size, &stride);
        let itemsize = if storage == "DoubleStorage" { 8 } else if storage == "FloatStorage" { 4 } else { 1 };
        let record = wrong_record.unwrap_or((numel.clamp(0, 64) * itemsize) as usize);
        let file = zip("archive", &[("data.pkl", &p), ("version", b"3"), ("data/0", &vec![0; record])]);
        let path = temp_file(&file);
        match read_torch_header(&path) {
            Ok(h) => {
                let t = &h.header.tensors[0];
                let (begin, end) = (h.header.data_start() + t.begin, h.header.data_start() + t.end);
                prop_assert!(begin <= end && end <= file.len() as u64);
                let elements: u64 = h.header.shape(t).iter().product();
                prop_assert!(elements == 0 || end - begin >= t.dtype.bits() / 8);
            }
            Err(e) => prop_assert!(matches!(e.error_code(), ErrorCode::Torch(_)), "{e}"),
        }
        // Classified as a scan classifies it (`t` is named like a kohya alpha, whose value is read).
        let target = Target { path: path.clone(), weights: path.clone(), config: None };
        if let Err(e) = load(target, ScanOptions::default()) {
            prop_assert!(matches!(e.error_code(), ErrorCode::Torch(_)), "{e}");
        }
        fs::remove_file(&path).unwrap();
    }
}

proptest! {

    #[test]
    fn mutated_pickles_never_panic(edits in prop::collection::vec(edit(), 1..6)) {
        let pickle = apply(seed_pickle(), &edits);
        known(read_state_dict(&pickle));
    }

    #[test]
    fn mutated_archives_never_panic(edits in prop::collection::vec(edit(), 1..4)) {
        let bytes = apply(fs::read(fixture("state.pt")).unwrap(), &edits);
        known(read_bytes(&bytes));
    }

    #[test]
    fn random_bytes_after_the_protocol_never_panic(body in prop::collection::vec(any::<u8>(), 0..256)) {
        let mut p = vec![0x80, 2];
        p.extend(body);
        known(read_state_dict(&p));
    }
}
