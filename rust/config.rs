//! The parts of a PEFT `adapter_config.json` (or diffusers `lora_adapter_metadata`) that decide
//! ranks and scales, with PEFT's first-match pattern rule (lora-formats.md §1.3-§1.5).
//!
//! A config is read with the header's JSON cursor, keeping only the fields used here; serde_json
//! reads it only when the cursor refuses it, so that errors carry serde_json's message. Both
//! routes reduce a value to a `Field` and share one interpretation (`LoraConfig::from_fields`).

use std::borrow::Cow;

use regex::Regex;
use rustc_hash::FxHashMap;
use serde_json::{Map, Value};

use crate::json::{Cursor, Number};

/// A config's `target_modules`.
#[derive(Debug, Clone, PartialEq)]
pub enum TargetModules {
    /// Module names, each matching a name equal to it or ending in `.` and it.
    List(Vec<String>),
    /// A regex (`re.fullmatch` against the full module name), or `all-linear`.
    Pattern(String),
}

/// One `rank_pattern` / `alpha_pattern` entry, matched as PEFT matches it:
/// `re.match(rf"(.*\.)?({key})$", module_name)`.
#[derive(Debug, Clone)]
pub struct Pattern {
    /// The key as the config writes it.
    pub key: String,
    /// How the key is matched.
    pub matcher: Matcher,
    /// The rank or alpha it gives.
    pub value: f64,
}

/// How a pattern key is matched.
#[derive(Debug, Clone)]
pub enum Matcher {
    /// A key whose only regex syntax is `.` (most are: PEFT writes module names), matched
    /// without a regex: each `.` is any character but a newline, the rest is text.
    Plain,
    /// Any other key, compiled.
    Regex(Regex),
    /// A key lorafast cannot evaluate (Python-only syntax, or over the size limits); never matches.
    Bad,
}

/// Limits on a config's compiled regexes, so that a small config cannot take much memory or
/// time (a hundred keys like `\w{100}` would take gigabytes and a minute): bytes per compiled program and
/// per lazy-DFA cache, and compiled patterns per config (later ones are reported as bad).
const REGEX_SIZE_LIMIT: usize = 256 << 10;
const MAX_REGEX_PATTERNS: usize = 64;

/// `^(?:.*\.)?(?:key)$` for a key whose only regex syntax is `.`: the key takes the last
/// characters of `name` (a `.` in it matches any but a newline); what comes before is empty, or
/// ends with a dot and has no newline (`.*` does not cross one).
fn plain_match(key: &str, name: &str) -> bool {
    let mut tail = name.char_indices().rev();
    let mut start = name.len();
    for k in key.chars().rev() {
        match tail.next() {
            Some((at, c)) if c == k || (k == '.' && c != '\n') => start = at,
            _ => return false,
        }
    }
    let head = &name[..start];
    head.is_empty() || (head.ends_with('.') && !head.contains('\n'))
}

fn build_regex(pattern: &str) -> Option<Regex> {
    regex::RegexBuilder::new(pattern)
        .size_limit(REGEX_SIZE_LIMIT)
        .dfa_size_limit(REGEX_SIZE_LIMIT)
        .build()
        .ok()
}

impl Pattern {
    /// Whether this entry applies to the module `name`.
    pub fn is_match(&self, name: &str) -> bool {
        match &self.matcher {
            Matcher::Plain => plain_match(&self.key, name),
            Matcher::Regex(r) => r.is_match(name),
            Matcher::Bad => false,
        }
    }
}

/// The fields of an adapter config that classification reads (PEFT's names; kohya and
/// diffusers spellings are read into them).
#[derive(Debug, Clone, Default)]
pub struct LoraConfig {
    /// `peft_type` (`LORA`, `LOHA`, ...).
    pub peft_type: Option<String>,
    /// `r`: the default rank.
    pub r: Option<u64>,
    /// `lora_alpha` (or `alpha`): the default alpha.
    pub lora_alpha: Option<f64>,
    /// `use_rslora`: scale by alpha / sqrt(r) instead of alpha / r.
    pub use_rslora: bool,
    /// `use_dora`.
    pub use_dora: bool,
    /// `rank_pattern`: per-module ranks.
    pub rank_pattern: Vec<Pattern>,
    /// `alpha_pattern`: per-module alphas.
    pub alpha_pattern: Vec<Pattern>,
    /// `target_modules`.
    pub target_modules: Option<TargetModules>,
    /// `target_parameters`: parameter names adapted directly (MoE expert weights).
    pub target_parameters: Vec<String>,
    /// `base_model_name_or_path`.
    pub base_model_name_or_path: Option<String>,
    /// `modules_to_save`: modules stored in full.
    pub modules_to_save: Vec<String>,
    /// `lora_bias`: the adapter trains lora_B biases.
    pub lora_bias: bool,
    /// Keys that make this not a plain LoRA delta (PiSSA-style init, aLoRA, ...).
    pub unsupported_features: Vec<String>,
    /// Patterns our regex engine cannot compile (Python-only syntax); reported as problems.
    pub bad_patterns: Vec<String>,
    /// Fields whose value has the wrong JSON type (`"r": "8"`), as messages; reported as
    /// `invalid_config_field` problems. Such a field is read as if absent.
    pub invalid_fields: Vec<String>,
    /// `target_modules` prepared once for the per-module checks.
    targets: TargetIndex,
    /// `modules_to_save` prepared once for the per-tensor checks.
    saved: SpanSet,
    /// `rank_pattern` / `alpha_pattern` prepared for many keys.
    rank_index: PatternIndex,
    alpha_index: PatternIndex,
}

