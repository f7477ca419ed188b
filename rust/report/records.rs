//! A scan report's summary records as the JSON text Python's `json.dumps` writes for their dicts
//! (`ScanReport.to_json`), written on the scan's threads without a Python object per record.

use std::os::unix::ffi::OsStrExt;
use std::path::Path;

use rayon::prelude::*;

use crate::codes::Flag;
use crate::scan::AdapterResult;

/// Between two records of a list.
const SEP: &str = ", ";

/// `s` as Python's `json.dumps` writes a str (ensure_ascii): `bytes` that are not UTF-8 stand for
/// the lone surrogates `os.fsdecode` makes of them (U+DC80 + byte).
fn json_str_bytes(out: &mut String, bytes: &[u8]) {
    use std::fmt::Write;
    out.push('"');
    for chunk in bytes.utf8_chunks() {
        for c in chunk.valid().chars() {
            match c {
                '"' => out.push_str("\\\""),
                '\\' => out.push_str("\\\\"),
                '\n' => out.push_str("\\n"),
                '\r' => out.push_str("\\r"),
                '\t' => out.push_str("\\t"),
                '\u{8}' => out.push_str("\\b"),
                '\u{c}' => out.push_str("\\f"),
                ' '..='~' => out.push(c),
                _ => {
                    let mut units = [0u16; 2];
                    for u in c.encode_utf16(&mut units) {
                        let _ = write!(out, "\\u{u:04x}");
                    }
                }
            }
        }
        for b in chunk.invalid() {
            let _ = write!(out, "\\u{:04x}", 0xdc00 + u16::from(*b));
        }
    }
    out.push('"');
}

fn json_str(out: &mut String, s: &str) {
    json_str_bytes(out, s.as_bytes());
}

fn json_opt_str(out: &mut String, s: Option<&str>) {
    match s {
        Some(s) => json_str(out, s),
        None => out.push_str("null"),
    }
}

fn json_list<T>(out: &mut String, items: impl IntoIterator<Item = T>, mut each: impl FnMut(&mut String, T)) {
    out.push('[');
    for (i, item) in items.into_iter().enumerate() {
        if i > 0 {
            out.push_str(", ");
        }
        each(out, item);
    }
    out.push(']');
}

/// One record of `ScanResult.records` (less `config_json`), as `json.dumps` writes its dict.
pub fn record_json(out: &mut String, r: &AdapterResult) {
    use std::fmt::Write;
    let c = &r.class;
    let path = |out: &mut String, p: &Path| json_str_bytes(out, p.as_os_str().as_bytes());
    out.push_str("{\"path\": ");
    path(out, &r.target.path);
    out.push_str(", \"weight_files\": [");
    path(out, &r.target.weights);
    out.push_str("], \"config_path\": ");
    match &r.target.config {
        Some(p) => path(out, p),
        None => out.push_str("null"),
    }
    out.push_str(", \"format\": ");
    json_str(out, c.format.code());
    out.push_str(", \"peft_type\": ");
    json_opt_str(out, c.peft_type.as_deref());
    let _ = write!(out, ", \"num_tensors\": {}, \"dtypes\": ", c.num_tensors);
    json_list(out, &c.dtypes, |o, d| json_str(o, d.name()));
    out.push_str(", \"layers\": ");
    json_list(out, &c.layers, |o, l| {
        let _ = write!(o, "{l}");
    });
    out.push_str(", \"base_model_name_or_path\": ");
    json_opt_str(out, c.base_model.as_deref());
    out.push_str(", \"target_modules\": ");
    json_list(out, &c.target_modules, |o, t| json_str(o, t));
    let _ = write!(out, ", \"rank\": {}, \"moe_layout\": ", c.rank);
    json_str(out, c.moe_layout.code());
    let _ = write!(out, ", \"num_experts\": {}, \"flags\": ", c.num_experts);
    json_list(out, Flag::set_in(c.flags), |o, f| json_str(o, f.code()));
    out.push_str(", \"variants\": ");
    json_list(out, &c.variants, |o, v| json_str(o, v.name()));
    out.push_str(", \"full_weight_tensors\": ");
    json_list(out, &c.full_weight_tensors, |o, t| json_str(o, t));
    out.push_str(", \"problems\": ");
    json_list(out, &c.problems, |o, p| {
        o.push('[');
        json_str(o, p.code.code());
        o.push_str(", ");
        json_str(o, &p.message);
        o.push_str(", ");
        json_opt_str(o, p.tensor.as_deref());
        o.push(']');
    });
    out.push_str(", \"content_hash\": ");
    json_opt_str(out, r.content_hash.as_deref());
    out.push_str(", \"metadata\": ");
    match &r.metadata {
        None => out.push_str("null"),
        Some(m) => {
            out.push('{');
            for (i, (k, v)) in m.iter().enumerate() {
                if i > 0 {
                    out.push_str(", ");
                }
                json_str(out, k);
                out.push_str(": ");
                json_str(out, v);
            }
            out.push('}');
        }
    }
    let _ = write!(
        out,
        ", \"header_size\": {}, \"file_size\": {}}}",
        r.header_size, r.file_size
    );
}

