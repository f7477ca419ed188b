//! A scan report's module table: one row per module of every successful adapter, as columns, built
//! on the scan's threads (the caller releases the GIL).
//!
//! Adapters whose headers repeat share one classification (the memo's `Arc<Modules>`), so the work
//! is split in two: each distinct classification is turned into rows once (its strings interned,
//! its numbers read), in parallel over the distinct ones; then every adapter's rows are written, in
//! parallel over row ranges, by copying its classification's. Repeated strings come out as
//! dictionary codes in first-appearance order, as a serial walk over the rows gives them.
//!
//! The columns are tens of megabytes written once (224,000 modules: 24 MB). Their first touch, a
//! page fault per 4 KiB, was most of the time of building them, so they all live in one anonymous
//! mapping (`Arena`) that the kernel may back with 2 MiB pages.

use std::marker::PhantomData;
use std::ops::Range;
use std::sync::Arc;

use memmap2::{Advice, MmapMut};
use rayon::prelude::*;
use rustc_hash::FxHashMap;

use crate::classify::{ModuleNumbers, ModuleStrings, Modules};
use crate::error::Error;
use crate::scan::AdapterResult;

/// A string column: a code per row (-1: null) into its distinct values.
pub struct StringColumn<'r> {
    /// A code per row, -1 for null.
    pub codes: Column<i32>,
    /// The distinct values, in first-appearance order.
    pub names: Vec<&'r str>,
}

/// Number types a column holds: all-zero bytes are a value (the arena starts zeroed), and a column
/// is only ever written as its own type.
pub trait Plain: Copy + Default + Send + Sync {}
impl Plain for u32 {}
impl Plain for i32 {}
impl Plain for u64 {}
impl Plain for f64 {}
impl Plain for bool {}
impl Plain for [i32; 7] {}

/// The memory of a table's columns: one anonymous mapping, zeroed by the kernel.
pub struct Arena {
    map: MmapMut,
    /// Where the columns start in the mapping: the first 2 MiB boundary (see `Arena::new`).
    base: usize,
    len: usize,
}

/// The size of a transparent huge page on x86-64 and aarch64 with 4 KiB pages.
const HUGE_PAGE: usize = 2 << 20;

impl Arena {
    fn new(len: usize) -> std::io::Result<Arena> {
        if len < HUGE_PAGE {
            let map = MmapMut::map_anon(len.max(1))?;
            return Ok(Arena { map, base: 0, len });
        }
        // Huge pages only cover 2 MiB-aligned stretches, and a mapping whose length is not a
        // multiple of 2 MiB starts wherever the kernel puts it: the dense fleet's 22 MB table then
        // had about 2.5 MB of 4 KiB pages at its ends, 620 of its 633 page faults. So the columns
        // start at the first boundary of a mapping 2 MiB longer (the stretch before it is never
        // touched, so it costs address space, not memory).
        let map = MmapMut::map_anon(len + HUGE_PAGE)?;
        // Only advice: where THP is off it fails and the pages are 4 KiB.
        let _ = map.advise(Advice::HugePage);
        let base = (map.as_ptr() as usize).next_multiple_of(HUGE_PAGE) - map.as_ptr() as usize;
        // The columns' last stretch, past their last 2 MiB boundary, takes 4 KiB pages unless a
        // huge page there wastes at most an eighth of the table: the 20,000-module table of 2.1 MB
        // took two huge pages (4 MB resident), the dense fleet's 22 MB table keeps its last one.
        let whole = len / HUGE_PAGE * HUGE_PAGE;
        if len > whole && HUGE_PAGE - (len - whole) > len / 8 {
            let _ = map.advise_range(Advice::NoHugePage, base + whole, map.len() - base - whole);
        }
        let mut arena = Arena { map, base, len };
        arena.touch();
        Ok(arena)
    }

    /// The columns' bytes.
    fn bytes_mut(&mut self) -> &mut [u8] {
        &mut self.map[self.base..self.base + self.len]
    }

