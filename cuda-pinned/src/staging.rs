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
//! the sizes where the driver's own path was measured as fast
//! ([`StagingConfig::driver_uploads`], [`StagingConfig::driver_downloads`]) take that path,
//! for host memory that starts in ordinary memory, on devices that cannot read pageable
//! memory themselves (the driver then stages it within its call: a source is read, a
//! destination filled, before the call returns). Downloads copy large pieces out with
//! non-temporal stores ([`StagingConfig::streaming_stores`]).

use std::collections::VecDeque;
use std::mem::ManuallyDrop;
use std::ops::RangeInclusive;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, PoisonError};
use std::thread::JoinHandle;

use bytemuck::{AnyBitPattern, NoUninit};

use crate::alloc::{DefaultPinned, PinnedAllocator};
use crate::device::Device;
use crate::device_buffer::{DeviceRange, DeviceSlice, DeviceSliceMut};
use crate::error::{Error, Result};
use crate::ffi::{self, Direction};
use crate::stream::{Event, Stream, check_same_device};
use crate::streaming::copy_bytes_streaming;
use crate::vec::PinnedVec;
use driver_check::{DriverPaths, MAX_DRIVER_BYTES};

/// How a [`Stager`] cuts and spreads copies. The defaults come from measurements on an H100
/// over PCIe 5.0 (benches/RESULTS.md); override them for other machines.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct StagingConfig {
    /// Bytes of one chunk of the ring: the largest piece a thread copies at once.
    pub chunk_bytes: usize,
    /// Threads that copy, the calling thread included (`threads - 1` workers are started).
    pub threads: usize,
    /// Chunks in the ring (page-locked memory: `slots × chunk_bytes`).
    pub slots: usize,
    /// Copies up to this size run on the calling thread alone, in pieces of one chunk: waking
    /// workers costs more than it saves.
    pub single_thread_bytes: usize,
    /// The smallest piece a larger copy is cut into. Copies are cut into about two pieces
    /// per thread, smaller at both ends: the DMA engine starts early and drains a short tail.
    pub min_piece_bytes: usize,
    /// Uploads of these sizes (in bytes) from ordinary memory take the driver's own path:
    /// one copy call from the source (`cuMemcpyHtoDAsync`, or the runtime's
    /// `cudaMemcpyAsync` where the driver's entry points cannot be reached). On a device
    /// that cannot read pageable memory itself, the driver copies such a source into pinned
    /// staging buffers before the call returns: CUDA documents this for `cudaMemcpy`, and
    /// for the asynchronous calls up to version 11; since then its documentation says only
    /// that they "might be synchronous". So a stager checks it on its device before taking
    /// this path (once per device and process: uploads of 4 KiB and 4 MiB behind work that
    /// holds the stream back, their sources overwritten as the calls return; see
    /// [`Stager::driver_uploads_taken`]), and the GPU tests check it for every default size.
    /// Sizes end at 4 MiB at most. Devices that read pageable memory directly (HMM, ATS) and
    /// sources that start in page-locked memory always go through the ring. The driver
    /// decides by the source's first byte, looked up by byte, not by page: registered memory
    /// sharing a page with the source, lying inside it or holding its end leaves it staged
    /// (checked by the GPU tests too). The call may wait for work queued earlier on the
    /// stream.
    ///
    /// Upload slots come first ([`upload_slot_bytes`](Self::upload_slot_bytes)): up to 16
    /// KiB this path takes the uploads for which no slot is free. The defaults are where the
    /// ring was not reliably faster on an H100 host: up to 16 KiB (a chunk's event calls
    /// cost more than they save) and from 128 KiB to 4 MiB (the driver overlaps its
    /// one-thread copy with the DMA, which one chunk cannot, and the ring's gain there hangs
    /// on how fast sleeping workers wake: 1.2–1.5× on some virtual machines, 0.65–0.9× on
    /// others). Around 64 KiB the driver's path is slow, and one chunk of the ring or an
    /// upload slot faster. Empty: every upload goes through the ring.
    pub driver_uploads: Vec<RangeInclusive<usize>>,
    /// Downloads of these sizes (in bytes) into ordinary memory take the driver's own path:
    /// one copy call into the destination (`cuMemcpyDtoHAsync`, or `cudaMemcpyAsync`). On a
    /// device that cannot read pageable memory itself, that call returns only once such a
    /// destination is filled, so the download needs no event and no wait of its own. CUDA
    /// documented this for `cudaMemcpyAsync` up to version 11 and version 13 behaves so, but
    /// its documentation now says only that the call "might be synchronous": as for uploads,
    /// a stager checks it on its device first (downloads of 4 KiB and 4 MiB behind held-back
    /// work, looked at as the calls return; see [`Stager::driver_downloads_taken`]), and
    /// sizes end at 4 MiB at most. The driver decides by the destination's first byte
    /// (observed from 4 to 64 KiB, and checked by the GPU tests at 12 and 16 KiB with
    /// registered memory inside it, holding its end or sharing its pages); page-locked
    /// destinations and devices that read pageable memory go through the ring.
    ///
    /// The default is up to 16 KiB: there the driver's call alone ran 1.04–1.20× the
    /// driver's path as programs use it (`cudaMemcpyAsync`, then the stream waited for) on an
    /// H100 host, the ring's one chunk (a copy call, an event recorded and waited for, then a
    /// copy out) 0.97–1.19×; from 32 KiB the two ran alike. Empty: every download goes
    /// through the ring.
    pub driver_downloads: Vec<RangeInclusive<usize>>,
    /// Uploads of up to this many bytes (from any host memory) are copied by the calling
    /// thread into a slot of their own and go to the device from there, ended by one event:
    /// the one handed back, which also frees the slot. A slot is taken when its last upload
    /// was seen finished (its copy waited for or queried) or one query finds it finished;
    /// when no slot is, the upload takes the driver's path or the ring. A ring chunk needs an
    /// event of its own besides the one that ends the copy, and the driver's path a pointer
    /// lookup. On H100 hosts, timed against the driver's untracked call in three runs, uploads
    /// of 64 KiB through slots ran 1.17–1.25× where the ring ran 1.04–1.07×; at 4 and 16 KiB
    /// slots and the driver's path ran alike (0.96–1.03×). 0: no slots.
    pub upload_slot_bytes: usize,
    /// Slots for small uploads (page-locked memory: `upload_slots × upload_slot_bytes`, after
    /// the ring's): as many uploads may be in flight before the next takes another path.
    pub upload_slots: usize,
    /// Downloads copy pieces of 4 KiB and more out of the ring with non-temporal stores
    /// (past the CPU's caches) where the CPU has them (x86-64 with AVX2): the destination's
    /// cache lines are not read first, which saves memory bandwidth on large downloads, but
    /// the data is not in the caches afterwards either. Uploads of 32 KiB and more copy into
    /// their upload slot with them too: in a probe on an H100 host a 64 KiB upload through a
    /// slot so filled ran 1.29–1.32× the driver's path (`cudaMemcpyAsync`, then the stream
    /// waited for), 1.11–1.19× with plain stores (under 32 KiB streaming stores were slower:
    /// 0.64–0.88× at 4 to 16 KiB).
    pub streaming_stores: bool,
}

