//! The pool: size-classed caches per thread over shared lists and a backend, with
//! event-gated reuse and exact statistics.

use std::alloc::Layout;
use std::collections::HashMap;
use std::fmt;
use std::hash::{BuildHasherDefault, Hasher};
use std::panic::AssertUnwindSafe;
use std::ptr;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::Instant;

use cuda_pinned::{
    Allocation, DefaultPinned, Error, PendingUses, PinnedAllocator, PinnedVec, Result,
};
use parking_lot::Mutex;

use crate::barrier::Barrier;
use crate::completion::Completion;
use crate::config::{ConfigError, PoolConfig};
use crate::local::{Amount, Cached, Counted, Local, LocalData, idle_bytes, magazine_has_room};
use crate::reserve::{Ahead, Ready, Reserve};
use crate::size_class::{CLASSES, MAX_NODES, PAGE, SLOT_STRIDE, class_of, class_size, slots};
use crate::stats::{DurationStat, PoolStats, Stat};
use crate::threads::PerThread;

/// A caching allocator of page-locked memory; see the crate documentation for the design.
///
/// A pool is a [`PinnedAllocator`]: use `&pool` (or an `Arc<Pool>`, to move buffers to other
/// threads) as the allocator of [`PinnedVec`] and the crate's other containers, and of
/// allocator-api2's: `PinnedVec::with_capacity_in(n, &pool)`. `B` is where new memory comes
/// from; `C` is what says a freed block's device work has finished ([`PendingUses`], CUDA
/// events, in real use).
///
/// ```
/// use std::sync::Arc;
/// use cuda_pinned::PinnedVec;
/// use pinned_pool::Pool;
///
/// let pool = Arc::new(Pool::new());
/// let worker = {
///     let pool = pool.clone();
///     std::thread::spawn(move || PinnedVec::from_slice_in(&[1u8, 2, 3], pool))
/// };
/// let batch = worker.join().unwrap()?; // a PinnedVec<u8, Arc<Pool>>, moved across threads
/// assert_eq!(batch, [1, 2, 3][..]);
/// # Ok::<(), cuda_pinned::Error>(())
/// ```
pub struct Pool<B: PinnedAllocator = DefaultPinned, C: Completion = PendingUses> {
    backend: B,
    config: PoolConfig,
    barrier: Barrier,
    /// Each thread's cache.
    locals: PerThread<Local>,
    /// The cache of threads that have none: those whose thread-locals are being destroyed
    /// (a buffer dropped from a `thread_local!` at thread exit). Never entered without the
    /// lock; counted, paused and drained like every other.
    shared: Local,
    /// What threads share: taken on a thread's slow path, and to pause every cache.
    central: Arc<Mutex<Central>>,
    /// Blocks given back while device work may still use them.
    pending: Mutex<Vec<(Allocation, C)>>,
    /// Every block pinned from the backend (blocks pinned ahead included, entered by the
    /// reserve thread), by address, as the backend described it, with the slot it serves.
    blocks: Arc<BlockMap>,
    /// NUMA nodes whose blocks are kept apart (the backend's, at most `MAX_NODES`): the lists
    /// are indexed by slot, a class on a node.
    nodes: usize,
    /// Class-size bytes of all blocks pinned (in use, pending, idle, or pinned ahead by the
    /// reserve thread, which counts them too), for the pinned cap.
    reserved: Arc<AtomicUsize>,
    /// The thread that pins ahead of need, started by the first [`Pool::reserve`].
    ahead: OnceLock<Reserve>,
    /// Held while that thread starts, so that two first calls at once start one. Not the
    /// central lock: starting waits for the thread to ask the backend its node, and the
    /// backend may take a lock of its own that a thread holds around other pool calls.
    starting: Mutex<()>,
    /// Why the configured reserve could not be started, for [`Pool::take_reserve_error`].
    reserve_start_error: Mutex<Option<Error>>,
    pending_bytes: AtomicUsize,
    pending_requests: AtomicU64,
    /// Blocks put on the shared lists so far, counted under the lock: a miss looks at the
    /// lists again before it takes a block pinned ahead only if this moved meanwhile.
    depot_adds: AtomicU64,
    /// Idle bytes in all caches, kept only under a cap on them (it costs a shared update per
    /// allocation and free). Raised before a block enters a cache and lowered after one
    /// leaves, so it is never below the true figure, and never wraps.
    cached: AtomicUsize,
}

/// The shared part of a pool.
pub(crate) struct Central {
    /// Idle blocks by class that no thread keeps: spilled from full thread stacks, and
    /// pending blocks whose device work has finished.
    depot: Box<[Vec<Cached>]>,
    /// Peaks of blocks and bytes handed out, pool-wide. Every thread's ceiling is within
    /// them (their sum is at most the peak), so no total can pass them unseen.
    peak: Amount,
    allocations: Stat,
    allocated_bytes: Stat,
    host_alloc_time: DurationStat,
    host_free_time: DurationStat,
    /// Blocks pinned ahead, and what the reserve thread is asked and has met.
    pub(crate) ahead: Ahead,
}

impl Central {
    fn new(nodes: usize) -> Self {
        Self {
            depot: (0..slots(nodes)).map(|_| Vec::new()).collect(),
            peak: Amount::default(),
            allocations: Stat::default(),
            allocated_bytes: Stat::default(),
            host_alloc_time: DurationStat::default(),
            host_free_time: DurationStat::default(),
            ahead: Ahead::new(nodes),
        }
    }

    /// Takes a block of `class` and moves more into `data`'s stack, filling it halfway.
    fn refill(&mut self, data: &mut LocalData, class: usize, size: usize) -> Option<Cached> {
        let taken = self.depot[class].pop()?;
        let stack = &mut data.magazine[class];
        while magazine_has_room(stack.len() * 2 + 1, size) {
            let Some(more) = self.depot[class].pop() else {
                break;
            };
            stack.push(more);
        }
        Some(taken)
    }

