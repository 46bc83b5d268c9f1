//! Kind 1: `cudaHostAlloc`, with typed flags.

use std::alloc::Layout;

use crate::error::Result;
use crate::memory::allocator::Allocation;
use crate::memory::allocator::MemoryKind;
use crate::memory::allocator::PinnedAllocator;
use crate::memory::allocator::check_layout;
use crate::memory::flags::HostAllocFlags;
/// Page-locked memory from `cudaHostAlloc`. Needs CUDA: without it allocation fails with
/// [`Error::Unavailable`](crate::Error::Unavailable).
///
/// Simple and universally supported, but slow to get (about a millisecond even for 4 KiB, and
/// ten times [`Registered`](crate::Registered)'s time per GiB), and it holds a driver lock
/// meanwhile: [`Registered`](crate::Registered) is the fast path.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct CudaHost {
    flags: HostAllocFlags,
}

impl CudaHost {
    /// Portable pinned memory.
    pub fn new() -> Self {
        Self::default()
    }

    /// With these flags.
    pub fn with_flags(flags: HostAllocFlags) -> Self {
        Self { flags }
    }

    /// The flags used.
    pub fn flags(&self) -> HostAllocFlags {
        self.flags
    }
}

// SAFETY: cudaHostAlloc returns page-aligned memory of at least the requested size (alignment
// above a page is refused by `check_layout`), page-locked until cudaFreeHost.
unsafe impl PinnedAllocator for CudaHost {
    fn allocate(&self, layout: Layout) -> Result<Allocation> {
        check_layout(layout)?;
        let ptr = crate::context::on_current_device(|| {
            crate::raw::memory::host_alloc(layout.size(), self.flags.bits())
        })?;
        Ok(Allocation::new(
            ptr,
            layout.size(),
            MemoryKind::CudaHost(self.flags),
            0,
        ))
    }

    unsafe fn deallocate(&self, allocation: Allocation) {
        // SAFETY: the allocation came from cudaHostAlloc and is unused, per the caller.
        let _ = crate::context::on_current_device(|| unsafe {
            crate::raw::memory::free_host(allocation.ptr())
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::memory::allocator::MemoryKind;
    use cuda_pinned_sys as sys;

    #[test]
    fn flags_combine_and_a_kind_is_one_byte() {
        let flags = HostAllocFlags::PORTABLE | HostAllocFlags::MAPPED;
        assert_eq!(
            flags.bits(),
            sys::cudaHostAllocPortable | sys::cudaHostAllocMapped
        );
        assert!(flags.contains(HostAllocFlags::MAPPED));
        assert!(!flags.contains(HostAllocFlags::WRITE_COMBINED));
        assert_eq!(flags.to_string(), "portable|mapped");
        assert_eq!(HostAllocFlags::NONE.bits(), 0);
        assert_eq!(std::mem::size_of::<MemoryKind>(), 1);
    }
}
