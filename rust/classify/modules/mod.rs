//! An adapter's module records, with every name and shape in buffers the adapter's modules share.
//!
//! A dense adapter has a few hundred modules, and a record with owned strings costs seven
//! allocations (key, name, leaf, two tensor names, two shapes) and as many frees: measured with
//! callgrind on a fresh 224-module header, those allocations were half of all the work of a scan.
//! Here the names go back to back into one `String` per adapter, the shapes into one `Vec<u64>`,
//! and a record holds ranges into them, so an adapter's modules take three allocations. Text that
//! repeats within a module is stored once: the key is the start of its lora_A tensor's name, and
//! the module name and leaf are usually the end of the key.

use std::fmt;
use std::ops::Range;

use super::ModuleKind;
use crate::header::Dtype;

mod stored;

/// A range of [`Modules`]' text or dims. 32 bits are enough: the text of one adapter's records
/// is at most a few times its header, which is at most 100 MB.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
struct Span {
    start: u32,
    len: u32,
}

impl Span {
    fn range(self) -> Range<usize> {
        self.start as usize..self.start as usize + self.len as usize
    }
}

/// One module's record as stored: its numbers, and its names and shapes as spans. Optional values
/// are a value and a bit in `present` (an `Option<u64>` takes 16 bytes, an `Option<Span>` 12): 152
/// bytes a module instead of 240, which a scan that keeps every adapter's modules feels.
#[derive(Debug, Clone)]
struct Record {
    num_experts: u64,
    rank: u64,
    in_features: u64,
    out_features: u64,
    config_rank: u64,
    alpha: f64,
    layer: u32,
    expert: u32,
    key: Span,
    name: Span,
    leaf: Span,
    a_key: Span,
    b_key: Span,
    alpha_key: Span,
    bias_key: Span,
    magnitude_key: Span,
    /// Into `dims`.
    a_shape: Span,
    /// Into `dims`.
    b_shape: Span,
    /// Into `extra`.
    extra_keys: Span,
    /// Which of the optional fields hold a value: bits `HAS_*`.
    present: u16,
    kind: ModuleKind,
    dtype: Option<Dtype>,
    use_rslora: bool,
}

/// A module's strings in the module table's order: name, key, leaf, kind, dtype, A key, B key.
pub type ModuleStrings<'m> = [Option<&'m str>; 7];

/// `Record::present` bits.
const HAS_NUM_EXPERTS: u16 = 1;
const HAS_RANK: u16 = 1 << 1;
const HAS_IN_FEATURES: u16 = 1 << 2;
const HAS_OUT_FEATURES: u16 = 1 << 3;
const HAS_CONFIG_RANK: u16 = 1 << 4;
const HAS_ALPHA: u16 = 1 << 5;
const HAS_LAYER: u16 = 1 << 6;
const HAS_EXPERT: u16 = 1 << 7;
const HAS_A_KEY: u16 = 1 << 8;
const HAS_B_KEY: u16 = 1 << 9;
const HAS_ALPHA_KEY: u16 = 1 << 10;
const HAS_BIAS_KEY: u16 = 1 << 11;
const HAS_MAGNITUDE_KEY: u16 = 1 << 12;
const HAS_A_SHAPE: u16 = 1 << 13;
const HAS_B_SHAPE: u16 = 1 << 14;

/// Stores an optional value as a value and a presence bit (the default stands for None).
#[inline]
fn keep<T: Default>(value: Option<T>, bit: u16, present: &mut u16) -> T {
    *present |= bit * u16::from(value.is_some());
    value.unwrap_or_default()
}

impl Record {
    /// The optional field stored under `bit`.
    #[inline]
    fn get<T>(&self, bit: u16, value: T) -> Option<T> {
        (self.present & bit != 0).then_some(value)
    }

    #[inline]
    fn numbers(&self) -> ModuleNumbers {
        ModuleNumbers {
            layer: self.get(HAS_LAYER, self.layer),
            expert: self.get(HAS_EXPERT, self.expert),
            num_experts: self.get(HAS_NUM_EXPERTS, self.num_experts),
            rank: self.get(HAS_RANK, self.rank),
            in_features: self.get(HAS_IN_FEATURES, self.in_features),
            out_features: self.get(HAS_OUT_FEATURES, self.out_features),
            config_rank: self.get(HAS_CONFIG_RANK, self.config_rank),
            alpha: self.get(HAS_ALPHA, self.alpha),
            use_rslora: self.use_rslora,
        }
    }
}

