//! The pinned memory batches are made in: slots of one region per field, recycled between the
//! workers, the consumer's batches and the uploads.

use std::sync::{Arc, Mutex, PoisonError};

use cuda_pinned::{HostBuffer, PendingUses, Transfer};
use pinned_pool::Pool;

use crate::arena::{Arena, Part};

/// One field's pinned region of a slot: ready for the host, still being read by an upload,
/// given back by a user's copy that may still run, or lost (to a failed upload; made anew when
/// the slot is next filled).
pub(crate) enum Region {
    Ready(Part),
    Uploading(Transfer<Part>),
    Released(Released),
    Lost,
}

/// The pinned memory one batch is made in: a region per field, each with room for a full
/// batch. Slots are made before the first batch and recycled, so the hot path pins nothing.
pub(crate) struct Slot {
    pub(crate) regions: Vec<Region>,
}

impl Slot {
    /// `count` slots of zeroed regions of `bytes[k]` each, all from one pinned allocation
    /// (zeroed on up to `threads` threads).
    pub(crate) fn many(
        pool: &Arc<Pool>,
        bytes: &[usize],
        count: usize,
        threads: usize,
    ) -> cuda_pinned::Result<Vec<Self>> {
        let sizes: Vec<usize> = (0..count).flat_map(|_| bytes.iter().copied()).collect();
        let mut parts = Arena::parts(pool, &sizes, threads)?.into_iter();
        Ok((0..count)
            .map(|_| Self {
                regions: parts
                    .by_ref()
                    .take(bytes.len())
                    .map(Region::Ready)
                    .collect(),
            })
            .collect())
    }

    /// One slot, pinned on its own.
    pub(crate) fn new(pool: &Arc<Pool>, bytes: &[usize]) -> cuda_pinned::Result<Self> {
        let mut slots = Self::many(pool, bytes, 1, 1)?;
        Ok(slots.pop().expect("one slot was made"))
    }

    /// The regions, each `bytes[k]` long, once every upload from them has finished. A region
    /// whose upload cannot be waited for (the device failed) is lost, and a new one pinned;
    /// the lost one's block is then never given back (it may still be read), and with it
    /// every slot made alongside.
    pub(crate) fn ready(
        &mut self,
        pool: &Arc<Pool>,
        bytes: &[usize],
    ) -> cuda_pinned::Result<Vec<&mut [u8]>> {
        for (region, &full) in self.regions.iter_mut().zip(bytes) {
            let part = match std::mem::replace(region, Region::Lost) {
                Region::Ready(part) => Some(part),
                Region::Uploading(upload) => upload.wait().ok(),
                Region::Released(released) => released.wait(),
                Region::Lost => None,
            };
            let mut part = match part {
                Some(part) => part,
                None => Arena::parts(pool, &[full], 1)?
                    .pop()
                    .expect("one part was made"),
            };
            // A short batch's upload sent less; the region is whole again.
            part.set_len(part.room());
            *region = Region::Ready(part);
        }
        Ok(self
            .regions
            .iter_mut()
            .map(|region| match region {
                Region::Ready(part) => part.as_mut_slice(),
                _ => unreachable!("every region was made ready above"),
            })
            .collect())
    }
}

/// Free slots, shared by the workers, the consumer's batches and the uploads.
#[derive(Default)]
pub(crate) struct SlotPool {
    free: Mutex<Vec<Slot>>,
}

impl SlotPool {
    pub(crate) fn take(&self) -> Option<Slot> {
        self.free
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .pop()
    }

    pub(crate) fn give(&self, slot: Slot) {
        self.free
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .push(slot);
    }

    /// Drops every free slot. The pool gets a block back, after any pending upload, once
    /// every slot cut from it is gone: batches still held keep theirs.
    pub(crate) fn clear(&self) {
        let slots = std::mem::take(&mut *self.free.lock().unwrap_or_else(PoisonError::into_inner));
        drop(slots);
    }
}

/// A region given back by a user's copy that may still use it. Waited for before the loader
/// writes it again; dropped unwaited (the slot dropped with its loader), it hands the uses to
/// the arena, which waits for them before its block goes back to the pool.
pub(crate) struct Released(pub(crate) Option<(Part, PendingUses)>);

impl Released {
    /// The part once the uses have ended; `None` (the uses handed to the arena) if waiting failed.
    fn wait(mut self) -> Option<Part> {
        let (part, uses) = self.0.take().expect("taken once");
        match uses.wait() {
            Ok(()) => Some(part),
            Err(_) => {
                part.release_after(uses);
                None
            }
        }
    }
}

impl Drop for Released {
    fn drop(&mut self) {
        if let Some((part, uses)) = self.0.take() {
            part.release_after(uses);
        }
    }
}
