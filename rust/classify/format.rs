//! The tensor naming scheme an adapter is written in, told from its spellings and key prefixes.

use crate::config::LoraConfig;
use crate::header::Header;
use crate::names::Spelling;

use super::grouping::Group;

crate::codes::code_enum! {
    /// The tensor naming scheme an adapter is written in (docs/scan.md describes each).
    pub enum Format {
        /// PEFT: `base_model.model.<module>.lora_A.weight`.
        Peft = "peft",
        /// diffusers: PEFT spelling under component prefixes (`unet.`, `transformer.`).
        Diffusers = "diffusers",
        /// Old diffusers attention processors (`.lora_linear_layer.down.weight`, `_lora.down.weight`).
        DiffusersLegacy = "diffusers_legacy",
        /// kohya sd-scripts: `lora_unet_..._proj.lora_down.weight` with `.alpha` scalars.
        Kohya = "kohya",
        /// LyCORIS variants (LoHa, LoKr, ...) by their factor names.
        Lycoris = "lycoris",
        /// XLabs Flux adapters.
        Xlabs = "xlabs",
        /// ai-toolkit Flux adapters (PEFT spelling on `double_blocks.` / `single_blocks.`).
        AiToolkit = "ai_toolkit",
        /// None of the above.
        Unknown = "unknown",
    }
}

/// Picks the format from the spellings seen, key prefixes and the presence of a config.
pub(super) fn detect_format(
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
