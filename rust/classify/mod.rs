//! Per-adapter classification from a validated header (and the adapter's config, when it has one):
//! format, modules with ranks and scales, MoE layout, flags and every inconsistency found.

use std::borrow::Cow;
use std::fmt;
use std::fs::File;
use std::os::unix::fs::FileExt;
use std::path::Path;

use crate::codes::{Flag, ProblemCode};
use crate::config::{same_tagged, short_tag, LoraConfig, TargetModules};
use crate::header::{Dtype, Header, TensorEntry};
use crate::names::{self, Role, Spelling, Variant};

mod modules;
pub use modules::{ModuleInfo, ModuleNumbers, ModuleStrings, Modules};
use modules::{Names, Repeated};

/// The tensor naming scheme an adapter is written in (docs/scan.md describes each).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub enum Format {
    /// PEFT: `base_model.model.<module>.lora_A.weight`.
    Peft = 0,
    /// diffusers: PEFT spelling under component prefixes (`unet.`, `transformer.`).
    Diffusers = 1,
    /// Old diffusers attention processors (`.lora_linear_layer.down.weight`, `_lora.down.weight`).
    DiffusersLegacy = 2,
    /// kohya sd-scripts: `lora_unet_..._proj.lora_down.weight` with `.alpha` scalars.
    Kohya = 3,
    /// LyCORIS variants (LoHa, LoKr, ...) by their factor names.
    Lycoris = 4,
    /// XLabs Flux adapters.
    Xlabs = 5,
    /// ai-toolkit Flux adapters (PEFT spelling on `double_blocks.` / `single_blocks.`).
    AiToolkit = 6,
    /// None of the above.
    Unknown = 7,
}

impl Format {
    /// Every format's name, in discriminant order (the `format` column's dictionary).
    pub const NAMES: [&'static str; 8] = [
        "peft",
        "diffusers",
        "diffusers_legacy",
        "kohya",
        "lycoris",
        "xlabs",
        "ai_toolkit",
        "unknown",
    ];

    /// The format's name (`"peft"`).
    pub fn name(self) -> &'static str {
        Self::NAMES[self as usize]
    }
}

/// How an adapter stores mixture-of-experts LoRA weights.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
#[repr(u8)]
pub enum MoeLayout {
    /// No expert modules.
    Dense = 0,
    /// One 2-D A/B pair per expert (`experts.3.w1`).
    PerExpert2d = 1,
    /// 3-D factors with a leading expert dimension.
    Stacked3d = 2,
    /// 3-D factors, one side shared by every expert (leading dimension 1).
    SharedOuter = 3,
    /// PEFT `target_parameters` on fused expert weights (`experts.base_layer`).
    PeftTargetParameters = 4,
    /// More than one of the above.
    Mixed = 5,
}

impl MoeLayout {
    /// Every layout's name, in discriminant order (the `moe_layout` column's dictionary).
    pub const NAMES: [&'static str; 6] = [
        "dense",
        "per_expert_2d",
        "stacked_3d",
        "shared_outer",
        "peft_target_parameters",
        "mixed",
    ];

    /// The layout's name (`"stacked_3d"`).
    pub fn name(self) -> &'static str {
        Self::NAMES[self as usize]
    }
}

/// What kind of module a group of tensors makes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ModuleKind {
    /// A 2-D A/B pair on a linear layer.
    Linear,
    /// 4-D or 5-D factors on a convolution.
    Conv,
    /// `lora_embedding_A` / `lora_embedding_B` on an embedding.
    Embedding,
    /// A 2-D pair on one expert of a MoE layer.
    Expert2d,
    /// 3-D factors holding every expert.
    Stacked3d,
    /// PEFT `target_parameters` on fused expert weights.
    TargetParameters,
    /// A LyCORIS / PEFT variant (LoHa, LoKr, OFT, ...).
    Variant(Variant),
    /// Only orphan tensors (an A without B, an alpha alone).
    Incomplete,
}

impl ModuleKind {
    /// Every kind's name, variants in `Variant` order (exported to Python as `MODULE_KINDS`).
    pub const NAMES: [&'static str; 14] = [
        "linear",
        "conv",
        "embedding",
        "expert_2d",
        "stacked_3d",
        "target_parameters",
        "loha",
        "lokr",
        "oft",
        "boft",
        "ia3",
        "glora",
        "diff",
        "incomplete",
    ];

    /// Every kind, in the order of [`ModuleKind::NAMES`].
    pub fn all() -> impl Iterator<Item = ModuleKind> {
        [
            ModuleKind::Linear,
            ModuleKind::Conv,
            ModuleKind::Embedding,
            ModuleKind::Expert2d,
            ModuleKind::Stacked3d,
            ModuleKind::TargetParameters,
        ]
        .into_iter()
        .chain(Variant::ALL.into_iter().map(ModuleKind::Variant))
        .chain([ModuleKind::Incomplete])
    }

    /// The kind's name, as in [`ModuleKind::NAMES`].
    pub fn name(self) -> &'static str {
        match self {
            ModuleKind::Linear => "linear",
            ModuleKind::Conv => "conv",
            ModuleKind::Embedding => "embedding",
            ModuleKind::Expert2d => "expert_2d",
            ModuleKind::Stacked3d => "stacked_3d",
            ModuleKind::TargetParameters => "target_parameters",
            ModuleKind::Variant(v) => v.name(),
            ModuleKind::Incomplete => "incomplete",
        }
    }
}

/// One inconsistency found in an adapter (docs/errors.md lists the codes).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Problem {
    /// What kind of problem.
    pub code: ProblemCode,
    /// What is wrong, naming the module or tensor.
    pub message: String,
    /// The tensor concerned, when one is.
    pub tensor: Option<String>,
}

/// Problems kept per adapter; past this a single "too_many_problems" entry stands for the rest.
const MAX_PROBLEMS: usize = 200;

