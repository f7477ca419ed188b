//! Errors of the core. Every header rule has its own variant and a stable string code, which
//! Python sees as `HeaderError.code` and a scan reports per failed file.

use std::io;
use std::path::PathBuf;

/// A failure to read or validate one file.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("{path}: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: io::Error,
        /// A more precise code than the error's kind gives (`dangling_link`), when known.
        code: Option<&'static str>,
    },
    #[error("{path}: {kind}")]
    Header { path: PathBuf, kind: HeaderError },
    #[error("{path}: {message}")]
    Adapter {
        path: PathBuf,
        code: &'static str,
        message: String,
    },
}

impl Error {
    pub fn code(&self) -> &'static str {
        match self {
            Error::Io { code: Some(code), .. } => code,
            Error::Io { source, .. } if source.raw_os_error() == Some(libc::ELOOP) => "symlink_loop",
            Error::Io { source, .. } => match source.kind() {
                io::ErrorKind::NotFound => "not_found",
                io::ErrorKind::PermissionDenied => "permission_denied",
                _ => "io_error",
            },
            Error::Header { kind, .. } => kind.code(),
            Error::Adapter { code, .. } => code,
        }
    }

    pub fn path(&self) -> &PathBuf {
        match self {
            Error::Io { path, .. } | Error::Header { path, .. } | Error::Adapter { path, .. } => path,
        }
    }

    /// The message without the path prefix.
    pub fn detail(&self) -> String {
        match self {
            Error::Io { source, .. } => source.to_string(),
            Error::Header { kind, .. } => kind.to_string(),
            Error::Adapter { message, .. } => message.clone(),
        }
    }

    pub fn io(path: impl Into<PathBuf>, source: io::Error) -> Self {
        Error::Io {
            path: path.into(),
            source,
            code: None,
        }
    }

    /// An OS error with a code more precise than its kind (a `NotFound` that is a dangling link).
    pub fn io_coded(path: impl Into<PathBuf>, code: &'static str, source: io::Error) -> Self {
        Error::Io {
            path: path.into(),
            source,
            code: Some(code),
        }
    }

    /// An OS error with `what` failed put before the OS's words; keeps the error's kind and errno.
    pub fn io_context(path: impl Into<PathBuf>, what: &str, source: io::Error) -> Self {
        Error::io(path, with_context(what, source))
    }

    /// The OS error number, also through `io_context`'s wrapping (0 when there is none).
    pub fn errno(source: &io::Error) -> i32 {
        source
            .raw_os_error()
            .or_else(|| source.get_ref()?.downcast_ref::<Context>()?.errno)
            .unwrap_or(0)
    }

    /// A panic caught while handling `path`, as that path's error (code `internal`).
    pub fn panicked(path: impl Into<PathBuf>, payload: &(dyn std::any::Any + Send)) -> Self {
        let what = payload
            .downcast_ref::<&str>()
            .map(|s| (*s).to_owned())
            .or_else(|| payload.downcast_ref::<String>().cloned())
            .unwrap_or_else(|| "unknown panic payload".to_owned());
        Error::adapter(path, "internal", format!("internal error (a bug in lorafast): {what}"))
    }

    pub fn adapter(path: impl Into<PathBuf>, code: &'static str, message: impl Into<String>) -> Self {
        Error::Adapter {
            path: path.into(),
            code,
            message: message.into(),
        }
    }
}

/// `source` with `what` put before its words, keeping its kind and errno (see `Error::errno`).
pub fn with_context(what: &str, source: io::Error) -> io::Error {
    let errno = source.raw_os_error();
    io::Error::new(
        source.kind(),
        Context {
            what: what.to_owned(),
            errno,
            source,
        },
    )
}

/// An OS error with what was being done when it happened.
#[derive(Debug, thiserror::Error)]
#[error("{what}: {source}")]
struct Context {
    what: String,
    errno: Option<i32>,
    source: io::Error,
}

/// The `&'static str` of a known error code (a header rule, an adapter or a torch code), for codes read
/// back from Python or from an index; None for any other text.
pub fn known_code(code: &str) -> Option<&'static str> {
    HEADER_ERROR_CODES
        .iter()
        .chain(ADAPTER_ERROR_CODES)
        .chain(crate::torch::TORCH_ERROR_CODES)
        .find(|k| **k == code)
        .copied()
}