/// `target_modules` ready for matching. A list entry without dots matches a module exactly when
/// it equals the module's last component; `tags` compares those without touching the text.
#[derive(Debug, Clone, Default)]
struct TargetIndex {
    /// (`short_tag`, position) of the list entries without a dot.
    dotless: Vec<(u64, usize)>,
    /// Positions of the list entries with a dot (`to_out.0`), matched by the full rule.
    dotted: Vec<usize>,
    /// The compiled `target_modules` regex (None: not a pattern, or one we cannot compile).
    regex: Option<Regex>,
    /// For a long list: entries by text, found as dotted suffixes of a module name (trying
    /// each entry per module is quadratic over a fleet-sized list).
    suffixes: Option<SuffixMap>,
}

/// Strings found as dotted suffixes of a name: the whole name, or what follows one of its dots.
#[derive(Debug, Clone, Default)]
struct SuffixMap {
    /// Entry -> its positions in the list.
    entries: FxHashMap<String, Vec<usize>>,
    /// The distinct dot counts of the entries, ascending.
    dots: Vec<usize>,
}

impl SuffixMap {
    fn new(list: &[String]) -> SuffixMap {
        let mut map = SuffixMap::default();
        for (i, t) in list.iter().enumerate() {
            map.entries.entry(t.clone()).or_default().push(i);
            map.dots.push(memchr::memchr_iter(b'.', t.as_bytes()).count());
        }
        map.dots.sort_unstable();
        map.dots.dedup();
        map
    }

    /// Positions of the entries `t` with `name == t` or `name` ending in `.t`.
    fn hits<'s>(&'s self, name: &'s str) -> impl Iterator<Item = usize> + 's {
        // An entry with d dots can only be what follows the (d+1)-th dot from the end, or the
        // whole name when that has exactly d dots.
        let dots: Vec<usize> = memchr::memrchr_iter(b'.', name.as_bytes()).collect();
        self.dots
            .iter()
            .map_while(move |&d| match dots.get(d) {
                Some(&at) => Some(&name[at + 1..]),
                None => (dots.len() == d).then_some(name),
            })
            .filter_map(|suffix| self.entries.get(suffix))
            .flatten()
            .copied()
    }
}

/// Length and first seven bytes of a string: equal tags mean equal strings for strings of up to
/// seven bytes, and almost always otherwise.
#[inline]
pub fn short_tag(s: &str) -> u64 {
    let b = s.as_bytes();
    let head = match b.first_chunk::<8>() {
        Some(w) => u64::from_le_bytes(*w) & 0x00FF_FFFF_FFFF_FFFF,
        // Short strings byte by byte: a variable-length copy would cost a `memcpy` call.
        None => b.iter().rev().fold(0u64, |v, &c| v << 8 | u64::from(c)),
    };
    head | (b.len() as u64) << 56
}

/// Equal strings, given their tags are equal.
#[inline]
pub fn same_tagged(a: &str, b: &str) -> bool {
    a.len() <= 7 || a == b
}

fn compile(key: &str) -> Option<Regex> {
    build_regex(&format!(r"^(?:.*\.)?(?:{key})$"))
}

/// PEFT's suffix rule for a `target_modules` list entry.
fn list_entry_matches(name: &str, t: &str) -> bool {
    name == t || (name.len() > t.len() && name.ends_with(t) && name.as_bytes()[name.len() - t.len() - 1] == b'.')
}

/// A JSON value reduced to what the config fields need.
#[derive(Debug, Clone, PartialEq)]
enum Field {
    Null,
    Bool(bool),
    Number(Number),
    Str(String),
    /// An array: its string items, and how many items were not strings.
    List(Vec<String>, usize),
    /// An object: keys in first-seen order, each with its (last) value as a number, if it is one.
    Object(Vec<(String, Option<f64>)>),
}

impl Field {
    fn from_value(v: &Value) -> Field {
        match v {
            Value::Null => Field::Null,
            Value::Bool(b) => Field::Bool(*b),
            Value::Number(n) => Field::Number(match (n.as_u64(), n.as_i64()) {
                (Some(u), _) => Number::U64(u),
                (None, Some(i)) => Number::I64(i),
                _ => Number::F64(n.as_f64().unwrap_or(f64::NAN)),
            }),
            Value::String(s) => Field::Str(s.clone()),
            Value::Array(items) => {
                let strings: Vec<String> = items.iter().filter_map(|v| v.as_str().map(str::to_owned)).collect();
                let others = items.len() - strings.len();
                Field::List(strings, others)
            }
            Value::Object(map) => Field::Object(map.iter().map(|(k, v)| (k.clone(), v.as_f64())).collect()),
        }
    }

    fn as_str(&self) -> Option<&str> {
        match self {
            Field::Str(s) => Some(s),
            _ => None,
        }
    }

    fn as_bool(&self) -> Option<bool> {
        match self {
            Field::Bool(b) => Some(*b),
            _ => None,
        }
    }

    fn as_number(&self) -> Option<Number> {
        match self {
            Field::Number(n) => Some(*n),
            _ => None,
        }
    }

    /// The strings of a list, or the one string; anything else is no strings.
    fn strings(&self) -> Vec<String> {
        match self {
            Field::List(items, _) => items.clone(),
            Field::Str(s) => vec![s.clone()],
            _ => Vec::new(),
        }
    }
}

