//! Pieces read through the page cache in parts: the thread that took a piece opens it, any
//! free thread reads its parts, and the one that finishes the last part closes it.
//!
//! Copies stay large (the DMA engine pays for each one it starts) while reads stay small (a
//! thread reads the page cache fastest into memory its caches still hold).

use cuda_pinned::ring::Chunk;
use parking_lot::Mutex;

/// A piece read part by part into its chunk.
pub(super) struct Open<E> {
    /// The piece's index in its job.
    pub(super) piece: usize,
    /// The address of the piece's first byte in the chunk.
    pub(super) start: usize,
    /// Held until the last part is finished.
    pub(super) chunk: Chunk<E>,
    parts: usize,
    /// Parts handed out, and parts not finished yet.
    claimed: usize,
    unfinished: usize,
    /// Whether a part was not read (an error, a panic, or a failed job).
    pub(super) failed: bool,
}

/// Part `index` of open piece `piece`, whose first byte is at `start`.
pub(super) struct Part {
    pub(super) piece: usize,
    pub(super) index: usize,
    pub(super) start: usize,
}

/// A job's open pieces, oldest first, until their last part is finished.
pub(super) struct OpenPieces<E> {
    open: Mutex<Vec<Open<E>>>,
}

impl<E> Default for OpenPieces<E> {
    fn default() -> Self {
        Self {
            open: Mutex::new(Vec::new()),
        }
    }
}

impl<E> OpenPieces<E> {
    /// Opens `piece`, filled at `start` of `chunk`, in `parts` parts.
    pub(super) fn open(&self, piece: usize, start: usize, chunk: Chunk<E>, parts: usize) {
        self.open.lock().push(Open {
            piece,
            start,
            chunk,
            parts,
            claimed: 0,
            unfinished: parts,
            failed: false,
        });
    }

    /// Whether a piece has a part nobody has claimed.
    pub(super) fn any_unclaimed(&self) -> bool {
        self.open
            .lock()
            .iter()
            .any(|open| open.claimed < open.parts)
    }

    /// The next unread part of the oldest open piece, claimed, if any piece has one.
    pub(super) fn claim(&self) -> Option<Part> {
        let mut open = self.open.lock();
        let entry = open.iter_mut().find(|open| open.claimed < open.parts)?;
        entry.claimed += 1;
        Some(Part {
            piece: entry.piece,
            index: entry.claimed - 1,
            start: entry.start,
        })
    }

    /// Counts a part of `piece` finished, `read` or not, and returns the pieces whose parts
    /// are now all finished; after a failure (`failed`), the unclaimed parts are skipped.
    #[must_use]
    pub(super) fn finish(&self, piece: usize, read: bool, failed: bool) -> Vec<Open<E>> {
        let mut open = self.open.lock();
        // Every part is finished once, and the entry goes only with the last one.
        if let Some(entry) = open.iter_mut().find(|open| open.piece == piece) {
            entry.unfinished -= 1;
            entry.failed |= !read;
        }
        take_closed(&mut open, failed)
    }

    /// After a failure, skips the parts that no thread has claimed (a thread that panicked
    /// has left the job, and may have been the one to come back for them), and returns the
    /// pieces that no thread reads any more.
    #[must_use]
    pub(super) fn skip_unclaimed(&self) -> Vec<Open<E>> {
        take_closed(&mut self.open.lock(), true)
    }
}

/// Takes out of `open` the pieces with no part left unfinished; after a failure, skips the
/// unclaimed parts first.
fn take_closed<E>(open: &mut Vec<Open<E>>, failed: bool) -> Vec<Open<E>> {
    if failed {
        for entry in open.iter_mut() {
            entry.unfinished -= entry.parts - entry.claimed;
            entry.claimed = entry.parts;
            entry.failed = true;
        }
    }
    open.extract_if(.., |entry| entry.unfinished == 0).collect()
}
