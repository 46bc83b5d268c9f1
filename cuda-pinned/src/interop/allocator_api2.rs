//! `allocator_api2::alloc::Allocator` for the pinned allocators, so that
//! `allocator_api2::vec::Vec<T, _>` and hashbrown's maps can live in page-locked memory.
//!
//! Such a `Vec` is a [`HostBuffer`](crate::HostBuffer): async copies take it by value like a
//! `PinnedVec`. It cannot record streams, so dropping a `Transfer` that holds one waits for
//! the copy before the memory goes back.

use std::alloc::Layout;
use std::ptr::NonNull;

use allocator_api2::alloc::{AllocError, Allocator};

use crate::memory::allocator::Allocation;
use crate::memory::allocator::MemoryKind;
use crate::memory::allocator::PinnedAllocator;
use crate::memory::cuda_host::CudaHost;
use crate::memory::default::DefaultPinned;
use crate::memory::host_locked::HostLocked;
use crate::memory::registered::Registered;
use crate::memory::virtual_host::VirtualHost;

/// A zero-sized request gets a dangling, aligned pointer, as allocator-api2 allows.
fn dangling(layout: Layout) -> NonNull<[u8]> {
    // SAFETY: an alignment is never zero.
    let ptr = unsafe { NonNull::new_unchecked(std::ptr::without_provenance_mut(layout.align())) };
    NonNull::slice_from_raw_parts(ptr, 0)
}

fn allocate_with<A: PinnedAllocator>(
    allocator: &A,
    layout: Layout,
) -> Result<NonNull<[u8]>, AllocError> {
    if layout.size() == 0 {
        return Ok(dangling(layout));
    }
    let allocation = allocator.allocate(layout).map_err(|_| AllocError)?;
    // `Allocation` is plain data; deallocation describes the block again from the layout.
    Ok(NonNull::slice_from_raw_parts(
        allocation.ptr(),
        allocation.bytes(),
    ))
}

/// Implements `Allocator` for a kind whose block size follows from the layout alone.
macro_rules! impl_allocator {
    ($kind:ty, |$this:ident, $layout:ident| $bytes:expr, $memory:expr) => {
        // SAFETY: forwards to the kind's `PinnedAllocator`, whose contract gives memory valid
        // for the returned length until deallocation. Every size between the request and the
        // returned length maps to the same block size (sizes are rounded up to the kind's
        // granule), so `deallocate` rebuilds exactly the allocation that was made.
        unsafe impl Allocator for $kind {
            fn allocate(&self, layout: Layout) -> Result<NonNull<[u8]>, AllocError> {
                allocate_with(self, layout)
            }

            unsafe fn deallocate(&self, ptr: NonNull<u8>, layout: Layout) {
                if layout.size() == 0 {
                    return;
                }
                let $this = self;
                let $layout = layout;
                let Some(bytes) = $bytes else { return };
                let memory: MemoryKind = $memory;
                // SAFETY: the caller guarantees `ptr` came from `allocate` with a layout that
                // fits; allocator-api2 containers have no stream uses (raw copies are the
                // caller's to finish).
                unsafe {
                    PinnedAllocator::deallocate(self, Allocation::new(ptr, bytes, memory, 0))
                };
            }
        }
    };
}

impl_allocator!(
    CudaHost,
    |this, layout| Some(layout.size()),
    MemoryKind::CudaHost(this.flags())
);
impl_allocator!(
    Registered,
    |this, layout| this.layout_bytes(layout),
    MemoryKind::Registered
);
impl_allocator!(
    HostLocked,
    |_this, layout| HostLocked::layout_bytes(layout),
    MemoryKind::HostLocked
);
impl_allocator!(
    DefaultPinned,
    |_this, layout| DefaultPinned::layout_bytes(layout),
    DefaultPinned::kind()
);

// SAFETY: forwards to `VirtualHost`'s `PinnedAllocator`. Blocks made here never grow in place
// (allocator-api2 grows by allocating anew), so a block's size follows from any layout between
// the request and the returned length, and its reserved room from its size: `deallocate`
// rebuilds exactly the allocation that was made.
unsafe impl Allocator for VirtualHost {
    fn allocate(&self, layout: Layout) -> Result<NonNull<[u8]>, AllocError> {
        allocate_with(self, layout)
    }

    unsafe fn deallocate(&self, ptr: NonNull<u8>, layout: Layout) {
        if layout.size() == 0 {
            return;
        }
        let Some(allocation) = self.allocation_at(ptr, layout) else {
            return;
        };
        // SAFETY: the caller guarantees `ptr` came from `allocate` with a layout that fits;
        // allocator-api2 containers have no stream uses.
        unsafe { PinnedAllocator::deallocate(self, allocation) };
    }
}
