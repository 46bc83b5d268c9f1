//! The chunks of a ring: free, taken by one thread, or lost.

use std::collections::VecDeque;
use std::sync::{Condvar, Mutex};

use super::{Dma, lock, wait};
use crate::error::{Error, Result};

/// A chunk of the ring: where it starts in the ring's memory, and the event of its last
/// copies.
pub struct Chunk<E> {
    offset: usize,
    event: E,
    pending: bool,
}

impl<E> Chunk<E> {
    /// Where the chunk starts, in bytes from the ring's first.
    pub fn offset(&self) -> usize {
        self.offset
    }

    /// The event recorded after the chunk's last copies.
    pub fn event(&self) -> &E {
        &self.event
    }

    /// Whether copies may have been queued out of (or into) the chunk since its event was
    /// last waited for: such a chunk is lost, never reused, if it is dropped while taken.
    pub fn pending(&self) -> bool {
        self.pending
    }

    /// Marks the chunk pending: copies out of (or into) it may be queued from now on.
    pub fn mark_pending(&mut self) {
        self.pending = true;
    }

    /// Marks the chunk settled: its copies are known to be over.
    ///
    /// # Safety
    ///
    /// No copy queued out of or into the chunk can still run (its event, or the stream it
    /// was recorded on, has been waited for): the chunk is then filled again, and the ring's
    /// memory freed once every chunk is settled.
    pub unsafe fn mark_settled(&mut self) {
        self.pending = false;
    }
}

/// The chunks not taken, and counts of the others.
struct Chunks<E> {
    free: VecDeque<Chunk<E>>,
    /// Chunks not lost (a chunk whose copies could not be accounted for is never reused).
    live: usize,
    /// Chunks whose contents wait, out of the free list, for other chunks to be filled first
    /// (see [`Ring::park`]).
    parked: usize,
    lost: bool,
}

/// The ring's memory, shared by the threads that take its chunks.
struct Base(*mut u8);

// SAFETY: an address alone, never dereferenced here: each chunk's bytes are used by the one
// thread that holds it taken (`Ring::new`'s contract), whichever thread that is.
unsafe impl Send for Base {}

// SAFETY: as above; sharing the ring hands out addresses, not access.
unsafe impl Sync for Base {}

/// A count of a ring's chunks ([`Ring::census`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Census {
    /// Chunks in the free list.
    pub free: usize,
    /// Chunks not lost.
    pub live: usize,
    /// Chunks parked (see [`Ring::park`]).
    pub parked: usize,
    /// Whether a chunk was lost.
    pub lost: bool,
}

/// Page-locked memory cut into chunks of the same size, each with an event.
///
/// The ring does not own its memory: its owner frees it once [`settle`](Self::settle) says no
/// copy can still use it, and leaks it otherwise.
pub struct Ring<D: Dma> {
    dma: D,
    /// The first chunk's first byte: a pointer, so that the chunks' addresses keep the
    /// memory's provenance.
    base: Base,
    chunk_bytes: usize,
    chunks: Mutex<Chunks<D::Event>>,
    freed: Condvar,
}

impl<D: Dma> Ring<D> {
    /// A ring of `count` chunks of `chunk_bytes` bytes, the first at `base`, with events
    /// from `dma`.
    ///
    /// # Errors
    ///
    /// [`Error::OutOfMemory`] for the list of chunks; the device's error making an event.
    ///
    /// # Safety
    ///
    /// `base` is page-locked memory valid for `count × chunk_bytes` bytes, used by nothing
    /// but the ring's takers, and freed only after [`settle`](Self::settle) returned `true`
    /// (or never).
    pub unsafe fn new(dma: D, base: *mut u8, chunk_bytes: usize, count: usize) -> Result<Self> {
        let mut free = VecDeque::new();
        free.try_reserve_exact(count)
            .map_err(|_| Error::OutOfMemory {
                requested: count.saturating_mul(size_of::<Chunk<D::Event>>()),
            })?;
        for i in 0..count {
            free.push_back(Chunk {
                offset: i * chunk_bytes,
                event: dma.event()?,
                pending: false,
            });
        }
        Ok(Self {
            dma,
            base: Base(base),
            chunk_bytes,
            chunks: Mutex::new(Chunks {
                free,
                live: count,
                parked: 0,
                lost: false,
            }),
            freed: Condvar::new(),
        })
    }

    /// The device.
    pub fn dma(&self) -> &D {
        &self.dma
    }

    /// Bytes of one chunk.
    pub fn chunk_bytes(&self) -> usize {
        self.chunk_bytes
    }

    /// The first byte of `chunk`.
    pub fn start_of(&self, chunk: &Chunk<D::Event>) -> *mut u8 {
        self.base.0.wrapping_add(chunk.offset)
    }

