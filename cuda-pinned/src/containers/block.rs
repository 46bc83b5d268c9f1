//! `Block<A>`: the memory a container owns — one allocation, its allocator and its record of
//! device uses — given back to the allocator when the block is dropped.
//!
//! Containers keep their elements' bookkeeping (length, initialised values) and leave the
//! memory to a `Block` field. Because the block is a field with its own `Drop`, the memory
//! is given back even when dropping an element panics, and a container is never left
//! pointing at memory it has already given back (see [`Block::replace`]).

use std::alloc::Layout;
use std::ptr::NonNull;

use crate::memory::allocator::Allocation;
use crate::memory::allocator::MemoryKind;
use crate::memory::allocator::PinnedAllocator;
use crate::memory::uses::StreamUses;

use crate::error::Result;
use crate::gpu::stream::Stream;
/// An allocation (or none) with its allocator and device uses.
///
/// Without an allocation, `allocation` describes zero bytes at a dangling address aligned
/// for the container's elements.
pub(crate) struct Block<A: PinnedAllocator> {
    allocation: Allocation,
    uses: StreamUses,
    allocator: A,
}

impl<A: PinnedAllocator> Block<A> {
    /// No memory yet; `dangling` is the address containers show while empty.
    #[inline]
    pub(crate) const fn empty(dangling: NonNull<u8>, allocator: A) -> Self {
        Self {
            allocation: Allocation::new(dangling, 0, MemoryKind::HostLocked, 0),
            uses: StreamUses::new(),
            allocator,
        }
    }

    /// Memory for `layout` (`layout.size() > 0`) from `allocator`.
    ///
    /// # Errors
    ///
    /// The allocator's error.
    #[inline]
    pub(crate) fn allocate(layout: Layout, allocator: A) -> Result<Self> {
        let allocation = allocator.allocate(layout)?;
        Ok(Self {
            allocation,
            uses: StreamUses::new(),
            allocator,
        })
    }

    /// Adopts `allocation` (from `allocator`); `None` gives an empty block.
    ///
    /// # Safety
    ///
    /// - `allocation` came from `allocator` (or an equal clone) and is used by nothing else.
    pub(crate) unsafe fn from_parts(
        allocation: Option<Allocation>,
        dangling: NonNull<u8>,
        allocator: A,
    ) -> Self {
        match allocation {
            Some(allocation) => Self {
                allocation,
                uses: StreamUses::new(),
                allocator,
            },
            None => Self::empty(dangling, allocator),
        }
    }

    /// The start of the memory (dangling while empty).
    #[inline]
    pub(crate) fn ptr(&self) -> NonNull<u8> {
        self.allocation.ptr()
    }

    /// Usable bytes (0 while empty).
    #[inline]
    pub(crate) fn bytes(&self) -> usize {
        self.allocation.bytes()
    }

    /// The allocation, if there is one.
    #[inline]
    pub(crate) fn allocation(&self) -> Option<&Allocation> {
        (self.bytes() != 0).then_some(&self.allocation)
    }

    /// The kind of memory; `None` while empty.
    pub(crate) fn kind(&self) -> Option<MemoryKind> {
        self.allocation().map(Allocation::kind)
    }

    #[inline]
    pub(crate) fn allocator(&self) -> &A {
        &self.allocator
    }

    pub(crate) fn uses_mut(&mut self) -> &mut StreamUses {
        &mut self.uses
    }

    pub(crate) fn record_stream(&mut self, stream: &Stream) {
        self.uses.record_stream(stream);
    }

    /// Allocates memory for `layout` from this block's allocator without touching the block.
    ///
    /// # Errors
    ///
    /// The allocator's error.
    pub(crate) fn allocate_more(&self, layout: Layout) -> Result<Allocation> {
        self.allocator.allocate(layout)
    }

