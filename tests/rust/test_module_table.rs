//! The module table (`_core::report::module_table`) is built in parallel, each distinct classification
//! once. It must equal, row for row and code for code, a plain serial walk over every adapter's
//! modules, whatever the number of threads; and its dictionaries must be in first-appearance order.

mod common;

use std::fs;
use std::path::PathBuf;

use _core::classify::ModuleInfo;
use _core::report::module_table::{ModuleTable, StringColumn};
use _core::scan::{scan_paths, AdapterResult, ScanOptions};

/// A fleet with repeated headers (shared classifications), headers that differ only in tensor
/// order, configs with and without rsLoRA and alpha, a file that fails, and a file whose
/// tensors make no module.
fn fleet() -> PathBuf {
    let dir = std::env::temp_dir().join(format!("lorafast-module-table-{}", std::process::id()));
    let _ = fs::remove_dir_all(&dir);
    fs::create_dir_all(&dir).unwrap();
    for i in 0..60usize {
        let folder = dir.join(format!("a{i:03}"));
        fs::create_dir_all(&folder).unwrap();
        let rank = [4u64, 8, 16][i % 3];
        let mut tensors = Vec::new();
        for layer in 0..(1 + i % 4) {
            for module in ["q_proj", "v_proj", "down_proj"] {
                let key = format!("base_model.model.model.layers.{layer}.self_attn.{module}");
                // Six dtypes: a module key with more string variants than the table remembers per key.
                let dtype = ["BF16", "F16", "F32", "F64", "F8_E4M3", "F8_E5M2"][i % 6];
                tensors.push((format!("{key}.lora_A.weight"), dtype.to_string(), vec![rank, 64]));
                tensors.push((format!("{key}.lora_B.weight"), dtype.to_string(), vec![32, rank]));
            }
        }
        if i % 5 == 0 {
            tensors.reverse(); // same modules, a header no other adapter has
        }
        fs::write(
            folder.join("adapter_model.safetensors"),
            common::adapters::file_of(&tensors, None),
        )
        .unwrap();
        let config = match i % 4 {
            0 => format!(r#"{{"peft_type":"LORA","r":{rank},"lora_alpha":16,"use_rslora":true}}"#),
            1 => format!(r#"{{"peft_type":"LORA","r":{rank},"lora_alpha":32,"rank_pattern":{{"v_proj":2}}}}"#),
            2 => r#"{"peft_type":"LORA"}"#.to_string(),
            _ => continue,
        };
        fs::write(folder.join("adapter_config.json"), config).unwrap();
    }
    fs::write(dir.join("broken.safetensors"), b"not a safetensors file").unwrap();
    let junk = vec![("junk".to_string(), "F32".to_string(), vec![1])];
    fs::write(dir.join("junk.safetensors"), common::adapters::file_of(&junk, None)).unwrap();
    dir
}

/// One row as the table holds it: strings decoded, numbers as options.
type Row = (u32, [Option<String>; 7], Vec<Option<f64>>, f64, bool);

fn expected(rows: &[Result<AdapterResult, _core::error::Error>]) -> Vec<Row> {
    let mut out = Vec::new();
    for (i, r) in rows.iter().enumerate() {
        let Ok(a) = r else { continue };
        for m in a.class.modules.iter() {
            let m: ModuleInfo<'_> = m;
            let strings = [
                Some(m.name),
                Some(m.key),
                Some(m.leaf),
                Some(m.kind.name()),
                m.dtype.map(|d| d.name()),
                m.a_key,
                m.b_key,
            ]
            .map(|s| s.map(str::to_string));
            let numbers = vec![
                m.layer.map(f64::from),
                m.expert.map(f64::from),
                m.num_experts.map(|v| v as f64),
                m.rank.map(|v| v as f64),
                m.in_features.map(|v| v as f64),
                m.out_features.map(|v| v as f64),
                m.config_rank.map(|v| v as f64),
                m.alpha,
            ];
            let scale = match (m.alpha, m.rank) {
                (Some(alpha), Some(rank)) if rank > 0 => {
                    alpha
                        / if m.use_rslora {
                            (rank as f64).sqrt()
                        } else {
                            rank as f64
                        }
                }
                _ => 1.0,
            };
            out.push((i as u32, strings, numbers, scale, m.use_rslora));
        }
    }
    out
}

fn decoded(t: &ModuleTable<'_>) -> Vec<Row> {
    let string = |c: &StringColumn<'_>, i: usize| {
        let code = t.get(&c.codes)[i];
        (code >= 0).then(|| c.names[code as usize].to_string())
    };
    let opt = |values: f64, valid: bool| valid.then_some(values);
    let (layer, layer_ok) = (t.get(&t.layer.values), t.get(&t.layer.valid));
    let (expert, expert_ok) = (t.get(&t.expert.values), t.get(&t.expert.valid));
    let (alpha, alpha_ok) = (t.get(&t.alpha.values), t.get(&t.alpha.valid));
    (0..t.len())
        .map(|i| {
            let mut numbers = vec![
                opt(f64::from(layer[i]), layer_ok[i]),
                opt(f64::from(expert[i]), expert_ok[i]),
            ];
            // The table's order is num_experts, rank, in_features, out_features, config_rank.
            numbers.extend(
                t.numbers
                    .iter()
                    .map(|c| opt(t.get(&c.values)[i] as f64, t.get(&c.valid)[i])),
            );
            numbers.push(opt(alpha[i], alpha_ok[i]));
            let strings = std::array::from_fn(|k| string(&t.strings[k], i));
            (
                t.get(&t.row)[i],
                strings,
                numbers,
                t.get(&t.scale)[i],
                t.get(&t.use_rslora)[i],
            )
        })
        .collect()
}

#[test]
fn module_table_equals_a_serial_walk_on_any_number_of_threads() {
    let dir = fleet();
    let opts = ScanOptions {
        keep_modules: true,
        ..ScanOptions::default()
    };
    let rows = scan_paths(std::slice::from_ref(&dir), true, opts, Some(2), false);
    assert_eq!(
        rows.iter().filter(|r| r.is_err()).count(),
        1,
        "broken.safetensors fails"
    );
    let want = expected(&rows);
    assert!(want.len() > 300, "{} modules", want.len());
    assert!(
        want.iter().any(|r| r.4) && want.iter().any(|r| r.2[7].is_none()),
        "rsLoRA and alpha-less modules"
    );
    let mut tables = Vec::new();
    for threads in [1, 2, 5] {
        let pool = rayon::ThreadPoolBuilder::new().num_threads(threads).build().unwrap();
        let table = pool.install(|| ModuleTable::build(&rows)).unwrap();
        assert_eq!(decoded(&table), want, "{threads} threads");
        // Dictionaries in first-appearance order: each code is at most one more than any before it.
        for col in &table.strings {
            let mut next = 0;
            for &c in table.get(&col.codes) {
                assert!(c < next + 1, "code {c} before {next}");
                next = next.max(c + 1);
            }
            assert_eq!(next as usize, col.names.len());
        }
        let strings = table.strings.each_ref().map(|c| {
            (
                table.get(&c.codes).to_vec(),
                c.names.iter().map(|s| s.to_string()).collect::<Vec<_>>(),
            )
        });
        tables.push(strings);
    }
    assert!(
        tables.windows(2).all(|w| w[0] == w[1]),
        "same codes and dictionaries on 1, 2 and 5 threads"
    );
    fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn module_table_of_no_modules_is_empty() {
    let rows: Vec<Result<AdapterResult, _core::error::Error>> = Vec::new();
    let table = ModuleTable::build(&rows).unwrap();
    assert!(table.is_empty() && table.get(&table.scale).is_empty());
    assert!(table
        .strings
        .iter()
        .all(|c| table.get(&c.codes).is_empty() && c.names.is_empty()));
}
