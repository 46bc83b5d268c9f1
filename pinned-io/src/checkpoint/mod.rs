//! Safetensors checkpoints: opening them (as untrusted input: one file's header, a sharded
//! checkpoint's index, where a tensor-parallel rank's part of a tensor lies in its file), and
//! loading their tensors onto devices: the start (`load`), the load under way and its result
//! (`loading`), and its figures (`report`).
//!
//! Everything here reads only headers and indexes, never tensor data, and checks them before any
//! number from them sizes an allocation or a read: a header that passes lays its tensors out
//! disjoint, without holes, and inside the file.

pub(crate) mod header;
pub(crate) mod index;
pub(crate) mod load;
pub(crate) mod loading;
pub(crate) mod open;
pub(crate) mod report;
pub(crate) mod split;

pub use header::TensorSpec;
pub use load::{Block, LoadOptions};
pub use loading::{Landed, Loaded, LoadedTensor, Loading};
pub use open::Checkpoint;
pub use report::{LoadLimit, LoadReport};
pub use split::Split;
