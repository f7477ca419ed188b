//! Errors of the core. Every failure has a stable code from one of the lists in `codes.rs`
//! (a header rule, an adapter error or a torch refusal), which Python sees as `.code` and a scan
//! reports per failed file.

use std::io;
use std::path::PathBuf;

pub use crate::codes::{AdapterErrorCode, ErrorCode, HeaderErrorCode, TorchErrorCode};

/// A failure to read or validate one file.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// An OS error.
    #[error("{path}: {source}")]
    Io {
        /// The file or folder.
        path: PathBuf,
        /// The OS error.
        #[source]
        source: io::Error,
        /// A more precise code than the error's kind gives (`dangling_link`), when known.
        code: Option<AdapterErrorCode>,
    },
    /// A header rule broken.
    #[error("{path}: {kind}")]
    Header {
        /// The file.
        path: PathBuf,
        /// The rule, with what breaks it.
        kind: HeaderError,
    },
    /// Any other failure with a code: an adapter error, a torch refusal, or a code read back from
    /// an index or from Python.
    #[error("{path}: {message}")]
    Adapter {
        /// The adapter (a file, a folder or a URL).
        path: PathBuf,
        /// Why it failed.
        code: ErrorCode,
        /// What failed, for people.
        message: String,
    },
}

impl Error {
    /// This error's code.
    pub fn error_code(&self) -> ErrorCode {
        match self {
            Error::Io { code: Some(code), .. } => (*code).into(),
            Error::Io { source, .. } if source.raw_os_error() == Some(libc::ELOOP) => {
                AdapterErrorCode::SymlinkLoop.into()
            }
            Error::Io { source, .. } => match source.kind() {
                io::ErrorKind::NotFound => AdapterErrorCode::NotFound.into(),
                io::ErrorKind::PermissionDenied => AdapterErrorCode::PermissionDenied.into(),
                _ => AdapterErrorCode::IoError.into(),
            },
            Error::Header { kind, .. } => kind.error_code().into(),
            Error::Adapter { code, .. } => *code,
        }
    }