    /// Moves the older half of `data`'s full stack of `class` here.
    fn spill(&mut self, data: &mut LocalData, class: usize) {
        let stack = &mut data.magazine[class];
        let half = stack.len().div_ceil(2);
        self.depot[class].extend(stack.drain(..half));
    }
}

/// Every thread cache paused (see [`Pool::pause_all`]); resumes them when dropped.
struct Paused<'a, B: PinnedAllocator, C: Completion> {
    pool: &'a Pool<B, C>,
}

impl<B: PinnedAllocator, C: Completion> Drop for Paused<'_, B, C> {
    fn drop(&mut self) {
        for local in self.pool.caches() {
            local.resume();
        }
    }
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
        Self::with_config(PoolConfig::default())
    }

    /// A pool over [`DefaultPinned`] with `config`; its configured reserve
    /// ([`PoolConfig::reserve`]) starts at once.
    pub fn with_config(config: PoolConfig) -> Self {
        let pool = Self::with_backend(DefaultPinned, config);
        pool.start_configured_reserve();
        pool
    }

    /// A pool over [`DefaultPinned`] configured by `CUDA_PINNED_POOL_CONF`.
    ///
    /// # Errors
    ///
    /// The variable's first malformed entry, unknown key or bad value.
    pub fn from_env() -> Result<Self, ConfigError> {
        Ok(Self::with_config(PoolConfig::from_env()?))
    }
}

impl<B: PinnedAllocator> Pool<B> {
    /// A pool pinning new memory from `backend` ([`CudaHost`](cuda_pinned::CudaHost) with
    /// chosen flags, [`Registered`](cuda_pinned::Registered), …).
    ///
    /// ```
    /// use cuda_pinned::HostLocked;
    /// use pinned_pool::{Pool, PoolConfig};
    ///
    /// let pool = Pool::with_backend(HostLocked, PoolConfig::new().max_cached_bytes(64 << 20));
    /// let buffer = pool.zeroed(4096)?;
    /// assert_eq!(buffer.len(), 4096);
    /// # Ok::<(), cuda_pinned::Error>(())
    /// ```
    pub fn with_backend(backend: B, config: PoolConfig) -> Self {
        Self::with_completion(backend, config)
    }
}

impl Default for Pool {
    fn default() -> Self {
        Self::new()
    }
}

