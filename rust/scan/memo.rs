//! Classifications remembered per scan thread, keyed on all that validation and classification
//! read: the header's tensor entries (bytes), the data section's size, the config text, and of the
//! `__metadata__`, only `lora_adapter_metadata` (diffusers' config).
//!
//! The adapters of a fleet are mostly trained from a few recipes, so their tensor entries are often
//! byte for byte the same (same names, dtypes, shapes and therefore offsets), while training tools
//! write run-specific `__metadata__` (kohya's `ss_*` keys, timestamps, hashes). Validation and
//! classification are a pure function of the key, so an adapter whose key equals one seen before
//! gets the same result without parsing its entries again; its metadata, when it leads the header
//! as the serializer writes it, is still parsed and checked. Every byte of the key is compared,
//! never just a hash, so a hit is exact. Results that read tensor data (kohya `.alpha` values) are
//! never remembered, because the data is not part of the key.

use std::borrow::Cow;
use std::cell::{Cell, RefCell};
use std::sync::Arc;

use crate::classify::Classification;
use crate::codes::Flag;
use crate::header::{owned_metadata, split_leading_metadata, Metadata, N_LEN};

/// Entries kept per thread: enough for the handful of recipes a fleet is made from, few enough
/// that a miss costs little (most entries differ in length or in their first bytes).
const ENTRIES: usize = 16;
/// Bytes of tensor entries kept per thread, at most: with many threads, memory stays bounded
/// (64 threads: 256 MiB at worst; a 448-tensor adapter's entries take 57 KB).
const BUDGET: usize = 4 << 20;
/// Headers longer than this are not remembered (each entry keeps a copy of its header).
const MAX_HEADER: usize = BUDGET / 4;

struct Entry {
    modules: bool,
    metadata_first: bool,
    entries: Vec<u8>,
    lora_metadata: Option<String>,
    data_size: u64,
    config: Option<String>,
    class: Arc<Classification>,
    /// The result's config text: a hit on a PEFT folder takes the text it read (`KeyConfig`), not a copy.
    config_json: ConfigJson,
    /// The header's `__metadata__` pairs, kept for a header whose metadata does not lead it: its
    /// `entries` are then the whole header, so its metadata is the same in every header that
    /// matches. (A leading one is the key's own, parsed by `Key::of`.)
    metadata: Option<Vec<(String, String)>>,
}

/// After this many misses in a row, a thread remembers only one new header in `SAMPLE`.
const STREAK: u32 = 32;
/// One new header in this many is remembered during a streak of misses.
const SAMPLE: u32 = 8;

thread_local! {
    /// Most recently used first.
    static ENTRIES_OF_THREAD: RefCell<Vec<Entry>> = const { RefCell::new(Vec::new()) };
    /// Misses since this thread's last hit. In a fleet whose headers never repeat, remembering
    /// each one copies its entries (57 KB for 448 tensors) and a classification for nothing: past
    /// `STREAK` misses only every `SAMPLE`th is remembered, so a header that does repeat is
    /// remembered within `SAMPLE` of its loads, and its first hit ends the streak.
    static MISSES: Cell<u32> = const { Cell::new(0) };
}

/// The input a validation and classification depend on.
pub struct Key<'a> {
    /// Whether the header opened with a valid `__metadata__`, which `entries` then follow.
    metadata_first: bool,
    /// The header after its leading `__metadata__` value, or the whole header.
    entries: &'a [u8],
    /// The `lora_adapter_metadata` value of a leading `__metadata__`.
    lora_metadata: Option<Cow<'a, str>>,
    /// The pairs of a leading `__metadata__` (None when it is not leading, or has no pairs).
    metadata: Option<Metadata<'a>>,
    /// File size minus length prefix and header: the coverage check compares offsets with it.
    data_size: u64,
    /// The text of `adapter_config.json`.
    config: Option<&'a str>,
    /// Whether the classification keeps its modules (`ScanOptions::keep_modules`): a result without
    /// them must never answer a load that wants them, nor the other way round.
    modules: bool,
}

impl<'a> Key<'a> {
    /// The key of a header (`bytes`, read from a `file_size`-byte file) and its config's text.
    pub fn of(bytes: &'a [u8], file_size: u64, config: Option<&'a str>) -> Self {
        let data_size = file_size.saturating_sub(N_LEN + bytes.len() as u64);
        let (metadata_first, entries, metadata) = match split_leading_metadata(bytes) {
            Some((metadata, rest)) => (true, rest, metadata),
            None => (false, bytes, None),
        };
        let lora_metadata = metadata
            .iter()
            .flatten()
            .find(|(k, _)| k == "lora_adapter_metadata")
            .map(|(_, v)| v.clone());
        Key {
            metadata_first,
            entries,
            lora_metadata,
            metadata,
            data_size,
            config,
            modules: false,
        }
    }

    /// The same key for a load that keeps (or not) its modules.
    pub fn with_modules(mut self, modules: bool) -> Self {
        self.modules = modules;
        self
    }
}

