//! 16 threads allocating and freeing, also across threads: exact statistics and no leak.

use std::sync::{Arc, Barrier, mpsc};

use cuda_pinned::Allocation;
use pinned_pool::PoolConfig;

use crate::support::{Heap, TestPool};

const THREADS: usize = 16;

fn rounds() -> usize {
    if cfg!(miri) { 20 } else { 4000 }
}

#[test]
fn sixteen_threads_keep_exact_stats_and_leak_nothing() {
    let heap = Heap::new();
    let pool = Arc::new(TestPool::with_completion(heap.clone(), PoolConfig::new()));
    let (senders, receivers): (Vec<_>, Vec<_>) =
        (0..THREADS).map(|_| mpsc::channel::<Allocation>()).unzip();
    let handles: Vec<_> = receivers
        .into_iter()
        .enumerate()
        .map(|(t, inbox)| {
            let pool = pool.clone();
            let next = senders[(t + 1) % THREADS].clone();
            std::thread::spawn(move || {
                let mut mine = Vec::new();
                for i in 0..rounds() {
                    let size = [4096, 10_000, 70_000, 1 << 20][(i + t) % 4];
                    let block = pool.allocate_raw(size).unwrap();
                    assert!(block.bytes() >= size);
                    // SAFETY: the block is ours; the write stays inside it.
                    unsafe { block.ptr().as_ptr().write(t as u8) };
                    if i % 3 == 0 {
                        next.send(block).unwrap(); // freed by the next thread
                    } else {
                        mine.push(block);
                    }
                    if mine.len() > 8 {
                        // SAFETY: from this pool, unused.
                        unsafe { pool.free_raw(mine.swap_remove(0)) };
                    }
                    while let Ok(foreign) = inbox.try_recv() {
                        // SAFETY: from this pool, unused; sent by the thread that allocated it.
                        unsafe { pool.free_raw(foreign) };
                    }
                }
                (mine, inbox)
            })
        })
        .collect();
    drop(senders);
    let leftovers: Vec<_> = handles.into_iter().map(|h| h.join().unwrap()).collect();
    for (mine, inbox) in leftovers {
        for block in mine.into_iter().chain(inbox.try_iter()) {
            // SAFETY: from this pool, unused.
            unsafe { pool.free_raw(block) };
        }
    }
    let stats = pool.stats();
    let total = (THREADS * rounds()) as u64;
    assert_eq!(stats.active_requests.current, 0);
    assert_eq!(stats.active_bytes.current, 0);
    assert_eq!(stats.active_requests.allocated, total);
    assert_eq!(stats.active_requests.freed, total);
    assert_eq!(stats.active_bytes.allocated, stats.active_bytes.freed);
    assert_eq!(stats.cache_hits + stats.cache_misses, total);
    assert_eq!(stats.cache_misses, stats.num_host_alloc);
    assert_eq!(stats.allocations.current, heap.live() as u64);
    assert_eq!(stats.cached_bytes, stats.allocated_bytes.current);
    drop(pool);
    assert_eq!(heap.live(), 0);
}

#[test]
fn peaks_are_true_peaks_under_concurrency() {
    let heap = Heap::new();
    let pool = Arc::new(TestPool::with_completion(heap, PoolConfig::new()));
    let per_thread = if cfg!(miri) { 2 } else { 50 };
    let barrier = Arc::new(Barrier::new(THREADS));
    let handles: Vec<_> = (0..THREADS)
        .map(|_| {
            let (pool, barrier) = (pool.clone(), barrier.clone());
            std::thread::spawn(move || {
                let blocks: Vec<_> = (0..per_thread)
                    .map(|_| pool.allocate_raw(8192).unwrap())
                    .collect();
                barrier.wait(); // every thread holds all of its blocks here
                for block in blocks {
                    // SAFETY: from this pool, unused.
                    unsafe { pool.free_raw(block) };
                }
            })
        })
        .collect();
    handles.into_iter().for_each(|h| h.join().unwrap());
    let stats = pool.stats();
    assert_eq!(stats.active_requests.peak, (THREADS * per_thread) as u64);
    assert_eq!(
        stats.active_bytes.peak,
        (THREADS * per_thread * 8192) as u64
    );
    pool.reset_peak_stats();
    assert_eq!(pool.stats().active_bytes.peak, 0);

    // A producer allocates, a consumer frees: the peak is what was alive at once, not the
    // producer's running total (per-thread counters would say 1000 here).
    let (tx, rx) = mpsc::sync_channel::<Allocation>(0);
    let producer = {
        let pool = pool.clone();
        std::thread::spawn(move || {
            for _ in 0..if cfg!(miri) { 5 } else { 1000 } {
                tx.send(pool.allocate_raw(4096).unwrap()).unwrap();
            }
        })
    };
    for block in rx {
        // SAFETY: from this pool, unused.
        unsafe { pool.free_raw(block) };
    }
    producer.join().unwrap();
    assert!(pool.stats().active_requests.peak <= 2);
}

