//! Pinning ahead of need: the reserve thread, over the counting heap backend.

use std::alloc::Layout;
use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex, mpsc};
use std::time::{Duration, Instant};

use cuda_pinned::{Allocation, Error, PinnedAllocator, Result};
use pinned_pool::{Pool, PoolConfig};

use crate::support::Heap;

/// The heap backend, noting which thread made each allocation.
#[derive(Clone, Default)]
struct Noting {
    heap: Heap,
    threads: Arc<Mutex<Vec<String>>>,
}

// SAFETY: forwards to `Heap`.
unsafe impl PinnedAllocator for Noting {
    fn allocate(&self, layout: Layout) -> Result<Allocation> {
        let name = std::thread::current().name().unwrap_or("").to_owned();
        self.threads.lock().unwrap().push(name);
        self.heap.allocate(layout)
    }

    unsafe fn deallocate(&self, allocation: Allocation) {
        // SAFETY: forwarded from the caller.
        unsafe { self.heap.deallocate(allocation) }
    }
}

/// The heap backend, whose allocations on the reserve thread wait until the gate opens.
#[derive(Clone, Default)]
struct Gated {
    heap: Heap,
    /// The reserve thread is waiting at the gate.
    waiting: Arc<AtomicBool>,
    /// The reserve thread got its block.
    pinned: Arc<AtomicBool>,
    gate: Arc<(Mutex<bool>, Condvar)>,
}

impl Gated {
    fn open(&self) {
        *self.gate.0.lock().unwrap() = true;
        self.gate.1.notify_all();
    }
}

// SAFETY: forwards to `Heap`.
unsafe impl PinnedAllocator for Gated {
    fn allocate(&self, layout: Layout) -> Result<Allocation> {
        if std::thread::current().name() != Some("pinned-pool-reserve") {
            return self.heap.allocate(layout);
        }
        self.waiting.store(true, Ordering::SeqCst);
        let (open, opened) = &*self.gate;
        drop(
            opened
                .wait_while(open.lock().unwrap(), |open| !*open)
                .unwrap(),
        );
        let block = self.heap.allocate(layout);
        self.pinned.store(true, Ordering::SeqCst);
        block
    }

    unsafe fn deallocate(&self, allocation: Allocation) {
        // SAFETY: forwarded from the caller.
        unsafe { self.heap.deallocate(allocation) }
    }
}

/// The heap backend pinning a page more than asked, which checks that every block comes back
/// as it described it.
#[derive(Clone, Default)]
struct Padded {
    heap: Heap,
    /// Bytes of each block out, by address.
    out: Arc<Mutex<HashMap<usize, usize>>>,
}

// SAFETY: forwards to `Heap`, with a larger layout.
unsafe impl PinnedAllocator for Padded {
    fn allocate(&self, layout: Layout) -> Result<Allocation> {
        let padded = Layout::from_size_align(layout.size() + PAGE, layout.align()).unwrap();
        let block = self.heap.allocate(padded)?;
        let address = block.ptr().as_ptr() as usize;
        self.out.lock().unwrap().insert(address, block.bytes());
        Ok(block)
    }

    unsafe fn deallocate(&self, allocation: Allocation) {
        let address = allocation.ptr().as_ptr() as usize;
        let bytes = self.out.lock().unwrap().remove(&address);
        assert_eq!(bytes, Some(allocation.bytes()), "not the block as pinned");
        // SAFETY: forwarded from the caller.
        unsafe { self.heap.deallocate(allocation) }
    }
}

/// Waits until `done` holds; fails the test after a minute (a thread that never got there).
fn eventually(what: &str, mut done: impl FnMut() -> bool) {
    let start = Instant::now();
    while !done() {
        assert!(start.elapsed() < Duration::from_secs(60), "never: {what}");
        std::thread::sleep(Duration::from_millis(1));
    }
}

const MIB: usize = 1 << 20;
const PAGE: usize = 4096;