/// Everything known about one adapter.
#[derive(Debug, Clone)]
pub struct Classification {
    /// The naming scheme.
    pub format: Format,
    /// The config's `peft_type`.
    pub peft_type: Option<String>,
    /// Tensors in the header.
    pub num_tensors: u32,
    /// The dtypes the tensors use, in `Dtype::ALL` order.
    pub dtypes: Vec<Dtype>,
    /// The layer numbers in module names, sorted, without repeats.
    pub layers: Vec<u32>,
    /// The config's `base_model_name_or_path`.
    pub base_model: Option<String>,
    /// The distinct module leaves (`q_proj`), in first-seen order.
    pub target_modules: Vec<String>,
    /// The largest LoRA rank of any module.
    pub rank: u64,
    /// How MoE weights are laid out.
    pub moe_layout: MoeLayout,
    /// The largest expert count of any module (0 for a dense adapter).
    pub num_experts: u64,
    /// `Flag` bits.
    pub flags: u32,
    /// The LyCORIS / PEFT variants present, sorted.
    pub variants: Vec<Variant>,
    /// Tensors saved whole (`modules_to_save`, embeddings), not as LoRA factors.
    pub full_weight_tensors: Vec<String>,
    /// Every inconsistency found, in the order found (at most `MAX_PROBLEMS` and one more).
    pub problems: Vec<Problem>,
    /// Shared: a remembered classification (`memo`) hands the same modules to every adapter it matches.
    pub modules: std::sync::Arc<Modules>,
    /// A tensor name that appears twice, found while grouping a header read with
    /// `parse_header_unchecked_names` (the scan then reports it as a `duplicate_tensor` header
    /// error; nothing else here is meaningful). Always None for a fully checked header.
    pub duplicate_tensor: Option<String>,
}

impl Classification {
    /// Out of line and cold: problems are rare, and keeping their formatting out of the module
    /// loop keeps that loop's registers for the common path.
    #[cold]
    #[inline(never)]
    fn problem(&mut self, code: ProblemCode, message: fmt::Arguments<'_>, tensor: Option<&str>) {
        if self.problems.len() < MAX_PROBLEMS {
            self.problems.push(Problem {
                code,
                message: message.to_string(),
                tensor: tensor.map(str::to_owned),
            });
        } else if self.problems.len() == MAX_PROBLEMS {
            self.problems.push(Problem {
                code: ProblemCode::TooManyProblems,
                message: format!("more than {MAX_PROBLEMS} problems; the rest are not listed"),
                tensor: None,
            });
        }
    }
}

/// Tensors of one module, as indices into the header.
#[derive(Default)]
struct Group<'h> {
    key: &'h str,
    a: Option<u32>,
    b: Option<u32>,
    bias: Option<u32>,
    magnitude: Option<u32>,
    alpha: Option<u32>,
    mid: Option<u32>,
    emb_a: Option<u32>,
    emb_b: Option<u32>,
    variant: Option<Variant>,
    variant_tensors: Vec<u32>,
}

/// Module key -> group index, by open addressing sized once for the whole header: cheaper than
/// a general hash map for the one lookup per module.
struct KeyIndex {
    /// Group index + 1; 0 is an empty slot.
    slots: Vec<u32>,
    mask: usize,
}

impl KeyIndex {
    fn new(keys: usize) -> KeyIndex {
        let size = (keys * 2).next_power_of_two().max(16);
        KeyIndex {
            slots: vec![0; size],
            mask: size - 1,
        }
    }

    /// The group of `key`, or `next` after recording it as a new one.
    #[inline]
    fn get_or_insert(&mut self, key: &str, groups: &[Group<'_>], next: usize) -> usize {
        let mut slot = names::hash_bytes(key.as_bytes()) as usize & self.mask;
        loop {
            match self.slots[slot] {
                0 => {
                    self.slots[slot] = next as u32 + 1;
                    return next;
                }
                g if groups[g as usize - 1].key == key => return g as usize - 1,
                _ => slot = (slot + 1) & self.mask,
            }
        }
    }
}

/// Options for one classification.
#[derive(Debug, Clone, Copy, Default)]
pub struct Options {
    /// Build the per-module records (`Classification::modules`); a scan for rows alone leaves them out.
    pub keep_modules: bool,
}

/// Where the adapter's config came from.
#[derive(Debug, Clone, Copy, Default)]
pub struct Configs<'c> {
    /// `adapter_config.json` next to the weights.
    pub file: Option<&'c LoraConfig>,
    /// diffusers `lora_adapter_metadata`, one config per component prefix (`"unet."`).
    pub components: &'c [(String, LoraConfig)],
}

impl<'c> Configs<'c> {
    /// The config that governs a module key: the file's, or the first component (in key order)
    /// whose prefix the key starts with.
    fn for_key(&self, key: &str, index: &ComponentIndex<'_>) -> Option<&'c LoraConfig> {
        self.file.or_else(|| {
            let by_prefix = match &index.0 {
                None => self.components.iter().find(|(p, _)| key.starts_with(p.as_str())),
                // Prefixes end with a dot: look up each of the key's dotted prefixes.
                Some(map) => memchr::memchr_iter(b'.', key.as_bytes())
                    .filter_map(|i| map.get(&key[..=i]).copied())
                    .min()
                    .and_then(|i| self.components.get(i)),
            };
            by_prefix
                .or(if self.components.len() == 1 {
                    self.components.first()
                } else {
                    None
                })
                .map(|(_, c)| c)
        })
    }

    fn any(&self) -> Option<&'c LoraConfig> {
        self.file.or_else(|| self.components.first().map(|(_, c)| c))
    }
}

/// Classifies one adapter from its validated header and its config(s): format, modules, ranks,
/// MoE layout, flags and every problem found. `weight_path` is the file kohya `.alpha` scalars
/// are read from. Never panics, whatever the header holds.
pub fn classify(header: &Header<'_>, configs: Configs<'_>, weight_path: &Path, opts: Options) -> Classification {
    classify_with(header, configs, weight_path, opts, true)
}