/// The config fields lorafast reads, in `Fields` slot order (public so the config fuzz harness draws from it).
pub const KNOWN: [&str; 19] = [
    "peft_type",
    "r",
    "lora_alpha",
    "alpha",
    "use_rslora",
    "use_dora",
    "rank_pattern",
    "alpha_pattern",
    "target_modules",
    "target_parameters",
    "base_model_name_or_path",
    "modules_to_save",
    "lora_bias",
    "init_lora_weights",
    "alora_invocation_tokens",
    "layer_replication",
    "use_bdlora",
    "use_qalora",
    "trainable_token_indices",
];

/// Fields whose presence (anything but null or false) means "not a plain LoRA delta".
const UNSUPPORTED: [&str; 5] = [
    "alora_invocation_tokens",
    "layer_replication",
    "use_bdlora",
    "use_qalora",
    "trainable_token_indices",
];

fn known_slot(key: &str) -> Option<usize> {
    KNOWN.iter().position(|k| *k == key)
}

/// One value per known field (the last one given), borrowed from wherever they were read.
#[derive(Default)]
struct Fields<'f>([Option<&'f Field>; KNOWN.len()]);

impl<'f> Fields<'f> {
    /// The fields of the entries whose key is `prefix` + a known name.
    fn from_entries(entries: &'f [(Cow<'_, str>, Field)], prefix: &str) -> Self {
        let mut fields = Fields::default();
        for (key, value) in entries {
            if let Some(slot) = key.strip_prefix(prefix).and_then(known_slot) {
                fields.0[slot] = Some(value);
            }
        }
        fields
    }

    /// `from_entries` for each of `prefixes` (distinct), in one pass over the entries: each
    /// entry is tried against the known names it ends with, not against every prefix.
    fn by_prefix(entries: &'f [(Cow<'_, str>, Field)], prefixes: &[String]) -> Vec<Self> {
        let index: FxHashMap<&str, usize> = prefixes.iter().enumerate().map(|(i, p)| (p.as_str(), i)).collect();
        let mut out: Vec<Fields<'f>> = prefixes.iter().map(|_| Fields::default()).collect();
        for (key, value) in entries {
            for (slot, name) in KNOWN.iter().enumerate() {
                if let Some(&i) = key.strip_suffix(name).and_then(|p| index.get(p)) {
                    out[i].0[slot] = Some(value);
                }
            }
        }
        out
    }

    fn get(&self, name: &str) -> Option<&'f Field> {
        self.0[known_slot(name)?]
    }
}