impl StagingConfig {
    /// The most threads a stager starts: more are refused (each is a thread of its own, and
    /// a copy is cut into about two pieces for each).
    pub const MAX_THREADS: usize = 1024;
}

impl Default for StagingConfig {
    fn default() -> Self {
        let threads = std::thread::available_parallelism()
            .map_or(4, |n| n.get())
            .min(12);
        Self {
            chunk_bytes: 4 << 20,
            threads,
            slots: 2 * threads,
            single_thread_bytes: 256 << 10,
            min_piece_bytes: 512 << 10,
            driver_uploads: vec![0..=(16 << 10), (128 << 10)..=(4 << 20)],
            driver_downloads: vec![0..=(16 << 10)],
            upload_slot_bytes: 64 << 10,
            upload_slots: 8,
            streaming_stores: true,
        }
    }
}

/// Copies between `&[T]` / `&mut [T]` in ordinary memory and device memory near page-locked
/// speed for large copies, through a ring of pinned chunks (from allocator `A`, a pool for
/// instance) and persistent copy threads. Share one stager between threads: calls from
/// several threads (both directions at once, on two streams) split the threads between them.
/// A stager copies to and from one device, the one current when it was made or the one named
/// ([`on`](Self::on)), from any thread whatever device is current there; make one per device.
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

    /// As [`with_config_in`](Self::with_config_in), for `device`: the ring is allocated and
    /// the workers run with it current. The calling thread's current device is left as it
    /// was.
    ///
    /// # Errors
    ///
    /// As [`with_config_in`](Self::with_config_in).
    pub fn with_config_on(device: Device, config: StagingConfig, allocator: A) -> Result<Self> {
        ffi::on_device(device.raw(), || {
            let engine = Engine::new(Cuda { device }, config, allocator)?;
            let config = &engine.shared.config;
            let stages_pageable = ffi::device_attribute(
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
        &self.engine.shared.config
    }

    /// Worker threads running (`threads - 1`, fewer if the system refused to start some).
    pub fn workers(&self) -> usize {
        self.engine.workers.len()
    }

    /// Copies `src` into `dst` (a [`DeviceBuffer`](crate::DeviceBuffer) or a view of one)
    /// on `stream`, and returns once `src` has been read: the borrow ends, the DMA trails on
    /// the stream from an upload slot, the ring, or the driver's staging memory (for the
    /// sizes of [`StagingConfig::upload_slot_bytes`] and [`StagingConfig::driver_uploads`]),
    /// and work queued on `stream` afterwards sees the data.
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
        stream.enqueue(|stream| {
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
                // SAFETY: on this device the driver copies a source in ordinary memory into
                // its own pinned buffers before its copy call returns (checked: the path is
                // on), and the stream runs the copy now, not at a graph's launch (capture
                // refused above: see `Error::Capturing` for a capture another thread begins
                // on the same stream during the call); `src` starts in ordinary memory,
                // which is what the driver decides by (a source starting in memory
                // registered with CUDA, which it would read later, was ruled out), so it
                // need only be valid during the call. The device range is live, borrowed
                // uniquely, and records the copy below.
                unsafe {
                    ffi::copy_once(
                        range.address as *mut std::ffi::c_void,
                        src.as_ptr().cast(),
                        bytes,
                        Direction::HostToDevice,
                        stream.as_raw(),
                    )
                }
                // A capture another thread began meanwhile is reported, if not prevented.
                .and_then(|()| stream.refuse_capture())
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
            && ffi::is_pageable(host.as_ptr().cast())
    }

    /// Whether uploads of the sizes in [`StagingConfig::driver_uploads`] take the driver's
    /// own path: not on a device that reads pageable memory itself, nor where the driver's
    /// call did not return with the source read when checked (once per device and process,
    /// as the first stager was made).
    pub fn driver_uploads_taken(&self) -> bool {
        self.driver_paths.uploads
    }

    /// Whether downloads of the sizes in [`StagingConfig::driver_downloads`] take the
    /// driver's own path: as [`driver_uploads_taken`](Self::driver_uploads_taken), for a call
    /// that must return with the destination filled (the check downloads what it uploaded,
    /// so it passes only where uploads pass too).
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
        stream.enqueue(|stream| {
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
                    ffi::copy_once(
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
#[derive(Debug)]
#[must_use = "the DMA may still be running; `wait` for it or order work after `event`"]
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

mod driver_check;
#[cfg(test)]
mod tests;

/// Cuts `bytes` into pieces (offset, length), in order, each at most a chunk. On one thread:
/// whole chunks, the fewest calls. Spread: about two pieces per thread, the first and last
/// `threads` of them a quarter of that (but at least `min_piece_bytes`), so that the DMA
/// engine starts on the first piece early and the last wave leaves a short tail.
fn cut(bytes: usize, config: &StagingConfig, spread: bool) -> Vec<(usize, usize)> {
    let chunk = config.chunk_bytes;
    let smallest = config.min_piece_bytes.clamp(1, chunk);
    let (edge, middle) = if spread {
        let middle = (bytes / (2 * config.threads)).clamp(smallest, chunk);
        ((middle / 4).max(smallest), middle)
    } else {
        (chunk, chunk)
    };
    let edges = if spread { config.threads } else { 0 };
    let mut cuts = Vec::with_capacity(bytes / middle + 2 * edges + 1);
    let mut offset = 0;
    // The tail's small pieces are cut from the end, so they come out whole.
    let tail = (edges * edge).min(bytes / 2);
    while offset < bytes {
        let left = bytes - offset;
        let size = if cuts.len() < edges || left <= tail {
            edge
        } else {
            middle.min(left - tail)
        };
        let size = size.min(left);
        cuts.push((offset, size));
        offset += size;
    }
    cuts
}

/// How long an idle worker watches for the next job before it sleeps: waking a sleeping
/// thread takes tens of microseconds on a virtual machine, a piece of a copy about as long.
const SPIN: std::time::Duration = std::time::Duration::from_micros(200);

/// Uploads of at least this size fill their upload slot with non-temporal stores (see
/// [`StagingConfig::streaming_stores`]).
const STREAMING_SLOT_BYTES: usize = 32 << 10;

/// What the engine needs from a device: CUDA, or a fake in the tests.
pub(crate) trait Dma: Send + Sync + 'static {
    type Stream: Clone + Send + Sync;
    type Event: Send + Sync;

    fn event(&self) -> Result<Self::Event>;

    /// Queues a copy of `bytes` between `host` and the device address `device`.
    ///
    /// # Safety
    ///
    /// `host` is valid for the copy (read for host → device, written for device → host) and
    /// the device range too, until the copy has finished.
    unsafe fn queue(
        &self,
        stream: &Self::Stream,
        host: *mut u8,
        device: u64,
        bytes: usize,
        direction: Direction,
    ) -> Result<()>;

    fn record(&self, event: &Self::Event, stream: &Self::Stream) -> Result<()>;
    fn wait(&self, event: &Self::Event) -> Result<()>;
    /// Whether the event's work is known to have finished, without asking the device.
    fn seen_finished(&self, event: &Self::Event) -> bool;
    /// Whether the event's work has finished, asking the device.
    fn finished(&self, event: &Self::Event) -> Result<bool>;
    fn wait_stream(&self, stream: &Self::Stream) -> Result<()>;
    /// The device the copies go to.
    fn device(&self) -> i32;
    /// Makes that device current on one of the engine's own threads.
    fn use_device(&self) -> Result<()>;
}

/// The CUDA runtime, on one device.
pub(crate) struct Cuda {
    device: Device,
}

impl Dma for Cuda {
    type Stream = Stream;
    type Event = Event;

    fn event(&self) -> Result<Event> {
        Event::untimed_on(self.device)
    }

    unsafe fn queue(
        &self,
        stream: &Stream,
        host: *mut u8,
        device: u64,
        bytes: usize,
        direction: Direction,
    ) -> Result<()> {
        let device = device as *mut std::ffi::c_void;
        let (dst, src) = match direction {
            Direction::HostToDevice => (device, host.cast_const().cast()),
            Direction::DeviceToHost => (host.cast(), device.cast_const()),
        };
        // SAFETY: forwarded from the caller; the stream is live while borrowed.
        unsafe { ffi::memcpy_async(dst, src, bytes, direction, stream.as_raw()) }
    }

    fn record(&self, event: &Event, stream: &Stream) -> Result<()> {
        event.record_shared(stream)?;
        // A capture begun on the stream (by another thread) since the copy was checked took
        // in the piece and this event: the engine then loses the chunk.
        stream.refuse_capture()
    }

    fn wait(&self, event: &Event) -> Result<()> {
        event.synchronize()
    }

    fn seen_finished(&self, event: &Event) -> bool {
        event.seen_finished()
    }

    fn finished(&self, event: &Event) -> Result<bool> {
        event.query()
    }

    fn wait_stream(&self, stream: &Stream) -> Result<()> {
        stream.synchronize()
    }

    fn device(&self) -> i32 {
        self.device.raw()
    }

    fn use_device(&self) -> Result<()> {
        self.device.set_current()
    }
}

/// One chunk of the ring (its offset in the ring's memory) and the event after its last DMA.
struct Slot<D: Dma> {
    offset: usize,
    event: D::Event,
    /// The event is known to have completed (the last piece waited for it): the next piece
    /// skips the wait.
    settled: bool,
}

/// A slot for small uploads (its offset in the ring's memory) and the event that ended its
/// last upload, shared with whoever tracks that upload.
struct UploadSlot<D: Dma> {
    offset: usize,
    ended: Option<Arc<D::Event>>,
}

/// The upload slots not in use, the least recently used first; a slot whose copy could not be
/// accounted for is lost (and the ring's memory then leaked, not freed).
struct UploadSlots<D: Dma> {
    free: VecDeque<UploadSlot<D>>,
    lost: bool,
}

/// An upload slot out of the free list: given back with the event that frees it, or else
/// lost when dropped (an error or a panic left its copy unaccounted for).
struct TakenUploadSlot<'a, D: Dma> {
    slots: &'a Mutex<UploadSlots<D>>,
    slot: Option<UploadSlot<D>>,
}

impl<D: Dma> TakenUploadSlot<'_, D> {
    fn give_back(mut self, ended: Option<Arc<D::Event>>) {
        if let Some(mut slot) = self.slot.take() {
            slot.ended = ended;
            lock(self.slots).free.push_back(slot);
        }
    }
}

impl<D: Dma> Drop for TakenUploadSlot<'_, D> {
    fn drop(&mut self) {
        if self.slot.take().is_some() {
            lock(self.slots).lost = true;
        }
    }
}

/// The free chunks, and how many exist: a chunk whose DMA could not be accounted for after a
/// device error is never reused (and the ring's memory is then leaked, not freed).
struct Ring<D: Dma> {
    free: VecDeque<Slot<D>>,
    live: usize,
    lost: bool,
}

struct Queue<D: Dma> {
    jobs: VecDeque<Arc<Job<D>>>,
    shutdown: bool,
}

struct Shared<D: Dma> {
    dma: D,
    config: StagingConfig,
    /// The ring's memory (owned by the engine, which outlives every use).
    base: Address,
    ring: Mutex<Ring<D>>,
    slot_freed: Condvar,
    queue: Mutex<Queue<D>>,
    job_posted: Condvar,
    /// Jobs posted so far: a worker that just finished watches it for a moment before
    /// sleeping, so a program copying in a loop finds its workers awake.
    posts: AtomicUsize,
}

/// The staging engine over a device `D`: the ring, the workers, the job queue.
pub(crate) struct Engine<D: Dma, A: PinnedAllocator> {
    shared: Arc<Shared<D>>,
    workers: Vec<JoinHandle<()>>,
    /// The device current at construction: the ring's events and the workers' device.
    device: i32,
    upload_slots: Mutex<UploadSlots<D>>,
    /// Dropped (or leaked) after the workers have stopped and every chunk's DMA has ended.
    memory: ManuallyDrop<PinnedVec<u8, A>>,
}

/// One copy, cut into pieces that any thread may take.
struct Job<D: Dma> {
    direction: Direction,
    /// The host side: dereferenced only for pieces taken before the caller has seen every
    /// piece finish.
    host: Address,
    device: u64,
    /// Each piece's offset and length, in order.
    cuts: Vec<(usize, usize)>,
    /// Takes the newest free chunk (a copy of one piece on the calling thread: the chunk is
    /// still in the CPU's caches) rather than the oldest.
    newest_chunk: bool,
    pieces: usize,
    stream: D::Stream,
    next: AtomicUsize,
    finished: Mutex<usize>,
    all_finished: Condvar,
    failed: AtomicBool,
    error: Mutex<Option<Error>>,
}

/// Host memory shared with the copy threads.
struct Address(*mut u8);

// SAFETY: an address alone; who may read or write through it is argued at each use (the
// ring's chunks are handed out one thread at a time, a job's host range in disjoint pieces).
unsafe impl Send for Address {}
// SAFETY: as above.
unsafe impl Sync for Address {}

/// An empty list with room for `len` entries, or [`Error::OutOfMemory`].
fn list_with_room<T>(len: usize) -> Result<VecDeque<T>> {
    let mut list = VecDeque::new();
    list.try_reserve_exact(len)
        .map_err(|_| Error::OutOfMemory {
            requested: len.saturating_mul(size_of::<T>()),
        })?;
    Ok(list)
}

fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    // Nothing panics while these locks are held; a poisoned lock holds consistent data.
    mutex.lock().unwrap_or_else(PoisonError::into_inner)
}

fn wait<'a, T>(condvar: &Condvar, guard: MutexGuard<'a, T>) -> MutexGuard<'a, T> {
    condvar.wait(guard).unwrap_or_else(PoisonError::into_inner)
}

