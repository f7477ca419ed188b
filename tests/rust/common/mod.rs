//! Helpers shared by the integration tests: header generators (differential with the
//! safetensors crate), adapter file builders, a counting allocator and the fuzz driver.
//! Each test binary uses a part of them.
#![allow(dead_code)]

pub mod adapters;
pub mod alloc;
pub mod fuzz;
pub mod headers;