    /// Faults the mapping in on every thread of the pool, a huge page at a time: the kernel
    /// zeroes each page on first touch, and left to the fill, which writes a slice of every column
    /// per thread, the first thread to reach a huge page zeroed all of it (in a profile of the
    /// dense fleet's table, one thread did 72% of the zeroing).
    fn touch(&mut self) {
        self.bytes_mut().par_chunks_mut(HUGE_PAGE).for_each(|stretch| {
            for page in stretch.chunks_mut(4096) {
                page[0] = 0;
            }
        });
    }

    /// The rows of `column`.
    pub fn get<T: Plain>(&self, column: &Column<T>) -> &[T] {
        let start = self.base + column.start;
        let bytes = &self.map[start..start + column.len * std::mem::size_of::<T>()];
        // SAFETY: the bytes are in the mapping, aligned for T (`Layout` aligns every column to 64
        // from `base`, itself page-aligned), and are zeros or values of T written through
        // `Carver::take`.
        unsafe { std::slice::from_raw_parts(bytes.as_ptr().cast::<T>(), column.len) }
    }
}

/// Where a column's rows lie in its table's arena.
pub struct Column<T> {
    start: usize,
    len: usize,
    _t: PhantomData<T>,
}

/// A nullable number column in the arena: values (0 where null) and a validity mask.
pub struct NullableColumn<T> {
    /// A value per row, 0 where null.
    pub values: Column<T>,
    /// Whether each row's value is there.
    pub valid: Column<bool>,
}

/// Places columns one after another, each 64-byte aligned.
#[derive(Default)]
struct Layout {
    size: usize,
}

impl Layout {
    fn column<T>(&mut self, len: usize) -> Column<T> {
        let start = self.size.next_multiple_of(64);
        self.size = start + len * std::mem::size_of::<T>();
        Column {
            start,
            len,
            _t: PhantomData,
        }
    }

    fn nullable<T>(&mut self, len: usize) -> NullableColumn<T> {
        NullableColumn {
            values: self.column(len),
            valid: self.column(len),
        }
    }
}

/// Hands out the arena's columns as mutable slices, in the order `Layout` placed them.
struct Carver<'a> {
    rest: &'a mut [u8],
    at: usize,
}

impl<'a> Carver<'a> {
    fn take<T: Plain>(&mut self, column: &Column<T>) -> &'a mut [T] {
        let rest = std::mem::take(&mut self.rest);
        let (_, rest) = rest.split_at_mut(column.start - self.at);
        let (bytes, rest) = rest.split_at_mut(column.len * std::mem::size_of::<T>());
        self.rest = rest;
        self.at = column.start + bytes.len();
        // SAFETY: as in `Arena::get`; these bytes are lent once, to be written as T.
        unsafe { std::slice::from_raw_parts_mut(bytes.as_mut_ptr().cast::<T>(), column.len) }
    }

    fn take_pair<T: Plain>(&mut self, c: &NullableColumn<T>) -> (&'a mut [T], &'a mut [bool]) {
        (self.take(&c.values), self.take(&c.valid))
    }
}

/// The module table's columns.
pub struct ModuleTable<'r> {
    /// The memory of every column below.
    pub arena: Arena,
    /// The adapter's row in the report.
    pub row: Column<u32>,
    /// name, key, leaf, kind, dtype, a_key, b_key.
    pub strings: [StringColumn<'r>; 7],
    /// The layer index.
    pub layer: NullableColumn<u32>,
    /// The expert index.
    pub expert: NullableColumn<u32>,
    /// num_experts, rank, in_features, out_features, config_rank.
    pub numbers: [NullableColumn<u64>; 5],
    /// The module's alpha.
    pub alpha: NullableColumn<f64>,
    /// `LoraModule.scale`: alpha / rank (alpha / sqrt(rank) with rsLoRA), 1.0 when either is unknown.
    pub scale: Column<f64>,
    /// Whether the scale is alpha / sqrt(rank).
    pub use_rslora: Column<bool>,
}

