//! Copies between ordinary (pageable) memory and the device at pinned speed: a ring of
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
//! most [`StagingConfig::single_thread_bytes`] runs on the calling thread alone.

use std::collections::VecDeque;
use std::mem::ManuallyDrop;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, PoisonError};
use std::thread::JoinHandle;

use bytemuck::{AnyBitPattern, NoUninit};

use crate::alloc::{DefaultPinned, PinnedAllocator};
use crate::device_buffer::{DeviceSlice, DeviceSliceMut};
use crate::error::{Error, Result};
use crate::ffi::{self, Direction};
use crate::stream::{Event, Stream};
use crate::vec::PinnedVec;

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
}

impl Default for StagingConfig {
    fn default() -> Self {
        let threads = std::thread::available_parallelism()
            .map_or(4, |n| n.get())
            .min(16);
        Self {
            chunk_bytes: 4 << 20,
            threads,
            slots: 2 * threads,
            single_thread_bytes: 1 << 20,
        }
    }
}

/// Copies between `&[T]` / `&mut [T]` in ordinary memory and device memory at page-locked
/// speed, through a ring of pinned chunks (from allocator `A`, a pool for instance)
/// and persistent copy threads. Share one stager between threads: calls from several threads
/// (both directions at once, on two streams) split the threads between them.
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
}

