//! The pool: size-classed, sharded free lists over a backend, with event-gated reuse.

use std::alloc::Layout;
use std::collections::HashMap;
use std::fmt;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::time::Instant;

use cuda_pinned::{
    Allocation, DefaultPinned, Error, PendingUses, PinnedAllocator, PinnedVec, Result,
};
use parking_lot::Mutex;

use crate::completion::Completion;
use crate::config::{ConfigError, PoolConfig};
use crate::shard::{Cached, Shard, my_shard};
use crate::size_class::{PAGE, class_of, class_size};
use crate::stats::{DurationStat, PackedActive, PoolStats, Stat};

/// A caching allocator of page-locked memory; see the crate documentation for the design.
///
/// Use `&Pool` as the allocator of [`PinnedVec`] (or allocator-api2 containers):
/// `PinnedVec::with_capacity_in(n, &pool)`. `B` is where new memory comes from; `C` is what
/// says a freed block's device work has finished ([`PendingUses`], CUDA events, in real use).
pub struct Pool<B: PinnedAllocator = DefaultPinned, C: Completion = PendingUses> {
    backend: B,
    config: PoolConfig,
    shards: Box<[Shard]>,
    /// Blocks given back while device work may still use them.
    pending: Mutex<Vec<(Allocation, C)>>,
    /// Every block pinned from the backend, by address, as the backend described it.
    blocks: Mutex<HashMap<usize, Allocation>>,
    /// Blocks and bytes handed out, when peaks are exact (the default); otherwise each shard
    /// counts its own.
    active: PackedActive,

    /// Class-size bytes of all blocks pinned (in use, pending or idle): limits and cache size.
    reserved: AtomicUsize,
    pending_bytes: AtomicUsize,
    pending_requests: AtomicU64,
    backend_stats: Mutex<BackendStats>,
}

#[derive(Default)]
struct BackendStats {
    allocations: Stat,
    allocated_bytes: Stat,
    host_alloc_time: DurationStat,
    host_free_time: DurationStat,
}

fn raise(stat: &mut Stat, amount: u64) {
    stat.current += amount;
    stat.allocated += amount;
    stat.peak = stat.peak.max(stat.current);
}

fn lower(stat: &mut Stat, amount: u64) {
    stat.current -= amount;
    stat.freed += amount;
}

impl<B: PinnedAllocator, C: Completion> fmt::Debug for Pool<B, C> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Pool")
            .field("config", &self.config)
            .field("stats", &self.stats())
            .finish()
    }
}

impl Pool {
    /// A pool over [`DefaultPinned`] with the default configuration.
    pub fn new() -> Self {
        Self::with_backend(DefaultPinned, PoolConfig::default())
    }

    /// A pool over [`DefaultPinned`] configured by `CUDA_PINNED_POOL_CONF`.
    ///
    /// # Errors
    ///
    /// The variable's first malformed entry, unknown key or bad value.
    pub fn from_env() -> Result<Self, ConfigError> {
        Ok(Self::with_backend(DefaultPinned, PoolConfig::from_env()?))
    }
}

impl Default for Pool {
    fn default() -> Self {
        Self::new()
    }
}

impl<B: PinnedAllocator, C: Completion> Pool<B, C> {
    /// A pool pinning new memory from `backend`.
    pub fn with_backend(backend: B, config: PoolConfig) -> Self {
        Self {
            backend,
            shards: (0..config.shards).map(|_| Shard::new()).collect(),
            config,
            pending: Mutex::new(Vec::new()),
            blocks: Mutex::new(HashMap::new()),
            active: PackedActive::default(),

            reserved: AtomicUsize::new(0),
            pending_bytes: AtomicUsize::new(0),
            pending_requests: AtomicU64::new(0),
            backend_stats: Mutex::new(BackendStats::default()),
        }
    }

    /// The configuration.
    pub fn config(&self) -> &PoolConfig {
        &self.config
    }

    /// The backend.
    pub fn backend(&self) -> &B {
        &self.backend
    }

    /// An empty byte vector with room for at least `bytes` bytes: the raw block (fill it
    /// with `extend_from_slice`, `resize` or `io::Write`, or write through `as_mut_ptr`).
    /// Dropping it gives the block back.
    ///
    /// # Errors
    ///
    /// As [`allocate_raw`](Self::allocate_raw).
    pub fn allocate(&self, bytes: usize) -> Result<PinnedVec<u8, &Self>>
    where
        C: From<PendingUses>,
    {
        PinnedVec::with_capacity_in(bytes, self)
    }

