//! `PinnedBox<T, A>`: one value in page-locked memory.

use std::alloc::Layout;
use std::fmt;
use std::marker::PhantomData;
use std::mem::{self, ManuallyDrop, MaybeUninit};
use std::ops::{Deref, DerefMut};
use std::ptr::{self, NonNull};

use bytemuck::Zeroable;

use crate::alloc::{Allocation, DefaultPinned, MemoryKind, PinnedAllocator, StreamUses, release};
use crate::error::Result;
use crate::stream::Stream;

/// One value in page-locked memory, like `Box<T>`: a counter or a struct the GPU writes back,
/// a small parameter block, a staging slot.
///
/// Zero-sized types never allocate. The same safety model as [`PinnedVec`](crate::PinnedVec):
/// async copies take the box by value and give it back when they have finished.
pub struct PinnedBox<T, A: PinnedAllocator = DefaultPinned> {
    ptr: NonNull<T>,
    allocation: Option<Allocation>,
    uses: StreamUses,
    allocator: A,
    _owns: PhantomData<T>,
}

// SAFETY: owns its `T` like `Box<T>`.
unsafe impl<T: Send, A: PinnedAllocator + Send> Send for PinnedBox<T, A> {}
// SAFETY: `&PinnedBox<T>` only gives `&T`.
unsafe impl<T: Sync, A: PinnedAllocator + Sync> Sync for PinnedBox<T, A> {}

impl<T> PinnedBox<T> {
    /// Moves `value` into pinned memory.
    ///
    /// # Errors
    ///
    /// The allocator's error.
    pub fn new(value: T) -> Result<Self> {
        Self::new_in(value, DefaultPinned)
    }

    /// Uninitialised pinned memory for one `T`.
    ///
    /// # Errors
    ///
    /// The allocator's error.
    pub fn new_uninit() -> Result<PinnedBox<MaybeUninit<T>>> {
        PinnedBox::new_uninit_in(DefaultPinned)
    }
}

impl<T: Zeroable> PinnedBox<T> {
    /// A zeroed `T` in pinned memory.
    ///
    /// # Errors
    ///
    /// The allocator's error.
    pub fn new_zeroed() -> Result<Self> {
        Self::new_zeroed_in(DefaultPinned)
    }
}

impl<T, A: PinnedAllocator> PinnedBox<T, A> {
    /// Moves `value` into memory from `allocator`.
    ///
    /// # Errors
    ///
    /// The allocator's error (`value` is dropped).
    pub fn new_in(value: T, allocator: A) -> Result<Self> {
        let uninit = PinnedBox::<MaybeUninit<T>, A>::new_uninit_in(allocator)?;
        Ok(PinnedBox::write(uninit, value))
    }

    /// Zeroed memory for one `T` from `allocator`.
    ///
    /// # Errors
    ///
    /// The allocator's error.
    pub fn new_zeroed_in(allocator: A) -> Result<Self>
    where
        T: Zeroable,
    {
        let mut uninit = PinnedBox::<MaybeUninit<T>, A>::new_uninit_in(allocator)?;
        // SAFETY: `T: Zeroable`: all-zero bytes are a valid `T`.
        unsafe {
            ptr::write_bytes(uninit.as_mut_ptr(), 0, 1);
            Ok(uninit.assume_init())
        }
    }

    /// The kind of memory; `None` for zero-sized types.
    pub fn memory_kind(&self) -> Option<MemoryKind> {
        self.allocation.as_ref().map(Allocation::kind)
    }

    /// A pointer to the value.
    pub fn as_ptr(&self) -> *const T {
        self.ptr.as_ptr()
    }

    /// A mutable pointer to the value.
    pub fn as_mut_ptr(&mut self) -> *mut T {
        self.ptr.as_ptr()
    }

    /// Marks the memory as used by work on `stream` the crate cannot see; see
    /// [`PinnedVec::record_stream`](crate::PinnedVec::record_stream).
    pub fn record_stream(&mut self, stream: &Stream) {
        self.uses.record_stream(stream);
    }

    pub(crate) fn uses_mut(&mut self) -> &mut StreamUses {
        &mut self.uses
    }

