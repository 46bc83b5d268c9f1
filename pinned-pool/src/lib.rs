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
//! # The machine's memory
//!
//! Pinned pages can never be swapped out or reclaimed. The pool pins nothing that would leave
//! less than 5% of the machine's memory available (`MemAvailable`), giving its idle cache back
//! first; past that an allocation fails with [`cuda_pinned::Error::MemoryPressure`], which says
//! how much the pool holds. While tasks stall for memory (the kernel's pressure stall
//! information) it gives its idle cache back ([`Pool::relieve_pressure`]). Both are set in
//! [`PoolConfig`], and counted in [`PoolStats`]; misses, trims, refusals and the reserve's
//! top-ups are `tracing` spans and events.
//!
//! # Design
//!
//! How the crate works inside, and why: the [`design`] module.

#![deny(unsafe_op_in_unsafe_fn)]

pub mod design {
    #![doc = include_str!("../docs/design.md")]
}
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
mod system_memory;
mod threads;

/// What says a freed block's device work has finished: CUDA events in use, a flag in tests.
#[doc(hidden)]
pub use completion::Completion;
pub use config::{ConfigError, POOL_CONF_VAR, PoolConfig};
pub use pool::Pool;
pub use stats::{DurationStat, PoolStats, Stat};