/// A module's numbers, without its names and shapes: what a table of numbers needs, read without
/// slicing the ten strings of a [`ModuleInfo`] (for the module table of 1,000 adapters whose headers
/// all differ, that view was over a quarter of the time).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct ModuleNumbers {
    /// As [`ModuleInfo::layer`].
    pub layer: Option<u32>,
    /// As [`ModuleInfo::expert`].
    pub expert: Option<u32>,
    /// As [`ModuleInfo::num_experts`].
    pub num_experts: Option<u64>,
    /// As [`ModuleInfo::rank`].
    pub rank: Option<u64>,
    /// As [`ModuleInfo::in_features`].
    pub in_features: Option<u64>,
    /// As [`ModuleInfo::out_features`].
    pub out_features: Option<u64>,
    /// As [`ModuleInfo::config_rank`].
    pub config_rank: Option<u64>,
    /// As [`ModuleInfo::alpha`].
    pub alpha: Option<f64>,
    /// As [`ModuleInfo::use_rslora`].
    pub use_rslora: bool,
}

/// One module, fully resolved: what [`Modules`] stores for it, its names and shapes borrowed.
#[derive(Debug, Clone, PartialEq)]
pub struct ModuleInfo<'m> {
    /// The module's key: its tensors' common name prefix, as in the file.
    pub key: &'m str,
    /// The module's name in the base model (the key without the PEFT wrapper prefix).
    pub name: &'m str,
    /// The module name's last part that target lists match (`q_proj`).
    pub leaf: &'m str,
    /// What kind of module the tensors make.
    pub kind: ModuleKind,
    /// The layer number in the name, if any.
    pub layer: Option<u32>,
    /// The expert number in the name, if any.
    pub expert: Option<u32>,
    /// Experts the module's tensors hold (stacked or target-parameter modules), or the adapter's
    /// expert count for a per-expert module.
    pub num_experts: Option<u64>,
    /// The LoRA rank.
    pub rank: Option<u64>,
    /// Input features of the base layer.
    pub in_features: Option<u64>,
    /// Output features of the base layer.
    pub out_features: Option<u64>,
    /// The dtype of the A (else B) factor.
    pub dtype: Option<Dtype>,
    /// The A factor's tensor name.
    pub a_key: Option<&'m str>,
    /// The B factor's tensor name.
    pub b_key: Option<&'m str>,
    /// The A factor's shape.
    pub a_shape: Option<&'m [u64]>,
    /// The B factor's shape.
    pub b_shape: Option<&'m [u64]>,
    /// The alpha: the file's `.alpha` scalar, else the config's.
    pub alpha: Option<f64>,
    /// The `.alpha` tensor's name.
    pub alpha_key: Option<&'m str>,
    /// The LoRA bias tensor's name.
    pub bias_key: Option<&'m str>,
    /// The DoRA magnitude tensor's name.
    pub magnitude_key: Option<&'m str>,
    /// The module's other tensors (variant factors, a kohya `lora_mid`), in file order.
    pub extra_keys: Vec<&'m str>,
    /// The rank the config gives this module (`r`, or a `rank_pattern` entry).
    pub config_rank: Option<u64>,
    /// Whether the config scales by `alpha / sqrt(rank)`.
    pub use_rslora: bool,
}

impl<'m> ModuleInfo<'m> {
    fn names(&self) -> Names<'m> {
        Names {
            key: self.key,
            name: self.name,
            leaf: self.leaf,
            a_key: self.a_key,
            b_key: self.b_key,
            alpha_key: self.alpha_key,
            bias_key: self.bias_key,
            magnitude_key: self.magnitude_key,
        }
    }

    /// The module's numbers.
    pub fn numbers(&self) -> ModuleNumbers {
        ModuleNumbers {
            layer: self.layer,
            expert: self.expert,
            num_experts: self.num_experts,
            rank: self.rank,
            in_features: self.in_features,
            out_features: self.out_features,
            config_rank: self.config_rank,
            alpha: self.alpha,
            use_rslora: self.use_rslora,
        }
    }
}