#[test]
fn allocations_take_blocks_pinned_ahead_and_the_thread_tops_up() {
    let backend = Noting::default();
    let pool = Pool::with_backend(backend.clone(), PoolConfig::new());
    pool.reserve(MIB, 3).unwrap();
    eventually("3 MiB ready", || {
        pool.stats().reserve_ready_bytes == 3 * MIB as u64
    });

    let held: Vec<_> = (0..3).map(|_| pool.with_capacity(MIB).unwrap()).collect();
    let stats = pool.stats();
    assert_eq!(stats.cache_misses, 3);
    assert_eq!(stats.active_bytes.current, 3 * MIB as u64);
    // The thread pins three more in their place.
    eventually("topped up", || {
        pool.stats().reserve_ready_bytes == 3 * MIB as u64
    });
    // Every block came from the reserve thread: no allocation waited for the backend.
    let threads = backend.threads.lock().unwrap().clone();
    assert_eq!(threads.len(), 6);
    assert!(
        threads.iter().all(|name| name == "pinned-pool-reserve"),
        "{threads:?}"
    );
    // Blocks pinned ahead are pinned memory: the approximate figures leave them out of idle.
    let approximate = pool.approximate_stats();
    assert_eq!(approximate.cached_bytes, 0);
    assert_eq!(approximate.reserve_ready_bytes, 3 * MIB as u64);
    drop(held);
    assert_eq!(pool.stats().cached_bytes, 3 * MIB as u64);

    // Other classes still pin on the allocating thread.
    drop(pool.with_capacity(4096).unwrap());
    let this = std::thread::current().name().unwrap_or("").to_owned();
    assert_eq!(backend.threads.lock().unwrap().last(), Some(&this));
}

#[test]
fn the_thread_is_joined_and_its_blocks_released_when_the_pool_drops() {
    let heap = Heap::new();
    let pool = Pool::with_backend(heap.clone(), PoolConfig::new());
    pool.reserve(MIB, 4).unwrap();
    pool.reserve(64 << 10, 2).unwrap();
    eventually("all ready", || {
        pool.stats().reserve_ready_bytes == 4 * MIB as u64 + 2 * (64 << 10)
    });
    let held = pool.with_capacity(MIB).unwrap();
    drop(held);
    drop(pool);
    assert_eq!(heap.live(), 0, "blocks pinned ahead outlived the pool");
    // The thread's clone of the backend is gone: the thread has ended.
    assert_eq!(Arc::strong_count(&heap.live), 1);
}

#[test]
fn errors_are_kept_counted_and_retried_on_the_next_call() {
    let heap = Heap::failing(0, 1);
    let pool = Pool::with_backend(heap.clone(), PoolConfig::new());
    assert!(pool.take_reserve_error().is_none());
    pool.reserve(MIB, 2).unwrap();
    eventually("the failure counted", || pool.stats().reserve_failures == 1);
    assert!(matches!(
        pool.take_reserve_error(),
        Some(Error::OutOfMemory { .. })
    ));
    assert!(
        pool.take_reserve_error().is_none(),
        "the error is handed out once"
    );
    // The class was given up on; asking again retries it.
    pool.reserve(MIB, 2).unwrap();
    eventually("2 MiB ready", || {
        pool.stats().reserve_ready_bytes == 2 * MIB as u64
    });
    assert_eq!(pool.stats().reserve_failures, 1);
}

#[test]
fn blocks_pinned_ahead_count_against_the_pinned_cap() {
    let heap = Heap::new();
    let pool = Pool::with_backend(heap.clone(), PoolConfig::new().max_pinned_bytes(3 * MIB));
    // More than the cap at all is refused at once.
    assert!(matches!(
        pool.reserve(MIB, 4),
        Err(Error::LimitExceeded { .. })
    ));
    // Within it, the thread meets the cap that an allocation in use takes part of.
    let held = pool.with_capacity(MIB).unwrap();
    pool.reserve(MIB, 3).unwrap();
    eventually("the cap met", || pool.stats().reserve_failures == 1);
    assert_eq!(pool.stats().reserve_ready_bytes, 2 * MIB as u64);
    assert!(matches!(
        pool.take_reserve_error(),
        Some(Error::LimitExceeded { limit, .. }) if limit == 3 * MIB
    ));
    // Nothing more fits, even on the allocating thread.
    let a = pool.with_capacity(MIB).unwrap();
    let b = pool.with_capacity(MIB).unwrap();
    assert!(matches!(
        pool.with_capacity(4096),
        Err(Error::LimitExceeded { .. })
    ));
    drop((a, b, held));
    drop(pool);
    assert_eq!(heap.live(), 0);
}

