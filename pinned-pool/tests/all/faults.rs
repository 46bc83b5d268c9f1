//! A backend that fails: for every N, a program whose Nth backend call fails (once, or from
//! then on) gets the error back, keeps consistent statistics, and leaks nothing.

use cuda_pinned::Error;
use pinned_pool::PoolConfig;

use crate::support::{Flag, Heap, TestPool};

/// A fixed program touching every path: misses, hits, pending blocks, trims, empty_cache.
/// Returns how many allocations failed.
fn program(pool: &TestPool) -> usize {
    let sizes = [
        5000,
        1 << 20,
        3_000_000,
        5000,
        64 << 10,
        1 << 20,
        12_345,
        3_000_000,
    ];
    let mut live = Vec::new();
    let mut flags = Vec::new();
    let mut failures = 0;
    for (step, &size) in sizes.iter().cycle().take(40).enumerate() {
        match pool.allocate_raw(size) {
            Ok(block) => {
                assert!(block.bytes() >= size);
                live.push(block);
            }
            Err(Error::OutOfMemory { .. }) => failures += 1,
            Err(other) => panic!("unexpected error {other}"),
        }
        if step % 3 == 2 && !live.is_empty() {
            let block = live.remove(0);
            let flag = Flag::default();
            flags.push(flag.clone());
            // SAFETY: from this pool; the flag stands for device work.
            unsafe { pool.free_raw_after(block, flag) };
        }
        if step % 4 == 3 && !live.is_empty() {
            // SAFETY: from this pool, unused.
            unsafe { pool.free_raw(live.remove(0)) };
        }
        if step % 5 == 4 {
            flags.iter().step_by(2).for_each(Flag::finish);
        }
        if step % 11 == 10 {
            pool.trim(1 << 20);
        }
        if step == 30 {
            pool.empty_cache();
        }
        let stats = pool.stats();
        assert_eq!(stats.active_requests.current, live.len() as u64);
        assert_eq!(
            stats.active_requests.allocated - stats.active_requests.freed,
            stats.active_requests.current
        );
    }
    for block in live {
        // SAFETY: from this pool, unused.
        unsafe { pool.free_raw(block) };
    }
    flags.iter().for_each(Flag::finish);
    failures
}

fn clean_calls() -> usize {
    let heap = Heap::new();
    let pool = TestPool::with_completion(heap.clone(), PoolConfig::new());
    assert_eq!(program(&pool), 0);
    drop(pool);
    assert_eq!(heap.live(), 0);
    heap.calls.load(std::sync::atomic::Ordering::SeqCst)
}

#[test]
fn a_single_failure_is_retried_after_releasing_the_cache() {
    for n in 0..clean_calls() {
        let heap = Heap::failing(n, n + 1);
        let pool = TestPool::with_completion(heap.clone(), PoolConfig::new());
        assert_eq!(program(&pool), 0, "failing call {n} was not retried");
        let stats = pool.stats();
        assert_eq!(stats.allocations.current, heap.live() as u64);
        drop(pool);
        assert_eq!(heap.live(), 0, "leak when call {n} failed");
    }
}

#[test]
fn lasting_failures_come_back_as_errors() {
    for n in 0..clean_calls() {
        let heap = Heap::failing(n, usize::MAX);
        let pool = TestPool::with_completion(heap.clone(), PoolConfig::new());
        let failures = program(&pool);
        assert!(failures > 0 || n >= heap.calls.load(std::sync::atomic::Ordering::SeqCst));
        let stats = pool.stats();
        assert_eq!(stats.cache_hits + stats.cache_misses + failures as u64, 40);
        assert_eq!(stats.allocations.current, heap.live() as u64);
        drop(pool);
        assert_eq!(heap.live(), 0, "leak when calls from {n} failed");
    }
}

#[test]
fn the_pinned_cap_releases_cache_then_refuses() {
    let heap = Heap::new();
    let pool = TestPool::with_completion(heap.clone(), PoolConfig::new().max_pinned_bytes(4 << 20));
    let a = pool.allocate_raw(2 << 20).unwrap();
    let b = pool.allocate_raw(1 << 20).unwrap();
    // SAFETY: from this pool, unused.
    unsafe { pool.free_raw(b) };
    // 2 MiB more does not fit beside 2 MiB in use and 1 MiB cached: the cache goes first.
    let c = pool.allocate_raw(2 << 20).unwrap();
    assert_eq!(pool.stats().cached_bytes, 0);
    match pool.allocate_raw(1 << 20) {
        Err(Error::LimitExceeded {
            requested,
            pinned,
            limit,
        }) => {
            assert_eq!((requested, pinned, limit), (1 << 20, 4 << 20, 4 << 20));
        }
        other => panic!("expected the limit, got {other:?}"),
    }
    // SAFETY: from this pool, unused.
    unsafe {
        pool.free_raw(a);
        pool.free_raw(c);
    }
    drop(pool);
    assert_eq!(heap.live(), 0);
}