/// `classify`, with `reuse` deciding whether modules that repeat per layer may share their
/// answers (`Template`); the tests compare the two ways.
fn classify_with(
    header: &Header<'_>,
    configs: Configs<'_>,
    weight_path: &Path,
    opts: Options,
    reuse: bool,
) -> Classification {
    let mut out = Classification::of_config(header, configs.any());
    let Grouping {
        groups,
        spelling_seen,
        dtype_mask,
        repeat,
    } = group_tensors(&header.tensors, header.names_checked, &mut out, configs.any());
    if let Some(i) = repeat {
        out.duplicate_tensor = Some(header.tensors[i].name.to_string());
        return out;
    }
    out.dtypes = dtypes_in(dtype_mask);
    out.format = detect_format(header, configs.file, &spelling_seen, &groups);
    // Scalars (kohya alphas) are the only tensor data we read: a few bytes each.
    let alphas = read_alphas(header, &groups, weight_path, &mut out);
    let mut modules = ModuleLoop::new(header, configs, &groups, alphas, out.format, opts, reuse);
    for (gi, g) in groups.iter().enumerate() {
        modules.resolve(gi, g, &mut out);
    }
    report_unmatched_targets(configs.file, &modules.tally.matched, !groups.is_empty(), &mut out);
    report_config_problems(configs, &mut out);
    add_config_flags(configs.any(), &mut out);
    modules.finish(&mut out);
    out
}

impl Classification {
    /// The classification before any tensor is read: what the config says, and the header's warnings.
    fn of_config(header: &Header<'_>, config: Option<&LoraConfig>) -> Classification {
        let mut out = Classification {
            format: Format::Unknown,
            peft_type: config.and_then(|c| c.peft_type.clone()),
            num_tensors: header.tensors.len() as u32,
            dtypes: Vec::new(),
            layers: Vec::new(),
            base_model: config.and_then(|c| c.base_model_name_or_path.clone()),
            target_modules: Vec::new(),
            rank: 0,
            moe_layout: MoeLayout::Dense,
            num_experts: 0,
            flags: if config.is_some() { Flag::HasConfig.bit() } else { 0 },
            variants: Vec::new(),
            full_weight_tensors: Vec::new(),
            problems: Vec::new(),
            modules: std::sync::Arc::default(),
            duplicate_tensor: None,
        };
        for w in &header.warnings {
            out.problem(w.code, format_args!("{}", w.message), None);
        }
        out
    }
}

/// The dtypes whose bits are set in `mask`, in `Dtype::ALL` order.
fn dtypes_in(mask: u32) -> Vec<Dtype> {
    Dtype::ALL
        .iter()
        .copied()
        .filter(|d| mask & (1 << (*d as u32)) != 0)
        .collect()
}

/// A module's factors: its A and B tensors (the embedding pair when it has one) and their shapes.
#[derive(Clone, Copy)]
struct Factors<'h> {
    a: Option<u32>,
    b: Option<u32>,
    a_shape: Option<&'h [u64]>,
    b_shape: Option<&'h [u64]>,
}

/// What a module's shapes (and config) give: ranks as A and B see them, features and experts.
#[derive(Clone, Copy)]
struct Dims {
    rank: Option<u64>,
    b_rank: Option<u64>,
    in_f: Option<u64>,
    out_f: Option<u64>,
    n_exp: Option<u64>,
}

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
struct ModuleLoop<'h, 'c> {
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
    tally: TargetTally<'h>,
    templates: Vec<Template<'h>>,
    /// The template the previous module matched (modules come in the same order in every layer).
    last_hit: usize,
    modules: Modules,
}