impl ModuleTable<'_> {
    /// The number of rows.
    pub fn len(&self) -> usize {
        self.row.len
    }

    /// Whether the table has no rows.
    pub fn is_empty(&self) -> bool {
        self.row.len == 0
    }

    /// The rows of one of the table's columns.
    pub fn get<T: Plain>(&self, column: &Column<T>) -> &[T] {
        self.arena.get(column)
    }
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
    fn of(m: ModuleNumbers) -> Self {
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

/// A classification more than one adapter uses, as columns: each adapter's rows are a copy of
/// each, column by column (writing a row at a time into 28 columns was most of the dense fleet's
/// table build after its page faults). The values are pushed as the modules are interned; the code
/// columns are filled once the codes are the table's.
#[derive(Default)]
struct ClassColumns {
    codes: [Vec<i32>; 7],
    layer: (Vec<u32>, Vec<bool>),
    expert: (Vec<u32>, Vec<bool>),
    numbers: [(Vec<u64>, Vec<bool>); 5],
    alpha: (Vec<f64>, Vec<bool>),
    scale: Vec<f64>,
    use_rslora: Vec<bool>,
}

impl ClassColumns {
    fn push(&mut self, v: &Values) {
        push_opt(&mut self.layer, v.layer);
        push_opt(&mut self.expert, v.expert);
        for (col, &n) in self.numbers.iter_mut().zip(&v.numbers) {
            push_opt(col, n);
        }
        push_opt(&mut self.alpha, v.alpha);
        self.scale.push(v.scale);
        self.use_rslora.push(v.use_rslora);
    }

    fn set_codes(&mut self, codes: &[[i32; 7]]) {
        for (k, col) in self.codes.iter_mut().enumerate() {
            *col = codes.iter().map(|row| row[k]).collect();
        }
    }
}

fn push_opt<T: Default>(col: &mut (Vec<T>, Vec<bool>), v: Option<T>) {
    col.1.push(v.is_some());
    col.0.push(v.unwrap_or_default());
}

/// A group of distinct classifications interned together, with its own dictionaries, and their
/// rows: string codes (into the group's dictionaries until the remap, then the table's), and for
/// each classification more than one adapter uses, its rows as columns (the others' values are read
/// from the modules where they are written).
///
/// Flat, not a record per classification: a fleet of single-module adapters whose headers do not
/// repeat has a classification per adapter, and a `Vec` of codes each (a header and a heap block)
/// was a third of the table's peak for 20,000 of them.
struct Group<'r, 'c> {
    classes: Range<usize>,
    /// The codes of each classification's modules, one classification after another: the group's
    /// stretch of one mapping for every group (`ModuleTable::build`).
    codes: &'c mut [[i32; 7]],
    /// Where each classification's codes start.
    starts: Vec<u32>,
    /// Boxed: 25 empty `Vec`s inline per classification (600 bytes) added 13 MB to the table of
    /// 20,000 single-module adapters.
    columns: Vec<Option<Box<ClassColumns>>>,
    names: [Vec<&'r str>; 7],
}

impl Group<'_, '_> {
    /// The codes of classification `c` (of `modules` modules) and its columns, if it has them.
    fn class(&self, c: usize, modules: usize) -> (&[[i32; 7]], Option<&ClassColumns>) {
        let local = c - self.classes.start;
        let start = self.starts[local] as usize;
        (&self.codes[start..start + modules], self.columns[local].as_deref())
    }
}

/// The string codes rows of a group have had, by the module key they went with: distinct
/// classifications mostly name the same modules, so a module's seven strings are found by one
/// lookup and compared, rather than hashed and looked up one by one. A few per key (another
/// adapter's module of that key may have another dtype, or lack a factor); the rest are interned.
const CODES_PER_KEY: usize = 4;

/// Interns the classifications of `range`, writing their modules' codes to `codes` (as long as
/// their modules together).
fn intern_group<'r, 'c>(
    classes: &[&'r Modules],
    uses: &[u32],
    range: Range<usize>,
    codes: &'c mut [[i32; 7]],
) -> Group<'r, 'c> {
    let mut index: [FxHashMap<&'r str, i32>; 7] = Default::default();
    let mut names: [Vec<&'r str>; 7] = Default::default();
    let mut by_key: FxHashMap<&'r str, Vec<(ModuleStrings<'r>, [i32; 7])>> = FxHashMap::default();
    let mut at = 0;
    let mut starts = Vec::with_capacity(range.len());
    let columns = range
        .clone()
        .map(|c| {
            let modules = classes[c];
            starts.push(at as u32);
            let mut columns = (uses[c] > 1).then(Box::<ClassColumns>::default);
            for (strings, numbers) in modules.strings().zip(modules.numbers()) {
                let key = strings[1].unwrap_or_default(); // the key, which every module has
                let known = by_key.entry(key).or_default();
                let row = match known.iter().find(|(s, _)| *s == strings) {
                    Some((_, row)) => *row,
                    None => {
                        let mut row = [-1i32; 7];
                        for (k, s) in strings.into_iter().enumerate() {
                            if let Some(s) = s {
                                row[k] = *index[k].entry(s).or_insert_with(|| {
                                    names[k].push(s);
                                    names[k].len() as i32 - 1
                                });
                            }
                        }
                        if known.len() < CODES_PER_KEY {
                            known.push((strings, row));
                        }
                        row
                    }
                };
                codes[at] = row;
                at += 1;
                if let Some(c) = columns.as_mut() {
                    c.push(&Values::of(numbers));
                }
            }
            columns
        })
        .collect();
    Group {
        classes: range,
        codes,
        starts,
        columns,
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

fn split_pair<'a, T>(p: (&'a mut [T], &'a mut [bool]), mid: usize) -> [(&'a mut [T], &'a mut [bool]); 2] {
    let (a, b) = p.0.split_at_mut(mid);
    let (c, d) = p.1.split_at_mut(mid);
    [(a, c), (b, d)]
}

impl<'a> Rows<'a> {
    fn split_at(self, mid: usize) -> (Self, Self) {
        let (row_a, row_b) = self.row.split_at_mut(mid);
        let codes = self.codes.map(|c| c.split_at_mut(mid));
        let [layer_a, layer_b] = split_pair(self.layer, mid);
        let [expert_a, expert_b] = split_pair(self.expert, mid);
        let numbers = self.numbers.map(|p| split_pair(p, mid));
        let [alpha_a, alpha_b] = split_pair(self.alpha, mid);
        let (scale_a, scale_b) = self.scale.split_at_mut(mid);
        let (rs_a, rs_b) = self.use_rslora.split_at_mut(mid);
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

    /// Rows `i..` are a copy of a classification's, for adapter row `row`; returns their number.
    fn put_class(&mut self, i: usize, row: u32, c: &ClassColumns) -> usize {
        let n = c.scale.len();
        let at = i..i + n;
        self.row[at.clone()].fill(row);
        for (col, from) in self.codes.iter_mut().zip(&c.codes) {
            col[at.clone()].copy_from_slice(from);
        }
        copy_pair(&mut self.layer, &at, &c.layer);
        copy_pair(&mut self.expert, &at, &c.expert);
        for (col, from) in self.numbers.iter_mut().zip(&c.numbers) {
            copy_pair(col, &at, from);
        }
        copy_pair(&mut self.alpha, &at, &c.alpha);
        self.scale[at.clone()].copy_from_slice(&c.scale);
        self.use_rslora[at].copy_from_slice(&c.use_rslora);
        n
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

fn copy_pair<T: Copy>(col: &mut (&mut [T], &mut [bool]), at: &Range<usize>, from: &(Vec<T>, Vec<bool>)) {
    col.0[at.clone()].copy_from_slice(&from.0);
    col.1[at.clone()].copy_from_slice(&from.1);
}

fn put_opt<T: Default>(col: &mut (&mut [T], &mut [bool]), i: usize, v: Option<T>) {
    col.1[i] = v.is_some();
    col.0[i] = v.unwrap_or_default();
}

impl<'r> ModuleTable<'r> {
    /// The table of `rows` (failed rows have no modules), on the current rayon pool. Fails only if
    /// the memory for the columns cannot be mapped.
    pub fn build(rows: &'r [Result<AdapterResult, Error>]) -> std::io::Result<Self> {
        // Which distinct classification each row has, in first-appearance order, and how many use it.
        let mut seen: FxHashMap<*const Modules, u32> = FxHashMap::default();
        let mut classes: Vec<&'r Modules> = Vec::new();
        let mut uses: Vec<u32> = Vec::new();
        // NONE for a row without modules (a u32, not an Option<usize>: a quarter of the memory).
        const NONE: u32 = u32::MAX;
        let row_class: Vec<u32> = rows
            .iter()
            .map(|r| match r.as_ref().ok().filter(|a| !a.class.modules.is_empty()) {
                Some(a) => {
                    let c = *seen.entry(Arc::as_ptr(&a.class.modules)).or_insert_with(|| {
                        classes.push(&a.class.modules);
                        uses.push(0);
                        (classes.len() - 1) as u32
                    });
                    uses[c as usize] += 1;
                    c
                }
                None => NONE,
            })
            .collect();
        drop(seen);
        let class_of = |row: usize| (row_class[row] != NONE).then(|| row_class[row] as usize);
        let threads = rayon::current_num_threads();

        // Each distinct classification's rows, interned by groups in parallel; then the groups'
        // dictionaries merged in order into the table's, and their codes rewritten to it.
        let ranges = balanced(classes.iter().map(|m| m.len()), threads * 4);
        // The groups' codes in one mapping, each group a stretch of it: a buffer per group (each
        // under 2 MiB) faults in 4 KiB pages, where one mapping takes huge pages (`Arena`).
        let mut layout = Layout::default();
        let all_codes = layout.column::<[i32; 7]>(classes.iter().map(|m| m.len()).sum());
        let mut code_arena = Arena::new(layout.size)?;
        let mut rest = Carver {
            rest: code_arena.bytes_mut(),
            at: 0,
        }
        .take(&all_codes);
        let mut stretches = Vec::with_capacity(ranges.len());
        for r in &ranges {
            let (stretch, tail) = std::mem::take(&mut rest).split_at_mut(r.clone().map(|c| classes[c].len()).sum());
            stretches.push(stretch);
            rest = tail;
        }
        let mut groups: Vec<Group<'r, '_>> = ranges
            .into_par_iter()
            .zip(stretches)
            .map(|(r, codes)| intern_group(&classes, &uses, r, codes))
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
            // The first group's dictionaries are the table's first entries: nothing to rewrite.
            let identity = remap.iter().all(|m| m.iter().enumerate().all(|(i, &c)| c == i as i32));
            if !identity {
                for row in g.codes.iter_mut() {
                    for (code, map) in row.iter_mut().zip(remap) {
                        if *code >= 0 {
                            *code = map[*code as usize];
                        }
                    }
                }
            }
            for (local, columns) in g.columns.iter_mut().enumerate() {
                if let Some(columns) = columns.as_mut() {
                    let start = g.starts[local] as usize;
                    columns.set_codes(&g.codes[start..start + columns.scale.len()]);
                }
            }
        });
        // The group of classification `c`: groups hold consecutive ranges of classifications.
        let group_of = |c: usize| &groups[groups.partition_point(|g| g.classes.end <= c)];

        // Every adapter's rows, in parallel over ranges of adapters of about equal module counts.
        let counts = || (0..rows.len()).map(|row| class_of(row).map_or(0, |c| classes[c].len()));
        let n: usize = counts().sum();
        let mut layout = Layout::default();
        let row = layout.column::<u32>(n);
        let codes: [Column<i32>; 7] = std::array::from_fn(|_| layout.column(n));
        let layer = layout.nullable::<u32>(n);
        let expert = layout.nullable::<u32>(n);
        let numbers: [NullableColumn<u64>; 5] = std::array::from_fn(|_| layout.nullable(n));
        let alpha = layout.nullable::<f64>(n);
        let scale = layout.column::<f64>(n);
        let use_rslora = layout.column::<bool>(n);
        let mut arena = Arena::new(layout.size)?;
        let mut carver = Carver {
            rest: arena.bytes_mut(),
            at: 0,
        };
        // Taken in the order they were laid out.
        let mut rest = Rows {
            row: carver.take(&row),
            codes: codes.each_ref().map(|c| carver.take(c)),
            layer: carver.take_pair(&layer),
            expert: carver.take_pair(&expert),
            numbers: numbers.each_ref().map(|c| carver.take_pair(c)),
            alpha: carver.take_pair(&alpha),
            scale: carver.take(&scale),
            use_rslora: carver.take(&use_rslora),
        };
        let mut parts = Vec::new();
        for r in balanced(counts(), threads * 4) {
            let len: usize = r.clone().map(|row| class_of(row).map_or(0, |c| classes[c].len())).sum();
            let (part, tail) = rest.split_at(len);
            parts.push((r, part));
            rest = tail;
        }
        parts.into_par_iter().for_each(|(range, mut out)| {
            let mut i = 0;
            for row in range {
                let Some(c) = class_of(row) else { continue };
                let (codes, columns) = group_of(c).class(c, classes[c].len());
                match columns {
                    Some(columns) => i += out.put_class(i, row as u32, columns),
                    None => {
                        for (codes, m) in codes.iter().zip(classes[c].numbers()) {
                            out.put(i, row as u32, codes, &Values::of(m));
                            i += 1;
                        }
                    }
                }
            }
        });
        let mut names = names.into_iter();
        Ok(ModuleTable {
            arena,
            row,
            strings: codes.map(|codes| StringColumn {
                codes,
                names: names.next().unwrap_or_default(),
            }),
            layer,
            expert,
            numbers,
            alpha,
            scale,
            use_rslora,
        })
    }
}

#[cfg(all(test, target_os = "linux"))]
mod tests {
    use super::*;

    /// The kernel's flags (`VmFlags` in /proc/self/smaps) of the mapping that holds `addr`.
    fn vm_flags(addr: usize) -> Vec<String> {
        let smaps = std::fs::read_to_string("/proc/self/smaps").expect("smaps");
        let mut inside = false;
        for line in smaps.lines() {
            let range = line.split(' ').next().and_then(|r| r.split_once('-'));
            if let Some((Ok(lo), Ok(hi))) =
                range.map(|(lo, hi)| (usize::from_str_radix(lo, 16), usize::from_str_radix(hi, 16)))
            {
                inside = (lo..hi).contains(&addr);
            } else if let (true, Some(flags)) = (inside, line.strip_prefix("VmFlags:")) {
                return flags.split_whitespace().map(str::to_owned).collect();
            }
        }
        panic!("no mapping holds {addr:#x}");
    }

    #[test]
    fn a_tables_last_stretch_takes_a_huge_page_only_when_little_of_it_is_wasted() {
        const MIB: usize = 1 << 20;
        let first = |a: &Arena| a.map.as_ptr() as usize + a.base;
        let last = |a: &Arena| first(a) + a.len - 1;
        let has = |addr: usize, flag: &str| vm_flags(addr).iter().any(|f| f == flag);
        // 2.1 MB: a huge page for the last 0.1 MB would hold 1.9 MB of nothing.
        let small = Arena::new(2 * MIB + 100 * 1024).expect("arena");
        if !has(first(&small), "hg") {
            return; // no transparent huge pages in this kernel: the advice is refused, pages are 4 KiB
        }
        assert!(has(last(&small), "nh"));
        // 21.9 MB: the last huge page wastes 0.1 MB.
        let large = Arena::new(21 * MIB + 900 * 1024).expect("arena");
        assert!(has(first(&large), "hg") && has(last(&large), "hg") && !has(last(&large), "nh"));
    }
}
