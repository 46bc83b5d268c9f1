//! The pool and the machine's memory: no pinning that would leave the machine short of memory
//! it can reclaim, and the idle cache given back while tasks stall waiting for memory.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Instant;

use cuda_pinned::{PinnedAllocator, Result};

use super::Pool;
use crate::completion::Completion;
use crate::system_memory::{SystemMemory, refusal};

/// What the pool watches, and what watching did.
pub(crate) struct Watch {
    pub(crate) memory: SystemMemory,
    /// When the pool was made: the clock of `looked_ms`.
    born: Instant,
    /// When stalls were last looked at (ms after `born`; 0: never).
    looked_ms: AtomicU64,
    pub(crate) refusals: AtomicU64,
    pub(crate) releases: AtomicU64,
    pub(crate) released_bytes: AtomicU64,
}

/// Stalls are looked at no more often than this.
const LOOK_EVERY_MS: u64 = 1000;

impl Watch {
    pub(crate) fn new(memory: SystemMemory) -> Self {
        Self {
            memory,
            born: Instant::now(),
            looked_ms: AtomicU64::new(0),
            refusals: AtomicU64::new(0),
            releases: AtomicU64::new(0),
            released_bytes: AtomicU64::new(0),
        }
    }

    /// Whether stalls may be looked at now (once a second at most, across threads).
    fn may_look(&self) -> bool {
        let now = (self.born.elapsed().as_millis() as u64).max(1);
        let last = self.looked_ms.load(Ordering::Relaxed);
        (last == 0 || now.saturating_sub(last) >= LOOK_EVERY_MS)
            && self
                .looked_ms
                .compare_exchange(last, now, Ordering::Relaxed, Ordering::Relaxed)
                .is_ok()
    }
}

impl<B: PinnedAllocator, C: Completion> Pool<B, C> {
    /// Refuses to pin `size` more bytes where that would leave less than the configured share
    /// of the machine's memory available, after giving the idle cache back. Says nothing where
    /// the machine's memory cannot be read.
    pub(super) fn check_memory(&self, size: usize) -> Result<()> {
        let keep_ppm = self.config.keep_available_ppm;
        if self.watch.memory.short_for(size, keep_ppm).is_none() {
            return Ok(());
        }
        self.empty_cache();
        let Some(short) = self.watch.memory.short_for(size, keep_ppm) else {
            return Ok(());
        };
        self.watch.refusals.fetch_add(1, Ordering::Relaxed);
        let pinned = self.reserved.load(Ordering::Relaxed);
        Err(refusal(size, short, "this pool", pinned))
    }

    /// Gives the idle cache back if tasks stalled for memory at least the configured share of
    /// the last minute; the bytes given back.
    ///
    /// Looks at the kernel's pressure stall information (`/proc/pressure/memory`) no more than
    /// once a second (a call sooner gives nothing back); the pool also calls it as it pins new
    /// memory, and a loader at the end of each epoch. A pool nobody calls keeps its cache: a
    /// program that idles under pressure calls this from a timer. Returns 0 where the kernel
    /// has no pressure information or [`PoolConfig::release_under_pressure`] is 0.
    ///
    /// [`PoolConfig::release_under_pressure`]: crate::PoolConfig::release_under_pressure
    pub fn relieve_pressure(&self) -> usize {
        let threshold = f64::from(self.config.release_stall) / 100.0;
        if self.config.release_stall == 0 || !self.watch.may_look() {
            return 0;
        }
        let Some(stall) = self.watch.memory.stall() else {
            return 0;
        };
        if stall.avg60 < threshold {
            return 0;
        }
        let before = self.idle_bytes();
        self.empty_cache();
        let released = before.saturating_sub(self.idle_bytes());
        self.watch.releases.fetch_add(1, Ordering::Relaxed);
        self.watch
            .released_bytes
            .fetch_add(released as u64, Ordering::Relaxed);
        tracing::warn!(
            stall_avg60 = stall.avg60,
            released,
            "idle cache given back: tasks stall for memory"
        );
        released
    }

    /// Bytes idle in the caches, as the statistics count them.
    fn idle_bytes(&self) -> usize {
        self.stats().cached_bytes as usize
    }
}
