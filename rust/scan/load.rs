//! Loading one adapter: its config, its header (through the memo), its classification and, when asked,
//! the hash of its data; a panic while loading becomes the adapter's `internal` error.

use std::cell::RefCell;
use std::fs;
use std::io::Read;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::path::{Path, PathBuf};
use std::rc::Rc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, PoisonError, RwLock};

use sha2::{Digest, Sha256};

use super::memo;
use crate::classify::{classify, Configs, Options};
use crate::config::LoraConfig;
use crate::error::{AdapterErrorCode, Error, HeaderError};
use crate::header::{header_bytes, owned_metadata, parse_header_unchecked_names, read_header_from, Header, N_LEN};
use crate::open::{not_regular, open_nonblocking};
use crate::torch;

use super::discover::{missing_weights, read_config_file, torch_fallback, weights_error, ConfigBytes};
use super::{AdapterResult, ScanOptions, Target};

/// A config larger than this is not an adapter config; refuse rather than read it whole.
pub(super) const MAX_CONFIG_BYTES: u64 = 16 << 20;

/// Refuses a config too large to be one (before it is read whole).
pub fn check_config_size(path: &Path, len: u64) -> Result<(), Error> {
    if len > MAX_CONFIG_BYTES {
        return Err(config_too_large(path, len));
    }
    Ok(())
}

pub(super) fn config_too_large(path: &Path, len: u64) -> Error {
    Error::adapter(
        path,
        AdapterErrorCode::InvalidConfig,
        format!("{len} bytes is too large for an adapter config"),
    )
}

/// Parses the bytes of an `adapter_config.json` (read from disk or fetched from a store).
pub fn parse_config(path: &Path, bytes: Vec<u8>) -> Result<(String, LoraConfig), Error> {
    let text = config_text(path, bytes)?;
    let config = parse_config_text(path, &text)?;
    Ok((text, config))
}

fn config_text(path: &Path, bytes: Vec<u8>) -> Result<String, Error> {
    String::from_utf8(bytes).map_err(|_| {
        Error::adapter(
            path,
            AdapterErrorCode::InvalidConfig,
            "not UTF-8 text: stream did not contain valid UTF-8",
        )
    })
}

pub(super) fn parse_config_text(path: &Path, text: &str) -> Result<LoraConfig, Error> {
    LoraConfig::from_json(text).map_err(|message| Error::adapter(path, AdapterErrorCode::InvalidConfig, message))
}

/// Configs a scan thread keeps parsed, by text (see `parse_config_kept`).
pub(super) const CONFIGS_KEPT: usize = 8;
/// The longest config text kept: memory per thread stays bounded.
const MAX_KEPT_CONFIG: usize = 64 << 10;

thread_local! {
    /// The configs this thread parsed last, most recent first: the adapters of a fleet share a
    /// few configs, and parsing one costs about as much as a tenth of a 448-tensor header.
    static CONFIGS: RefCell<Vec<(String, Rc<LoraConfig>)>> = const { RefCell::new(Vec::new()) };
}

/// `parse_config_text`, answered from this thread's parsed configs when `text` is one of them.
/// A config is a pure function of its text, so a kept one is exactly what a new parse gives.
pub(super) fn parse_config_kept(path: &Path, text: &str) -> Result<Rc<LoraConfig>, Error> {
    let kept = CONFIGS.with(|cell| {
        let mut configs = cell.borrow_mut();
        let i = configs.iter().position(|(t, _)| t == text)?;
        configs[..=i].rotate_right(1);
        Some(Rc::clone(&configs[0].1))
    });
    if let Some(config) = kept {
        return Ok(config);
    }
    let config = Rc::new(parse_config_text(path, text)?);
    if text.len() <= MAX_KEPT_CONFIG {
        CONFIGS.with(|cell| {
            let mut configs = cell.borrow_mut();
            configs.truncate(CONFIGS_KEPT - 1);
            configs.insert(0, (text.to_owned(), Rc::clone(&config)));
        });
    }
    Ok(config)
}

