//! Statistics with PyTorch's names, exact under concurrency.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

/// One statistic: its current value, its peak since the last reset, and the running totals
/// of increases and decreases (`current == allocated - freed`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Stat {
    /// Value now.
    pub current: u64,
    /// Highest value since creation or [`Pool::reset_peak_stats`](crate::Pool::reset_peak_stats).
    pub peak: u64,
    /// Sum of all increases.
    pub allocated: u64,
    /// Sum of all decreases.
    pub freed: u64,
}

/// Timing of a slow operation (backend allocation or release).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct DurationStat {
    /// Sum of all durations.
    pub total: Duration,
    /// Longest.
    pub max: Duration,
    /// Shortest (zero when `count` is 0).
    pub min: Duration,
    /// How many.
    pub count: u64,
}

impl DurationStat {
    /// Mean duration (zero when `count` is 0).
    pub fn avg(&self) -> Duration {
        if self.count == 0 {
            Duration::ZERO
        } else {
            self.total / self.count as u32
        }
    }

    pub(crate) fn record(&mut self, elapsed: Duration) {
        self.min = if self.count == 0 {
            elapsed
        } else {
            self.min.min(elapsed)
        };
        self.max = self.max.max(elapsed);
        self.total += elapsed;
        self.count += 1;
    }
}

/// A snapshot of a pool's statistics.
///
/// The names follow PyTorch's `torch.cuda.host_memory_stats()`: `allocations` and
/// `allocated_bytes` count blocks pinned from the backend; `active_requests` and
/// `active_bytes` count blocks handed out and not yet given back. Unlike PyTorch's, peaks are
/// true peaks of the pool-wide total (not sums of per-bucket peaks) and blocks waiting for
/// device work are counted apart (`pending_*`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct PoolStats {
    /// Blocks pinned from the backend.
    pub allocations: Stat,
    /// Bytes pinned from the backend (reserved).
    pub allocated_bytes: Stat,
    /// Blocks handed out.
    pub active_requests: Stat,
    /// Bytes of blocks handed out (class sizes).
    pub active_bytes: Stat,
    /// Blocks given back whose device work has not finished yet.
    pub pending_requests: u64,
    /// Their bytes.
    pub pending_bytes: u64,
    /// Bytes idle in the cache, ready for reuse.
    pub cached_bytes: u64,
    /// Backend allocations (`cudaHostAlloc` or registrations).
    pub num_host_alloc: u64,
    /// Backend releases.
    pub num_host_free: u64,
    /// Time spent in backend allocations.
    pub host_alloc_time: DurationStat,
    /// Time spent in backend releases.
    pub host_free_time: DurationStat,
    /// Allocations served from the cache.
    pub cache_hits: u64,
    /// Allocations that had to pin new memory.
    pub cache_misses: u64,
}

/// Blocks and bytes handed out, in one atomic word so that a single read-modify-write keeps
/// both exact and their peaks true: requests in the top 24 bits, bytes as 4 KiB pages in the
/// low 40 (up to 16.7 million blocks and 4 PiB at once).
#[derive(Debug, Default)]
pub(crate) struct PackedActive {
    word: AtomicU64,
    peak_requests: AtomicU64,
    peak_pages: AtomicU64,
}

const PAGE_BITS: u32 = 40;
const PAGE_MASK: u64 = (1 << PAGE_BITS) - 1;
const MAX_REQUESTS: u64 = (1 << (64 - PAGE_BITS)) - 1;

fn delta(bytes: usize) -> u64 {
    (1 << PAGE_BITS) | (bytes / crate::size_class::PAGE) as u64
}

impl PackedActive {
    /// Counts a block of `bytes` (a multiple of 4 KiB) handed out; `false`, counting nothing,
    /// when the word is full.
    pub(crate) fn add(&self, bytes: usize) -> bool {
        let delta = delta(bytes);
        let before = self.word.fetch_add(delta, Ordering::Relaxed);
        if before >> PAGE_BITS == MAX_REQUESTS
            || (before & PAGE_MASK) + (delta & PAGE_MASK) > PAGE_MASK
        {
            self.word.fetch_sub(delta, Ordering::Relaxed);
            return false;
        }
        let now = before + delta;
        // Plain loads first: the peaks' cache line is written only when a peak moves.
        if now >> PAGE_BITS > self.peak_requests.load(Ordering::Relaxed) {
            self.peak_requests
                .fetch_max(now >> PAGE_BITS, Ordering::Relaxed);
        }
        if now & PAGE_MASK > self.peak_pages.load(Ordering::Relaxed) {
            self.peak_pages
                .fetch_max(now & PAGE_MASK, Ordering::Relaxed);
        }
        true
    }

    /// Counts a block of `bytes` given back.
    pub(crate) fn sub(&self, bytes: usize) {
        self.word.fetch_sub(delta(bytes), Ordering::Relaxed);
    }

    /// `(requests, bytes)` now.
    pub(crate) fn current(&self) -> (u64, u64) {
        let word = self.word.load(Ordering::Relaxed);
        (
            word >> PAGE_BITS,
            (word & PAGE_MASK) * crate::size_class::PAGE as u64,
        )
    }

    /// `(requests, bytes)` peaks.
    pub(crate) fn peaks(&self) -> (u64, u64) {
        let pages = self.peak_pages.load(Ordering::Relaxed);
        (
            self.peak_requests.load(Ordering::Relaxed),
            pages * crate::size_class::PAGE as u64,
        )
    }

    pub(crate) fn reset_peaks(&self) {
        let word = self.word.load(Ordering::Relaxed);
        self.peak_requests
            .store(word >> PAGE_BITS, Ordering::Relaxed);
        self.peak_pages.store(word & PAGE_MASK, Ordering::Relaxed);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn packs_requests_and_bytes_and_refuses_overflow() {
        let active = PackedActive::default();
        assert!(active.add(8192));
        assert!(active.add(4096));
        active.sub(8192);
        assert_eq!(active.current(), (1, 4096));
        assert_eq!(active.peaks(), (2, 12288));
        // A block that would carry the byte count into the request count is refused.
        let huge = (PAGE_MASK as usize) * crate::size_class::PAGE;
        assert!(!active.add(huge));
        assert_eq!(active.current(), (1, 4096));
        active.reset_peaks();
        assert_eq!(active.peaks(), (1, 4096));
    }
}
