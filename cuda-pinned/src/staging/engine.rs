//! The staging engine: the ring, its workers and their job queue.

use std::collections::VecDeque;
use std::mem::ManuallyDrop;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;

use super::config::StagingConfig;
use super::dma::Dma;
use super::driver_check::MAX_DRIVER_BYTES;
use super::job::{AbortOnUnwind, Job, PieceGuard, Queue, cut};
use super::ring::{Address, Chunk, Ring, TakenUploadSlot, UploadSlot, UploadSlots, list_with_room};
use super::{lock, wait};
use crate::containers::vec::PinnedVec;
use crate::copy::nontemporal::copy_bytes_streaming;
use crate::error::{Error, Result};
use crate::memory::allocator::PinnedAllocator;
use crate::raw::copy::Direction;

/// How long an idle worker watches for the next job before it sleeps: waking a sleeping
/// thread takes tens of microseconds on a virtual machine, a piece of a copy about as long.
const SPIN: std::time::Duration = std::time::Duration::from_micros(200);

/// Uploads of at least this size fill their upload slot with non-temporal stores (see
/// [`StagingConfig::streaming_stores`]).
const STREAMING_SLOT_BYTES: usize = 32 << 10;

/// Uploads through the ring of several pieces and at most this size fill its chunks with
/// non-temporal stores (see [`StagingConfig::streaming_stores`]): their copies into the
/// chunks then skip reading the chunks' old bytes first, which pays while the ring's pipeline
/// fills; the largest uploads ran faster with plain stores, which leave the chunks in the
/// CPU's caches for the DMA to read (`docs/tuning.md`).
const STREAMING_UPLOAD_BYTES: usize = 256 << 20;

pub(super) struct Shared<D: Dma> {
    pub(super) dma: D,
    pub(super) config: StagingConfig,
    /// The ring's memory (owned by the engine, which outlives every use).
    pub(super) base: Address,
    pub(super) ring: Mutex<Ring<D>>,
    pub(super) slot_freed: Condvar,
    pub(super) queue: Mutex<Queue<D>>,
    pub(super) job_posted: Condvar,
    /// Jobs posted so far: a worker that just finished watches it for a moment before
    /// sleeping, so a program copying in a loop finds its workers awake.
    pub(super) posts: AtomicUsize,
}

/// The staging engine over a device `D`: the ring, the workers, the job queue.
pub(crate) struct Engine<D: Dma, A: PinnedAllocator> {
    pub(super) shared: Arc<Shared<D>>,
    pub(super) workers: Vec<JoinHandle<()>>,
    /// The device current at construction: the ring's events and the workers' device.
    pub(super) device: i32,
    pub(super) upload_slots: Mutex<UploadSlots<D>>,
    /// Dropped (or leaked) after the workers have stopped and every chunk's DMA has ended.
    pub(super) memory: ManuallyDrop<PinnedVec<u8, A>>,
}

/// A chunk out of the ring: given back, or else lost when dropped (an error or a panic left
/// its DMA unknown).
pub(super) struct Taken<'a, D: Dma> {
    pub(super) shared: &'a Shared<D>,
    pub(super) slot: Option<Chunk<D>>,
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

/// Refuses a configuration the engine cannot work with.
fn check(config: &StagingConfig) -> Result<()> {
    if config.chunk_bytes == 0 || config.threads == 0 || config.chunks == 0 {
        return Err(Error::Unsupported(
            "a staging configuration needs at least one byte per chunk, one thread and one \
             chunk",
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
            "a staging configuration's driver sizes must each end at or after their start, and \
             at most at 4 MiB (the largest size at which the driver's paths are checked)",
        ));
    }
    Ok(())
}

/// Starts the workers, `threads - 1` of them; those that cannot start (or cannot use the
/// device) leave more work to the others and the callers.
fn start_workers<D: Dma>(shared: &Arc<Shared<D>>) -> Vec<JoinHandle<()>> {
    (1..shared.config.threads)
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
        .collect()
}

