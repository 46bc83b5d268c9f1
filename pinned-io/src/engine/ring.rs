//! The ring: page-locked memory cut into chunks, which the crew's threads take, fill, and
//! give back once the chunk's copies are queued behind its event.

use std::collections::VecDeque;
use std::sync::{Condvar, Mutex, PoisonError};

use super::{Dma, lock};
use crate::error::{Error, Result};
use crate::file::DIRECT_ALIGN;

/// A chunk of the ring, and the event of its last copies.
pub(super) struct Chunk<E> {
    pub(super) offset: usize,
    pub(super) event: E,
    /// Whether copies were queued since the event was last waited for.
    pub(super) pending: bool,
}

/// The chunks not taken, and counts of the others.
pub(super) struct Chunks<E> {
    pub(super) free: VecDeque<Chunk<E>>,
    /// Chunks not lost (a chunk whose copies could not be accounted for is never reused).
    pub(super) live: usize,
    /// Chunks whose pieces are parked by their jobs (see [`Job::queue`](super::Job::queue)).
    pub(super) parked: usize,
    pub(super) lost: bool,
}

/// The ring: page-locked memory cut into chunks, each with room for a piece and the scratch
/// of aligned reads around it (a page before and after).
pub(crate) struct Ring<D: Dma> {
    pub(crate) dma: D,
    pub(super) base: usize,
    /// The most bytes a piece holds.
    capacity: usize,
    /// The chunks it was made with.
    count: usize,
    /// The most bytes one thread reads of a piece through the page cache.
    pub(super) part: usize,
    pub(super) chunks: Mutex<Chunks<D::Event>>,
    freed: Condvar,
    /// The allocation (dropped once every chunk's copies are known to be over).
    memory: Option<Box<dyn Send + Sync>>,
}

impl<D: Dma> Ring<D> {
    /// The bytes of memory a ring of `count` chunks for pieces of `capacity` bytes needs,
    /// with room to align its start.
    pub(crate) fn bytes_for(capacity: usize, count: usize) -> Option<usize> {
        capacity
            .checked_add(2 * DIRECT_ALIGN)?
            .checked_mul(count)?
            .checked_add(DIRECT_ALIGN)
    }

    /// A ring of `count` chunks for pieces of `capacity` bytes (a multiple of
    /// [`DIRECT_ALIGN`]) in `memory`, which it keeps, from its first aligned byte `start` on
    /// ([`bytes_for`](Self::bytes_for) bytes from `start`'s allocation).
    pub(crate) fn new(
        dma: D,
        start: *mut u8,
        capacity: usize,
        count: usize,
        memory: Box<dyn Send + Sync>,
    ) -> Result<Self> {
        let base = start.wrapping_add(start.align_offset(DIRECT_ALIGN));
        debug_assert!(capacity.is_multiple_of(DIRECT_ALIGN));
        let stride = capacity + 2 * DIRECT_ALIGN;
        let mut free = VecDeque::with_capacity(count);
        for i in 0..count {
            free.push_back(Chunk {
                offset: i * stride,
                event: dma.event()?,
                pending: false,
            });
        }
        Ok(Self {
            dma,
            base: base as usize,
            capacity,
            count,
            part: capacity,
            chunks: Mutex::new(Chunks {
                free,
                live: count,
                parked: 0,
                lost: false,
            }),
            freed: Condvar::new(),
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

    pub(super) fn take(&self) -> Result<Chunk<D::Event>> {
        let mut chunks = lock(&self.chunks);
        loop {
            if let Some(chunk) = chunks.free.pop_front() {
                return Ok(chunk);
            }
            if chunks.live == 0 {
                return Err(Error::Invalid(
                    "every chunk of the reader's ring was lost to device errors".into(),
                ));
            }
            // Parked chunks wait for pieces that need a chunk: with every chunk left parked
            // (the others lost), none comes back.
            if chunks.parked >= chunks.live {
                return Err(Error::Invalid(
                    "every chunk of the reader's ring was lost to device errors or waits for a \
                     piece that needs one"
                        .into(),
                ));
            }
            chunks = self
                .freed
                .wait(chunks)
                .unwrap_or_else(PoisonError::into_inner);
        }
    }

    /// A free chunk, if one is free now.
    pub(super) fn try_take(&self) -> Option<Chunk<D::Event>> {
        lock(&self.chunks).free.pop_front()
    }

    /// Counts `count` more chunks parked if at most half the live chunks are then parked, by
    /// every job together: the pieces that parked chunks wait for must find chunks.
    pub(super) fn park(&self, count: usize) -> bool {
        let mut chunks = lock(&self.chunks);
        let room = chunks.parked + count <= chunks.live / 2;
        if room {
            chunks.parked += count;
        }
        room
    }

    /// Counts `count` chunks no longer parked.
    pub(super) fn unpark(&self, count: usize) {
        lock(&self.chunks).parked -= count;
    }

    pub(super) fn give_back(&self, chunk: Chunk<D::Event>) {
        lock(&self.chunks).free.push_back(chunk);
        self.freed.notify_one();
    }

    pub(super) fn lose(&self, chunk: Chunk<D::Event>) {
        let mut chunks = lock(&self.chunks);
        chunks.live -= 1;
        chunks.lost = true;
        drop(chunks);
        drop(chunk);
        self.freed.notify_all();
    }
}

impl<D: Dma> Drop for Ring<D> {
    fn drop(&mut self) {
        let chunks = lock(&self.chunks);
        let settled = !chunks.lost
            && chunks
                .free
                .iter()
                .all(|chunk| !chunk.pending || self.dma.wait(&chunk.event).is_ok());
        drop(chunks);
        if !settled {
            // Copies out of it may still run: the memory is never given back.
            std::mem::forget(self.memory.take());
        }
    }
}
