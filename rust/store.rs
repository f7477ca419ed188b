//! Scan rows as bytes and back, for the persistent index (`lorafast.Index`): a row keeps its own
//! fields (paths, config text, metadata, sizes) and names its classification by the sha256 of that
//! classification's encoding, so the adapters of one recipe store their modules once. Decoding gives
//! the `AdapterResult` (or error) the scan had: a report assembled from stored rows equals a full scan.
//!
//! The encoding is JSON (serde_json). Paths are strings when they are UTF-8, else arrays of bytes. Class ids
//! (a sha256 of the class's encoding) are computed by the caller (`lorafast.index`, with `hashlib`).

use std::ffi::OsString;
use std::os::unix::ffi::{OsStrExt, OsStringExt};
use std::path::{Path, PathBuf};
use std::sync::Arc;

use serde_json::{json, Value};

use crate::classify::{Classification, Format, ModuleInfo, ModuleKind, Modules, MoeLayout, Problem};
use crate::codes::{ErrorCode, ProblemCode};
use crate::error::Error;
use crate::header::Dtype;
use crate::names::Variant;
use crate::scan::{AdapterResult, Target};

/// Bumped when the encoding changes: rows of another version are read again.
pub const VERSION: u32 = 1;

const FORMATS: [Format; 8] = [
    Format::Peft,
    Format::Diffusers,
    Format::DiffusersLegacy,
    Format::Kohya,
    Format::Lycoris,
    Format::Xlabs,
    Format::AiToolkit,
    Format::Unknown,
];

const LAYOUTS: [MoeLayout; 6] = [
    MoeLayout::Dense,
    MoeLayout::PerExpert2d,
    MoeLayout::Stacked3d,
    MoeLayout::SharedOuter,
    MoeLayout::PeftTargetParameters,
    MoeLayout::Mixed,
];

fn bad(what: &str) -> String {
    format!("stored row: bad {what}")
}

fn path_value(p: &Path) -> Value {
    match p.to_str() {
        Some(s) => Value::from(s),
        None => Value::from(p.as_os_str().as_bytes().to_vec()),
    }
}

fn value_path(v: &Value) -> Result<PathBuf, String> {
    match v {
        Value::String(s) => Ok(PathBuf::from(s)),
        Value::Array(a) => {
            let bytes = a
                .iter()
                .map(|b| b.as_u64().and_then(|b| u8::try_from(b).ok()))
                .collect::<Option<Vec<u8>>>()
                .ok_or_else(|| bad("path"))?;
            Ok(PathBuf::from(OsString::from_vec(bytes)))
        }
        _ => Err(bad("path")),
    }
}

/// Writes `$v` as JSON into the `Vec<u8>` `$buf` (serde; no intermediate `Value`).
macro_rules! put {
    ($buf:expr, $v:expr) => {
        serde_json::to_writer(&mut *$buf, &$v).expect("JSON of plain data")
    };
}

/// The encoding of a classification (the part adapters of one recipe share). Written field by field:
/// a dense adapter has hundreds of modules, and building a `Value` tree first cost most of the time.
pub fn encode_class(c: &Classification) -> Vec<u8> {
    let head = json!({
        "format": c.format.name(),
        "peft_type": c.peft_type,
        "num_tensors": c.num_tensors,
        "dtypes": c.dtypes.iter().map(|d| d.name()).collect::<Vec<_>>(),
        "layers": c.layers,
        "base_model": c.base_model,
        "target_modules": c.target_modules,
        "rank": c.rank,
        "moe_layout": c.moe_layout.name(),
        "num_experts": c.num_experts,
        "flags": c.flags,
        "variants": c.variants.iter().map(|v| v.name()).collect::<Vec<_>>(),
        "full_weight_tensors": c.full_weight_tensors,
        "problems": c.problems.iter().map(|p| json!([p.code.code(), p.message, p.tensor])).collect::<Vec<_>>(),
    });
    let mut out = serde_json::to_vec(&head).expect("JSON of plain data");
    out.pop(); // the closing brace: the modules follow
    out.extend_from_slice(b",\"modules\":[");
    let buf = &mut out;
    for (i, m) in c.modules.iter().enumerate() {
        if i > 0 {
            buf.push(b',');
        }
        buf.push(b'[');
        put!(buf, m.key);
        buf.push(b',');
        put!(buf, m.name);
        buf.push(b',');
        put!(buf, m.leaf);
        buf.push(b',');
        put!(buf, m.kind.name());
        buf.push(b',');
        put!(buf, m.layer);
        buf.push(b',');
        put!(buf, m.expert);
        buf.push(b',');
        put!(buf, m.num_experts);
        buf.push(b',');
        put!(buf, m.rank);
        buf.push(b',');
        put!(buf, m.in_features);
        buf.push(b',');
        put!(buf, m.out_features);
        buf.push(b',');
        put!(buf, m.dtype.map(Dtype::name));
        buf.push(b',');
        put!(buf, m.a_key);
        buf.push(b',');
        put!(buf, m.b_key);
        buf.push(b',');
        put!(buf, m.a_shape);
        buf.push(b',');
        put!(buf, m.b_shape);
        buf.push(b',');
        put!(buf, m.alpha.map(f64::to_bits));
        buf.push(b',');
        put!(buf, m.alpha_key);
        buf.push(b',');
        put!(buf, m.bias_key);
        buf.push(b',');
        put!(buf, m.magnitude_key);
        buf.push(b',');
        put!(buf, m.extra_keys);
        buf.push(b',');
        put!(buf, m.config_rank);
        buf.push(b',');
        put!(buf, m.use_rslora);
        buf.push(b']');
    }
    buf.extend_from_slice(b"]}");
    out
}

