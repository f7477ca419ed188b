//! Generators of safetensors files that are valid or nearly so, and the differential check
//! against the safetensors crate (`read_metadata`), shared by `proptest_header.rs` and
//! `fuzz_header.rs`.
//!
//! Generated files: random names (escapes, unicode, controls), every dtype, 0-d and empty shapes,
//! contiguous or perturbed offsets, metadata, padding, duplicates, unknown fields, trailing bytes
//! and wrong length prefixes.

use std::collections::HashMap;

use _core::header::{parse_file, Header};
use proptest::prelude::*;
use safetensors::SafeTensors;

pub const DTYPES: [(&str, u64); 22] = [
    ("BOOL", 8),
    ("F4", 4),
    ("F6_E2M3", 6),
    ("F6_E3M2", 6),
    ("U8", 8),
    ("I8", 8),
    ("F8_E5M2", 8),
    ("F8_E4M3", 8),
    ("F8_E8M0", 8),
    ("F8_E4M3FNUZ", 8),
    ("F8_E5M2FNUZ", 8),
    ("I16", 16),
    ("U16", 16),
    ("F16", 16),
    ("BF16", 16),
    ("I32", 32),
    ("U32", 32),
    ("F32", 32),
    ("C64", 64),
    ("F64", 64),
    ("I64", 64),
    ("U64", 64),
];

#[derive(Debug, Clone)]
pub struct Tensor {
    pub name: String,
    pub dtype: String,
    pub shape: Vec<u64>,
}

