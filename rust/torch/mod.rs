//! `.bin` / `.pt` weights (`torch.save`'s zip format) read like a safetensors header: tensor
//! names, dtypes and shapes from `data.pkl`, interpreted by [`pickle`] without running it,
//! each checked against its storage record in the zip ([`zip`]). The entries become a
//! `Header`, so these adapters get the same classification and checks as safetensors ones.

use std::borrow::Cow;
use std::fs::File;
use std::io::{self, Read};
use std::path::{Path, PathBuf};
use std::rc::Rc;

use rustc_hash::FxHashMap;

use crate::codes::ProblemCode;
use crate::error::{AdapterErrorCode, Error, ErrorCode, TorchErrorCode};
use crate::header::{Header, TensorEntry, Warning, N_LEN};
use crate::open::open_regular;
use crate::scan::{build_result, check_config_size, parse_config, AdapterResult, ScanOptions, Target};

pub mod pickle;
pub mod zip;

use pickle::{read_state_dict, Storage, Tensor};
use zip::{read_at, Archive};

/// PEFT's pickled weights, in vLLM's order after `adapter_model.safetensors`.
pub const PEFT_TORCH_WEIGHTS: [&str; 2] = ["adapter_model.bin", "adapter_model.pt"];
/// A larger `data.pkl` is refused unread (a 100,000-tensor state dict pickles to about 20 MB).
pub const MAX_PICKLE_BYTES: u64 = 64 << 20;

/// Why a torch file was refused, before the path is known.
#[derive(Debug)]
pub enum TorchError {
    /// The file is refused.
    Format {
        /// Why.
        code: TorchErrorCode,
        /// What is wrong, for people.
        message: String,
    },
    /// Reading the file failed.
    Io(io::Error),
}

impl TorchError {
    /// A refusal with `code`.
    pub fn new(code: TorchErrorCode, message: impl Into<String>) -> Self {
        TorchError::Format {
            code,
            message: message.into(),
        }
    }

    /// This refusal's code (`io_error` for a failed read).
    pub fn error_code(&self) -> ErrorCode {
        match self {
            TorchError::Format { code, .. } => (*code).into(),
            TorchError::Io(_) => AdapterErrorCode::IoError.into(),
        }
    }

    /// This refusal's code, as Python spells it.
    pub fn code(&self) -> &'static str {
        self.error_code().code()
    }

    /// The error of the adapter at `path`.
    pub fn into_error(self, path: &Path) -> Error {
        match self {
            TorchError::Format { code, message } => Error::adapter(path, code, message),
            TorchError::Io(e) => Error::io(path, e),
        }
    }
}

/// A torch file read as a header.
#[derive(Debug)]
pub struct TorchHeader {
    /// `header_size` is 0, so `data_start()` is 8 and `data_start() + begin` is the file offset
    /// of a tensor's first byte, where `classify` reads kohya `.alpha` scalars.
    pub header: Header<'static>,
    /// Size of `data.pkl`, reported as the header size.
    pub pickle_size: u64,
    /// The archive's top folder (`archive`, or the saved file's stem).
    pub prefix: String,
}

/// Whether `path` names torch-pickled weights (by extension, as vLLM and PEFT name them).
pub fn is_torch_weights(path: &Path) -> bool {
    path.extension().is_some_and(|e| e == "bin" || e == "pt" || e == "pth")
}

/// The pickled weights of a PEFT folder without `adapter_model.safetensors`, as vLLM picks them.
pub fn fallback_weights(dir: &Path) -> Option<PathBuf> {
    PEFT_TORCH_WEIGHTS
        .iter()
        .map(|name| dir.join(name))
        .find(|p| p.is_file())
}

