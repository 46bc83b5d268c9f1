//! The reader's ring: the engine's ring of chunks, each with room for a piece and the
//! scratch of aligned reads around it (a page before and after).

use std::ops::Deref;

use cuda_pinned::ring::{Dma, Ring};

use crate::error::Result;
use crate::file::DIRECT_ALIGN;

/// A ring for pieces read from files, and the memory it lies in.
pub(crate) struct ReadRing<D: Dma> {
    ring: Ring<D>,
    /// The most bytes a piece holds.
    capacity: usize,
    /// The chunks it was made with.
    count: usize,
    /// The most bytes one thread reads of a piece through the page cache.
    pub(super) part: usize,
    /// The allocation (dropped once every chunk's copies are known to be over).
    memory: Option<Box<dyn Send + Sync>>,
}

impl<D: Dma> ReadRing<D> {
    /// The bytes of memory a ring of `count` chunks for pieces of `capacity` bytes needs,
    /// with room to align its start.
    pub(crate) fn bytes_for(capacity: usize, count: usize) -> Option<usize> {
        capacity
            .checked_add(2 * DIRECT_ALIGN)?
            .checked_mul(count)?
            .checked_add(DIRECT_ALIGN)
    }

    /// A ring of `count` chunks for pieces of `capacity` bytes (a multiple of
    /// [`DIRECT_ALIGN`]) in `memory`, which it keeps, from its first aligned byte `start` on.
    ///
    /// # Safety
    ///
    /// `start` is page-locked memory of `memory`'s, valid for
    /// [`bytes_for`](Self::bytes_for) bytes, used by nothing else.
    pub(crate) unsafe fn new(
        dma: D,
        start: *mut u8,
        capacity: usize,
        count: usize,
        memory: Box<dyn Send + Sync>,
    ) -> Result<Self> {
        let base = start.wrapping_add(start.align_offset(DIRECT_ALIGN));
        debug_assert!(capacity.is_multiple_of(DIRECT_ALIGN));
        // SAFETY: `count` chunks of `capacity + 2 * DIRECT_ALIGN` bytes from the aligned
        // start lie in the `bytes_for` bytes, which are page-locked and used by nothing else
        // (the caller's contract); the memory goes with the ring, and only once it settled
        // (else never: see `Drop`).
        let ring = unsafe { Ring::new(dma, base, capacity + 2 * DIRECT_ALIGN, count) }?;
        Ok(Self {
            ring,
            capacity,
            count,
            part: capacity,
            memory: Some(memory),
        })
    }

    /// The ring, with pieces read through the page cache in parts of at most `bytes` bytes
    /// (at least one), each by a thread of its own (by default, a piece is one part).
    pub(crate) fn read_in_parts_of(mut self, bytes: usize) -> Self {
        self.part = bytes.max(1);
        self
    }

    /// The most bytes one piece may hold.
    pub(crate) fn capacity(&self) -> usize {
        self.capacity
    }

    /// The pinned memory the ring holds.
    pub(crate) fn pinned_bytes(&self) -> usize {
        Self::bytes_for(self.capacity, self.count).unwrap_or(usize::MAX)
    }
}

impl<D: Dma> Deref for ReadRing<D> {
    type Target = Ring<D>;

    fn deref(&self) -> &Ring<D> {
        &self.ring
    }
}

impl<D: Dma> Drop for ReadRing<D> {
    fn drop(&mut self) {
        if !self.ring.settle() {
            // Copies out of it may still run: the memory is never given back.
            std::mem::forget(self.memory.take());
        }
    }
}