#[test]
fn the_cached_cap_and_block_cap_and_idle_release() {
    let heap = Heap::new();
    let config = PoolConfig::new()
        .max_cached_bytes(1 << 20)
        .max_block_cached_bytes(8 << 20);
    let pool = TestPool::with_completion(heap.clone(), config);
    let blocks: Vec<_> = (0..4)
        .map(|_| pool.allocate_raw(512 << 10).unwrap())
        .collect();
    let big = pool.allocate_raw(16 << 20).unwrap();
    for block in blocks.into_iter().chain([big]) {
        // SAFETY: from this pool, unused.
        unsafe { pool.free_raw(block) };
    }
    let stats = pool.stats();
    assert!(
        stats.cached_bytes <= 1 << 20,
        "cached {}",
        stats.cached_bytes
    );
    assert_eq!(
        stats.allocations.current, 2,
        "the big block and two of the small ones went back"
    );

    let pool = TestPool::with_completion(
        heap.clone(),
        PoolConfig::new().idle_release(std::time::Duration::ZERO),
    );
    let block = pool.allocate_raw(4096).unwrap();
    // SAFETY: from this pool, unused.
    unsafe { pool.free_raw(block) };
    pool.release_idle();
    assert_eq!(pool.stats().allocations.current, 0);
}

/// A backend that panics on the thread named "panicking".
#[derive(Clone, Default)]
struct PanicsHere(Heap);

// SAFETY: forwards to `Heap` (or panics before allocating).
unsafe impl cuda_pinned::PinnedAllocator for PanicsHere {
    fn allocate(&self, layout: std::alloc::Layout) -> cuda_pinned::Result<cuda_pinned::Allocation> {
        if std::thread::current().name() == Some("panicking") {
            panic!("backend failure");
        }
        self.0.allocate(layout)
    }

    unsafe fn deallocate(&self, allocation: cuda_pinned::Allocation) {
        // SAFETY: forwarded from the caller.
        unsafe { self.0.deallocate(allocation) }
    }
}

/// An allocation whose backend unwinds leaves no wish behind: another thread that raises the
/// peak counts only what is really handed out.
#[test]
fn an_unwinding_backend_leaves_the_peaks_exact() {
    let pool = pinned_pool::Pool::with_backend(PanicsHere::default(), PoolConfig::new());
    std::thread::scope(|scope| {
        let pool = &pool;
        let (caught, done) = std::sync::mpsc::channel();
        let (go_on, wait) = std::sync::mpsc::channel::<()>();
        std::thread::Builder::new()
            .name("panicking".into())
            .spawn_scoped(scope, move || {
                let unwound = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                    pool.allocate_raw(1 << 20)
                }));
                caught.send(unwound.is_err()).unwrap();
                // The thread (and its cache) lives on while the other allocates.
                wait.recv().unwrap();
            })
            .unwrap();
        assert!(done.recv().unwrap(), "the backend was expected to panic");
        let block = pool.with_capacity(4096).unwrap();
        let peak = pool.stats().active_bytes.peak;
        assert_eq!(peak, 4096, "a block never taken was counted in the peak");
        drop(block);
        go_on.send(()).unwrap();
    });
}

/// A completion that answers "finished", or panics when asked.
struct FinishedOrPanics {
    panics: bool,
}

// SAFETY: "finished" is only said of blocks no device ever used.
unsafe impl pinned_pool::Completion for FinishedOrPanics {
    fn is_complete(&mut self) -> bool {
        assert!(!self.panics, "completion panicked (on purpose)");
        true
    }

    fn wait(&mut self) -> bool {
        !self.panics
    }
}

/// A completion that panics leaks its own block (never reused) and nothing else: the blocks
/// pending with it that finished reach the cache, and the counts stay exact.
#[test]
#[cfg_attr(miri, ignore = "leaks a block on purpose, which Miri reports")]
fn a_panicking_completion_leaks_its_block_only() {
    let heap = Heap::new();
    let pool = pinned_pool::Pool::<Heap, FinishedOrPanics>::with_completion(
        heap.clone(),
        PoolConfig::new(),
    );
    let blocks: Vec<_> = (0..4).map(|_| pool.allocate_raw(4096).unwrap()).collect();
    for (i, block) in blocks.into_iter().enumerate() {
        // SAFETY: from this pool; no device work used it.
        unsafe { pool.free_raw_after(block, FinishedOrPanics { panics: i == 2 }) };
    }
    let caught = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| pool.process_events()));
    assert!(caught.is_err(), "the completion's panic was swallowed");
    let stats = pool.stats();
    assert_eq!(stats.cached_bytes, 3 * 4096, "{stats:?}");
    assert_eq!(stats.pending_requests, 0, "{stats:?}");
    // The three come back as hits; the leaked block is never handed out again.
    let again: Vec<_> = (0..4).map(|_| pool.allocate_raw(4096).unwrap()).collect();
    assert_eq!(heap.live(), 5, "the leaked block was reused or freed");
    for block in again {
        // SAFETY: from this pool, unused.
        unsafe { pool.free_raw(block) };
    }
    drop(pool);
    assert_eq!(heap.live(), 1, "only the leaked block stays");
}