    /// A block of at least `bytes` bytes. Its [`Allocation::bytes`] is the class size and its
    /// tag the class index; give it back with [`free_raw`](Self::free_raw) or
    /// [`free_raw_after`](Self::free_raw_after).
    ///
    /// # Errors
    ///
    /// [`Error::CapacityOverflow`] above the largest class (128 TiB);
    /// [`Error::LimitExceeded`] when the pinned-bytes cap would be passed even after releasing
    /// idle cache; the backend's error when pinning fails even after releasing idle cache.
    pub fn allocate_raw(&self, bytes: usize) -> Result<Allocation> {
        let (class, size) = class_of(bytes).ok_or(Error::CapacityOverflow)?;
        let me = my_shard(self.shards.len());
        let allocation = match self.take(me, class) {
            Some(hit) => hit,
            None => self.allocate_slow(me, class, size)?,
        };
        if self.config.exact_peaks && !self.active.add(size) {
            // More than 16.7 million blocks or 4 PiB in use at once: the count is full.
            let in_use = self.active.current().1 as usize;
            self.cache(me, allocation, true, false);
            return Err(Error::LimitExceeded {
                requested: size,
                pinned: in_use,
                limit: in_use,
            });
        }
        Ok(allocation)
    }

    /// Pops an idle block of `class` from shard `shard`, counting the hit there.
    fn take(&self, shard: usize, class: usize) -> Option<Allocation> {
        let mut data = self.shards[shard].lock();
        let cached = data.free[class].pop()?;
        let size = class_size(class);
        data.hits += 1;
        data.handed += 1;
        data.handed_bytes += size as u64;
        if !self.config.exact_peaks {
            data.active.add(size);
        }
        Some(cached.allocation)
    }

    fn allocate_slow(&self, me: usize, class: usize, size: usize) -> Result<Allocation> {
        self.process_events();
        if self.config.idle_release.is_some() {
            self.release_idle();
        }
        let shards = self.shards.len();
        if let Some(hit) = (0..shards).find_map(|i| self.take((me + i) % shards, class)) {
            return Ok(hit);
        }
        let allocation = self.pin_new(class, size)?;
        let mut data = self.shards[me].lock();
        data.misses += 1;
        data.handed += 1;
        data.handed_bytes += size as u64;
        if !self.config.exact_peaks {
            data.active.add(size);
        }
        Ok(allocation)
    }

    /// Pins a new block from the backend, within the limit, retrying once after releasing
    /// the idle cache.
    fn pin_new(&self, class: usize, size: usize) -> Result<Allocation> {
        self.reserve(size)?;
        let layout = Layout::from_size_align(size, PAGE).map_err(|_| Error::CapacityOverflow)?;
        let mut result = self.timed_backend_allocate(layout);
        if let Err(error) = &result
            && retryable(error)
        {
            self.empty_cache();
            result = self.timed_backend_allocate(layout);
        }
        let block = match result {
            Ok(block) => block,
            Err(error) => {
                self.reserved.fetch_sub(size, Ordering::Relaxed);
                return Err(error);
            }
        };
        let handed = Allocation::new(block.ptr(), size, block.kind(), class);
        let bytes = block.bytes() as u64;
        self.blocks
            .lock()
            .insert(block.ptr().as_ptr() as usize, block);
        let mut stats = self.backend_stats.lock();
        raise(&mut stats.allocations, 1);
        raise(&mut stats.allocated_bytes, bytes);
        Ok(handed)
    }

    fn timed_backend_allocate(&self, layout: Layout) -> Result<Allocation> {
        let start = Instant::now();
        let result = self.backend.allocate(layout);
        if result.is_ok() {
            self.backend_stats
                .lock()
                .host_alloc_time
                .record(start.elapsed());
        }
        result
    }

