//! A scan report's module table: one row per module of every successful adapter, as columns, built
//! on the scan's threads (the caller releases the GIL).
//!
//! Adapters whose headers repeat share one classification (the memo's `Arc<Modules>`), so the work
//! is split in two: each distinct classification is turned into rows once (its strings interned,
//! its numbers read), in parallel over the distinct ones; then every adapter's rows are written, in
//! parallel over row ranges, by copying its classification's. Repeated strings come out as
//! dictionary codes in first-appearance order, as a serial walk over the rows gives them.
//!
//! The columns are tens of megabytes written once (224,000 modules: 25 MB). Their first touch, a
//! page fault per 4 KiB, was most of the time of building them, so they ask for transparent huge
//! pages where the kernel offers them on request.

use std::ops::Range;
use std::sync::Arc;

use rayon::prelude::*;
use rustc_hash::FxHashMap;

use crate::classify::{ModuleInfo, Modules};
use crate::error::Error;
use crate::header::Dtype;
use crate::scan::AdapterResult;

/// The string columns, in the order of `ModuleTable::strings`.
pub const STRING_COLUMNS: [&str; 7] = ["name", "key", "leaf", "kind", "dtype", "a_key", "b_key"];
/// The nullable whole-number columns, in the order of `ModuleTable::numbers`.
pub const NUMBER_COLUMNS: [&str; 5] = ["num_experts", "rank", "in_features", "out_features", "config_rank"];

/// A string column: a code per row (-1: null) into its distinct values.
pub struct StringColumn<'r> {
    /// A code per row, -1 for null.
    pub codes: Vec<i32>,
    /// The distinct values, in first-appearance order.
    pub names: Vec<&'r str>,
}

/// A nullable number column: values (0 where null) and a validity mask.
pub struct Nullable<T> {
    /// A value per row, 0 where null.
    pub values: Vec<T>,
    /// Whether each row's value is there.
    pub valid: Vec<bool>,
}

impl<T: Default> Nullable<T> {
    /// An empty column with room for `n` rows.
    pub fn with_capacity(n: usize) -> Self {
        Nullable {
            values: Vec::with_capacity(n),
            valid: Vec::with_capacity(n),
        }
    }

    /// Appends a row.
    pub fn push(&mut self, v: Option<T>) {
        self.valid.push(v.is_some());
        self.values.push(v.unwrap_or_default());
    }
}

/// The module table's columns.
pub struct ModuleTable<'r> {
    /// The adapter's row in the report.
    pub row: Vec<u32>,
    /// The columns of `STRING_COLUMNS`.
    pub strings: [StringColumn<'r>; 7],
    /// The layer index.
    pub layer: Nullable<u32>,
    /// The expert index.
    pub expert: Nullable<u32>,
    /// The columns of `NUMBER_COLUMNS`.
    pub numbers: [Nullable<u64>; 5],
    /// The module's alpha.
    pub alpha: Nullable<f64>,
    /// `LoraModule.scale`: alpha / rank (alpha / sqrt(rank) with rsLoRA), 1.0 when either is unknown.
    pub scale: Vec<f64>,
    /// Whether the scale is alpha / sqrt(rank).
    pub use_rslora: Vec<bool>,
}

/// One module's values but its strings.
#[derive(Clone, Copy, Default)]
struct Values {
    layer: Option<u32>,
    expert: Option<u32>,
    numbers: [Option<u64>; 5],
    alpha: Option<f64>,
    scale: f64,
    use_rslora: bool,
}

impl Values {
    fn of(m: &ModuleInfo<'_>) -> Self {
        let scale = match (m.alpha, m.rank) {
            (Some(alpha), Some(rank)) if rank > 0 => {
                let rank = rank as f64;
                alpha / if m.use_rslora { rank.sqrt() } else { rank }
            }
            _ => 1.0,
        };
        Values {
            layer: m.layer,
            expert: m.expert,
            numbers: [m.num_experts, m.rank, m.in_features, m.out_features, m.config_rank],
            alpha: m.alpha,
            scale,
            use_rslora: m.use_rslora,
        }
    }
}

