//! Test allocators: one that counts live blocks (leaks), one that fails on demand (faults).

use std::alloc::Layout;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};

use cuda_pinned::{Allocation, HostLocked, PinnedAllocator, Result};

/// Wraps `HostLocked`, counting live allocations and failing while `fail` is set.
#[derive(Clone, Default)]
pub struct Counting {
    pub live: Arc<AtomicUsize>,
    pub allocations: Arc<AtomicUsize>,
    pub fail: Arc<AtomicBool>,
}

impl Counting {
    pub fn live(&self) -> usize {
        self.live.load(Ordering::SeqCst)
    }
}

// SAFETY: forwards to `HostLocked`, which upholds the contract; failing returns no memory.
unsafe impl PinnedAllocator for Counting {
    fn allocate(&self, layout: Layout) -> Result<Allocation> {
        if self.fail.load(Ordering::SeqCst) {
            return Err(cuda_pinned::Error::OutOfMemory {
                requested: layout.size(),
            });
        }
        let allocation = HostLocked.allocate(layout)?;
        self.live.fetch_add(1, Ordering::SeqCst);
        self.allocations.fetch_add(1, Ordering::SeqCst);
        Ok(allocation)
    }

    unsafe fn deallocate(&self, allocation: Allocation) {
        self.live.fetch_sub(1, Ordering::SeqCst);
        // SAFETY: forwarded from the caller; the allocation came from `HostLocked`.
        unsafe { HostLocked.deallocate(allocation) }
    }
}