impl<A: PinnedAllocator> Stager<A> {
    /// A stager cutting copies as `config` says, its ring allocated from `allocator` now.
    ///
    /// # Errors
    ///
    /// [`Error::Unsupported`] for a configuration with zero chunk bytes, threads or slots;
    /// [`Error::Unavailable`] without CUDA; the allocator's error for the ring.
    pub fn with_config_in(config: StagingConfig, allocator: A) -> Result<Self> {
        Ok(Self {
            engine: Engine::new(Cuda, config, allocator)?,
        })
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
    /// the stream from the ring, and work queued on `stream` afterwards sees the data.
    ///
    /// # Errors
    ///
    /// [`Error::LengthMismatch`] when the lengths differ, or the CUDA error. After an error
    /// part of `dst` may have been written.
    pub fn copy_to_device<'d, T: NoUninit + 'd>(
        &self,
        stream: &Stream,
        src: &[T],
        dst: impl Into<DeviceSliceMut<'d, T>>,
    ) -> Result<StagedCopy> {
        let dst = dst.into();
        let range = dst.range;
        if range.len != src.len() {
            return Err(Error::LengthMismatch {
                host: src.len(),
                device: range.len,
            });
        }
        range.pending.order_before(stream)?;
        let bytes = size_of_val(src);
        // SAFETY: `src` is readable for `bytes` and borrowed until the engine returns, which
        // is after the last read of it; the device range is live, borrowed uniquely, and
        // records the copies below before its memory can be freed.
        let copied = unsafe {
            self.engine.run(
                Direction::HostToDevice,
                src.as_ptr().cast_mut().cast(),
                range.address,
                bytes,
                stream,
            )
        };
        let event = track(stream, |event| range.pending.track(stream, event));
        copied?;
        Ok(StagedCopy { event: event? })
    }

    /// Copies `src` (a [`DeviceBuffer`](crate::DeviceBuffer) or a view of one) into `dst` on
    /// `stream`, after the work queued there before, and returns once `dst` is filled.
    ///
    /// # Errors
    ///
    /// [`Error::LengthMismatch`] when the lengths differ, or the CUDA error. After an error
    /// part of `dst` may have been written.
    pub fn copy_from_device<'d, T: AnyBitPattern + 'd>(
        &self,
        stream: &Stream,
        src: impl Into<DeviceSlice<'d, T>>,
        dst: &mut [T],
    ) -> Result<()> {
        let range = src.into().range;
        if range.len != dst.len() {
            return Err(Error::LengthMismatch {
                host: dst.len(),
                device: range.len,
            });
        }
        range.pending.order_before(stream)?;
        let bytes = size_of_val(dst);
        // SAFETY: `dst` is writable for `bytes`, borrowed uniquely until the engine returns
        // (after its last write), and any bytes are a valid `T`; the device range is live and
        // records the reads below before its memory can be freed.
        let copied = unsafe {
            self.engine.run(
                Direction::DeviceToHost,
                dst.as_mut_ptr().cast(),
                range.address,
                bytes,
                stream,
            )
        };
        let tracked = track(stream, |event| range.pending.track(stream, event));
        copied.and(tracked.map(drop))
    }
}

/// Records the end of a staged copy's device work on `stream` for `keep`; when no event can
/// be recorded, waits for the stream instead, so the device range is never freed early.
fn track(stream: &Stream, keep: impl FnOnce(Arc<Event>)) -> Result<Arc<Event>> {
    match stream.record_event_untimed() {
        Ok(event) => {
            let event = Arc::new(event);
            keep(event.clone());
            Ok(event)
        }
        Err(error) => {
            stream.synchronize()?;
            Err(error)
        }
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

#[cfg(test)]
mod tests;

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
    fn wait_stream(&self, stream: &Self::Stream) -> Result<()>;
    fn current_device(&self) -> Result<i32>;
    fn set_device(&self, device: i32) -> Result<()>;
}

/// The CUDA runtime.
pub(crate) struct Cuda;

impl Dma for Cuda {
    type Stream = Stream;
    type Event = Event;

    fn event(&self) -> Result<Event> {
        Event::untimed()
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
        event.record(stream)
    }

    fn wait(&self, event: &Event) -> Result<()> {
        event.synchronize()
    }

    fn wait_stream(&self, stream: &Stream) -> Result<()> {
        stream.synchronize()
    }

    fn current_device(&self) -> Result<i32> {
        ffi::current_device()
    }

    fn set_device(&self, device: i32) -> Result<()> {
        ffi::set_device(device)
    }
}

/// One chunk of the ring (its offset in the ring's memory) and the event after its last DMA.
struct Slot<D: Dma> {
    offset: usize,
    event: D::Event,
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
}

/// The staging engine over a device `D`: the ring, the workers, the job queue.
pub(crate) struct Engine<D: Dma, A: PinnedAllocator> {
    shared: Arc<Shared<D>>,
    workers: Vec<JoinHandle<()>>,
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
    bytes: usize,
    piece: usize,
    pieces: usize,
    stream: D::Stream,
    device_ordinal: i32,
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

/// Counts a taken piece as finished when dropped, whatever path the piece took.
struct PieceGuard<'a, D: Dma>(&'a Job<D>);

impl<D: Dma> Drop for PieceGuard<'_, D> {
    fn drop(&mut self) {
        self.0.finish_piece();
    }
}

impl<D: Dma, A: PinnedAllocator> Engine<D, A> {
    pub(crate) fn new(dma: D, config: StagingConfig, allocator: A) -> Result<Self> {
        if config.chunk_bytes == 0 || config.threads == 0 || config.slots == 0 {
            return Err(Error::Unsupported(
                "a staging configuration needs at least one byte per chunk, one thread and one slot",
            ));
        }
        let bytes = config
            .chunk_bytes
            .checked_mul(config.slots)
            .ok_or(Error::CapacityOverflow)?;
        let free = (0..config.slots)
            .map(|i| {
                Ok(Slot {
                    offset: i * config.chunk_bytes,
                    event: dma.event()?,
                })
            })
            .collect::<Result<VecDeque<_>>>()?;
        let mut memory = PinnedVec::with_capacity_in(bytes, allocator)?;
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
        });
        // Workers that cannot start leave more work to the others and the callers.
        let workers = (1..shared.config.threads)
            .map_while(|index| {
                let shared = shared.clone();
                std::thread::Builder::new()
                    .name(format!("pinned-staging-{index}"))
                    .spawn(move || shared.work(index))
                    .ok()
            })
            .collect();
        Ok(Self {
            shared,
            workers,
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
        let (piece, helpers) = if bytes <= config.single_thread_bytes || self.workers.is_empty() {
            (config.chunk_bytes, 0)
        } else {
            // Enough pieces for every thread, none larger than a chunk.
            let piece = bytes
                .div_ceil(config.threads)
                .max(64 << 10)
                .min(config.chunk_bytes);
            (piece, self.workers.len())
        };
        let pieces = bytes.div_ceil(piece);
        let job = Arc::new(Job {
            direction,
            host: Address(host),
            device,
            bytes,
            piece,
            pieces,
            stream: stream.clone(),
            device_ordinal: if helpers > 0 {
                self.shared.dma.current_device()?
            } else {
                0
            },
            next: AtomicUsize::new(0),
            finished: Mutex::new(0),
            all_finished: Condvar::new(),
            failed: AtomicBool::new(false),
            error: Mutex::new(None),
        });
        let helpers = helpers.min(pieces - 1);
        if helpers > 0 {
            lock(&self.shared.queue).jobs.push_back(job.clone());
            for _ in 0..helpers {
                self.shared.job_posted.notify_one();
            }
        }
        while let Some(index) = job.take() {
            self.shared.copy_piece(&job, index);
        }
        job.wait_finished();
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

impl<D: Dma> Shared<D> {
    /// A worker: takes pieces of the queued jobs (worker `index` starts on job
    /// `index % jobs`, so concurrent copies share the workers) until shutdown.
    fn work(&self, index: usize) {
        let mut device = None;
        loop {
            let job = {
                let mut queue = lock(&self.queue);
                loop {
                    if queue.shutdown {
                        return;
                    }
                    queue.jobs.retain(|job| !job.exhausted());
                    if !queue.jobs.is_empty() {
                        break queue.jobs[index % queue.jobs.len()].clone();
                    }
                    queue = wait(&self.job_posted, queue);
                }
            };
            if device != Some(job.device_ordinal) {
                if let Err(error) = self.dma.set_device(job.device_ordinal) {
                    job.fail(error);
                    continue;
                }
                device = Some(job.device_ordinal);
            }
            while let Some(piece) = job.take() {
                self.copy_piece(&job, piece);
            }
        }
    }

    /// Copies piece `index` of `job` through a chunk of the ring.
    fn copy_piece(&self, job: &Job<D>, index: usize) {
        let _finished = PieceGuard(job);
        if job.failed.load(Ordering::Relaxed) {
            return;
        }
        let slot = match self.take_slot() {
            Ok(slot) => slot,
            Err(error) => return job.fail(error),
        };
        // The chunk's previous DMA must be over before it is written or refilled; if that
        // cannot be known, the chunk is never used again.
        if let Err(error) = self.dma.wait(&slot.event) {
            self.lose(slot);
            return job.fail(error);
        }
        let offset = index * job.piece;
        let bytes = job.piece.min(job.bytes - offset);
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
                    unsafe { std::ptr::copy_nonoverlapping(chunk.cast_const(), host, bytes) }
                })
            }
        };
        match moved {
            Ok(()) => self.give_back(slot),
            Err(error) => {
                // A copy may be queued that the chunk's event does not cover.
                if self.dma.wait_stream(&job.stream).is_ok() {
                    self.give_back(slot);
                } else {
                    self.lose(slot);
                }
                job.fail(error);
            }
        }
    }

    /// The oldest free chunk (the likeliest to have finished its DMA); waits while all are
    /// taken.
    fn take_slot(&self) -> Result<Slot<D>> {
        let mut ring = lock(&self.ring);
        loop {
            if let Some(slot) = ring.free.pop_front() {
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
            let _ = worker.join();
        }
        // No thread uses the ring now; its memory goes once every chunk's last DMA is over.
        let ring = lock(&self.shared.ring);
        let settled = !ring.lost
            && ring
                .free
                .iter()
                .all(|slot| self.shared.dma.wait(&slot.event).is_ok());
        drop(ring);
        if settled {
            // SAFETY: dropped once, here; no DMA or thread uses the memory any more.
            unsafe { ManuallyDrop::drop(&mut self.memory) };
        }
    }
}