impl<'h, 'c> ModuleLoop<'h, 'c> {
    fn new(
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
    fn resolve(&mut self, gi: usize, g: &Group<'h>, out: &mut Classification) {
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
    fn finish(mut self, out: &mut Classification) {
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

/// The kind of module a group's tensors make.
fn module_kind(g: &Group<'_>, f: Factors<'_>, expert: Option<u32>) -> ModuleKind {
    let two_d = |s: Option<&[u64]>| s.is_some_and(|s| s.len() == 2);
    if let Some(v) = g.variant {
        ModuleKind::Variant(v)
    } else if f.a.is_none() || f.b.is_none() {
        ModuleKind::Incomplete
    } else if g.emb_a.is_some() {
        ModuleKind::Embedding
    } else if g.key.ends_with("experts.base_layer")
        || (g.key.ends_with(".experts") && (two_d(f.a_shape) || two_d(f.b_shape)))
    {
        ModuleKind::TargetParameters
    } else {
        match f.a_shape.map_or(0, <[u64]>::len) {
            3 => ModuleKind::Stacked3d,
            4 | 5 => ModuleKind::Conv,
            _ if expert.is_some() => ModuleKind::Expert2d,
            _ => ModuleKind::Linear,
        }
    }
}

/// A module's consistency problems: a missing factor, ranks or dtypes that disagree between A and
/// B, a rank the config does not give.
#[allow(clippy::too_many_arguments)]
fn check_factors(
    kind: ModuleKind,
    g: &Group<'_>,
    f: Factors<'_>,
    dims: Dims,
    config_rank: Option<u64>,
    name: &str,
    format: Format,
    tensors: &[TensorEntry<'_>],
    out: &mut Classification,
) {
    match kind {
        ModuleKind::Incomplete => {
            let what = if f.a.is_some() {
                (ProblemCode::MissingLoraB, "has lora_A but no lora_B")
            } else if f.b.is_some() {
                (ProblemCode::MissingLoraA, "has lora_B but no lora_A")
            } else {
                (ProblemCode::OrphanTensor, "has no lora_A/lora_B pair")
            };
            out.problem(what.0, format_args!("module {:?} {}", g.key, what.1), None);
        }
        ModuleKind::Variant(_) => {}
        _ => {
            // Ranks and features are read from fixed dimensions (2 for linear, embedding, per-expert
            // and target-parameters modules): a factor with other dimensions gives missing or wrong
            // numbers, so its module is not clean.
            let want = match kind {
                ModuleKind::Stacked3d => 3,
                ModuleKind::Conv => f.a_shape.map_or(4, <[u64]>::len), // 4 or 5; lora_B like lora_A
                _ => 2,
            };
            for (factor, shape) in [("lora_A", f.a_shape), ("lora_B", f.b_shape)] {
                if let Some(shape) = shape.filter(|s| s.len() != want) {
                    out.problem(
                        ProblemCode::InvalidFactorShape,
                        format_args!(
                            "module {:?}: {factor} has shape {shape:?}, but a {} module's factors have {want} dimensions",
                            g.key,
                            kind.name()
                        ),
                        None,
                    );
                }
            }
            let a_rank = if kind == ModuleKind::TargetParameters {
                f.a_shape.and_then(|s| s.first().copied())
            } else {
                dims.rank
            };
            if let (Some(ra), Some(rb)) = (a_rank, dims.b_rank) {
                if ra != rb {
                    out.problem(
                        ProblemCode::RankMismatch,
                        format_args!("module {:?}: lora_A rank {ra} but lora_B rank {rb}", g.key),
                        None,
                    );
                }
            }
            let dtype = |i: Option<u32>| i.and_then(|i| tensors.get(i as usize)).map(|t| t.dtype);
            if let Some((da, db)) = dtype(f.a).zip(dtype(f.b)).filter(|(da, db)| da != db) {
                out.problem(
                    ProblemCode::DtypeMismatch,
                    format_args!(
                        "module {:?}: lora_A is {} but lora_B is {}",
                        g.key,
                        da.name(),
                        db.name()
                    ),
                    None,
                );
            }
            if kind != ModuleKind::TargetParameters {
                if let (Some(r), Some(cr)) = (dims.rank, config_rank) {
                    if r != cr && format == Format::Peft {
                        out.problem(
                            ProblemCode::ConfigRankMismatch,
                            format_args!(
                                "module {name:?}: rank {r} in the tensors but the config (r / rank_pattern) gives {cr}"
                            ),
                            None,
                        );
                    }
                }
            }
        }
    }
}

/// Adds a module's experts and rank to the adapter's; returns the module's expert count (its
/// own expert number counts).
fn add_totals(dims: Dims, expert: Option<u32>, out: &mut Classification) -> Option<u64> {
    let mut n_exp = dims.n_exp;
    if let Some(e) = expert {
        n_exp = Some(n_exp.unwrap_or(0).max(u64::from(e) + 1));
    }
    out.num_experts = out.num_experts.max(n_exp.unwrap_or(0));
    out.rank = out.rank.max(dims.rank.unwrap_or(0));
    n_exp
}

/// Entries of the config file's `target_modules` list that no module matched (none are reported
/// for a file without modules).
fn report_unmatched_targets(file: Option<&LoraConfig>, matched: &[bool], any_module: bool, out: &mut Classification) {
    let Some(TargetModules::List(list)) = file.and_then(|c| c.target_modules.as_ref()) else {
        return;
    };
    for (t, matched) in list.iter().zip(matched) {
        if !matched && any_module {
            out.problem(
                ProblemCode::TargetModulesMismatch,
                format_args!("config target_modules entry {t:?} matches no tensor in the file"),
                None,
            );
        }
    }
}

/// Problems of the config(s) themselves: patterns lorafast cannot evaluate, and fields of the
/// wrong type (read as absent) in every config read, each diffusers component's included.
fn report_config_problems(configs: Configs<'_>, out: &mut Classification) {
    if let Some(c) = configs.any() {
        for p in &c.bad_patterns {
            out.problem(
                ProblemCode::UnsupportedPattern,
                format_args!("pattern {p:?} is not a regex lorafast can evaluate"),
                None,
            );
        }
    }
    let components = configs.components.iter().map(|(p, c)| (p.as_str(), c));
    for (prefix, c) in configs.file.map(|c| ("", c)).into_iter().chain(components) {
        for message in &c.invalid_fields {
            out.problem(
                ProblemCode::InvalidConfigField,
                format_args!(
                    "{}{message}",
                    if prefix.is_empty() {
                        String::new()
                    } else {
                        format!("component {prefix:?}: ")
                    }
                ),
                None,
            );
        }
    }
}

/// The flags and variant the config states: features lorafast does not model, DoRA, a non-LoRA
/// `peft_type`.
fn add_config_flags(config: Option<&LoraConfig>, out: &mut Classification) {
    let Some(c) = config else { return };
    if !c.unsupported_features.is_empty() {
        out.flags |= Flag::UnsupportedFeatures.bit();
    }
    if c.use_dora {
        out.flags |= Flag::Dora.bit();
    }
    if let Some(v) = c.peft_type.as_deref().and_then(variant_of_peft_type) {
        if !out.variants.contains(&v) {
            out.variants.push(v);
        }
    }
}

/// What the module loop reads of a plain A/B module besides its name, and what it concluded.
/// Two modules with equal inputs whose names differ only where nothing reads them (the layer and
/// expert numbers, when `name_free` holds) get the same kind, dims, flags, layout and target
/// matches; the second then only adds its layer, expert and record.
#[derive(Clone, Copy)]
struct Template<'h> {
    leaf_tag: u64,
    leaf: &'h str,
    last: &'h str,
    a_shape: &'h [u64],
    b_shape: &'h [u64],
    dtypes: (Dtype, Dtype),
    /// bias, magnitude, alpha present; an expert number; a 3-D A with "experts" in the key.
    bits: u8,
    /// The answers: set when the template is remembered.
    kind: ModuleKind,
    dims: Option<Dims>,
    /// The index of its module's record, when records are kept (else `usize::MAX`).
    record: usize,
}

impl Template<'_> {
    /// Inlined: an out-of-line call per module and template costs more than the compare.
    #[inline(always)]
    fn same_inputs(&self, other: &Template<'_>) -> bool {
        self.leaf_tag == other.leaf_tag
            && self.bits == other.bits
            && self.dtypes == other.dtypes
            && same_dims(self.a_shape, other.a_shape)
            && same_dims(self.b_shape, other.b_shape)
            && same_tagged(self.leaf, other.leaf)
            // `last` is usually `leaf` itself (the same bytes): then equal leaves are enough.
            && ((same_str(self.last, self.leaf) && same_str(other.last, other.leaf)) || self.last == other.last)
    }
}

/// The same slice (address and length), not merely equal text.
#[inline]
fn same_str(a: &str, b: &str) -> bool {
    std::ptr::eq(a, b)
}

/// Equal shapes, element by element: shapes are short, and a slice compare calls `memcmp`.
#[inline]
fn same_dims(a: &[u64], b: &[u64]) -> bool {
    a.len() == b.len() && a.iter().zip(b).all(|(x, y)| x == y)
}

/// Does nothing in the module loop read a module's whole name under this config? Ranks come from
/// `r` alone (no `rank_pattern`) and targets from the last component alone (`memo_ok`: a list of
/// dotless entries), from a pattern matching everything, or are not given.
fn name_free(c: &LoraConfig, memo_ok: bool) -> bool {
    c.rank_pattern.is_empty()
        && match &c.target_modules {
            None => true,
            Some(TargetModules::List(_)) => memo_ok,
            Some(TargetModules::Pattern(p)) => p == "all-linear" || p == "all",
        }
}

/// Component prefix -> position, when there are too many components to try each per module
/// (the first match by position is the rule; a scan per module is quadratic).
struct ComponentIndex<'c>(Option<rustc_hash::FxHashMap<&'c str, usize>>);

impl<'c> ComponentIndex<'c> {
    fn new(components: &'c [(String, LoraConfig)]) -> Self {
        if components.len() <= 16 || !components.iter().all(|(p, _)| p.ends_with('.')) {
            return ComponentIndex(None);
        }
        let mut map = rustc_hash::FxHashMap::default();
        for (i, (p, _)) in components.iter().enumerate() {
            map.entry(p.as_str()).or_insert(i);
        }
        ComponentIndex(Some(map))
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
    fn new(modules: usize) -> LayerSet {
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

/// Tensors grouped by module key, and what the grouping saw on the way.
struct Grouping<'h> {
    groups: Vec<Group<'h>>,
    spelling_seen: [bool; 5],
    dtype_mask: u32,
    /// The first tensor whose name repeats an earlier one (only looked for when the header's
    /// names are unchecked).
    repeat: Option<usize>,
}

/// Groups tensors by module key; problems of single tensors (unknown names, two spellings of
/// one factor) go to `out`. Its own function: a loop small enough to keep its state in registers.
#[inline(never)]
fn group_tensors<'h>(
    tensors: &'h [TensorEntry<'_>],
    names_checked: bool,
    out: &mut Classification,
    config: Option<&LoraConfig>,
) -> Grouping<'h> {
    let mut index = KeyIndex::new(tensors.len());
    let mut groups: Vec<Group<'_>> = Vec::with_capacity(tensors.len() / 2 + 1);
    let mut spelling_seen = [false; 5];
    let mut dtype_mask: u32 = 0;
    // For a header whose names are unchecked: tensors outside any factor slot, the first repeat
    // seen, and whether a slot changed hands (then only a full check is exact).
    let find_repeats = !names_checked;
    let mut loose: Vec<u32> = Vec::new();
    let mut repeat: Option<u32> = None;
    let mut slot_changed = false;
    for (i, t) in tensors.iter().enumerate() {
        dtype_mask |= 1 << (t.dtype as u32);
        let Some((key, role, spelling)) = names::split(&t.name) else {
            loose.push(i as u32);
            unsorted_tensor(out, &t.name, config);
            continue;
        };
        spelling_seen[spelling as usize] = true;
        if role == Role::TrainableTokens {
            loose.push(i as u32);
            out.flags |= Flag::TrainableTokens.bit();
            continue;
        }
        // A module's tensors are usually adjacent (A then B): only a new key costs a lookup.
        let g = match groups.last() {
            Some(last) if last.key == key => groups.len() - 1,
            _ => {
                let next = groups.len();
                let g = index.get_or_insert(key, &groups, next);
                if g == next {
                    groups.push(Group {
                        key,
                        ..Group::default()
                    });
                }
                g
            }
        };
        let group = &mut groups[g];
        let i = i as u32;
        let slot = match role {
            Role::A => &mut group.a,
            Role::B => &mut group.b,
            Role::Bias => &mut group.bias,
            Role::Magnitude => &mut group.magnitude,
            Role::Alpha => &mut group.alpha,
            Role::Mid => &mut group.mid,
            Role::EmbeddingA => &mut group.emb_a,
            Role::EmbeddingB => &mut group.emb_b,
            Role::TrainableTokens => continue,
            Role::Variant(v) => {
                if find_repeats
                    && group
                        .variant_tensors
                        .iter()
                        .any(|&j| tensors[j as usize].name == t.name)
                {
                    repeat = repeat.or(Some(i));
                }
                group.variant = Some(v);
                group.variant_tensors.push(i);
                continue;
            }
        };
        if let Some(before) = slot.replace(i) {
            if find_repeats && tensors[before as usize].name == t.name {
                repeat = repeat.or(Some(i));
            } else {
                slot_changed = true;
                // Two spellings of the same factor (e.g. `.lora_A` and `.lora_A.weight`).
                out.problem(
                    ProblemCode::DuplicateFactor,
                    format_args!("module {key:?} has two tensors for the same factor"),
                    Some(&t.name),
                );
            }
        }
    }
    if find_repeats {
        // Equal names always land in the same slot, list or group, so each check above sees
        // every repeat of its own kind; only a slot that changed hands can hide one.
        let first = if slot_changed {
            crate::header::first_repeat(tensors.iter().map(|t| t.name.as_ref())).map(|i| i as u32)
        } else {
            let in_loose = crate::header::first_repeat(loose.iter().map(|&i| tensors[i as usize].name.as_ref()));
            match (repeat, in_loose.map(|k| loose[k])) {
                (Some(a), Some(b)) => Some(a.min(b)),
                (a, b) => a.or(b),
            }
        };
        repeat = first;
    }
    Grouping {
        groups,
        spelling_seen,
        dtype_mask,
        repeat: repeat.map(|i| i as usize),
    }
}

/// A tensor whose name has no LoRA role: a full weight PEFT saved on purpose, or something unknown.
fn unsorted_tensor(out: &mut Classification, name: &str, config: Option<&LoraConfig>) {
    let saved_embedding =
        name.ends_with("embed_tokens.base_layer.weight") || name.ends_with("lm_head.base_layer.weight");
    let in_modules_to_save = config.is_some_and(|c| c.saves(name));
    if saved_embedding {
        out.flags |= Flag::FullWeights.bit();
    } else if in_modules_to_save {
        out.flags |= Flag::ModulesToSave.bit() | Flag::FullWeights.bit();
    } else {
        out.problem(
            ProblemCode::UnknownTensor,
            format_args!("no rule understands tensor name {name:?}"),
            Some(name),
        );
        return;
    }
    out.full_weight_tensors.push(name.to_owned());
}

/// Which module the inner (`experts.base_layer`) and outer (`experts`) PEFT ParamWrappers hold.
/// PEFT nests the wrappers in the model's parameter order, so with both targeted the inner one is
/// `gate_up_proj` whatever order the config lists them in.
fn target_parameter_leaves(config: Option<&LoraConfig>) -> (&'static str, &'static str) {
    match config.map(|c| c.target_parameters.as_slice()) {
        Some([only]) => {
            let leaf = if only.ends_with("down_proj") || only.ends_with("w2") {
                "down_proj"
            } else {
                "gate_up_proj"
            };
            (leaf, leaf)
        }
        _ => ("gate_up_proj", "down_proj"),
    }
}

/// Ranks (as A and B give them), features and experts from a module's factor shapes.
fn dims(kind: ModuleKind, a: Option<&[u64]>, b: Option<&[u64]>) -> Dims {
    let at = |s: Option<&[u64]>, i: usize| s.and_then(|s| s.get(i).copied());
    match kind {
        ModuleKind::Stacked3d => Dims {
            rank: at(a, 1),
            b_rank: at(b, 2),
            in_f: at(a, 2),
            out_f: at(b, 1),
            n_exp: at(a, 0).max(at(b, 0)),
        },
        _ => Dims {
            rank: at(a, 0),
            b_rank: at(b, 1),
            in_f: at(a, 1),
            out_f: at(b, 0),
            n_exp: None,
        },
    }
}

/// (rank, in, out) of a LyCORIS/PEFT variant module from its factor shapes. LoHa: `w1_a (out, r)`,
/// `w1_b (r, in)`. LoKr: the delta is `kron(w1, w2)`, each side given whole or as `a @ b`; the rank
/// comes from a factorised side (None, meaning scale 1, when neither is).
fn variant_dims(v: Variant, g: &Group<'_>, header: &Header<'_>) -> (Option<u64>, Option<u64>, Option<u64>) {
    let shape = |suffix: &str| {
        g.variant_tensors
            .iter()
            .map(|&i| &header.tensors[i as usize])
            .find(|t| t.name.ends_with(suffix))
            .map(|t| header.shape(t))
    };
    let dim = |s: Option<&[u64]>, i: usize| s.and_then(|s| s.get(i).copied());
    match v {
        Variant::Loha => {
            let (w1a, w1b) = (shape(".hada_w1_a"), shape(".hada_w1_b"));
            // A leading 0 dim makes a valid tensor whatever the rest multiply to: check.
            let input = w1b
                .and_then(|s| s.get(1..))
                .and_then(|rest| rest.iter().try_fold(1u64, |n, &d| n.checked_mul(d)));
            (dim(w1b, 0), input, dim(w1a, 0))
        }
        Variant::Lokr => {
            // (rows, cols) of one Kronecker side, and its rank when factorised.
            let side = |whole: &str, a: &str, b: &str| match shape(whole) {
                Some(s) => (dim(Some(s), 0), dim(Some(s), 1), None),
                None => (dim(shape(a), 0), dim(shape(b), 1), dim(shape(b), 0)),
            };
            let (r1, c1, k1) = side(".lokr_w1", ".lokr_w1_a", ".lokr_w1_b");
            let (r2, c2, k2) = side(".lokr_w2", ".lokr_w2_a", ".lokr_w2_b");
            let mul = |x: Option<u64>, y: Option<u64>| x.zip(y).and_then(|(x, y)| x.checked_mul(y));
            (k2.or(k1), mul(c1, c2), mul(r1, r2))
        }
        _ => (None, None, None),
    }
}

fn variant_of_peft_type(peft_type: &str) -> Option<Variant> {
    match peft_type.to_ascii_uppercase().as_str() {
        "LOHA" => Some(Variant::Loha),
        "LOKR" => Some(Variant::Lokr),
        "OFT" => Some(Variant::Oft),
        "BOFT" => Some(Variant::Boft),
        "IA3" => Some(Variant::Ia3),
        _ => None,
    }
}

/// What the module loop learns about the `target_modules` list entries.
struct TargetTally<'k> {
    /// Per entry of the adapter_config.json list: matched by some module. Empty for diffusers
    /// component configs (no unmatched-entry report there).
    matched: Vec<bool>,
    /// Hit masks by last component (`LoraConfig::last_only_hits`), when `memo_ok`.
    memo: Vec<(u64, &'k str, u64)>,
    memo_ok: bool,
    /// (config address, leaf, whether its `target_parameters` cover the leaf).
    params: Vec<(usize, String, bool)>,
}

impl<'k> TargetTally<'k> {
    /// Records which list entries match the module `name` (last component `last`); returns
    /// whether any does.
    fn hits(&mut self, c: &LoraConfig, name: &str, last: &'k str) -> bool {
        if self.memo_ok {
            let tag = short_tag(last);
            let known = self
                .memo
                .iter()
                .find(|e| e.0 == tag && same_tagged(last, e.1))
                .map(|e| e.2);
            if let Some(mask) = known.or_else(|| c.last_only_hits(last)) {
                // Bounded: a scan of many distinct last components would be quadratic.
                if known.is_none() && self.memo.len() < 64 {
                    self.memo.push((tag, last, mask));
                }
                let mut bits = mask;
                while bits != 0 {
                    if let Some(m) = self.matched.get_mut(bits.trailing_zeros() as usize) {
                        *m = true;
                    }
                    bits &= bits - 1;
                }
                return mask != 0;
            }
        }
        let matched = &mut self.matched;
        c.list_hits(name, last, |i| {
            if let Some(m) = matched.get_mut(i) {
                *m = true;
            }
        })
    }
}

fn check_target<'k>(
    c: &LoraConfig,
    kind: ModuleKind,
    name: &str,
    last: &'k str,
    leaf: &str,
    tally: &mut TargetTally<'k>,
    out: &mut Classification,
) {
    if kind == ModuleKind::TargetParameters {
        // Two leaves, each checked once per config: a scan of the list per module is quadratic.
        let key = (std::ptr::from_ref(c) as usize, leaf);
        let covered = match tally.params.iter().find(|(k, l, _)| (*k, l.as_str()) == key) {
            Some(&(_, _, covered)) => covered,
            None => {
                let covered = c.target_parameters.iter().any(|p| p.ends_with(leaf));
                if tally.params.len() < 8 {
                    tally.params.push((key.0, leaf.to_owned(), covered));
                }
                covered
            }
        };
        if !c.target_parameters.is_empty() && !covered {
            out.problem(
                ProblemCode::TargetModulesMismatch,
                format_args!("module {name:?} has expert tensors but {leaf:?} is not in config target_parameters"),
                None,
            );
        }
        return;
    }
    if let Some(TargetModules::List(_)) = &c.target_modules {
        let any = tally.hits(c, name, last);
        // Embeddings saved under `modules_to_save`-style names and trainable tokens are not targets.
        if !any && kind != ModuleKind::Incomplete {
            out.problem(
                ProblemCode::TargetModulesMismatch,
                format_args!("module {name:?} has LoRA tensors but is not matched by config target_modules"),
                None,
            );
        }
    } else if c.targets(name) == Some(false) && kind != ModuleKind::Incomplete {
        out.problem(
            ProblemCode::TargetModulesMismatch,
            format_args!("module {name:?} has LoRA tensors but does not match the config target_modules pattern"),
            None,
        );
    }
}

