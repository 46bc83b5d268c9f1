//! The lead: a job's first target goes to the device first.
//!
//! Until every piece holding the first target's bytes has queued its copies, a filled piece
//! after them waits (is parked) in its chunk; once the lead's last piece is queued, the
//! parked pieces are handed back to the thread that queued it, to queue in order. At most
//! half the ring is parked so: the lead's own pieces always find a chunk.

use std::sync::atomic::{AtomicBool, Ordering};

use cuda_pinned::ring::Chunk;
use parking_lot::{Mutex, MutexGuard};

/// A filled piece, in its chunk from `start`, waiting for the job's destination or for the
/// lead's copies to be queued.
pub(super) struct Parked<E> {
    pub(super) piece: usize,
    pub(super) start: usize,
    pub(super) chunk: Chunk<E>,
    /// Whether the ring counts it (a piece waiting for the lead, not for the destination).
    pub(super) counted: bool,
}

/// The lead's pieces not yet queued, and the pieces waiting for them.
pub(super) struct Waiting<E> {
    pub(super) left: usize,
    pub(super) parked: Vec<Parked<E>>,
}

/// A job's lead: pieces `0..pieces` hold its first target's bytes.
pub(super) struct Lead<E> {
    pub(super) pieces: usize,
    waiting: Mutex<Waiting<E>>,
    /// Whether every lead piece is queued: nothing parks for the lead any more.
    done: AtomicBool,
}

impl<E> Lead<E> {
    /// The lead of a job whose first `pieces` pieces hold its first target.
    pub(super) fn new(pieces: usize) -> Self {
        Self {
            pieces,
            waiting: Mutex::new(Waiting {
                left: pieces,
                parked: Vec::new(),
            }),
            done: AtomicBool::new(false),
        }
    }

    /// Whether piece `index` belongs to the lead.
    pub(super) fn holds(&self, index: usize) -> bool {
        index < self.pieces
    }

    /// Whether every lead piece is known queued (a stale `false` only takes the slow way).
    pub(super) fn done(&self) -> bool {
        self.done.load(Ordering::Relaxed)
    }

    /// The lead's state, to park pieces under.
    pub(super) fn waiting(&self) -> MutexGuard<'_, Waiting<E>> {
        self.waiting.lock()
    }

    /// Counts the lead's pieces among the `count` from `first` on as queued, and returns the
    /// parked pieces, in order, if that was the lead's last: the caller queues them.
    #[must_use]
    pub(super) fn queued(&self, first: usize, count: usize) -> Vec<Parked<E>> {
        let queued = self.pieces.saturating_sub(first).min(count);
        if queued == 0 {
            return Vec::new();
        }
        let mut waiting = self.waiting.lock();
        waiting.left -= queued;
        if waiting.left > 0 {
            return Vec::new();
        }
        self.done.store(true, Ordering::Relaxed);
        in_order(std::mem::take(&mut waiting.parked))
    }

    /// Takes the parked pieces out, in order (the destination came, or the job failed).
    #[must_use]
    pub(super) fn take_parked(&self) -> Vec<Parked<E>> {
        in_order(std::mem::take(&mut self.waiting.lock().parked))
    }
}

fn in_order<E>(mut parked: Vec<Parked<E>>) -> Vec<Parked<E>> {
    parked.sort_unstable_by_key(|parked| parked.piece);
    parked
}
