//! Safe page-locked ("pinned") host memory for CUDA: containers, a caching pool's contract,
//! and async copies that cannot race with the host.
//!
//! Page-locked memory lets the GPU's DMA engines copy directly and asynchronously; this
//! crate gives it as [`PinnedVec`] and [`PinnedBox`] over several [kinds of
//! memory](guide#kinds-of-memory), tracks every async copy so that no buffer is freed, reused
//! or touched by the host while the device still uses it, and copies ordinary memory near
//! page-locked speed through a [`Stager`]. It loads CUDA at run time: it builds and runs
//! without CUDA, where buffers are `mlock`ed memory. Pinning, copies, staged copies and waits
//! are `tracing` spans (free when nothing subscribes; [`traces`] lists every crate's). The [`guide`] explains the ideas; the
//! rooms of the code are:
//!
//! | module | what |
//! |---|---|
//! | `memory` | the kinds of page-locked memory, under the [`PinnedAllocator`] contract |
//! | `containers` | [`PinnedVec`], [`PinnedBox`] and [`PinMemory`] |
//! | `gpu` | [`Device`], [`Stream`], [`Event`], [`DeviceBuffer`] and its views |
//! | `copy` | tracked copies ([`Transfer`]), blocking copies of device views, batches of raw copies |
//! | `nontemporal` | non-temporal stores ([`copy_streaming`], [`read_at_streaming`]) |
//! | `files` | the operating system's side of reading files: [`open_regular_file`] (never blocking on a pipe or opening a device), [`PageCacheProbe`] (what the page cache holds) |
//! | [`ring`] | the engine beneath: a ring of pinned chunks, each with an event, and a crew of threads that fill and drain it |
//! | `staging` | the [`Stager`]: copies from ordinary memory through the ring |
//! | `raw`, `context` | one CUDA call per function, and the context and capture-mode policy around them |
//! | `interop` | cudarc (the `cudarc` feature) and allocator-api2 |
//! | [`nvtx`](mod@crate::nvtx) | spans as NVTX ranges for Nsight Systems (the `nvtx` feature) |
//!
//! # With cudarc
//!
//! Most Rust GPU code runs its kernels through cudarc; with the `cudarc` feature this crate's
//! copies run on cudarc's streams and its device memory goes to cudarc's kernels and copies.
//! The waiting rule: a stream may use memory written by another stream's work only after it
//! waited for that work on the device, and memory is reused or freed only after every stream
//! that used it has passed that use. Copies through this crate keep the rule themselves; for
//! a kernel, adopt its stream ([`Stream::from_cudarc`]) and make it wait for the memory
//! ([`DeviceBuffer::record_stream`], or a loader batch's `ready_on`) before the launch:
//!
//! ```no_run
//! # #[cfg(feature = "cudarc")]
//! # fn demo(kernel: &cudarc::driver::CudaFunction) -> Result<(), Box<dyn std::error::Error>> {
//! use cuda_pinned::{CudarcCopies, DeviceBuffer, PinnedVec, Stream};
//! use cudarc::driver::{CudaContext, LaunchConfig, PushKernelArg};
//!
//! let cudarc_stream = CudaContext::new(0)?.new_stream()?;
//! let stream = Stream::from_cudarc(&cudarc_stream)?;
//!
//! // An upload into cudarc's memory: returns at once, the buffer travels with the copy.
//! let mut weights = cudarc_stream.alloc_zeros::<f32>(1024)?;
//! let upload = cudarc_stream.copy_to_device(PinnedVec::from_slice(&[0.5f32; 1024])?, &mut weights)?;
//!
//! // This crate's device memory as a kernel argument: the kernel's stream waits for its
//! // copies, and the buffer is freed only after that stream's work.
//! let input = DeviceBuffer::from_slice(&[1.0f32; 1024])?;
//! input.record_stream(&stream)?;
//! let input = input.slice(..);
//! let mut launch = cudarc_stream.launch_builder(kernel);
//! launch.arg(&input).arg(&mut weights);
//! // SAFETY: the kernel takes two arrays of 1,024 floats and stays in bounds.
//! unsafe { launch.launch(LaunchConfig::for_num_elems(1024)) }?;
//! let pinned = upload.wait()?; // back, free to refill
//! # Ok(()) }
//! ```
//!
//! # Without cudarc
//!
//! ```
//! use cuda_pinned::{DeviceBuffer, PinnedVec, Stream};
//!
//! let mut batch = PinnedVec::<f32>::with_capacity(1024)?;
//! batch.extend((0..1024).map(|i| i as f32));
//! println!("{} floats in {} memory", batch.len(), batch.memory_kind().unwrap());
//!
//! if cuda_pinned::is_available() {
//!     let stream = Stream::new()?;
//!     let mut on_device = DeviceBuffer::<f32>::zeroed(batch.len())?;
//!     // The copy takes the buffer and returns it once the DMA is done.
//!     let transfer = stream.copy_to_device(batch, &mut on_device)?;
//!     // ... queue kernels, other copies ...
//!     let batch = transfer.wait()?;
//!     assert_eq!(on_device.to_vec()?, batch.as_slice());
//! }
//! # Ok::<(), cuda_pinned::Error>(())
//! ```