/// The encoding of one row, without its classification (stored apart, see `encode_class`).
pub fn encode_row(row: &Result<AdapterResult, Error>) -> Vec<u8> {
    let v = match row {
        Ok(a) => json!({
            "v": VERSION,
            "path": path_value(&a.target.path),
            "weights": path_value(&a.target.weights),
            "config": a.target.config.as_deref().map(path_value),
            "config_json": a.config_json,
            "metadata": a.metadata,
            "header_size": a.header_size,
            "file_size": a.file_size,
            "content_hash": a.content_hash,
        }),
        Err(e) => json!({
            "v": VERSION,
            "error": [path_value(e.path()), e.code(), e.detail()],
        }),
    };
    serde_json::to_vec(&v).unwrap_or_default()
}

fn get<'a>(v: &'a Value, key: &str) -> &'a Value {
    v.get(key).unwrap_or(&Value::Null)
}

fn opt_str(v: &Value) -> Result<Option<String>, String> {
    match v {
        Value::Null => Ok(None),
        Value::String(s) => Ok(Some(s.clone())),
        _ => Err(bad("string")),
    }
}

/// A string borrowed from `v` (None for null).
fn opt_text(v: &Value) -> Result<Option<&str>, String> {
    match v {
        Value::Null => Ok(None),
        Value::String(s) => Ok(Some(s)),
        _ => Err(bad("string")),
    }
}

/// A string borrowed from `v`.
fn text(v: &Value) -> Result<&str, String> {
    opt_text(v)?.ok_or_else(|| bad("string"))
}

fn string(v: &Value) -> Result<String, String> {
    opt_str(v)?.ok_or_else(|| bad("string"))
}

fn opt_u64(v: &Value) -> Result<Option<u64>, String> {
    match v {
        Value::Null => Ok(None),
        v => v.as_u64().map(Some).ok_or_else(|| bad("number")),
    }
}

fn u64_of(v: &Value) -> Result<u64, String> {
    opt_u64(v)?.ok_or_else(|| bad("number"))
}

fn opt_u32(v: &Value) -> Result<Option<u32>, String> {
    opt_u64(v)?
        .map(|n| u32::try_from(n).map_err(|_| bad("number")))
        .transpose()
}

fn array(v: &Value) -> Result<&Vec<Value>, String> {
    v.as_array().ok_or_else(|| bad("list"))
}

fn strings(v: &Value) -> Result<Vec<String>, String> {
    array(v)?.iter().map(string).collect()
}

fn opt_shape(v: &Value) -> Result<Option<Vec<u64>>, String> {
    match v {
        Value::Null => Ok(None),
        v => array(v)?.iter().map(u64_of).collect::<Result<_, _>>().map(Some),
    }
}

fn by_name<T: Copy>(items: impl IntoIterator<Item = T>, name: fn(T) -> &'static str, v: &Value) -> Result<T, String> {
    let s = v.as_str().ok_or_else(|| bad("name"))?;
    items.into_iter().find(|t| name(*t) == s).ok_or_else(|| bad(s))
}

