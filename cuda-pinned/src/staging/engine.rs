//! The stager's engine: copies cut into pieces that the ring's crew and the caller move
//! through the chunks, and the upload slots beside the ring.

use std::mem::ManuallyDrop;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex};

use super::config::StagingConfig;
use super::driver_check::MAX_DRIVER_BYTES;
use super::job::{AbortOnUnwind, Job, PieceGuard, cut};
use super::slots::{Address, TakenUploadSlot, UploadSlot, UploadSlots, list_with_room};
use crate::containers::vec::PinnedVec;
use crate::error::{Error, Result};
use crate::memory::allocator::PinnedAllocator;
use crate::nontemporal::copy_bytes_streaming;
use crate::raw::copy::Direction;
use crate::ring::{Crew, CrewConfig, Dma, Pick, Ring, RingCopy, Taken, Way, lock};

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

/// What the crew's threads share: the ring, and how copies are cut.
pub(crate) struct Copier<D: Dma> {
    pub(super) ring: Ring<D>,
    pub(super) config: StagingConfig,
}

/// The staging engine over a device `D`: the ring and its crew, the upload slots.
pub(crate) struct Engine<D: Dma, A: PinnedAllocator> {
    pub(super) crew: Crew<Copier<D>, Job<D>>,
    /// The device current at construction: the ring's events and the workers' device.
    pub(super) device: i32,
    /// The first upload slot's memory.
    slots_base: Address,
    pub(super) upload_slots: Mutex<UploadSlots<D>>,
    /// Dropped (or leaked) after the workers have stopped and every chunk's DMA has ended.
    pub(super) memory: ManuallyDrop<PinnedVec<u8, A>>,
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
        let threads = config.threads;
        let upload_count = if config.upload_slot_bytes == 0 {
            0
        } else {
            config.upload_slots
        };
        let mut upload_slots = list_with_room(upload_count)?;
        upload_slots.extend((0..upload_count).map(|i| UploadSlot {
            offset: i * config.upload_slot_bytes,
            ended: None,
        }));
        let device = dma.device();
        let base = memory.as_mut_ptr();
        // SAFETY: the first `ring_bytes` of the memory are the ring's (the slots lie after
        // them), page-locked; the memory is dropped only after the ring settled.
        let ring = unsafe { Ring::new(dma, base, config.chunk_bytes, config.chunks) }?;
        let crew = Crew::start(
            Copier { ring, config },
            CrewConfig {
                threads: threads - 1,
                name: "pinned-staging",
                pick: Pick::Spread,
                spin: SPIN,
            },
            |copier| copier.ring.dma().use_device().is_ok(),
        );
        Ok(Self {
            crew,
            device,
            slots_base: Address(base.wrapping_add(ring_bytes)),
            upload_slots: Mutex::new(UploadSlots {
                free: upload_slots,
                lost: false,
            }),
            memory: ManuallyDrop::new(memory),
        })
    }

    pub(super) fn config(&self) -> &StagingConfig {
        &self.crew.context().config
    }

    /// Worker threads running.
    pub(super) fn workers(&self) -> usize {
        self.crew.threads()
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
        let config = self.config();
        let workers = self.workers();
        let spread = bytes > config.single_thread_bytes && workers > 0;
        let cuts = cut(bytes, config, spread);
        let pieces = cuts.len();
        let helpers = if spread { workers.min(pieces - 1) } else { 0 };
        let way = match direction {
            Direction::HostToDevice => Way::Upload,
            Direction::DeviceToHost => Way::Download,
        };
        let job = Arc::new(Job {
            way,
            host: Address(host),
            device,
            cuts,
            newest_chunk: helpers == 0 && pieces == 1,
            streaming: match way {
                // One piece goes into the newest chunk, which the CPU's caches still hold:
                // plain stores keep it there.
                Way::Upload => {
                    config.streaming_stores && pieces > 1 && bytes <= STREAMING_UPLOAD_BYTES
                }
                Way::Download => config.streaming_stores,
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
            self.crew.post(&job, helpers);
        }
        let unwinding = AbortOnUnwind;
        let copier = self.crew.context();
        while let Some(index) = job.take() {
            copier.copy_piece(&job, index);
        }
        job.wait_finished();
        drop(unwinding);
        if helpers > 0 {
            self.crew.withdraw(&job);
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
        if bytes == 0 || bytes > self.config().upload_slot_bytes {
            return None;
        }
        let taken = TakenUploadSlot {
            slots: &self.upload_slots,
            slot: Some(self.take_upload_slot()?),
        };
        let offset = taken.slot.as_ref().expect("taken").offset;
        let dma = self.crew.context().ring.dma();
        let memory = self.slots_base.0.wrapping_add(offset);
        // SAFETY: `host` is readable for `bytes` (the caller's contract); the slot is this
        // thread's alone (taken from the free list), its last copy has finished, it holds
        // `upload_slot_bytes` ≥ `bytes`, and it is disjoint from `host`, which is not ours.
        unsafe {
            if self.config().streaming_stores && bytes >= STREAMING_SLOT_BYTES {
                copy_bytes_streaming(host, memory, bytes);
            } else {
                std::ptr::copy_nonoverlapping(host, memory, bytes);
            }
        }
        let copy = RingCopy::plain(memory, device, bytes);
        // SAFETY: the slot is page-locked, and stays allocated and untouched until the event
        // `end` records has finished (or, after an error, until the stream has been waited
        // for); the device range is valid per the caller's contract.
        let ended = unsafe { dma.queue(stream, &[copy], Way::Upload) }.and_then(|()| end());
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
        let dma = self.crew.context().ring.dma();
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

impl<D: Dma> Copier<D> {
    /// Copies piece `index` of `job` through a chunk of the ring.
    pub(super) fn copy_piece(&self, job: &Job<D>, index: usize) {
        let _finished = PieceGuard(job);
        if job.failed.load(Ordering::Relaxed) {
            return;
        }
        let taken = if job.newest_chunk {
            self.ring.take_newest()
        } else {
            self.ring.take()
        };
        let mut taken = match taken {
            Ok(taken) => taken,
            Err(error) => return job.fail(error),
        };
        // The chunk's previous DMA must be over before it is written or refilled; if that
        // cannot be known, the chunk is never used again (`taken` loses it when dropped).
        if let Err(error) = taken.settle() {
            return job.fail(error);
        }
        let (offset, bytes) = job.cuts[index];
        let host = job.host.0.wrapping_add(offset);
        let chunk = taken.start();
        let device = job.device + offset as u64;
        // From here on copies of the chunk may be queued: lost if dropped pending.
        taken.chunk_mut().mark_pending();
        // SAFETY: the caller of `run` keeps the host range valid (read for uploads, written
        // for downloads, this piece's alone) until every piece has finished; the chunk is this
        // thread's alone (taken from the free list), its previous DMA is over, and it stays
        // allocated until its event has completed; the device range is valid per `run`'s
        // contract; both sides are `bytes` long and disjoint.
        let moved = unsafe { self.move_piece(job, &taken, chunk, host, device, bytes) };
        match moved {
            Ok(settled) => {
                if settled {
                    // SAFETY: the download into the chunk was waited for (`move_piece`).
                    unsafe { taken.chunk_mut().mark_settled() };
                }
                taken.give_back();
            }
            Err(error) => {
                // A copy may be queued that the chunk's event does not cover. One that a
                // capture took in may run at any launch of its graph: the chunk is lost
                // without waiting for the stream, which would break the capture.
                if !matches!(error, Error::Capturing)
                    && self.ring.dma().wait_stream(&job.stream).is_ok()
                {
                    // SAFETY: the stream the piece's copy was queued on has finished its work.
                    unsafe { taken.chunk_mut().mark_settled() };
                }
                job.fail(error);
            }
        }
    }

    /// Moves one piece between the host range at `host` and the device at `device` through
    /// the `taken` chunk at `chunk`: host → chunk → device, or device → chunk (waited for) →
    /// host. Returns whether the chunk's copies are known to be over.
    ///
    /// # Safety
    ///
    /// - `host` is valid for `bytes` (read for an upload, written for a download) and this
    ///   piece's alone until the job's pieces have all finished;
    /// - `chunk` is `bytes` of the taken chunk, its previous DMA over, and it stays allocated
    ///   and untouched until its event has completed;
    /// - `device` is device memory valid for the copy until it has finished.
    unsafe fn move_piece(
        &self,
        job: &Job<D>,
        taken: &Taken<'_, D>,
        chunk: *mut u8,
        host: *mut u8,
        device: u64,
        bytes: usize,
    ) -> Result<bool> {
        let dma = self.ring.dma();
        let copy = [RingCopy::plain(chunk, device, bytes)];
        match job.way {
            Way::Upload => {
                // SAFETY: both are `bytes` long, disjoint, and ours (the contract).
                unsafe {
                    if job.streaming {
                        copy_bytes_streaming(host.cast_const(), chunk, bytes);
                    } else {
                        std::ptr::copy_nonoverlapping(host.cast_const(), chunk, bytes);
                    }
                }
                // SAFETY: the chunk is page-locked and stays untouched until its event,
                // recorded next, has completed; the device range is valid (the contract).
                unsafe { dma.queue(&job.stream, &copy, job.way) }?;
                taken.record(&job.stream)?;
                Ok(false)
            }
            Way::Download => {
                // SAFETY: as above; the chunk is written by the DMA only.
                unsafe { dma.queue(&job.stream, &copy, job.way) }?;
                taken.record(&job.stream)?;
                dma.wait(taken.chunk().event())?;
                // SAFETY: the DMA into the chunk has finished; the host range is writable
                // and this piece's alone (the contract).
                unsafe {
                    if job.streaming {
                        copy_bytes_streaming(chunk.cast_const(), host, bytes);
                    } else {
                        std::ptr::copy_nonoverlapping(chunk.cast_const(), host, bytes);
                    }
                }
                Ok(true)
            }
        }
    }
}

impl<D: Dma, A: PinnedAllocator> Drop for Engine<D, A> {
    fn drop(&mut self) {
        self.crew.stop();
        // No thread uses the ring now; its memory goes once every chunk's and every upload
        // slot's last DMA is over.
        let dma = self.crew.context().ring.dma();
        let ring_settled = self.crew.context().ring.settle();
        let uploads = lock(&self.upload_slots);
        let settled = ring_settled
            && !uploads.lost
            && uploads.free.iter().all(|slot| {
                slot.ended
                    .as_ref()
                    .is_none_or(|event| dma.wait(event).is_ok())
            });
        drop(uploads);
        if settled {
            // SAFETY: dropped once, here; no DMA or thread uses the memory any more.
            unsafe { ManuallyDrop::drop(&mut self.memory) };
        }
    }
}
