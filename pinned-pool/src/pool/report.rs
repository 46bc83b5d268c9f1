//! Statistics: exact or approximate.

use std::sync::atomic::Ordering;

use cuda_pinned::PinnedAllocator;

use super::Pool;
use super::central::Central;
use crate::completion::Completion;
use crate::local::{Amount, Counted, Local, idle_bytes};
use crate::stats::PoolStats;

impl<B: PinnedAllocator, C: Completion> Pool<B, C> {
    /// A snapshot of the statistics, exact: every thread cache is paused while it is read, so the
    /// numbers are one consistent state of the pool even while other threads allocate.
    ///
    /// The pause costs one `membarrier(2)` call, the pool's lock and a wait for each thread to
    /// leave its cache: microseconds, and while other threads allocate the pause slows them too.
    /// For frequent monitoring use [`approximate_stats`](Self::approximate_stats).
    pub fn stats(&self) -> PoolStats {
        let mut central = self.central.lock();
        let paused = self.pause_all(&mut central);
        let mut stats = PoolStats {
            cached_bytes: idle_bytes(&central.depot),
            ..PoolStats::default()
        };
        let mut counted = Vec::new();
        for local in self.caches() {
            // SAFETY: every cache is paused and the lock is held; one borrow at a time.
            stats.cached_bytes += idle_bytes(&unsafe { local.data() }.magazine);
            counted.push(local.counted());
        }
        drop(paused);
        self.fill_stats(&mut stats, &central, counted);
        stats
    }

    /// The statistics without pausing any thread: cheaper, but the totals may mix moments.
    ///
    /// Each thread's counters are read as they are at that moment, so the totals may mix moments (a
    /// block freed on one thread and just handed out on another may count twice or not at all, and
    /// `cached_bytes` is derived from the others). Peaks and backend figures are exact. It costs a
    /// short hold of the pool's lock and a read of each thread's counters, and slows no allocation
    /// that its thread's cache serves.
    pub fn approximate_stats(&self) -> PoolStats {
        let central = self.central.lock();
        let counted: Vec<_> = self.caches().map(Local::counted).collect();
        let mut stats = PoolStats::default();
        let ahead = self.fill_stats(&mut stats, &central, counted);
        // Whatever is pinned and neither handed out, pending nor held by the reserve is idle.
        stats.cached_bytes = (self.reserved.load(Ordering::Relaxed) as u64)
            .saturating_sub(stats.active_bytes.current)
            .saturating_sub(stats.pending_bytes)
            .saturating_sub(ahead);
        stats
    }

    /// Fills in what `counted` (each cache's counters), `central` and the reserve say; returns
    /// the bytes the reserve holds (ready, or being pinned), read with its other figures.
    pub(super) fn fill_stats(
        &self,
        stats: &mut PoolStats,
        central: &Central,
        counted: Vec<Counted>,
    ) -> u64 {
        let mut active = Amount::default();
        for counted in counted {
            stats.cache_hits += counted.hits;
            stats.cache_misses += counted.misses;
            stats.active_bytes.allocated += counted.handed_bytes;
            active = active + counted.active;
        }
        // Read without a pause, a sum may be caught between a free and its count.
        let active_requests = active.requests.max(0) as u64;
        let active_bytes = active.bytes.max(0) as u64;
        // Each thread's given-back counts are its handed-out counts less its active ones.
        stats.active_requests.allocated = stats.cache_hits + stats.cache_misses;
        stats.active_requests.current = active_requests;
        stats.active_requests.freed = stats
            .active_requests
            .allocated
            .saturating_sub(active_requests);
        stats.active_bytes.current = active_bytes;
        stats.active_bytes.freed = stats.active_bytes.allocated.saturating_sub(active_bytes);
        stats.active_requests.peak = central.peak.requests as u64;
        stats.active_bytes.peak = central.peak.bytes as u64;
        stats.allocations = central.allocations;
        stats.allocated_bytes = central.allocated_bytes;
        stats.num_host_alloc = central.allocations.allocated;
        stats.num_host_free = central.allocations.freed;
        stats.host_alloc_time = central.host_alloc_time;
        stats.host_free_time = central.host_free_time;
        stats.pending_requests = self.pending_requests.load(Ordering::Relaxed);
        stats.pending_bytes = self.pending_bytes.load(Ordering::Relaxed) as u64;
        stats.reserve_ready_bytes = central.ahead.ready_bytes() as u64;
        stats.reserve_failures = central.ahead.failures();
        stats.pressure_refusals = self.watch.refusals.load(Ordering::Relaxed);
        stats.pressure_releases = self.watch.releases.load(Ordering::Relaxed);
        stats.pressure_released_bytes = self.watch.released_bytes.load(Ordering::Relaxed);
        central.ahead.held_bytes() as u64
    }

    /// Sets every peak to its current value.
    pub fn reset_peak_stats(&self) {
        let mut central = self.central.lock();
        let paused = self.pause_all(&mut central);
        let mut total = Amount::default();
        for local in self.caches() {
            // The ceilings must fit under the lowered peak: each falls to its thread's count.
            let active = local.active();
            local.set_ceiling(active);
            total = total + active;
        }
        drop(paused);
        central.peak = total;
        central.allocations.peak = central.allocations.current;
        central.allocated_bytes.peak = central.allocated_bytes.current;
    }
}