impl<D: Dma> Job<D> {
    fn take(&self) -> Option<usize> {
        let index = self.next.fetch_add(1, Ordering::Relaxed);
        (index < self.pieces).then_some(index)
    }

    fn exhausted(&self) -> bool {
        self.next.load(Ordering::Relaxed) >= self.pieces
    }

    fn fail(&self, error: Error) {
        lock(&self.error).get_or_insert(error);
        self.failed.store(true, Ordering::Relaxed);
    }

    fn finish_piece(&self) {
        let mut finished = lock(&self.finished);
        *finished += 1;
        if *finished == self.pieces {
            self.all_finished.notify_all();
        }
    }

    fn wait_finished(&self) {
        let mut finished = lock(&self.finished);
        while *finished < self.pieces {
            finished = wait(&self.all_finished, finished);
        }
    }
}

/// Counts a taken piece as finished when dropped, whatever path the piece took; a piece left
/// by a panic fails its job.
struct PieceGuard<'a, D: Dma>(&'a Job<D>);

impl<D: Dma> Drop for PieceGuard<'_, D> {
    fn drop(&mut self) {
        if std::thread::panicking() {
            self.0
                .fail(Error::Unsupported("a staging copy thread panicked"));
        }
        self.0.finish_piece();
    }
}

/// A chunk out of the ring: given back, or else lost when dropped (an error or a panic left
/// its DMA unknown).
struct Taken<'a, D: Dma> {
    shared: &'a Shared<D>,
    slot: Option<Slot<D>>,
}