#[test]
fn a_reserve_of_zero_stops_pinning_and_bad_sizes_are_refused() {
    let heap = Heap::new();
    let pool = Pool::with_backend(heap.clone(), PoolConfig::new());
    assert!(matches!(
        pool.reserve(usize::MAX, 1),
        Err(Error::CapacityOverflow)
    ));
    pool.reserve(MIB, 1).unwrap();
    eventually("ready", || pool.stats().reserve_ready_bytes == MIB as u64);
    // A target of 0 releases what is ready and pins no more.
    pool.reserve(MIB, 0).unwrap();
    assert_eq!(heap.live(), 0);
    assert_eq!(pool.approximate_stats().cached_bytes, 0);
    drop(pool.with_capacity(MIB).unwrap());
    std::thread::sleep(Duration::from_millis(20));
    assert_eq!(
        pool.stats().reserve_ready_bytes,
        0,
        "topped up past a target of 0"
    );
}

#[test]
fn blocks_whose_device_work_finished_come_before_blocks_pinned_ahead() {
    use crate::support::{Flag, TestPool};
    let heap = Heap::new();
    let pool = TestPool::with_completion(heap.clone(), PoolConfig::new());
    pool.reserve(4096, 2).unwrap();
    eventually("ready", || pool.stats().reserve_ready_bytes == 2 * 4096);
    for _ in 0..100 {
        let block = pool.allocate_raw(4096).unwrap();
        let done = Flag::default();
        done.finish();
        // SAFETY: allocated above from this pool; nothing uses it.
        unsafe { pool.free_raw_after(block, done) };
    }
    // One block in use at a time: the finished ones are reused, the pool does not grow.
    eventually("settled", || pool.stats().reserve_ready_bytes == 2 * 4096);
    assert!(
        heap.live() <= 4,
        "{} blocks pinned for one in use",
        heap.live()
    );
}

/// A backend that panics on the reserve thread.
#[derive(Clone, Default)]
struct PanicsAhead(Heap);

// SAFETY: forwards to `Heap` (or panics before allocating).
unsafe impl PinnedAllocator for PanicsAhead {
    fn allocate(&self, layout: Layout) -> Result<Allocation> {
        if std::thread::current().name() == Some("pinned-pool-reserve") {
            panic!("backend failure on the reserve thread");
        }
        self.0.allocate(layout)
    }

    unsafe fn deallocate(&self, allocation: Allocation) {
        // SAFETY: forwarded from the caller.
        unsafe { self.0.deallocate(allocation) }
    }
}

#[test]
fn a_panicking_backend_is_an_error_and_gives_its_count_back() {
    let backend = PanicsAhead::default();
    let pool = Pool::with_backend(backend, PoolConfig::new().max_pinned_bytes(2 * MIB));
    pool.reserve(MIB, 1).unwrap();
    eventually("the failure counted", || pool.stats().reserve_failures >= 1);
    assert!(matches!(
        pool.take_reserve_error(),
        Some(Error::Unsupported(_))
    ));
    assert_eq!(pool.approximate_stats().cached_bytes, 0);
    // The whole cap is still there for allocations on this thread.
    let a = pool.with_capacity(MIB).unwrap();
    let b = pool.with_capacity(MIB).unwrap();
    drop((a, b));
    // The thread lives on: asking again counts a second failure.
    pool.reserve(MIB, 1).unwrap();
    eventually("a second failure", || pool.stats().reserve_failures >= 2);
}

/// A panic payload whose own drop panics.
struct Bomb;

impl Drop for Bomb {
    fn drop(&mut self) {
        panic!("the payload's drop panicked (on purpose)");
    }
}

/// A backend that panics on the reserve thread with a [`Bomb`].
#[derive(Clone, Default)]
struct BombsAhead(Heap);

// SAFETY: forwards to `Heap` (or panics before allocating).
unsafe impl PinnedAllocator for BombsAhead {
    fn allocate(&self, layout: Layout) -> Result<Allocation> {
        if std::thread::current().name() == Some("pinned-pool-reserve") {
            std::panic::panic_any(Bomb);
        }
        self.0.allocate(layout)
    }