#[test]
fn pausing_calls_during_traffic_see_consistent_states() {
    let heap = Heap::new();
    let pool = Arc::new(TestPool::with_completion(heap.clone(), PoolConfig::new()));
    let workers = if cfg!(miri) { 3 } else { 8 };
    let rounds = if cfg!(miri) { 30 } else { 3000 };
    // Bounded, so that workers cannot run far ahead of the main thread's frees.
    let (tx, rx) = mpsc::sync_channel::<Allocation>(64);
    let handles: Vec<_> = (0..workers)
        .map(|t| {
            let (pool, tx) = (pool.clone(), tx.clone());
            std::thread::spawn(move || {
                for i in 0..rounds {
                    let block = pool.allocate_raw([4096, 70_000][(i + t) % 2]).unwrap();
                    if i % 5 == 0 {
                        tx.send(block).unwrap(); // freed by the main thread
                    } else {
                        // SAFETY: from this pool, unused.
                        unsafe { pool.free_raw(block) };
                    }
                }
            })
        })
        .collect();
    drop(tx);
    let mut round = 0;
    loop {
        let stats = pool.stats();
        assert_eq!(
            stats.active_requests.allocated - stats.active_requests.freed,
            stats.active_requests.current
        );
        assert!(stats.active_requests.current <= stats.active_requests.peak);
        assert!(stats.active_bytes.current <= stats.active_bytes.peak);
        // (Blocks being pinned are counted once the backend returns, outside the lock, so
        // the backend's own count may run ahead here.)
        assert!(stats.cached_bytes <= stats.allocated_bytes.current);
        match round % 4 {
            0 => pool.trim(64 << 10),
            1 => pool.empty_cache(),
            2 => pool.reset_peak_stats(),
            _ => {}
        }
        round += 1;
        // Free what the workers sent; stop once they are all done and nothing is left.
        match rx.recv_timeout(std::time::Duration::from_millis(1)) {
            // SAFETY: from this pool, unused; sent by the thread that allocated it.
            Ok(block) => unsafe { pool.free_raw(block) },
            Err(mpsc::RecvTimeoutError::Timeout) => {}
            Err(mpsc::RecvTimeoutError::Disconnected) => break,
        }
        for block in rx.try_iter() {
            // SAFETY: as above.
            unsafe { pool.free_raw(block) };
        }
    }
    handles.into_iter().for_each(|h| h.join().unwrap());
    let stats = pool.stats();
    assert_eq!(stats.active_requests.current, 0);
    assert_eq!(stats.active_requests.freed, (workers * rounds) as u64);
    assert_eq!(
        stats.cache_hits + stats.cache_misses,
        (workers * rounds) as u64
    );
    pool.empty_cache();
    assert_eq!(pool.stats().allocations.current, 0);
    assert_eq!(heap.live(), 0, "empty_cache reached every thread's cache");
}

#[test]
fn blocks_cached_by_finished_threads_are_released() {
    let heap = Heap::new();
    let pool = Arc::new(TestPool::with_completion(heap.clone(), PoolConfig::new()));
    for _ in 0..3 {
        let pool = pool.clone();
        std::thread::spawn(move || {
            let block = pool.allocate_raw(8192).unwrap();
            // SAFETY: from this pool, unused; it stays in this thread's cache.
            unsafe { pool.free_raw(block) };
        })
        .join()
        .unwrap();
    }
    // A later thread (which may reuse a finished thread's cache) still gets a cached block.
    let block = pool.allocate_raw(8192).unwrap();
    // SAFETY: from this pool, unused.
    unsafe { pool.free_raw(block) };
    let stats = pool.stats();
    assert_eq!(stats.cache_misses, 1);
    assert_eq!(stats.cached_bytes, 8192);
    pool.empty_cache();
    assert_eq!(heap.live(), 0);
}

#[test]
fn threads_taking_blocks_pinned_ahead_while_the_target_moves_keep_exact_stats() {
    const MIB: usize = 1 << 20;
    let heap = Heap::new();
    let pool = Arc::new(TestPool::with_completion(heap.clone(), PoolConfig::new()));
    pool.reserve(MIB, 4).unwrap();
    let threads = 8;
    let start = Arc::new(Barrier::new(threads + 1));
    let handles: Vec<_> = (0..threads)
        .map(|t| {
            let (pool, start) = (pool.clone(), start.clone());
            std::thread::spawn(move || {
                start.wait();
                let mut held = Vec::new();
                for i in 0..rounds() {
                    let size = if (i + t) % 3 == 0 { 64 << 10 } else { MIB };
                    held.push(pool.allocate_raw(size).unwrap());
                    // Up to a dozen held: the 1 MiB class runs dry and takes ready blocks.
                    if held.len() > 12 || i % 7 == 0 {
                        // SAFETY: from this pool, unused.
                        unsafe { pool.free_raw(held.swap_remove(0)) };
                    }
                }
                for block in held {
                    // SAFETY: from this pool, unused.
                    unsafe { pool.free_raw(block) };
                }
            })
        })
        .collect();
    start.wait();
    for i in 0..rounds() / 10 {
        pool.reserve(MIB, [0, 8, 2, 16][i % 4]).unwrap();
        let stats = pool.approximate_stats();
        assert!(stats.reserve_ready_bytes <= 16 * MIB as u64);
        if i % 5 == 0 {
            pool.empty_cache();
        }
    }
    for handle in handles {
        handle.join().unwrap();
    }
    pool.reserve(MIB, 0).unwrap();
    // A block being pinned when the target fell is released by the thread itself.
    let start = std::time::Instant::now();
    while heap.live() as u64 != pool.stats().allocations.current {
        assert!(start.elapsed().as_secs() < 60, "the reserve kept a block");
        std::thread::sleep(std::time::Duration::from_millis(1));
    }
    let stats = pool.stats();
    let total = (threads * rounds()) as u64;
    assert_eq!(stats.reserve_ready_bytes, 0);
    assert_eq!(stats.active_requests.current, 0);
    assert_eq!(stats.active_requests.allocated, total);
    assert_eq!(stats.cache_hits + stats.cache_misses, total);
    // Every miss pinned a block or took one pinned ahead; those all count as allocations.
    assert_eq!(stats.cache_misses, stats.num_host_alloc);
    assert_eq!(stats.cached_bytes, stats.allocated_bytes.current);
    drop(pool);
    assert_eq!(heap.live(), 0);
}