/// diffusers keeps the PEFT config of each component in `lora_adapter_metadata`, keys prefixed
/// by the component (`unet.r`, `text_encoder.r`): one config per component.
fn metadata_configs(header: &Header<'_>) -> Option<(String, Vec<(String, LoraConfig)>)> {
    let text = header.metadata_value("lora_adapter_metadata")?;
    let configs = LoraConfig::components_from_json(text)?;
    Some((text.to_owned(), configs))
}

thread_local! {
    /// Header bytes, reused across the files one thread reads.
    static BUF: RefCell<Vec<u8>> = const { RefCell::new(Vec::new()) };
}

/// A thread keeps its header buffer between files up to this size. A larger one (a rare header
/// of many megabytes) is freed after its file, not held for the life of the thread.
pub const KEEP_BUF_BYTES: usize = 4 << 20;

/// Loads and classifies one adapter. A panic while doing so becomes its `internal` error.
pub fn load(target: Target, opts: ScanOptions) -> Result<AdapterResult, Error> {
    load_read(target, None, opts)
}

/// `load` with the config's bytes already read (None: read them here, if the target has a config).
pub(super) fn load_read(
    target: Target,
    config: Option<ConfigBytes>,
    opts: ScanOptions,
) -> Result<AdapterResult, Error> {
    let at = target.weights.clone();
    contain(&at, || load_inner(target, config, opts))
}

/// Runs `f`, the work for `path`; a panic in it becomes `path`'s error (code `internal`) instead
/// of unwinding through a scan and losing every other row.
pub fn contain<T>(path: &Path, f: impl FnOnce() -> Result<T, Error>) -> Result<T, Error> {
    catch_unwind(AssertUnwindSafe(f)).unwrap_or_else(|payload| Err(Error::panicked(path, &*payload)))
}

/// Test hook behind `_core._debug_panic_on`: loading these weights panics, so that tests can show
/// a panic becoming an error row or exception. Not public API.
static PANIC_ON: RwLock<Option<PathBuf>> = RwLock::new(None);
static PANIC_ARMED: AtomicBool = AtomicBool::new(false);

/// Arms (`Some`) or disarms (`None`) the test hook that makes loading `path` panic.
pub fn debug_panic_on(path: Option<PathBuf>) {
    PANIC_ARMED.store(path.is_some(), Ordering::SeqCst);
    *PANIC_ON.write().unwrap_or_else(PoisonError::into_inner) = path;
}

/// Panics when the test hook is armed for `path` (see `debug_panic_on`); else does nothing.
pub fn debug_hook(path: &Path) {
    if PANIC_ARMED.load(Ordering::Relaxed) && PANIC_ON.read().is_ok_and(|p| p.as_deref() == Some(path)) {
        panic!("debug hook: forced panic while classifying {}", path.display());
    }
}

fn load_inner(target: Target, config: Option<ConfigBytes>, opts: ScanOptions) -> Result<AdapterResult, Error> {
    debug_hook(&target.weights);
    // The weights first: a PEFT folder without them is `missing_weights`, whatever its config holds.
    // Opened without blocking and checked to be a regular file: a FIFO or device is reported.
    if torch::is_torch_weights(&target.weights) {
        return torch::load(target, config, opts);
    }
    let (weights, meta) = match open_nonblocking(&target.weights) {
        Ok((_, meta)) if target.config.is_some() && meta.is_dir() => {
            let missing = missing_weights(&target.path);
            return torch::load(torch_fallback(target, missing)?, config, opts);
        }
        Ok(opened) => opened,
        Err(e) => {
            let missing = weights_error(&target, e);
            return torch::load(torch_fallback(target, missing)?, config, opts);
        }
    };
    if !meta.is_file() {
        return Err(not_regular(&target.weights, &meta));
    }
    let text = match (config, &target.config) {
        (Some(bytes), Some(path)) => Some(config_text(path, bytes)?),
        (None, Some(path)) => match read_config_file(path)? {
            Some(bytes) => Some(config_text(path, bytes)?),
            None => return Err(Error::io(path, std::io::ErrorKind::NotFound.into())),
        },
        _ => None,
    };
    BUF.with(|cell| {
        let mut buf = cell.borrow_mut();
        let result = load_header(target, &weights, meta.len(), text, opts, &mut buf);
        if buf.capacity() > KEEP_BUF_BYTES {
            *buf = Vec::new();
        }
        result
    })
}

