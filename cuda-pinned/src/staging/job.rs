//! One copy cut into pieces that any thread may take, and the queue of them.

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Condvar, Mutex};

use super::config::StagingConfig;
use super::engine::Copier;
use super::slots::Address;
use crate::error::Error;
use crate::ring::{CrewJob, Dma, Way, lock, wait};

/// Cuts `bytes` into pieces (offset, length), in order, each at most a chunk. On one thread:
/// whole chunks, the fewest calls. Spread: about two pieces per thread, the first and last
/// `threads` of them a quarter of that (but at least `min_piece_bytes`), so that the DMA
/// engine starts on the first piece early and the last wave leaves a short tail.
pub(super) fn cut(bytes: usize, config: &StagingConfig, spread: bool) -> Vec<(usize, usize)> {
    let chunk = config.chunk_bytes;
    let smallest = config.min_piece_bytes.clamp(1, chunk);
    let (edge, middle) = if spread {
        let middle = (bytes / (2 * config.threads)).clamp(smallest, chunk);
        ((middle / 4).max(smallest), middle)
    } else {
        (chunk, chunk)
    };
    let edges = if spread { config.threads } else { 0 };
    let mut cuts = Vec::with_capacity(bytes / middle + 2 * edges + 1);
    let mut offset = 0;
    // The tail's small pieces are cut from the end, so they come out whole.
    let tail = (edges * edge).min(bytes / 2);
    while offset < bytes {
        let left = bytes - offset;
        let size = if cuts.len() < edges || left <= tail {
            edge
        } else {
            middle.min(left - tail)
        };
        let size = size.min(left);
        cuts.push((offset, size));
        offset += size;
    }
    cuts
}

/// One copy, cut into pieces that any thread may take.
pub(super) struct Job<D: Dma> {
    pub(super) way: Way,
    /// The host side: dereferenced only for pieces taken before the caller has seen every
    /// piece finish.
    pub(super) host: Address,
    pub(super) device: u64,
    /// Each piece's offset and length, in order.
    pub(super) cuts: Vec<(usize, usize)>,
    /// Takes the newest free chunk (a copy of one piece on the calling thread: the chunk is
    /// still in the CPU's caches) rather than the oldest.
    pub(super) newest_chunk: bool,
    /// Fills chunks (uploads) or the host range (downloads) with non-temporal stores.
    pub(super) streaming: bool,
    pub(super) pieces: usize,
    pub(super) stream: D::Stream,
    pub(super) next: AtomicUsize,
    pub(super) finished: Mutex<usize>,
    pub(super) all_finished: Condvar,
    pub(super) failed: AtomicBool,
    pub(super) error: Mutex<Option<Error>>,
}

impl<D: Dma> Job<D> {
    pub(super) fn take(&self) -> Option<usize> {
        let index = self.next.fetch_add(1, Ordering::Relaxed);
        (index < self.pieces).then_some(index)
    }

    pub(super) fn exhausted(&self) -> bool {
        self.next.load(Ordering::Relaxed) >= self.pieces
    }

    pub(super) fn fail(&self, error: Error) {
        lock(&self.error).get_or_insert(error);
        self.failed.store(true, Ordering::Relaxed);
    }

    pub(super) fn finish_piece(&self) {
        let mut finished = lock(&self.finished);
        *finished += 1;
        if *finished == self.pieces {
            self.all_finished.notify_all();
        }
    }

    pub(super) fn wait_finished(&self) {
        let mut finished = lock(&self.finished);
        while *finished < self.pieces {
            finished = wait(&self.all_finished, finished);
        }
    }
}

impl<D: Dma> CrewJob<Copier<D>> for Job<D> {
    fn exhausted(&self) -> bool {
        Job::exhausted(self)
    }

    fn work(&self, copier: &Copier<D>, _worker: usize) {
        while let Some(index) = self.take() {
            copier.copy_piece(self, index);
        }
    }
}

/// Counts a taken piece as finished when dropped, whatever path the piece took; a piece left
/// by a panic fails its job.
pub(super) struct PieceGuard<'a, D: Dma>(pub(super) &'a Job<D>);

impl<D: Dma> Drop for PieceGuard<'_, D> {
    fn drop(&mut self) {
        if std::thread::panicking() {
            self.0.fail(Error::Panicked {
                what: "a staging copy",
            });
        }
        self.0.finish_piece();
    }
}

/// Aborts the process if dropped while unwinding: the caller of a copy must not return, by a
/// panic either, while other threads may still touch its buffer.
pub(super) struct AbortOnUnwind;

impl Drop for AbortOnUnwind {
    fn drop(&mut self) {
        if std::thread::panicking() {
            std::process::abort();
        }
    }
}
