//! `PinnedBox<T, A>`: one value in page-locked memory.

use std::alloc::Layout;
use std::fmt;
use std::marker::PhantomData;
use std::mem::{self, ManuallyDrop, MaybeUninit};
use std::ops::{Deref, DerefMut};
use std::ptr::{self, NonNull};

use bytemuck::Zeroable;

use crate::containers::block::Block;
use crate::error::Result;
use crate::gpu::stream::Stream;
use crate::memory::allocator::MemoryKind;
use crate::memory::allocator::PinnedAllocator;
use crate::memory::default::DefaultPinned;
use crate::memory::uses::StreamUses;

/// One value in page-locked memory, like `Box<T>`: a counter or a struct the GPU writes back,
/// a small parameter block, a staging slot.
///
/// Zero-sized types never allocate. The same safety model as [`PinnedVec`](crate::PinnedVec):
/// async copies take the box by value and give it back when they have finished.
pub struct PinnedBox<T, A: PinnedAllocator = DefaultPinned> {
    /// The memory (dangling and empty for zero-sized `T`); given back when the block drops,
    /// after the value (also when dropping the value panics).
    block: Block<A>,
    _owns: PhantomData<T>,
}

// SAFETY: owns its `T` like `Box<T>`.
unsafe impl<T: Send, A: PinnedAllocator + Send> Send for PinnedBox<T, A> {}
// SAFETY: `&PinnedBox<T>` only gives `&T`.
unsafe impl<T: Sync, A: PinnedAllocator + Sync> Sync for PinnedBox<T, A> {}

impl<T> PinnedBox<T> {
    /// Moves `value` into pinned memory.
    ///
    /// # Examples
    ///
    /// ```
    /// use cuda_pinned::PinnedBox;
    /// let header = PinnedBox::new([0u32; 16])?;
    /// assert_eq!(header[3], 0);
    /// # Ok::<(), cuda_pinned::Error>(())
    /// ```
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
        self.block.kind()
    }

    /// A pointer to the value.
    #[inline]
    pub fn as_ptr(&self) -> *const T {
        self.block.ptr().as_ptr().cast()
    }

    /// A mutable pointer to the value.
    #[inline]
    pub fn as_mut_ptr(&mut self) -> *mut T {
        self.block.ptr().as_ptr().cast()
    }

    /// Marks the memory as used by work on `stream` the crate cannot see; see
    /// [`PinnedVec::record_stream`](crate::PinnedVec::record_stream).
    pub fn record_stream(&mut self, stream: &Stream) {
        self.block.record_stream(stream);
    }

    pub(crate) fn uses_mut(&mut self) -> &mut StreamUses {
        self.block.uses_mut()
    }

    /// The value's address in the device's address space (mapped memory); see
    /// [`PinnedVec::device_ptr`](crate::PinnedVec::device_ptr).
    ///
    /// # Errors
    ///
    /// [`Error::Unsupported`](crate::Error::Unsupported) for zero-sized types and `mlock`ed
    /// memory; the CUDA error when the memory is not mapped.
    pub fn device_ptr(&self) -> Result<u64> {
        self.block
            .allocation()
            .ok_or(crate::Error::Unsupported(
                "a zero-sized value has no buffer",
            ))?
            .device_ptr()
    }

    /// Moves the value out and frees the memory.
    pub fn into_inner(self) -> T {
        let this = ManuallyDrop::new(self);
        // SAFETY: the value is initialised and read once; `this` is never dropped, so the
        // block (moved out once, and given back when it drops) does not drop it again.
        unsafe {
            let value = this.as_ptr().read();
            drop(ptr::read(&this.block));
            value
        }
    }
}

impl<T, A: PinnedAllocator> PinnedBox<MaybeUninit<T>, A> {
    /// Uninitialised memory for one `T` from `allocator`.
    ///
    /// # Errors
    ///
    /// The allocator's error.
    pub fn new_uninit_in(allocator: A) -> Result<Self> {
        let block = if mem::size_of::<T>() == 0 {
            Block::empty(NonNull::<T>::dangling().cast(), allocator)
        } else {
            Block::allocate(Layout::new::<T>(), allocator)?
        };
        Ok(Self {
            block,
            _owns: PhantomData,
        })
    }

    /// Declares the value initialised.
    ///
    /// # Safety
    ///
    /// - the memory holds a valid `T`.
    pub unsafe fn assume_init(self) -> PinnedBox<T, A> {
        let this = ManuallyDrop::new(self);
        // SAFETY: the block is moved out once from a value that is never dropped;
        // `MaybeUninit<T>` and `T` have the same layout, so it fits the value as it is.
        let block = unsafe { ptr::read(&this.block) };
        PinnedBox {
            block,
            _owns: PhantomData,
        }
    }

    /// Writes `value` and declares the box initialised.
    pub fn write(mut this: Self, value: T) -> PinnedBox<T, A> {
        // SAFETY: the block is valid for one `T` (or `T` is zero-sized and the pointer
        // dangling, aligned); `MaybeUninit` needs no drop of what was there.
        unsafe {
            this.as_mut_ptr().write(MaybeUninit::new(value));
            this.assume_init()
        }
    }
}

impl<T, A: PinnedAllocator> Drop for PinnedBox<T, A> {
    fn drop(&mut self) {
        // SAFETY: the value is initialised (a `PinnedBox<MaybeUninit<_>>` drops nothing) and
        // dropped once, here; the block field gives the memory back afterwards, also if the
        // value's destructor panics.
        unsafe { ptr::drop_in_place(self.as_mut_ptr()) };
    }
}

impl<T, A: PinnedAllocator> Deref for PinnedBox<T, A> {
    type Target = T;
    fn deref(&self) -> &T {
        // SAFETY: the value is initialised and no device work writes it while `self` is
        // borrowed: copies take the box by value.
        unsafe { &*self.as_ptr() }
    }
}

impl<T, A: PinnedAllocator> DerefMut for PinnedBox<T, A> {
    fn deref_mut(&mut self) -> &mut T {
        // SAFETY: as `deref`; `&mut self` makes the access unique.
        unsafe { &mut *self.as_mut_ptr() }
    }
}

impl<T: fmt::Debug, A: PinnedAllocator> fmt::Debug for PinnedBox<T, A> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Debug::fmt(&**self, f)
    }
}