/// Ways to bend a valid file.
#[derive(Debug, Clone)]
pub enum Twist {
    ShiftBegin(usize, i8),
    ShiftEnd(usize, i8),
    DuplicateName(usize, usize),
    DuplicateField(usize, u8),
    MissingField(usize, u8),
    UnknownField(usize, String),
    /// `["F32", [2], [0, 8]]`: serde accepts a struct written as a sequence.
    SeqForm(usize),
    /// `{"F32": <value>}`: serde accepts a unit enum variant written as a one-key map.
    DtypeAsMap(usize, &'static str),
    RawControlInName(usize),
    NamedMetadata(usize),
    LoneSurrogateInName(usize),
    TrailingData(u8),
    LengthDelta(i8),
    TrailingText(&'static str),
    FlipByte(usize, u8),
    Truncate(usize),
}

#[derive(Debug, Clone)]
pub enum Meta {
    Absent,
    Null,
    Map(Vec<(String, String)>),
    DuplicateKey(Vec<(String, String)>),
    NonString,
}

pub fn name_strategy() -> impl Strategy<Value = String> + Clone {
    let chars = prop::sample::select(vec![
        'a', 'b', '.', '_', '0', '7', '"', '\\', '/', '\u{0}', '\n', '\u{1f}', '\u{7f}', 'é', '\u{2028}', '\u{ffff}',
        '😀', ' ',
    ]);
    prop_oneof![
        4 => (0u32..40, prop::sample::select(vec!["q_proj", "k_proj", "down_proj"]), prop::sample::select(vec!["lora_A.weight", "lora_B.weight", "alpha"]))
            .prop_map(|(l, m, s)| format!("base_model.model.model.layers.{l}.self_attn.{m}.{s}")),
        2 => "[a-z0-9_.]{0,12}",
        2 => prop::collection::vec(chars, 0..8).prop_map(|v| v.into_iter().collect()),
    ]
}

pub fn dtype_strategy() -> impl Strategy<Value = String> {
    prop_oneof![
        80 => prop::sample::select(DTYPES.iter().map(|d| d.0).collect::<Vec<_>>()).prop_map(str::to_owned),
        1 => prop::sample::select(vec!["F8", "bf16", "", "F32 ", "Q4"]).prop_map(str::to_owned),
    ]
}

pub fn shape_strategy() -> impl Strategy<Value = Vec<u64>> {
    let dim =
        prop_oneof![30 => 0u64..4, 15 => Just(8u64), 15 => 1u64..70, 1 => Just(u64::MAX / 3), 1 => Just(1u64 << 40)];
    prop::collection::vec(dim, 0..4)
}

/// A JSON number literal, including ones serde_json rejects as out of range.
pub fn number_strategy() -> impl Strategy<Value = String> {
    prop_oneof![
        prop::sample::select(vec![
            "0",
            "-0",
            "7",
            "-12",
            "1.5",
            "2e3",
            "1E+2",
            "1e-400",
            "0e999999999999",
            "1e308",
            "1.7976931348623157e308",
            "1.7976931348623159e308",
            "1e309",
            "-1e309",
            "18446744073709551615",
            "18446744073709551616",
            "1e2147483648",
            "0.000001e-2147483648",
        ])
        .prop_map(str::to_owned),
        (1usize..400).prop_map(|n| "9".repeat(n)),
        (1usize..330, 0usize..20).prop_map(|(a, b)| format!("{}.{}", "1".repeat(a), "5".repeat(b + 1))),
    ]
}

pub fn json_strategy() -> impl Strategy<Value = String> {
    let leaf = prop_oneof![
        Just("null".to_owned()),
        Just("true".to_owned()),
        Just("false".to_owned()),
        number_strategy(),
        name_strategy().prop_map(|s| render_string(&s, &mut Noise::new(1))),
    ];
    let tree = leaf.prop_recursive(3, 12, 4, |inner| {
        prop_oneof![
            prop::collection::vec(inner.clone(), 0..4).prop_map(|v| format!("[{}]", v.join(","))),
            prop::collection::vec(("[a-z]{0,3}", inner), 0..4).prop_map(|v| {
                let body: Vec<String> = v.iter().map(|(k, x)| format!("\"{k}\":{x}")).collect();
                format!("{{{}}}", body.join(","))
            }),
        ]
    });
    prop_oneof![
        8 => tree,
        // serde_json's recursion limit sits right here (two containers are already open).
        1 => (123usize..129).prop_map(|n| format!("{}{}", "[".repeat(n), "]".repeat(n))),
        1 => (123usize..129).prop_map(|n| format!("{}1{}", "{\"a\":".repeat(n), "}".repeat(n))),
    ]
}

pub fn twist_strategy() -> impl Strategy<Value = Twist> {
    let i = 0usize..8;
    prop_oneof![
        1 => (i.clone(), -2i8..3).prop_map(|(i, d)| Twist::ShiftBegin(i, d)),
        1 => (i.clone(), -2i8..3).prop_map(|(i, d)| Twist::ShiftEnd(i, d)),
        2 => (i.clone(), i.clone()).prop_map(|(a, b)| Twist::DuplicateName(a, b)),
        1 => (i.clone(), 0u8..3).prop_map(|(i, f)| Twist::DuplicateField(i, f)),
        1 => (i.clone(), 0u8..3).prop_map(|(i, f)| Twist::MissingField(i, f)),
        3 => (i.clone(), json_strategy()).prop_map(|(i, v)| Twist::UnknownField(i, v)),
        2 => i.clone().prop_map(Twist::SeqForm),
        1 => (i.clone(), prop::sample::select(vec!["null", "{}", "[]", "1"])).prop_map(|(i, v)| Twist::DtypeAsMap(i, v)),
        1 => i.clone().prop_map(Twist::RawControlInName),
        1 => i.clone().prop_map(Twist::NamedMetadata),
        1 => i.clone().prop_map(Twist::LoneSurrogateInName),
        1 => (1u8..5).prop_map(Twist::TrailingData),
        1 => (-3i8..4).prop_map(Twist::LengthDelta),
        1 => prop::sample::select(vec!["x", ",", "}", " \n\t\r ", "\u{0}", "{}"]).prop_map(Twist::TrailingText),
        1 => (any::<usize>(), any::<u8>()).prop_map(|(p, b)| Twist::FlipByte(p, b)),
        1 => any::<usize>().prop_map(Twist::Truncate),
    ]
}

pub fn meta_strategy() -> impl Strategy<Value = Meta> {
    let pairs = || prop::collection::vec((name_strategy(), name_strategy()), 0..3);
    prop_oneof![
        4 => Just(Meta::Absent),
        1 => Just(Meta::Null),
        4 => pairs().prop_map(Meta::Map),
        1 => pairs().prop_map(Meta::DuplicateKey),
        1 => Just(Meta::NonString),
    ]
}

/// Rendering decisions (whitespace, escapes, field order) from a seed.
pub struct Noise(pub u64);

impl Noise {
    pub fn new(seed: u64) -> Self {
        Noise(seed | 1)
    }

    pub fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }

    pub fn chance(&mut self, one_in: u64) -> bool {
        self.next() % one_in == 0
    }

    pub fn ws(&mut self) -> &'static str {
        if self.chance(4) {
            [" ", "\n", "\t", "\r\n ", "  "][(self.next() % 5) as usize]
        } else {
            ""
        }
    }
}

