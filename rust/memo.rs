//! Classifications remembered per scan thread, keyed on all that a classification reads: the
//! header bytes, the file size and the config text.
//!
//! The adapters of a fleet are mostly trained from a few recipes, so their headers are often
//! byte for byte the same (same names, dtypes, shapes and therefore offsets). Validation and
//! classification are a pure function of that input, so an adapter whose input equals one seen
//! before gets the same result without parsing again. Every byte of the key is compared, never
//! just a hash, so a hit is exact. Results that read tensor data (kohya `.alpha` values) are never
//! remembered, because the data is not part of the key.

use std::cell::RefCell;

use crate::classify::{flags, Classification};

/// Entries kept per thread: enough for the handful of recipes a fleet is made from, few enough
/// that a miss costs little (most entries differ in length or in their first bytes).
const ENTRIES: usize = 16;
/// Headers longer than this are not remembered (each entry keeps a copy of its header).
const MAX_HEADER: usize = 1 << 20;

struct Entry {
    header: Vec<u8>,
    file_size: u64,
    config: Option<String>,
    class: Classification,
    /// The result's config text: the key's, or the one a diffusers header carries in its metadata.
    config_json: Option<String>,
}

thread_local! {
    /// Most recently used first.
    static ENTRIES_OF_THREAD: RefCell<Vec<Entry>> = const { RefCell::new(Vec::new()) };
}

/// The input a classification depends on.
#[derive(Clone, Copy)]
pub struct Key<'a> {
    pub header: &'a [u8],
    pub file_size: u64,
    pub config: Option<&'a str>,
}

impl Entry {
    fn matches(&self, key: &Key<'_>) -> bool {
        self.file_size == key.file_size
            && self.header.len() == key.header.len()
            && self.config.as_deref() == key.config
            && self.header == key.header
    }
}

/// The classification (and config text) remembered for `key` on this thread, if any.
pub fn get(key: &Key<'_>) -> Option<(Classification, Option<String>)> {
    ENTRIES_OF_THREAD.with(|entries| {
        let mut entries = entries.borrow_mut();
        let i = entries.iter().position(|e| e.matches(key))?;
        entries[..=i].rotate_right(1);
        Some((entries[0].class.clone(), entries[0].config_json.clone()))
    })
}

/// Remembers `class` for `key`, unless it depends on more than the key.
pub fn put(key: &Key<'_>, class: &Classification, config_json: Option<&str>) {
    if class.flags & flags::KOHYA_ALPHA != 0 || key.header.len() > MAX_HEADER {
        return;
    }
    ENTRIES_OF_THREAD.with(|entries| {
        let mut entries = entries.borrow_mut();
        if entries.len() == ENTRIES {
            entries.pop();
        }
        entries.insert(
            0,
            Entry {
                header: key.header.to_vec(),
                file_size: key.file_size,
                config: key.config.map(str::to_owned),
                class: class.clone(),
                config_json: config_json.map(str::to_owned),
            },
        );
    });
}
