//! Copies between ordinary (pageable) memory and the device near pinned speed: a ring of
//! page-locked chunks that several host threads fill (or empty) while the DMA engine drains
//! (or fills) them on the caller's stream.
//!
//! The driver copies pageable memory through one hidden pinned buffer with one CPU thread,
//! at a quarter of the link. Here a copy is cut into pieces of at most one chunk; each piece
//! takes a free chunk of the ring, waits for that chunk's previous DMA (its event), and:
//! - host → device: a thread copies the piece into the chunk and queues the chunk's DMA;
//! - device → host: the DMA fills the chunk, then a thread copies it out.
//!
//! Persistent worker threads and the calling thread take pieces in parallel; a copy of at
//! most [`StagingConfig::single_thread_bytes`] runs on the calling thread alone. An upload of
//! at most [`StagingConfig::upload_slot_bytes`] is copied into a slot of its own beside the
//! ring, ended by a single event that frees the slot and is handed back. Copies of
//! the sizes where the driver's own path is as fast
//! ([`StagingConfig::driver_uploads`], [`StagingConfig::driver_downloads`]) take that path,
//! for host memory that starts in ordinary memory, on devices that cannot read pageable
//! memory themselves (the driver then stages it within its call: a source is read, a
//! destination filled, before the call returns). Downloads copy pieces out, and uploads of
//! several pieces up to 256 MiB copy them in, with non-temporal stores
//! ([`StagingConfig::streaming_stores`]).

use std::ops::RangeInclusive;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};

use bytemuck::{AnyBitPattern, NoUninit};

use crate::error::Error;
use crate::error::Result;
use crate::gpu::device::Device;
use crate::gpu::views::DeviceRange;
use crate::gpu::views::DeviceSlice;
use crate::gpu::views::DeviceSliceMut;
use crate::memory::allocator::PinnedAllocator;
use crate::memory::default::DefaultPinned;
use crate::raw::copy::Direction;

use crate::gpu::device::check_same_device;
use crate::gpu::event::Event;
use crate::gpu::stream::Stream;
use crate::ring::{Cuda, lock};
use driver_check::DriverPaths;
use engine::Engine;

mod config;
mod driver_check;
mod engine;
mod job;
mod slots;
#[cfg(test)]
mod tests;

pub use config::StagingConfig;

/// Copies between ordinary memory and the device near page-locked speed, through a pinned ring.
///
/// Copies between `&[T]` / `&mut [T]` in ordinary memory and device memory near page-locked
/// speed for large copies, through a ring of pinned chunks (from allocator `A`, a pool for
/// instance) and persistent copy threads. Share one stager between threads: calls from
/// several threads (both directions at once, on two streams) split the threads between them.
/// A stager copies to and from one device, the one current when it was made or the one named
/// ([`on`](Self::on)), from any thread whatever device is current there; make one per device.
///
/// # Examples
///
/// ```no_run
/// use cuda_pinned::{DeviceBuffer, Stager, Stream};
/// let stager = Stager::new()?;
/// let stream = Stream::new()?;
/// let data: Vec<f32> = vec![1.0; 1 << 28]; // ordinary memory, 1 GiB
/// let mut device = DeviceBuffer::<f32>::zeroed(data.len())?;
/// let upload = stager.copy_to_device(&stream, &data, &mut device)?; // `data` has been read
/// drop(data); // the DMA trails on the stream, from the ring
/// upload.wait()?;
/// let mut back = vec![0.0f32; 1 << 28];
/// stager.copy_from_device(&stream, &device, &mut back)?; // returns with `back` filled
/// # Ok::<(), cuda_pinned::Error>(())
/// ```
pub struct Stager<A: PinnedAllocator = DefaultPinned> {
    engine: Engine<Cuda, A>,
    /// Which driver paths are taken: none where the device reads pageable memory itself
    /// (the driver then stages nothing), else those whose calls behaved as needed when
    /// checked.
    driver_paths: DriverPaths,
    /// Events that ended uploads, reused once nobody holds them (creating one costs about as
    /// much as a small copy).
    events: Mutex<Vec<Arc<Event>>>,
}

impl Stager {
    /// A stager with the default configuration and [`DefaultPinned`] memory.
    ///
    /// # Examples
    ///
    /// ```no_run
    /// use cuda_pinned::{DeviceBuffer, Stager, Stream};
    /// let (stager, stream) = (Stager::new()?, Stream::new()?);
    /// let data = vec![1u8; 64 << 20]; // ordinary memory
    /// let mut device = DeviceBuffer::<u8>::zeroed(data.len())?;
    /// stager.copy_to_device(&stream, &data, &mut device)?.wait()?;
    /// # Ok::<(), cuda_pinned::Error>(())
    /// ```
    ///
    /// # Errors
    ///
    /// As [`with_config_in`](Self::with_config_in).
    pub fn new() -> Result<Self> {
        Self::with_config_in(StagingConfig::default(), DefaultPinned)
    }

