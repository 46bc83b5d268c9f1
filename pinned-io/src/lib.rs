//! Files into page-locked memory and onto the GPU.

#![deny(unsafe_op_in_unsafe_fn)]

mod checkpoint;
mod engine;
mod error;
mod file;
mod plan;
mod reader;

pub use checkpoint::{Checkpoint, LoadOptions, Loaded, LoadedTensor, Loading, Split, TensorSpec};
pub use error::{Error, Result};
pub use file::{DataFile, ReadMode};
pub use reader::{FileReader, ReaderConfig};
/// The element types of checkpoints (the `safetensors` crate's).
pub use safetensors::Dtype;