    /// The value's address in the device's address space (mapped memory); see
    /// [`PinnedVec::device_ptr`](crate::PinnedVec::device_ptr).
    ///
    /// # Errors
    ///
    /// [`Error::Unsupported`](crate::Error::Unsupported) for zero-sized types and `mlock`ed
    /// memory; the CUDA error when the memory is not mapped.
    pub fn device_ptr(&self) -> Result<u64> {
        let allocation = self.allocation.as_ref();
        allocation
            .ok_or(crate::Error::Unsupported(
                "a zero-sized value has no buffer",
            ))?
            .device_ptr()
    }

    /// Moves the value out and frees the memory.
    pub fn into_inner(self) -> T {
        let mut this = ManuallyDrop::new(self);
        // SAFETY: the value is initialised; it is read once and `this` is never dropped, so
        // the memory is released below without dropping the value again.
        let value = unsafe { this.ptr.as_ptr().read() };
        let allocation = this.allocation.take();
        // SAFETY: fields moved out once from a value that is not dropped.
        let (mut uses, allocator) = unsafe { (ptr::read(&this.uses), ptr::read(&this.allocator)) };
        if let Some(allocation) = allocation {
            // SAFETY: from this allocator; `uses` covers device work.
            unsafe { release(&allocator, allocation, &mut uses) };
        }
        value
    }
}

impl<T, A: PinnedAllocator> PinnedBox<MaybeUninit<T>, A> {
    /// Uninitialised memory for one `T` from `allocator`.
    ///
    /// # Errors
    ///
    /// The allocator's error.
    pub fn new_uninit_in(allocator: A) -> Result<Self> {
        let (ptr, allocation) = if mem::size_of::<T>() == 0 {
            (NonNull::dangling(), None)
        } else {
            let allocation = allocator.allocate(Layout::new::<T>())?;
            (allocation.ptr().cast(), Some(allocation))
        };
        Ok(Self {
            ptr,
            allocation,
            uses: StreamUses::new(),
            allocator,
            _owns: PhantomData,
        })
    }

    /// Declares the value initialised.
    ///
    /// # Safety
    ///
    /// - the memory holds a valid `T`.
    pub unsafe fn assume_init(self) -> PinnedBox<T, A> {
        let mut this = ManuallyDrop::new(self);
        // SAFETY: every field is moved out once from a value that is never dropped;
        // `MaybeUninit<T>` and `T` have the same layout.
        unsafe {
            PinnedBox {
                ptr: this.ptr.cast(),
                allocation: this.allocation.take(),
                uses: ptr::read(&this.uses),
                allocator: ptr::read(&this.allocator),
                _owns: PhantomData,
            }
        }
    }

    /// Writes `value` and declares the box initialised.
    pub fn write(this: Self, value: T) -> PinnedBox<T, A> {
        // SAFETY: `ptr` is valid for one `T`; `MaybeUninit` needs no drop of what was there.
        unsafe {
            this.ptr.as_ptr().write(MaybeUninit::new(value));
            this.assume_init()
        }
    }
}

impl<T, A: PinnedAllocator> Drop for PinnedBox<T, A> {
    fn drop(&mut self) {
        // SAFETY: the value is initialised (a `PinnedBox<MaybeUninit<_>>` drops nothing).
        unsafe { ptr::drop_in_place(self.ptr.as_ptr()) };
        if let Some(allocation) = self.allocation.take() {
            // SAFETY: from this allocator; `uses` covers device work.
            unsafe { release(&self.allocator, allocation, &mut self.uses) };
        }
    }
}

impl<T, A: PinnedAllocator> Deref for PinnedBox<T, A> {
    type Target = T;
    fn deref(&self) -> &T {
        // SAFETY: the value is initialised and no device work writes it while `self` is
        // borrowed: copies take the box by value.
        unsafe { self.ptr.as_ref() }
    }
}

impl<T, A: PinnedAllocator> DerefMut for PinnedBox<T, A> {
    fn deref_mut(&mut self) -> &mut T {
        // SAFETY: as `deref`; `&mut self` makes the access unique.
        unsafe { self.ptr.as_mut() }
    }
}

impl<T: fmt::Debug, A: PinnedAllocator> fmt::Debug for PinnedBox<T, A> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Debug::fmt(&**self, f)
    }
}