    /// The oldest free chunk (the likeliest to have finished its copies), waiting while every
    /// chunk is taken.
    ///
    /// # Errors
    ///
    /// [`Error::RingLost`] when every chunk was lost, or every one left waits for a chunk
    /// (see [`park`](Self::park)).
    pub fn take(&self) -> Result<Taken<'_, D>> {
        self.take_from(false)
    }

    /// As [`take`](Self::take), the newest free chunk: its memory is likely still in the
    /// CPU's caches, and its copies likely over where the last taker waited for them.
    ///
    /// # Errors
    ///
    /// As [`take`](Self::take).
    pub fn take_newest(&self) -> Result<Taken<'_, D>> {
        self.take_from(true)
    }

    fn take_from(&self, newest: bool) -> Result<Taken<'_, D>> {
        let mut chunks = lock(&self.chunks);
        loop {
            let chunk = if newest {
                chunks.free.pop_back()
            } else {
                chunks.free.pop_front()
            };
            if let Some(chunk) = chunk {
                return Ok(self.taken(chunk));
            }
            // Parked chunks wait for chunks to be filled: with every chunk left parked (the
            // others lost), none comes back.
            if chunks.live == 0 || chunks.parked >= chunks.live {
                return Err(Error::RingLost);
            }
            chunks = wait(&self.freed, chunks);
        }
    }

    /// The oldest free chunk, if one is free now.
    pub fn try_take(&self) -> Option<Taken<'_, D>> {
        let chunk = lock(&self.chunks).free.pop_front()?;
        Some(self.taken(chunk))
    }

    /// `chunk` in a guard again, out of the ring still.
    ///
    /// # Safety
    ///
    /// `chunk` was taken out of this ring ([`Taken::take_chunk`]), and is held nowhere else.
    pub unsafe fn hold(&self, chunk: Chunk<D::Event>) -> Taken<'_, D> {
        self.taken(chunk)
    }

    fn taken(&self, chunk: Chunk<D::Event>) -> Taken<'_, D> {
        Taken {
            ring: self,
            chunk: Some(chunk),
        }
    }

    /// Counts `count` more chunks parked (held out of the free list while other chunks are
    /// filled) if at most half the live chunks are then parked: the chunks they wait for
    /// must find chunks. `false`: none counted.
    pub fn park(&self, count: usize) -> bool {
        let mut chunks = lock(&self.chunks);
        let room = chunks.parked + count <= chunks.live / 2;
        if room {
            chunks.parked += count;
        }
        room
    }

    /// Counts `count` chunks no longer parked.
    pub fn unpark(&self, count: usize) {
        lock(&self.chunks).parked -= count;
    }

    fn give_back(&self, chunk: Chunk<D::Event>) {
        lock(&self.chunks).free.push_back(chunk);
        self.freed.notify_one();
    }

    fn lose(&self, chunk: Chunk<D::Event>) {
        let mut chunks = lock(&self.chunks);
        chunks.live -= 1;
        chunks.lost = true;
        drop(chunks);
        drop(chunk);
        self.freed.notify_all();
    }

    /// How many chunks are free, live (not lost) and parked, and whether one was lost.
    pub fn census(&self) -> Census {
        let chunks = lock(&self.chunks);
        Census {
            free: chunks.free.len(),
            live: chunks.live,
            parked: chunks.parked,
            lost: chunks.lost,
        }
    }

    /// Waits until no copy out of or into a free chunk can still run, and says whether the
    /// memory may go: `false` if a chunk was lost or a wait failed (copies may still run).
    /// Called by the owner once nobody takes chunks any more.
    pub fn settle(&self) -> bool {
        let chunks = lock(&self.chunks);
        !chunks.lost
            && (chunks.free.iter())
                .all(|chunk| !chunk.pending || self.dma.wait(&chunk.event).is_ok())
    }
}

/// A chunk out of the ring, one thread's alone: given back, or else, when dropped, given
/// back if no copy of it can be running and lost (never reused) if one may be.
pub struct Taken<'a, D: Dma> {
    ring: &'a Ring<D>,
    chunk: Option<Chunk<D::Event>>,
}

impl<'a, D: Dma> Taken<'a, D> {
    /// Whether the guard still holds its chunk (it was not given back or taken out).
    pub fn is_held(&self) -> bool {
        self.chunk.is_some()
    }

    /// The chunk.
    pub fn chunk(&self) -> &Chunk<D::Event> {
        self.chunk.as_ref().expect("held until given back")
    }

    /// The chunk, to mark it pending or not.
    pub fn chunk_mut(&mut self) -> &mut Chunk<D::Event> {
        self.chunk.as_mut().expect("held until given back")
    }

    /// The first byte of the chunk.
    pub fn start(&self) -> *mut u8 {
        self.ring.start_of(self.chunk())
    }

    /// Waits for the chunk's last copies if they may be pending, so that it can be filled.
    ///
    /// # Errors
    ///
    /// The wait's: the chunk stays pending (lost when dropped).
    pub fn settle(&mut self) -> Result<()> {
        let chunk = self.chunk.as_mut().expect("held until given back");
        if chunk.pending {
            self.ring.dma.wait(&chunk.event)?;
            chunk.pending = false;
        }
        Ok(())
    }

    /// Records the chunk's event on `stream` after the copies queued out of it there.
    ///
    /// # Errors
    ///
    /// The device's (the chunk stays pending).
    pub fn record(&self, stream: &D::Stream) -> Result<()> {
        self.ring.dma.record(&self.chunk().event, stream)
    }

    /// Gives the chunk back to the ring (whatever its copies: their event guards it); the
    /// guard is then empty.
    pub fn give_back(&mut self) {
        if let Some(chunk) = self.chunk.take() {
            self.ring.give_back(chunk);
        }
    }

    /// Loses the chunk: it is never reused (its copies cannot be accounted for); the guard is
    /// then empty.
    pub fn lose(&mut self) {
        if let Some(chunk) = self.chunk.take() {
            self.ring.lose(chunk);
        }
    }

    /// The chunk out of its guard, still out of the ring (parked: [`Ring::hold`] guards it
    /// again, or it is never reused); the guard is then empty.
    pub fn take_chunk(&mut self) -> Chunk<D::Event> {
        self.chunk.take().expect("held until given back")
    }
}

impl<D: Dma> Drop for Taken<'_, D> {
    fn drop(&mut self) {
        if let Some(chunk) = self.chunk.take() {
            if chunk.pending {
                self.ring.lose(chunk);
            } else {
                self.ring.give_back(chunk);
            }
        }
    }
}