impl<D: Dma> Taken<'_, D> {
    fn give_back(mut self) {
        if let Some(slot) = self.slot.take() {
            self.shared.give_back(slot);
        }
    }
}

impl<D: Dma> Drop for Taken<'_, D> {
    fn drop(&mut self) {
        if let Some(slot) = self.slot.take() {
            self.shared.lose(slot);
        }
    }
}

/// Aborts the process if dropped while unwinding: the caller of a copy must not return, by a
/// panic either, while other threads may still touch its buffer.
struct AbortOnUnwind;

impl Drop for AbortOnUnwind {
    fn drop(&mut self) {
        if std::thread::panicking() {
            std::process::abort();
        }
    }
}

impl<D: Dma, A: PinnedAllocator> Engine<D, A> {
    pub(crate) fn new(dma: D, config: StagingConfig, allocator: A) -> Result<Self> {
        if config.chunk_bytes == 0 || config.threads == 0 || config.slots == 0 {
            return Err(Error::Unsupported(
                "a staging configuration needs at least one byte per chunk, one thread \
                 and one slot",
            ));
        }
        if config.threads > StagingConfig::MAX_THREADS {
            return Err(Error::Unsupported(
                "a staging configuration may have at most `StagingConfig::MAX_THREADS` threads",
            ));
        }
        let mut ranges = config.driver_uploads.iter().chain(&config.driver_downloads);
        if ranges.any(|range| range.start() > range.end() || *range.end() > MAX_DRIVER_BYTES) {
            return Err(Error::Unsupported(
                "a staging configuration's driver sizes must each end at or after their start, \
                 and at most at 4 MiB (the largest size at which the driver's paths are checked)",
            ));
        }
        let ring_bytes = config
            .chunk_bytes
            .checked_mul(config.slots)
            .ok_or(Error::CapacityOverflow)?;
        let bytes = config
            .upload_slot_bytes
            .checked_mul(config.upload_slots)
            .and_then(|slots| slots.checked_add(ring_bytes))
            .ok_or(Error::CapacityOverflow)?;
        // The memory first: a configuration with more slots than the machine can hold fails
        // here, before the slots' lists are made.
        let mut memory = PinnedVec::with_capacity_in(bytes, allocator)?;
        let upload_count = if config.upload_slot_bytes == 0 {
            0
        } else {
            config.upload_slots
        };
        let mut upload_slots = list_with_room(upload_count)?;
        upload_slots.extend((0..upload_count).map(|i| UploadSlot {
            offset: ring_bytes + i * config.upload_slot_bytes,
            ended: None,
        }));
        let mut free = list_with_room(config.slots)?;
        for i in 0..config.slots {
            free.push_back(Slot {
                offset: i * config.chunk_bytes,
                event: dma.event()?,
                settled: true,
            });
        }
        let device = dma.device();
        let shared = Arc::new(Shared {
            dma,
            base: Address(memory.as_mut_ptr()),
            ring: Mutex::new(Ring {
                live: free.len(),
                free,
                lost: false,
            }),
            config,
            slot_freed: Condvar::new(),
            queue: Mutex::new(Queue {
                jobs: VecDeque::new(),
                shutdown: false,
            }),
            job_posted: Condvar::new(),
            posts: AtomicUsize::new(0),
        });
        // Workers that cannot start (or cannot use the device) leave more work to the others
        // and the callers.
        let workers = (1..shared.config.threads)
            .map_while(|index| {
                let shared = shared.clone();
                std::thread::Builder::new()
                    .name(format!("pinned-staging-{index}"))
                    .spawn(move || {
                        if shared.dma.use_device().is_ok() {
                            shared.work(index);
                        }
                    })
                    .ok()
            })
            .collect();
        Ok(Self {
            shared,
            workers,
            device,
            upload_slots: Mutex::new(UploadSlots {
                free: upload_slots,
                lost: false,
            }),
            memory: ManuallyDrop::new(memory),
        })
    }

