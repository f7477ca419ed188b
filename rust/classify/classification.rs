//! What a classification says: MoE layouts, module kinds, problems, and the `Classification` itself.

use std::fmt;

use crate::codes::{Flag, ProblemCode};
use crate::config::LoraConfig;
use crate::header::{Dtype, Header};
use crate::names::Variant;

use super::{Format, Modules};

crate::codes::code_enum! {
    /// How an adapter stores mixture-of-experts LoRA weights.
    #[derive(PartialOrd, Ord)]
    pub enum MoeLayout {
        /// No expert modules.
        Dense = "dense",
        /// One 2-D A/B pair per expert (`experts.3.w1`).
        PerExpert2d = "per_expert_2d",
        /// 3-D factors with a leading expert dimension.
        Stacked3d = "stacked_3d",
        /// 3-D factors, one side shared by every expert (leading dimension 1).
        SharedOuter = "shared_outer",
        /// PEFT `target_parameters` on fused expert weights (`experts.base_layer`).
        PeftTargetParameters = "peft_target_parameters",
        /// More than one of the above.
        Mixed = "mixed",
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
pub(super) const MAX_PROBLEMS: usize = 200;

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
    pub(super) fn problem(&mut self, code: ProblemCode, message: fmt::Arguments<'_>, tensor: Option<&str>) {
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

impl Classification {
    /// The classification before any tensor is read: what the config says, and the header's warnings.
    pub(super) fn of_config(header: &Header<'_>, config: Option<&LoraConfig>) -> Classification {
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
pub(super) fn dtypes_in(mask: u32) -> Vec<Dtype> {
    Dtype::ALL
        .iter()
        .copied()
        .filter(|d| mask & (1 << (*d as u32)) != 0)
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn module_kind_names_are_listed() {
        let names: Vec<&str> = ModuleKind::all().map(ModuleKind::name).collect();
        assert_eq!(names, ModuleKind::NAMES);
    }
}