/// Reads the tensors of the torch file `file` (`file_size` bytes).
pub fn read_torch_file(file: &File, file_size: u64) -> Result<TorchHeader, TorchError> {
    let magic = read_at(file, 0, file_size.min(4) as usize)?;
    if magic.first() == Some(&0x80) {
        return Err(TorchError::new(
            TorchErrorCode::LegacyTorchFormat,
            "a pre-1.6 (non-zip) torch file, whose pickle is not read; re-save it with a current torch.save",
        ));
    }
    if magic != b"PK\x03\x04" {
        return Err(TorchError::new(
            TorchErrorCode::InvalidZip,
            "not a zip archive (torch.save's format)",
        ));
    }
    let zip = Archive::open(file, file_size)?;
    if let Some(order) = zip.record("byteorder") {
        let text = if order.size <= 16 {
            zip.read(order, 16)?
        } else {
            Vec::new()
        };
        if text != b"little" {
            return Err(TorchError::new(
                TorchErrorCode::UnsupportedByteorder,
                format!(
                    "byteorder {:?}; only little-endian files are read",
                    String::from_utf8_lossy(&text)
                ),
            ));
        }
    }
    let pkl = zip.record("data.pkl").ok_or_else(|| {
        TorchError::new(
            TorchErrorCode::InvalidZip,
            format!("no {}/data.pkl record: not a torch.save file", zip.prefix()),
        )
    })?;
    let pickle = zip.read(pkl, MAX_PICKLE_BYTES.min(file_size))?;
    let mut state = read_state_dict(&pickle)?;
    drop(pickle);
    check_version(&zip)?;

    // Each storage once, used by a tensor of the state dict or not (torch reads them all): its
    // record must hold exactly the bytes its persistent id declares. The reader gives one `Storage`
    // per key, so its address names it.
    let mut starts: FxHashMap<*const Storage, u64> = FxHashMap::default();
    for storage in &state.storages {
        let key = &storage.key;
        let record = zip.record(&format!("data/{key}")).ok_or_else(|| {
            TorchError::new(
                TorchErrorCode::InvalidTorchTensor,
                format!("storage record data/{key} is missing"),
            )
        })?;
        if record.size != storage.nbytes() {
            return Err(TorchError::new(
                TorchErrorCode::InvalidTorchTensor,
                format!(
                    "storage data/{key} holds {} bytes, its {} {} elements need {}",
                    record.size,
                    storage.numel,
                    storage.dtype.name(),
                    storage.nbytes()
                ),
            ));
        }
        starts.insert(Rc::as_ptr(storage), zip.data_offset(record)?);
    }

    let mut tensors = Vec::with_capacity(state.tensors.len());
    let mut dims = Vec::new();
    // A tensor listed under several keys has one shape in `dims`, which its entries share.
    let mut shapes: FxHashMap<*const Tensor, u32> = FxHashMap::default();
    for (name, t) in &mut state.tensors {
        let dtype = t.dtype.safetensors().ok_or_else(|| {
            TorchError::new(
                TorchErrorCode::InvalidTorchTensor,
                format!(
                    "tensor {name:?}: dtype {} has no safetensors equivalent",
                    t.dtype.name()
                ),
            )
        })?;
        let (begin, end) = byte_range(t, starts[&Rc::as_ptr(&t.storage)]);
        let shape_start = if Rc::strong_count(t) > 1 {
            *shapes.entry(Rc::as_ptr(t)).or_insert_with(|| push_shape(&mut dims, t))
        } else {
            push_shape(&mut dims, t)
        };
        tensors.push(TensorEntry {
            name: Cow::Owned(std::mem::take(name)),
            dtype,
            shape_start,
            shape_len: t.shape.len() as u32,
            begin: begin - N_LEN,
            end: end - N_LEN,
        });
    }
    let mut warnings = Vec::new();
    if !state.skipped.is_empty() {
        let shown: Vec<&str> = state.skipped.iter().take(5).map(String::as_str).collect();
        warnings.push(Warning {
            code: ProblemCode::NonTensorValue,
            message: format!(
                "{} state-dict value(s) are not tensors and were skipped: {shown:?}{}",
                state.skipped.len(),
                if state.skipped.len() > shown.len() { " ..." } else { "" }
            ),
        });
    }
    Ok(TorchHeader {
        header: Header {
            tensors,
            dims,
            metadata: None,
            header_size: 0,
            file_size,
            warnings,
            names_checked: true,
        },
        pickle_size: pkl.size,
        prefix: zip.prefix().to_owned(),
    })
}

