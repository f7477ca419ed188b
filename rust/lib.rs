//! lorafast core: safetensors header reading and validation, tensor-name parsing, adapter
//! classification and the parallel bulk scan. Pure Rust; the Python binding lives in `py/`,
//! behind the `python` feature, so `cargo test --no-default-features` needs no libpython.

#![warn(missing_docs)]

pub mod classify;
pub mod codes;
pub mod config;
pub mod error;
pub mod header;
pub mod json;
pub mod names;
pub mod open;
pub mod remote;
pub mod report;
pub mod scan;
pub mod torch;

#[cfg(feature = "python")]
mod py;

pub use codes::{AdapterErrorCode, ErrorCode, Flag, HeaderErrorCode, ProblemCode, TorchErrorCode};
pub use error::{Error, HeaderError};
pub use header::{parse_header, read_header, Dtype, Header, ReadMode, TensorEntry};