impl<D: Dma, A: PinnedAllocator> Engine<D, A> {
    pub(crate) fn new(dma: D, config: StagingConfig, allocator: A) -> Result<Self> {
        check(&config)?;
        let ring_bytes = config
            .chunk_bytes
            .checked_mul(config.chunks)
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
        let mut free = list_with_room(config.chunks)?;
        for i in 0..config.chunks {
            free.push_back(Chunk {
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
        let workers = start_workers(&shared);
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
            streaming: match direction {
                // One piece goes into the newest chunk, which the CPU's caches still hold:
                // plain stores keep it there.
                Direction::HostToDevice => {
                    config.streaming_stores && pieces > 1 && bytes <= STREAMING_UPLOAD_BYTES
                }
                Direction::DeviceToHost => config.streaming_stores,
            },
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
        // SAFETY: the caller of `run` keeps the host range valid (read for uploads, written
        // for downloads, this piece's alone) until every piece has finished; the chunk is this
        // thread's alone (taken from the free list), its previous DMA is over, and it stays
        // allocated until its event has completed; the device range is valid per `run`'s
        // contract; both sides are `bytes` long and disjoint.
        let moved = unsafe { self.move_piece(job, &slot.event, chunk, host, device, bytes) };
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

    /// Moves one piece between the host range at `host` and the device at `device` through
    /// `chunk`, whose DMA `event` records: host → chunk → device, or device → chunk (waited
    /// for) → host.
    ///
    /// # Safety
    ///
    /// - `host` is valid for `bytes` (read for an upload, written for a download) and this
    ///   piece's alone until the job's pieces have all finished;
    /// - `chunk` is `bytes` of the ring that only this thread uses, its previous DMA over,
    ///   and it stays allocated and untouched until `event` has completed;
    /// - `device` is device memory valid for the copy until it has finished.
    unsafe fn move_piece(
        &self,
        job: &Job<D>,
        event: &D::Event,
        chunk: *mut u8,
        host: *mut u8,
        device: u64,
        bytes: usize,
    ) -> Result<()> {
        match job.direction {
            Direction::HostToDevice => {
                // SAFETY: both are `bytes` long, disjoint, and ours (the contract).
                unsafe {
                    if job.streaming {
                        copy_bytes_streaming(host.cast_const(), chunk, bytes);
                    } else {
                        std::ptr::copy_nonoverlapping(host.cast_const(), chunk, bytes);
                    }
                }
                // SAFETY: the chunk stays untouched until its event, recorded next, has
                // completed; the device range is valid (the contract).
                unsafe {
                    self.dma
                        .queue(&job.stream, chunk, device, bytes, job.direction)
                }
                .and_then(|()| self.dma.record(event, &job.stream))
            }
            Direction::DeviceToHost => {
                // SAFETY: as above; the chunk is written by the DMA only.
                unsafe {
                    self.dma
                        .queue(&job.stream, chunk, device, bytes, job.direction)
                }
                .and_then(|()| self.dma.record(event, &job.stream))
                .and_then(|()| self.dma.wait(event))
                .map(|()| {
                    // SAFETY: the DMA into the chunk has finished; the host range is
                    // writable and this piece's alone (the contract).
                    unsafe {
                        if job.streaming {
                            copy_bytes_streaming(chunk.cast_const(), host, bytes);
                        } else {
                            std::ptr::copy_nonoverlapping(chunk.cast_const(), host, bytes);
                        }
                    }
                })
            }
        }
    }

    /// A free chunk, waiting while all are taken: the oldest (the likeliest to have finished
    /// its DMA), or the newest (still in the CPU's caches; for a small copy on one thread,
    /// whose DMA is usually over since small copies are waited for).
    fn take_slot(&self, newest: bool) -> Result<Chunk<D>> {
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

    fn give_back(&self, slot: Chunk<D>) {
        lock(&self.ring).free.push_back(slot);
        self.slot_freed.notify_one();
    }

    fn lose(&self, slot: Chunk<D>) {
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
