//! Blocks given back while device work may still use them, and the polling of their events.

use std::panic::AssertUnwindSafe;
use std::sync::atomic::Ordering;
use std::time::Instant;

use cuda_pinned::{Allocation, PinnedAllocator};

use super::{Pool, keep_first};
use crate::completion::Completion;
use crate::local::Cached;
use crate::size_class::class_size;

impl<B: PinnedAllocator, C: Completion> Pool<B, C> {
    /// Gives a block back; it is reused only once `completion` says the device work that
    /// used it has finished, whatever other blocks still wait on (no head-of-line blocking).
    ///
    /// # Safety
    ///
    /// - as [`free_raw`](Self::free_raw), except that device work covered by `completion`
    ///   may still use the block.
    pub unsafe fn free_raw_after(&self, allocation: Allocation, completion: C) {
        let size = class_size(allocation.tag());
        self.count_returned(self.local(), size);
        self.pending_bytes.fetch_add(size, Ordering::Relaxed);
        self.pending_requests.fetch_add(1, Ordering::Relaxed);
        self.pending.lock().push((allocation, completion));
    }

    /// Moves every block whose device work has finished into the cache, however many older
    /// blocks still wait. Called on every cache miss; no lock is held while events are asked.
    pub fn process_events(&self) {
        // Counted before a block is listed and after it leaves: a count of zero means an
        // empty list, checked without the lock.
        if self.pending_requests.load(Ordering::Relaxed) == 0 {
            return;
        }
        let waiting = {
            let mut pending = self.pending.lock();
            if pending.is_empty() {
                return;
            }
            std::mem::take(&mut *pending)
        };
        let mut done = Vec::new();
        let mut still_waiting = Vec::new();
        // A completion that panics loses its block (leaked: never reused) and the others
        // are seen to before the panic goes on.
        let mut panicked = None;
        for (allocation, mut completion) in waiting {
            match std::panic::catch_unwind(AssertUnwindSafe(|| completion.is_complete())) {
                Ok(true) => {
                    // Finished either way; a completion whose drop panics is leaked.
                    let dropped = std::panic::catch_unwind(AssertUnwindSafe(|| drop(completion)));
                    keep_first(&mut panicked, dropped.err());
                    done.push(allocation);
                }
                Ok(false) => still_waiting.push((allocation, completion)),
                Err(payload) => {
                    self.pending_requests.fetch_sub(1, Ordering::Relaxed);
                    self.pending_bytes
                        .fetch_sub(class_size(allocation.tag()), Ordering::Relaxed);
                    std::mem::forget((allocation, completion));
                    keep_first(&mut panicked, Some(payload));
                }
            }
        }
        if !still_waiting.is_empty() {
            self.pending.lock().extend(still_waiting);
        }
        if !done.is_empty() {
            self.take_in_finished(done);
        }
        if let Some(payload) = panicked {
            std::panic::resume_unwind(payload);
        }
    }

    /// Caches (or releases, when too big to cache) blocks whose device work has finished.
    pub(super) fn take_in_finished(&self, done: Vec<Allocation>) {
        self.pending_requests
            .fetch_sub(done.len() as u64, Ordering::Relaxed);
        let done_bytes = done.iter().map(|a| class_size(a.tag())).sum();
        self.pending_bytes.fetch_sub(done_bytes, Ordering::Relaxed);
        let too_big = |a: &Allocation| {
            self.config
                .max_block_cached_bytes
                .is_some_and(|max| class_size(a.tag()) > max)
        };
        let (release, cache): (Vec<_>, Vec<_>) = done.into_iter().partition(too_big);
        let cached_bytes = cache.iter().map(|a| class_size(a.tag())).sum();
        let over_cap = self.cache_grows(cached_bytes);
        {
            let idle_since = self.config.idle_release.map(|_| Instant::now());
            let mut central = self.central.lock();
            self.depot_adds
                .fetch_add(cache.len() as u64, Ordering::Relaxed);
            for allocation in cache {
                central.depot[allocation.tag()].push(Cached::new(&allocation, idle_since));
            }
        }
        self.release(release);
        if over_cap {
            self.trim_to_cap();
        }
    }
}
