//! Statistics with PyTorch's names, exact under concurrency.

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
            // In nanoseconds, so that any count divides (a `u32` divisor would wrap).
            let nanos = self.total.as_nanos() / u128::from(self.count);
            Duration::from_nanos(u64::try_from(nanos).unwrap_or(u64::MAX))
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
    /// Allocations that had to pin new memory (or took a block pinned ahead).
    pub cache_misses: u64,
    /// Bytes pinned ahead by the reserve thread and not yet taken ([`Pool::reserve`]).
    ///
    /// [`Pool::reserve`]: crate::Pool::reserve
    pub reserve_ready_bytes: u64,
    /// Errors the reserve thread met (the first is kept for `Pool::take_reserve_error`).
    pub reserve_failures: u64,
    /// Allocations refused because pinning would have left the machine too little memory
    /// available ([`PoolConfig::keep_available`](crate::PoolConfig::keep_available)).
    pub pressure_refusals: u64,
    /// Times the idle cache was given back because tasks stalled for memory
    /// ([`PoolConfig::release_under_pressure`](crate::PoolConfig::release_under_pressure)).
    pub pressure_releases: u64,
    /// Bytes given back so.
    pub pressure_released_bytes: u64,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn average_divides_by_any_count() {
        let mut stat = DurationStat {
            total: Duration::from_secs(1 << 33),
            count: 1 << 32,
            ..DurationStat::default()
        };
        assert_eq!(stat.avg(), Duration::from_secs(2));
        stat.count += 1;
        assert!(stat.avg() < Duration::from_secs(2));
        stat.record(Duration::from_secs(3));
        assert_eq!(stat.max, Duration::from_secs(3));
    }
}
