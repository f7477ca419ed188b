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

/// A range of [`Modules`]' text or dims. 32 bits are enough: the text of one adapter's records
/// is at most a few times its header, which is at most 100 MB.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Span {
    start: u32,
    len: u32,
}

impl Span {
    fn range(self) -> Range<usize> {
        self.start as usize..self.start as usize + self.len as usize
    }
}

/// One module's record as stored: the numbers themselves, names and shapes as spans.
#[derive(Debug, Clone)]
struct Record {
    kind: ModuleKind,
    dtype: Option<Dtype>,
    use_rslora: bool,
    layer: Option<u32>,
    expert: Option<u32>,
    num_experts: Option<u64>,
    rank: Option<u64>,
    in_features: Option<u64>,
    out_features: Option<u64>,
    alpha: Option<f64>,
    config_rank: Option<u64>,
    key: Span,
    name: Span,
    leaf: Span,
    a_key: Option<Span>,
    b_key: Option<Span>,
    alpha_key: Option<Span>,
    bias_key: Option<Span>,
    magnitude_key: Option<Span>,
    /// Into `dims`.
    a_shape: Option<Span>,
    /// Into `dims`.
    b_shape: Option<Span>,
    /// Into `extra`.
    extra_keys: Span,
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

    /// Adds a module, copying its names and shapes in.
    pub fn push(&mut self, m: &ModuleInfo<'_>) {
        // The first factor's name holds the key (its start), which holds the name and leaf.
        let source = m.a_key.or(m.b_key).unwrap_or("");
        let base = m.a_key.or(m.b_key).map(|k| self.add_text(k));
        let key = self.place(m.key, source, base);
        let name = self.place(m.name, m.key, Some(key));
        let leaf = self.place(m.leaf, m.key, Some(key));
        let a_key = if m.a_key.is_some() { base } else { None };
        let b_key = match (m.a_key, m.b_key) {
            (None, Some(_)) => base,
            (_, b) => b.map(|b| self.add_text(b)),
        };
        let extra_start = self.extra.len();
        for k in &m.extra_keys {
            let span = self.add_text(k);
            self.extra.push(span);
        }
        let record = Record {
            kind: m.kind,
            dtype: m.dtype,
            use_rslora: m.use_rslora,
            layer: m.layer,
            expert: m.expert,
            num_experts: m.num_experts,
            rank: m.rank,
            in_features: m.in_features,
            out_features: m.out_features,
            alpha: m.alpha,
            config_rank: m.config_rank,
            key,
            name,
            leaf,
            a_key,
            b_key,
            alpha_key: m.alpha_key.map(|k| self.add_text(k)),
            bias_key: m.bias_key.map(|k| self.add_text(k)),
            magnitude_key: m.magnitude_key.map(|k| self.add_text(k)),
            a_shape: m.a_shape.map(|s| self.add_dims(s)),
            b_shape: m.b_shape.map(|s| self.add_dims(s)),
            extra_keys: span_of(extra_start, self.extra.len() - extra_start),
        };
        self.records.push(record);
    }

    /// Sets the expert count of every per-expert (`expert_2d`) module: the adapter's, known only
    /// once all its modules are read.
    pub(crate) fn set_expert_2d_count(&mut self, num_experts: u64) {
        for r in &mut self.records {
            if r.kind == ModuleKind::Expert2d {
                r.num_experts = Some(num_experts);
            }
        }
    }

    fn view(&self, r: &Record) -> ModuleInfo<'_> {
        let text = |s: Span| &self.text[s.range()];
        let dims = |s: Span| &self.dims[s.range()];
        ModuleInfo {
            key: text(r.key),
            name: text(r.name),
            leaf: text(r.leaf),
            kind: r.kind,
            layer: r.layer,
            expert: r.expert,
            num_experts: r.num_experts,
            rank: r.rank,
            in_features: r.in_features,
            out_features: r.out_features,
            dtype: r.dtype,
            a_key: r.a_key.map(text),
            b_key: r.b_key.map(text),
            a_shape: r.a_shape.map(dims),
            b_shape: r.b_shape.map(dims),
            alpha: r.alpha,
            alpha_key: r.alpha_key.map(text),
            bias_key: r.bias_key.map(text),
            magnitude_key: r.magnitude_key.map(text),
            extra_keys: self.extra[r.extra_keys.range()].iter().map(|&s| text(s)).collect(),
            config_rank: r.config_rank,
            use_rslora: r.use_rslora,
        }
    }

    fn add_text(&mut self, s: &str) -> Span {
        let start = self.text.len();
        self.text.push_str(s);
        span_of(start, s.len())
    }

    /// `s` as a part of the text at `within`, which was copied from `source`, when it is: when `s`
    /// lies inside `source` in memory (a key is a slice of its tensor's name, a module name and leaf
    /// slices of the key), or else starts or ends it. Otherwise `s` is added.
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

    fn add_dims(&mut self, shape: &[u64]) -> Span {
        let start = self.dims.len();
        self.dims.extend_from_slice(shape);
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
            for s in [&mut r.a_key, &mut r.bias_key].into_iter().flatten() {
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