impl Entry {
    fn matches(&self, key: &Key<'_>) -> bool {
        self.data_size == key.data_size
            && self.modules == key.modules
            && self.metadata_first == key.metadata_first
            && self.entries.len() == key.entries.len()
            && self.config.as_deref() == key.config
            && self.lora_metadata.as_deref() == key.lora_metadata.as_deref()
            && self.entries == key.entries
    }
}

/// What a remembered load gives: the classification, the config text (`KeyConfig`: the key's own) and,
/// for a key that keeps its modules, the header's `__metadata__` pairs.
pub type Hit = (Arc<Classification>, ConfigJson, Option<Vec<(String, String)>>);

/// A remembered result's config text.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ConfigJson {
    /// The key's config text (what the load read from `adapter_config.json`).
    KeyConfig,
    /// Another text (the one a diffusers header carries), or none.
    Other(Option<String>),
}

/// The classification (and config text, and metadata) remembered for `key` on this thread, if any.
pub fn get(key: &Key<'_>) -> Option<Hit> {
    ENTRIES_OF_THREAD.with(|entries| {
        let mut entries = entries.borrow_mut();
        let Some(i) = entries.iter().position(|e| e.matches(key)) else {
            MISSES.with(|m| m.set(m.get().saturating_add(1)));
            return None;
        };
        MISSES.with(|m| m.set(0));
        entries[..=i].rotate_right(1);
        let e = &entries[0];
        let metadata = match (key.modules, key.metadata_first) {
            (false, _) => None,
            (true, true) => key.metadata.as_ref().map(owned_metadata),
            (true, false) => e.metadata.clone(),
        };
        Some((Arc::clone(&e.class), e.config_json.clone(), metadata))
    })
}

/// Remembers `class` for `key`, unless it depends on more than the key. `metadata`: the load's
/// `__metadata__` pairs (kept with modules).
pub fn put(
    key: &Key<'_>,
    class: &Arc<Classification>,
    config_json: Option<&str>,
    metadata: Option<&[(String, String)]>,
) {
    if class.flags & Flag::KohyaAlpha.bit() != 0 || key.entries.len() > MAX_HEADER {
        return;
    }
    let misses = MISSES.with(Cell::get);
    if misses > STREAK && misses % SAMPLE != 0 {
        return;
    }
    ENTRIES_OF_THREAD.with(|entries| {
        let mut entries = entries.borrow_mut();
        // The evicted entry's buffer takes the new bytes: a scan of unique headers then allocates
        // nothing here once the memory is full.
        let mut bytes = Vec::new();
        let mut held: usize = entries.iter().map(|e| e.entries.capacity()).sum();
        while entries.len() == ENTRIES || (held + key.entries.len() > BUDGET && !entries.is_empty()) {
            if let Some(evicted) = entries.pop() {
                held -= evicted.entries.capacity();
                bytes = evicted.entries;
            }
        }
        bytes.clear();
        bytes.extend_from_slice(key.entries);
        entries.insert(
            0,
            Entry {
                modules: key.modules,
                metadata_first: key.metadata_first,
                entries: bytes,
                lora_metadata: key.lora_metadata.as_deref().map(str::to_owned),
                data_size: key.data_size,
                config: key.config.map(str::to_owned),
                class: Arc::clone(class),
                config_json: match (config_json, key.config) {
                    (Some(json), Some(text)) if json == text => ConfigJson::KeyConfig,
                    (json, _) => ConfigJson::Other(json.map(str::to_owned)),
                },
                metadata: if key.metadata_first {
                    None
                } else {
                    metadata.map(<[_]>::to_vec)
                },
            },
        );
    });
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A one-tensor header whose tensor is named after `i`.
    fn header(i: usize) -> String {
        format!(r#"{{"t{i}.lora_A.weight":{{"dtype":"F32","shape":[1],"data_offsets":[0,4]}}}}"#)
    }

    #[test]
    fn a_streak_of_misses_remembers_one_header_in_sample_and_a_hit_ends_it() {
        let text = header(0);
        let parsed = crate::header::parse_header(text.as_bytes(), 8 + text.len() as u64 + 4).unwrap();
        let class = Arc::new(crate::classify::classify(
            &parsed,
            crate::classify::Configs::default(),
            std::path::Path::new("x"),
            crate::classify::Options::default(),
        ));
        let load = |text: &str| {
            let key = Key::of(text.as_bytes(), 100, None);
            let hit = get(&key).is_some();
            if !hit {
                put(&key, &class, None, None);
            }
            hit
        };
        // Before the streak, a header is remembered at its first load.
        assert!(!load(&header(1)));
        assert!(load(&header(1)));
        for i in 0..STREAK as usize + 5 {
            assert!(!load(&header(100 + i)));
        }
        // During the streak, a header that repeats is not remembered at once (the third load
        // here would hit), but within SAMPLE loads of it.
        let again = header(1_000);
        let loads = (1..=SAMPLE + 1).find(|_| load(&again)).unwrap();
        assert!(loads > 2 && loads <= SAMPLE + 1, "{loads}");
        // Its hit ended the streak: the next new header is remembered at its first load again.
        assert!(!load(&header(2_000)));
        assert!(load(&header(2_000)));
    }
}