/// Reads a top-level JSON object into (key, value) entries, first position and last value for a
/// repeated key (as serde_json's order-preserving map does). Values of keys `keep` refuses are
/// skipped (validated, not kept). None if the text is not valid JSON or not an object.
fn read_object<'t>(text: &'t str, keep: impl Fn(&str) -> bool) -> Option<Vec<(Cow<'t, str>, Field)>> {
    let mut cur = Cursor::new(text.as_bytes());
    if cur.peek() != Some(b'{') {
        return None;
    }
    let mut entries: Vec<(Cow<'t, str>, Field)> = Vec::new();
    let mut index = KeyIndex::default();
    if cur.object_start().ok()? {
        loop {
            let key = cur.key().ok()?;
            if keep(&key) {
                let value = read_field(&mut cur, 1).ok()?;
                index.upsert(&mut entries, key, value);
            } else {
                cur.skip_value(1).ok()?;
            }
            if !cur.object_next().ok()? {
                break;
            }
        }
    }
    cur.finish().ok()?;
    Some(entries)
}

/// Where each key of a list of (key, value) entries is. Repeated keys are found by a scan while
/// the list is small, by a hash index once it is not (a scan per key is quadratic).
struct KeyIndex<K>(FxHashMap<K, usize>);

impl<K> Default for KeyIndex<K> {
    fn default() -> Self {
        KeyIndex(FxHashMap::default())
    }
}

impl<K: Clone + Eq + std::hash::Hash> KeyIndex<K> {
    /// Sets `key`'s value: first position, last value, as serde_json's order-preserving map.
    fn upsert<V>(&mut self, entries: &mut Vec<(K, V)>, key: K, value: V) {
        let seen = if entries.len() < 32 {
            entries.iter().position(|(k, _)| *k == key)
        } else {
            if self.0.is_empty() {
                self.0
                    .extend(entries.iter().enumerate().map(|(i, (k, _))| (k.clone(), i)));
            }
            self.0.get(&key).copied()
        };
        match seen {
            Some(i) => entries[i].1 = value,
            None => {
                if !self.0.is_empty() {
                    self.0.insert(key.clone(), entries.len());
                }
                entries.push((key, value));
            }
        }
    }
}

/// Reads one value inside `open` containers as a `Field`.
fn read_field(cur: &mut Cursor<'_>, open: u32) -> crate::json::Result<Field> {
    Ok(match cur.peek() {
        Some(b'"') => Field::Str(cur.string()?.into_owned()),
        Some(b'-' | b'0'..=b'9') => Field::Number(cur.number()?),
        Some(b't') => {
            cur.literal(b"true")?;
            Field::Bool(true)
        }
        Some(b'f') => {
            cur.literal(b"false")?;
            Field::Bool(false)
        }
        Some(b'[') => {
            cur.enter(open)?;
            let (mut items, mut others) = (Vec::new(), 0);
            if cur.array_start()? {
                loop {
                    if cur.peek() == Some(b'"') {
                        items.push(cur.string()?.into_owned());
                    } else {
                        others += 1;
                        cur.skip_value(open + 1)?;
                    }
                    if !cur.array_next()? {
                        break;
                    }
                }
            }
            Field::List(items, others)
        }
        Some(b'{') => {
            cur.enter(open)?;
            let mut entries: Vec<(String, Option<f64>)> = Vec::new();
            let mut index = KeyIndex::default();
            if cur.object_start()? {
                loop {
                    let key = cur.key()?;
                    let value = if matches!(cur.peek(), Some(b'-' | b'0'..=b'9')) {
                        Some(cur.number()?.as_f64())
                    } else {
                        cur.skip_value(open + 1)?;
                        None
                    };
                    index.upsert(&mut entries, key.into_owned(), value);
                    if !cur.object_next()? {
                        break;
                    }
                }
            }
            Field::Object(entries)
        }
        _ => {
            cur.literal(b"null")?;
            Field::Null
        }
    })
}

impl LoraConfig {
    /// Reads `adapter_config.json` text; the error is the message a scan reports.
    pub fn from_json(text: &str) -> Result<LoraConfig, String> {
        if let Some(entries) = read_object(text, |k| known_slot(k).is_some()) {
            return Ok(Self::from_fields(&Fields::from_entries(&entries, "")));
        }
        // The cursor refused the text: serde_json says why (or reads it, should it disagree).
        let value: Value =
            serde_json::from_str(text).map_err(|e| format!("adapter_config.json is not valid JSON: {e}"))?;
        let map = value
            .as_object()
            .ok_or_else(|| "adapter_config.json is not a JSON object".to_owned())?;
        Ok(Self::from_map(map, ""))
    }

    /// diffusers' `lora_adapter_metadata`: one config per component prefix (`"unet."`), in key
    /// order. None if the text is not a JSON object or names no component.
    pub fn components_from_json(text: &str) -> Option<Vec<(String, LoraConfig)>> {
        let configs: Vec<(String, LoraConfig)> = match read_object(text, |_| true) {
            Some(entries) => {
                let prefixes = prefixes(entries.iter().map(|(k, _)| k.as_ref()));
                let fields = Fields::by_prefix(&entries, &prefixes);
                prefixes
                    .into_iter()
                    .zip(fields)
                    .map(|(prefix, fields)| (prefix, Self::from_fields(&fields)))
                    .collect()
            }
            None => {
                let value: Value = serde_json::from_str(text).ok()?;
                let map = value.as_object()?;
                prefixes(map.keys().map(String::as_str))
                    .into_iter()
                    .map(|prefix| {
                        let config = Self::from_map(map, &prefix);
                        (prefix, config)
                    })
                    .collect()
            }
        };
        (!configs.is_empty()).then_some(configs)
    }

    /// Reads the fields from a JSON object; `prefix` selects diffusers' component keys (`"transformer."`).
    pub fn from_map(map: &Map<String, Value>, prefix: &str) -> LoraConfig {
        let values: Vec<(Cow<'_, str>, Field)> = KNOWN
            .iter()
            .filter_map(|k| {
                map.get(&format!("{prefix}{k}"))
                    .map(|v| (Cow::Borrowed(*k), Field::from_value(v)))
            })
            .collect();
        Self::from_fields(&Fields::from_entries(&values, ""))
    }

    fn from_fields(fields: &Fields<'_>) -> LoraConfig {
        let get = |k: &str| fields.get(k);
        let flag = |k: &str| get(k).and_then(Field::as_bool).unwrap_or(false);
        let (mut bad_patterns, mut compiled) = (Vec::new(), 0);
        let target_modules = match get("target_modules") {
            Some(Field::Str(s)) => Some(TargetModules::Pattern(s.clone())),
            Some(v @ Field::List(..)) => Some(TargetModules::List(v.strings())),
            _ => None,
        };
        let mut unsupported_features = Vec::new();
        if let Some(Field::Str(init)) = get("init_lora_weights") {
            let init = init.to_ascii_lowercase();
            if ["pissa", "olora", "corda", "loftq"].iter().any(|m| init.starts_with(m)) {
                unsupported_features.push(format!("init_lora_weights={init}"));
            }
        }
        for k in UNSUPPORTED {
            if get(k).is_some_and(|v| !matches!(v, Field::Null | Field::Bool(false))) {
                unsupported_features.push(k.to_owned());
            }
        }
        let targets = TargetIndex::new(target_modules.as_ref());
        let modules_to_save = get("modules_to_save").map(Field::strings).unwrap_or_default();
        let rank_pattern = patterns(get("rank_pattern"), &mut bad_patterns, &mut compiled);
        let alpha_pattern = patterns(get("alpha_pattern"), &mut bad_patterns, &mut compiled);
        LoraConfig {
            peft_type: get("peft_type").and_then(Field::as_str).map(str::to_owned),
            r: get("r").and_then(Field::as_number).and_then(Number::as_u64),
            // PEFT's LoHa/LoKr configs call it `alpha`.
            lora_alpha: get("lora_alpha")
                .or_else(|| get("alpha"))
                .and_then(Field::as_number)
                .map(Number::as_f64),
            use_rslora: flag("use_rslora"),
            use_dora: flag("use_dora"),
            rank_index: PatternIndex::new(&rank_pattern),
            alpha_index: PatternIndex::new(&alpha_pattern),
            rank_pattern,
            alpha_pattern,
            target_modules,
            target_parameters: get("target_parameters").map(Field::strings).unwrap_or_default(),
            base_model_name_or_path: get("base_model_name_or_path")
                .and_then(Field::as_str)
                .map(str::to_owned),
            saved: SpanSet::new(&modules_to_save),
            modules_to_save,
            lora_bias: flag("lora_bias"),
            unsupported_features,
            bad_patterns,
            invalid_fields: invalid_fields(fields),
            targets,
        }
    }

    /// Is the tensor `name` inside a `modules_to_save` module: does `.{m}.` occur in it, or does
    /// it start with `{m}.`, for an entry `m`?
    pub fn saves(&self, name: &str) -> bool {
        self.saved.inside(name)
    }

    /// PEFT's `get_pattern_key`: the first pattern (in file order) whose regex matches.
    fn resolve(patterns: &[Pattern], index: &PatternIndex, name: &str) -> Option<f64> {
        let first = match &index.plain {
            None => patterns.iter().position(|p| p.is_match(name)),
            Some(plain) => {
                // The first plain key that matches, then any regex key before it.
                let plain = plain.candidates(name).filter(|&i| patterns[i].is_match(name)).min();
                let limit = plain.unwrap_or(usize::MAX);
                let regex = index
                    .others
                    .iter()
                    .take_while(|&&i| i < limit)
                    .find(|&&i| patterns[i].is_match(name));
                regex.copied().or(plain)
            }
        };
        first.map(|i| patterns[i].value)
    }

    /// The rank this config gives `name` (prefix-free module name).
    pub fn rank_for(&self, name: &str) -> Option<u64> {
        if !self.rank_pattern.is_empty() {
            if let Some(v) = Self::resolve(&self.rank_pattern, &self.rank_index, name) {
                return Some(v as u64);
            }
        }
        self.r
    }

    /// The alpha this config gives `name`.
    pub fn alpha_for(&self, name: &str) -> Option<f64> {
        if !self.alpha_pattern.is_empty() {
            if let Some(v) = Self::resolve(&self.alpha_pattern, &self.alpha_index, name) {
                return Some(v);
            }
        }
        self.lora_alpha
    }

    /// Does a module named `name` fall under `target_modules` (PEFT's matching rule)?
    /// None when it cannot be told (no config, or a regex we cannot compile).
    pub fn targets(&self, name: &str) -> Option<bool> {
        match self.target_modules.as_ref()? {
            TargetModules::List(list) => Some(list.iter().any(|t| list_entry_matches(name, t))),
            TargetModules::Pattern(p) if p == "all-linear" || p == "all" => Some(true),
            TargetModules::Pattern(_) => self.targets.regex.as_ref().map(|r| r.is_match(name)),
        }
    }

    /// The `target_modules` list entries matching a module whose last dotted component is `last`,
    /// as a bit mask, when the answer depends on `last` alone: a list of at most 64 entries, none
    /// with a dot. None otherwise (use `list_hits`).
    pub fn last_only_hits(&self, last: &str) -> Option<u64> {
        let Some(TargetModules::List(list)) = &self.target_modules else {
            return None;
        };
        if list.len() > 64 || !self.targets.dotted.is_empty() {
            return None;
        }
        let last_tag = short_tag(last);
        let hits = self
            .targets
            .dotless
            .iter()
            .filter(|&&(tag, i)| tag == last_tag && same_tagged(last, &list[i]));
        Some(hits.fold(0, |mask, &(_, i)| mask | 1 << i))
    }

    /// Calls `hit(i)` for each `target_modules` list entry `i` that matches the module `name`,
    /// whose last dotted component is `last`; returns whether any did.
    pub fn list_hits(&self, name: &str, last: &str, mut hit: impl FnMut(usize)) -> bool {
        let Some(TargetModules::List(list)) = &self.target_modules else {
            return false;
        };
        let mut any = false;
        if let Some(suffixes) = &self.targets.suffixes {
            for i in suffixes.hits(name) {
                hit(i);
                any = true;
            }
            return any;
        }
        let last_tag = short_tag(last);
        for &(tag, i) in &self.targets.dotless {
            if tag == last_tag && same_tagged(last, &list[i]) {
                hit(i);
                any = true;
            }
        }
        for &i in &self.targets.dotted {
            if list_entry_matches(name, &list[i]) {
                hit(i);
                any = true;
            }
        }
        any
    }
}

impl TargetIndex {
    fn new(targets: Option<&TargetModules>) -> TargetIndex {
        match targets {
            Some(TargetModules::List(list)) => TargetIndex {
                dotless: list
                    .iter()
                    .enumerate()
                    .filter(|(_, t)| !t.contains('.'))
                    .map(|(i, t)| (short_tag(t), i))
                    .collect(),
                dotted: list
                    .iter()
                    .enumerate()
                    .filter(|(_, t)| t.contains('.'))
                    .map(|(i, _)| i)
                    .collect(),
                regex: None,
                suffixes: (list.len() > 64).then(|| SuffixMap::new(list)),
            },
            Some(TargetModules::Pattern(p)) => TargetIndex {
                dotless: Vec::new(),
                dotted: Vec::new(),
                regex: build_regex(&format!("^(?:{p})$")),
                suffixes: None,
            },
            None => TargetIndex::default(),
        }
    }
}

/// The JSON type a field must have; null always passes (PEFT's default).
#[derive(Clone, Copy)]
enum Want {
    Str,
    Bool,
    /// A bool or a string (`init_lora_weights`).
    BoolOrStr,
    /// A non-negative integer (`r`).
    Count,
    Number,
    /// A list of strings, or one string.
    Strings,
    /// An object of numbers; `true`: of non-negative integers (`rank_pattern`).
    Numbers(bool),
}

/// The expected type of each known field that has one (the unsupported-feature flags take any).
const TYPES: [(&str, Want, &str); 14] = [
    ("peft_type", Want::Str, "a string"),
    ("r", Want::Count, "a non-negative integer"),
    ("lora_alpha", Want::Number, "a number"),
    ("alpha", Want::Number, "a number"),
    ("use_rslora", Want::Bool, "true or false"),
    ("use_dora", Want::Bool, "true or false"),
    ("lora_bias", Want::Bool, "true or false"),
    (
        "rank_pattern",
        Want::Numbers(true),
        "an object of non-negative integers",
    ),
    ("alpha_pattern", Want::Numbers(false), "an object of numbers"),
    ("target_modules", Want::Strings, "a string or a list of strings"),
    ("target_parameters", Want::Strings, "a list of strings"),
    ("modules_to_save", Want::Strings, "a list of strings"),
    ("base_model_name_or_path", Want::Str, "a string"),
    ("init_lora_weights", Want::BoolOrStr, "true, false or a method name"),
];

/// Messages for the fields whose value has the wrong type.
fn invalid_fields(fields: &Fields<'_>) -> Vec<String> {
    let is_count = |v: f64| v >= 0.0 && v.fract() == 0.0;
    let mut out = Vec::new();
    for (name, want, expected) in TYPES {
        let Some(value) = fields.get(name) else { continue };
        let fits = match (want, value) {
            (_, Field::Null) => true,
            (Want::Str | Want::BoolOrStr, Field::Str(_)) => true,
            (Want::Bool | Want::BoolOrStr, Field::Bool(_)) => true,
            (Want::Count, Field::Number(n)) => n.as_u64().is_some(),
            (Want::Number, Field::Number(_)) => true,
            (Want::Strings, Field::Str(_)) => true,
            (Want::Strings, Field::List(_, others)) => *others == 0,
            (Want::Numbers(count), Field::Object(entries)) => {
                entries.iter().all(|(_, v)| v.is_some_and(|v| !count || is_count(v)))
            }
            _ => false,
        };
        if !fits {
            out.push(format!(
                "config field {name:?} is {}; expected {expected}",
                value.describe()
            ));
        }
    }
    out
}

impl Field {
    /// What the value is, for messages.
    fn describe(&self) -> &'static str {
        match self {
            Field::Null => "null",
            Field::Bool(_) => "a boolean",
            Field::Number(Number::U64(_)) => "an integer",
            Field::Number(Number::I64(_)) => "a negative integer",
            Field::Number(Number::F64(_)) => "a fractional number",
            Field::Str(_) => "a string",
            Field::List(_, 0) => "a list",
            Field::List(..) => "a list with items that are not strings",
            Field::Object(_) => "an object with values of the wrong type",
        }
    }
}

/// A pattern list with many keys, ready for `resolve`: its plain keys found by lookup, so that
/// a module costs a few lookups rather than one match per key (quadratic over a fleet-sized list).
#[derive(Debug, Clone, Default)]
struct PatternIndex {
    /// None for short lists: trying each pattern in order is as fast.
    plain: Option<PlainIndex>,
    /// Positions of the other (regex or bad) keys, ascending.
    others: Vec<usize>,
}

impl PatternIndex {
    fn new(patterns: &[Pattern]) -> PatternIndex {
        if patterns.len() <= 16 {
            return PatternIndex::default();
        }
        let plain = |p: &Pattern| matches!(p.matcher, Matcher::Plain);
        let keys = patterns
            .iter()
            .enumerate()
            .filter(|(_, p)| plain(p))
            .map(|(i, p)| (p.key.as_str(), i));
        PatternIndex {
            plain: Some(PlainIndex::new(keys)),
            others: (0..patterns.len()).filter(|&i| !plain(&patterns[i])).collect(),
        }
    }
}

/// Plain keys grouped by shape: their length in characters and where their dots are, counted
/// from the end. A key of one shape can only match the last characters of a name with those
/// characters turned into dots, so each shape costs one lookup. PEFT's keys come in few shapes.
#[derive(Debug, Clone, Default)]
struct PlainIndex {
    /// Each shape with its keys (key -> its first position).
    shapes: Vec<(Shape, FxHashMap<String, usize>)>,
}

/// A plain key's length in characters and the positions of its dots, counted from the end.
type Shape = (usize, Vec<usize>);

impl PlainIndex {
    fn new<'k>(keys: impl Iterator<Item = (&'k str, usize)>) -> PlainIndex {
        let mut at: FxHashMap<Shape, usize> = FxHashMap::default();
        let mut index = PlainIndex::default();
        for (key, i) in keys {
            let shape = (
                key.chars().count(),
                key.chars()
                    .rev()
                    .enumerate()
                    .filter(|(_, c)| *c == '.')
                    .map(|(j, _)| j)
                    .collect(),
            );
            let slot = *at.entry(shape.clone()).or_insert_with(|| {
                index.shapes.push((shape, FxHashMap::default()));
                index.shapes.len() - 1
            });
            index.shapes[slot].1.entry(key.to_owned()).or_insert(i);
        }
        index
    }

    /// Positions of the keys that may match `name` (to be confirmed with `plain_match`).
    fn candidates<'s>(&'s self, name: &'s str) -> impl Iterator<Item = usize> + 's {
        let mut tail = String::new();
        self.shapes.iter().filter_map(move |((len, dots), keys)| {
            tail.clear();
            let mut dots = dots.iter().peekable();
            let mut chars = name.chars().rev();
            for j in 0..*len {
                let c = chars.next()?;
                tail.push(if dots.next_if_eq(&&j).is_some() { '.' } else { c });
            }
            let key: String = tail.chars().rev().collect();
            keys.get(&key).copied()
        })
    }
}