    /// Counts `size` more reserved bytes, within `max_pinned_bytes`: over it, idle cache is
    /// released first.
    fn reserve(&self, size: usize) -> Result<()> {
        let Some(limit) = self.config.max_pinned_bytes else {
            self.reserved.fetch_add(size, Ordering::Relaxed);
            return Ok(());
        };
        let mut trimmed = false;
        loop {
            let pinned = self.reserved.load(Ordering::Relaxed);
            let wanted = pinned.checked_add(size).ok_or(Error::CapacityOverflow)?;
            if wanted <= limit {
                if self
                    .reserved
                    .compare_exchange(pinned, wanted, Ordering::Relaxed, Ordering::Relaxed)
                    .is_ok()
                {
                    return Ok(());
                }
            } else if !trimmed {
                let cached = self.cached_bytes();
                self.trim(cached.saturating_sub(wanted - limit));
                trimmed = true;
            } else {
                return Err(Error::LimitExceeded {
                    requested: size,
                    pinned,
                    limit,
                });
            }
        }
    }

    /// Gives a block back for reuse.
    ///
    /// # Safety
    ///
    /// - `allocation` came from [`allocate_raw`](Self::allocate_raw) of this pool, unchanged,
    ///   and is not used afterwards;
    /// - no device work still uses it (otherwise use [`free_raw_after`](Self::free_raw_after)).
    pub unsafe fn free_raw(&self, allocation: Allocation) {
        self.cache(my_shard(self.shards.len()), allocation, true, true);
    }

    /// Gives a block back; it is reused only once `completion` says the device work that
    /// used it has finished, whatever other blocks still wait on (no head-of-line blocking).
    ///
    /// # Safety
    ///
    /// - as [`free_raw`](Self::free_raw), except that device work covered by `completion`
    ///   may still use the block.
    pub unsafe fn free_raw_after(&self, allocation: Allocation, completion: C) {
        let size = class_size(allocation.tag());
        if self.config.exact_peaks {
            self.active.sub(size);
        }
        {
            let mut data = self.shards[my_shard(self.shards.len())].lock();
            data.returned += 1;
            data.returned_bytes += size as u64;
            if !self.config.exact_peaks {
                data.active.sub(size);
            }
        }
        self.pending_bytes.fetch_add(size, Ordering::Relaxed);
        self.pending_requests.fetch_add(1, Ordering::Relaxed);
        self.pending.lock().push((allocation, completion));
    }

    /// Puts an idle block into shard `shard` (or releases it when caching it is not wanted).
    /// `returned`: a user gave it back (counted as freed), rather than a pending block having
    /// become free; `was_active`: it is still counted as handed out.
    fn cache(&self, shard: usize, allocation: Allocation, returned: bool, was_active: bool) {
        let size = class_size(allocation.tag());
        let too_big = self
            .config
            .max_block_cached_bytes
            .is_some_and(|max| size > max);
        {
            if was_active && self.config.exact_peaks {
                self.active.sub(size);
            }
            let mut data = self.shards[shard].lock();
            if returned {
                data.returned += 1;
                data.returned_bytes += size as u64;
            }
            if was_active && !self.config.exact_peaks {
                data.active.sub(size);
            }
            if !too_big {
                let idle_since = self.config.idle_release.map(|_| Instant::now());
                data.free[allocation.tag()].push(Cached {
                    allocation,
                    idle_since,
                });
                drop(data);
                if let Some(max) = self.config.max_cached_bytes
                    && self.cached_bytes() > max
                {
                    self.trim(max);
                }
                return;
            }
        }
        self.release(vec![allocation]);
    }

    /// Moves every block whose device work has finished into the cache, however many older
    /// blocks still wait. Called on every cache miss; no lock is held while events are asked.
    pub fn process_events(&self) {
        let waiting = {
            let mut pending = self.pending.lock();
            if pending.is_empty() {
                return;
            }
            std::mem::take(&mut *pending)
        };
        let me = my_shard(self.shards.len());
        let mut still_waiting = Vec::new();
        for (allocation, mut completion) in waiting {
            if completion.is_complete() {
                self.pending_bytes
                    .fetch_sub(class_size(allocation.tag()), Ordering::Relaxed);
                self.pending_requests.fetch_sub(1, Ordering::Relaxed);
                self.cache(me, allocation, false, false);
            } else {
                still_waiting.push((allocation, completion));
            }
        }
        if !still_waiting.is_empty() {
            self.pending.lock().extend(still_waiting);
        }
    }