/// A module's key, name, leaf and tensor names (see [`ModuleInfo`]).
#[derive(Debug, Clone, Copy)]
pub(crate) struct Names<'m> {
    pub key: &'m str,
    pub name: &'m str,
    pub leaf: &'m str,
    pub a_key: Option<&'m str>,
    pub b_key: Option<&'m str>,
    pub alpha_key: Option<&'m str>,
    pub bias_key: Option<&'m str>,
    pub magnitude_key: Option<&'m str>,
}

/// Where `add_names` put them.
struct NameSpans {
    key: Span,
    name: Span,
    leaf: Span,
    a_key: Option<Span>,
    b_key: Option<Span>,
    alpha_key: Option<Span>,
    bias_key: Option<Span>,
    magnitude_key: Option<Span>,
}

/// What a module that repeats another (`Modules::push_like`) has of its own.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Repeated<'m> {
    pub names: Names<'m>,
    pub layer: Option<u32>,
    pub expert: Option<u32>,
    pub num_experts: Option<u64>,
    pub alpha: Option<f64>,
    pub config_rank: Option<u64>,
}

/// The module records of one adapter, in the order the header first names each module.
#[derive(Clone, Default)]
pub struct Modules {
    text: String,
    dims: Vec<u64>,
    extra: Vec<Span>,
    records: Vec<Record>,
}

impl Modules {
    /// Room for `modules` records with `text` bytes of names and `dims` shape dimensions in all,
    /// reserved once: grown by doubling, the buffers would be copied about once more.
    pub fn reserve(&mut self, modules: usize, text: usize, dims: usize) {
        self.records.reserve_exact(modules);
        self.text.reserve_exact(text);
        self.dims.reserve_exact(dims);
    }

    /// The number of modules.
    pub fn len(&self) -> usize {
        self.records.len()
    }

    /// Whether there are no modules.
    pub fn is_empty(&self) -> bool {
        self.records.is_empty()
    }