    /// Copies `bytes` between `host` and the device address `device` on `stream`; returns
    /// when every piece has been copied on the host side (host → device: queued behind it).
    ///
    /// # Safety
    ///
    /// `host` is valid for `bytes` (read for host → device, written for device → host) until
    /// this returns, and nobody else writes it meanwhile (or reads it, device → host); the
    /// device range is valid for the copy until it finishes on `stream`.
    pub(crate) unsafe fn run(
        &self,
        direction: Direction,
        host: *mut u8,
        device: u64,
        bytes: usize,
        stream: &D::Stream,
    ) -> Result<()> {
        if bytes == 0 {
            return Ok(());
        }
        let config = &self.shared.config;
        let spread = bytes > config.single_thread_bytes && !self.workers.is_empty();
        let cuts = cut(bytes, config, spread);
        let pieces = cuts.len();
        let helpers = if spread {
            self.workers.len().min(pieces - 1)
        } else {
            0
        };
        let job = Arc::new(Job {
            direction,
            host: Address(host),
            device,
            cuts,
            newest_chunk: helpers == 0 && pieces == 1,
            pieces,
            stream: stream.clone(),
            next: AtomicUsize::new(0),
            finished: Mutex::new(0),
            all_finished: Condvar::new(),
            failed: AtomicBool::new(false),
            error: Mutex::new(None),
        });
        if helpers > 0 {
            {
                // Counted under the lock: a worker checks the count under it before sleeping.
                let mut queue = lock(&self.shared.queue);
                queue.jobs.push_back(job.clone());
                self.shared.posts.fetch_add(1, Ordering::Release);
            }
            for _ in 0..helpers {
                self.shared.job_posted.notify_one();
            }
        }
        let unwinding = AbortOnUnwind;
        while let Some(index) = job.take() {
            self.shared.copy_piece(&job, index);
        }
        job.wait_finished();
        drop(unwinding);
        if helpers > 0 {
            lock(&self.shared.queue)
                .jobs
                .retain(|queued| !Arc::ptr_eq(queued, &job));
        }
        match lock(&job.error).take() {
            Some(error) => Err(error),
            None => Ok(()),
        }
    }
}