    unsafe fn deallocate(&self, allocation: Allocation) {
        // SAFETY: forwarded from the caller.
        unsafe { self.0.deallocate(allocation) }
    }
}

/// The thread survives a panic whose payload panics when dropped: the failure is reported
/// and its count given back.
#[test]
#[cfg_attr(miri, ignore = "leaks a panic payload on purpose, which Miri reports")]
fn a_backend_panic_whose_payload_panics_is_reported_and_gives_its_count_back() {
    let pool = Pool::with_backend(
        BombsAhead::default(),
        PoolConfig::new().max_pinned_bytes(2 * MIB),
    );
    pool.reserve(MIB, 1).unwrap();
    eventually("the failure counted", || pool.stats().reserve_failures >= 1);
    assert!(pool.take_reserve_error().is_some());
    let a = pool.with_capacity(MIB).unwrap();
    let b = pool.with_capacity(MIB).unwrap();
    drop((a, b));
}

/// What a reserve would pin is checked when it is asked for.
#[test]
fn reserves_of_empty_blocks_or_past_the_cap_are_refused() {
    let pool = Pool::with_backend(Heap::new(), PoolConfig::new());
    assert!(matches!(pool.reserve(0, 4), Err(Error::Unsupported(_))));
    assert!(matches!(
        pool.reserve(MIB, usize::MAX),
        Err(Error::CapacityOverflow)
    ));
    // Without a cap, the machine's memory is the limit.
    assert!(matches!(
        pool.reserve(1 << 30, 1 << 24),
        Err(Error::LimitExceeded { .. })
    ));
    let capped = Pool::with_backend(Heap::new(), PoolConfig::new().max_pinned_bytes(4 * MIB));
    assert!(matches!(
        capped.reserve(MIB, 5),
        Err(Error::LimitExceeded { .. })
    ));
    capped.reserve(MIB, 4).unwrap();
    assert_eq!(capped.stats().reserve_failures, 0);
}

#[test]
fn a_configured_reserve_starts_with_the_pool_or_on_request() {
    // Over any backend: started on request.
    let backend = Noting::default();
    let config = PoolConfig::new().reserve(MIB, 2).reserve(2 * MIB, 1);
    let pool = Pool::with_backend(backend.clone(), config.clone());
    std::thread::sleep(Duration::from_millis(20));
    assert_eq!(pool.stats().reserve_ready_bytes, 0, "started unasked");
    pool.start_configured_reserve();
    eventually("4 MiB ready", || {
        pool.stats().reserve_ready_bytes == 4 * MIB as u64
    });
    assert!(pool.take_reserve_error().is_none());
    drop(pool);

    // The default pool (page-locked memory here) starts it at once, as from the environment.
    let pool = Pool::with_config(PoolConfig::parse("reserve_mb:1x2").unwrap());
    eventually("2 MiB ready", || {
        pool.stats().reserve_ready_bytes == 2 * MIB as u64
    });

    // A size no class holds is an error kept for the caller, not a panic.
    let pool = Pool::with_backend(backend, PoolConfig::new().reserve(usize::MAX / 2, 1));
    pool.start_configured_reserve();
    assert!(matches!(
        pool.take_reserve_error(),
        Some(Error::CapacityOverflow)
    ));
    assert!(pool.take_reserve_error().is_none());
}

#[test]
fn a_block_pinned_after_its_target_fell_is_released() {
    let backend = Gated::default();
    let pool = Pool::with_backend(backend.clone(), PoolConfig::new().max_pinned_bytes(MIB));
    pool.reserve(MIB, 1).unwrap();
    eventually("the thread pinning", || {
        backend.waiting.load(Ordering::SeqCst)
    });
    pool.reserve(MIB, 0).unwrap();
    backend.open();
    // Pinned, freed, and no longer counted as pinned.
    eventually("the block released", || {
        backend.pinned.load(Ordering::SeqCst)
            && backend.heap.live() == 0
            && pool.approximate_stats().cached_bytes == 0
    });
    assert_eq!(pool.stats().reserve_ready_bytes, 0);
    // Its bytes no longer count against the cap: a block of the whole cap fits.
    drop(pool.with_capacity(MIB).unwrap());
}