    /// Module `i`, if there is one.
    pub fn get(&self, i: usize) -> Option<ModuleInfo<'_>> {
        self.records.get(i).map(|r| self.view(r))
    }

    /// Every module, in order.
    pub fn iter(&self) -> impl ExactSizeIterator<Item = ModuleInfo<'_>> + '_ {
        self.records.iter().map(|r| self.view(r))
    }

    /// Every module's numbers, in order.
    pub fn numbers(&self) -> impl ExactSizeIterator<Item = ModuleNumbers> + '_ {
        self.records.iter().map(Record::numbers)
    }

    /// Every module's strings as the module table has them, in order: its name, key, leaf, kind,
    /// dtype, A key and B key; read from the records without a full view (the view was an eighth of
    /// the table's time on a fleet of distinct headers).
    pub fn strings(&self) -> impl ExactSizeIterator<Item = ModuleStrings<'_>> + '_ {
        let text = |s: Span| &self.text[s.range()];
        self.records.iter().map(move |r| {
            [
                Some(text(r.name)),
                Some(text(r.key)),
                Some(text(r.leaf)),
                Some(r.kind.name()),
                r.dtype.map(Dtype::name),
                r.get(HAS_A_KEY, r.a_key).map(text),
                r.get(HAS_B_KEY, r.b_key).map(text),
            ]
        })
    }

    /// Adds a module, copying its names and shapes in.
    pub fn push(&mut self, m: &ModuleInfo<'_>) {
        let n = self.add_names(&m.names());
        let extra_start = self.extra.len();
        for k in &m.extra_keys {
            let span = self.add_text(k);
            self.extra.push(span);
        }
        let a_shape = m.a_shape.map(|s| self.add_dims(s));
        let b_shape = m.b_shape.map(|s| self.add_dims(s));
        let mut present = 0;
        let record = Record {
            num_experts: keep(m.num_experts, HAS_NUM_EXPERTS, &mut present),
            rank: keep(m.rank, HAS_RANK, &mut present),
            in_features: keep(m.in_features, HAS_IN_FEATURES, &mut present),
            out_features: keep(m.out_features, HAS_OUT_FEATURES, &mut present),
            config_rank: keep(m.config_rank, HAS_CONFIG_RANK, &mut present),
            alpha: keep(m.alpha, HAS_ALPHA, &mut present),
            layer: keep(m.layer, HAS_LAYER, &mut present),
            expert: keep(m.expert, HAS_EXPERT, &mut present),
            key: n.key,
            name: n.name,
            leaf: n.leaf,
            a_key: keep(n.a_key, HAS_A_KEY, &mut present),
            b_key: keep(n.b_key, HAS_B_KEY, &mut present),
            alpha_key: keep(n.alpha_key, HAS_ALPHA_KEY, &mut present),
            bias_key: keep(n.bias_key, HAS_BIAS_KEY, &mut present),
            magnitude_key: keep(n.magnitude_key, HAS_MAGNITUDE_KEY, &mut present),
            a_shape: keep(a_shape, HAS_A_SHAPE, &mut present),
            b_shape: keep(b_shape, HAS_B_SHAPE, &mut present),
            extra_keys: span_of(extra_start, self.extra.len() - extra_start),
            present,
            kind: m.kind,
            dtype: m.dtype,
            use_rslora: m.use_rslora,
        };
        self.records.push(record);
    }

    /// Adds a module whose kind, rank, features, dtype, shapes and `use_rslora` are those of
    /// module `like`, pushed before, and which has no extra keys: its names and its own numbers
    /// (`m`) go in, the rest is `like`'s record, its shapes shared. Cheaper than `push` for the
    /// modules that repeat per layer. False (nothing added) when there is no module `like`.
    pub(crate) fn push_like(&mut self, like: usize, m: &Repeated<'_>) -> bool {
        let Some(mut r) = self.records.get(like).cloned() else {
            return false;
        };
        let n = self.add_names(&m.names);
        let mut present = r.present & (HAS_RANK | HAS_IN_FEATURES | HAS_OUT_FEATURES | HAS_A_SHAPE | HAS_B_SHAPE);
        r.num_experts = keep(m.num_experts, HAS_NUM_EXPERTS, &mut present);
        r.config_rank = keep(m.config_rank, HAS_CONFIG_RANK, &mut present);
        r.alpha = keep(m.alpha, HAS_ALPHA, &mut present);
        r.layer = keep(m.layer, HAS_LAYER, &mut present);
        r.expert = keep(m.expert, HAS_EXPERT, &mut present);
        (r.key, r.name, r.leaf) = (n.key, n.name, n.leaf);
        r.a_key = keep(n.a_key, HAS_A_KEY, &mut present);
        r.b_key = keep(n.b_key, HAS_B_KEY, &mut present);
        r.alpha_key = keep(n.alpha_key, HAS_ALPHA_KEY, &mut present);
        r.bias_key = keep(n.bias_key, HAS_BIAS_KEY, &mut present);
        r.magnitude_key = keep(n.magnitude_key, HAS_MAGNITUDE_KEY, &mut present);
        r.extra_keys = span_of(self.extra.len(), 0);
        r.present = present;
        self.records.push(r);
        true
    }

    /// Copies a module's names in: the first factor's name holds the key (its start), which holds
    /// the name and leaf.
    #[inline(always)]
    fn add_names(&mut self, m: &Names<'_>) -> NameSpans {
        let source = m.a_key.or(m.b_key).unwrap_or("");
        let base = m.a_key.or(m.b_key).map(|k| self.add_text(k));
        let key = self.place(m.key, source, base);
        let name = self.place(m.name, m.key, Some(key));
        let leaf = self.place(m.leaf, m.key, Some(key));
        let b_key = match (m.a_key, m.b_key) {
            (None, Some(_)) => base,
            (_, b) => b.map(|b| self.add_text(b)),
        };
        NameSpans {
            key,
            name,
            leaf,
            a_key: if m.a_key.is_some() { base } else { None },
            b_key,
            alpha_key: m.alpha_key.map(|k| self.add_text(k)),
            bias_key: m.bias_key.map(|k| self.add_text(k)),
            magnitude_key: m.magnitude_key.map(|k| self.add_text(k)),
        }
    }

    /// Sets the expert count of every per-expert (`expert_2d`) module: the adapter's, known only
    /// once all its modules are read.
    pub(crate) fn set_expert_2d_count(&mut self, num_experts: u64) {
        for r in &mut self.records {
            if r.kind == ModuleKind::Expert2d {
                r.num_experts = num_experts;
                r.present |= HAS_NUM_EXPERTS;
            }
        }
    }

    fn view(&self, r: &Record) -> ModuleInfo<'_> {
        let text = |s: Span| &self.text[s.range()];
        let dims = |s: Span| &self.dims[s.range()];
        let n = r.numbers();
        ModuleInfo {
            key: text(r.key),
            name: text(r.name),
            leaf: text(r.leaf),
            kind: r.kind,
            layer: n.layer,
            expert: n.expert,
            num_experts: n.num_experts,
            rank: n.rank,
            in_features: n.in_features,
            out_features: n.out_features,
            dtype: r.dtype,
            a_key: r.get(HAS_A_KEY, r.a_key).map(text),
            b_key: r.get(HAS_B_KEY, r.b_key).map(text),
            a_shape: r.get(HAS_A_SHAPE, r.a_shape).map(dims),
            b_shape: r.get(HAS_B_SHAPE, r.b_shape).map(dims),
            alpha: n.alpha,
            alpha_key: r.get(HAS_ALPHA_KEY, r.alpha_key).map(text),
            bias_key: r.get(HAS_BIAS_KEY, r.bias_key).map(text),
            magnitude_key: r.get(HAS_MAGNITUDE_KEY, r.magnitude_key).map(text),
            extra_keys: self.extra[r.extra_keys.range()].iter().map(|&s| text(s)).collect(),
            config_rank: n.config_rank,
            use_rslora: n.use_rslora,
        }
    }

    #[inline]
    fn add_text(&mut self, s: &str) -> Span {
        let start = self.text.len();
        self.text.push_str(s);
        span_of(start, s.len())
    }

    /// `s` as a part of the text at `within`, which was copied from `source`, when it is: when `s`
    /// lies inside `source` in memory (a key is a slice of its tensor's name, a module name and leaf
    /// slices of the key), or else starts or ends it. Otherwise `s` is added.
    #[inline(always)]
    fn place(&mut self, s: &str, source: &str, within: Option<Span>) -> Span {
        let Some(w) = within else {
            return self.add_text(s);
        };
        let offset = (s.as_ptr() as usize).wrapping_sub(source.as_ptr() as usize);
        if offset <= source.len() && s.len() <= source.len() - offset {
            return span_of(w.start as usize + offset, s.len());
        }
        if source.starts_with(s) {
            return span_of(w.start as usize, s.len());
        }
        if source.ends_with(s) {
            return span_of(w.range().end - s.len(), s.len());
        }
        self.add_text(s)
    }

    #[inline]
    fn add_dims(&mut self, shape: &[u64]) -> Span {
        let start = self.dims.len();
        // Shapes are short: one by one costs less than the call `extend_from_slice` makes to `memcpy`.
        for &d in shape {
            self.dims.push(d);
        }
        span_of(start, shape.len())
    }
}

