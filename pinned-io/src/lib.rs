//! Files into page-locked memory and onto the GPU.

#![deny(unsafe_op_in_unsafe_fn)]

mod checkpoint;
mod error;

pub use checkpoint::{Split, TensorSpec};
pub use error::{Error, Result};