impl<B: PinnedAllocator, C: Completion> Pool<B, C> {
    /// A pool pinning new memory from `backend` and told by completions of type `C` when
    /// freed blocks' device work has finished (`Pool::<_, MyCompletion>::with_completion`).
    pub fn with_completion(backend: B, config: PoolConfig) -> Self {
        let nodes = backend.numa_nodes().clamp(1, MAX_NODES);
        Self {
            backend,
            config,
            barrier: Barrier::new(),
            locals: PerThread::new(),
            shared: Local::new(nodes),
            central: Arc::new(Mutex::new(Central::new(nodes))),
            pending: Mutex::new(Vec::new()),
            blocks: Arc::default(),
            nodes,
            reserved: Arc::new(AtomicUsize::new(0)),
            ahead: OnceLock::new(),
            starting: Mutex::new(()),
            reserve_start_error: Mutex::new(None),
            pending_bytes: AtomicUsize::new(0),
            pending_requests: AtomicU64::new(0),
            depot_adds: AtomicU64::new(0),
            cached: AtomicUsize::new(0),
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

    /// Whether allocate and free take no atomic read-modify-write and no fence on their fast
    /// path. True on Linux 4.14 and later, where pausing the thread caches uses
    /// `membarrier(2)`; elsewhere each operation pays one full fence.
    pub fn has_fence_free_fast_path(&self) -> bool {
        self.barrier.is_expedited()
    }

    /// This thread's cache, created on first use; `None` while the thread's thread-locals
    /// are being destroyed (it is then served by the shared cache, under the lock).
    #[inline]
    fn local(&self) -> Option<&Local> {
        self.locals.get_or(|| Local::new(self.nodes))
    }

    /// The first slot of the NUMA node the backend would place new memory on now: blocks
    /// are reused only for requests on their own node. Free with one node.
    #[inline(always)]
    fn node_slots(&self) -> usize {
        if self.nodes == 1 {
            0
        } else {
            self.backend.numa_node() % self.nodes * SLOT_STRIDE
        }
    }

    /// Every cache: each thread's and the shared one.
    fn caches(&self) -> impl Iterator<Item = &Local> {
        self.locals.iter().chain(std::iter::once(&self.shared))
    }

    /// An empty byte vector with room for at least `bytes` bytes, PyTorch's
    /// `allocate(bytes)`: fill it with `extend_from_slice`, `resize`, `io::Write`, or in place
    /// through `spare_capacity_mut` and `set_len`. Dropping it gives the block back.
    ///
    /// # Errors
    ///
    /// As [`allocate_raw`](Self::allocate_raw).
    pub fn with_capacity(&self, bytes: usize) -> Result<PinnedVec<u8, &Self>>
    where
        C: From<PendingUses>,
    {
        PinnedVec::with_capacity_in(bytes, self)
    }

    /// `bytes` zeroed bytes (the zeroing costs what a `memset` of them does).
    ///
    /// # Errors
    ///
    /// As [`allocate_raw`](Self::allocate_raw).
    pub fn zeroed(&self, bytes: usize) -> Result<PinnedVec<u8, &Self>>
    where
        C: From<PendingUses>,
    {
        PinnedVec::zeroed_in(bytes, self)
    }

    /// A block of at least `bytes` bytes. Its [`Allocation::bytes`] is the class size and its
    /// tag the pool's own (the class, on the NUMA node the backend places memory on for this
    /// thread now); give it back with [`free_raw`](Self::free_raw) or
    /// [`free_raw_after`](Self::free_raw_after).
    ///
    /// # Errors
    ///
    /// [`Error::CapacityOverflow`] above the largest class (128 TiB);
    /// [`Error::LimitExceeded`] when the pinned-bytes cap would be passed even after releasing
    /// idle cache; the backend's error when pinning fails even after releasing idle cache.
    #[inline(always)]
    pub fn allocate_raw(&self, bytes: usize) -> Result<Allocation> {
        let Some((class, size)) = class_of(bytes) else {
            return Err(Error::CapacityOverflow);
        };
        // From here on `class` is a slot: the class on the node new memory would go to.
        let class = class + self.node_slots();
        let local = self.local();
        if let Some(local) = local
            && let Some(mut data) = local.enter(self.barrier)
            && let Some(cached) = local.take(&mut data, class, size)
        {
            drop(data);
            self.cache_shrank(size);
            return Ok(cached.into_allocation(class));
        }
        let cached = self.allocate_slow(local, class, size)?;
        Ok(cached.into_allocation(class))
    }

    /// This thread's stack when its cache was paused or the ceiling was reached, then the
    /// shared lists, then finished pending blocks, then every thread's stack, then new memory.
    ///
    /// Returns the block as a [`Cached`] so that the caller builds the [`Allocation`] from
    /// its parts on either path: a whole `Allocation` written here and copied there would
    /// stall the fast path on store forwarding.
    #[cold]
    fn allocate_slow(&self, local: Option<&Local>, class: usize, size: usize) -> Result<Cached> {
        let Some(local) = local else {
            // Several threads may use the shared cache: a wish there would not be one
            // thread's, so it makes none.
            return self.find_or_pin(&self.shared, class, size);
        };
        local.want(size);
        // Withdraws the wish however the search ends (an unwinding backend included), so that
        // no pauser counts a block this thread never took.
        let _withdrawn = Withdraw(local);
        self.find_or_pin(local, class, size)
    }

    /// The search of [`allocate_slow`](Self::allocate_slow), while this thread's wish for a
    /// block is visible to pausers. `local` is this thread's cache or the shared one, used
    /// only under the lock.
    fn find_or_pin(&self, local: &Local, class: usize, size: usize) -> Result<Cached> {
        // With no block pending and none released by age, nothing could come before a block
        // pinned ahead but the lists: one hold of the lock looks at both, so that an
        // allocation the reserve covers costs a hit and the adoption.
        let ahead = self
            .ahead
            .get()
            .filter(|_| self.config.idle_release.is_none());
        let listed = self.depot_adds.load(Ordering::Relaxed);
        if let Some(cached) = self.take_listed(local, class, size, ahead) {
            return Ok(cached);
        }
        self.process_events();
        if self.config.idle_release.is_some() {
            self.release_idle();
        }
        if let Some(ahead) = self.ahead.get() {
            // Blocks that reached the shared lists meanwhile (device work just finished, or
            // another thread's spill) come first, then one pinned ahead (counted against the
            // cap already): neither pauses anyone.
            if self.depot_adds.load(Ordering::Relaxed) != listed
                && let Some(cached) = self.take_listed(local, class, size, None)
            {
                return Ok(cached);
            }
            let mut central = self.central.lock();
            if let Some(ready) = ahead.take(&mut central.ahead, class) {
                // SAFETY: this thread owns `local`, is outside `enter` and holds the lock.
                let data = unsafe { self.own(local) };
                let allocation = self.count_adopted(&mut central, local, data, ready, size);
                return Ok(Cached::new(&allocation, None));
            }
        }
        {
            let mut central = self.central.lock();
            let paused = self.pause_all(&mut central);
            let cached = central.depot[class].pop().or_else(|| {
                self.caches()
                    .filter(|other| !ptr::eq(*other, local))
                    .find_map(|other| {
                        // SAFETY: every cache is paused and the lock is held; `other` is not
                        // this thread's, whose data is not borrowed yet.
                        unsafe { other.data() }.magazine[class].pop()
                    })
            });
            if let Some(cached) = cached {
                // SAFETY: this thread owns `local`, holds the lock and has paused every cache
                // (its own included, which the guard resumes).
                let data = unsafe { local.data() };
                self.hand_out(&mut central, local, data, size, true, Some(&paused));
                drop(paused);
                drop(central);
                self.cache_shrank(size);
                return Ok(cached);
            }
        }
        let block = self.pin_from_backend(size)?;
        let allocation = self.adopt(local, block, class, size);
        Ok(Cached::new(&allocation, None))
    }

    /// A block of `class` from this thread's stack (when its cache was paused or the ceiling
    /// was reached) or the shared lists, else, if no block is pending, one that `ahead`
    /// pinned; handed out under the lock.
    fn take_listed(
        &self,
        local: &Local,
        class: usize,
        size: usize,
        ahead: Option<&Reserve>,
    ) -> Option<Cached> {
        let mut central = self.central.lock();
        // SAFETY: this thread owns `local`, is outside `enter` and holds the lock.
        let data = unsafe { self.own(local) };
        if let Some(cached) = data.magazine[class]
            .pop()
            .or_else(|| central.refill(data, class, size))
        {
            self.hand_out(&mut central, local, data, size, true, None);
            drop(central);
            self.cache_shrank(size);
            return Some(cached);
        }
        // The pending count rises before a block is listed as pending: zero means no block
        // could reach the lists by finishing its device work first.
        let ready = ahead
            .filter(|_| self.pending_requests.load(Ordering::Relaxed) == 0)?
            .take(&mut central.ahead, class)?;
        let allocation = self.count_adopted(&mut central, local, data, ready, size);
        Some(Cached::new(&allocation, None))
    }

    /// This thread's cache data under the lock, let out of its initial pause.
    ///
    /// # Safety
    ///
    /// As [`Local::data`] for the owning thread: `local` is this thread's (or the shared
    /// cache, which no thread enters), the caller holds the lock, is outside `enter`, and
    /// holds no other reference to the data.
    #[allow(clippy::mut_from_ref, reason = "exclusivity comes from the lock")]
    unsafe fn own<'a>(&self, local: &'a Local) -> &'a mut LocalData {
        // A cache starts paused (see `Local::new`); under the lock no pause is running.
        local.resume();
        // SAFETY: forwarded from the caller.
        unsafe { local.data() }
    }