/// A span of the buffers' 32-bit positions (see [`Span`] for why they fit).
fn span_of(start: usize, len: usize) -> Span {
    Span {
        start: start as u32,
        len: len as u32,
    }
}

/// As a list of modules: two stores of the same modules print alike, however their text is laid out.
impl fmt::Debug for Modules {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_list().entries(self.iter()).finish()
    }
}

/// Equal when they hold the same modules, whatever the buffers' layout.
impl PartialEq for Modules {
    fn eq(&self, other: &Modules) -> bool {
        self.len() == other.len() && self.iter().eq(other.iter())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn module<'m>(key: &'m str, a: Option<&'m str>, b: Option<&'m str>, shape: &'m [u64]) -> ModuleInfo<'m> {
        ModuleInfo {
            key,
            name: key.strip_prefix("base_model.model.").unwrap_or(key),
            leaf: key.rsplit('.').next().unwrap_or(key),
            kind: ModuleKind::Linear,
            layer: Some(3),
            expert: None,
            num_experts: None,
            rank: Some(8),
            in_features: Some(64),
            out_features: Some(16),
            dtype: Some(Dtype::BF16),
            a_key: a,
            b_key: b,
            a_shape: Some(shape),
            b_shape: None,
            alpha: Some(16.0),
            alpha_key: None,
            bias_key: Some("bias"),
            magnitude_key: None,
            extra_keys: vec!["x.hada_w1_a", "x.hada_w1_b"],
            config_rank: Some(8),
            use_rslora: false,
        }
    }

    #[test]
    fn modules_read_back_as_pushed_and_share_their_keys_text() {
        let key = "base_model.model.layers.3.q_proj";
        let (a, b) = (format!("{key}.lora_A.weight"), format!("{key}.lora_B.weight"));
        let pushed = [
            module(key, Some(&a), Some(&b), &[8, 64]),
            module(key, None, Some(&b), &[]),
            module("orphan", None, None, &[1, 2, 3]),
            // A key that no factor's name starts with is stored whole.
            module("other.k_proj", Some(&a), None, &[4]),
        ];
        let mut store = Modules::default();
        for m in &pushed {
            store.push(m);
        }
        let back: Vec<ModuleInfo<'_>> = store.iter().collect();
        assert_eq!(back, pushed);
        assert_eq!(store.get(2), Some(pushed[2].clone()));
        assert_eq!(store.get(4), None);
        // The first module's key, name and leaf are parts of its lora_A name: no text of their own.
        let first_text = a.len() + b.len() + "bias".len() + "x.hada_w1_ax.hada_w1_b".len();
        let mut one = Modules::default();
        one.push(&pushed[0]);
        assert_eq!(one.text.len(), first_text);
    }

    #[test]
    fn numbers_read_back_as_the_modules_have_them() {
        let key = "base_model.model.layers.3.q_proj";
        let mut pushed = vec![module(key, None, None, &[2]); 4];
        // Every number distinct, and each absent in one module.
        for (i, m) in pushed.iter_mut().enumerate() {
            let n = i as u64 * 10;
            (m.layer, m.expert, m.num_experts) = (Some(n as u32 + 1), Some(n as u32 + 2), Some(n + 3));
            (m.rank, m.in_features, m.out_features) = (Some(n + 4), Some(n + 5), Some(n + 6));
            (m.config_rank, m.alpha, m.use_rslora) = (Some(n + 7), Some(n as f64 + 8.5), i % 2 == 0);
        }
        (pushed[1].layer, pushed[1].rank, pushed[1].alpha) = (None, None, None);
        (pushed[2].expert, pushed[2].in_features, pushed[2].config_rank) = (None, None, None);
        (pushed[3].num_experts, pushed[3].out_features) = (None, None);
        let mut store = Modules::default();
        for m in &pushed {
            store.push(m);
        }
        let numbers: Vec<ModuleNumbers> = store.numbers().collect();
        let want: Vec<ModuleNumbers> = pushed.iter().map(ModuleInfo::numbers).collect();
        assert_eq!(numbers, want);
    }

    #[test]
    fn strings_read_back_as_the_views_have_them() {
        let (a, b) = ("base_model.model.layers.3.q_proj.lora_A.weight", "other.lora_B");
        let mut pushed = vec![
            module("base_model.model.layers.3.q_proj", Some(a), Some(b), &[2]),
            module("layers.4.v_proj", None, Some(b), &[2]),
            module("layers.5.o_proj", Some(a), None, &[2]),
        ];
        pushed[1].dtype = None;
        pushed[2].kind = ModuleKind::Embedding;
        let mut store = Modules::default();
        for m in &pushed {
            store.push(m);
        }
        let want: Vec<ModuleStrings> = store
            .iter()
            .map(|m| {
                [
                    Some(m.name),
                    Some(m.key),
                    Some(m.leaf),
                    Some(m.kind.name()),
                    m.dtype.map(Dtype::name),
                    m.a_key,
                    m.b_key,
                ]
            })
            .collect();
        assert_eq!(store.strings().collect::<Vec<_>>(), want);
        assert_eq!(want[1][4], None);
        assert_eq!(want[2][6], None);
    }

    #[test]
    fn a_record_takes_152_bytes() {
        assert_eq!(std::mem::size_of::<Record>(), 152);
    }

    #[test]
    fn equal_modules_compare_and_print_alike_whatever_their_layout() {
        let key = "m.q_proj";
        let a = format!("{key}.lora_A");
        let m = module(key, Some(&a), None, &[2]);
        let mut packed = Modules::default();
        packed.push(&m);
        let mut spread = packed.clone();
        // The same module with its text laid out otherwise.
        spread.text.insert_str(0, "padding");
        for r in &mut spread.records {
            for s in [&mut r.key, &mut r.name, &mut r.leaf] {
                s.start += 7;
            }
            for s in [&mut r.a_key, &mut r.bias_key] {
                s.start += 7;
            }
        }
        for s in &mut spread.extra {
            s.start += 7;
        }
        assert_eq!(packed, spread);
        assert_eq!(format!("{packed:?}"), format!("{spread:?}"));
        let mut expert = packed.clone();
        expert.records[0].kind = ModuleKind::Expert2d;
        expert.set_expert_2d_count(4);
        assert_eq!(expert.get(0).map(|m| m.num_experts), Some(Some(4)));
        assert_ne!(packed, expert);
    }
}
