//! Blocks kept per NUMA node: a fake backend with two nodes, the calling thread's node chosen
//! by the test, each block remembering the node it was made for.

use std::alloc::Layout;
use std::cell::Cell;
use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use cuda_pinned::{Allocation, PinnedAllocator, Result};
use pinned_pool::{Pool, PoolConfig};
use proptest::prelude::*;

use crate::support::Heap;

thread_local! {
    /// The node this thread's allocations go on (its "current device's").
    static NODE: Cell<usize> = const { Cell::new(0) };
}

/// Heap memory on two pretend nodes: a block is on the node of the thread that made it.
#[derive(Clone, Default)]
struct TwoNodes {
    heap: Heap,
    node_of: Arc<Mutex<HashMap<usize, usize>>>,
}

impl TwoNodes {
    fn node_of(&self, ptr: *const u8) -> usize {
        self.node_of.lock().unwrap()[&(ptr as usize)]
    }
}

// SAFETY: forwards to `Heap`, noting each block's node.
unsafe impl PinnedAllocator for TwoNodes {
    fn allocate(&self, layout: Layout) -> Result<Allocation> {
        let block = self.heap.allocate(layout)?;
        self.node_of
            .lock()
            .unwrap()
            .insert(block.ptr().as_ptr() as usize, NODE.get());
        Ok(block)
    }

    unsafe fn deallocate(&self, allocation: Allocation) {
        self.node_of
            .lock()
            .unwrap()
            .remove(&(allocation.ptr().as_ptr() as usize));
        // SAFETY: forwarded from the caller.
        unsafe { self.heap.deallocate(allocation) }
    }

    fn numa_nodes(&self) -> usize {
        2
    }

    fn numa_node(&self) -> usize {
        NODE.get()
    }
}

#[test]
fn a_block_is_reused_only_on_its_own_node() {
    let backend = TwoNodes::default();
    let pool = Pool::with_backend(backend.clone(), PoolConfig::new());
    NODE.set(1);
    let on_one = pool.with_capacity(4096).unwrap();
    let address = on_one.as_ptr();
    drop(on_one);
    NODE.set(0);
    let on_zero = pool.with_capacity(4096).unwrap();
    assert_ne!(on_zero.as_ptr(), address, "node 1's block served node 0");
    assert_eq!(backend.node_of(on_zero.as_ptr()), 0);
    NODE.set(1);
    let again = pool.with_capacity(4096).unwrap();
    assert_eq!(
        again.as_ptr(),
        address,
        "node 1's idle block not reused on node 1"
    );
    let stats = pool.stats();
    assert_eq!((stats.cache_hits, stats.cache_misses), (1, 2));
    drop((on_zero, again));
    // Both nodes' blocks are released with the cache.
    pool.empty_cache();
    assert_eq!(backend.heap.live(), 0);
}

#[test]
fn blocks_freed_on_another_thread_go_back_to_their_node() {
    let backend = TwoNodes::default();
    let pool = Arc::new(Pool::with_backend(backend.clone(), PoolConfig::new()));
    NODE.set(1);
    let block = pinned_pool_vec(&pool, 1 << 20);
    let address = block.as_ptr() as usize;
    // Freed by a thread on node 0: still node 1's block.
    std::thread::spawn(move || {
        NODE.set(0);
        drop(block);
    })
    .join()
    .unwrap();
    NODE.set(0);
    let on_zero = pinned_pool_vec(&pool, 1 << 20);
    assert_ne!(on_zero.as_ptr() as usize, address);
    NODE.set(1);
    let on_one = pinned_pool_vec(&pool, 1 << 20);
    assert_eq!(on_one.as_ptr() as usize, address);
}

fn pinned_pool_vec(
    pool: &Arc<Pool<TwoNodes>>,
    bytes: usize,
) -> cuda_pinned::PinnedVec<u8, Arc<Pool<TwoNodes>>> {
    cuda_pinned::PinnedVec::with_capacity_in(bytes, pool.clone()).unwrap()
}

proptest! {
    #![proptest_config(ProptestConfig {
        cases: crate::support::capped(if cfg!(miri) { 4 } else { 128 }),
        failure_persistence: None,
        ..ProptestConfig::default()
    })]

    /// Whatever the sequence of allocations and frees on either node, every block handed out
    /// was made for the node that asks.
    #[test]
    fn every_block_handed_out_is_on_the_asking_node(
        ops in proptest::collection::vec((0usize..2, 1usize..200_000, any::<bool>()), 1..80),
    ) {
        let backend = TwoNodes::default();
        let pool = Pool::with_backend(backend.clone(), PoolConfig::new());
        let mut held = Vec::new();
        for (node, bytes, free_one) in ops {
            NODE.set(node);
            if free_one && !held.is_empty() {
                let index = bytes % held.len();
                drop(held.swap_remove(index));
                continue;
            }
            let block = pool.with_capacity(bytes).unwrap();
            prop_assert_eq!(backend.node_of(block.as_ptr()), node);
            held.push(block);
        }
        drop(held);
        pool.empty_cache();
        prop_assert_eq!(backend.heap.live(), 0);
    }
}

#[test]
fn blocks_pinned_ahead_serve_only_the_node_they_are_on() {
    let backend = TwoNodes::default();
    let pool = Pool::with_backend(backend.clone(), PoolConfig::new());
    // The reserve thread pins on its own node (here node 0: the pretend node is per thread,
    // as a device is), whichever node the caller is on.
    NODE.set(1);
    pool.reserve(1 << 20, 1).unwrap();
    let start = std::time::Instant::now();
    while pool.stats().reserve_ready_bytes != 1 << 20 {
        assert!(start.elapsed().as_secs() < 60, "nothing pinned ahead");
        std::thread::sleep(std::time::Duration::from_millis(1));
    }
    let on_one = pool.with_capacity(1 << 20).unwrap();
    assert_eq!(backend.node_of(on_one.as_ptr()), 1);
    NODE.set(0);
    let on_zero = pool.with_capacity(1 << 20).unwrap();
    assert_eq!(backend.node_of(on_zero.as_ptr()), 0);
}

#[test]
fn a_pool_over_a_pool_keeps_nodes_apart_too() {
    let backend = TwoNodes::default();
    let inner = Arc::new(Pool::with_backend(backend.clone(), PoolConfig::new()));
    let outer = Pool::with_backend(inner, PoolConfig::new());
    NODE.set(1);
    let on_one = outer.with_capacity(4096).unwrap();
    let address = on_one.as_ptr();
    drop(on_one);
    NODE.set(0);
    let on_zero = outer.with_capacity(4096).unwrap();
    assert_ne!(on_zero.as_ptr(), address, "node 1's block served node 0");
    assert_eq!(backend.node_of(on_zero.as_ptr()), 0);
}