    /// A stager for `device`, with the default configuration and [`DefaultPinned`] memory
    /// (on the device's NUMA node).
    ///
    /// # Errors
    ///
    /// As [`with_config_in`](Self::with_config_in).
    pub fn on(device: Device) -> Result<Self> {
        Self::with_config_on(device, StagingConfig::default(), DefaultPinned)
    }
}

impl<A: PinnedAllocator> Stager<A> {
    /// A stager cutting copies as `config` says, its ring allocated from `allocator` now.
    ///
    /// # Errors
    ///
    /// [`Error::Unsupported`] for a configuration with zero chunk bytes, threads or slots,
    /// more than [`StagingConfig::MAX_THREADS`] threads,
    /// or a driver size range that ends before it starts or past 4 MiB;
    /// [`Error::Unavailable`] without CUDA; the allocator's error for the ring; the CUDA
    /// error of checking the driver's paths.
    pub fn with_config_in(config: StagingConfig, allocator: A) -> Result<Self> {
        Self::with_config_on(Device::current()?, config, allocator)
    }

    /// As [`with_config_in`](Self::with_config_in), for `device`: the ring is allocated and the
    /// workers run with it current.
    ///
    /// The calling thread's current device is left as it was.
    ///
    /// # Errors
    ///
    /// As [`with_config_in`](Self::with_config_in).
    pub fn with_config_on(device: Device, config: StagingConfig, allocator: A) -> Result<Self> {
        crate::context::on_device(device.raw(), || {
            let engine = Engine::new(Cuda::on(device), config, allocator)?;
            let config = engine.config();
            let stages_pageable = crate::raw::device::device_attribute(
                cuda_pinned_sys::cudaDeviceAttr::cudaDevAttrPageableMemoryAccess,
                device.raw(),
            )
            .is_ok_and(|access| access == 0);
            let wanted = !config.driver_uploads.is_empty() || !config.driver_downloads.is_empty();
            let driver_paths = if stages_pageable && wanted {
                driver_check::driver_paths(device)?
            } else {
                DriverPaths::default()
            };
            Ok(Self {
                engine,
                driver_paths,
                events: Mutex::new(Vec::new()),
            })
        })
    }

    /// The device it copies to and from.
    pub fn device(&self) -> Device {
        Device::from_raw(self.engine.device)
    }

    /// The configuration in use.
    pub fn config(&self) -> &StagingConfig {
        self.engine.config()
    }

    /// Worker threads running (`threads - 1`, fewer if the system refused to start some).
    pub fn workers(&self) -> usize {
        self.engine.workers()
    }

