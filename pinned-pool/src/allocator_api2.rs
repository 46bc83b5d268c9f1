//! allocator-api2's `Allocator` for `Pool` (and so for `&Pool`), so
//! `allocator_api2::vec::Vec<T, &Pool>` and hashbrown maps can live in pooled pinned memory.
//! Such a `Vec` is a `cuda_pinned::HostBuffer`: async copies take it like a `PinnedVec`, and
//! dropping their `Transfer` waits for the copy before the block goes back.

use std::alloc::Layout;
use std::ptr::NonNull;

use allocator_api2::alloc::{AllocError, Allocator};
use cuda_pinned::{Allocation, PendingUses, PinnedAllocator};

use crate::completion::Completion;
use crate::pool::Pool;
use crate::size_class::{PAGE, class_of};

// SAFETY: blocks come from `allocate_raw` (valid for the class size, page-aligned, used by
// nobody else); the returned length is the class size, so every layout size that fits the
// block (between the request and the class size) maps back to the same class.
unsafe impl<B: PinnedAllocator, C: Completion + From<PendingUses>> Allocator for Pool<B, C> {
    fn allocate(&self, layout: Layout) -> Result<NonNull<[u8]>, AllocError> {
        if layout.size() == 0 {
            // SAFETY: an alignment is never zero.
            let dangling =
                unsafe { NonNull::new_unchecked(std::ptr::without_provenance_mut(layout.align())) };
            return Ok(NonNull::slice_from_raw_parts(dangling, 0));
        }
        if layout.align() > PAGE {
            return Err(AllocError);
        }
        let block = self.allocate_raw(layout.size()).map_err(|_| AllocError)?;
        Ok(NonNull::slice_from_raw_parts(block.ptr(), block.bytes()))
    }

    unsafe fn deallocate(&self, ptr: NonNull<u8>, layout: Layout) {
        if layout.size() == 0 {
            return;
        }
        let Some((_, size)) = class_of(layout.size()) else {
            return;
        };
        let Some((kind, slot)) = self.block_kind(ptr) else {
            return;
        };
        let allocation = Allocation::new(ptr, size, kind, slot);
        // SAFETY: the caller guarantees `ptr` came from `allocate` with a fitting layout and
        // is unused; allocator-api2 containers record no device work.
        unsafe { self.free_raw(allocation) };
    }
}