    /// Releases every idle block to the backend (PyTorch's `empty_cache`). Blocks in use or
    /// waiting for device work stay.
    pub fn empty_cache(&self) {
        self.process_events();
        let mut idle = Vec::new();
        for shard in self.shards.iter() {
            let mut data = shard.lock();
            for list in &mut data.free {
                idle.extend(list.drain(..).map(|cached| cached.allocation));
            }
        }
        self.release(idle);
    }

    /// Releases idle blocks, largest first, until at most `target_bytes` stay cached.
    pub fn trim(&self, target_bytes: usize) {
        let mut excess = self.cached_bytes().saturating_sub(target_bytes);
        let mut victims = Vec::new();
        'classes: for class in (0..crate::size_class::CLASSES).rev() {
            for shard in self.shards.iter() {
                if excess == 0 {
                    break 'classes;
                }
                let mut data = shard.lock();
                while excess > 0 {
                    let Some(cached) = data.free[class].pop() else {
                        break;
                    };
                    excess = excess.saturating_sub(class_size(class));
                    victims.push(cached.allocation);
                }
            }
        }
        self.release(victims);
    }

    /// Releases blocks idle for longer than the configured
    /// [`idle_release`](PoolConfig::idle_release); nothing without one.
    pub fn release_idle(&self) {
        let Some(after) = self.config.idle_release else {
            return;
        };
        let now = Instant::now();
        let mut victims = Vec::new();
        for shard in self.shards.iter() {
            let mut data = shard.lock();
            for list in &mut data.free {
                let mut i = 0;
                while i < list.len() {
                    if list[i]
                        .idle_since
                        .is_some_and(|t| now.duration_since(t) >= after)
                    {
                        victims.push(list.swap_remove(i).allocation);
                    } else {
                        i += 1;
                    }
                }
            }
        }
        self.release(victims);
    }

    /// Gives blocks back to the backend; takes no pool lock during the backend calls.
    fn release(&self, victims: Vec<Allocation>) {
        for handed in victims {
            let Some(block) = self.blocks.lock().remove(&(handed.ptr().as_ptr() as usize)) else {
                continue;
            };
            let bytes = block.bytes() as u64;
            let start = Instant::now();
            // SAFETY: the block came from the backend, is idle (in no list, not in use, its
            // device work finished) and is forgotten by the pool from here on.
            unsafe { self.backend.deallocate(block) };
            let elapsed = start.elapsed();
            self.reserved
                .fetch_sub(class_size(handed.tag()), Ordering::Relaxed);
            let mut stats = self.backend_stats.lock();
            stats.host_free_time.record(elapsed);
            lower(&mut stats.allocations, 1);
            lower(&mut stats.allocated_bytes, bytes);
        }
    }

    /// The kind of the block at `ptr`, if the pool pinned it.
    pub(crate) fn block_kind(&self, ptr: std::ptr::NonNull<u8>) -> Option<cuda_pinned::MemoryKind> {
        self.blocks
            .lock()
            .get(&(ptr.as_ptr() as usize))
            .map(Allocation::kind)
    }

    fn cached_bytes(&self) -> usize {
        let reserved = self.reserved.load(Ordering::Relaxed);
        let busy = self.active_totals().0.1 as usize + self.pending_bytes.load(Ordering::Relaxed);
        reserved.saturating_sub(busy)
    }

    /// `((requests, bytes) now, (requests, bytes) peaks)` handed out. Per-shard counts are
    /// summed: currents exactly, peaks as an upper bound.
    fn active_totals(&self) -> ((u64, u64), (u64, u64)) {
        if self.config.exact_peaks {
            return (self.active.current(), self.active.peaks());
        }
        let mut sum = crate::shard::Active::default();
        for shard in self.shards.iter() {
            let active = shard.lock().active;
            sum.requests += active.requests;
            sum.bytes += active.bytes;
            sum.peak_requests += active.peak_requests;
            sum.peak_bytes += active.peak_bytes;
        }
        let u = |v: i64| v.max(0) as u64;
        (
            (u(sum.requests), u(sum.bytes)),
            (u(sum.peak_requests), u(sum.peak_bytes)),
        )
    }

    /// A snapshot of the statistics. Shard totals are read under each shard's lock; with no
    /// allocation or free running, every number is exact.
    pub fn stats(&self) -> PoolStats {
        let mut stats = PoolStats::default();
        for shard in self.shards.iter() {
            let data = shard.lock();
            stats.cache_hits += data.hits;
            stats.cache_misses += data.misses;
            stats.active_requests.allocated += data.handed;
            stats.active_requests.freed += data.returned;
            stats.active_bytes.allocated += data.handed_bytes;
            stats.active_bytes.freed += data.returned_bytes;
        }
        let ((requests, bytes), (peak_requests, peak_bytes)) = self.active_totals();
        stats.active_requests.current = requests;
        stats.active_requests.peak = peak_requests;
        stats.active_bytes.current = bytes;
        stats.active_bytes.peak = peak_bytes;
        stats.pending_requests = self.pending_requests.load(Ordering::Relaxed);
        stats.pending_bytes = self.pending_bytes.load(Ordering::Relaxed) as u64;
        stats.cached_bytes = self.cached_bytes() as u64;
        let backend = self.backend_stats.lock();
        stats.allocations = backend.allocations;
        stats.allocated_bytes = backend.allocated_bytes;
        stats.num_host_alloc = backend.allocations.allocated;
        stats.num_host_free = backend.allocations.freed;
        stats.host_alloc_time = backend.host_alloc_time;
        stats.host_free_time = backend.host_free_time;
        stats
    }

    /// Sets every peak to its current value.
    pub fn reset_peak_stats(&self) {
        self.active.reset_peaks();
        for shard in self.shards.iter() {
            let mut data = shard.lock();
            data.active.peak_requests = data.active.requests;
            data.active.peak_bytes = data.active.bytes;
        }
        let mut backend = self.backend_stats.lock();
        backend.allocations.peak = backend.allocations.current;
        backend.allocated_bytes.peak = backend.allocated_bytes.current;
    }
}