pub fn render_string(s: &str, noise: &mut Noise) -> String {
    let mut out = String::from("\"");
    // Escapes where none are needed, in one string out of four.
    let odd = if noise.chance(4) { 3 } else { u64::MAX };
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\n' if noise.chance(2) => out.push_str("\\n"),
            '/' if noise.chance(odd) => out.push_str("\\/"),
            c if (c as u32) < 0x20 || noise.chance(odd) => {
                let mut units = [0u16; 2];
                for u in c.encode_utf16(&mut units) {
                    if noise.chance(2) {
                        out.push_str(&format!("\\u{u:04x}"));
                    } else {
                        out.push_str(&format!("\\u{u:04X}"));
                    }
                }
            }
            c => out.push(c),
        }
    }
    out.push('"');
    out
}

pub fn bits(dtype: &str) -> u64 {
    DTYPES.iter().find(|d| d.0 == dtype).map_or(8, |d| d.1)
}

/// Builds the file bytes for `tensors` (JSON order as given, data in `data_order`).
pub fn build(tensors: &[Tensor], data_order: &[usize], meta: &Meta, twists: &[Twist], seed: u64) -> Vec<u8> {
    let mut noise = Noise::new(seed);
    let n = tensors.len();
    let mut offsets = vec![(0u64, 0u64); n];
    let mut at = 0u64;
    for &i in data_order {
        let nelem = tensors[i]
            .shape
            .iter()
            .try_fold(1u64, |a, &d| a.checked_mul(d))
            .unwrap_or(0);
        let size = nelem
            .checked_mul(bits(&tensors[i].dtype))
            .map_or(0, |b| b / 8)
            .min(1 << 12);
        offsets[i] = (at, at + size);
        at += size;
    }
    let data_len = at;
    let mut names: Vec<String> = tensors.iter().map(|t| render_string(&t.name, &mut noise)).collect();
    let mut entries: Vec<Vec<(u8, String)>> = vec![Vec::new(); n];
    let mut seq_form = vec![false; n];
    let mut trailing = String::new();
    let (mut extra_data, mut len_delta, mut flips, mut truncate) = (0u64, 0i64, Vec::new(), None);
    for (i, t) in tensors.iter().enumerate() {
        let shape: Vec<String> = t.shape.iter().map(u64::to_string).collect();
        let sep = |noise: &mut Noise| format!(",{}", noise.ws());
        entries[i] = vec![
            (0, render_string(&t.dtype, &mut noise)),
            (1, format!("[{}]", shape.join(&sep(&mut noise)))),
            (2, format!("[{},{}{}]", offsets[i].0, noise.ws(), offsets[i].1)),
        ];
    }
    for twist in twists {
        let pick = |i: &usize| if n == 0 { None } else { Some(i % n) };
        match twist {
            Twist::ShiftBegin(i, d) | Twist::ShiftEnd(i, d) => {
                let Some(i) = pick(i) else { continue };
                let (mut b, mut e) = offsets[i];
                if matches!(twist, Twist::ShiftBegin(..)) {
                    b = b.saturating_add_signed(i64::from(*d));
                } else {
                    e = e.saturating_add_signed(i64::from(*d));
                }
                offsets[i] = (b, e);
                if let Some(field) = entries[i].iter_mut().find(|e| e.0 == 2) {
                    field.1 = format!("[{b},{e}]");
                }
            }
            Twist::DuplicateName(a, b) => {
                if let (Some(a), Some(b)) = (pick(a), pick(b)) {
                    names[b] = render_string(&tensors[a].name, &mut noise);
                }
            }
            Twist::DuplicateField(i, f) => {
                let Some(i) = pick(i) else { continue };
                if let Some(e) = entries[i].iter().find(|e| e.0 == *f).cloned() {
                    entries[i].push(e);
                }
            }
            Twist::MissingField(i, f) => {
                let Some(i) = pick(i) else { continue };
                entries[i].retain(|e| e.0 != *f);
            }
            Twist::UnknownField(i, v) => {
                let Some(i) = pick(i) else { continue };
                let at = (noise.next() as usize) % (entries[i].len() + 1);
                entries[i].insert(at, (9, v.clone()));
            }
            Twist::SeqForm(i) => {
                if let Some(i) = pick(i) {
                    seq_form[i] = true;
                }
            }
            Twist::DtypeAsMap(i, v) => {
                let Some(i) = pick(i) else { continue };
                if let Some(e) = entries[i].iter_mut().find(|e| e.0 == 0) {
                    e.1 = format!("{{{}:{}{v}}}", e.1, noise.ws());
                }
            }
            Twist::NamedMetadata(i) => {
                if let Some(i) = pick(i) {
                    names[i] = "\"__metadata__\"".to_owned();
                }
            }
            Twist::RawControlInName(i) => {
                if let Some(i) = pick(i) {
                    names[i].insert(1, '\u{1}');
                }
            }
            Twist::LoneSurrogateInName(i) => {
                if let Some(i) = pick(i) {
                    names[i].insert_str(1, ["\\ud800", "\\udc00", "\\ud800\\u0041", "\\uD83D\\uDE00"][i % 4]);
                }
            }
            Twist::TrailingData(k) => extra_data += u64::from(*k),
            Twist::LengthDelta(d) => len_delta += i64::from(*d),
            Twist::TrailingText(t) => trailing.push_str(t),
            Twist::FlipByte(p, b) => flips.push((*p, *b)),
            Twist::Truncate(p) => truncate = Some(*p),
        }
    }
    let mut members: Vec<String> = Vec::new();
    for i in 0..n {
        let value = if seq_form[i] {
            let fields: Vec<&str> = [0u8, 1, 2]
                .iter()
                .filter_map(|f| entries[i].iter().find(|e| e.0 == *f).map(|e| e.1.as_str()))
                .collect();
            format!("[{}]", fields.join(","))
        } else {
            let fields: Vec<String> = entries[i]
                .iter()
                .map(|(f, v)| {
                    let key = ["\"dtype\"", "\"shape\"", "\"data_offsets\"", "\"x\""][usize::from(*f).min(3)];
                    let key = if *f == 1 && noise.chance(5) {
                        "\"sh\\u0061pe\""
                    } else {
                        key
                    };
                    format!("{key}{}:{}{v}", noise.ws(), noise.ws())
                })
                .collect();
            format!("{{{}}}", fields.join(&format!(",{}", noise.ws())))
        };
        members.push(format!("{}{}:{}{value}", names[i], noise.ws(), noise.ws()));
    }
    let meta_json = match meta {
        Meta::Absent => None,
        Meta::Null => Some("null".to_owned()),
        Meta::Map(pairs) | Meta::DuplicateKey(pairs) => {
            let mut pairs = pairs.clone();
            if let (Meta::DuplicateKey(_), Some(first)) = (meta, pairs.first().cloned()) {
                pairs.push(first);
            }
            let body: Vec<String> = pairs
                .iter()
                .map(|(k, v)| format!("{}:{}", render_string(k, &mut noise), render_string(v, &mut noise)))
                .collect();
            Some(format!("{{{}}}", body.join(",")))
        }
        Meta::NonString => Some("{\"k\":1}".to_owned()),
    };
    if let Some(m) = meta_json {
        let at = (noise.next() as usize) % (members.len() + 1);
        members.insert(at, format!("\"__metadata__\":{m}"));
    }
    let mut header = format!(
        "{}{{{}}}{trailing}",
        noise.ws(),
        members.join(&format!(",{}", noise.ws()))
    )
    .into_bytes();
    // Padding to a multiple of 8, as the safetensors serializer writes it.
    if noise.chance(2) {
        header.resize(header.len().next_multiple_of(8), b' ');
    }
    if !header.is_empty() {
        for (p, b) in flips {
            let p = p % header.len();
            header[p] = b;
        }
        if let Some(p) = truncate {
            header.truncate(p % header.len());
        }
    }
    let declared = (header.len() as i64 + len_delta).max(0) as u64;
    let mut file = declared.to_le_bytes().to_vec();
    file.extend_from_slice(&header);
    file.resize(file.len() + (data_len + extra_data) as usize, 0);
    file
}

