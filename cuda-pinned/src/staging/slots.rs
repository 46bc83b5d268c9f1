//! The upload slots beside the ring: small uploads, each copied into a slot of its own and
//! sent from there, freed by the event that ends it.

use std::collections::VecDeque;
use std::sync::{Arc, Mutex};

use crate::error::{Error, Result};
use crate::ring::{Dma, lock};

/// A slot for small uploads (its offset in the ring's memory) and the event that ended its
/// last upload, shared with whoever tracks that upload.
pub(super) struct UploadSlot<D: Dma> {
    pub(super) offset: usize,
    pub(super) ended: Option<Arc<D::Event>>,
}

/// The upload slots not in use, the least recently used first; a slot whose copy could not be
/// accounted for is lost (and the ring's memory then leaked, not freed).
pub(super) struct UploadSlots<D: Dma> {
    pub(super) free: VecDeque<UploadSlot<D>>,
    pub(super) lost: bool,
}

/// An upload slot out of the free list: given back with the event that frees it, or else
/// lost when dropped (an error or a panic left its copy unaccounted for).
pub(super) struct TakenUploadSlot<'a, D: Dma> {
    pub(super) slots: &'a Mutex<UploadSlots<D>>,
    pub(super) slot: Option<UploadSlot<D>>,
}

impl<D: Dma> TakenUploadSlot<'_, D> {
    pub(super) fn give_back(mut self, ended: Option<Arc<D::Event>>) {
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

/// Host memory shared with the copy threads.
pub(super) struct Address(pub(super) *mut u8);

// SAFETY: an address alone; who may read or write through it is argued at each use (the
// ring's chunks are handed out one thread at a time, a job's host range in disjoint pieces).
unsafe impl Send for Address {}

// SAFETY: as above.
unsafe impl Sync for Address {}

/// An empty list with room for `len` entries, or [`Error::OutOfMemory`].
pub(super) fn list_with_room<T>(len: usize) -> Result<VecDeque<T>> {
    let mut list = VecDeque::new();
    list.try_reserve_exact(len)
        .map_err(|_| Error::OutOfMemory {
            requested: len.saturating_mul(size_of::<T>()),
        })?;
    Ok(list)
}