/// Decodes a classification written by `encode_class`.
pub fn decode_class(bytes: &[u8]) -> Result<Classification, String> {
    let v: Value = serde_json::from_slice(bytes).map_err(|e| bad(&e.to_string()))?;
    let dtype =
        |v: &Value| -> Result<Dtype, String> { v.as_str().and_then(Dtype::from_name).ok_or_else(|| bad("dtype")) };
    let mut modules = Modules::default();
    for m in array(get(&v, "modules"))? {
        let f = array(m)?;
        if f.len() != 22 {
            return Err(bad("module"));
        }
        let (a_shape, b_shape) = (opt_shape(&f[13])?, opt_shape(&f[14])?);
        modules.push(&ModuleInfo {
            key: text(&f[0])?,
            name: text(&f[1])?,
            leaf: text(&f[2])?,
            kind: by_name(ModuleKind::all(), ModuleKind::name, &f[3])?,
            layer: opt_u32(&f[4])?,
            expert: opt_u32(&f[5])?,
            num_experts: opt_u64(&f[6])?,
            rank: opt_u64(&f[7])?,
            in_features: opt_u64(&f[8])?,
            out_features: opt_u64(&f[9])?,
            dtype: match &f[10] {
                Value::Null => None,
                d => Some(dtype(d)?),
            },
            a_key: opt_text(&f[11])?,
            b_key: opt_text(&f[12])?,
            a_shape: a_shape.as_deref(),
            b_shape: b_shape.as_deref(),
            alpha: opt_u64(&f[15])?.map(f64::from_bits),
            alpha_key: opt_text(&f[16])?,
            bias_key: opt_text(&f[17])?,
            magnitude_key: opt_text(&f[18])?,
            extra_keys: array(&f[19])?.iter().map(text).collect::<Result<_, _>>()?,
            config_rank: opt_u64(&f[20])?,
            use_rslora: f[21].as_bool().ok_or_else(|| bad("bool"))?,
        });
    }
    let problems = array(get(&v, "problems"))?
        .iter()
        .map(|p| {
            let f = array(p)?;
            if f.len() != 3 {
                return Err(bad("problem"));
            }
            let code = string(&f[0])?;
            Ok(Problem {
                code: ProblemCode::from_code(&code).ok_or_else(|| bad("problem code"))?,
                message: string(&f[1])?,
                tensor: opt_str(&f[2])?,
            })
        })
        .collect::<Result<_, String>>()?;
    Ok(Classification {
        format: by_name(FORMATS, Format::name, get(&v, "format"))?,
        peft_type: opt_str(get(&v, "peft_type"))?,
        num_tensors: opt_u32(get(&v, "num_tensors"))?.ok_or_else(|| bad("num_tensors"))?,
        dtypes: array(get(&v, "dtypes"))?.iter().map(dtype).collect::<Result<_, _>>()?,
        layers: array(get(&v, "layers"))?
            .iter()
            .map(|l| opt_u32(l)?.ok_or_else(|| bad("layer")))
            .collect::<Result<_, _>>()?,
        base_model: opt_str(get(&v, "base_model"))?,
        target_modules: strings(get(&v, "target_modules"))?,
        rank: u64_of(get(&v, "rank"))?,
        moe_layout: by_name(LAYOUTS, MoeLayout::name, get(&v, "moe_layout"))?,
        num_experts: u64_of(get(&v, "num_experts"))?,
        flags: opt_u32(get(&v, "flags"))?.ok_or_else(|| bad("flags"))?,
        variants: array(get(&v, "variants"))?
            .iter()
            .map(|x| by_name(Variant::ALL, Variant::name, x))
            .collect::<Result<_, _>>()?,
        full_weight_tensors: strings(get(&v, "full_weight_tensors"))?,
        problems,
        modules: Arc::new(modules),
        duplicate_tensor: None,
    })
}

/// Decodes a row written by `encode_row`; `class` gives its classification (called for a successful row).
pub fn decode_row(
    bytes: &[u8],
    class: impl FnOnce() -> Result<Classification, String>,
) -> Result<Result<AdapterResult, Error>, String> {
    let v: Value = serde_json::from_slice(bytes).map_err(|e| bad(&e.to_string()))?;
    if get(&v, "v").as_u64() != Some(u64::from(VERSION)) {
        return Err(bad("version"));
    }
    if let Some(e) = v.get("error") {
        let f = array(e)?;
        if f.len() != 3 {
            return Err(bad("error"));
        }
        let code = ErrorCode::from_code(&string(&f[1])?).ok_or_else(|| bad("error code"))?;
        return Ok(Err(Error::adapter(value_path(&f[0])?, code, string(&f[2])?)));
    }
    let metadata = match get(&v, "metadata") {
        Value::Null => None,
        m => Some(
            array(m)?
                .iter()
                .map(|kv| match kv.as_array().map(Vec::as_slice) {
                    Some([k, v]) => Ok((string(k)?, string(v)?)),
                    _ => Err(bad("metadata")),
                })
                .collect::<Result<Vec<_>, String>>()?,
        ),
    };
    let config = match get(&v, "config") {
        Value::Null => None,
        c => Some(value_path(c)?),
    };
    Ok(Ok(AdapterResult {
        target: Target {
            path: value_path(get(&v, "path"))?,
            weights: value_path(get(&v, "weights"))?,
            config,
        },
        config_json: opt_str(get(&v, "config_json"))?,
        metadata,
        header_size: u64_of(get(&v, "header_size"))?,
        file_size: u64_of(get(&v, "file_size"))?,
        class: class()?,
        content_hash: opt_str(get(&v, "content_hash"))?,
    }))
}
