//! A shard of the free lists: per-class stacks of idle blocks and the shard's running totals,
//! behind a spin lock that is almost never contended (each thread keeps to its own shard).

use std::cell::{Cell, UnsafeCell};
use std::ops::{Deref, DerefMut};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::Instant;

use cuda_pinned::Allocation;

use crate::size_class::CLASSES;

/// An idle block and, when the pool releases idle blocks, since when it has been idle.
#[derive(Debug)]
pub(crate) struct Cached {
    pub(crate) allocation: Allocation,
    pub(crate) idle_since: Option<Instant>,
}

/// What one shard holds and has counted.
#[derive(Debug)]
pub(crate) struct ShardData {
    pub(crate) free: Vec<Vec<Cached>>,
    pub(crate) hits: u64,
    pub(crate) misses: u64,
    pub(crate) handed: u64,
    pub(crate) handed_bytes: u64,
    pub(crate) returned: u64,
    pub(crate) returned_bytes: u64,
    /// With per-shard statistics: blocks handed out here less blocks given back here (it
    /// goes negative where another thread frees), and its high-water mark.
    pub(crate) active: Active,
}

/// Blocks and bytes handed out and not given back, with peaks.
#[derive(Debug, Default, Clone, Copy)]
pub(crate) struct Active {
    pub(crate) requests: i64,
    pub(crate) bytes: i64,
    pub(crate) peak_requests: i64,
    pub(crate) peak_bytes: i64,
}

impl Active {
    pub(crate) fn add(&mut self, bytes: usize) {
        self.requests += 1;
        self.bytes += bytes as i64;
        self.peak_requests = self.peak_requests.max(self.requests);
        self.peak_bytes = self.peak_bytes.max(self.bytes);
    }

    pub(crate) fn sub(&mut self, bytes: usize) {
        self.requests -= 1;
        self.bytes -= bytes as i64;
    }
}

impl ShardData {
    fn new() -> Self {
        Self {
            free: (0..CLASSES).map(|_| Vec::new()).collect(),
            hits: 0,
            misses: 0,
            handed: 0,
            handed_bytes: 0,
            returned: 0,
            returned_bytes: 0,
            active: Active::default(),
        }
    }
}

/// One shard, on its own cache lines so that shards do not share them.
#[repr(align(128))]
pub(crate) struct Shard {
    locked: AtomicBool,
    data: UnsafeCell<ShardData>,
}

// SAFETY: `data` is only reached through `lock`, which gives one guard at a time; the data
// (allocations and counters) may move between threads.
unsafe impl Sync for Shard {}
// SAFETY: as above.
unsafe impl Send for Shard {}

impl Shard {
    pub(crate) fn new() -> Self {
        Self {
            locked: AtomicBool::new(false),
            data: UnsafeCell::new(ShardData::new()),
        }
    }

    /// Takes the lock. Critical sections are a few instructions (a push or a pop), so a short
    /// spin suffices; past it the thread yields, so oversubscribed machines still progress.
    pub(crate) fn lock(&self) -> ShardGuard<'_> {
        let mut spins = 0u32;
        while self
            .locked
            .compare_exchange_weak(false, true, Ordering::Acquire, Ordering::Relaxed)
            .is_err()
        {
            while self.locked.load(Ordering::Relaxed) {
                spins += 1;
                if spins < 64 {
                    std::hint::spin_loop();
                } else {
                    std::thread::yield_now();
                }
            }
        }
        ShardGuard { shard: self }
    }

    /// The data, through exclusive access (no lock needed).
    pub(crate) fn get_mut(&mut self) -> &mut ShardData {
        self.data.get_mut()
    }
}

/// Exclusive access to a shard's data until dropped.
pub(crate) struct ShardGuard<'a> {
    shard: &'a Shard,
}

impl Deref for ShardGuard<'_> {
    type Target = ShardData;
    fn deref(&self) -> &ShardData {
        // SAFETY: the guard holds the lock, so no other reference to the data exists.
        unsafe { &*self.shard.data.get() }
    }
}

impl DerefMut for ShardGuard<'_> {
    fn deref_mut(&mut self) -> &mut ShardData {
        // SAFETY: as in `deref`, and `&mut self` makes this the only use of the guard.
        unsafe { &mut *self.shard.data.get() }
    }
}

impl Drop for ShardGuard<'_> {
    fn drop(&mut self) {
        self.shard.locked.store(false, Ordering::Release);
    }
}

/// This thread's shard among `shards`: threads take consecutive numbers, so up to `shards`
/// threads each have a shard of their own.
pub(crate) fn my_shard(shards: usize) -> usize {
    static NEXT: AtomicUsize = AtomicUsize::new(0);
    thread_local!(static NUMBER: Cell<usize> = const { Cell::new(usize::MAX) });
    let number = NUMBER.with(|n| {
        if n.get() == usize::MAX {
            n.set(NEXT.fetch_add(1, Ordering::Relaxed));
        }
        n.get()
    });
    // Most threads have a shard of their own: skip the division then.
    if number < shards {
        number
    } else {
        number % shards
    }
}
