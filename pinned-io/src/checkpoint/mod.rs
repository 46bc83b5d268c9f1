//! Safetensors checkpoints as untrusted input: one file's header, a sharded checkpoint's index,
//! and where a tensor-parallel rank's part of a tensor lies in its file.
//!
//! Everything here reads only headers and indexes, never tensor data, and checks them before any
//! number from them sizes an allocation or a read: a header that passes lays its tensors out
//! disjoint, without holes, and inside the file.

// The read engine and the checkpoint loader are the users of the crate-private items here.
#[allow(dead_code, reason = "used by the checkpoint loader")]
pub(crate) mod header;
#[allow(dead_code, reason = "used by the checkpoint loader")]
pub(crate) mod index;
#[allow(dead_code, reason = "used by the checkpoint loader")]
pub(crate) mod split;

pub use header::TensorSpec;
pub use split::Split;
