//! Feeding a GPU from host memory: PyTorch's `DataLoader(pin_memory=True)` with
//! `non_blocking=True` uploads, done for Rust.
//!
//! Workers write samples straight into pinned batches (no copy through pageable memory);
//! a copy stream of the loader's own uploads each batch while the consumer's GPU works on
//! the previous one; the consumer's stream waits for each batch on the device, never the
//! host. The pinned working set is reserved before the first batch, as one block from the
//! pool (one registration), so nothing is pinned on the hot path. Pinned memory is memory the
//! machine can never swap: a working set that would leave it short is refused
//! ([`cuda_pinned::Error::MemoryPressure`], naming what is pinned), and between epochs the
//! pool gives its idle cache back while the machine stalls for memory. Each epoch leaves its
//! figures and a verdict on what limited it ([`Loader::epoch_stats`], [`EpochStats::verdict`]);
//! fills, uploads and waits are `tracing` spans, for a timeline ([`cuda_pinned::traces`] lists
//! them with every crate's).
//!
//! # With cudarc
//!
//! A training loop over cudarc (the `cudarc` feature): each batch is made ready on cudarc's
//! stream, and its fields go to cudarc's kernels as arguments and to its copies. The waiting
//! rule is kept on both sides: [`DeviceBatch::ready_on`] makes the stream wait, on the device,
//! for the batch's upload, and a dropped batch's memory is reused only after every stream it
//! was made ready on has passed the work queued there, kernels included. Launch on such a
//! stream.
//!
//! ```no_run
//! # #[cfg(feature = "cudarc")]
//! # fn demo<D>(data: D, train_step: &cudarc::driver::CudaFunction) -> Result<(), Box<dyn std::error::Error>>
//! # where D: pinned_loader::Dataset<Fields = (pinned_loader::Field<u8>, pinned_loader::Field<i64>)> {
//! use cuda_pinned::Stream;
//! use cudarc::driver::{CudaContext, LaunchConfig, PushKernelArg};
//! use pinned_loader::{Assembly, DeviceLoader, Loader, LoaderConfig};
//!
//! let cudarc_stream = CudaContext::new(0)?.new_stream()?;
//! let stream = Stream::from_cudarc(&cudarc_stream)?;
//! let loader = Loader::new(data, LoaderConfig::new(256).workers(8).shuffle(0))?;
//! let mut device = DeviceLoader::new(loader, Assembly::HostCollate)?;
//! let mut loss = cudarc_stream.alloc_zeros::<f32>(1)?;
//! for epoch in 0..10 {
//!     for batch in device.epoch(epoch) {
//!         let mut batch = batch?;
//!         let samples = batch.len() as u32;
//!         let (images, labels) = batch.ready_on(&stream)?;
//!         let mut step = cudarc_stream.launch_builder(train_step);
//!         step.arg(&images).arg(&labels).arg(&mut loss).arg(&samples);
//!         // SAFETY: the kernel's parameters are these, and it stays in bounds.
//!         unsafe { step.launch(LaunchConfig::for_num_elems(samples)) }?;
//!     } // each batch goes back to the loader here, reused once the kernel is done
//! }
//! # Ok(()) }
//! ```
//!
//! Without a kernel, `CudarcCopies::copy_device_to_cudarc` copies a field into cudarc's memory,
//! and a [`HostBatch`]'s fields ([`HostBatch::into_buffers`]) go to tracked uploads as they are,
//! pinned already.
//!
//! # On the host
//!
//! ```
//! use pinned_loader::{BoxError, Dataset, Field, Loader, LoaderConfig};
//!
//! /// 64 "images" of 3×8×8 bytes with a label each, in memory.
//! struct Images { pixels: Vec<u8>, labels: Vec<i64> }
//! const IMAGE: usize = 3 * 8 * 8;
//!
//! impl Dataset for Images {
//!     type Fields = (Field<u8>, Field<i64>);
//!     fn len(&self) -> usize { self.labels.len() }
//!     fn fields(&self) -> Self::Fields { (Field::new(IMAGE), Field::new(1)) }
//!     // Writes sample `i` straight into its place in a pinned batch (past the CPU's caches:
//!     // the DMA engine reads it next).
//!     fn write(&self, i: usize, (image, label): (&mut [u8], &mut [i64])) -> Result<(), BoxError> {
//!         pinned_loader::copy_streaming(image, &self.pixels[i * IMAGE..(i + 1) * IMAGE]);
//!         label[0] = self.labels[i];
//!         Ok(())
//!     }
//! }
//!
//! let data = Images { pixels: vec![1; 64 * IMAGE], labels: (0..64).collect() };
//! let config = LoaderConfig::new(16).workers(4).prefetch(2).shuffle(42).drop_last(true);
//! let mut loader = Loader::new(data, config)?;
//! for epoch in 0..3 {
//!     for batch in loader.epoch(epoch) {
//!         let batch = batch?;                     // an error names the batch and the sample
//!         let (images, labels) = batch.fields();  // pinned memory: upload it at link speed
//!         assert_eq!(images.len(), 16 * IMAGE);
//!         assert_eq!(labels.len(), 16);
//!     }
//! }
//! println!("{:?}", loader.stats());
//! # Ok::<(), pinned_loader::LoaderError>(())
//! ```
//!
//! On a GPU, [`DeviceLoader`] turns the same loader into batches on the device:
//! `for batch in device.epoch(e) { let (images, labels) = batch?.ready_on(&stream)?; … }`.
//!
//! Datasets in files are read sample by sample into their places in the pinned batch:
//! [`NpyDataset`] over `.npy` arrays (one per field; each field's element type is checked
//! against its file's when it opens) and [`RecordDataset`] over fixed-size records in one or
//! more files. Every batch names the dataset samples it holds, [`HostBatch::indices`]:
//!
//! ```no_run
//! use pinned_loader::{Field, Loader, LoaderConfig, NpyDataset};
//!
//! // images.npy: (N, 3, 32, 32) uint8; labels.npy: (N,) int64
//! let data = NpyDataset::<(Field<u8>, Field<i64>)>::open(&["images.npy", "labels.npy"])?;
//! let mut loader = Loader::new(data, LoaderConfig::new(256).workers(8).shuffle(1))?;
//! for batch in loader.epoch(0) {
//!     let batch = batch?;
//!     let (images, labels) = batch.fields();
//!     println!("trained on {:?}", batch.indices());
//! }
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```
//!
//! A worker reading from the page cache moves bytes more slowly than one copying from
//! memory (the kernel copies them), so a dataset in files wants more workers than the same
//! samples in memory to keep the device fed: up to one per core that training leaves free.
//!
//! | PyTorch | pinned-loader |
//! |---|---|
//! | `Dataset.__getitem__` + `collate_fn` | [`SampleDataset::get`] (the loader collates), or [`Dataset::write`] (the dataset writes into the batch itself) |
//! | `DataLoader(batch_size, num_workers, prefetch_factor, shuffle, drop_last, persistent_workers, in_order)` | [`LoaderConfig`] |
//! | `DistributedSampler(rank, num_replicas)` | [`LoaderConfig::shard`], the ranks from the launcher's environment by [`Ranks::from_env`] |
//! | `pin_memory=True` | always |
//! | `pin_memory_device` / one process per GPU | [`LoaderConfig::device`]: one loader per GPU, sharing a pool |
//! | `.to(device, non_blocking=True)` | [`DeviceLoader`], [`DeviceBatch::ready_on`] |
//!
//! # Design
//!
//! How the crate works inside, and why: the [`design`] module.

#![deny(unsafe_op_in_unsafe_fn)]

pub mod design {
    #![doc = include_str!("../docs/design.md")]
}
mod arena;
mod batch;
mod config;
mod dataset;
mod device;
mod error;
mod field_buffer;
mod fields;
mod files;
mod loader;
mod ranks;
mod sampler;
mod slot;
mod stats;

// Loaders, their epochs and batches.
pub use batch::HostBatch;
pub use config::LoaderConfig;
pub use device::{Assembly, DeviceBatch, DeviceEpoch, DeviceLoader};
pub use field_buffer::FieldBuffer;
pub use loader::{Epoch, Loader};
pub use ranks::{Launcher, Ranks, RanksError};

// Datasets and the fields of their samples.
pub use cuda_pinned::copy_streaming;
pub use dataset::{Dataset, PinnedSamples, PinnedStorage, SampleDataset};
pub use fields::{Collate, Field, Fields};

// Datasets read from files.
pub use files::{FileError, NpyArray, NpyDataset, NpyElement, NpyFields, RecordDataset};

// Errors and statistics.
pub use error::{BoxError, LoaderError};
pub use stats::{EpochStats, Limit, LoaderStats, Verdict};