/// Picks the format from the spellings seen, key prefixes and the presence of a config.
fn detect_format(
    header: &Header<'_>,
    config: Option<&LoraConfig>,
    spelling: &[bool; 5],
    groups: &[Group<'_>],
) -> Format {
    let has = |s: Spelling| spelling[s as usize];
    let any_key = |pred: &dyn Fn(&str) -> bool| groups.iter().any(|g| pred(g.key));
    let kohya_prefix = |k: &str| {
        [
            "lora_unet_",
            "lora_te_",
            "lora_te1_",
            "lora_te2_",
            "lora_te3_",
            "lora_prior_",
            "lora_transformer_",
            "lycoris_",
        ]
        .iter()
        .any(|p| k.starts_with(p))
    };
    let lycoris = groups.iter().any(|g| g.variant.is_some());
    if config.is_some() && (has(Spelling::Peft) || groups.iter().any(|g| g.emb_a.is_some() || g.variant.is_some())) {
        return Format::Peft;
    }
    if lycoris {
        return Format::Lycoris;
    }
    if has(Spelling::Kohya) && any_key(&kohya_prefix) {
        return Format::Kohya;
    }
    if has(Spelling::Xlabs) {
        return Format::Xlabs;
    }
    if has(Spelling::Peft) {
        let flux_blocks = |k: &str| {
            let k = k.strip_prefix("base_model.model.").unwrap_or(k);
            let k = k.strip_prefix("transformer.").unwrap_or(k);
            k.starts_with("double_blocks.") || k.starts_with("single_blocks.")
        };
        if any_key(&flux_blocks) {
            return Format::AiToolkit;
        }
        let component = |k: &str| {
            [
                "unet.",
                "transformer.",
                "text_encoder.",
                "text_encoder_2.",
                "prior.",
                "diffusion_model.",
            ]
            .iter()
            .any(|p| k.starts_with(p))
        };
        if header.metadata_value("lora_adapter_metadata").is_some() || any_key(&component) {
            return Format::Diffusers;
        }
        return Format::Peft;
    }
    if has(Spelling::DiffusersLegacy) {
        return Format::DiffusersLegacy;
    }
    if has(Spelling::Kohya) {
        return Format::Kohya;
    }
    if config.is_some() && !groups.is_empty() {
        return Format::Peft;
    }
    Format::Unknown
}

/// Reads each module's 0-d `.alpha` value (a few bytes per module, by pread).
fn read_alphas(header: &Header<'_>, groups: &[Group<'_>], path: &Path, out: &mut Classification) -> Vec<Option<f64>> {
    let mut alphas = vec![None; groups.len()];
    if !groups.iter().any(|g| g.alpha.is_some()) {
        return alphas;
    }
    let file = match File::open(path) {
        Ok(f) => f,
        Err(e) => {
            out.problem(
                ProblemCode::InvalidAlpha,
                format_args!("cannot reopen the file to read alpha values: {e}"),
                None,
            );
            return alphas;
        }
    };
    for (slot, g) in alphas.iter_mut().zip(groups) {
        let Some(i) = g.alpha else { continue };
        let t = &header.tensors[i as usize];
        // Checked: `classify` must not panic, even on a header no validation has seen.
        let nelem = header.shape(t).iter().try_fold(1u64, |n, &d| n.checked_mul(d));
        if nelem != Some(1) {
            let nelem = nelem.map_or_else(|| "too many".to_owned(), |n| n.to_string());
            out.problem(
                ProblemCode::InvalidAlpha,
                format_args!("alpha tensor {:?} has {nelem} elements, expected 1", t.name),
                Some(&t.name),
            );
            continue;
        }
        let mut buf = [0u8; 8];
        let width = (t.dtype.bits() / 8) as usize;
        let at = header.data_start().saturating_add(t.begin);
        let value = match file.read_exact_at(&mut buf[..width.min(8)], at) {
            Ok(()) => scalar(t.dtype, &buf),
            Err(_) => None,
        };
        match value {
            // sd-scripts treats alpha 0 as "no alpha": alpha = rank, scale 1.
            Some(0.0) => {}
            Some(v) if v.is_finite() => *slot = Some(v),
            _ => out.problem(
                ProblemCode::InvalidAlpha,
                format_args!(
                    "alpha tensor {:?} ({}) is not a readable finite number",
                    t.name,
                    t.dtype.name()
                ),
                Some(&t.name),
            ),
        }
    }
    alphas
}