fn strings<'m>(m: &ModuleInfo<'m>) -> [Option<&'m str>; 7] {
    [
        Some(m.name),
        Some(m.key),
        Some(m.leaf),
        Some(m.kind.name()),
        m.dtype.map(Dtype::name),
        m.a_key,
        m.b_key,
    ]
}

/// One distinct classification's rows: string codes (into its group's dictionaries until `remap`,
/// then the table's), and its values when more than one adapter uses it (else they are read from
/// the modules where they are written).
struct ClassRows {
    codes: Vec<[i32; 7]>,
    values: Option<Vec<Values>>,
}

/// A group of distinct classifications interned together, with its own dictionaries.
struct Group<'r> {
    classes: Range<usize>,
    rows: Vec<ClassRows>,
    names: [Vec<&'r str>; 7],
}

fn intern_group<'r>(classes: &[&'r Modules], uses: &[u32], range: Range<usize>) -> Group<'r> {
    let mut index: [FxHashMap<&'r str, i32>; 7] = Default::default();
    let mut names: [Vec<&'r str>; 7] = Default::default();
    let rows = range
        .clone()
        .map(|c| {
            let modules = classes[c];
            let mut codes = Vec::with_capacity(modules.len());
            let mut values = (uses[c] > 1).then(|| Vec::with_capacity(modules.len()));
            for m in modules.iter() {
                let mut row = [-1i32; 7];
                for (k, s) in strings(&m).into_iter().enumerate() {
                    if let Some(s) = s {
                        row[k] = *index[k].entry(s).or_insert_with(|| {
                            names[k].push(s);
                            names[k].len() as i32 - 1
                        });
                    }
                }
                codes.push(row);
                if let Some(v) = values.as_mut() {
                    v.push(Values::of(&m));
                }
            }
            ClassRows { codes, values }
        })
        .collect();
    Group {
        classes: range,
        rows,
        names,
    }
}

/// Splits `0..weights.len()` into at most `parts` contiguous ranges of about equal total weight.
fn balanced(weights: impl Iterator<Item = usize> + Clone, parts: usize) -> Vec<Range<usize>> {
    let total: usize = weights.clone().sum();
    let per = total.div_ceil(parts.max(1)).max(1);
    let mut out = Vec::new();
    let (mut start, mut acc, mut n) = (0, 0, 0);
    for w in weights {
        acc += w;
        n += 1;
        if acc >= per {
            out.push(start..n);
            start = n;
            acc = 0;
        }
    }
    if start < n {
        out.push(start..n);
    }
    out
}

/// A vector of `n` zeros whose pages are huge where the kernel allows it (THP "madvise" mode).
fn column<T: Clone + Default>(n: usize) -> Vec<T> {
    let v = vec![T::default(); n]; // zeroed memory from the allocator: no page is touched yet
    advise_huge(v.as_ptr().cast(), n * std::mem::size_of::<T>());
    v
}

fn advise_huge(ptr: *const u8, len: usize) {
    const HUGE: usize = 2 << 20;
    if len < 2 * HUGE {
        return;
    }
    let start = (ptr as usize).next_multiple_of(HUGE);
    let end = (ptr as usize + len) & !(HUGE - 1);
    if end > start {
        // SAFETY: the range lies inside one live allocation of ours; MADV_HUGEPAGE is only advice
        // (it changes no contents, and fails harmlessly where THP is off).
        unsafe {
            libc::madvise(start as *mut libc::c_void, end - start, libc::MADV_HUGEPAGE);
        }
    }
}

/// Mutable views of the table's columns over a range of its rows.
struct Rows<'a> {
    row: &'a mut [u32],
    codes: [&'a mut [i32]; 7],
    layer: (&'a mut [u32], &'a mut [bool]),
    expert: (&'a mut [u32], &'a mut [bool]),
    numbers: [(&'a mut [u64], &'a mut [bool]); 5],
    alpha: (&'a mut [f64], &'a mut [bool]),
    scale: &'a mut [f64],
    use_rslora: &'a mut [bool],
}

fn split<T>(s: &mut [T], mid: usize) -> (&mut [T], &mut [T]) {
    s.split_at_mut(mid)
}

fn split_pair<'a, T>(p: (&'a mut [T], &'a mut [bool]), mid: usize) -> [(&'a mut [T], &'a mut [bool]); 2] {
    let (a, b) = p.0.split_at_mut(mid);
    let (c, d) = p.1.split_at_mut(mid);
    [(a, c), (b, d)]
}