/// Strings matched against runs of whole dotted components of a name (`modules_to_save`).
#[derive(Debug, Clone, Default)]
struct SpanSet {
    entries: rustc_hash::FxHashSet<String>,
    /// The distinct dot counts of the entries, ascending: the run lengths worth looking up.
    dots: Vec<usize>,
    /// The distinct entry lengths: a cheap filter before hashing a run.
    lens: rustc_hash::FxHashSet<usize>,
}

impl SpanSet {
    fn new(items: &[String]) -> SpanSet {
        let mut dots: Vec<usize> = items
            .iter()
            .map(|m| memchr::memchr_iter(b'.', m.as_bytes()).count())
            .collect();
        dots.sort_unstable();
        dots.dedup();
        SpanSet {
            entries: items.iter().cloned().collect(),
            dots,
            lens: items.iter().map(String::len).collect(),
        }
    }

    /// Is some entry a run of whole components of `name` that a dot follows? That is `.{m}.`
    /// inside `name` or `{m}.` at its start, found with one lookup per (component, dot count)
    /// instead of one substring search per entry.
    fn inside(&self, name: &str) -> bool {
        if self.entries.is_empty() {
            return false;
        }
        let dots: Vec<usize> = memchr::memchr_iter(b'.', name.as_bytes()).collect();
        for s in 0..dots.len() {
            let start = if s == 0 { 0 } else { dots[s - 1] + 1 };
            for &d in &self.dots {
                let Some(&end) = dots.get(s + d) else { break };
                if self.lens.contains(&(end - start)) && self.entries.contains(&name[start..end]) {
                    return true;
                }
            }
        }
        false
    }
}

