//! The parts of a PEFT `adapter_config.json` (or diffusers `lora_adapter_metadata`) that decide
//! ranks and scales, with PEFT's first-match pattern rule (lora-formats.md §1.3-§1.5).

use regex::Regex;
use serde_json::{Map, Value};

#[derive(Debug, Clone, PartialEq)]
pub enum TargetModules {
    List(Vec<String>),
    /// A regex (`re.fullmatch` against the full module name), or `all-linear`.
    Pattern(String),
}

/// One `rank_pattern` / `alpha_pattern` entry, compiled as PEFT matches it:
/// `re.match(rf"(.*\.)?({key})$", module_name)`.
#[derive(Debug, Clone)]
pub struct Pattern {
    pub key: String,
    pub regex: Option<Regex>,
    pub value: f64,
}

#[derive(Debug, Clone, Default)]
pub struct LoraConfig {
    pub peft_type: Option<String>,
    pub r: Option<u64>,
    pub lora_alpha: Option<f64>,
    pub use_rslora: bool,
    pub use_dora: bool,
    pub rank_pattern: Vec<Pattern>,
    pub alpha_pattern: Vec<Pattern>,
    pub target_modules: Option<TargetModules>,
    pub target_parameters: Vec<String>,
    pub base_model_name_or_path: Option<String>,
    pub modules_to_save: Vec<String>,
    pub lora_bias: bool,
    /// Keys that make this not a plain LoRA delta (PiSSA-style init, aLoRA, ...).
    pub unsupported_features: Vec<String>,
    /// Patterns our regex engine cannot compile (Python-only syntax); reported as problems.
    pub bad_patterns: Vec<String>,
}

fn compile(key: &str) -> Option<Regex> {
    Regex::new(&format!(r"^(?:.*\.)?(?:{key})$")).ok()
}

fn patterns(value: Option<&Value>, bad: &mut Vec<String>) -> Vec<Pattern> {
    let Some(Value::Object(map)) = value else { return Vec::new() };
    map.iter()
        .filter_map(|(key, v)| {
            let value = v.as_f64()?;
            let regex = compile(key);
            if regex.is_none() {
                bad.push(key.clone());
            }
            Some(Pattern { key: key.clone(), regex, value })
        })
        .collect()
}

fn strings(value: Option<&Value>) -> Vec<String> {
    match value {
        Some(Value::Array(items)) => items.iter().filter_map(|v| v.as_str().map(str::to_owned)).collect(),
        Some(Value::String(s)) => vec![s.clone()],
        _ => Vec::new(),
    }
}

impl LoraConfig {
    /// Reads the fields from a JSON object; `prefix` selects diffusers' component keys (`"transformer."`).
    pub fn from_map(map: &Map<String, Value>, prefix: &str) -> LoraConfig {
        let get = |k: &str| map.get(&format!("{prefix}{k}"));
        let flag = |k: &str| get(k).and_then(Value::as_bool).unwrap_or(false);
        let mut bad_patterns = Vec::new();
        let target_modules = match get("target_modules") {
            Some(Value::String(s)) => Some(TargetModules::Pattern(s.clone())),
            Some(v @ Value::Array(_)) => Some(TargetModules::List(strings(Some(v)))),
            _ => None,
        };
        let mut unsupported_features = Vec::new();
        if let Some(Value::String(init)) = get("init_lora_weights") {
            let init = init.to_ascii_lowercase();
            if ["pissa", "olora", "corda", "loftq"].iter().any(|m| init.starts_with(m)) {
                unsupported_features.push(format!("init_lora_weights={init}"));
            }
        }
        for k in ["alora_invocation_tokens", "layer_replication", "use_bdlora", "use_qalora", "trainable_token_indices"] {
            if get(k).is_some_and(|v| !v.is_null() && v != &Value::Bool(false)) {
                unsupported_features.push(k.to_owned());
            }
        }
        LoraConfig {
            peft_type: get("peft_type").and_then(Value::as_str).map(str::to_owned),
            r: get("r").and_then(Value::as_u64),
            // PEFT's LoHa/LoKr configs call it `alpha`.
            lora_alpha: get("lora_alpha").or_else(|| get("alpha")).and_then(Value::as_f64),
            use_rslora: flag("use_rslora"),
            use_dora: flag("use_dora"),
            rank_pattern: patterns(get("rank_pattern"), &mut bad_patterns),
            alpha_pattern: patterns(get("alpha_pattern"), &mut bad_patterns),
            target_modules,
            target_parameters: strings(get("target_parameters")),
            base_model_name_or_path: get("base_model_name_or_path").and_then(Value::as_str).map(str::to_owned),
            modules_to_save: strings(get("modules_to_save")),
            lora_bias: flag("lora_bias"),
            unsupported_features,
            bad_patterns,
        }
    }

    /// PEFT's `get_pattern_key`: the first pattern (in file order) whose regex matches.
    fn resolve(patterns: &[Pattern], name: &str) -> Option<f64> {
        patterns.iter().find(|p| p.regex.as_ref().is_some_and(|r| r.is_match(name))).map(|p| p.value)
    }

    /// The rank this config gives `name` (prefix-free module name).
    pub fn rank_for(&self, name: &str) -> Option<u64> {
        if !self.rank_pattern.is_empty() {
            if let Some(v) = Self::resolve(&self.rank_pattern, name) {
                return Some(v as u64);
            }
        }
        self.r
    }

    /// The alpha this config gives `name`.
    pub fn alpha_for(&self, name: &str) -> Option<f64> {
        if !self.alpha_pattern.is_empty() {
            if let Some(v) = Self::resolve(&self.alpha_pattern, name) {
                return Some(v);
            }
        }
        self.lora_alpha
    }

    /// Does a module named `name` fall under `target_modules` (PEFT's matching rule)?
    /// None when it cannot be told (no config, or a regex we cannot compile).
    pub fn targets(&self, name: &str) -> Option<bool> {
        match self.target_modules.as_ref()? {
            TargetModules::List(list) => Some(list.iter().any(|t| {
                name == t || (name.len() > t.len() && name.ends_with(t.as_str()) && name.as_bytes()[name.len() - t.len() - 1] == b'.')
            })),
            TargetModules::Pattern(p) if p == "all-linear" || p == "all" => Some(true),
            TargetModules::Pattern(p) => Regex::new(&format!("^(?:{p})$")).ok().map(|r| r.is_match(name)),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn first_match_in_file_order() {
        let v: Value = serde_json::from_str(
            r#"{"r": 8, "lora_alpha": 16, "rank_pattern": {"q_proj": 4, "layers.0.self_attn.q_proj": 2},
                "alpha_pattern": {"v_proj": 3}, "target_modules": ["q_proj", "v_proj"]}"#,
        )
        .unwrap();
        let c = LoraConfig::from_map(v.as_object().unwrap(), "");
        assert_eq!(c.rank_for("model.layers.0.self_attn.q_proj"), Some(4));
        assert_eq!(c.rank_for("model.layers.0.self_attn.k_proj"), Some(8));
        assert_eq!(c.alpha_for("model.layers.0.self_attn.v_proj"), Some(3.0));
        assert_eq!(c.alpha_for("model.layers.0.self_attn.xv_proj"), Some(16.0));
        assert_eq!(c.targets("model.layers.0.self_attn.v_proj"), Some(true));
        assert_eq!(c.targets("model.layers.0.self_attn.o_proj"), Some(false));
    }
}
