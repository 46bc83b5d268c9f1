//! Safetensors checkpoints: loading their tensors onto devices, and, as untrusted input, one file's header, a sharded checkpoint's index,
//! and where a tensor-parallel rank's part of a tensor lies in its file.
//!
//! Everything here reads only headers and indexes, never tensor data, and checks them before any
//! number from them sizes an allocation or a read: a header that passes lays its tensors out
//! disjoint, without holes, and inside the file.

pub(crate) mod header;
pub(crate) mod index;
pub(crate) mod load;
pub(crate) mod split;

pub use header::TensorSpec;
pub use load::{Checkpoint, LoadOptions, Loaded, LoadedTensor, Loading};
pub use split::Split;