/// [`Gated`], whose releases on the reserve thread panic (after freeing the block, so that
/// nothing leaks).
#[derive(Clone, Default)]
struct PanicsReleasing(Gated);

// SAFETY: forwards to `Gated`.
unsafe impl PinnedAllocator for PanicsReleasing {
    fn allocate(&self, layout: Layout) -> Result<Allocation> {
        self.0.allocate(layout)
    }

    unsafe fn deallocate(&self, allocation: Allocation) {
        // SAFETY: forwarded from the caller.
        unsafe { self.0.deallocate(allocation) };
        assert_ne!(
            std::thread::current().name(),
            Some("pinned-pool-reserve"),
            "a release that fails"
        );
    }
}

#[test]
fn a_release_that_panics_on_the_reserve_thread_is_reported_and_the_thread_goes_on() {
    let backend = PanicsReleasing::default();
    let pool = Pool::with_backend(backend.clone(), PoolConfig::new());
    pool.reserve(MIB, 1).unwrap();
    eventually("the thread pinning", || {
        backend.0.waiting.load(Ordering::SeqCst)
    });
    // The block being pinned is no longer wanted: the thread releases it, and panics.
    pool.reserve(MIB, 0).unwrap();
    backend.0.open();
    eventually("the panic reported", || {
        pool.approximate_stats().reserve_failures == 1
    });
    assert!(matches!(
        pool.take_reserve_error(),
        Some(Error::Unsupported(_))
    ));
    // The thread is still there: it pins what it is asked for next.
    pool.reserve(4096, 1).unwrap();
    eventually("a block ready", || {
        pool.approximate_stats().reserve_ready_bytes == 4096
    });
}

/// Finished or not, as set; the first query waits at a gate (saying so first), so that a test
/// can hold an allocation inside its look at the pending blocks.
struct Held {
    finished: bool,
    gate: Option<(std::sync::mpsc::Sender<()>, Gated)>,
}

// SAFETY: nothing uses the blocks freed with it, so whatever it answers is true of them.
unsafe impl pinned_pool::Completion for Held {
    fn is_complete(&mut self) -> bool {
        if let Some((entered, gate)) = self.gate.take() {
            let _ = entered.send(());
            let (open, opened) = &*gate.gate;
            drop(
                opened
                    .wait_while(open.lock().unwrap(), |open| !*open)
                    .unwrap(),
            );
        }
        self.finished
    }

    fn wait(&mut self) -> bool {
        true
    }
}

#[test]
fn a_block_cached_while_a_miss_looks_at_pending_blocks_comes_before_one_pinned_ahead() {
    let heap = Heap::new();
    let pool = Arc::new(Pool::<Heap, Held>::with_completion(
        heap.clone(),
        PoolConfig::new(),
    ));
    pool.reserve(4096, 1).unwrap();
    eventually("one ready", || pool.stats().reserve_ready_bytes == 4096);
    let waiting = pool.allocate_raw(4096).unwrap();
    eventually("one ready", || pool.stats().reserve_ready_bytes == 4096);
    let cached = pool.allocate_raw(4096).unwrap();
    eventually("one ready", || pool.stats().reserve_ready_bytes == 4096);
    let cached_at = cached.ptr();
    // A pending block whose query holds the next miss at the gate.
    let gate = Gated::default();
    let (entered, inside) = std::sync::mpsc::channel();
    let held = Held {
        finished: false,
        gate: Some((entered, gate.clone())),
    };
    // SAFETY: allocated above from this pool; nothing uses it.
    unsafe { pool.free_raw_after(waiting, held) };
    let miss = {
        let pool = pool.clone();
        std::thread::spawn(move || pool.allocate_raw(4096).unwrap())
    };
    inside.recv().unwrap();
    // Meanwhile another block finishes and reaches the shared lists.
    let finished = Held {
        finished: true,
        gate: None,
    };
    // SAFETY: allocated above from this pool; nothing uses it.
    unsafe { pool.free_raw_after(cached, finished) };
    pool.process_events();
    gate.open();
    let got = miss.join().unwrap();
    assert_eq!(got.ptr(), cached_at, "the cached block was passed over");
    assert_eq!(
        pool.stats().reserve_ready_bytes,
        4096,
        "the reserve was not drawn on"
    );
    // SAFETY: allocated from this pool; nothing uses it.
    unsafe { pool.free_raw(got) };
}

