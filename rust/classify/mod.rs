//! Per-adapter classification from a validated header (and the adapter's config, when it has one):
//! format, modules with ranks and scales, MoE layout, flags and every inconsistency found.

use std::path::Path;

use crate::config::LoraConfig;
use crate::header::Header;

mod alpha;
mod classification;
mod format;
mod grouping;
mod module_loop;
mod modules;
mod shapes;
mod targets;
mod templates;

pub use classification::{Classification, ModuleKind, MoeLayout, Problem};
pub use format::Format;
pub use modules::{ModuleInfo, ModuleNumbers, ModuleStrings, Modules};

use alpha::read_alphas;
use classification::dtypes_in;
use format::detect_format;
use grouping::{group_tensors, Grouping};
use module_loop::ModuleLoop;
use targets::{add_config_flags, report_config_problems, report_unmatched_targets, ComponentIndex};

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