impl<D: Dma, A: PinnedAllocator> Engine<D, A> {
    /// Uploads `bytes` from `host` through an upload slot, on the calling thread, when the
    /// size fits a slot and one is ready; `None` (nothing done) otherwise. `end` runs once
    /// the slot's copy is queued: it records on `stream` the event that ends the upload
    /// (tracking whatever else the caller tracks by it), which then also frees the slot.
    ///
    /// # Safety
    ///
    /// `host` is readable for `bytes` during the call, and the device range is valid for the
    /// copy until it finishes on `stream`.
    pub(crate) unsafe fn upload_in_slot(
        &self,
        host: *const u8,
        device: u64,
        bytes: usize,
        stream: &D::Stream,
        end: impl FnOnce() -> Result<Arc<D::Event>>,
    ) -> Option<Result<Arc<D::Event>>> {
        if bytes == 0 || bytes > self.shared.config.upload_slot_bytes {
            return None;
        }
        let taken = TakenUploadSlot {
            slots: &self.upload_slots,
            slot: Some(self.take_upload_slot()?),
        };
        let offset = taken.slot.as_ref().expect("taken").offset;
        let dma = &self.shared.dma;
        let memory = self.shared.base.0.wrapping_add(offset);
        // SAFETY: `host` is readable for `bytes` (the caller's contract); the slot is this
        // thread's alone (taken from the free list), its last copy has finished, it holds
        // `upload_slot_bytes` ≥ `bytes`, and it is disjoint from `host`, which is not ours.
        unsafe {
            if self.shared.config.streaming_stores && bytes >= STREAMING_SLOT_BYTES {
                copy_bytes_streaming(host, memory, bytes);
            } else {
                std::ptr::copy_nonoverlapping(host, memory, bytes);
            }
        }
        // SAFETY: the slot stays allocated and untouched until the event `end` records has
        // finished (or, after an error, until the stream has been waited for); the device
        // range is valid per the caller's contract.
        let ended = unsafe { dma.queue(stream, memory, device, bytes, Direction::HostToDevice) }
            .and_then(|()| end());
        match ended {
            Ok(event) => {
                taken.give_back(Some(event.clone()));
                Some(Ok(event))
            }
            Err(error) => {
                // A copy may be queued that no event covers. One that a capture took in may
                // run at any launch of its graph: the slot is lost (dropped while taken)
                // without waiting for the stream, which would break the capture.
                if !matches!(error, Error::Capturing) && dma.wait_stream(stream).is_ok() {
                    taken.give_back(None);
                }
                Some(Err(error))
            }
        }
    }