    /// Copies `src` into `dst` on `stream`, and returns once `src` has been read.
    ///
    /// `dst` is a [`DeviceBuffer`](crate::DeviceBuffer) or a view of one. When the call returns,
    /// the borrow ends, the DMA trails on the stream from an upload slot, the ring, or the driver's
    /// staging memory (for the sizes of [`StagingConfig::upload_slot_bytes`] and
    /// [`StagingConfig::driver_uploads`]), and work queued on `stream` afterwards sees the data.
    ///
    /// # Errors
    ///
    /// [`Error::LengthMismatch`] when the lengths differ, [`Error::DeviceMismatch`] when the
    /// stream or the device buffer belongs to another device than the stager's,
    /// [`Error::Capturing`] on a stream capturing a graph, or the CUDA error. After an error
    /// part of `dst` may have been written.
    pub fn copy_to_device<'d, T: NoUninit + 'd>(
        &self,
        stream: &Stream,
        src: &[T],
        dst: impl Into<DeviceSliceMut<'d, T>>,
    ) -> Result<StagedCopy> {
        let range = dst.into().range;
        let bytes = size_of_val(src);
        self.check(stream, range, src.len())?;
        let _span = tracing::debug_span!(
            "staged copy",
            direction = %"host to device",
            bytes,
            memory = %"ordinary, staged",
            stream = ?stream.as_raw(),
            device = stream.device().raw(),
        )
        .entered();
        crate::gpu::fence::enqueue(stream, |stream| {
            range.pending.order_before(stream)?;
            // SAFETY: `src` is readable for `bytes` during the call; the device range is
            // live, borrowed uniquely, and records the copy in `end_on` before its memory can
            // be freed (or, where no event could be recorded, the stream is waited for).
            let in_slot = unsafe {
                self.engine.upload_in_slot(
                    src.as_ptr().cast(),
                    range.address,
                    bytes,
                    stream,
                    || {
                        let ended = self.end_on(stream, range)?;
                        // A capture another thread began meanwhile (it may hold the copy or
                        // the record that frees the slot) is reported, if not prevented: the
                        // slot is then lost.
                        stream.refuse_capture()?;
                        Ok(ended)
                    },
                )
            };
            if let Some(ended) = in_slot {
                return ended.map(|event| StagedCopy { event });
            }
            let copied = if self.takes_driver_path(
                src,
                self.driver_paths.uploads,
                &self.config().driver_uploads,
            ) {
                self.upload_through_driver(stream, src, range)
            } else {
                // SAFETY: `src` is readable for `bytes` and borrowed until the engine
                // returns, which is after the last read of it; the device range is live,
                // borrowed uniquely, and records the copies below before its memory can be
                // freed.
                unsafe {
                    self.engine.run(
                        Direction::HostToDevice,
                        src.as_ptr().cast_mut().cast(),
                        range.address,
                        bytes,
                        stream,
                    )
                }
            };
            if let Err(Error::Capturing) = copied {
                // A capture took in the copy: an event there would mark nothing, and waiting
                // for the stream would break the capture.
                return Err(Error::Capturing);
            }
            let ended = self.end_on(stream, range);
            copied?;
            Ok(StagedCopy { event: ended? })
        })
    }