fn scalar(dtype: Dtype, b: &[u8; 8]) -> Option<f64> {
    let u16v = u16::from_le_bytes([b[0], b[1]]);
    Some(match dtype {
        Dtype::F32 => f64::from(f32::from_le_bytes([b[0], b[1], b[2], b[3]])),
        Dtype::F64 => f64::from_le_bytes(*b),
        Dtype::BF16 => f64::from(f32::from_bits(u32::from(u16v) << 16)),
        Dtype::F16 => f16_to_f64(u16v),
        Dtype::I64 => i64::from_le_bytes(*b) as f64,
        Dtype::I32 => f64::from(i32::from_le_bytes([b[0], b[1], b[2], b[3]])),
        Dtype::I16 => f64::from(i16::from_le_bytes([b[0], b[1]])),
        Dtype::U8 => f64::from(b[0]),
        Dtype::I8 => f64::from(b[0] as i8),
        _ => return None,
    })
}

fn f16_to_f64(h: u16) -> f64 {
    let sign = if h >> 15 == 1 { -1.0 } else { 1.0 };
    let exp = i32::from((h >> 10) & 0x1f);
    let frac = f64::from(h & 0x3ff);
    match exp {
        0 => sign * frac * 2f64.powi(-24),
        31 => {
            if frac == 0.0 {
                sign * f64::INFINITY
            } else {
                f64::NAN
            }
        }
        _ => sign * (1.0 + frac / 1024.0) * 2f64.powi(exp - 15),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A header of `tensors` (name, shape; BF16) laid out in order, and its file size.
    fn header_json(tensors: &[(String, Vec<u64>)]) -> (String, u64) {
        let mut at = 0;
        let entries: Vec<String> = tensors
            .iter()
            .map(|(name, shape)| {
                let size = shape.iter().product::<u64>() * 2;
                let dims: Vec<String> = shape.iter().map(u64::to_string).collect();
                let entry = format!(
                    "\"{name}\":{{\"dtype\":\"BF16\",\"shape\":[{}],\"data_offsets\":[{at},{}]}}",
                    dims.join(","),
                    at + size
                );
                at += size;
                entry
            })
            .collect();
        let json = format!("{{{}}}", entries.join(","));
        let size = 8 + json.len() as u64 + at;
        (json, size)
    }

    /// Modules that repeat per layer share their answers (`Template`), except where the name or a
    /// problem decides: every problem is still reported for its own module, and every record is
    /// the module's own, as a module-by-module pass (`reuse` off) gives them.
    #[test]
    fn templates_give_what_a_module_by_module_pass_gives() {
        let mut tensors = Vec::new();
        for layer in 0..6u64 {
            for (m, out) in [
                ("q_proj", 64),
                ("v_proj", 16),
                ("mlp.experts.3.up_proj", 32),
                ("o_proj", 64),
            ] {
                let key = format!("base_model.model.model.layers.{layer}.{m}");
                // Layer 2's q_proj B disagrees on the rank, layer 4's v_proj A has another rank.
                let rb = if layer == 2 && m == "q_proj" { 4 } else { 8 };
                let ra = if layer == 4 && m == "v_proj" { 16 } else { 8 };
                tensors.push((format!("{key}.lora_A.weight"), vec![ra, 64]));
                tensors.push((format!("{key}.lora_B.weight"), vec![out, rb]));
                // o_proj has a bias from layer 3 on, and a DoRA magnitude in odd layers.
                if m == "o_proj" && layer >= 3 {
                    tensors.push((format!("{key}.lora_B.bias"), vec![out]));
                }
                if m == "o_proj" && layer % 2 == 1 {
                    tensors.push((format!("{key}.lora_magnitude_vector"), vec![out]));
                }
                // A `lora_mid` (a template does not compare it) in the first v_proj and layer 3's.
                if m == "v_proj" && (layer == 0 || layer == 3) {
                    tensors.push((format!("{key}.lora_mid.weight"), vec![8, 8]));
                }
            }
        }
        let (json, size) = header_json(&tensors);
        let header = crate::header::parse_header(json.as_bytes(), size).unwrap();
        for config in [
            r#"{"r": 8, "target_modules": ["q_proj", "up_proj"]}"#,
            r#"{"r": 8, "target_modules": "all-linear"}"#,
            r#"{"r": 8, "lora_alpha": 16, "target_modules": "all-linear", "alpha_pattern": {"layers.3.o_proj": 4}}"#,
            r#"{"r": 8, "target_modules": ["q_proj", "v_proj", "up_proj"], "rank_pattern": {"layers.1.q_proj": 4}}"#,
            r#"{"r": 8, "target_modules": ".*q_proj"}"#,
        ] {
            let c = LoraConfig::from_json(config).unwrap();
            let run = |keep_modules, reuse| {
                let configs = Configs {
                    file: Some(&c),
                    components: &[],
                };
                classify_with(&header, configs, Path::new("x"), Options { keep_modules }, reuse)
            };
            for keep_modules in [false, true] {
                let (fast, full) = (run(keep_modules, true), run(keep_modules, false));
                assert_eq!(format!("{fast:?}"), format!("{full:?}"), "{config}");
                assert!(!fast.problems.is_empty(), "{config}");
                assert_eq!(fast.layers, (0..6).collect::<Vec<u32>>());
                assert_eq!(fast.num_experts, 4);
                assert_eq!(fast.modules.len(), if keep_modules { 24 } else { 0 });
            }
        }
    }

    #[test]
    fn module_kind_names_are_listed() {
        let names: Vec<&str> = ModuleKind::all().map(ModuleKind::name).collect();
        assert_eq!(names, ModuleKind::NAMES);
    }

    #[test]
    fn half_precision() {
        assert_eq!(f16_to_f64(0x3c00), 1.0);
        assert_eq!(f16_to_f64(0x4c00), 16.0);
        assert_eq!(f16_to_f64(0xc000), -2.0);
    }
}
