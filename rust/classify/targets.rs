//! The config's side: `target_modules` and `target_parameters` matching, the component configs of
//! diffusers, and the config's own problems and flags.

use crate::codes::{Flag, ProblemCode};
use crate::config::{same_tagged, short_tag, LoraConfig, TargetModules};
use crate::names::Variant;

use super::{Classification, Configs, ModuleKind};

/// Entries of the config file's `target_modules` list that no module matched (none are reported
/// for a file without modules).
pub(super) fn report_unmatched_targets(
    file: Option<&LoraConfig>,
    matched: &[bool],
    any_module: bool,
    out: &mut Classification,
) {
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
pub(super) fn report_config_problems(configs: Configs<'_>, out: &mut Classification) {
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
pub(super) fn add_config_flags(config: Option<&LoraConfig>, out: &mut Classification) {
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

/// Component prefix -> position, when there are too many components to try each per module
/// (the first match by position is the rule; a scan per module is quadratic).
pub(super) struct ComponentIndex<'c>(pub(super) Option<rustc_hash::FxHashMap<&'c str, usize>>);

impl<'c> ComponentIndex<'c> {
    pub(super) fn new(components: &'c [(String, LoraConfig)]) -> Self {
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

/// Which module the inner (`experts.base_layer`) and outer (`experts`) PEFT ParamWrappers hold.
/// PEFT nests the wrappers in the model's parameter order, so with both targeted the inner one is
/// `gate_up_proj` whatever order the config lists them in.
pub(super) fn target_parameter_leaves(config: Option<&LoraConfig>) -> (&'static str, &'static str) {
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

pub(super) fn variant_of_peft_type(peft_type: &str) -> Option<Variant> {
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
pub(super) struct TargetTally<'k> {
    /// Per entry of the adapter_config.json list: matched by some module. Empty for diffusers
    /// component configs (no unmatched-entry report there).
    pub(super) matched: Vec<bool>,
    /// Hit masks by last component (`LoraConfig::last_only_hits`), when `memo_ok`.
    pub(super) memo: Vec<(u64, &'k str, u64)>,
    pub(super) memo_ok: bool,
    /// (config address, leaf, whether its `target_parameters` cover the leaf).
    pub(super) params: Vec<(usize, String, bool)>,
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

pub(super) fn check_target<'k>(
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
