//! A caching allocator of page-locked host memory with stream-safe reuse: PyTorch's
//! `CachingHostAllocator`, with its verbs and semantics, minus what its users report.
//!
//! ```
//! use cuda_pinned::PinnedVec;
//! use pinned_pool::Pool;
//!
//! let pool = Pool::new();
//! for step in 0..3 {
//!     // The first allocation pins memory; the next ones reuse it in nanoseconds.
//!     let mut batch = PinnedVec::<f32, _>::with_capacity_in(1 << 16, &pool)?;
//!     batch.resize(1 << 16, step as f32);
//!     // ... stream.copy_to_device(batch, &mut device) ...
//! }
//! let stats = pool.stats();
//! assert_eq!((stats.cache_misses, stats.cache_hits), (1, 2));
//! pool.empty_cache();
//! # Ok::<(), cuda_pinned::Error>(())
//! ```
//!
//! # Verbs (PyTorch → here)
//!
//! | PyTorch | pinned-pool |
//! |---|---|
//! | `allocate(size)` | [`Pool::with_capacity`] (a byte buffer), or `&pool` / `Arc<Pool>` as the allocator of any [`PinnedVec`](cuda_pinned::PinnedVec); [`Pool::allocate_raw`] for the raw block |
//! | `record_event(ptr, ctx, stream)` | `PinnedVec::record_stream(&stream)`; copies through `cuda_pinned` record themselves |
//! | `free` (deleter) | dropping the buffer (or the in-flight `Transfer`) |
//! | `empty_cache()` | [`Pool::empty_cache`] |
//! | `get_stats()`, `reset_peak_stats()` | [`Pool::stats`] (exact), [`Pool::approximate_stats`] (for monitoring: pauses nobody), [`Pool::reset_peak_stats`] |
//! | `PYTORCH_ALLOC_CONF=pinned_…` | [`PoolConfig`], or `CUDA_PINNED_POOL_CONF=max_cached_mb:1024,…` |
//! | `pinned_reserve_segment_size_mb` | [`Pool::reserve`]`(block_bytes, blocks)`: blocks of a class pinned ahead on a background thread |
//!
//! # Design note
//!
//! *Size classes.* Requests round up to a class: page multiples to 32 KiB, then eight classes
//! per power of two. No request of 4 KiB or more grows by more than 12.5% plus a page
//! (PyTorch rounds to the next power of two, up to 2×). Each block is one backend
//! allocation of its class size; a freed block serves later requests of its class.
//!
//! *Backend.* New memory comes from a [`PinnedAllocator`](cuda_pinned::PinnedAllocator):
//! by default `DefaultPinned`, which is `cuda_pinned::Registered` (huge pages, parallel
//! pre-fault, `cudaHostRegister`: about ten times faster to get than `cudaHostAlloc`) with
//! CUDA, and `mlock`ed memory without, so the pool works the same on CPU-only machines.
//!
//! *NUMA nodes.* On a machine with several nodes, `Registered` (the default backend) and
//! `VirtualHost` place new memory on the node nearest the calling thread's device, and the
//! pool keeps each node's blocks apart: a block is reused only for a request on its own node
//! (PyTorch's reuses any block anywhere). A freed block goes back to its node's lists
//! whichever thread frees it. On one node the pool never asks, and its lists are as they
//! were. Nodes numbered below 16 are kept apart; higher numbers share lists (modulo 16).
//!
//! *Several GPUs.* One pool serves every device of the process: with the default backends
//! its memory is portable (any device copies from any block; `HostLocked` memory is no
//! device's), blocks stay with the node they were pinned on, and a block used on several
//! devices' streams waits for all of them before reuse, each use recorded as an event on its
//! own stream's device.
//!
//! *Stream safety.* A buffer dropped while device work may still use it (a copy in flight, a
//! recorded stream) arrives through `deallocate_after` with an event per stream, recorded at
//! free time as PyTorch does. The block waits in a pending list and becomes reusable as soon
//! as *its* events have completed, whatever older blocks still wait on (PyTorch stops at the
//! first unfinished event: head-of-line blocking). Pending blocks are checked on every cache
//! miss and by [`Pool::process_events`].
//!
//! *Threads.* Each thread has its own cache in the pool: a short stack of idle blocks per
//! class (up to 16 blocks or 1 MiB) and its own counters. A warm allocate or free touches
//! only that cache, with no lock, no atomic read-modify-write and no fence: two plain stores
//! and a load say "inside" and check "paused". A thread whose stack is full passes its older
//! half to shared lists; one whose stack is empty refills from them; a miss there pauses
//! every cache and looks in the other threads' stacks before pinning new memory.
//!
//! A thread whose thread-locals are being destroyed (a buffer kept in a `thread_local!` and
//! dropped at thread exit) has no cache of its own any more; it is served by a shared cache
//! under the pool's lock.
//!
//! *Pausing.* `empty_cache`, `trim`, `release_idle`, `stats` and the rare peak check below
//! need every thread's cache at once. The pauser, holding the pool's lock, marks each cache
//! paused, runs `membarrier(2)` (which makes every running thread of the process execute a
//! full fence, so no fence is needed on the fast path) and waits for each owner to leave its
//! cache; owners meanwhile take the lock instead. On systems without `membarrier` the fast
//! path pays one fence instead ([`Pool::has_fence_free_fast_path`]).
//!
//! *Counters.* Each thread's counters have one writer at a time and are updated with a plain
//! load and store, but as atomics: [`Pool::stats`] pauses every cache to read one consistent
//! state, [`Pool::approximate_stats`] just reads them as they are.
//!
//! *Exact peaks without a shared counter.* PyTorch sums per-bucket peaks, an upper bound.
//! Here `active_*` peaks are true pool-wide peaks: each thread may hand out blocks while its
//! own count stays under its *ceiling*, and the ceilings of all threads add up to at most
//! the recorded peak, so the pool-wide count cannot pass the peak unseen. A thread that
//! needs a higher ceiling takes the lock: if the peak leaves room it takes some (with
//! headroom, so a loop of allocations asks a logarithmic number of times); if not, it pauses
//! every cache, sums the exact total (counting blocks that threads waiting for the lock are
//! about to take) and raises the peak to it if it is higher. Frees lower a thread's ceiling
//! to its count plus its usual headroom, returning room to the others. Once the peak covers
//! what threads hold at once, allocations take no lock; until then threads take the lock and
//! pause often while the pool learns the new peak, a short warm-up.
//!
//! *Locks and CUDA.* No CUDA call runs under a pool lock: events are queried with the pending
//! list taken out, and blocks are pinned and released with no lock held (PyTorch's own rule,
//! which its `empty_cache` breaks).
//!
//! *Limits.* [`PoolConfig`] caps idle cached bytes (freeing past it trims; with this cap set,
//! each allocate and free also updates one shared counter), total pinned bytes
//! (an allocation past it first releases idle cache, then fails with
//! `Error::LimitExceeded`), the size of blocks worth caching, and how long a block may stay
//! idle. [`Pool::trim`] shrinks the cache to a target. When the backend fails to pin, the pool
//! releases its idle cache and tries once more before returning the error (PyTorch fails at
//! once).
//!
//! *Pinning ahead.* [`Pool::reserve`] starts a thread of the pool's own that keeps a number of
//! blocks of a class pinned and ready, and pins another each time one is taken (or configure
//! it: [`PoolConfig::reserve`], `CUDA_PINNED_POOL_CONF=reserve_mb:16x64`). An allocation that
//! finds its class empty takes a ready block before anything slower (no pause, no backend
//! call), in the same hold of the pool's lock, as it would a cached block: about the cost of a
//! pool hit. Pinning runs outside every pool lock; registration holds the driver's lock for
//! its whole range, so small blocks keep other threads' copies from waiting long while the
//! pool grows. Over host memory from CUDA's virtual-memory API
//! (`Pool::with_backend(VirtualHost::new().fixed_size(), ..)`), which takes the driver's lock
//! one chunk at a time, other threads' copies hardly wait at all; that memory is slower to
//! create, which the background thread pays. `benches/RESULTS.md` has the figures.
//!
//! *Failure.* A block whose device work cannot be known (a CUDA error, or a stream recorded
//! on it that is capturing a CUDA graph when it is freed) is never reused and, when the pool
//! drops, never freed: leaking is the only safe answer to a device that may still write it.
//! It stays counted as in use, and against the pool's cap.

#![deny(unsafe_op_in_unsafe_fn)]

mod allocator_api2;
mod barrier;
mod completion;
mod config;
mod local;
mod pinner;
mod pool;
mod size_class;
mod stats;
mod sync;
mod threads;

/// What says a freed block's device work has finished: CUDA events in use, a flag in tests.
#[doc(hidden)]
pub use completion::Completion;
pub use config::{ConfigError, POOL_CONF_VAR, PoolConfig};
pub use pool::Pool;
pub use stats::{DurationStat, PoolStats, Stat};
