//! What once went wrong: a cap on cached bytes raced with eviction, a buffer dropped from a
//! thread-local at thread exit, an element destructor that panics, approximate statistics.

use std::cell::RefCell;
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Barrier};
use std::time::{Duration, Instant};

use cuda_pinned::PinnedVec;
use pinned_pool::PoolConfig;

use crate::support::{Heap, HeapPool, TestPool};

struct StopOnDrop<'a>(&'a AtomicBool);

impl Drop for StopOnDrop<'_> {
    fn drop(&mut self) {
        self.0.store(true, Ordering::SeqCst);
    }
}

/// Frees race with `empty_cache` and `trim` under a cap on cached bytes. The idle-bytes count
/// must never wrap (a debug build panicked inside `deallocate`; a release build trimmed
/// everything later on), and must come out exact.
#[test]
fn a_cache_cap_survives_frees_racing_with_eviction() {
    const CAP: usize = 64 << 10;
    let heap = Heap::new();
    let pool = TestPool::with_completion(heap.clone(), PoolConfig::new().max_cached_bytes(CAP));
    let run_for = if cfg!(miri) {
        Duration::ZERO
    } else {
        Duration::from_millis(500)
    };
    let rounds = if cfg!(miri) { 8 } else { usize::MAX };
    let stop = AtomicBool::new(false);
    let start = Barrier::new(6);
    std::thread::scope(|scope| {
        for t in 0..4 {
            let (pool, stop, start) = (&pool, &stop, &start);
            scope.spawn(move || {
                // Stops the evicting threads however this one ends (a panic included).
                let _stop = StopOnDrop(stop);
                start.wait();
                let began = Instant::now();
                for i in 0..rounds {
                    let sizes = [4096, 8192, 16384];
                    let blocks: Vec<_> = (0..3)
                        .map(|k| pool.allocate_raw(sizes[(i + k + t) % 3]).unwrap())
                        .collect();
                    for block in blocks {
                        // SAFETY: from this pool, unused.
                        unsafe { pool.free_raw(block) };
                    }
                    if began.elapsed() > run_for && i >= rounds.min(30) {
                        break;
                    }
                }
            });
        }
        for t in 0..2 {
            let (pool, stop, start) = (&pool, &stop, &start);
            scope.spawn(move || {
                start.wait();
                // Under Miri every call is slow: a few suffice to interleave.
                let mut calls = 0;
                let enough = |calls| cfg!(miri) && calls == 6;
                while !stop.load(Ordering::SeqCst) && !enough(calls) {
                    calls += 1;
                    if t == 0 {
                        pool.empty_cache();
                    } else {
                        pool.trim(4096);
                    }
                    std::thread::yield_now();
                }
            });
        }
    });
    let stats = pool.stats();
    assert_eq!(stats.active_requests.current, 0);
    assert!(stats.cached_bytes <= CAP as u64, "{stats:?}");
    // Had the count drifted high, these frees (40 KiB, under the cap) would be trimmed away.
    pool.empty_cache();
    let blocks: Vec<_> = (0..10).map(|_| pool.allocate_raw(4096).unwrap()).collect();
    for block in blocks {
        // SAFETY: from this pool, unused.
        unsafe { pool.free_raw(block) };
    }
    assert_eq!(pool.stats().cached_bytes, 40 << 10);
    drop(pool);
    assert_eq!(heap.live(), 0);
}

thread_local! {
    static KEPT: RefCell<Option<PinnedVec<u8, Arc<HeapPool>>>> = const { RefCell::new(None) };
}

/// A buffer kept in a user's `thread_local!` is dropped at thread exit, possibly after the
/// pool's own per-thread state is gone. That must free the block (not abort the process).
#[test]
fn buffers_dropped_by_thread_local_destructors_come_back() {
    let heap = Heap::new();
    let pool = Arc::new(HeapPool::with_backend(heap.clone(), PoolConfig::new()));
    for first_use_of_the_pool_before_the_user_thread_local in [false, true] {
        let pool_in = pool.clone();
        std::thread::spawn(move || {
            if first_use_of_the_pool_before_the_user_thread_local {
                drop(PinnedVec::<u8, _>::with_capacity_in(1, pool_in.clone()).unwrap());
            }
            // Touching the thread-local first makes it outlive the pool's state on glibc,
            // which destroys thread-locals in the reverse order of their first use.
            KEPT.with(|kept| assert!(kept.borrow().is_none()));
            let mut buffer = PinnedVec::with_capacity_in(10_000, pool_in).unwrap();
            buffer.extend_from_slice(&[7; 10_000]);
            KEPT.with(|kept| *kept.borrow_mut() = Some(buffer));
        })
        .join()
        .unwrap();
        let stats = pool.stats();
        assert_eq!(stats.active_requests.current, 0, "{stats:?}");
        assert!(stats.cached_bytes >= 10_000, "{stats:?}");
    }
    // The blocks given back at exit are reused.
    let misses = pool.stats().cache_misses;
    let again = PinnedVec::<u8, _>::with_capacity_in(10_000, &*pool).unwrap();
    assert_eq!(pool.stats().cache_misses, misses);
    drop(again);
    pool.empty_cache();
    assert_eq!(heap.live(), 0);
}

#[test]
fn a_panicking_element_destructor_gives_the_block_back_to_the_pool() {
    struct Bomb(#[allow(dead_code, reason = "not zero-sized, so it allocates")] u64);
    impl Drop for Bomb {
        fn drop(&mut self) {
            panic!("element destructor panicked (on purpose)");
        }
    }
    let heap = Heap::new();
    let pool = HeapPool::with_backend(heap.clone(), PoolConfig::new());
    let mut v = PinnedVec::new_in(&pool);
    v.push(Bomb(0));
    assert!(catch_unwind(AssertUnwindSafe(move || drop(v))).is_err());
    assert_eq!(pool.stats().active_requests.current, 0);
    drop(pool);
    assert_eq!(heap.live(), 0, "the pool freed every block when it dropped");
}

#[test]
fn approximate_stats_agree_with_exact_ones_when_quiet() {
    let pool = TestPool::with_completion(Heap::new(), PoolConfig::new());
    let held: Vec<_> = (0..5)
        .map(|i| pool.allocate_raw(4096 << i).unwrap())
        .collect();
    let (exact, approximate) = (pool.stats(), pool.approximate_stats());
    assert_eq!(exact, approximate);
    for block in held {
        // SAFETY: from this pool, unused.
        unsafe { pool.free_raw(block) };
    }
    let (exact, approximate) = (pool.stats(), pool.approximate_stats());
    assert_eq!(exact.cached_bytes, 31 * 4096);
    assert_eq!(exact, approximate);
}