    /// Counts a block of `size` handed out by this thread, first making room for it under
    /// the thread's ceiling.
    fn hand_out(
        &self,
        central: &mut Central,
        local: &Local,
        data: &mut LocalData,
        size: usize,
        hit: bool,
        paused: Option<&Paused<'_, B, C>>,
    ) {
        self.make_room(central, local, data, size, paused);
        local.count_handed(size, hit);
    }

    /// Raises `local`'s ceiling to fit one more block of `size`, keeping the peaks exact.
    ///
    /// The sum of all ceilings stays within the peak. While the other threads' ceilings leave
    /// room under the peak, this thread takes some. Otherwise only the exact total can tell
    /// whether this allocation makes a new peak: every cache is paused and the total summed,
    /// counting the blocks that threads waiting for the lock are about to take as taken (their
    /// allocations are under way, so the total is one the pool passes through); the peak
    /// rises to it if it is higher, and is shared out again: to each thread what it holds and
    /// is about to take, then, while any is left, its usual headroom. (Should such a waiting
    /// allocation then fail, the peak has counted a block that was never handed out.)
    fn make_room(
        &self,
        central: &mut Central,
        local: &Local,
        data: &mut LocalData,
        size: usize,
        paused: Option<&Paused<'_, B, C>>,
    ) {
        let active = local.active();
        let after = active + Amount::block(size);
        if after.within(local.ceiling()) {
            return;
        }
        let others = || self.caches().filter(|other| !ptr::eq(*other, local));
        // Room for as much again as this thread last needed, so that a loop of allocations
        // asks here a logarithmic number of times.
        let headroom = data.keep.max(Amount::block(size));
        // Other threads may be lowering their ceilings meanwhile: the sum can only be high.
        let room = central.peak - others().map(Local::ceiling).sum();
        let ceiling = if after.within(room) {
            (after + headroom).min(room)
        } else {
            let pause = match paused {
                Some(_) => None,
                None => Some(self.pause_all(central)),
            };
            let mut held = Vec::new();
            for other in others() {
                // SAFETY: every cache is paused and the lock is held; `other` is not this
                // thread's, whose data the caller holds.
                let theirs = unsafe { other.data() };
                held.push((other, other.active() + other.wanted(), theirs.keep));
            }
            let elsewhere: Amount = held.iter().map(|(_, amount, _)| *amount).sum();
            central.peak = central.peak.max(elsewhere + after);
            let mut spare = central.peak - elsewhere - after;
            let extra = headroom.min(spare);
            spare = spare - extra;
            for (other, amount, keep) in held {
                let extra = keep.min(spare);
                spare = spare - extra;
                other.set_ceiling(amount + extra);
            }
            drop(pause);
            after + extra
        };
        local.set_ceiling(ceiling);
        data.keep = data.keep.max(ceiling - active);
    }

