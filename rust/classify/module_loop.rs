//! The module loop: each group of tensors resolved to a module (kind, names, checks, flags, record),
//! and what the loop gathers from one module to the next.

use std::borrow::Cow;

use crate::codes::{Flag, ProblemCode};
use crate::config::{same_tagged, short_tag, LoraConfig, TargetModules};
use crate::header::Header;
use crate::names::{self, Variant};

use super::classification::MAX_PROBLEMS;
use super::grouping::Group;
use super::modules::{Names, Repeated};
use super::shapes::{add_totals, check_factors, dims, module_kind, variant_dims, Dims, Factors};
use super::targets::{check_target, target_parameter_leaves, ComponentIndex, TargetTally};
use super::templates::{name_free, Template};
use super::{Classification, Configs, Format, ModuleInfo, ModuleKind, Modules, MoeLayout, Options};

/// What a module's record takes besides its names: the answers of the checks, its own numbers
/// and its config.
struct Answers<'c> {
    kind: ModuleKind,
    layer: Option<u32>,
    expert: Option<u32>,
    dims: Dims,
    /// Its experts, its own expert number counted (`add_totals`).
    n_exp: Option<u64>,
    config: Option<&'c LoraConfig>,
    config_rank: Option<u64>,
}

/// The module loop: what it knows of the adapter, and what it gathers from one module to the next.
pub(super) struct ModuleLoop<'h, 'c> {
    header: &'h Header<'h>,
    configs: Configs<'c>,
    components: ComponentIndex<'c>,
    /// The leaves of the inner and outer PEFT target-parameter wrappers.
    inner_outer: (&'static str, &'static str),
    format: Format,
    /// Kohya and LyCORIS names: leaves read as kohya spells them.
    kohya_names: bool,
    keep_modules: bool,
    /// Whether modules may share answers through `templates` (see `Template`).
    templates_ok: bool,
    /// Each module's `.alpha` value, read from the file.
    alphas: Vec<Option<f64>>,
    layers: LayerSet,
    leaves: Leaves<'h>,
    /// `MoeLayout` bits seen.
    layouts: u8,
    pub(super) tally: TargetTally<'h>,
    templates: Vec<Template<'h>>,
    /// The template the previous module matched (modules come in the same order in every layer).
    last_hit: usize,
    modules: Modules,
}