/// The rest of a load, with the weights open and the config's text read: header, memo, classification.
fn load_header(
    target: Target,
    weights: &fs::File,
    len: u64,
    text: Option<String>,
    opts: ScanOptions,
    buf: &mut Vec<u8>,
) -> Result<AdapterResult, Error> {
    // Borrowed from the target (until it moves into the result): nothing copies it.
    let config_path = target.config.as_deref().unwrap_or(Path::new(""));
    let (file_size, n) = match read_header_from(weights, &target.weights, len, opts.mode, buf) {
        Ok(x) => x,
        Err(e) => {
            // A bad config is reported before a bad header, as when it is read first.
            text.as_ref().map(|t| parse_config_text(config_path, t)).transpose()?;
            return Err(e);
        }
    };
    let bytes = header_bytes(buf, n);
    let content_hash = if opts.content_hash {
        Some(hash_data(weights, &target.weights, N_LEN + n as u64)?)
    } else {
        None
    };
    let remember = !opts.fresh;
    let key = remember.then(|| memo::Key::of(bytes, file_size, text.as_deref()).with_modules(opts.keep_modules));
    // A remembered classification shares its modules (an `Arc`); the metadata is the adapter's own
    // (parsed with the key when it leads the header; else the whole header is the key).
    let hit = key.as_ref().and_then(memo::get);
    let result = match hit {
        Some((class, config_json, metadata)) => AdapterResult {
            config_json: match config_json {
                memo::ConfigJson::KeyConfig => text,
                memo::ConfigJson::Other(json) => json,
            },
            metadata,
            header_size: n as u64,
            file_size,
            class,
            content_hash,
            target,
        },
        None => {
            let config = text.as_ref().map(|t| parse_config_kept(config_path, t)).transpose()?;
            // Repeated tensor names are found by `classify` while it groups tensors (cheaper
            // than a separate pass); `duplicate_tensor` turns them back into the header error.
            let header = parse_header_unchecked_names(bytes, file_size).map_err(|kind| Error::Header {
                path: target.weights.clone(),
                kind,
            })?;
            let alphas = target.weights.clone();
            let result = build_result_of(
                target,
                text.clone(),
                config.as_deref(),
                &header,
                &alphas,
                opts,
                content_hash,
            );
            if let Some(key) = &key {
                memo::put(
                    key,
                    &result.class,
                    result.config_json.as_deref(),
                    result.metadata.as_deref(),
                );
            }
            result
        }
    };
    match result.class.duplicate_tensor {
        Some(ref name) => Err(Error::Header {
            path: result.target.weights.clone(),
            kind: HeaderError::DuplicateTensor(name.clone()),
        }),
        None => Ok(result),
    }
}

/// Classifies a read header: the part of a load that local files and remote objects share.
/// `alpha_file` is where `classify` reads kohya `.alpha` scalars from (the weights, or a local
/// stand-in holding the fetched bytes of a remote file).
pub fn build_result(
    target: Target,
    config: Option<(String, LoraConfig)>,
    header: &Header<'_>,
    alpha_file: &Path,
    opts: ScanOptions,
    content_hash: Option<String>,
) -> AdapterResult {
    let (text, config) = config.unzip();
    build_result_of(target, text, config.as_ref(), header, alpha_file, opts, content_hash)
}

