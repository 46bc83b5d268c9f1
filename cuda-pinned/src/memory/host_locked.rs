//! Kind 4: `mlock`ed host memory, for machines without CUDA.

use std::alloc::Layout;

use crate::error::Error;
use crate::error::Result;
use crate::memory::allocator::Allocation;
use crate::memory::allocator::MemoryKind;
use crate::memory::allocator::PinnedAllocator;
use crate::memory::allocator::check_layout;
use crate::os;

/// Page-locked memory without CUDA: an anonymous mapping locked with `mlock`.
///
/// It cannot be swapped out, like CUDA-pinned memory, but no GPU knows it, so a copy from it is
/// staged by the driver as if it were pageable. It is what [`DefaultPinned`](crate::DefaultPinned)
/// uses where CUDA is absent, so programs and their tests run on CPU-only machines.
///
/// Locking counts against `RLIMIT_MEMLOCK` (`ulimit -l`) unless the process holds
/// `CAP_IPC_LOCK`; beyond it allocation fails with [`Error::MemlockLimit`].
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct HostLocked;

impl HostLocked {
    /// The allocator.
    pub fn new() -> Self {
        Self
    }

    pub(crate) fn layout_bytes(layout: Layout) -> Option<usize> {
        os::round_up(layout.size(), os::page_size())
    }
}

// SAFETY: a fresh private mapping of `bytes` ≥ the request, page-aligned, locked before it is
// handed out, unlocked and unmapped only in `deallocate`.
unsafe impl PinnedAllocator for HostLocked {
    fn allocate(&self, layout: Layout) -> Result<Allocation> {
        check_layout(layout)?;
        let bytes = Self::layout_bytes(layout).ok_or(Error::CapacityOverflow)?;
        let ptr = os::map(bytes, false)?;
        // SAFETY: our fresh mapping of `bytes` bytes.
        if let Err(error) = unsafe { os::lock(ptr, bytes) } {
            // SAFETY: not handed out; nobody uses it.
            unsafe { os::unmap(ptr, bytes) };
            return Err(error);
        }
        Ok(Allocation::new(ptr, bytes, MemoryKind::HostLocked, 0))
    }

    unsafe fn deallocate(&self, allocation: Allocation) {
        // SAFETY: locked and mapped by `allocate`; unused, per the caller.
        unsafe {
            os::unlock(allocation.ptr(), allocation.bytes());
            os::unmap(allocation.ptr(), allocation.bytes());
        }
    }
}