/// A backend whose `deallocate` panics once.
#[derive(Clone, Default)]
struct FreePanicsOnce(Heap, std::sync::Arc<std::sync::atomic::AtomicBool>);

// SAFETY: forwards to `Heap` (or panics before freeing).
unsafe impl cuda_pinned::PinnedAllocator for FreePanicsOnce {
    fn allocate(&self, layout: std::alloc::Layout) -> cuda_pinned::Result<cuda_pinned::Allocation> {
        self.0.allocate(layout)
    }

    unsafe fn deallocate(&self, allocation: cuda_pinned::Allocation) {
        if !self.1.swap(true, std::sync::atomic::Ordering::SeqCst) {
            panic!("backend failed to free (on purpose)");
        }
        // SAFETY: forwarded from the caller.
        unsafe { self.0.deallocate(allocation) }
    }
}

/// A free that panics while the pool empties its cache loses that block (still counted
/// against the cap, since whether it was freed is unknown) and frees every other one.
#[test]
#[cfg_attr(miri, ignore = "leaks a block on purpose, which Miri reports")]
fn a_panicking_free_loses_its_block_only() {
    let backend = FreePanicsOnce::default();
    let pool = pinned_pool::Pool::with_backend(
        backend.clone(),
        PoolConfig::new().max_pinned_bytes(5 * 4096),
    );
    let blocks: Vec<_> = (0..5).map(|_| pool.allocate_raw(4096).unwrap()).collect();
    for block in blocks {
        // SAFETY: from this pool, unused.
        unsafe { pool.free_raw(block) };
    }
    let caught = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| pool.empty_cache()));
    assert!(caught.is_err(), "the backend's panic was swallowed");
    assert_eq!(backend.0.live(), 1, "the other blocks were not freed");
    assert_eq!(pool.stats().cached_bytes, 0);
    // Four blocks' room under the cap is back; the lost one's is not.
    let again: Vec<_> = (0..4).map(|_| pool.allocate_raw(4096).unwrap()).collect();
    assert!(
        pool.allocate_raw(4096).is_err(),
        "the lost block left the cap"
    );
    for block in again {
        // SAFETY: from this pool, unused.
        unsafe { pool.free_raw(block) };
    }
}

/// A completion whose wait panics, for the pool's drop.
struct WaitPanics {
    panics: bool,
}

// SAFETY: "finished" is only said of blocks no device ever used.
unsafe impl pinned_pool::Completion for WaitPanics {
    fn is_complete(&mut self) -> bool {
        false
    }

    fn wait(&mut self) -> bool {
        assert!(!self.panics, "wait panicked (on purpose)");
        true
    }
}

/// A pool dropped with a completion whose wait panics gives every other block back, then
/// lets the panic continue.
#[test]
#[cfg_attr(miri, ignore = "leaks a block on purpose, which Miri reports")]
fn dropping_the_pool_past_a_panicking_wait_frees_the_other_blocks() {
    let heap = Heap::new();
    let pool =
        pinned_pool::Pool::<Heap, WaitPanics>::with_completion(heap.clone(), PoolConfig::new());
    let blocks: Vec<_> = (0..6).map(|_| pool.allocate_raw(4096).unwrap()).collect();
    for (i, block) in blocks.into_iter().enumerate() {
        // SAFETY: from this pool; no device work used it.
        unsafe { pool.free_raw_after(block, WaitPanics { panics: i == 1 }) };
    }
    let idle = pool.allocate_raw(8192).unwrap();
    // SAFETY: from this pool, unused.
    unsafe { pool.free_raw(idle) };
    let caught = std::panic::catch_unwind(std::panic::AssertUnwindSafe(move || drop(pool)));
    assert!(caught.is_err(), "the completion's panic was swallowed");
    assert_eq!(heap.live(), 1, "only the panicking block may stay");
}

/// A completion whose drop panics, after answering "finished".
struct DropPanics;

// SAFETY: "finished" is only said of blocks no device ever used.
unsafe impl pinned_pool::Completion for DropPanics {
    fn is_complete(&mut self) -> bool {
        false
    }

    fn wait(&mut self) -> bool {
        true
    }
}

impl Drop for DropPanics {
    fn drop(&mut self) {
        panic!("a completion's drop panicked (on purpose)");
    }
}

/// A pool dropped with completions whose drop panics still gives every block back.
#[test]
#[cfg_attr(miri, ignore = "leaks panic payloads on purpose, which Miri reports")]
fn dropping_the_pool_past_completions_whose_drop_panics_frees_every_block() {
    let heap = Heap::new();
    let pool =
        pinned_pool::Pool::<Heap, DropPanics>::with_completion(heap.clone(), PoolConfig::new());
    let blocks: Vec<_> = (0..7).map(|_| pool.allocate_raw(4096).unwrap()).collect();
    for block in blocks {
        // SAFETY: from this pool; no device work used it.
        unsafe { pool.free_raw_after(block, DropPanics) };
    }
    let caught = std::panic::catch_unwind(std::panic::AssertUnwindSafe(move || drop(pool)));
    assert!(caught.is_err(), "the drop's panic was swallowed");
    assert_eq!(heap.live(), 0, "blocks were leaked");
}