impl<'a> Rows<'a> {
    fn split_at(self, mid: usize) -> (Self, Self) {
        let (row_a, row_b) = split(self.row, mid);
        let codes = self.codes.map(|c| split(c, mid));
        let [layer_a, layer_b] = split_pair(self.layer, mid);
        let [expert_a, expert_b] = split_pair(self.expert, mid);
        let numbers = self.numbers.map(|p| split_pair(p, mid));
        let [alpha_a, alpha_b] = split_pair(self.alpha, mid);
        let (scale_a, scale_b) = split(self.scale, mid);
        let (rs_a, rs_b) = split(self.use_rslora, mid);
        let mut codes_b = Vec::with_capacity(7);
        let mut numbers_b = Vec::with_capacity(5);
        let codes_a = codes.map(|(a, b)| {
            codes_b.push(b);
            a
        });
        let numbers_a = numbers.map(|[a, b]| {
            numbers_b.push(b);
            a
        });
        let (Ok(codes_b), Ok(numbers_b)) = (codes_b.try_into(), numbers_b.try_into()) else {
            unreachable!("seven code columns and five number columns")
        };
        (
            Rows {
                row: row_a,
                codes: codes_a,
                layer: layer_a,
                expert: expert_a,
                numbers: numbers_a,
                alpha: alpha_a,
                scale: scale_a,
                use_rslora: rs_a,
            },
            Rows {
                row: row_b,
                codes: codes_b,
                layer: layer_b,
                expert: expert_b,
                numbers: numbers_b,
                alpha: alpha_b,
                scale: scale_b,
                use_rslora: rs_b,
            },
        )
    }

    fn put(&mut self, i: usize, row: u32, codes: &[i32; 7], v: &Values) {
        self.row[i] = row;
        for (col, &code) in self.codes.iter_mut().zip(codes) {
            col[i] = code;
        }
        put_opt(&mut self.layer, i, v.layer);
        put_opt(&mut self.expert, i, v.expert);
        for (col, &n) in self.numbers.iter_mut().zip(&v.numbers) {
            put_opt(col, i, n);
        }
        put_opt(&mut self.alpha, i, v.alpha);
        self.scale[i] = v.scale;
        self.use_rslora[i] = v.use_rslora;
    }
}

fn put_opt<T: Default>(col: &mut (&mut [T], &mut [bool]), i: usize, v: Option<T>) {
    col.1[i] = v.is_some();
    col.0[i] = v.unwrap_or_default();
}

fn nullable<T: Clone + Default>(n: usize) -> Nullable<T> {
    Nullable {
        values: column(n),
        valid: column(n),
    }
}

