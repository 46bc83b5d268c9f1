//! candle on cuda-pinned's paths: checkpoints loaded by pinned-io as a `VarBuilder`, loader
//! batches as `Tensor`s, CPU tensors to the GPU and back through pinned memory. A candle
//! program adopts each by changing a line.
//!
//! | instead of | write | what it does |
//! |---|---|---|
//! | `unsafe { VarBuilder::from_mmaped_safetensors(&paths, dtype, &device)? }` | [`var_builder`]`(&paths, dtype, &device)?` | pinned-io loads the checkpoint (a crew of readers, a small pinned ring, the DMA at the link's speed) into memory candle allocates and owns; each `get` waits for its own tensor only, so the model is built while the rest loads |
//! | a hand-written batching loop | [`TensorLoader::new`]`(loader, &device)?` | pinned-loader's workers write samples into pinned batches; each batch is uploaded straight into candle's tensors beside candle's work |
//! | `tensor.to_device(&gpu)?` | `tensor.`[`to_device_staged`](ToDeviceStaged::to_device_staged)`(&gpu)?` | a CPU tensor through cuda-pinned's `Stager` instead of the driver's pageable path, and back |
//!
//! [`CheckpointLoader`] takes a reader and load options of your own (an order that brings
//! the embeddings first, tensor-parallel parts) and builds a builder for candle's sharded
//! loading too.
//!
//! # Ownership and order
//!
//! Every tensor this crate hands over is candle's: its memory was allocated by candle on its
//! device's stream, and candle frees it when the last tensor using it drops. Nothing is
//! borrowed, and no `unsafe` is asked of the caller. A checkpoint's load allocates its
//! tensors' memory when it starts, and a `VarBuilder` holds every loaded tensor until it is
//! dropped (weights asked for in another element type are converted copies beside them):
//! load only what the model takes (`LoadOptions::only`) where device memory is short. The
//! first load and the first staged copy on a device make a reader and a stager (threads and
//! a small pinned ring each), kept for the process's later ones.
//!
//! candle's stream waits for each tensor on the device, not the host, on devices with a stream
//! of their own (`Device::new_cuda_with_stream`), and cudarc's event tracking records the
//! writes, so that cudarc's copies on other streams wait too. On `Device::new_cuda`'s device,
//! candle runs on cudarc's per-thread stream, which is a different stream on every thread:
//! there the host waits for a tensor before handing it over (a checkpoint's tensors), or the
//! calling thread's stream waits and cudarc's tracking covers the others (a batch's).
//!
//! # Building
//!
//! candle's `cuda` feature links the CUDA libraries at build time and compiles candle's
//! kernels with nvcc; see the crate's README for a build without a CUDA toolkit.

#![deny(unsafe_op_in_unsafe_fn)]

mod batches;
mod checkpoint;
mod device;
mod error;
mod memory;
mod staged;

pub use batches::{TensorBatch, TensorElement, TensorEpoch, TensorFields, TensorLoader, Upload};
pub use checkpoint::{CheckpointLoader, PinnedSafetensors, ShardedPinnedSafetensors, var_builder};
pub use error::Result;
pub use staged::{STAGED_DOWNLOADS_FROM, ToDeviceStaged};