/// The stage of `read_metadata` that finds an error: the length prefix, UTF-8, JSON and serde,
/// the layout (`validate`), the coverage of the data section.
fn our_stage(code: &str) -> u8 {
    match code {
        "header_too_small" | "header_too_large" | "invalid_header_length" => 0,
        "invalid_utf8" => 1,
        "invalid_json"
        | "header_not_object"
        | "invalid_metadata"
        | "invalid_tensor_entry"
        | "unknown_dtype"
        | "duplicate_key"
        | "duplicate_tensor" => 2,
        "invalid_offset" | "overflow" | "misaligned_slice" | "tensor_size_mismatch" => 3,
        "incomplete_buffer" => 4,
        other => panic!("unknown header error code {other}"),
    }
}

fn their_stage(e: &safetensors::SafeTensorError) -> u8 {
    use safetensors::SafeTensorError as E;
    match e {
        E::HeaderTooSmall | E::HeaderTooLarge | E::InvalidHeaderLength => 0,
        E::InvalidHeader(_) => 1,
        E::InvalidHeaderDeserialization(_) => 2,
        E::InvalidOffset(_) | E::ValidationOverflow | E::MisalignedSlice | E::TensorInvalidInfo => 3,
        E::MetadataIncompleteBuffer => 4,
        other => panic!("read_metadata gave {other:?}"),
    }
}

