//! Safe page-locked ("pinned") host memory for CUDA.
//!
//! # What pinned memory is for
//!
//! A GPU copies to and from host memory with DMA engines, which need the memory's physical
//! pages to stay put. From ordinary (pageable) memory the driver first copies into a hidden
//! pinned staging buffer, and the copy runs synchronously; from page-locked memory the DMA
//! engines read directly and the copy runs asynchronously beside compute. On an H100 over
//! PCIe 5.0 that is 55 GB/s each way against 8–13.6 GB/s from pageable memory.
//!
//! **When not to use it:** pinned pages cannot be swapped out or moved. Pinning much of a
//! machine's memory starves the rest of the system; pin what you transfer, reuse it (see the
//! `pinned-pool` crate), and give it back. Getting pinned memory is also slow (about 1 ms
//! for a small `cudaHostAlloc`), so allocate once and reuse.
//!
//! # `Vec` and `PinnedVec`
//!
//! | | `Vec<T>` | [`PinnedVec<T, A>`] |
//! |---|---|---|
//! | memory | pageable heap | page-locked, from allocator `A` |
//! | H2D / D2H copy | staged by the driver, synchronous | direct DMA, async ([`Stream::copy_to_device`]) |
//! | allocation cost | ~50 ns | 0.2–1.5 ms (cache it: `pinned-pool`) |
//! | failure | aborts | `try_*` methods return [`Error`] |
//! | without CUDA | — | `mlock`ed memory ([`HostLocked`]), same API |
//! | access | `Deref<Target = [T]>` | `Deref<Target = [T]>`, never blocks |
//!
//! # Example
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
//!
//! # Copies from ordinary memory
//!
//! Data that lives in a `Vec` or a `&[T]` need not be pinned first: a [`Stager`] copies it
//! through a ring of page-locked chunks that several threads fill while the DMA engine drains
//! them (on an H100, 3.5–5.9× the driver's own path from 64 MiB up; at 1 GiB about 90% of
//! page-locked memory for uploads made back to back, 96% for downloads; see
//! benches/RESULTS.md). Small uploads go through slots of their own, ended by one event.
//! Copies of the sizes where the driver's own call is as fast take it, once the first stager
//! of the device has checked that the call reads or fills ordinary memory before it returns.
//! An upload returns once the source has been read; a download once the destination is
//! filled.
//!
//! Copies, tracked work and host functions refuse a stream that is capturing a CUDA graph
//! ([`Error::Capturing`]): the graph would run them at each launch, after the host memory may
//! be gone. A buffer marked as used on such a stream and freed meanwhile is never released.
//!
//! ```no_run
//! # use cuda_pinned::{DeviceBuffer, Stager, Stream};
//! # let (stager, stream) = (Stager::new()?, Stream::new()?);
//! let weights: Vec<f32> = vec![0.5; 1 << 26];
//! let mut on_device = DeviceBuffer::<f32>::zeroed(weights.len())?;
//! stager.copy_to_device(&stream, &weights, &mut on_device)?; // `weights` is free again
//! # Ok::<(), cuda_pinned::Error>(())
//! ```
//!
//! Filling page-locked memory yourself for a copy that follows (a batch), write large pieces
//! with [`copy_streaming`]: its non-temporal stores do not read the destination in first,
//! which leaves more memory bandwidth to the copy.
//!
//! # Kinds of memory
//!
//! Every allocator implements [`PinnedAllocator`]; every buffer says its [`MemoryKind`].
//!
//! | allocator | how | needs |
//! |---|---|---|
//! | [`DefaultPinned`] | [`Registered`] with CUDA, [`HostLocked`] without | nothing |
//! | [`CudaHost`] | `cudaHostAlloc` ([`HostAllocFlags`]: portable by default, mapped, write-combined) | CUDA |
//! | [`Registered`] | `mmap` + huge pages + parallel pre-fault + `cudaHostRegister`: ~10× faster to get; on the GPU's NUMA node; optionally registered in chunks, pipelined with the pre-fault | CUDA |
//! | [`Registration`], [`RegisteredVec`] | registers memory you already own | CUDA |
//! | [`HostLocked`] | `mmap` + `mlock` | `RLIMIT_MEMLOCK` room |
//! | [`VirtualHost`] | `cuMemCreate` on the GPU's NUMA node, chunks mapped into one reserved range: never stalls other threads' copies, [`PinnedVec`] grows in place | CUDA 12.5 |
//!
//! Measured on an H100 host, getting 1 GiB takes 0.4–0.6 s with `cudaHostAlloc`, 40–55 ms
//! registered, 0.24–0.30 s as [`VirtualHost`]; copies from all three run at 99–100% of the
//! link's speed from 16 MiB up.
//!
//! Getting pinned memory holds a driver lock that other threads' copies wait for: 0.35–0.6 s
//! while `cudaHostAlloc` pins 1 GiB, 20–35 ms for one registration. Registered in 12 MiB
//! chunks ([`Registered::register_in_chunks`]), 1 GiB pinned faster and the wait fell to
//! about a millisecond; created as [`VirtualHost`], to 0.05–0.7 ms.
//!
//! They also implement allocator-api2's `Allocator`, so `allocator_api2::vec::Vec<T, _>` and
//! hashbrown maps can live in pinned memory.
//!
//! # Several GPUs
//!
//! Which device sees which memory:
//!
//! | memory | seen as page-locked by |
//! |---|---|
//! | [`CudaHost`], [`Registered`], [`Registration`], [`DefaultPinned`] | every device: the portable flag is on by default (without it, only the device current at allocation) |
//! | [`VirtualHost`] | every device that supports it: each chunk is opened to all of them |
//! | [`HostLocked`] | none: copies from it are staged by the driver like pageable ones |
//!
//! [`Registered`] and [`VirtualHost`] memory goes on the NUMA node of the device current
//! when it is allocated (`cudaHostAlloc`'s where the allocating thread first touches it). A
//! device on another node reaches it across the link between the sockets, which can cost
//! bandwidth: `pinned-bench devices` measures each GPU from each node on machines that have
//! several.
//!
//! Streams, events, device buffers and stagers belong to one device: the current one when
//! made ([`Stream::new`], [`Event::new`], [`DeviceBuffer::zeroed`], [`Stager::new`]) or the
//! one named ([`Stream::on`], [`Event::on`], [`DeviceBuffer::zeroed_on`], [`Stager::on`]),
//! and each says which ([`Stream::device`]). Work on them runs on their device's primary
//! context whichever device is current on the calling thread, and **no call but
//! [`Device::set_current`] leaves the thread's current device changed**: the context current
//! before is put back, and a thread that had none is left with none (with CUDA 12.5 or
//! later; older runtimes put the device number back, which makes that device's context
//! current). Pinned memory is allocated and freed in the current device's context (device
//! 0's on a thread that never chose one), and that too leaves the thread's context as it was. Where CUDA needs one device, mixing two is
//! an [`Error::DeviceMismatch`]: a copy into a buffer of device 1 on a stream of device 0, an
//! event recording another device's stream. A buffer used on several devices' streams is
//! freed, or reused by a pool, only after every one of them has passed its work. The crate
//! keeps each device's primary context (the runtime's and cudarc's) retained once used:
//! `cudaDeviceReset` destroys everything made in it, so reset a device only when nothing of
//! this crate lives there.
//!
//! ```no_run
//! use cuda_pinned::{Device, DeviceBuffer, PinnedVec, Stream};
//! for device in Device::all()? {
//!     let stream = Stream::on(device)?;
//!     let mut memory = DeviceBuffer::<f32>::zeroed_on(device, 1 << 20)?;
//!     let batch = PinnedVec::from_slice(&vec![1.0f32; 1 << 20])?;
//!     stream.copy_to_device(batch, &mut memory)?.wait()?;
//! }
//! # Ok::<(), cuda_pinned::Error>(())
//! ```
//!
//! # Safety model
//!
//! No safe API lets a device read or write memory that is freed, reused, or accessed by the
//! host at the same time:
//!
//! - An async copy takes the pinned buffer **by value** and returns a [`Transfer`]; the host
//!   gets the buffer back from [`Transfer::wait`], after the copy. Host access during the
//!   copy is a compile error, and `Deref` never has to wait or fail.
//! - Dropping a `Transfer` hands the buffer to its allocator together with the copy's event:
//!   a plain allocator waits for it, a caching pool reuses the block only after it.
//! - `mem::forget` on a `Transfer` leaks the buffer: leaked memory is never reused.
//! - Work the crate cannot see (your kernels on a mapped buffer) is declared with
//!   [`PinnedVec::record_stream`], and is waited for or deferred on in the same way.
//! - Copies need plain-old-data: `bytemuck::NoUninit` to the device, `AnyBitPattern` back.
//! - Raw-pointer copies are `unsafe`.
//!
//! Buffers move into a copy, so they cannot be touched while it runs:
//!
//! ```compile_fail
//! # use cuda_pinned::{DeviceBuffer, PinnedVec, Stream};
//! # fn f(stream: &Stream, mut device: DeviceBuffer<u8>) -> cuda_pinned::Result<()> {
//! let mut host = PinnedVec::from_slice(&[1u8, 2, 3])?;
//! let transfer = stream.copy_to_device(host, &mut device)?;
//! host.push(4); // error: `host` was moved into the copy
//! # Ok(()) }
//! ```
//!
//! `Send` and `Sync` follow the element type, as for `Vec`:
//!
//! ```compile_fail
//! fn send<T: Send>(_: T) {}
//! let v = cuda_pinned::PinnedVec::<std::rc::Rc<u8>>::new();
//! send(v); // error: `Rc<u8>` is not `Send`
//! ```
//!
//! ```compile_fail
//! fn share<T: Sync>(_: &T) {}
//! let b = cuda_pinned::PinnedBox::new(std::cell::Cell::new(0u8)).unwrap();
//! share(&b); // error: `Cell<u8>` is not `Sync`
//! ```
//!
//! # With cudarc (the `cudarc` feature)
//!
//! Both crates load CUDA at run time and use the device's primary context, so they share
//! streams, events and device memory. One call needs care: cudarc's
//! `stream.memcpy_htod(src, &mut device)` takes the host side by reference and, for `&[T]`,
//! returns as soon as the copy is queued, assuming pageable memory (which the driver copies
//! before returning). From page-locked memory the DMA is still reading when the borrow ends,
//! and a host write made right after the call reaches the device. Our buffers are therefore
//! not cudarc `HostSlice`s: cudarc could end such a copy only with a wait of its own, which
//! CUDA refuses while another thread captures a graph in global mode, and cudarc then
//! returns with the DMA running. With the feature:
//! - `CudarcCopies` (on `Arc<CudaStream>`) queues tracked copies between our buffers and
//!   cudarc's `CudaSlice` / views that return at once: the buffer moves into a [`Transfer`],
//!   as with [`Stream::copy_to_device`], and the device side joins cudarc's event tracking.
//!   `.wait()` on it makes a blocking copy.
//! - `Stream::from_cudarc` adopts a cudarc stream, so [`PinnedVec::record_stream`] can hold a
//!   buffer back from reuse and free until cudarc's kernels on that stream are done;
//!   [`Stream::from_raw`] adopts any raw stream handle (PyTorch's `ExternalStream`).
//!
//! # Errors
//!
//! Everything the world can do is an [`Error`] value: no CUDA ([`Error::Unavailable`] lists
//! where libcudart was looked for), a CUDA error ([`CudaError`] with code, name and
//! description, or [`DriverError`] from the driver's calls this crate makes: copies,
//! events, host memory through the virtual-memory API), the memlock limit
//! ([`Error::MemlockLimit`] with the limit and a fix), out of memory, and sizes that
//! overflow. A failed CUDA call clears the runtime's sticky last-error so it does not
//! resurface in your next, unrelated call. Set [`RUNTIME_CALLS_VAR`] to make copies, events
//! and pointer lookups go through the runtime's calls instead of the driver's, as they do
//! with runtimes before 12.5.

