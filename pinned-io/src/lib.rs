//! Files into page-locked memory and onto the GPU: checkpoints and byte ranges, read by a
//! crew of threads while the DMA engine drains what they read.
//!
//! A [`FileReader`] owns a small ring of pinned chunks and a crew of threads: a thread takes
//! a piece of a file and a free chunk for it, the piece is read into the chunk, and its copy
//! to the device is queued; a chunk is reused once its copy is done. Reads and copies
//! overlap, and the pinned memory held is the ring's, whatever the size of the file. Each
//! piece is read through the page cache where the kernel holds it, in parts by several
//! threads at once, and past the cache (`O_DIRECT`) where it does not ([`ReadMode`]), in one
//! large read, so that a cold file keeps the storage busy. A checkpoint's first tensor is
//! read while its device memory is allocated, and goes to the device before the tensors
//! after it.
//!
//! | type | what |
//! |---|---|
//! | [`FileReader`], [`ReaderConfig`] | the crew and its ring, for one device |
//! | [`DataFile`] | a file opened for it (its length, what was read how) |
//! | [`Checkpoint`] | a safetensors checkpoint, one file or sharded, its headers checked |
//! | [`LoadOptions`], [`Split`] | which tensors, which tensor-parallel part, which other devices |
//! | [`Loading`], [`LoadedTensor`], [`Loaded`], [`Landed`] | tensors on the device, each ready on its own event, in the order they land |
//! | [`Block`], [`Checkpoint::load_into`] | the device memory of a load's tensors of one element type, which the caller may lend |
//! | [`LoadReport`], [`LoadLimit`] | a load's figures, and what limited it |
//!
//! # Example
//!
//! ```no_run
//! use cuda_pinned::{Device, Stream};
//! use pinned_io::{Checkpoint, FileReader, LoadOptions, Split};
//!
//! let reader = FileReader::new()?;
//! let checkpoint = Checkpoint::open("model.safetensors.index.json")?;
//! // Rank 1 of 4 of every 2-D weight, split along its rows as a column-parallel layer is.
//! let options = LoadOptions::new()
//!     .only(|tensor| tensor.name().ends_with(".weight"))
//!     .split(|tensor| (tensor.shape().len() == 2).then(|| Split::new(0, 1, 4).ok()).flatten());
//! let loading = checkpoint.load(&reader, &options)?; // returns at once
//! let stream = Stream::new()?;
//! for tensor in loading.tensors() {
//!     // The stream waits (on the device) for this tensor alone; the rest still loads.
//!     let bytes = tensor.ready_on(&stream)?;
//!     println!("{} {:?} {:?}: {} bytes", tensor.name(), tensor.dtype(), tensor.shape(), bytes.len());
//! }
//! let loaded = loading.wait()?; // everything landed, or the first error
//! # let _ = (loaded, Device::current());
//! # Ok::<(), pinned_io::Error>(())
//! ```
//!
//! Which tensor lands first, and in which order the others follow, is
//! [`Loading`]'s to say ([`LoadOptions::order_by`] chooses; [`Loading::landed`] yields them as
//! they land); a load's figures and what limited it are [`Loaded::report`]'s. Opening, the
//! load, each read and each batch of copies are `tracing` spans (listed with every crate's in
//! [`cuda_pinned::traces`]); the `nvtx` feature shows them on Nsight Systems' timeline.
//!
//! Checkpoints are untrusted input: a header or index that breaks the format is an
//! [`Error`] naming the file and the tensor, before any number from it sizes a read or an
//! allocation.

#![deny(unsafe_op_in_unsafe_fn)]

mod checkpoint;
mod engine;
mod error;
mod file;
mod plan;
mod reader;

pub use checkpoint::{
    Block, Checkpoint, Landed, LoadLimit, LoadOptions, LoadReport, Loaded, LoadedTensor, Loading,
    Split, TensorSpec,
};
pub use error::{Error, Result};
pub use file::{DataFile, ReadMode};
pub use reader::{FileReader, ReaderConfig};
/// The element types of checkpoints (the `safetensors` crate's).
pub use safetensors::Dtype;
