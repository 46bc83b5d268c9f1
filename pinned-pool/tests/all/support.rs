//! A backend of plain heap memory that counts and fails on demand, and a completion source
//! the test controls. Both run under miri.

use std::alloc::Layout;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};

use cuda_pinned::{Allocation, Error, MemoryKind, PinnedAllocator, Result};
use pinned_pool::Completion;

/// Heap memory standing in for pinned memory: counts calls and live blocks, and fails the
/// calls numbered in `fail_from..fail_until`.
#[derive(Clone, Default)]
pub struct Heap {
    pub calls: Arc<AtomicUsize>,
    pub live: Arc<AtomicUsize>,
    pub live_bytes: Arc<AtomicUsize>,
    pub fail_from: Arc<AtomicUsize>,
    pub fail_until: Arc<AtomicUsize>,
}

impl Heap {
    pub fn new() -> Self {
        Self::default()
    }

    /// Fails calls `from..until` (counted from 0 over the backend's life).
    pub fn failing(from: usize, until: usize) -> Self {
        let heap = Self::new();
        heap.fail_from.store(from, Ordering::SeqCst);
        heap.fail_until.store(until, Ordering::SeqCst);
        heap
    }

    pub fn live(&self) -> usize {
        self.live.load(Ordering::SeqCst)
    }
}

// SAFETY: std::alloc gives valid, aligned memory of the layout's size until dealloc with the
// same layout (rebuilt from the allocation's size and a page alignment).
unsafe impl PinnedAllocator for Heap {
    fn allocate(&self, layout: Layout) -> Result<Allocation> {
        let call = self.calls.fetch_add(1, Ordering::SeqCst);
        if (self.fail_from.load(Ordering::SeqCst)..self.fail_until.load(Ordering::SeqCst))
            .contains(&call)
        {
            return Err(Error::OutOfMemory {
                requested: layout.size(),
            });
        }
        let layout = layout.align_to(4096).unwrap();
        // SAFETY: the size is non-zero (the pool never asks for 0).
        let ptr = std::ptr::NonNull::new(unsafe { std::alloc::alloc(layout) }).ok_or(
            Error::OutOfMemory {
                requested: layout.size(),
            },
        )?;
        self.live.fetch_add(1, Ordering::SeqCst);
        self.live_bytes.fetch_add(layout.size(), Ordering::SeqCst);
        Ok(Allocation::new(
            ptr,
            layout.size(),
            MemoryKind::HostLocked,
            0,
        ))
    }

    unsafe fn deallocate(&self, allocation: Allocation) {
        self.live.fetch_sub(1, Ordering::SeqCst);
        self.live_bytes
            .fetch_sub(allocation.bytes(), Ordering::SeqCst);
        let layout = Layout::from_size_align(allocation.bytes(), 4096).unwrap();
        // SAFETY: allocated above with this layout; the pool gives it back once.
        unsafe { std::alloc::dealloc(allocation.ptr().as_ptr(), layout) };
    }
}

/// A completion the test finishes by hand.
#[derive(Clone, Debug, Default)]
pub struct Flag(pub Arc<AtomicBool>);

impl Flag {
    pub fn finish(&self) {
        self.0.store(true, Ordering::SeqCst);
    }
    pub fn is_done(&self) -> bool {
        self.0.load(Ordering::SeqCst)
    }
}

// SAFETY: tests finish a flag only when nothing uses the block (or to check that the pool
// trusts it).
unsafe impl Completion for Flag {
    fn is_complete(&mut self) -> bool {
        self.is_done()
    }
    fn wait(&mut self) -> bool {
        self.is_done()
    }
}

pub type TestPool = pinned_pool::Pool<Heap, Flag>;

/// A pool over [`Heap`] whose freed blocks carry CUDA events (none, in CPU tests): the
/// allocator of `PinnedVec`s in tests.
pub type HeapPool = pinned_pool::Pool<Heap>;

/// `cases`, capped by `PROPTEST_MAX_CASES` where it is set: the sanitizer runs, whose every
/// case costs many times a plain run's, take fewer.
pub fn capped(cases: u32) -> u32 {
    std::env::var("PROPTEST_MAX_CASES")
        .ok()
        .and_then(|max| max.parse().ok())
        .map_or(cases, |max: u32| cases.min(max))
}