/// The codes of failed adapters besides the header rules, in documentation order (exported to
/// Python as `ADAPTER_ERROR_CODES`). Remote-only codes come last.
pub const ADAPTER_ERROR_CODES: &[&str] = &[
    "not_found",
    "permission_denied",
    "io_error",
    "not_regular_file",
    "dangling_link",
    "symlink_loop",
    "no_adapter",
    "ambiguous_adapter",
    "missing_weights",
    "invalid_config",
    "internal",
    "timeout",
    "connection_error",
    "remote_error",
    "short_read",
    "file_changed",
    "invalid_url",
    "store_config",
    "remote_unsupported",
];

/// One violated safetensors header rule. The first group mirrors the safetensors crate's checks;
/// the second is stricter than the crate.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum HeaderError {
    #[error("file is {0} bytes, shorter than the 8-byte header length")]
    HeaderTooSmall(u64),
    #[error("header length {0} exceeds the 100000000-byte limit")]
    HeaderTooLarge(u64),
    #[error("header length {n} runs past the end of the {file_size}-byte file")]
    InvalidHeaderLength { n: u64, file_size: u64 },
    #[error("header is not valid UTF-8 (byte {0})")]
    InvalidUtf8(usize),
    #[error("header is not valid JSON: {message} at byte {offset}")]
    InvalidJson { message: &'static str, offset: usize },
    #[error("header JSON is not an object")]
    HeaderNotObject,
    #[error("__metadata__ must map strings to strings: {0}")]
    InvalidMetadata(String),
    #[error("tensor {name:?}: {message}")]
    InvalidTensorEntry { name: String, message: String },
    #[error("tensor {name:?}: unknown dtype {dtype:?}")]
    UnknownDtype { name: String, dtype: String },
    #[error("tensor {name:?}: data_offsets {begin}..{end} are not contiguous with the previous tensor (expected begin {expected})")]
    InvalidOffset {
        name: String,
        begin: u64,
        end: u64,
        expected: u64,
    },
    #[error("tensor {0:?}: shape or byte size overflows 64 bits")]
    Overflow(String),
    #[error("tensor {0:?}: size in bits is not a whole number of bytes")]
    MisalignedSlice(String),
    #[error("tensor {name:?}: data_offsets span {span} bytes but dtype and shape need {expected}")]
    TensorSizeMismatch { name: String, span: u64, expected: u64 },
    #[error("tensor data ends at {data_end} but the file holds {available} data bytes")]
    IncompleteBuffer { data_end: u64, available: u64 },
    // Stricter than the crate:
    #[error("tensor {0:?} appears more than once in the header")]
    DuplicateTensor(String),
    #[error("key {0:?} appears more than once in one JSON object")]
    DuplicateKey(String),
}

impl HeaderError {
    pub fn code(&self) -> &'static str {
        match self {
            HeaderError::HeaderTooSmall(_) => "header_too_small",
            HeaderError::HeaderTooLarge(_) => "header_too_large",
            HeaderError::InvalidHeaderLength { .. } => "invalid_header_length",
            HeaderError::InvalidUtf8(_) => "invalid_utf8",
            HeaderError::InvalidJson { .. } => "invalid_json",
            HeaderError::HeaderNotObject => "header_not_object",
            HeaderError::InvalidMetadata(_) => "invalid_metadata",
            HeaderError::InvalidTensorEntry { .. } => "invalid_tensor_entry",
            HeaderError::UnknownDtype { .. } => "unknown_dtype",
            HeaderError::InvalidOffset { .. } => "invalid_offset",
            HeaderError::Overflow(_) => "overflow",
            HeaderError::MisalignedSlice(_) => "misaligned_slice",
            HeaderError::TensorSizeMismatch { .. } => "tensor_size_mismatch",
            HeaderError::IncompleteBuffer { .. } => "incomplete_buffer",
            HeaderError::DuplicateTensor(_) => "duplicate_tensor",
            HeaderError::DuplicateKey(_) => "duplicate_key",
        }
    }
}

/// Every header error code, in documentation order (exported to Python as `HEADER_ERROR_CODES`).
pub const HEADER_ERROR_CODES: &[&str] = &[
    "header_too_small",
    "header_too_large",
    "invalid_header_length",
    "invalid_utf8",
    "invalid_json",
    "header_not_object",
    "invalid_metadata",
    "invalid_tensor_entry",
    "unknown_dtype",
    "invalid_offset",
    "overflow",
    "misaligned_slice",
    "tensor_size_mismatch",
    "incomplete_buffer",
    "duplicate_tensor",
    "duplicate_key",
];