/// `build_result` with the config's text and the config it parses to apart.
fn build_result_of(
    target: Target,
    text: Option<String>,
    config: Option<&LoraConfig>,
    header: &Header<'_>,
    alpha_file: &Path,
    opts: ScanOptions,
    content_hash: Option<String>,
) -> AdapterResult {
    let meta_config = if config.is_none() {
        metadata_configs(header)
    } else {
        None
    };
    let configs = Configs {
        file: config,
        components: meta_config.as_ref().map_or(&[], |(_, c)| c.as_slice()),
    };
    let class = Arc::new(classify(
        header,
        configs,
        alpha_file,
        Options {
            keep_modules: opts.keep_modules,
        },
    ));
    AdapterResult {
        config_json: text.or(meta_config.map(|(text, _)| text)),
        // Kept with the modules only: a scan without them never copies the pairs.
        metadata: header
            .metadata
            .as_ref()
            .filter(|_| opts.keep_modules)
            .map(owned_metadata),
        header_size: header.header_size,
        file_size: header.file_size,
        class,
        content_hash,
        target,
    }
}

/// sha256 of the data section only, so metadata edits do not change it (kohya's `sshs_model_hash`).
/// Reads the already open (and checked) `file`, so the path cannot be swapped for a FIFO meanwhile.
fn hash_data(mut file: &fs::File, path: &Path, data_start: u64) -> Result<String, Error> {
    use std::io::{Seek, SeekFrom};
    file.seek(SeekFrom::Start(data_start)).map_err(|e| Error::io(path, e))?;
    let mut hasher = Sha256::new();
    let mut chunk = vec![0u8; 1 << 20];
    loop {
        let n = file.read(&mut chunk).map_err(|e| Error::io(path, e))?;
        if n == 0 {
            break;
        }
        hasher.update(&chunk[..n]);
    }
    Ok(hasher.finalize().iter().map(|b| format!("{b:02x}")).collect())
}

#[cfg(test)]
mod tests {
    use std::fs;
    use std::path::PathBuf;

    use super::*;
    use crate::error::AdapterErrorCode;
    use crate::scan::scan_paths;

    fn temp_dir(name: &str) -> PathBuf {
        let dir = std::env::temp_dir().join(format!("lorafast-scan-{name}-{}", std::process::id()));
        let _ = fs::remove_dir_all(&dir);
        fs::create_dir_all(&dir).unwrap();
        dir
    }

