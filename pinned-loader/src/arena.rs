//! `Arena`: the pinned memory of many slots as one pool allocation, cut into parts.
//!
//! Pinning costs a fixed fraction of a millisecond per registration on top of its cost per
//! byte, and the driver serialises registrations: a loader's working set pinned as one block
//! is ready several times sooner than as one block per region.

use std::mem::{ManuallyDrop, MaybeUninit};
use std::sync::{Arc, Mutex, PoisonError};

use cuda_pinned::{HostBuffer, PendingUses, PinnedVec};
use pinned_pool::Pool;

/// Parts start at multiples of this, so every field's elements are aligned.
const ALIGN: usize = 4096;

/// One pool allocation, reached only through its [`Part`]s.
pub(crate) struct Arena {
    /// Never resized, read or written through after construction: the parts own its bytes.
    /// Dropped once no copy can read it any more, or leaked.
    memory: ManuallyDrop<PinnedVec<u8, Arc<Pool>>>,
    base: *mut u8,
    /// Device work that may still read parts given up without waiting for it.
    pending: Mutex<Vec<PendingUses>>,
}

// SAFETY: the arena's bytes are reached only through parts, each owning a disjoint range
// (see `Part`); the pointer itself is plain data, and the rest is `Send + Sync`.
unsafe impl Send for Arena {}
// SAFETY: as above.
unsafe impl Sync for Arena {}

impl Drop for Arena {
    fn drop(&mut self) {
        // Every part is gone; a copy some of them gave up on may still read the memory. It
        // goes back to the pool after those copies, or is leaked when that cannot be known.
        let pending = self
            .pending
            .get_mut()
            .unwrap_or_else(PoisonError::into_inner);
        if pending.iter().all(|uses| uses.wait().is_ok()) {
            // SAFETY: dropped once, here; no part and no copy uses the memory any more.
            unsafe { ManuallyDrop::drop(&mut self.memory) };
        }
    }
}

/// A range of an arena, owned: the only way to its bytes. Its length is at most its room
/// (an upload of a short batch sends fewer bytes).
pub(crate) struct Part {
    arena: Arc<Arena>,
    offset: usize,
    room: usize,
    len: usize,
}

impl Arena {
    /// Zeroed parts of `sizes[k]` bytes each, from one allocation of `pool`, zeroed on up to
    /// `threads` threads.
    pub(crate) fn parts(
        pool: &Arc<Pool>,
        sizes: &[usize],
        threads: usize,
    ) -> cuda_pinned::Result<Vec<Part>> {
        let mut offsets = Vec::with_capacity(sizes.len());
        let mut total = 0usize;
        for &size in sizes {
            offsets.push(total);
            total = size
                .checked_next_multiple_of(ALIGN)
                .and_then(|room| total.checked_add(room))
                .ok_or(cuda_pinned::Error::CapacityOverflow)?;
        }
        let mut memory = PinnedVec::with_capacity_in(total, pool.clone())?;
        zero(&mut memory.spare_capacity_mut()[..total], threads);
        // SAFETY: the first `total` bytes were just written, and the capacity holds them.
        unsafe { memory.set_len(total) };
        let base = memory.as_mut_ptr();
        let arena = Arc::new(Arena {
            memory: ManuallyDrop::new(memory),
            base,
            pending: Mutex::new(Vec::new()),
        });
        Ok(offsets
            .into_iter()
            .zip(sizes)
            .map(|(offset, &room)| Part {
                arena: arena.clone(),
                offset,
                room,
                len: room,
            })
            .collect())
    }
}

/// Writes zeroes over `bytes` on up to `threads` threads (pinned memory is written at the
/// memory's speed only by several), in pieces of 1 MiB taken in turn.
fn zero(bytes: &mut [MaybeUninit<u8>], threads: usize) {
    const PIECE: usize = 1 << 20;
    let threads = threads.min(bytes.len().div_ceil(PIECE));
    let pieces = Mutex::new(bytes.chunks_mut(PIECE));
    let work = || {
        loop {
            let piece = pieces.lock().unwrap_or_else(PoisonError::into_inner).next();
            match piece {
                Some(piece) => piece.fill(MaybeUninit::new(0)),
                None => return,
            }
        }
    };
    std::thread::scope(|scope| {
        // Threads that cannot start leave their pieces to the others.
        for _ in 1..threads {
            let _ = std::thread::Builder::new().spawn_scoped(scope, work);
        }
        work();
    });
}