    /// This error's code, as Python and the index spell it.
    pub fn code(&self) -> &'static str {
        self.error_code().code()
    }

    /// Whether this error's code is `code`.
    pub fn is(&self, code: impl Into<ErrorCode>) -> bool {
        self.error_code() == code.into()
    }

    /// The file, folder or URL that failed.
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

    /// An OS error, coded by its kind.
    pub fn io(path: impl Into<PathBuf>, source: io::Error) -> Self {
        Error::Io {
            path: path.into(),
            source,
            code: None,
        }
    }

    /// An OS error with a code more precise than its kind (a `NotFound` that is a dangling link).
    pub fn io_coded(path: impl Into<PathBuf>, code: AdapterErrorCode, source: io::Error) -> Self {
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
        Error::adapter(
            path,
            AdapterErrorCode::Internal,
            format!("internal error (a bug in lorafast): {what}"),
        )
    }

    /// A failure with `code` and a message for people.
    pub fn adapter(path: impl Into<PathBuf>, code: impl Into<ErrorCode>, message: impl Into<String>) -> Self {
        Error::Adapter {
            path: path.into(),
            code: code.into(),
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

/// One violated safetensors header rule. The first group mirrors the safetensors crate's checks;
/// the second is stricter than the crate.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum HeaderError {
    /// The file is too short to hold the header length (its size).
    #[error("file is {0} bytes, shorter than the 8-byte header length")]
    HeaderTooSmall(u64),
    /// The header length is over the limit (the length).
    #[error("header length {0} exceeds the 100000000-byte limit")]
    HeaderTooLarge(u64),
    /// The header runs past the end of the file.
    #[error("header length {n} runs past the end of the {file_size}-byte file")]
    InvalidHeaderLength {
        /// The header length the file gives.
        n: u64,
        /// The file's size.
        file_size: u64,
    },
    /// The header is not UTF-8 (the offset of the first bad byte).
    #[error("header is not valid UTF-8 (byte {0})")]
    InvalidUtf8(usize),
    /// The header is not JSON.
    #[error("header is not valid JSON: {message} at byte {offset}")]
    InvalidJson {
        /// What the parser expected.
        message: &'static str,
        /// Where in the header.
        offset: usize,
    },
    /// The header JSON is not an object.
    #[error("header JSON is not an object")]
    HeaderNotObject,
    /// `__metadata__` is not a map of strings to strings (what is wrong).
    #[error("__metadata__ must map strings to strings: {0}")]
    InvalidMetadata(String),
    /// A tensor entry lacks a field or has one of the wrong type.
    #[error("tensor {name:?}: {message}")]
    InvalidTensorEntry {
        /// The tensor.
        name: String,
        /// What is wrong.
        message: String,
    },
    /// A dtype safetensors does not define.
    #[error("tensor {name:?}: unknown dtype {dtype:?}")]
    UnknownDtype {
        /// The tensor.
        name: String,
        /// The dtype as written.
        dtype: String,
    },
    /// A tensor's data does not start where the previous one's ends.
    #[error("tensor {name:?}: data_offsets {begin}..{end} are not contiguous with the previous tensor (expected begin {expected})")]
    InvalidOffset {
        /// The tensor.
        name: String,
        /// Its first data offset.
        begin: u64,
        /// Its end data offset.
        end: u64,
        /// Where the previous tensor's data ends.
        expected: u64,
    },
    /// A tensor's shape or byte size overflows 64 bits (the tensor).
    #[error("tensor {0:?}: shape or byte size overflows 64 bits")]
    Overflow(String),
    /// A tensor's size in bits is not a whole number of bytes (the tensor).
    #[error("tensor {0:?}: size in bits is not a whole number of bytes")]
    MisalignedSlice(String),
    /// A tensor's data offsets span another size than its dtype and shape need.
    #[error("tensor {name:?}: data_offsets span {span} bytes but dtype and shape need {expected}")]
    TensorSizeMismatch {
        /// The tensor.
        name: String,
        /// The bytes its offsets span.
        span: u64,
        /// The bytes its dtype and shape need.
        expected: u64,
    },
    /// The data section ends before the last tensor's data.
    #[error("tensor data ends at {data_end} but the file holds {available} data bytes")]
    IncompleteBuffer {
        /// Where the tensors' data ends.
        data_end: u64,
        /// The data bytes the file holds.
        available: u64,
    },
    // Stricter than the crate:
    /// A tensor name appears twice (the name).
    #[error("tensor {0:?} appears more than once in the header")]
    DuplicateTensor(String),
    /// A key appears twice in one JSON object (the key).
    #[error("key {0:?} appears more than once in one JSON object")]
    DuplicateKey(String),
}

impl HeaderError {
    /// The rule this error breaks.
    pub fn error_code(&self) -> HeaderErrorCode {
        match self {
            HeaderError::HeaderTooSmall(_) => HeaderErrorCode::HeaderTooSmall,
            HeaderError::HeaderTooLarge(_) => HeaderErrorCode::HeaderTooLarge,
            HeaderError::InvalidHeaderLength { .. } => HeaderErrorCode::InvalidHeaderLength,
            HeaderError::InvalidUtf8(_) => HeaderErrorCode::InvalidUtf8,
            HeaderError::InvalidJson { .. } => HeaderErrorCode::InvalidJson,
            HeaderError::HeaderNotObject => HeaderErrorCode::HeaderNotObject,
            HeaderError::InvalidMetadata(_) => HeaderErrorCode::InvalidMetadata,
            HeaderError::InvalidTensorEntry { .. } => HeaderErrorCode::InvalidTensorEntry,
            HeaderError::UnknownDtype { .. } => HeaderErrorCode::UnknownDtype,
            HeaderError::InvalidOffset { .. } => HeaderErrorCode::InvalidOffset,
            HeaderError::Overflow(_) => HeaderErrorCode::Overflow,
            HeaderError::MisalignedSlice(_) => HeaderErrorCode::MisalignedSlice,
            HeaderError::TensorSizeMismatch { .. } => HeaderErrorCode::TensorSizeMismatch,
            HeaderError::IncompleteBuffer { .. } => HeaderErrorCode::IncompleteBuffer,
            HeaderError::DuplicateTensor(_) => HeaderErrorCode::DuplicateTensor,
            HeaderError::DuplicateKey(_) => HeaderErrorCode::DuplicateKey,
        }
    }

    /// The stable string of the rule this error breaks.
    pub fn code(&self) -> &'static str {
        self.error_code().code()
    }
}