/// Checks one file against the crate; returns a description of any disagreement. When both
/// reject, the error must come from the stage the crate's does (the rule broken first), except
/// for our extra rules (repeated names or keys), which may come earlier.
pub fn compare(file: &[u8]) -> Result<(), String> {
    let ours = parse_file(file);
    let theirs = SafeTensors::read_metadata(file);
    let extra = |code: &str| matches!(code, "duplicate_tensor" | "duplicate_key");
    match (ours, theirs) {
        (Ok(h), Ok((n, meta))) => agree(&h, n, &meta),
        (Ok(_), Err(e)) => Err(format!("we accept, safetensors rejects: {e:?}")),
        (Err(e), Ok(_)) if extra(e.code()) => Ok(()),
        (Err(e), Ok(_)) => Err(format!("safetensors accepts, we reject with {}: {e}", e.code())),
        (Err(e), Err(t)) => {
            let (ours, theirs) = (our_stage(e.code()), their_stage(&t));
            if ours == theirs || (extra(e.code()) && ours < theirs) {
                Ok(())
            } else {
                Err(format!("we report {} ({e}), safetensors {t:?}", e.code()))
            }
        }
    }
}

pub fn agree(h: &Header<'_>, n: usize, meta: &safetensors::tensor::Metadata) -> Result<(), String> {
    if h.header_size != n as u64 {
        return Err(format!("header size {} vs {n}", h.header_size));
    }
    let theirs = meta.tensors();
    if theirs.len() != h.tensors.len() {
        return Err(format!("{} tensors vs {}", h.tensors.len(), theirs.len()));
    }
    for t in &h.tensors {
        let Some(info) = theirs.get(t.name.as_ref()) else {
            return Err(format!("tensor {:?} missing in safetensors", t.name));
        };
        let shape: Vec<u64> = info.shape.iter().map(|&d| d as u64).collect();
        let offsets = (info.data_offsets.0 as u64, info.data_offsets.1 as u64);
        if format!("{:?}", info.dtype) != t.dtype.name() || shape != h.shape(t) || offsets != (t.begin, t.end) {
            return Err(format!(
                "tensor {:?} differs: {info:?} vs {t:?} {:?}",
                t.name,
                h.shape(t)
            ));
        }
    }
    let ours: Option<HashMap<String, String>> = h
        .metadata
        .as_ref()
        .map(|m| m.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect());
    if &ours != meta.metadata() {
        return Err(format!("metadata {ours:?} vs {:?}", meta.metadata()));
    }
    Ok(())
}

pub fn file_of(header: &str, data: usize) -> Vec<u8> {
    let mut file = (header.len() as u64).to_le_bytes().to_vec();
    file.extend_from_slice(header.as_bytes());
    file.resize(file.len() + data, 0);
    file
}

pub fn case_strategy() -> impl Strategy<Value = (Vec<Tensor>, Vec<usize>, Meta, Vec<Twist>, u64)> {
    let tensor = (name_strategy(), dtype_strategy(), shape_strategy()).prop_map(|(name, dtype, shape)| Tensor {
        name,
        dtype,
        shape,
    });
    prop::collection::vec(tensor, 0..8).prop_flat_map(|tensors| {
        let n = tensors.len();
        let order = Just((0..n).collect::<Vec<usize>>()).prop_shuffle();
        let twists = prop_oneof![3 => Just(Vec::new()), 5 => prop::collection::vec(twist_strategy(), 1..3)];
        (Just(tensors), order, meta_strategy(), twists, any::<u64>())
    })
}