    /// Grows the block's memory to `layout` without moving it, where the allocator can;
    /// `Ok(false)` where it cannot (or the block is empty).
    ///
    /// # Errors
    ///
    /// The allocator's error; the block is unchanged.
    pub(crate) fn grow_in_place(&mut self, layout: Layout) -> Result<bool> {
        if self.allocation.bytes() == 0 {
            return Ok(false);
        }
        // SAFETY: the block's allocation came from its allocator and is live; containers
        // grow with their element type's alignment, the one they allocated with.
        match unsafe { self.allocator.grow_in_place(&self.allocation, layout) }? {
            Some(grown) => {
                debug_assert_eq!(grown.ptr(), self.allocation.ptr());
                // The grown allocation describes the same memory: nothing is given back.
                self.allocation = grown;
                Ok(true)
            }
            None => Ok(false),
        }
    }

    /// Makes `allocation` (from this block's allocator, its contents already moved in) the
    /// block's memory, then gives the old memory back, deferred on the old uses.
    ///
    /// The block describes the new memory *before* the allocator runs, so a container whose
    /// allocator unwinds out of the release still points at live memory. (The old memory may
    /// then be lost, never reused while referenced.)
    ///
    /// # Safety
    ///
    /// - `allocation` came from this block's allocator and is used by nothing else;
    /// - the old memory's contents have been moved out or need no drop, and nothing on the
    ///   host uses it afterwards.
    pub(crate) unsafe fn replace(&mut self, allocation: Allocation) {
        let old = std::mem::replace(&mut self.allocation, allocation);
        if old.bytes() != 0 {
            // SAFETY: `old` came from this allocator; `uses` holds every recorded device use
            // of it (and is left empty for the new memory); the caller has moved its values.
            unsafe { release(&self.allocator, old, &mut self.uses) };
        }
    }

    /// Takes the block apart without releasing anything: its allocation (if any), and the
    /// allocator. Recorded uses are dropped: whoever frees the memory answers for them.
    pub(crate) fn into_parts(self) -> (Option<Allocation>, A) {
        let mut this = std::mem::ManuallyDrop::new(self);
        let allocation = (this.allocation.bytes() != 0).then(|| {
            std::mem::replace(
                &mut this.allocation,
                Allocation::new(NonNull::dangling(), 0, MemoryKind::HostLocked, 0),
            )
        });
        // SAFETY: `this` is never dropped; each field is moved out or dropped exactly once.
        unsafe {
            std::ptr::drop_in_place(&mut this.uses);
            (allocation, std::ptr::read(&this.allocator))
        }
    }
}

impl<A: PinnedAllocator> Drop for Block<A> {
    #[inline]
    fn drop(&mut self) {
        if self.allocation.bytes() != 0 {
            let allocation = Allocation::new(
                self.allocation.ptr(),
                self.allocation.bytes(),
                self.allocation.kind(),
                self.allocation.tag(),
            );
            // SAFETY: the allocation came from this allocator, is dropped once (here), and
            // its container no longer uses it; `uses` covers device work.
            unsafe { release(&self.allocator, allocation, &mut self.uses) };
        }
    }
}

/// Releases `allocation` through `allocator`, deferring on `uses` (taken, left empty) if there
/// are any; leaks it when the uses cannot be known. Borrowing `uses` spares the common case
/// (no device work) a move of the record.
///
/// # Safety
///
/// As [`PinnedAllocator::deallocate_after`]; `uses` covers every device use.
#[inline]
pub(crate) unsafe fn release<A: PinnedAllocator + ?Sized>(
    allocator: &A,
    allocation: Allocation,
    uses: &mut StreamUses,
) {
    if uses.is_empty() {
        // SAFETY: no device work was recorded; the caller's guarantees cover the rest.
        unsafe { allocator.deallocate(allocation) };
    } else if let Ok(pending) = std::mem::take(uses).finish() {
        // SAFETY: `pending` covers every recorded use.
        unsafe { allocator.deallocate_after(allocation, pending) };
    }
}