#[test]
fn a_block_pinned_ahead_counts_as_pinned_once_taken_and_is_released_as_pinned() {
    let backend = Padded::default();
    let pool = Pool::with_backend(backend.clone(), PoolConfig::new());
    pool.reserve(MIB, 2).unwrap();
    eventually("ready", || {
        pool.stats().reserve_ready_bytes == 2 * MIB as u64
    });
    assert_eq!(pool.stats().allocations.current, 0, "counted before taken");

    let held = pool.with_capacity(MIB).unwrap();
    let stats = pool.stats();
    assert_eq!(stats.allocations.current, 1);
    assert_eq!(stats.allocated_bytes.current, (MIB + PAGE) as u64);
    drop(held);
    // Released from the cache, from the reserve, and with the pool: each as the backend
    // described it (`Padded` checks), and each once.
    pool.empty_cache();
    let stats = pool.stats();
    assert_eq!(stats.allocations.current, 0);
    assert_eq!(stats.allocated_bytes.current, 0);
    eventually("topped up", || {
        pool.stats().reserve_ready_bytes == 2 * MIB as u64
    });
    pool.reserve(MIB, 0).unwrap();
    assert_eq!(backend.heap.live(), 0);
    pool.reserve(MIB, 1).unwrap();
    eventually("ready again", || {
        pool.stats().reserve_ready_bytes == MIB as u64
    });
    drop(pool);
    assert_eq!(backend.heap.live(), 0);
    assert!(backend.out.lock().unwrap().is_empty());
}

/// The heap backend on two nodes, whose node query takes a lock of the application's (say, a
/// registry of which device each thread drives) and says when it is asked.
#[derive(Clone)]
struct NodeUnderLock {
    heap: Heap,
    registry: Arc<Mutex<()>>,
    asked: mpsc::Sender<()>,
}

// SAFETY: forwards to `Heap`.
unsafe impl PinnedAllocator for NodeUnderLock {
    fn allocate(&self, layout: Layout) -> Result<Allocation> {
        self.heap.allocate(layout)
    }

    unsafe fn deallocate(&self, allocation: Allocation) {
        // SAFETY: forwarded from the caller.
        unsafe { self.heap.deallocate(allocation) }
    }

    fn numa_nodes(&self) -> usize {
        2
    }

    fn numa_node(&self) -> usize {
        let _ = self.asked.send(());
        let _registry = self.registry.lock().unwrap();
        0
    }
}

#[test]
fn starting_the_reserve_thread_holds_no_lock_that_pool_calls_take() {
    let registry = Arc::new(Mutex::new(()));
    let (asked, asking) = mpsc::channel();
    let backend = NodeUnderLock {
        heap: Heap::new(),
        registry: registry.clone(),
        asked,
    };
    let pool = Arc::new(Pool::with_backend(backend.clone(), PoolConfig::new()));
    let held = registry.lock().unwrap();
    let reserving = {
        let pool = pool.clone();
        std::thread::spawn(move || pool.reserve(MIB, 1))
    };
    // The new thread asks its node and waits for the registry; the first call waits for it.
    asking.recv().unwrap();
    // Meanwhile a thread holding the registry maintains the pool.
    let (done, finished) = mpsc::channel();
    let maintaining = {
        let pool = pool.clone();
        std::thread::spawn(move || {
            pool.trim(0);
            let _ = pool.stats();
            let _ = done.send(());
        })
    };
    let maintained = finished.recv_timeout(Duration::from_secs(10)).is_ok();
    drop(held);
    maintaining.join().unwrap();
    reserving.join().unwrap().unwrap();
    assert!(maintained, "pool calls waited for the thread starting");
    eventually("ready", || pool.stats().reserve_ready_bytes == MIB as u64);
    drop(pool);
    assert_eq!(backend.heap.live(), 0);
}
