//! `HostBatch`: a batch in pinned memory, and the slots batches are made in.

use std::ops::Range;
use std::sync::{Arc, Mutex, PoisonError};

use cuda_pinned::Transfer;
use pinned_pool::Pool;

use crate::arena::{Arena, Part};
use crate::fields::Fields;

/// One field's pinned region of a slot: ready for the host, still being read by an upload,
/// or lost to a failed upload (made anew when the slot is next filled).
pub(crate) enum Region {
    Ready(Part),
    Uploading(Transfer<Part>),
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

/// A batch in pinned memory, as a loader delivers it: read its fields with
/// [`fields`](Self::fields); dropping it gives its memory back to the loader for a later batch.
///
/// Its memory is part of the loader's one pinned block: a batch kept after its loader is dropped
/// keeps that whole block from going back to the pool.
pub struct HostBatch<F: Fields> {
    pub(crate) slot: Option<Slot>,
    pub(crate) len: usize,
    pub(crate) index: usize,
    /// The epoch's order, and this batch's range of it: shared, not copied per batch.
    pub(crate) order: Arc<Vec<usize>>,
    pub(crate) range: Range<usize>,
    pub(crate) fields: F,
    pub(crate) sample_bytes: Arc<[usize]>,
    pub(crate) home: Arc<SlotPool>,
}

impl<F: Fields> HostBatch<F> {
    /// Samples in the batch (the last of an epoch may be short).
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether the batch has no samples.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The batch's number in its epoch.
    pub fn index(&self) -> usize {
        self.index
    }

    /// The dataset indices of the batch's samples, in the order the batch holds them.
    ///
    /// Sample `j` of every field is dataset sample `indices()[j]`: with shuffling, sharding
    /// or batches out of order, this is what the batch was trained on.
    pub fn indices(&self) -> &[usize] {
        &self.order[self.range.clone()]
    }

    /// The fields: for `(Field<u8>, Field<i64>)`, `(&[u8], &[i64])` of `len` samples each.
    pub fn fields(&self) -> F::Host<'_> {
        let slot = self.slot.as_ref().expect("a delivered batch has its slot");
        let mut regions = slot.regions.iter().zip(self.sample_bytes.iter()).map(
            |(region, &bytes)| match region {
                Region::Ready(part) => &part.as_slice()[..self.len * bytes],
                _ => unreachable!("a delivered batch is ready"),
            },
        );
        self.fields.host(&mut regions)
    }

    /// Takes the slot out (the batch then gives nothing back when dropped).
    pub(crate) fn into_slot(mut self) -> Slot {
        self.slot.take().expect("a delivered batch has its slot")
    }
}

impl<F: Fields> Drop for HostBatch<F> {
    fn drop(&mut self) {
        if let Some(slot) = self.slot.take() {
            self.home.give(slot);
        }
    }
}

impl<F: Fields> std::fmt::Debug for HostBatch<F> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HostBatch")
            .field("index", &self.index)
            .field("len", &self.len)
            .finish_non_exhaustive()
    }
}
