//! Tensors grouped by module key, and the problems of single tensors found on the way.

use crate::codes::{Flag, ProblemCode};
use crate::config::LoraConfig;
use crate::header::TensorEntry;
use crate::names::{self, Role, Variant};

use super::Classification;

/// Tensors of one module, as indices into the header.
#[derive(Default)]
pub(super) struct Group<'h> {
    pub(super) key: &'h str,
    pub(super) a: Option<u32>,
    pub(super) b: Option<u32>,
    pub(super) bias: Option<u32>,
    pub(super) magnitude: Option<u32>,
    pub(super) alpha: Option<u32>,
    pub(super) mid: Option<u32>,
    pub(super) emb_a: Option<u32>,
    pub(super) emb_b: Option<u32>,
    pub(super) variant: Option<Variant>,
    pub(super) variant_tensors: Vec<u32>,
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

/// Tensors grouped by module key, and what the grouping saw on the way.
pub(super) struct Grouping<'h> {
    pub(super) groups: Vec<Group<'h>>,
    pub(super) spelling_seen: [bool; 5],
    pub(super) dtype_mask: u32,
    /// The first tensor whose name repeats an earlier one (only looked for when the header's
    /// names are unchecked).
    pub(super) repeat: Option<usize>,
}

/// Groups tensors by module key; problems of single tensors (unknown names, two spellings of
/// one factor) go to `out`. Its own function: a loop small enough to keep its state in registers.
#[inline(never)]
pub(super) fn group_tensors<'h>(
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