impl<'r> ModuleTable<'r> {
    /// The table of `rows` (failed rows have no modules), on the current rayon pool.
    pub fn build(rows: &'r [Result<AdapterResult, Error>]) -> Self {
        // Which distinct classification each row has, in first-appearance order, and how many use it.
        let mut seen: FxHashMap<*const Modules, usize> = FxHashMap::default();
        let mut classes: Vec<&'r Modules> = Vec::new();
        let mut uses: Vec<u32> = Vec::new();
        let row_class: Vec<Option<usize>> = rows
            .iter()
            .map(|r| {
                r.as_ref().ok().filter(|a| !a.class.modules.is_empty()).map(|a| {
                    let c = *seen.entry(Arc::as_ptr(&a.class.modules)).or_insert_with(|| {
                        classes.push(&a.class.modules);
                        uses.push(0);
                        classes.len() - 1
                    });
                    uses[c] += 1;
                    c
                })
            })
            .collect();
        let threads = rayon::current_num_threads();

        // Each distinct classification's rows, interned by groups in parallel; then the groups'
        // dictionaries merged in order into the table's, and their codes rewritten to it.
        let ranges = balanced(classes.iter().map(|m| m.len()), threads * 4);
        let mut groups: Vec<Group<'r>> = ranges
            .into_par_iter()
            .map(|r| intern_group(&classes, &uses, r))
            .collect();
        let mut index: [FxHashMap<&'r str, i32>; 7] = Default::default();
        let mut names: [Vec<&'r str>; 7] = Default::default();
        let remaps: Vec<[Vec<i32>; 7]> = groups
            .iter()
            .map(|g| {
                std::array::from_fn(|k| {
                    g.names[k]
                        .iter()
                        .map(|&s| {
                            *index[k].entry(s).or_insert_with(|| {
                                names[k].push(s);
                                names[k].len() as i32 - 1
                            })
                        })
                        .collect()
                })
            })
            .collect();
        groups.par_iter_mut().zip(&remaps).for_each(|(g, remap)| {
            for class in &mut g.rows {
                for row in &mut class.codes {
                    for (code, map) in row.iter_mut().zip(remap) {
                        if *code >= 0 {
                            *code = map[*code as usize];
                        }
                    }
                }
            }
        });
        let mut class_rows: Vec<Option<&ClassRows>> = vec![None; classes.len()];
        for g in &groups {
            for (c, rows) in g.classes.clone().zip(&g.rows) {
                class_rows[c] = Some(rows);
            }
        }

        // Every adapter's rows, in parallel over ranges of adapters of about equal module counts.
        let counts = || row_class.iter().map(|c| c.map_or(0, |c| classes[c].len()));
        let n: usize = counts().sum();
        let mut table = ModuleTable {
            row: column(n),
            strings: std::array::from_fn(|_| StringColumn {
                codes: column(n),
                names: Vec::new(),
            }),
            layer: nullable(n),
            expert: nullable(n),
            numbers: std::array::from_fn(|_| nullable(n)),
            alpha: nullable(n),
            scale: column(n),
            use_rslora: column(n),
        };
        let mut rest = Rows {
            row: &mut table.row,
            codes: table.strings.each_mut().map(|s| &mut s.codes[..]),
            layer: (&mut table.layer.values, &mut table.layer.valid),
            expert: (&mut table.expert.values, &mut table.expert.valid),
            numbers: table.numbers.each_mut().map(|c| (&mut c.values[..], &mut c.valid[..])),
            alpha: (&mut table.alpha.values, &mut table.alpha.valid),
            scale: &mut table.scale,
            use_rslora: &mut table.use_rslora,
        };
        let mut parts = Vec::new();
        for r in balanced(counts(), threads * 4) {
            let len: usize = row_class[r.clone()]
                .iter()
                .map(|c| c.map_or(0, |c| classes[c].len()))
                .sum();
            let (part, tail) = rest.split_at(len);
            parts.push((r, part));
            rest = tail;
        }
        parts.into_par_iter().for_each(|(range, mut out)| {
            let mut i = 0;
            for row in range {
                let Some(c) = row_class[row] else { continue };
                let Some(class) = class_rows[c] else { continue };
                match &class.values {
                    Some(values) => {
                        for (codes, v) in class.codes.iter().zip(values) {
                            out.put(i, row as u32, codes, v);
                            i += 1;
                        }
                    }
                    None => {
                        for (codes, m) in class.codes.iter().zip(classes[c].iter()) {
                            out.put(i, row as u32, codes, &Values::of(&m));
                            i += 1;
                        }
                    }
                }
            }
        });
        for (col, names) in table.strings.iter_mut().zip(names) {
            col.names = names;
        }
        table
    }
}