    /// Copies `src` into new device memory on `stream`, and returns it once `src` has been
    /// read: the memory is allocated uninitialised and filled by the copy, with no memset
    /// first (what [`DeviceBuffer::zeroed`](crate::DeviceBuffer::zeroed) and then
    /// [`copy_to_device`](Self::copy_to_device) would pay for a large upload).
    ///
    /// As with `copy_to_device`, work queued on `stream` afterwards sees the data, and the
    /// buffer orders its own later copies on other streams after this one; a kernel on
    /// another stream waits for it through [`DeviceBuffer::record_stream`](crate::DeviceBuffer::record_stream).
    ///
    /// ```no_run
    /// use cuda_pinned::{Stager, Stream};
    /// let (stager, stream) = (Stager::new()?, Stream::new()?);
    /// let weights = vec![0.5f32; 1 << 28]; // 1 GiB of ordinary memory
    /// let on_device = stager.to_device_buffer(&stream, &weights)?;
    /// assert_eq!(on_device.len(), weights.len());
    /// # Ok::<(), cuda_pinned::Error>(())
    /// ```
    ///
    /// # Errors
    ///
    /// The error of allocating the memory (out of device memory among them); then as
    /// [`copy_to_device`](Self::copy_to_device), after which the memory is freed.
    pub fn to_device_buffer<T: NoUninit>(
        &self,
        stream: &Stream,
        src: &[T],
    ) -> Result<crate::DeviceBuffer<T>> {
        let mut buffer =
            crate::DeviceBuffer::<std::mem::MaybeUninit<T>>::uninit_on(self.device(), src.len())?;
        let range = buffer.slice_mut(..).range;
        let dst = DeviceSliceMut::<'_, T> {
            range,
            _unique: std::marker::PhantomData,
        };
        // The copy's event is tracked by the buffer: nothing else needs it.
        let _copy = self.copy_to_device(stream, src, dst)?;
        // SAFETY: the copy just queued writes every element (the lengths are equal), and
        // every use of the memory is ordered after it: on `stream` by the stream, elsewhere
        // by the copy's event, which the buffer tracks.
        Ok(unsafe { buffer.assume_init() })
    }

    /// The driver's own path for an upload from ordinary memory: one copy call, which stages
    /// `src` before it returns. Runs with the stager's device current.
    fn upload_through_driver<T: NoUninit>(
        &self,
        stream: &Stream,
        src: &[T],
        range: DeviceRange<'_>,
    ) -> Result<()> {
        // SAFETY: on this device the driver copies a source in ordinary memory into its own
        // pinned buffers before its copy call returns (checked: the path is on, which the
        // caller asked), and the stream runs the copy now, not at a graph's launch (the fence
        // refused a capture, or took the copy onto a companion that no capture holds); `src`
        // starts in ordinary memory, which is what the driver decides by (a source starting
        // in memory registered with CUDA, which it would read later, was ruled out), so it
        // need only be valid during the call. The device range is live, borrowed uniquely,
        // and the caller records the copy.
        unsafe {
            crate::raw::copy::copy_once(
                range.address as *mut std::ffi::c_void,
                src.as_ptr().cast(),
                size_of_val(src),
                Direction::HostToDevice,
                stream.as_raw(),
            )
        }?;
        // A capture another thread began meanwhile is reported, if not prevented.
        stream.refuse_capture()
    }

    /// Whether a copy from or into `host` takes the driver's own path: the path holds on
    /// this device (`on`), the copy's size is one of `sizes`, and CUDA sees the host side's
    /// first byte as ordinary memory. The driver decides by that byte alone: host memory that
    /// starts in ordinary memory is staged even where registered memory lies inside it or
    /// holds its end (the GPU tests check both), and memory that starts in registered memory
    /// is not (the call may return before the copy, or refuse it). Runs with the stager's
    /// device current.
    fn takes_driver_path<T>(&self, host: &[T], on: bool, sizes: &[RangeInclusive<usize>]) -> bool {
        let bytes = size_of_val(host);
        on && bytes > 0
            && sizes.iter().any(|r| r.contains(&bytes))
            && crate::raw::memory::is_pageable(host.as_ptr().cast())
    }

    /// Whether uploads of [`StagingConfig::driver_uploads`]' sizes take the driver's path.
    ///
    /// Whether uploads of the sizes in [`StagingConfig::driver_uploads`] take the driver's
    /// own path: not on a device that reads pageable memory itself, nor where the driver's
    /// call did not return with the source read when checked (once per device and process,
    /// as the first stager was made).
    #[doc(hidden)]
    pub fn driver_uploads_taken(&self) -> bool {
        self.driver_paths.uploads
    }

    /// Whether downloads of [`StagingConfig::driver_downloads`]' sizes take the driver's path.
    ///
    /// Whether downloads of the sizes in [`StagingConfig::driver_downloads`] take the
    /// driver's own path: as [`driver_uploads_taken`](Self::driver_uploads_taken), for a call
    /// that must return with the destination filled (the check downloads what it uploaded,
    /// so it passes only where uploads pass too).
    #[doc(hidden)]
    pub fn driver_downloads_taken(&self) -> bool {
        self.driver_paths.downloads
    }

    /// Checks the devices and the lengths.
    fn check(&self, stream: &Stream, range: DeviceRange<'_>, host: usize) -> Result<()> {
        check_same_device("the stream", self.engine.device, stream.device().raw())?;
        check_same_device("the device buffer", self.engine.device, range.device)?;
        if range.len != host {
            return Err(Error::LengthMismatch {
                host,
                device: range.len,
            });
        }
        Ok(())
    }

    /// Records the end of the work queued on `stream` so far for `range`, which frees its
    /// memory only after it; without an event, waits for the stream instead (if even that
    /// fails, the device is in an error state).
    fn end_on(&self, stream: &Stream, range: DeviceRange<'_>) -> Result<Arc<Event>> {
        let ended = self.end_event().and_then(|event| {
            event.record_shared(stream)?;
            range.pending.track(stream, event.clone());
            Ok(event)
        });
        if ended.is_err() {
            let _ = stream.synchronize();
        }
        ended
    }

    /// An event nobody else holds (a handle, a device buffer or an upload slot), or a new
    /// one.
    fn end_event(&self) -> Result<Arc<Event>> {
        const KEPT: usize = 64;
        let mut events = lock(&self.events);
        // Only this list can hand out a clone, under its lock: a count of one stays one.
        if let Some(event) = events.iter().find(|event| Arc::strong_count(event) == 1) {
            // The count is read without ordering; what the last other holder did with the
            // event (a query that marked it finished) must come before it is recorded again,
            // as `Arc::get_mut` orders it.
            std::sync::atomic::fence(Ordering::Acquire);
            return Ok(event.clone());
        }
        let event = Arc::new(Event::untimed_on(self.device())?);
        if events.len() < KEPT {
            events.push(event.clone());
        }
        Ok(event)
    }

    /// Copies `src` (a [`DeviceBuffer`](crate::DeviceBuffer) or a view of one) into `dst` on
    /// `stream`, after the work queued there before, and returns once `dst` is filled.
    ///
    /// # Examples
    ///
    /// ```no_run
    /// use cuda_pinned::{DeviceBuffer, Stager, Stream};
    /// let (stager, stream) = (Stager::new()?, Stream::new()?);
    /// let device = DeviceBuffer::from_slice(&[9u16; 1 << 20])?;
    /// let mut back = vec![0u16; 1 << 20]; // ordinary memory, filled when the call returns
    /// stager.copy_from_device(&stream, &device, &mut back)?;
    /// assert_eq!(back[0], 9);
    /// # Ok::<(), cuda_pinned::Error>(())
    /// ```
    ///
    /// # Errors
    ///
    /// As [`copy_to_device`](Self::copy_to_device).
    pub fn copy_from_device<'d, T: AnyBitPattern + 'd>(
        &self,
        stream: &Stream,
        src: impl Into<DeviceSlice<'d, T>>,
        dst: &mut [T],
    ) -> Result<()> {
        let range = src.into().range;
        let bytes = size_of_val(dst);
        self.check(stream, range, dst.len())?;
        let _span = tracing::debug_span!(
            "staged copy",
            direction = %"device to host",
            bytes,
            memory = %"ordinary, staged",
            stream = ?stream.as_raw(),
            device = stream.device().raw(),
        )
        .entered();
        crate::gpu::fence::enqueue(stream, |stream| {
            range.pending.order_before(stream)?;
            if self.takes_driver_path(
                dst,
                self.driver_paths.downloads,
                &self.config().driver_downloads,
            ) {
                // SAFETY: on this device the driver fills a destination in ordinary memory
                // before its copy call returns (checked: the path is on), and the stream
                // runs the copy now, not at a graph's launch (capture refused above: see
                // `Error::Capturing` for a capture another thread begins on the same stream
                // during the call); `dst` starts in ordinary memory, which is what the
                // driver decides by, is writable for `bytes` and borrowed uniquely until
                // this returns, and any bytes are a valid `T`. The device range is live;
                // once the call has returned, the destination is filled and nothing reads
                // the range any more.
                let copied = unsafe {
                    crate::raw::copy::copy_once(
                        dst.as_mut_ptr().cast(),
                        range.address as *const std::ffi::c_void,
                        bytes,
                        Direction::DeviceToHost,
                        stream.as_raw(),
                    )
                }
                // A capture another thread began meanwhile is reported, if not prevented.
                .and_then(|()| stream.refuse_capture());
                if matches!(copied, Err(ref error) if !matches!(error, Error::Capturing)) {
                    // Whether the driver's DMA still reads the range is unknown: it must know
                    // when the stream gets past it (unless a capture took in the copy).
                    let _ = self.end_on(stream, range);
                }
                return copied;
            }
            // SAFETY: `dst` is writable for `bytes`, borrowed uniquely until the engine
            // returns (after its last write), and any bytes are a valid `T`; the device range
            // is live and records the reads below before its memory can be freed.
            let copied = unsafe {
                self.engine.run(
                    Direction::DeviceToHost,
                    dst.as_mut_ptr().cast(),
                    range.address,
                    bytes,
                    stream,
                )
            };
            if matches!(copied, Err(ref error) if !matches!(error, Error::Capturing)) {
                // Pieces still in flight may read the device range: it must know when they
                // end (unless a capture took them in).
                let _ = self.end_on(stream, range);
            }
            // On success every piece's copy was waited for: nothing is left to track.
            copied
        })
    }
}