/// The format versions torch 2.x reads (`kMinSupportedFileFormatVersion` to `kMax...`); `torch.save`
/// writes 3.
const FORMAT_VERSIONS: std::ops::RangeInclusive<u64> = 1..=10;

/// Refuses an archive without the `version` record torch requires, or of a version it cannot read.
fn check_version(zip: &Archive<'_>) -> Result<(), TorchError> {
    let record = zip.record("version").or_else(|| zip.record(".data/version"));
    let Some(record) = record else {
        return Err(TorchError::new(
            TorchErrorCode::InvalidZip,
            format!("no {}/version record: not a torch.save file", zip.prefix()),
        ));
    };
    let text = if record.size <= 16 {
        zip.read(record, 16)?
    } else {
        Vec::new()
    };
    let version = std::str::from_utf8(&text)
        .ok()
        .and_then(|t| t.trim().parse::<u64>().ok());
    if !version.is_some_and(|v| FORMAT_VERSIONS.contains(&v)) {
        return Err(TorchError::new(
            TorchErrorCode::InvalidZip,
            format!(
                "format version {:?}; torch reads {} to {}",
                String::from_utf8_lossy(&text),
                FORMAT_VERSIONS.start(),
                FORMAT_VERSIONS.end()
            ),
        ));
    }
    Ok(())
}

/// Appends `t`'s shape to `dims`; returns where it starts. The reader's budget keeps `dims` far
/// below 2^32 entries.
fn push_shape(dims: &mut Vec<u64>, t: &Tensor) -> u32 {
    let start = dims.len() as u32;
    dims.extend_from_slice(&t.shape);
    start
}

/// The file bytes `t` spans: its extent in its storage, whose data starts at `start`. A tensor with
/// elements was checked against its storage (and the storage against the file) already; an empty
/// one spans nothing, and its offset, which `set_` does not check, may be anything.
fn byte_range(t: &Tensor, start: u64) -> (u64, u64) {
    let extent = t.extent();
    if extent == 0 {
        return (start, start);
    }
    let size = t.dtype.itemsize();
    let begin = start + t.offset * size;
    (begin, begin + extent * size)
}

/// Opens and reads the torch file at `path`.
pub fn read_torch_header(path: &Path) -> Result<TorchHeader, Error> {
    let (file, size) = open_regular(path)?;
    read_torch_file(&file, size).map_err(|e| e.into_error(path))
}

/// Loads and classifies an adapter whose weights are a torch file (`config`: the config's bytes,
/// when already read). A bad config is reported before a bad weights file, as for safetensors.
pub fn load(target: Target, config: Option<Vec<u8>>, opts: ScanOptions) -> Result<AdapterResult, Error> {
    let (file, size) = open_regular(&target.weights)?;
    let config = match (&target.config, config) {
        (Some(path), Some(bytes)) => Some(parse_config(path, bytes)?),
        (Some(path), None) => {
            let (mut f, len) = open_regular(path)?;
            check_config_size(path, len)?;
            let mut bytes = Vec::with_capacity(len as usize);
            f.read_to_end(&mut bytes).map_err(|e| Error::io(path, e))?;
            Some(parse_config(path, bytes)?)
        }
        (None, _) => None,
    };
    let torch = read_torch_file(&file, size).map_err(|e| e.into_error(&target.weights))?;
    drop(file);
    let alphas = target.weights.clone();
    // content_hash is kohya's hash of a safetensors data section; a torch file has none.
    let mut result = build_result(target, config, &torch.header, &alphas, opts, None);
    result.header_size = torch.pickle_size;
    Ok(result)
}