impl<'h, 'c> ModuleLoop<'h, 'c> {
    pub(super) fn new(
        header: &'h Header<'h>,
        configs: Configs<'c>,
        groups: &[Group<'h>],
        alphas: Vec<Option<f64>>,
        format: Format,
        opts: Options,
        reuse: bool,
    ) -> Self {
        let tally = TargetTally {
            matched: match configs.file.and_then(|c| c.target_modules.as_ref()) {
                Some(TargetModules::List(list)) => vec![false; list.len()],
                _ => Vec::new(),
            },
            memo: Vec::new(),
            // With one config for every module, hits that depend on the last component alone repeat.
            memo_ok: configs.file.is_some_and(|c| c.last_only_hits("").is_some()),
            params: Vec::new(),
        };
        // Modules that differ only in their layer (or expert) number get the same answers from the
        // checks, when nothing there reads the whole name (see `Template`): the first of them is
        // resolved in full and remembered, the rest only add their layer, expert and record.
        let templates_ok =
            reuse && configs.components.is_empty() && configs.file.map_or(true, |c| name_free(c, tally.memo_ok));
        let mut modules = Modules::default();
        if opts.keep_modules {
            let text = header.tensors.iter().map(|t| t.name.len()).sum();
            modules.reserve(groups.len(), text, header.dims.len());
        }
        ModuleLoop {
            header,
            configs,
            components: ComponentIndex::new(configs.components),
            inner_outer: target_parameter_leaves(configs.any()),
            format,
            kohya_names: matches!(format, Format::Kohya | Format::Lycoris),
            keep_modules: opts.keep_modules,
            templates_ok,
            alphas,
            layers: LayerSet::new(groups.len()),
            leaves: Leaves::default(),
            layouts: 0,
            tally,
            templates: Vec::new(),
            last_hit: usize::MAX,
            modules,
        }
    }

    /// Resolves module `gi` (group `g`): its kind, names, dims, checks, flags and record.
    pub(super) fn resolve(&mut self, gi: usize, g: &Group<'h>, out: &mut Classification) {
        let f = self.factors(g);
        let parts = names::parts(g.key);
        let probe = self.probe(g, f, &parts);
        if let Some((i, p)) = probe.as_ref().and_then(|p| Some((self.find_template(p)?, p))) {
            self.repeat_template(i, gi, g, f, &parts, p.leaf, out);
            return;
        }
        let problems_before = out.problems.len();
        let kind = module_kind(g, f, parts.expert);
        let (name, leaf) = self.name_and_leaf(g, kind, &parts);
        self.leaves.insert(leaf);
        if let Some(l) = parts.layer {
            self.layers.insert(l);
        }
        let config = self.configs.for_key(g.key, &self.components);
        let config_rank = config.and_then(|c| c.rank_for(names::pattern_name(g.key)));
        let dims = self.module_dims(kind, g, f, config_rank, &name, out);
        check_factors(
            kind,
            g,
            f,
            dims,
            config_rank,
            &name,
            self.format,
            &self.header.tensors,
            out,
        );
        if let Some(c) = config {
            check_target(c, kind, &name, parts.last, leaf, &mut self.tally, out);
        }
        self.note_flags_and_layout(g, kind, f, out);
        if let Some(t) = probe {
            self.remember(t, kind, dims, problems_before, out);
        }
        let n_exp = add_totals(dims, parts.expert, out);
        if self.keep_modules {
            let answers = Answers {
                kind,
                layer: parts.layer,
                expert: parts.expert,
                dims,
                n_exp,
                config,
                config_rank,
            };
            self.record(gi, g, f, &name, leaf, answers);
        }
    }

    /// The A and B factors of `g` and their shapes.
    fn factors(&self, g: &Group<'h>) -> Factors<'h> {
        let (a, b) = if g.emb_a.is_some() || g.emb_b.is_some() {
            (g.emb_a, g.emb_b)
        } else {
            (g.a, g.b)
        };
        let header = self.header;
        let shape = |i: Option<u32>| i.map(|i| header.shape(&header.tensors[i as usize]));
        Factors {
            a,
            b,
            a_shape: shape(a),
            b_shape: shape(b),
        }
    }

    /// The inputs a template compares, for a plain A/B module (never target parameters: those read
    /// the name); None when this module cannot share answers.
    fn probe(&self, g: &Group<'h>, f: Factors<'h>, parts: &names::KeyParts<'h>) -> Option<Template<'h>> {
        let (Some(ia), Some(ib), Some(sa), Some(sb)) = (g.a, g.b, f.a_shape, f.b_shape) else {
            return None;
        };
        if !self.templates_ok
            || g.variant.is_some()
            || g.emb_a.is_some()
            || g.emb_b.is_some()
            || g.key.ends_with("experts.base_layer")
            || g.key.ends_with(".experts")
        {
            return None;
        }
        let tensors = &self.header.tensors;
        let leaf = names::leaf_of(g.key, parts, self.kohya_names);
        Some(Template {
            leaf_tag: short_tag(leaf),
            leaf,
            last: parts.last,
            a_shape: sa,
            b_shape: sb,
            dtypes: (tensors[ia as usize].dtype, tensors[ib as usize].dtype),
            bits: u8::from(g.bias.is_some())
                | u8::from(g.magnitude.is_some()) << 1
                | u8::from(g.alpha.is_some()) << 2
                | u8::from(parts.expert.is_some()) << 3
                // Read only for a 3-D factor (`Stacked3d`'s layout): a search per module costs.
                | u8::from(sa.len() == 3 && memchr::memmem::find(g.key.as_bytes(), b"experts").is_some()) << 4,
            kind: ModuleKind::Incomplete,
            dims: None,
            record: usize::MAX,
        })
    }

    /// The template with the same inputs as `probe`: first the one after the last one hit.
    fn find_template(&self, probe: &Template<'_>) -> Option<usize> {
        let next = self.last_hit.wrapping_add(1) % self.templates.len().max(1);
        match self.templates.get(next) {
            Some(t) if t.same_inputs(probe) => Some(next),
            _ => self.templates.iter().position(|t| t.same_inputs(probe)),
        }
    }

    /// A module that matched template `i`: the template's answers, its own layer, expert and record
    /// (`leaf`: its own, as its probe read it).
    #[allow(clippy::too_many_arguments)]
    fn repeat_template(
        &mut self,
        i: usize,
        gi: usize,
        g: &Group<'h>,
        f: Factors<'h>,
        parts: &names::KeyParts<'h>,
        leaf: &str,
        out: &mut Classification,
    ) {
        self.last_hit = i;
        // The answers, not the whole template: a copy of it costs a dozen moves per module.
        let (kind, like, Some(dims)) = (self.templates[i].kind, self.templates[i].record, self.templates[i].dims)
        else {
            return;
        };
        if let Some(l) = parts.layer {
            self.layers.insert(l);
        }
        let n_exp = add_totals(dims, parts.expert, out);
        if self.keep_modules {
            // The name and config answers are this module's own (a template never has a
            // `rank_pattern` to read, but the alpha may come from an `alpha_pattern`).
            let name = names::strip_prefix(g.key);
            let config = self.configs.for_key(g.key, &self.components);
            let config_rank = config.and_then(|c| c.rank_for(names::pattern_name(g.key)));
            // Everything else in its record is the template's (a kohya `lora_mid`, which a
            // template does not compare, is not).
            if g.mid.is_none() {
                let tensors = &self.header.tensors;
                let tname = |i: Option<u32>| i.map(|i| tensors[i as usize].name.as_ref());
                let own = Repeated {
                    names: Names {
                        key: g.key,
                        name,
                        leaf,
                        a_key: tname(g.a),
                        b_key: tname(g.b),
                        alpha_key: tname(g.alpha),
                        bias_key: tname(g.bias),
                        magnitude_key: tname(g.magnitude),
                    },
                    layer: parts.layer,
                    expert: parts.expert,
                    num_experts: n_exp,
                    alpha: self.alphas[gi].or_else(|| config.and_then(|c| c.alpha_for(names::pattern_name(g.key)))),
                    config_rank,
                };
                if self.modules.push_like(like, &own) {
                    return;
                }
            }
            let answers = Answers {
                kind,
                layer: parts.layer,
                expert: parts.expert,
                dims,
                n_exp,
                config,
                config_rank,
            };
            self.record(gi, g, f, name, leaf, answers);
        }
    }

    /// Remembers a fully resolved module's answers for the same module in later layers. Only a
    /// module that raised no problem: a problem's message names its module.
    fn remember(&mut self, mut t: Template<'h>, kind: ModuleKind, dims: Dims, before: usize, out: &Classification) {
        if out.problems.len() == before && before < MAX_PROBLEMS && self.templates.len() < 32 {
            (t.kind, t.dims) = (kind, Some(dims));
            // This module's record, which `record` pushes next.
            t.record = if self.keep_modules {
                self.modules.len()
            } else {
                usize::MAX
            };
            self.templates.push(t);
            self.last_hit = self.templates.len() - 1;
        }
    }

    /// The module's name in the base model and its leaf. A target-parameters module is named by
    /// the wrapper's module (`...experts.gate_up_proj`), whose leaf the config decides.
    fn name_and_leaf(&self, g: &Group<'h>, kind: ModuleKind, parts: &names::KeyParts<'h>) -> (Cow<'h, str>, &'h str) {
        let name = names::strip_prefix(g.key);
        if kind != ModuleKind::TargetParameters {
            return (Cow::Borrowed(name), names::leaf_of(g.key, parts, self.kohya_names));
        }
        let leaf = if g.key.ends_with("base_layer") {
            self.inner_outer.0
        } else {
            self.inner_outer.1
        };
        let base = name.trim_end_matches(".base_layer");
        (Cow::Owned(format!("{base}.{leaf}")), leaf)
    }

    /// Ranks, features and experts from the factors' shapes: a target-parameters module's experts
    /// come from the configured rank, a variant's numbers from its own factors.
    fn module_dims(
        &self,
        kind: ModuleKind,
        g: &Group<'h>,
        f: Factors<'h>,
        config_rank: Option<u64>,
        name: &str,
        out: &mut Classification,
    ) -> Dims {
        let mut d = dims(kind, f.a_shape, f.b_shape);
        if kind == ModuleKind::TargetParameters {
            if let (Some(rows), Some(r)) = (d.rank, config_rank) {
                if r > 0 && rows % r == 0 {
                    d.n_exp = Some(rows / r);
                    d.rank = Some(r);
                } else {
                    out.problem(
                        ProblemCode::MoeRankNotDivisible,
                        format_args!(
                            "module {name:?}: lora_A has {rows} rows, not a multiple of the configured rank {r}"
                        ),
                        None,
                    );
                }
            }
        }
        if let ModuleKind::Variant(v) = kind {
            (d.rank, d.in_f, d.out_f) = variant_dims(v, g, self.header);
        }
        d
    }

    /// The adapter flags and MoE layout bits a module shows.
    fn note_flags_and_layout(&mut self, g: &Group<'h>, kind: ModuleKind, f: Factors<'h>, out: &mut Classification) {
        if g.magnitude.is_some() {
            out.flags |= Flag::Dora.bit();
        }
        if g.bias.is_some() {
            out.flags |= Flag::LoraBias.bit();
        }
        if g.alpha.is_some() {
            out.flags |= Flag::KohyaAlpha.bit();
        }
        match kind {
            ModuleKind::Embedding => out.flags |= Flag::Embeddings.bit(),
            ModuleKind::Conv => out.flags |= Flag::Conv.bit(),
            ModuleKind::Variant(v) if !out.variants.contains(&v) => out.variants.push(v),
            ModuleKind::Expert2d => self.layouts |= 1 << MoeLayout::PerExpert2d as u8,
            ModuleKind::TargetParameters => self.layouts |= 1 << MoeLayout::PeftTargetParameters as u8,
            ModuleKind::Stacked3d if g.key.contains("experts") => {
                // A 0-d factor has no leading dim: it says nothing about the layout.
                let outer = f.a_shape.is_some_and(|s| s.first() == Some(&1))
                    || f.b_shape.is_some_and(|s| s.first() == Some(&1));
                self.layouts |= 1
                    << if outer {
                        MoeLayout::SharedOuter as u8
                    } else {
                        MoeLayout::Stacked3d as u8
                    };
            }
            _ => {}
        }
    }

    /// Adds the module's record (`keep_modules`).
    fn record(&mut self, gi: usize, g: &Group<'h>, f: Factors<'h>, name: &str, leaf: &str, answers: Answers<'_>) {
        let Answers {
            kind,
            layer,
            expert,
            dims,
            n_exp,
            config,
            config_rank,
        } = answers;
        let tensors = &self.header.tensors;
        let tname = |i: Option<u32>| i.map(|i| tensors[i as usize].name.as_ref());
        let mut extra: Vec<&str> = g
            .variant_tensors
            .iter()
            .map(|&i| tensors[i as usize].name.as_ref())
            .collect();
        if let Some(m) = g.mid {
            extra.push(&tensors[m as usize].name);
        }
        self.modules.push(&ModuleInfo {
            key: g.key,
            name,
            leaf,
            kind,
            layer,
            expert,
            num_experts: n_exp,
            rank: dims.rank,
            in_features: dims.in_f,
            out_features: dims.out_f,
            dtype: f.a.or(f.b).map(|i| tensors[i as usize].dtype),
            a_key: tname(f.a),
            b_key: tname(f.b),
            a_shape: f.a_shape,
            b_shape: f.b_shape,
            alpha: self.alphas[gi].or_else(|| config.and_then(|c| c.alpha_for(names::pattern_name(g.key)))),
            alpha_key: tname(g.alpha),
            bias_key: tname(g.bias),
            magnitude_key: tname(g.magnitude),
            extra_keys: extra,
            config_rank,
            use_rslora: config.is_some_and(|c| c.use_rslora),
        });
    }

    /// What the loop gathered, into `out`: layers, target modules, MoE layout, the records.
    pub(super) fn finish(mut self, out: &mut Classification) {
        out.variants.sort();
        if out.flags & Flag::Dora.bit() != 0 || out.variants.iter().any(|v| *v != Variant::Diff) {
            out.flags |= Flag::NonAdditive.bit();
        }
        out.moe_layout = match self.layouts.count_ones() {
            0 => MoeLayout::Dense,
            1 => match self.layouts.trailing_zeros() {
                1 => MoeLayout::PerExpert2d,
                2 => MoeLayout::Stacked3d,
                3 => MoeLayout::SharedOuter,
                _ => MoeLayout::PeftTargetParameters,
            },
            _ => MoeLayout::Mixed,
        };
        out.layers = self.layers.into_sorted();
        out.target_modules = self.leaves.list.into_iter().map(|(_, l)| l.to_owned()).collect();
        // A per-expert module's expert count is the adapter's, known only now.
        self.modules.set_expert_2d_count(out.num_experts);
        if let Some(kept) = std::sync::Arc::get_mut(&mut out.modules) {
            *kept = self.modules;
        }
    }
}

/// The distinct leaves, in first-seen order. Leaves repeat in every layer: a few distinct ones
/// are compared by tag before text; past 32 a hash set takes over (a scan per module over many
/// distinct leaves is quadratic).
#[derive(Default)]
struct Leaves<'k> {
    list: Vec<(u64, &'k str)>,
    index: rustc_hash::FxHashSet<&'k str>,
}

impl<'k> Leaves<'k> {
    #[inline]
    fn insert(&mut self, leaf: &'k str) {
        if self.list.len() < 32 {
            let leaf_tag = short_tag(leaf);
            if !self
                .list
                .iter()
                .any(|&(tag, l)| tag == leaf_tag && same_tagged(leaf, l))
            {
                self.list.push((leaf_tag, leaf));
            }
            return;
        }
        if self.index.is_empty() {
            self.index.extend(self.list.iter().map(|&(_, l)| l));
        }
        if self.index.insert(leaf) {
            self.list.push((0, leaf));
        }
    }
}

/// The layer indices seen, sorted and without repeats at the end. Small indices go to a bit mask
/// of at most one word per module, so its size follows the count of modules, never the largest
/// index (a name with `layers.999999999` must not cost 125 MB); larger ones to a list.
struct LayerSet {
    mask: Vec<u64>,
    max_words: usize,
    far: Vec<u32>,
}

impl LayerSet {
    pub(super) fn new(modules: usize) -> LayerSet {
        LayerSet {
            mask: Vec::new(),
            max_words: modules.max(1),
            far: Vec::new(),
        }
    }

    #[inline]
    fn insert(&mut self, layer: u32) {
        let word = (layer / 64) as usize;
        if word >= self.max_words {
            self.far.push(layer);
            return;
        }
        if self.mask.len() <= word {
            self.mask.resize(word + 1, 0);
        }
        self.mask[word] |= 1 << (layer % 64);
    }

    fn into_sorted(mut self) -> Vec<u32> {
        let mut out = Vec::new();
        for (w, bits) in self.mask.iter().enumerate() {
            let mut bits = *bits;
            while bits != 0 {
                out.push(w as u32 * 64 + bits.trailing_zeros());
                bits &= bits - 1;
            }
        }
        // Every far index is above every masked one.
        self.far.sort_unstable();
        self.far.dedup();
        out.extend(self.far);
        out
    }
}