impl<A: PinnedAllocator> std::fmt::Debug for Stager<A> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Stager")
            .field("config", self.config())
            .field("workers", &self.workers())
            .finish()
    }
}

/// A staged host → device copy whose DMA may still run: the source was read already.
///
/// Dropping it changes nothing about the copy: it runs on, work queued on its stream
/// afterwards still sees the data, and the device memory still orders its later copies after
/// it (the buffer tracks it). What is given up is only a way to wait for it on the host
/// ([`wait`](Self::wait)) or to order another stream's work after it ([`event`](Self::event)).
#[derive(Debug)]
#[must_use = "the DMA may still be running: `wait` for it, order other streams after `event`, \
              or let it run (work on its stream sees the data)"]
pub struct StagedCopy {
    event: Arc<Event>,
}

impl StagedCopy {
    /// Whether the device has received all of it.
    ///
    /// # Errors
    ///
    /// A CUDA error, including one of the copy itself.
    pub fn is_done(&self) -> Result<bool> {
        self.event.query()
    }

    /// Blocks until the device has received all of it.
    ///
    /// # Errors
    ///
    /// A CUDA error, including one of the copy itself.
    pub fn wait(self) -> Result<()> {
        self.event.synchronize()
    }

    /// The event that completes with the copy, for ordering work on other streams after it.
    pub fn event(&self) -> &Event {
        &self.event
    }
}