#![deny(unsafe_op_in_unsafe_fn)]

mod containers;
mod context;
mod copy;
mod error;
mod gpu;
mod interop;
mod memory;
mod os;
mod raw;
mod staging;
mod test_hooks;

pub use containers::boxed::PinnedBox;
pub use containers::pin_memory::PinMemory;
pub use containers::vec::{IntoIter, PinnedVec};
pub use copy::batch::RawCopy;
pub use copy::nontemporal::copy_streaming;
pub use copy::tracked::{HostBuffer, Transfer};
/// The raw CUDA runtime bindings this crate is built on (the types of [`Stream::as_raw`] and
/// [`Event::as_raw`], and the rest of the runtime API).
pub use cuda_pinned_sys as sys;
pub use cuda_pinned_sys::LoadError;
pub use error::{CudaError, DriverError, Error, Result};
pub use gpu::buffer::DeviceBuffer;
pub use gpu::device::{
    Device, Version, device_count, driver_version, is_available, runtime_path, runtime_version,
};
pub use gpu::event::Event;
pub use gpu::stream::Stream;
pub use gpu::views::{DeviceSlice, DeviceSliceMut};
#[cfg(feature = "cudarc")]
pub use interop::cudarc::CudarcCopies;
pub use memory::allocator::{Allocation, MemoryKind, PendingUses, PinnedAllocator};
pub use memory::cuda_host::CudaHost;
pub use memory::default::DefaultPinned;
pub use memory::flags::{HostAllocFlags, RegisterFlags};
pub use memory::host_locked::HostLocked;
pub use memory::registered::Registered;
pub use memory::registration::{RegisteredVec, Registration};
pub use memory::virtual_host::VirtualHost;
pub use raw::RUNTIME_CALLS_VAR;
pub use staging::{StagedCopy, Stager, StagingConfig};