#![deny(unsafe_op_in_unsafe_fn)]

mod containers;
mod context;
mod copy;
pub mod guide {
    #![doc = include_str!("../docs/guide.md")]
}
mod error;
mod files;
mod gpu;
mod interop;
mod memory;
mod nontemporal;
#[cfg(feature = "nvtx")]
pub mod nvtx;
mod os;
mod raw;
pub mod ring;
mod staging;
mod test_hooks;
pub mod traces {
    #![doc = include_str!("../docs/tracing.md")]
}

// Memory: the allocator contract and the kinds.
pub use memory::allocator::{Allocation, MemoryKind, PendingUses, PinnedAllocator};
pub use memory::cuda_host::CudaHost;
pub use memory::default::DefaultPinned;
pub use memory::flags::{HostAllocFlags, RegisterFlags};
pub use memory::host_locked::HostLocked;
pub use memory::registered::Registered;
pub use memory::registration::{ReadOnlyRegistration, RegisteredVec, Registration};
pub use memory::virtual_host::VirtualHost;

// Containers.
pub use containers::boxed::PinnedBox;
pub use containers::pin_memory::PinMemory;
pub use containers::vec::{IntoIter, PinnedVec};

// The GPU side.
pub use gpu::buffer::{DeviceBuffer, LentDeviceMemory};
pub use gpu::device::{
    Device, Version, device_count, driver_version, is_available, runtime_path, runtime_version,
};
pub use gpu::event::Event;
pub use gpu::stream::Stream;
pub use gpu::views::{DeviceSlice, DeviceSliceMut};

// Copies.
pub use copy::batch::{RawCopy, RawCopy2d};
pub use copy::tracked::{HostBuffer, Transfer};
pub use copy::window::Window;
pub use files::open::open_regular_file;
pub use files::page_cache::{PageCacheProbe, advise_random, advise_will_need};
#[cfg(feature = "cudarc")]
pub use interop::cudarc::CudarcCopies;
pub use nontemporal::{copy_streaming, read_at_streaming};
pub use staging::{StagedCopy, Stager, StagingConfig};

// Errors, and the layer below.
/// The raw CUDA runtime bindings this crate is built on (the types of [`Stream::as_raw`] and
/// [`Event::as_raw`], and the rest of the runtime API).
pub use cuda_pinned_sys as sys;
pub use cuda_pinned_sys::LoadError;
pub use error::{CudaError, DriverError, Error, ErrorChain, Result, copy_io_error};
#[doc(hidden)]
pub use raw::RUNTIME_CALLS_VAR;
