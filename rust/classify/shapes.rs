//! A module's kind, dimensions and consistency problems, read from its factors' shapes.

use crate::codes::ProblemCode;
use crate::header::{Header, TensorEntry};
use crate::names::Variant;

use super::grouping::Group;
use super::{Classification, Format, ModuleKind};

/// A module's factors: its A and B tensors (the embedding pair when it has one) and their shapes.
#[derive(Clone, Copy)]
pub(super) struct Factors<'h> {
    pub(super) a: Option<u32>,
    pub(super) b: Option<u32>,
    pub(super) a_shape: Option<&'h [u64]>,
    pub(super) b_shape: Option<&'h [u64]>,
}

/// What a module's shapes (and config) give: ranks as A and B see them, features and experts.
#[derive(Clone, Copy)]
pub(super) struct Dims {
    pub(super) rank: Option<u64>,
    pub(super) b_rank: Option<u64>,
    pub(super) in_f: Option<u64>,
    pub(super) out_f: Option<u64>,
    pub(super) n_exp: Option<u64>,
}

/// The kind of module a group's tensors make.
pub(super) fn module_kind(g: &Group<'_>, f: Factors<'_>, expert: Option<u32>) -> ModuleKind {
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
pub(super) fn check_factors(
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
pub(super) fn add_totals(dims: Dims, expert: Option<u32>, out: &mut Classification) -> Option<u64> {
    let mut n_exp = dims.n_exp;
    if let Some(e) = expert {
        n_exp = Some(n_exp.unwrap_or(0).max(u64::from(e) + 1));
    }
    out.num_experts = out.num_experts.max(n_exp.unwrap_or(0));
    out.rank = out.rank.max(dims.rank.unwrap_or(0));
    n_exp
}

/// Ranks (as A and B give them), features and experts from a module's factor shapes.
pub(super) fn dims(kind: ModuleKind, a: Option<&[u64]>, b: Option<&[u64]>) -> Dims {
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
pub(super) fn variant_dims(v: Variant, g: &Group<'_>, header: &Header<'_>) -> (Option<u64>, Option<u64>, Option<u64>) {
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
