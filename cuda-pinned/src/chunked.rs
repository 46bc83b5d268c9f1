//! Buffers registered in chunks. CUDA refuses a copy that spans two registrations, so the
//! crate keeps the layout of every buffer it registered in pieces, and each copy it queues is
//! split where it crosses from one registration into the next. Copies queued by other code
//! (a raw pointer handed to another crate) are not split: they must stay inside one chunk.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{PoisonError, RwLock};

/// Buffers registered in chunks: start address → (bytes, chunk bytes). Registrations follow
/// one another from the start, `chunk` bytes each (the last may be shorter).
static BUFFERS: RwLock<BTreeMap<usize, (usize, usize)>> = RwLock::new(BTreeMap::new());
/// How many buffers `BUFFERS` holds: copies skip the lock while there are none.
static LIVE: AtomicUsize = AtomicUsize::new(0);

/// Records a buffer of `bytes` at `start`, registered in pieces of `chunk` bytes.
pub(crate) fn insert(start: usize, bytes: usize, chunk: usize) {
    let mut buffers = BUFFERS.write().unwrap_or_else(PoisonError::into_inner);
    if buffers.insert(start, (bytes, chunk)).is_none() {
        LIVE.fetch_add(1, Ordering::SeqCst);
    }
}

/// Forgets the buffer at `start`; its `(bytes, chunk)` if it was recorded.
pub(crate) fn remove(start: usize) -> Option<(usize, usize)> {
    let mut buffers = BUFFERS.write().unwrap_or_else(PoisonError::into_inner);
    let removed = buffers.remove(&start);
    if removed.is_some() {
        LIVE.fetch_sub(1, Ordering::SeqCst);
    }
    removed
}

/// Whether any buffer registered in chunks is alive (copies need not look otherwise).
pub(crate) fn any() -> bool {
    LIVE.load(Ordering::SeqCst) != 0
}

/// The pieces of `addr..addr + len` that each lie in one registration, as `(offset, len)`
/// from `addr`, in order; the whole range as one piece unless it lies in a chunked buffer.
pub(crate) fn pieces(addr: usize, len: usize) -> Pieces {
    let mut pieces = Pieces {
        addr,
        offset: 0,
        len,
        layout: None,
    };
    if !any() || len == 0 {
        return pieces;
    }
    let buffers = BUFFERS.read().unwrap_or_else(PoisonError::into_inner);
    if let Some((&start, &(bytes, chunk))) = buffers.range(..=addr).next_back()
        && addr - start < bytes
    {
        pieces.layout = Some((start, chunk));
    }
    pieces
}

/// Iterator of [`pieces`].
#[derive(Clone, Debug)]
pub(crate) struct Pieces {
    addr: usize,
    offset: usize,
    len: usize,
    /// `(start, chunk)` of the chunked buffer the range begins in.
    layout: Option<(usize, usize)>,
}

impl Iterator for Pieces {
    type Item = (usize, usize);

    fn next(&mut self) -> Option<(usize, usize)> {
        if self.offset >= self.len {
            return None;
        }
        let rest = self.len - self.offset;
        let piece = match self.layout {
            None => rest,
            Some((start, chunk)) => {
                let into_chunk = (self.addr + self.offset - start) % chunk;
                (chunk - into_chunk).min(rest)
            }
        };
        let item = (self.offset, piece);
        self.offset += piece;
        Some(item)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn copies_split_only_inside_chunked_buffers() {
        // Addresses no real buffer has, so other tests' buffers cannot overlap them.
        let start = usize::MAX / 2;
        insert(start, 100, 32);
        let cut: Vec<_> = pieces(start + 10, 80).collect();
        assert_eq!(cut, [(0, 22), (22, 32), (54, 26)]);
        assert_eq!(pieces(start, 32).collect::<Vec<_>>(), [(0, 32)]);
        assert_eq!(pieces(start + 96, 4).collect::<Vec<_>>(), [(0, 4)]);
        // Outside it, and empty ranges.
        assert_eq!(pieces(start + 100, 64).collect::<Vec<_>>(), [(0, 64)]);
        assert_eq!(pieces(start - 8, 4).collect::<Vec<_>>(), [(0, 4)]);
        assert_eq!(pieces(start + 10, 0).count(), 0);
        assert_eq!(remove(start), Some((100, 32)));
        assert_eq!(remove(start), None);
        assert_eq!(pieces(start + 10, 80).collect::<Vec<_>>(), [(0, 80)]);
    }
}