    /// A free upload slot whose last copy has finished: the most recently used of those
    /// known to have (its memory likely still in the CPU's caches), else the least recently
    /// used if one query finds its copy finished.
    fn take_upload_slot(&self) -> Option<UploadSlot<D>> {
        let dma = &self.shared.dma;
        let mut slots = lock(&self.upload_slots);
        let known = slots.free.iter().rposition(|slot| {
            slot.ended
                .as_ref()
                .is_none_or(|event| dma.seen_finished(event))
        });
        let index = match known {
            Some(index) => index,
            None => {
                let event = slots.free.front()?.ended.as_ref()?;
                if !matches!(dma.finished(event), Ok(true)) {
                    return None;
                }
                0
            }
        };
        slots.free.remove(index)
    }
}

impl<D: Dma> Shared<D> {
    /// A worker (on the engine's device): takes pieces of the queued jobs (worker `index`
    /// starts on job `index % jobs`, so concurrent copies share the workers) until shutdown.
    fn work(&self, index: usize) {
        loop {
            let seen = self.posts.load(Ordering::Acquire);
            let queued = {
                let mut queue = lock(&self.queue);
                if queue.shutdown {
                    return;
                }
                queue.jobs.retain(|job| !job.exhausted());
                (!queue.jobs.is_empty()).then(|| queue.jobs[index % queue.jobs.len()].clone())
            };
            let Some(job) = queued else {
                self.idle(seen);
                continue;
            };
            while let Some(piece) = job.take() {
                self.copy_piece(&job, piece);
            }
        }
    }

    /// Waits for a job posted after `seen` (or shutdown): watching for a moment, then asleep.
    fn idle(&self, seen: usize) {
        let watch = std::time::Instant::now();
        while watch.elapsed() < SPIN {
            if self.posts.load(Ordering::Acquire) != seen {
                return;
            }
            std::hint::spin_loop();
        }
        let queue = lock(&self.queue);
        if self.posts.load(Ordering::Acquire) == seen && !queue.shutdown {
            drop(wait(&self.job_posted, queue));
        }
    }