impl Part {
    /// The bytes it has room for.
    pub(crate) fn room(&self) -> usize {
        self.room
    }

    /// Sets the length an upload sends (at most the room).
    pub(crate) fn set_len(&mut self, len: usize) {
        self.len = len.min(self.room);
    }

    pub(crate) fn as_slice(&self) -> &[u8] {
        // SAFETY: `offset + len` lies inside the arena's initialised bytes, which this part
        // alone reaches, and the arena lives while the part does.
        unsafe { std::slice::from_raw_parts(self.arena.base.add(self.offset), self.len) }
    }

    pub(crate) fn as_mut_slice(&mut self) -> &mut [u8] {
        // SAFETY: as for `as_slice`, borrowed uniquely through `self`.
        unsafe { std::slice::from_raw_parts_mut(self.arena.base.add(self.offset), self.len) }
    }
}

// SAFETY: the part owns `len` initialised bytes of the arena's page-locked memory, disjoint
// from every other part's, on the heap (moving the part moves no bytes) and kept alive by the
// `Arc` it holds; nothing else reaches them. `release_after` hands the pending uses to the
// arena, which waits for them before its memory goes back to the pool (or leaks it).
unsafe impl HostBuffer for Part {
    type Elem = u8;

    fn host_parts(&mut self) -> (*mut u8, usize) {
        (self.as_mut_slice().as_mut_ptr(), self.len)
    }

    fn release_after(self, pending: PendingUses) {
        self.arena
            .pending
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .push(pending);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Parts are zeroed, page-aligned, disjoint and of their sizes; the pool gets its block
    /// back once the last part is gone.
    #[test]
    fn parts_are_disjoint_aligned_and_zeroed() {
        let pool = Arc::new(Pool::new());
        // Miri checks every byte: a smaller largest part there.
        let large = if cfg!(miri) { 12 << 10 } else { 3 << 20 };
        let sizes = [1, 4096, 5000, 0, large];
        let mut parts = Arena::parts(&pool, &sizes, 3).unwrap();
        assert_eq!(pool.stats().active_requests.current, 1);
        for (k, part) in parts.iter_mut().enumerate() {
            assert_eq!(part.room(), sizes[k]);
            assert_eq!(part.as_slice().len(), sizes[k]);
            assert_eq!(part.as_mut_slice().as_ptr() as usize % ALIGN, 0);
            assert!(part.as_slice().iter().all(|&b| b == 0));
            part.as_mut_slice().fill(k as u8 + 1);
        }
        for (k, part) in parts.iter().enumerate() {
            assert!(part.as_slice().iter().all(|&b| b == k as u8 + 1));
        }
        parts[2].set_len(10);
        assert_eq!(parts[2].as_slice().len(), 10);
        parts[2].set_len(usize::MAX);
        assert_eq!(parts[2].as_slice().len(), 5000);
        let last = parts.pop().unwrap();
        drop(parts);
        assert_eq!(pool.stats().active_requests.current, 1);
        drop(last);
        assert_eq!(pool.stats().active_requests.current, 0);
    }

    #[test]
    fn sizes_past_the_address_space_are_refused() {
        let pool = Arc::new(Pool::new());
        let result = Arena::parts(&pool, &[usize::MAX - 10], 1);
        assert!(matches!(result, Err(cuda_pinned::Error::CapacityOverflow)));
    }
}

#[cfg(test)]
mod released {
    use super::*;
    use crate::slot::{Region, Released, Slot};

    /// A slot dropped with a region a user's copy may still use (a loader dropped before the
    /// field buffers' copies ended) hands the copy's uses to the arena, which waits for them
    /// before its block goes back to the pool.
    #[test]
    fn dropping_a_slot_with_a_released_region_keeps_its_uses() {
        let pool = Arc::new(Pool::new());
        let mut parts = Arena::parts(&pool, &[4096, 4096], 1).unwrap();
        let keep = parts.pop().unwrap();
        let released = parts.pop().unwrap();
        let slot = Slot {
            regions: vec![Region::Released(Released(Some((
                released,
                PendingUses::none(),
            ))))],
        };
        drop(slot);
        let recorded = keep.arena.pending.lock().unwrap().len();
        assert_eq!(
            recorded, 1,
            "the released region's pending uses were dropped unwaited"
        );
    }
}
