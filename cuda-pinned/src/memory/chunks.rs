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
/// from `addr`, in order: a piece ends at every chunk boundary and at the start and end of
/// every chunked buffer the range meets; a range that meets none is one piece.
pub(crate) fn pieces(addr: usize, len: usize) -> Pieces {
    let whole = Pieces {
        whole: (len > 0).then_some((0, len)),
        cut: Vec::new().into_iter(),
    };
    let Some(end) = addr.checked_add(len) else {
        return whole;
    };
    if !any() || len == 0 {
        return whole;
    }
    let buffers = BUFFERS.read().unwrap_or_else(PoisonError::into_inner);
    let mut cuts = Vec::new();
    let mut at = addr;
    while at < end {
        let stop = match buffers.range(..=at).next_back() {
            // Inside a chunked buffer: to the end of this chunk (or of the buffer).
            Some((&start, &(bytes, chunk))) if at - start < bytes => {
                (start + ((at - start) / chunk + 1) * chunk).min(start + bytes)
            }
            // Outside: to the next chunked buffer, if the range reaches it.
            _ => buffers
                .range(at + 1..)
                .next()
                .map_or(end, |(&start, _)| start),
        }
        .min(end);
        cuts.push((at - addr, stop - at));
        at = stop;
    }
    if cuts.len() == 1 {
        return whole;
    }
    Pieces {
        whole: None,
        cut: cuts.into_iter(),
    }
}

/// Iterator of [`pieces`].
#[derive(Clone, Debug)]
pub(crate) struct Pieces {
    /// The whole range, when it is not cut (no allocation for the common case).
    whole: Option<(usize, usize)>,
    cut: std::vec::IntoIter<(usize, usize)>,
}

impl Iterator for Pieces {
    type Item = (usize, usize);

    fn next(&mut self) -> Option<(usize, usize)> {
        self.whole.take().or_else(|| self.cut.next())
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
        // Outside it, into it, through it, and empty ranges.
        assert_eq!(pieces(start + 100, 64).collect::<Vec<_>>(), [(0, 64)]);
        assert_eq!(pieces(start - 8, 4).collect::<Vec<_>>(), [(0, 4)]);
        assert_eq!(
            pieces(start - 8, 48).collect::<Vec<_>>(),
            [(0, 8), (8, 32), (40, 8)]
        );
        assert_eq!(
            pieces(start + 90, 20).collect::<Vec<_>>(),
            [(0, 6), (6, 4), (10, 10)]
        );
        assert_eq!(pieces(start + 10, 0).count(), 0);
        // A second chunked buffer right after the first: the short last chunk ends a piece.
        insert(start + 100, 64, 32);
        assert_eq!(
            pieces(start + 90, 20).collect::<Vec<_>>(),
            [(0, 6), (6, 4), (10, 10)]
        );
        assert_eq!(
            pieces(start + 120, 40).collect::<Vec<_>>(),
            [(0, 12), (12, 28)]
        );
        assert_eq!(remove(start + 100), Some((64, 32)));
        assert_eq!(remove(start), Some((100, 32)));
        assert_eq!(remove(start), None);
        assert_eq!(pieces(start + 10, 80).collect::<Vec<_>>(), [(0, 80)]);
    }
}