    /// Pauses every thread cache: owners take the lock (held by the caller, as `_central`
    /// shows) instead of their lock-free path until the guard drops.
    fn pause_all(&self, _central: &mut Central) -> Paused<'_, B, C> {
        let mine = self.locals.get();
        let mut others = false;
        for local in self.locals.iter() {
            local.pause();
            others |= !mine.is_some_and(|mine| ptr::eq(mine, local));
        }
        // The shared cache is only used under the lock: pausing it asks for no barrier.
        self.shared.pause();
        if others {
            self.barrier.heavy();
        }
        for local in self.locals.iter() {
            local.wait_idle();
        }
        Paused { pool: self }
    }

    /// Makes `block` (new, pinned for `class` and counted against the cap) one of the pool's
    /// blocks, and hands it out to `local`'s thread. No other lock is taken while the block
    /// map's is held.
    fn adopt(&self, local: &Local, block: Allocation, class: usize, size: usize) -> Allocation {
        let ready = (
            Allocation::new(block.ptr(), size, block.kind(), class),
            block.bytes(),
        );
        self.blocks
            .lock()
            .insert(block.ptr().as_ptr() as usize, (block, class));
        let mut central = self.central.lock();
        // SAFETY: this thread owns `local` (the allocating thread's cache, or the shared one),
        // is outside `enter` and holds the lock.
        let data = unsafe { self.own(local) };
        self.count_adopted(&mut central, local, data, ready, size)
    }

    /// Counts a block in the block map but never handed out before as one of the pool's, and
    /// hands it out to `local`'s thread (whose data this is, under the lock). `ready` is the
    /// block as handed out, and the bytes the backend pinned.
    fn count_adopted(
        &self,
        central: &mut Central,
        local: &Local,
        data: &mut LocalData,
        (handed, bytes): Ready,
        size: usize,
    ) -> Allocation {
        raise(&mut central.allocations, 1);
        raise(&mut central.allocated_bytes, bytes as u64);
        self.hand_out(central, local, data, size, false, None);
        handed
    }

    /// A new block of `size` from the backend, counted against the cap (retried once after
    /// releasing idle cache).
    fn pin_from_backend(&self, size: usize) -> Result<Allocation> {
        let layout = Layout::from_size_align(size, PAGE).map_err(|_| Error::CapacityOverflow)?;
        self.count_pinned(size)?;
        // Gives the count back if the backend fails, or unwinds.
        let reservation = Reservation { pool: self, size };
        let mut result = self.timed_backend_allocate(layout);
        if let Err(error) = &result
            && retryable(error)
        {
            self.empty_cache();
            result = self.timed_backend_allocate(layout);
        }
        let block = result?;
        std::mem::forget(reservation);
        Ok(block)
    }

    fn timed_backend_allocate(&self, layout: Layout) -> Result<Allocation> {
        let start = Instant::now();
        let result = self.backend.allocate(layout);
        if result.is_ok() {
            self.central.lock().host_alloc_time.record(start.elapsed());
        }
        result
    }

    /// Counts `size` more reserved bytes, within `max_pinned_bytes`: over it, idle cache is
    /// released first.
    fn count_pinned(&self, size: usize) -> Result<()> {
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
                self.shed(|_| (wanted - limit) as u64);
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
    #[inline(always)]
    pub unsafe fn free_raw(&self, allocation: Allocation) {
        let class = allocation.tag();
        let size = class_size(class);
        let local = self.local();
        if self
            .config
            .max_block_cached_bytes
            .is_some_and(|max| size > max)
        {
            self.count_returned(local, size);
            self.release(vec![allocation]);
            return;
        }
        let idle_since = self.config.idle_release.map(|_| Instant::now());
        // Counted before the block is in a cache, so that nobody can take it out (and count
        // it out) first.
        let over_cap = self.cache_grows(size);
        if let Some(local) = local
            && let Some(mut data) = local.enter(self.barrier)
            && local.give(&mut data, &allocation, idle_since, class, size)
        {
            drop(data);
        } else {
            self.free_slow(local, &allocation, idle_since, class, size);
        }
        if over_cap {
            self.trim_to_cap();
        }
    }

    /// A free when this thread's cache was paused or its stack of the class is full.
    #[cold]
    fn free_slow(
        &self,
        local: Option<&Local>,
        allocation: &Allocation,
        idle_since: Option<Instant>,
        class: usize,
        size: usize,
    ) {
        let local = local.unwrap_or(&self.shared);
        let mut central = self.central.lock();
        // SAFETY: this thread owns `local` (or it is the shared cache), is outside `enter`
        // and holds the lock.
        let data = unsafe { self.own(local) };
        if !local.give(data, allocation, idle_since, class, size) {
            // The stack is full: its older half and this block go to the shared lists.
            central.spill(data, class);
            central.depot[class].push(Cached::new(allocation, idle_since));
            self.depot_adds.fetch_add(1, Ordering::Relaxed);
            local.count_returned(data, size);
        }
    }

    /// Counts a block of `size` given back by this thread (`None`: by a thread without a
    /// cache of its own).
    fn count_returned(&self, local: Option<&Local>, size: usize) {
        if let Some(local) = local
            && let Some(data) = local.enter(self.barrier)
        {
            local.count_returned(&data, size);
            return;
        }
        let local = local.unwrap_or(&self.shared);
        let _central = self.central.lock();
        // SAFETY: this thread owns `local` (or it is the shared cache), is outside `enter`
        // and holds the lock.
        local.count_returned(unsafe { self.own(local) }, size);
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
        self.count_returned(self.local(), size);
        self.pending_bytes.fetch_add(size, Ordering::Relaxed);
        self.pending_requests.fetch_add(1, Ordering::Relaxed);
        self.pending.lock().push((allocation, completion));
    }

    /// Counts `size` idle bytes more in the caches, under a cap on them, *before* they enter
    /// one; whether the caches are then over the cap (and want [`trim_to_cap`](Self::trim_to_cap)
    /// once the bytes are in).
    #[inline]
    fn cache_grows(&self, size: usize) -> bool {
        self.config
            .max_cached_bytes
            .is_some_and(|max| self.cached.fetch_add(size, Ordering::Relaxed) + size > max)
    }

    /// Trims the caches to the cap on idle bytes.
    #[cold]
    fn trim_to_cap(&self) {
        if let Some(max) = self.config.max_cached_bytes {
            self.trim(max);
        }
    }

    /// Counts `size` idle bytes fewer in the caches, under a cap on them, *after* they have
    /// left them.
    #[inline]
    fn cache_shrank(&self, size: usize) {
        if self.config.max_cached_bytes.is_some() {
            self.cached.fetch_sub(size, Ordering::Relaxed);
        }
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
    fn take_in_finished(&self, done: Vec<Allocation>) {
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

    /// Keeps `blocks` blocks of `block_bytes` (rounded up to its size class) pinned ahead of
    /// need from now on, like PyTorch's `pinned_reserve_segment_size_mb` per size class: a
    /// thread of the pool's own pins them in the background and pins another each time an
    /// allocation takes one, so an allocation that finds its class empty (and no block whose
    /// device work has finished) takes a ready block instead of waiting for the driver. Call
    /// it again to change the count: ready blocks past it are released (0 releases them all).
    /// The thread starts on the first call, with that caller's current device (so memory is
    /// placed near it), and is stopped and joined when the pool drops; on a machine with
    /// several NUMA nodes its blocks serve allocations on that device's node only, whichever
    /// thread calls later. Blocks pinned ahead count against `max_pinned_bytes`, are released
    /// with the pool, and not by [`empty_cache`](Self::empty_cache). They enter `allocations` and
    /// `allocated_bytes` when an allocation takes them; until then they are
    /// [`PoolStats::reserve_ready_bytes`].
    ///
    /// Errors the thread meets (the backend's, or the pinned cap) stop it pinning that class
    /// until the next call or the next block taken; they are counted in
    /// [`PoolStats::reserve_failures`] and the first is kept for
    /// [`take_reserve_error`](Self::take_reserve_error).
    ///
    /// ```
    /// use cuda_pinned::HostLocked;
    /// use pinned_pool::{Pool, PoolConfig};
    ///
    /// let pool = Pool::with_backend(HostLocked, PoolConfig::new());
    /// pool.reserve(1 << 20, 4)?; // four 1 MiB blocks, pinned in the background
    /// let batch = pool.with_capacity(1 << 20)?; // a ready block once the thread got to it
    /// # Ok::<(), cuda_pinned::Error>(())
    /// ```
    ///
    /// # Errors
    ///
    /// [`Error::Unsupported`] for blocks of 0 bytes; [`Error::CapacityOverflow`] above the
    /// largest class, or for more blocks than memory can be counted in;
    /// [`Error::LimitExceeded`] when the blocks together pass
    /// [`PoolConfig::max_pinned_bytes`], or the machine's memory where no cap is set;
    /// [`Error::Os`] when the thread cannot be started.
    pub fn reserve(&self, block_bytes: usize, blocks: usize) -> Result<()>
    where
        B: Clone + Send + 'static,
    {
        if block_bytes == 0 {
            return Err(Error::Unsupported("a reserve of blocks of 0 bytes"));
        }
        let (class, _) = class_of(block_bytes).ok_or(Error::CapacityOverflow)?;
        let total = class_size(class)
            .checked_mul(blocks)
            .ok_or(Error::CapacityOverflow)?;
        let limit = self.config.max_pinned_bytes.unwrap_or_else(physical_memory);
        if total > limit {
            return Err(Error::LimitExceeded {
                requested: total,
                pinned: self.reserved.load(Ordering::Relaxed),
                limit,
            });
        }
        let ahead = match self.ahead.get() {
            Some(ahead) => ahead,
            None => {
                let starting = self.starting.lock();
                if self.ahead.get().is_none() {
                    let started = Reserve::start(
                        self.backend.clone(),
                        self.nodes,
                        self.reserved.clone(),
                        self.config.max_pinned_bytes,
                        self.blocks.clone(),
                        self.central.clone(),
                    )
                    .map_err(|source| Error::Os {
                        call: "pthread_create",
                        source,
                    })?;
                    let _ = self.ahead.set(started);
                }
                drop(starting);
                self.ahead.get().expect("set above")
            }
        };
        let class = class + ahead.slot_base;
        let excess = ahead.set_target(&mut self.central.lock().ahead, class, blocks);
        for ready in excess {
            self.release_ahead(ready);
        }
        Ok(())
    }

    /// Gives a block pinned ahead and never handed out back to the backend.
    fn release_ahead(&self, (handed, _): Ready) {
        let Some((block, slot)) = self.blocks.lock().remove(&(handed.ptr().as_ptr() as usize))
        else {
            return;
        };
        self.reserved.fetch_sub(class_size(slot), Ordering::Relaxed);
        // SAFETY: pinned ahead from the backend, never handed out, and out of the map now.
        unsafe { self.backend.deallocate(block) };
    }

    /// Starts what the configuration asks to keep pinned ahead ([`PoolConfig::reserve`]), as
    /// [`reserve`](Self::reserve) would for each size. A failure to start (a size above the
    /// largest class, no thread to be had) is kept for
    /// [`take_reserve_error`](Self::take_reserve_error).
    pub fn start_configured_reserve(&self)
    where
        B: Clone + Send + 'static,
    {
        for &(block_bytes, blocks) in &self.config.reserve {
            if let Err(error) = self.reserve(block_bytes, blocks) {
                self.reserve_start_error.lock().get_or_insert(error);
            }
        }
    }

    /// The first error the reserve thread met since the last call (see
    /// [`reserve`](Self::reserve)), or why the configured reserve could not start; `None`
    /// when there was none.
    pub fn take_reserve_error(&self) -> Option<Error> {
        let start_error = self.reserve_start_error.lock().take();
        start_error.or_else(|| self.central.lock().ahead.take_error())
    }

    /// Releases every idle block to the backend (PyTorch's `empty_cache`). Blocks in use or
    /// waiting for device work stay.
    pub fn empty_cache(&self) {
        self.process_events();
        self.evict(|holders| {
            let mut victims = Vec::new();
            for lists in holders {
                for (class, list) in lists.iter_mut().enumerate() {
                    victims.extend(list.drain(..).map(|cached| cached.into_allocation(class)));
                }
            }
            victims
        });
    }

    /// Releases idle blocks, largest first, until at most `target_bytes` stay cached.
    pub fn trim(&self, target_bytes: usize) {
        self.shed(|cached| cached.saturating_sub(target_bytes as u64));
    }

    /// Releases idle blocks, largest first, until the excess `excess_of(cached bytes)` says
    /// is gone (or nothing idle is left).
    fn shed(&self, excess_of: impl FnOnce(u64) -> u64) {
        self.evict(|holders| {
            let cached = holders.iter().map(|lists| idle_bytes(lists)).sum();
            let mut excess = excess_of(cached);
            let mut victims = Vec::new();
            // Largest class first, on every node.
            let slots = (0..CLASSES)
                .rev()
                .flat_map(|class| (0..self.nodes).map(move |node| node * SLOT_STRIDE + class));
            for slot in slots {
                let size = class_size(slot) as u64;
                for lists in holders.iter_mut() {
                    while excess > 0 {
                        let Some(cached) = lists[slot].pop() else {
                            break;
                        };
                        excess = excess.saturating_sub(size);
                        victims.push(cached.into_allocation(slot));
                    }
                }
            }
            victims
        });
    }

    /// Releases blocks idle for longer than the configured
    /// [`idle_release`](PoolConfig::idle_release); nothing without one.
    pub fn release_idle(&self) {
        let Some(after) = self.config.idle_release else {
            return;
        };
        let now = Instant::now();
        let expired = |cached: &Cached| {
            cached
                .idle_since
                .is_some_and(|t| now.duration_since(t) >= after)
        };
        self.evict(|holders| {
            let mut victims = Vec::new();
            for lists in holders {
                for (class, list) in lists.iter_mut().enumerate() {
                    let idle = list.extract_if(.., |c| expired(c));
                    victims.extend(idle.map(|c| c.into_allocation(class)));
                }
            }
            victims
        });
    }

    /// Releases the idle blocks `select` takes out of the shared lists and every thread's
    /// stacks (all paused meanwhile), with no lock held during the backend calls.
    fn evict(&self, select: impl FnOnce(&mut [IdleLists<'_>]) -> Vec<Allocation>) {
        let victims = {
            let mut central = self.central.lock();
            let paused = self.pause_all(&mut central);
            let central = &mut *central;
            let mut holders = vec![&mut central.depot[..]];
            for local in self.caches() {
                // SAFETY: every cache is paused and the lock is held; each is borrowed once.
                holders.push(&mut unsafe { local.data() }.magazine[..]);
            }
            let victims = select(&mut holders);
            drop(holders);
            drop(paused);
            victims
        };
        self.cache_shrank(victims.iter().map(|a| class_size(a.tag())).sum());
        self.release(victims);
    }

    /// Gives blocks back to the backend; takes no pool lock during the backend calls. A
    /// backend that panics on one block keeps that block's bytes counted (whether it was
    /// freed is unknown, and the cap errs on the safe side); the other blocks are released
    /// before the panic goes on.
    fn release(&self, victims: Vec<Allocation>) {
        let mut panicked = None;
        for handed in victims {
            let Some((block, _)) = self.blocks.lock().remove(&(handed.ptr().as_ptr() as usize))
            else {
                continue;
            };
            let bytes = block.bytes() as u64;
            let start = Instant::now();
            let released = std::panic::catch_unwind(AssertUnwindSafe(|| {
                // SAFETY: the block came from the backend, is idle (in no list, not in use,
                // its device work finished) and is forgotten by the pool from here on.
                unsafe { self.backend.deallocate(block) }
            }));
            if let Err(payload) = released {
                keep_first(&mut panicked, Some(payload));
                continue;
            }
            let elapsed = start.elapsed();
            self.reserved
                .fetch_sub(class_size(handed.tag()), Ordering::Relaxed);
            let mut central = self.central.lock();
            central.host_free_time.record(elapsed);
            lower(&mut central.allocations, 1);
            lower(&mut central.allocated_bytes, bytes);
        }
        if let Some(payload) = panicked {
            std::panic::resume_unwind(payload);
        }
    }

    /// The kind and slot of the block at `ptr`, if the pool pinned it.
    pub(crate) fn block_kind(
        &self,
        ptr: std::ptr::NonNull<u8>,
    ) -> Option<(cuda_pinned::MemoryKind, usize)> {
        self.blocks
            .lock()
            .get(&(ptr.as_ptr() as usize))
            .map(|(block, slot)| (block.kind(), *slot))
    }

    /// A snapshot of the statistics, exact: every thread cache is paused while it is read,
    /// so the numbers are one consistent state of the pool even while other threads
    /// allocate. The pause costs one `membarrier(2)` call, the pool's lock and a wait for
    /// each thread to leave its cache: microseconds, and while other threads allocate the
    /// pause slows them too. For frequent monitoring use
    /// [`approximate_stats`](Self::approximate_stats).
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

    /// The statistics without pausing anyone: each thread's counters are read as they are
    /// at that moment, so the totals may mix moments (a block freed on one thread and just
    /// handed out on another may count twice or not at all, and `cached_bytes` is derived
    /// from the others). Peaks and backend figures are exact. It costs a short hold of the
    /// pool's lock and a read of each thread's counters, and slows no
    /// allocation that its thread's cache serves.
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
    fn fill_stats(&self, stats: &mut PoolStats, central: &Central, counted: Vec<Counted>) -> u64 {
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

/// Bytes reserved against `max_pinned_bytes` for a block being pinned; given back unless
/// forgotten once the block exists.
struct Reservation<'a, B: PinnedAllocator, C: Completion> {
    pool: &'a Pool<B, C>,
    size: usize,
}

impl<B: PinnedAllocator, C: Completion> Drop for Reservation<'_, B, C> {
    fn drop(&mut self) {
        self.pool.reserved.fetch_sub(self.size, Ordering::Relaxed);
    }
}

/// Withdraws a thread's wish for a block when dropped.
struct Withdraw<'a>(&'a Local);

impl Drop for Withdraw<'_> {
    fn drop(&mut self) {
        self.0.want(0);
    }
}

/// One holder's idle blocks, by class.
type IdleLists<'a> = &'a mut [Vec<Cached>];

/// The machine's memory in bytes (`usize::MAX` where it cannot be told): more than this can
/// never be pinned ahead.
fn physical_memory() -> usize {
    // SAFETY: sysconf has no preconditions.
    let (pages, page) = unsafe {
        (
            libc::sysconf(libc::_SC_PHYS_PAGES),
            libc::sysconf(libc::_SC_PAGESIZE),
        )
    };
    match (usize::try_from(pages), usize::try_from(page)) {
        (Ok(pages), Ok(page)) if pages > 0 && page > 0 => pages.saturating_mul(page),
        _ => usize::MAX,
    }
}

/// Failures worth one more try after the idle cache is released: memory and limit errors.
fn retryable(error: &Error) -> bool {
    match error {
        Error::OutOfMemory { .. } | Error::MemlockLimit { .. } => true,
        Error::Cuda(e) => e.is_out_of_memory(),
        Error::Driver(e) => e.is_out_of_memory(),
        _ => false,
    }
}

/// Keeps the first panic's payload, to go on with once the pool is consistent again; later
/// ones are leaked, since dropping a payload may panic too.
fn keep_first(
    kept: &mut Option<Box<dyn std::any::Any + Send>>,
    payload: Option<Box<dyn std::any::Any + Send>>,
) {
    match (kept.is_some(), payload) {
        (false, payload) => *kept = payload,
        (true, Some(payload)) => std::mem::forget(payload),
        (true, None) => {}
    }
}

impl<B: PinnedAllocator, C: Completion> Drop for Pool<B, C> {
    /// Waits for the device work of pending blocks, then releases every block. A block whose
    /// work cannot be waited for (the device is in an error state) is leaked, not freed. A
    /// completion or a free that panics loses its own block only: the pool goes on with the
    /// others, then lets the first panic continue (unless the thread is unwinding already).
    fn drop(&mut self) {
        let mut panicked = None;
        let catch = |panicked: &mut _, work: &mut dyn FnMut()| {
            if let Err(payload) = std::panic::catch_unwind(AssertUnwindSafe(work)) {
                keep_first(panicked, Some(payload));
            }
        };
        if let Some(mut ahead) = self.ahead.take() {
            for ready in ahead.drain() {
                let mut ready = Some(ready);
                catch(&mut panicked, &mut || {
                    self.release_ahead(ready.take().expect("taken once"));
                });
            }
        }
        let mut idle = Vec::new();
        let pending = std::mem::take(self.pending.get_mut());
        for (allocation, mut completion) in pending {
            match std::panic::catch_unwind(AssertUnwindSafe(|| completion.wait())) {
                Ok(true) => {
                    self.pending_bytes
                        .fetch_sub(class_size(allocation.tag()), Ordering::Relaxed);
                    self.pending_requests.fetch_sub(1, Ordering::Relaxed);
                    idle.push(allocation);
                    continue;
                }
                Ok(false) => {}
                Err(payload) => {
                    // Dropping a completion that panicked may panic again: leaked with it.
                    std::mem::forget(completion);
                    keep_first(&mut panicked, Some(payload));
                }
            }
            self.blocks
                .lock()
                .remove(&(allocation.ptr().as_ptr() as usize));
        }
        let mut drain = |lists: &mut [Vec<Cached>]| {
            for (class, list) in lists.iter_mut().enumerate() {
                idle.extend(list.drain(..).map(|cached| cached.into_allocation(class)));
            }
        };
        drain(&mut self.central.lock().depot);
        for local in self.locals.iter_mut() {
            drain(&mut local.data_mut().magazine);
        }
        drain(&mut self.shared.data_mut().magazine);
        let mut idle = Some(idle);
        catch(&mut panicked, &mut || {
            self.release(idle.take().expect("taken once"));
        });
        if let Some(payload) = panicked {
            if std::thread::panicking() {
                std::mem::forget(payload);
            } else {
                std::panic::resume_unwind(payload);
            }
        }
    }
}

// SAFETY: blocks come from the backend (whose contract covers validity, alignment to a page
// and page-locking) with at least the class size ≥ the layout's size; a block is in exactly
// one place at a time (handed out, pending, or idle in one list), and pending blocks are
// reused only after their completion (an `unsafe` contract) says so. Alignment above a page
// is refused.
unsafe impl<B: PinnedAllocator, C: Completion + From<PendingUses>> PinnedAllocator for Pool<B, C> {
    #[inline]
    fn allocate(&self, layout: Layout) -> Result<Allocation> {
        if layout.align() > PAGE {
            return Err(Error::Unsupported("alignment above the page size"));
        }
        self.allocate_raw(layout.size())
    }

    #[inline]
    unsafe fn deallocate(&self, allocation: Allocation) {
        // SAFETY: forwarded from the caller: from this pool, unused, no device work.
        unsafe { self.free_raw(allocation) }
    }

    unsafe fn deallocate_after(&self, allocation: Allocation, pending: PendingUses) {
        // SAFETY: forwarded from the caller; `pending` covers the device work.
        unsafe { self.free_raw_after(allocation, C::from(pending)) }
    }

    fn numa_nodes(&self) -> usize {
        self.nodes
    }

    fn numa_node(&self) -> usize {
        self.node_slots() / SLOT_STRIDE
    }
}

/// Hashes block addresses: distinct integers that no adversary chooses, for which one
/// multiplication does what SipHash would at a fraction of the cost (every new block inserts
/// one).
#[derive(Default)]
pub(crate) struct AddressHasher(u64);

pub(crate) type BuildAddressHasher = BuildHasherDefault<AddressHasher>;

/// Blocks by address: the backend's description of each, with the slot it serves.
pub(crate) type BlockMap = Mutex<HashMap<usize, (Allocation, usize), BuildAddressHasher>>;

impl Hasher for AddressHasher {
    fn write(&mut self, bytes: &[u8]) {
        for &byte in bytes {
            self.write_u64(u64::from(byte));
        }
    }

    fn write_u64(&mut self, n: u64) {
        // The full product, folded: every bit of the address reaches the low bits the table
        // indexes by, which a plain product takes from the address's (mostly zero) low bits
        // alone. The constant added keeps a run of zeros from hashing like nothing.
        const K: u64 = 0x9e37_79b9_7f4a_7c15;
        let product = u128::from(self.0.rotate_left(5) ^ n) * u128::from(K);
        self.0 = ((product as u64) ^ ((product >> 64) as u64)).wrapping_add(K);
    }

    fn write_usize(&mut self, n: usize) {
        self.write_u64(n as u64);
    }

    fn finish(&self) -> u64 {
        self.0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn aligned_addresses_spread_over_the_low_bits() {
        // Blocks at strides from a page to a TiB, as many as a 47-bit address space holds up
        // to 4,096: their hashes' low 12 bits (the index of a table that size) should take
        // most values, as random ones would (4,096 random values take about 63% of them).
        for (shift, blocks, least) in [
            (12, 4096, 2400),
            (21, 4096, 2400),
            (30, 4096, 2400),
            (40, 128, 120),
        ] {
            let distinct: std::collections::HashSet<u64> = (0..blocks)
                .map(|k: u64| {
                    let mut hasher = AddressHasher::default();
                    hasher.write_usize((0x7f00_0000_0000 - (k << shift)) as usize);
                    hasher.finish() & 0xfff
                })
                .collect();
            assert!(
                distinct.len() >= least,
                "stride 2^{shift}: {} of {blocks}",
                distinct.len()
            );
        }
        // Zeros are not nothing.
        let hash = |bytes: &[u8]| {
            let mut hasher = AddressHasher::default();
            hasher.write(bytes);
            hasher.finish()
        };
        assert_ne!(hash(&[0]), hash(&[0, 0]));
    }
}