    /// A kept config is the config its text parses to, and the thread keeps at most
    /// `CONFIGS_KEPT`, the most recently used.
    #[test]
    fn kept_configs_are_what_their_text_parses_to() {
        let path = Path::new("adapter_config.json");
        let text = |r: usize| format!(r#"{{"r": {r}, "lora_alpha": {}, "target_modules": ["q_proj"]}}"#, 2 * r);
        for round in 0..3 {
            for r in 0..CONFIGS_KEPT + 2 {
                let kept = parse_config_kept(path, &text(r)).unwrap();
                let fresh = parse_config_text(path, &text(r)).unwrap();
                assert_eq!(format!("{kept:?}"), format!("{fresh:?}"), "round {round}, r {r}");
            }
        }
        CONFIGS.with(|c| assert_eq!(c.borrow().len(), CONFIGS_KEPT));
        let bad = parse_config_kept(path, "{").unwrap_err();
        assert_eq!(
            format!("{bad:?}"),
            format!("{:?}", parse_config_text(path, "{").unwrap_err())
        );
    }

    /// A one-tensor safetensors file whose header carries `pad` bytes of metadata.
    fn write_adapter(path: &Path, pad: usize) {
        let mut header = format!(
            r#"{{"__metadata__":{{"pad":"{}"}},"t.lora_A.weight":{{"dtype":"F32","shape":[1],"data_offsets":[0,4]}}}}"#,
            "x".repeat(pad)
        )
        .into_bytes();
        header.resize(header.len().next_multiple_of(8), b' ');
        let mut bytes = (header.len() as u64).to_le_bytes().to_vec();
        bytes.extend_from_slice(&header);
        bytes.extend_from_slice(&[0; 4]);
        fs::write(path, bytes).unwrap();
    }

    /// A remembered load gives the adapter's metadata as a full parse does: one that leads the header
    /// (parsed with the memo's key), one after the tensors (kept with the remembered result), none.
    #[test]
    fn a_remembered_load_has_the_metadata_of_a_full_parse() {
        let dir = temp_dir("memo-metadata");
        let entry = r#""t.lora_A.weight":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}"#;
        let headers = [
            format!(r#"{{"__metadata__":{{"a":"1","b":"2"}},{entry}}}"#),
            format!(r#"{{{entry},"__metadata__":{{"z":"9","a":"1"}}}}"#),
            format!(r#"{{{entry}}}"#),
        ];
        for (i, header) in headers.iter().enumerate() {
            let path = dir.join(format!("m{i}.safetensors"));
            let mut bytes = header.clone().into_bytes();
            bytes.resize(bytes.len().next_multiple_of(8), b' ');
            let mut file = (bytes.len() as u64).to_le_bytes().to_vec();
            file.extend_from_slice(&bytes);
            file.extend_from_slice(&[0; 4]);
            fs::write(&path, file).unwrap();
            let target = Target {
                path: path.clone(),
                weights: path.clone(),
                config: None,
            };
            let opts = |fresh| ScanOptions {
                keep_modules: true,
                fresh,
                ..ScanOptions::default()
            };
            let full = load(target.clone(), opts(true)).unwrap().metadata;
            // The first remembered load fills the memo, the second is answered from it.
            for _ in 0..2 {
                assert_eq!(load(target.clone(), opts(false)).unwrap().metadata, full, "{header}");
            }
            assert_eq!(full.is_some(), i < 2, "{header}");
        }
        fs::remove_dir_all(&dir).unwrap();
    }

    fn buffer_capacity() -> usize {
        BUF.with(|b| b.borrow().capacity())
    }

    #[test]
    fn oversized_header_buffer_is_released_after_its_file() {
        let dir = temp_dir("buf");
        let (small, big) = (dir.join("small.safetensors"), dir.join("big.safetensors"));
        write_adapter(&small, 100);
        write_adapter(&big, 3 * KEEP_BUF_BYTES);
        let target = |p: &Path| Target {
            path: p.to_path_buf(),
            weights: p.to_path_buf(),
            config: None,
        };
        load(target(&small), ScanOptions::default()).unwrap();
        let kept = buffer_capacity();
        assert!(
            kept > 0 && kept <= KEEP_BUF_BYTES,
            "a small header's buffer is kept for reuse"
        );
        let result = load(target(&big), ScanOptions::default()).unwrap();
        assert!(result.header_size > 3 * KEEP_BUF_BYTES as u64);
        assert_eq!(
            buffer_capacity(),
            0,
            "the big header's buffer is freed once its file is done"
        );
        fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn a_panic_while_loading_becomes_that_adapters_internal_error() {
        let dir = temp_dir("panic");
        let (ok, bad) = (dir.join("a.safetensors"), dir.join("b.safetensors"));
        write_adapter(&ok, 8);
        write_adapter(&bad, 8);
        debug_panic_on(Some(bad.clone()));
        let rows = scan_paths(std::slice::from_ref(&dir), true, ScanOptions::default(), Some(2), false);
        debug_panic_on(None);
        assert_eq!(rows.len(), 2);
        assert!(rows[0].is_ok());
        let err = rows[1].as_ref().unwrap_err();
        assert_eq!(
            (err.error_code(), err.path()),
            (AdapterErrorCode::Internal.into(), &bad)
        );
        assert!(err.detail().contains("forced panic"), "{}", err.detail());
        fs::remove_dir_all(&dir).unwrap();
    }
}
