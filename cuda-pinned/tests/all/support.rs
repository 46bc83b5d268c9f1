//! Test allocators: one that counts live blocks (leaks) and fails on demand (faults), one
//! that panics on demand (unwinding), and a heap stand-in for page-locked memory under Miri.

use std::alloc::Layout;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};

use cuda_pinned::{Allocation, PinnedAllocator, Result};

/// Page-locked memory (`HostLocked`); under Miri, which cannot lock pages, the heap.
#[derive(Clone, Copy, Default)]
pub struct Backing;

// SAFETY: forwards to `HostLocked`, or takes heap memory of the layout (page-aligned) and
// gives it back with the same layout.
unsafe impl PinnedAllocator for Backing {
    fn allocate(&self, layout: Layout) -> Result<Allocation> {
        if cfg!(miri) {
            let layout = layout.align_to(4096).unwrap();
            // SAFETY: the size is non-zero (containers never ask for 0).
            let ptr = std::ptr::NonNull::new(unsafe { std::alloc::alloc(layout) }).unwrap();
            Ok(Allocation::new(
                ptr,
                layout.size(),
                cuda_pinned::MemoryKind::HostLocked,
                0,
            ))
        } else {
            cuda_pinned::HostLocked.allocate(layout)
        }
    }

    unsafe fn deallocate(&self, allocation: Allocation) {
        if cfg!(miri) {
            let layout = Layout::from_size_align(allocation.bytes(), 4096).unwrap();
            // SAFETY: allocated above with this layout; given back once.
            unsafe { std::alloc::dealloc(allocation.ptr().as_ptr(), layout) };
        } else {
            // SAFETY: forwarded from the caller; the allocation came from `HostLocked`.
            unsafe { cuda_pinned::HostLocked.deallocate(allocation) }
        }
    }
}

/// Wraps [`Backing`], counting live allocations, failing while `fail` is set and panicking
/// in `deallocate` (after giving the memory back) while `panic_on_free` is set. With
/// `growth_factor` at n > 1, each block takes n times its size and grows in place up to it
/// (counted in `grown`), as address space reserved ahead allows.
#[derive(Clone, Default)]
pub struct Counting {
    pub live: Arc<AtomicUsize>,
    pub allocations: Arc<AtomicUsize>,
    pub fail: Arc<AtomicBool>,
    pub panic_on_free: Arc<AtomicBool>,
    pub growth_factor: Arc<AtomicUsize>,
    pub grown: Arc<AtomicUsize>,
}

impl Counting {
    pub fn live(&self) -> usize {
        self.live.load(Ordering::SeqCst)
    }
}

// SAFETY: forwards to `Backing`, which upholds the contract; failing returns no memory.
unsafe impl PinnedAllocator for Counting {
    fn allocate(&self, layout: Layout) -> Result<Allocation> {
        if self.fail.load(Ordering::SeqCst) {
            return Err(cuda_pinned::Error::OutOfMemory {
                requested: layout.size(),
            });
        }
        let factor = self.growth_factor.load(Ordering::SeqCst).max(1);
        let room = layout
            .size()
            .checked_mul(factor)
            .and_then(|size| Layout::from_size_align(size, layout.align()).ok())
            .ok_or(cuda_pinned::Error::CapacityOverflow)?;
        let block = Backing.allocate(room)?;
        self.live.fetch_add(1, Ordering::SeqCst);
        self.allocations.fetch_add(1, Ordering::SeqCst);
        // The block shows the size asked for; its tag keeps the whole room.
        Ok(Allocation::new(
            block.ptr(),
            layout.size(),
            block.kind(),
            block.bytes(),
        ))
    }

    unsafe fn deallocate(&self, allocation: Allocation) {
        self.live.fetch_sub(1, Ordering::SeqCst);
        let block = Allocation::new(allocation.ptr(), allocation.tag(), allocation.kind(), 0);
        // SAFETY: forwarded from the caller; the block (its whole room) came from `Backing`.
        unsafe { Backing.deallocate(block) };
        if self.panic_on_free.load(Ordering::SeqCst) {
            panic!("deallocate panicked (on purpose)");
        }
    }

    unsafe fn grow_in_place(
        &self,
        allocation: &Allocation,
        layout: Layout,
    ) -> Result<Option<Allocation>> {
        if self.fail.load(Ordering::SeqCst) {
            return Err(cuda_pinned::Error::OutOfMemory {
                requested: layout.size(),
            });
        }
        if self.growth_factor.load(Ordering::SeqCst) <= 1 || layout.size() > allocation.tag() {
            return Ok(None);
        }
        self.grown.fetch_add(1, Ordering::SeqCst);
        Ok(Some(Allocation::new(
            allocation.ptr(),
            layout.size(),
            allocation.kind(),
            allocation.tag(),
        )))
    }
}

/// Proptest's configuration: `cases` cases, `miri_cases` under Miri, which also isolates the
/// program from the file system where failures would be saved.
pub fn proptest_config(cases: u32, miri_cases: u32) -> proptest::prelude::ProptestConfig {
    let default = proptest::prelude::ProptestConfig::default();
    proptest::prelude::ProptestConfig {
        cases: capped(if cfg!(miri) { miri_cases } else { cases }),
        failure_persistence: if cfg!(miri) {
            None
        } else {
            default.failure_persistence.clone()
        },
        ..default
    }
}

/// `cases`, capped by `PROPTEST_MAX_CASES` where it is set: the sanitizer runs, whose every
/// case costs many times a plain run's, take fewer.
fn capped(cases: u32) -> u32 {
    std::env::var("PROPTEST_MAX_CASES")
        .ok()
        .and_then(|max| max.parse().ok())
        .map_or(cases, |max: u32| cases.min(max))
}