/// Failures worth one more try after the idle cache is released: memory and limit errors.
fn retryable(error: &Error) -> bool {
    match error {
        Error::OutOfMemory { .. } | Error::MemlockLimit { .. } => true,
        Error::Cuda(e) => e.is_out_of_memory(),
        _ => false,
    }
}

impl<B: PinnedAllocator, C: Completion> Drop for Pool<B, C> {
    /// Waits for the device work of pending blocks, then releases every block. A block whose
    /// work cannot be waited for (the device is in an error state) is leaked, not freed.
    fn drop(&mut self) {
        let pending = std::mem::take(self.pending.get_mut());
        for (allocation, mut completion) in pending {
            if completion.wait() {
                self.pending_bytes
                    .fetch_sub(class_size(allocation.tag()), Ordering::Relaxed);
                self.pending_requests.fetch_sub(1, Ordering::Relaxed);
                self.release(vec![allocation]);
            } else {
                self.blocks
                    .get_mut()
                    .remove(&(allocation.ptr().as_ptr() as usize));
            }
        }
        let mut idle = Vec::new();
        for shard in self.shards.iter_mut() {
            for list in &mut shard.get_mut().free {
                idle.extend(list.drain(..).map(|cached| cached.allocation));
            }
        }
        self.release(idle);
    }
}

// SAFETY: blocks come from the backend (whose contract covers validity, alignment to a page
// and page-locking) with at least the class size ≥ the layout's size; a block is in exactly
// one place at a time (handed out, pending, or idle in one shard), and pending blocks are
// reused only after their completion says so. Alignment above a page is refused.
unsafe impl<B: PinnedAllocator, C: Completion + From<PendingUses>> PinnedAllocator for &Pool<B, C> {
    fn allocate(&self, layout: Layout) -> Result<Allocation> {
        if layout.align() > PAGE {
            return Err(Error::Unsupported("alignment above the page size"));
        }
        self.allocate_raw(layout.size())
    }

    unsafe fn deallocate(&self, allocation: Allocation) {
        // SAFETY: forwarded from the caller: from this pool, unused, no device work.
        unsafe { self.free_raw(allocation) }
    }

    unsafe fn deallocate_after(&self, allocation: Allocation, pending: PendingUses) {
        // SAFETY: forwarded from the caller; `pending` covers the device work.
        unsafe { self.free_raw_after(allocation, C::from(pending)) }
    }
}