/// Component prefixes (`"unet."`) from keys such as `unet.r`, in key order.
fn prefixes<'k>(keys: impl Iterator<Item = &'k str>) -> Vec<String> {
    keys.filter_map(|k| k.strip_suffix('r').filter(|p| p.ends_with('.')))
        .map(str::to_owned)
        .collect()
}

/// The entries of a pattern object; `compiled` counts the regexes built for the config so far.
fn patterns(value: Option<&Field>, bad: &mut Vec<String>, compiled: &mut usize) -> Vec<Pattern> {
    let Some(Field::Object(entries)) = value else {
        return Vec::new();
    };
    entries
        .iter()
        .filter_map(|(key, v)| {
            let value = (*v)?;
            let matcher = if regex::escape(key) == key.replace('.', "\\.") {
                Matcher::Plain
            } else if *compiled < MAX_REGEX_PATTERNS {
                *compiled += 1;
                compile(key).map_or(Matcher::Bad, Matcher::Regex)
            } else {
                Matcher::Bad
            };
            if matches!(matcher, Matcher::Bad) {
                bad.push(key.clone());
            }
            Some(Pattern {
                key: key.clone(),
                matcher,
                value,
            })
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn first_match_in_file_order() {
        let text = r#"{"r": 8, "lora_alpha": 16, "rank_pattern": {"q_proj": 4, "layers.0.self_attn.q_proj": 2},
                "alpha_pattern": {"v_proj": 3}, "target_modules": ["q_proj", "v_proj"]}"#;
        let v: Value = serde_json::from_str(text).unwrap();
        for c in [
            LoraConfig::from_map(v.as_object().unwrap(), ""),
            LoraConfig::from_json(text).unwrap(),
        ] {
            assert_eq!(c.rank_for("model.layers.0.self_attn.q_proj"), Some(4));
            assert_eq!(c.rank_for("model.layers.0.self_attn.k_proj"), Some(8));
            assert_eq!(c.alpha_for("model.layers.0.self_attn.v_proj"), Some(3.0));
            assert_eq!(c.alpha_for("model.layers.0.self_attn.xv_proj"), Some(16.0));
            assert_eq!(c.targets("model.layers.0.self_attn.v_proj"), Some(true));
            assert_eq!(c.targets("model.layers.0.self_attn.o_proj"), Some(false));
        }
    }

    /// Plain keys (only `.` as regex syntax) are matched without a regex, with the regex's answer.
    #[test]
    fn plain_keys_match_as_their_regex() {
        let keys = [
            "q_proj",
            "layers.1.q_proj",
            "",
            "é",
            "a\nb",
            "0",
            ".",
            "..",
            "a.b",
            "é.x",
        ];
        let names = [
            "q_proj",
            "x.q_proj",
            "xq_proj",
            "model.layers.1.q_proj",
            "layers.1.q_proj",
            "layersX1Yq_proj",
            "m.layers_1_q_proj",
            "a\n.q_proj",
            "layers\n1.q_proj",
            ".",
            "",
            "x.é",
            "x.a\nb",
            "a\nb",
            "m.0",
            "q_proj\n",
            "ab",
            "x.aéb",
            "x.a\u{1F600}b",
            "ééx",
            "q.é😀x",
        ];
        for key in keys {
            let plain = Pattern {
                key: key.to_owned(),
                matcher: Matcher::Plain,
                value: 1.0,
            };
            let regex = compile(key).unwrap();
            for name in names {
                assert_eq!(plain.is_match(name), regex.is_match(name), "{key:?} {name:?}");
            }
        }
    }

    /// With many keys, plain keys are looked up by shape: the same first match as a scan.
    #[test]
    fn pattern_index_keeps_the_first_match() {
        let keys = [
            "q_proj",
            "layers.1.q_proj",
            "1.q_proj",
            "v_proj",
            "x|q_proj",
            "layers\\.1\\..*",
            "model.layers.1.q_proj",
            "k_proj",
            "a\nb",
            "b",
            "",
            "(",
            "mlp.down_proj",
            "down_proj",
            "layers.0.mlp.down_proj",
            "up_proj",
        ];
        let mut seed = 0x2545_F491_4F6C_DD1Du64;
        let mut next = move || {
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            seed
        };
        let names = [
            "model.layers.1.q_proj",
            "model.layers.0.q_proj",
            "q_proj",
            "x.a\nb",
            "a\nb",
            "y\n.b",
            "model.layers.0.mlp.down_proj",
            "layers.1.k_proj",
            "",
            ".",
            "q",
            "1.q_proj",
            "up_proj.x",
            "m.layersX1Yq_proj",
            "layers.1.q_proj",
        ];
        for _ in 0..300 {
            // 17 to 30 keys in a random order, some repeated: past the 16 that switch the index on.
            let n = 17 + (next() % 14) as usize;
            let body: Vec<String> = (0..n)
                .map(|i| {
                    let key = keys[(next() % keys.len() as u64) as usize];
                    let key = if next() % 3 == 0 {
                        format!("{key}{i}")
                    } else {
                        key.to_owned()
                    };
                    format!("{}: {i}", serde_json::to_string(&key).unwrap())
                })
                .collect();
            let c = LoraConfig::from_json(&format!(r#"{{"rank_pattern": {{{}}}}}"#, body.join(","))).unwrap();
            assert!(c.rank_index.plain.is_some() || c.rank_pattern.len() <= 16);
            for name in names {
                let linear = c.rank_pattern.iter().find(|p| p.is_match(name)).map(|p| p.value as u64);
                assert_eq!(c.rank_for(name), linear.or(c.r), "{name:?} in {body:?}");
            }
        }
    }

    /// Regex keys are compiled within limits: a few bytes of config cannot take much memory.
    #[test]
    fn regex_keys_are_bounded() {
        let keys: Vec<String> = (0..100).map(|i| format!(r#""\\w{{{}}}": 4"#, 100 + i)).collect();
        let c = LoraConfig::from_json(&format!(r#"{{"rank_pattern": {{{}}}}}"#, keys.join(","))).unwrap();
        assert_eq!(c.bad_patterns.len(), 100);
        let many: Vec<String> = (0..100).map(|i| format!(r#""q{i}|v": 4"#)).collect();
        let c = LoraConfig::from_json(&format!(r#"{{"rank_pattern": {{{}}}}}"#, many.join(","))).unwrap();
        assert_eq!(c.bad_patterns.len(), 100 - MAX_REGEX_PATTERNS);
        assert_eq!(c.rank_for("x.q3"), Some(4));
    }

    /// A long target list is searched by suffix lookup, with the hits of the suffix rule.
    #[test]
    fn long_target_lists_hit_by_suffix() {
        let mut list: Vec<String> = (0..100).map(|i| format!("m{i}")).collect();
        list.extend(["q_proj", "to_out.0", "attn.to_k", "", "q_proj", "a.b.c"].map(str::to_owned));
        let c = LoraConfig::from_json(&serde_json::json!({ "target_modules": list }).to_string()).unwrap();
        assert!(c.targets.suffixes.is_some());
        for name in [
            "x.q_proj",
            "q_proj",
            "up.0.to_out.0",
            "b.attn.to_k",
            "b.xattn.to_k",
            "x.",
            "",
            "a.b.c",
            "b.c",
            "m7",
            "z.m99",
        ] {
            let last = name.rsplit('.').next().unwrap_or(name);
            let mut got = Vec::new();
            c.list_hits(name, last, |i| got.push(i));
            got.sort_unstable();
            let want: Vec<usize> = (0..list.len())
                .filter(|&i| list_entry_matches(name, &list[i]))
                .collect();
            assert_eq!(got, want, "{name:?}");
        }
    }

    #[test]
    fn components_by_prefix() {
        let text = r#"{"unet.r": 4, "unet.lora_alpha": 8, "text_encoder.r": 2, "text_encoder.target_modules": ["q_proj"], "format": "pt"}"#;
        let configs = LoraConfig::components_from_json(text).unwrap();
        let names: Vec<&str> = configs.iter().map(|(p, _)| p.as_str()).collect();
        assert_eq!(names, ["unet.", "text_encoder."]);
        assert_eq!((configs[0].1.r, configs[0].1.lora_alpha), (Some(4), Some(8.0)));
        assert_eq!(configs[1].1.targets("encoder.layers.0.self_attn.q_proj"), Some(true));
        assert!(LoraConfig::components_from_json(r#"{"format": "pt"}"#).is_none());
    }

    #[test]
    fn list_hits_follow_the_suffix_rule() {
        let c =
            LoraConfig::from_json(r#"{"target_modules": ["q_proj", "gate_proj", "to_out.0", "attn.to_k"]}"#).unwrap();
        let hits = |name: &str| {
            let last = name.rsplit('.').next().unwrap_or(name);
            let mut found = Vec::new();
            c.list_hits(name, last, |i| found.push(i));
            found
        };
        assert_eq!(hits("model.layers.0.self_attn.q_proj"), [0]);
        assert_eq!(hits("model.layers.0.mlp.gate_proj"), [1]);
        assert_eq!(hits("up.0.to_out.0"), [2]);
        assert_eq!(hits("blocks.0.attn.to_k"), [3]);
        assert_eq!(hits("blocks.0.xattn.to_k"), Vec::<usize>::new());
        assert_eq!(hits("q_proj"), [0]);
        assert_eq!(hits("xq_proj"), Vec::<usize>::new());
    }
}
