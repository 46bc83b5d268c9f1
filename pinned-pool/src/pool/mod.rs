//! The pool: size-classed caches per thread over shared lists and a backend, with
//! event-gated reuse and exact statistics.

use std::alloc::Layout;
use std::fmt;
use std::panic::AssertUnwindSafe;
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
use crate::local::{Cached, Local};
use crate::pinner::Reserve;
use crate::size_class::{MAX_NODES, PAGE, SLOT_STRIDE, class_of, class_size};
use crate::system_memory::SystemMemory;
use crate::threads::PerThread;
pub(crate) mod central;

use central::{BlockMap, Central};
mod evict;
mod miss;
mod pending;
mod pressure;
mod report;
mod reserve;

/// A caching allocator of page-locked memory; see the crate documentation for the design.
///
/// A pool is a [`PinnedAllocator`]: use `&pool` (or an `Arc<Pool>`, to move buffers to other
/// threads) as the allocator of [`PinnedVec`] and the crate's other containers, and of
/// allocator-api2's: `PinnedVec::with_capacity_in(n, &pool)`. `B` is where new memory comes
/// from; `C` is what says a freed block's device work has finished ([`PendingUses`], CUDA
/// events, in real use).
///
/// # Examples
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
    /// The machine's memory, watched before pinning more.
    watch: pressure::Watch,
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
    ///
    /// # Examples
    ///
    /// ```
    /// use cuda_pinned::PinnedVec;
    /// use pinned_pool::Pool;
    /// let pool = Pool::new();
    /// let batch = PinnedVec::<f32, _>::with_capacity_in(1 << 16, &pool)?;
    /// drop(batch); // back in the pool's cache, not unpinned
    /// assert_eq!(pool.stats().active_requests.current, 0);
    /// # Ok::<(), cuda_pinned::Error>(())
    /// ```
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
    #[doc(hidden)]
    pub fn with_completion(backend: B, config: PoolConfig) -> Self {
        let nodes = backend.numa_nodes().clamp(1, MAX_NODES);
        let watch = pressure::Watch::new(match &config.memory_files {
            Some(dir) => SystemMemory::at(dir),
            None => SystemMemory::default(),
        });
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
            watch,
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

    /// Whether allocate and free take no atomic read-modify-write and no fence on their fast path.
    ///
    /// True on Linux 4.14 and later, where pausing the thread caches uses `membarrier(2)`;
    /// elsewhere each operation pays one full fence.
    #[doc(hidden)]
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

    /// An empty byte vector with room for `bytes` bytes: PyTorch's `allocate(bytes)`.
    ///
    /// The room is at least `bytes`. Fill it with `extend_from_slice`, `resize`, `io::Write`, or in
    /// place through `spare_capacity_mut` and `set_len`. Dropping it gives the block back.
    ///
    /// # Examples
    ///
    /// ```
    /// use std::io::Write;
    /// use pinned_pool::Pool;
    /// let pool = Pool::new();
    /// let mut bytes = pool.with_capacity(4096)?;
    /// bytes.write_all(b"header")?;
    /// assert_eq!(&bytes[..], b"header");
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
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

    /// A block of at least `bytes` bytes.
    ///
    /// Its [`Allocation::bytes`] is the class size and its tag the pool's own (the class, on the
    /// NUMA node the backend places memory on for this thread now); give it back with
    /// [`free_raw`](Self::free_raw) or [`free_raw_after`](Self::free_raw_after).
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
            let waited = std::panic::catch_unwind(AssertUnwindSafe(|| completion.wait()));
            if waited.is_ok() {
                // Its answer stands whatever its drop does; a drop that panics is leaked.
                let dropped = std::panic::catch_unwind(AssertUnwindSafe(|| drop(completion)));
                keep_first(&mut panicked, dropped.err());
            } else {
                // Dropping a completion that panicked may panic again: leaked with it.
                std::mem::forget(completion);
            }
            match waited {
                Ok(true) => {
                    self.pending_bytes
                        .fetch_sub(class_size(allocation.tag()), Ordering::Relaxed);
                    self.pending_requests.fetch_sub(1, Ordering::Relaxed);
                    idle.push(allocation);
                    continue;
                }
                Ok(false) => {}
                Err(payload) => keep_first(&mut panicked, Some(payload)),
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
