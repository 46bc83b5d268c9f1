//! Files into page-locked memory and onto the GPU.

#![deny(unsafe_op_in_unsafe_fn)]

mod error;

pub use error::{Error, Result};