/// The records of `rows` joined by ", ": a JSON list's text less its brackets.
pub fn records_text(rows: &[&AdapterResult]) -> String {
    let mut out = String::new();
    for (i, a) in rows.iter().enumerate() {
        if i > 0 {
            out.push_str(SEP);
        }
        record_json(&mut out, a);
    }
    out
}

/// Each record's length as `record_json` writes it, in parallel on the caller's pool.
pub fn record_lengths(rows: &[&AdapterResult]) -> Vec<usize> {
    rows.par_iter()
        .map_init(String::new, |buf, a| {
            buf.clear();
            record_json(buf, a);
            buf.len()
        })
        .collect()
}

/// The length of records of `lens` joined by ", ".
pub fn joined_len(lens: &[usize]) -> usize {
    lens.iter().sum::<usize>() + SEP.len() * lens.len().saturating_sub(1)
}

/// Writes `records_text(rows)` into `out`, in parallel on the caller's pool, each record into its own
/// part; `lens` are `record_lengths(rows)` and `out` is `joined_len(lens)` bytes long.
pub fn write_records(rows: &[&AdapterResult], lens: &[usize], out: &mut [u8]) {
    assert_eq!(out.len(), joined_len(lens), "write_records: the text's length");
    let mut parts: Vec<&mut [u8]> = Vec::with_capacity(rows.len());
    let mut body = out;
    for (i, len) in lens.iter().enumerate() {
        let (part, more) = body.split_at_mut(len + if i > 0 { SEP.len() } else { 0 });
        parts.push(part);
        body = more;
    }
    rows.par_iter()
        .zip(parts)
        .enumerate()
        .for_each_init(String::new, |buf, (i, (a, part))| {
            buf.clear();
            if i > 0 {
                buf.push_str(SEP);
            }
            record_json(buf, a);
            // The same record written the same way: the length cannot differ.
            part.copy_from_slice(buf.as_bytes());
        });
}

#[cfg(test)]
mod tests {
    use std::ffi::OsStr;

    use super::*;
    use crate::scan::{load, ScanOptions, Target};

    #[test]
    fn strings_are_escaped_as_json_dumps_escapes_them() {
        let mut out = String::new();
        json_str_bytes(&mut out, b"a\"\\\n\t\x01\xff\xc3\xa9\xf0\x9f\x98\x80");
        assert_eq!(out, r#""a\"\\\n\t\u0001\udcff\u00e9\ud83d\ude00""#);
    }

    /// A one-adapter file under a folder whose name is not UTF-8.
    fn adapter(dir: &Path, name: &str) -> AdapterResult {
        let path = dir.join(name);
        let header = br#"{"__metadata__":{"k":"v\u00e9"},"m.lora_A.weight":{"dtype":"F32","shape":[1,1],"data_offsets":[0,4]},"m.lora_B.weight":{"dtype":"F32","shape":[1,1],"data_offsets":[4,8]}}"#;
        let mut bytes = (header.len() as u64).to_le_bytes().to_vec();
        bytes.extend_from_slice(header);
        bytes.extend_from_slice(&[0; 8]);
        std::fs::write(&path, bytes).unwrap();
        let target = Target {
            path: path.clone(),
            weights: path,
            config: None,
        };
        let opts = ScanOptions {
            keep_modules: true,
            ..ScanOptions::default()
        };
        load(target, opts).unwrap()
    }

    #[test]
    fn records_are_json_and_written_in_parallel_as_in_series() {
        let dir = std::env::temp_dir().join(format!("lorafast-records-{}", std::process::id()));
        let dir = dir.join(OsStr::from_bytes(b"not-utf8-\xff"));
        std::fs::create_dir_all(&dir).unwrap();
        let rows: Vec<AdapterResult> = ["a.safetensors", "b.safetensors", "c.safetensors"]
            .iter()
            .map(|n| adapter(&dir, n))
            .collect();
        let rows: Vec<&AdapterResult> = rows.iter().collect();
        let text = records_text(&rows);
        // serde_json refuses lone surrogates, which Python's json reads back as the path's bytes.
        assert!(text.contains(r"not-utf8-\udcff/a.safetensors"), "{text}");
        let list = format!("[{}]", text.replace(r"\udcff", "?"));
        let list: serde_json::Value = serde_json::from_str(&list).unwrap();
        let first = &list[0];
        let keys: Vec<&str> = first.as_object().unwrap().keys().map(String::as_str).collect();
        assert_eq!(keys[..3], ["path", "weight_files", "config_path"]);
        assert_eq!(keys.last(), Some(&"file_size"));
        assert!(first["path"].as_str().unwrap().ends_with("not-utf8-?/a.safetensors"));
        assert_eq!(first["metadata"]["k"], "v\u{e9}");
        assert_eq!(first["format"], "peft");
        assert!(text.is_ascii());
        let lens = record_lengths(&rows);
        let mut out = vec![0u8; joined_len(&lens)];
        write_records(&rows, &lens, &mut out);
        assert_eq!(String::from_utf8(out).unwrap(), text);
        std::fs::remove_dir_all(dir.parent().unwrap()).unwrap();
    }
}