    /// Copies piece `index` of `job` through a chunk of the ring.
    fn copy_piece(&self, job: &Job<D>, index: usize) {
        let _finished = PieceGuard(job);
        if job.failed.load(Ordering::Relaxed) {
            return;
        }
        let mut taken = match self.take_slot(job.newest_chunk) {
            Ok(slot) => Taken {
                shared: self,
                slot: Some(slot),
            },
            Err(error) => return job.fail(error),
        };
        let slot = taken.slot.as_mut().expect("taken");
        // The chunk's previous DMA must be over before it is written or refilled; if that
        // cannot be known, the chunk is never used again (`taken` loses it when dropped).
        if !slot.settled
            && let Err(error) = self.dma.wait(&slot.event)
        {
            return job.fail(error);
        }
        slot.settled = job.direction == Direction::DeviceToHost;
        let (offset, bytes) = job.cuts[index];
        let host = job.host.0.wrapping_add(offset);
        let chunk = self.base.0.wrapping_add(slot.offset);
        let device = job.device + offset as u64;
        let moved = match job.direction {
            Direction::HostToDevice => {
                // SAFETY: the caller of `run` keeps the host range readable until every
                // piece has finished; the chunk is this thread's alone (taken from the free
                // list) and its previous DMA is over; both are `bytes` long and disjoint.
                unsafe { std::ptr::copy_nonoverlapping(host.cast_const(), chunk, bytes) };
                // SAFETY: the chunk stays allocated and untouched until its event, recorded
                // next, has completed; the device range is valid per `run`'s contract.
                unsafe {
                    self.dma
                        .queue(&job.stream, chunk, device, bytes, job.direction)
                }
                .and_then(|()| self.dma.record(&slot.event, &job.stream))
            }
            Direction::DeviceToHost => {
                // SAFETY: as above; the chunk is written by the DMA only.
                unsafe {
                    self.dma
                        .queue(&job.stream, chunk, device, bytes, job.direction)
                }
                .and_then(|()| self.dma.record(&slot.event, &job.stream))
                .and_then(|()| self.dma.wait(&slot.event))
                .map(|()| {
                    // SAFETY: the DMA into the chunk has finished; the host range is
                    // writable and this piece's alone until every piece has finished.
                    unsafe {
                        if self.config.streaming_stores {
                            copy_bytes_streaming(chunk.cast_const(), host, bytes);
                        } else {
                            std::ptr::copy_nonoverlapping(chunk.cast_const(), host, bytes);
                        }
                    }
                })
            }
        };
        match moved {
            Ok(()) => taken.give_back(),
            Err(error) => {
                // A copy may be queued that the chunk's event does not cover. One that a
                // capture took in may run at any launch of its graph: the chunk is lost
                // without waiting for the stream, which would break the capture.
                if !matches!(error, Error::Capturing) && self.dma.wait_stream(&job.stream).is_ok() {
                    taken.give_back();
                }
                job.fail(error);
            }
        }
    }

    /// A free chunk, waiting while all are taken: the oldest (the likeliest to have finished
    /// its DMA), or the newest (still in the CPU's caches; for a small copy on one thread,
    /// whose DMA is usually over since small copies are waited for).
    fn take_slot(&self, newest: bool) -> Result<Slot<D>> {
        let mut ring = lock(&self.ring);
        loop {
            let slot = if newest {
                ring.free.pop_back()
            } else {
                ring.free.pop_front()
            };
            if let Some(slot) = slot {
                return Ok(slot);
            }
            if ring.live == 0 {
                return Err(Error::Unsupported(
                    "every chunk of the staging ring was lost to device errors",
                ));
            }
            ring = wait(&self.slot_freed, ring);
        }
    }

    fn give_back(&self, slot: Slot<D>) {
        lock(&self.ring).free.push_back(slot);
        self.slot_freed.notify_one();
    }

    fn lose(&self, slot: Slot<D>) {
        let mut ring = lock(&self.ring);
        ring.live -= 1;
        ring.lost = true;
        drop(ring);
        drop(slot);
        self.slot_freed.notify_all();
    }
}

impl<D: Dma, A: PinnedAllocator> Drop for Engine<D, A> {
    fn drop(&mut self) {
        lock(&self.shared.queue).shutdown = true;
        self.shared.job_posted.notify_all();
        for worker in self.workers.drain(..) {
            if let Err(payload) = worker.join() {
                // A panic's payload may panic when dropped: leaked.
                std::mem::forget(payload);
            }
        }
        // No thread uses the ring now; its memory goes once every chunk's and every upload
        // slot's last DMA is over.
        let dma = &self.shared.dma;
        let ring = lock(&self.shared.ring);
        let uploads = lock(&self.upload_slots);
        let settled = !ring.lost
            && !uploads.lost
            && ring.free.iter().all(|slot| dma.wait(&slot.event).is_ok())
            && uploads.free.iter().all(|slot| {
                slot.ended
                    .as_ref()
                    .is_none_or(|event| dma.wait(event).is_ok())
            });
        drop((ring, uploads));
        if settled {
            // SAFETY: dropped once, here; no DMA or thread uses the memory any more.
            unsafe { ManuallyDrop::drop(&mut self.memory) };
        }
    }
}
