//! `PinnedVec<T, A>`: a growable array in page-locked memory.

use std::alloc::Layout;
use std::fmt;
use std::marker::PhantomData;
use std::mem::{self, ManuallyDrop, MaybeUninit};
use std::ops::{Deref, DerefMut};
use std::ptr::{self, NonNull};

use bytemuck::{AnyBitPattern, NoUninit, Zeroable};

use crate::containers::block::Block;
use crate::error::Error;
use crate::error::Result;
use crate::gpu::stream::Stream;
use crate::memory::allocator::Allocation;
use crate::memory::allocator::MemoryKind;
use crate::memory::allocator::PinnedAllocator;
use crate::memory::default::DefaultPinned;
use crate::memory::uses::StreamUses;

/// A contiguous growable array in page-locked memory: `Vec<T>` whose buffer a GPU can copy
/// from and to at full speed, asynchronously.
///
/// `A` says where the memory comes from: [`DefaultPinned`] (the fast registration path with
/// CUDA, `mlock` without), [`CudaHost`](crate::CudaHost), [`Registered`](crate::Registered),
/// [`HostLocked`](crate::HostLocked), or a caching pool (`&Pool` or `Arc<Pool>`: any
/// reference or `Arc` of an allocator is one).
///
/// Methods that allocate have a `try_` twin that returns [`Error`] instead of panicking.
/// Zero-sized types and empty vectors never allocate.
///
/// # Safety
///
/// The buffer is only ever reachable through `&self`/`&mut self` while no device work uses
/// it: async copies take the vector by value ([`Stream::copy_to_device`]) and give it back
/// after they finish. Streams recorded with [`record_stream`](Self::record_stream) (work the
/// crate cannot see, such as a kernel reading [`device_ptr`](Self::device_ptr)) are waited
/// for, or deferred on by a caching allocator, before the memory is freed or reused.
pub struct PinnedVec<T, A: PinnedAllocator = DefaultPinned> {
    /// The memory: dangling and zero bytes until the first allocation; given back when the
    /// block drops, after the elements (also when dropping an element panics).
    block: Block<A>,
    len: usize,
    _owns: PhantomData<T>,
}

// SAFETY: `PinnedVec<T>` owns its `T`s like `Vec<T>`: sending it sends them, so `T: Send`
// suffices (the allocator must be sendable too). The raw pointer is uniquely owned.
unsafe impl<T: Send, A: PinnedAllocator + Send> Send for PinnedVec<T, A> {}
// SAFETY: `&PinnedVec<T>` only gives `&[T]` and reads of plain fields, like `&Vec<T>`.
unsafe impl<T: Sync, A: PinnedAllocator + Sync> Sync for PinnedVec<T, A> {}

impl<T> PinnedVec<T> {
    /// An empty vector; allocates nothing until elements arrive.
    pub const fn new() -> Self {
        Self::new_in(DefaultPinned)
    }

    /// An empty vector with room for at least `capacity` elements.
    ///
    /// # Examples
    ///
    /// ```
    /// use cuda_pinned::PinnedVec;
    /// let mut batch = PinnedVec::<f32>::with_capacity(1024)?;
    /// batch.extend((0..1024).map(|i| i as f32));
    /// assert!(batch.capacity() >= 1024);
    /// # Ok::<(), cuda_pinned::Error>(())
    /// ```
    ///
    /// # Errors
    ///
    /// [`Error::CapacityOverflow`] when the size overflows, or the allocator's error.
    pub fn with_capacity(capacity: usize) -> Result<Self> {
        Self::with_capacity_in(capacity, DefaultPinned)
    }
}

impl<T: Clone> PinnedVec<T> {
    /// A pinned copy of `slice`.
    ///
    /// # Examples
    ///
    /// ```
    /// use cuda_pinned::PinnedVec;
    /// let labels = PinnedVec::from_slice(&[1i64, 2, 3])?;
    /// assert_eq!(labels, [1, 2, 3][..]);
    /// # Ok::<(), cuda_pinned::Error>(())
    /// ```
    ///
    /// # Errors
    ///
    /// The allocator's error.
    pub fn from_slice(slice: &[T]) -> Result<Self> {
        Self::from_slice_in(slice, DefaultPinned)
    }
}

impl<T: Zeroable> PinnedVec<T> {
    /// `len` zeroed elements.
    ///
    /// # Errors
    ///
    /// [`Error::CapacityOverflow`] or the allocator's error.
    pub fn zeroed(len: usize) -> Result<Self> {
        Self::zeroed_in(len, DefaultPinned)
    }
}

/// Keeps a vector's length in a local while a loop writes elements, and stores it back when
/// the loop ends or a `clone` unwinds. With the length out of memory, the compiler can tell
/// that the writes do not change it, and a loop of `Copy` elements becomes one `memcpy`.
struct SetLenOnDrop<'a> {
    len: &'a mut usize,
    local: usize,
}

impl Drop for SetLenOnDrop<'_> {
    #[inline]
    fn drop(&mut self) {
        *self.len = self.local;
    }
}

impl<T, A: PinnedAllocator> PinnedVec<T, A> {
    const IS_ZST: bool = mem::size_of::<T>() == 0;

    /// An empty vector using `allocator`; allocates nothing.
    #[inline]
    pub const fn new_in(allocator: A) -> Self {
        Self {
            block: Block::empty(NonNull::<T>::dangling().cast(), allocator),
            len: 0,
            _owns: PhantomData,
        }
    }

    /// An empty vector with room for at least `capacity` elements, from `allocator`.
    ///
    /// # Errors
    ///
    /// [`Error::CapacityOverflow`] when the size overflows, or the allocator's error.
    #[inline]
    pub fn with_capacity_in(capacity: usize, allocator: A) -> Result<Self> {
        if Self::IS_ZST || capacity == 0 {
            return Ok(Self::new_in(allocator));
        }
        let Ok(layout) = Layout::array::<T>(capacity) else {
            return Err(Error::CapacityOverflow);
        };
        Ok(Self {
            block: Block::allocate(layout, allocator)?,
            len: 0,
            _owns: PhantomData,
        })
    }

    /// Number of elements.
    #[inline]
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether there are no elements.
    #[inline]
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Elements the buffer holds without reallocating (page-granular allocators often give
    /// more than was asked for).
    #[inline]
    pub fn capacity(&self) -> usize {
        if Self::IS_ZST {
            usize::MAX
        } else {
            self.block.bytes() / mem::size_of::<T>()
        }
    }

    /// The allocator.
    pub fn allocator(&self) -> &A {
        self.block.allocator()
    }

    /// The kind of memory the buffer is in; `None` while nothing is allocated.
    pub fn memory_kind(&self) -> Option<MemoryKind> {
        self.block.kind()
    }

    /// A pointer to the first element (dangling when nothing is allocated).
    #[inline]
    pub fn as_ptr(&self) -> *const T {
        self.block.ptr().as_ptr().cast()
    }

    /// A mutable pointer to the first element (dangling when nothing is allocated).
    #[inline]
    pub fn as_mut_ptr(&mut self) -> *mut T {
        self.block.ptr().as_ptr().cast()
    }

    /// The elements.
    #[inline]
    pub fn as_slice(&self) -> &[T] {
        // SAFETY: the block is valid for `len` initialised elements (dangling, aligned and 0
        // when empty), and no device work writes them while `self` is borrowed (see the
        // type's Safety).
        unsafe { std::slice::from_raw_parts(self.as_ptr(), self.len) }
    }

    /// The elements, mutably.
    #[inline]
    pub fn as_mut_slice(&mut self) -> &mut [T] {
        // SAFETY: as `as_slice`, and `&mut self` makes the access unique.
        unsafe { std::slice::from_raw_parts_mut(self.as_mut_ptr(), self.len) }
    }

    /// The capacity past the length, as uninitialised elements to write in place.
    ///
    /// The room after the elements, to be filled in place and then declared with
    /// [`set_len`](Self::set_len) — how a worker writes a batch straight into pinned memory
    /// without building it elsewhere first.
    ///
    /// ```
    /// # use cuda_pinned::PinnedVec;
    /// let mut v = PinnedVec::<u32>::with_capacity(4)?;
    /// for (i, slot) in v.spare_capacity_mut()[..4].iter_mut().enumerate() {
    ///     slot.write(i as u32 * 10);
    /// }
    /// // SAFETY: the first 4 elements were just written.
    /// unsafe { v.set_len(4) };
    /// assert_eq!(v, [0, 10, 20, 30][..]);
    /// # Ok::<(), cuda_pinned::Error>(())
    /// ```
    #[inline]
    pub fn spare_capacity_mut(&mut self) -> &mut [MaybeUninit<T>] {
        let spare = self.capacity() - self.len;
        // SAFETY: the block holds `capacity` elements' room; the slots from `len` on are
        // unused (`MaybeUninit` asks nothing of their contents), and `&mut self` makes the
        // access unique. For zero-sized `T` the dangling pointer is valid for any length.
        unsafe {
            std::slice::from_raw_parts_mut(
                self.as_mut_ptr().add(self.len).cast::<MaybeUninit<T>>(),
                spare,
            )
        }
    }

    /// Sets the length, as `Vec::set_len`.
    ///
    /// # Safety
    ///
    /// - `new_len <= self.capacity()`;
    /// - the elements at `old_len..new_len` are initialised (and those beyond `new_len` are
    ///   no longer considered part of the vector: they are not dropped).
    #[inline]
    pub unsafe fn set_len(&mut self, new_len: usize) {
        debug_assert!(new_len <= self.capacity());
        self.len = new_len;
    }

    /// Makes room for at least `additional` more elements, growing geometrically.
    ///
    /// # Errors
    ///
    /// [`Error::CapacityOverflow`] or the allocator's error; the vector is unchanged.
    #[inline]
    pub fn try_reserve(&mut self, additional: usize) -> Result<()> {
        // `let else`, not `ok_or`: an error value built eagerly is also dropped on success.
        let Some(required) = self.len.checked_add(additional) else {
            return Err(Error::CapacityOverflow);
        };
        if required <= self.capacity() {
            return Ok(());
        }
        let minimum = match mem::size_of::<T>() {
            1 => 8,
            ..=1024 => 4,
            _ => 1,
        };
        self.grow_to(required.max(self.capacity().saturating_mul(2)).max(minimum))
    }

    /// Makes room for exactly `additional` more elements (the allocator may round up).
    ///
    /// # Errors
    ///
    /// [`Error::CapacityOverflow`] or the allocator's error; the vector is unchanged.
    pub fn try_reserve_exact(&mut self, additional: usize) -> Result<()> {
        // `let else`, not `ok_or`: an error value built eagerly is also dropped on success.
        let Some(required) = self.len.checked_add(additional) else {
            return Err(Error::CapacityOverflow);
        };
        if required <= self.capacity() {
            return Ok(());
        }
        self.grow_to(required)
    }

    /// As [`try_reserve`](Self::try_reserve).
    ///
    /// # Panics
    ///
    /// When the allocation fails.
    pub fn reserve(&mut self, additional: usize) {
        if let Err(e) = self.try_reserve(additional) {
            panic!("PinnedVec::reserve: {}", crate::ErrorChain(&e));
        }
    }

    /// Makes room for `capacity` (> the current capacity) elements: in place where the
    /// allocator can grow the block, else by moving the elements into a new allocation. An
    /// allocator that fails to grow in place fails the call (a new block would fail alike).
    #[cold]
    fn grow_to(&mut self, capacity: usize) -> Result<()> {
        if Self::IS_ZST {
            return Ok(()); // capacity is already usize::MAX
        }
        let layout = Layout::array::<T>(capacity).map_err(|_| Error::CapacityOverflow)?;
        if self.block.grow_in_place(layout)? {
            return Ok(());
        }
        let allocation = self.block.allocate_more(layout)?;
        // SAFETY: the new block holds ≥ `capacity` ≥ `len` elements and does not overlap the
        // old one (both are live allocations); moving the bits moves the values.
        unsafe {
            ptr::copy_nonoverlapping(self.as_ptr(), allocation.ptr().as_ptr().cast(), self.len)
        };
        // SAFETY: from this block's allocator, unused elsewhere; the old block's values were
        // moved out above. The block points at the new memory before the old one is given
        // back, so an unwinding allocator cannot leave this vector on freed memory.
        unsafe { self.block.replace(allocation) };
        Ok(())
    }

    /// Appends `value`.
    ///
    /// # Errors
    ///
    /// The allocator's error if the vector had to grow; `value` is dropped.
    #[inline]
    pub fn try_push(&mut self, value: T) -> Result<()> {
        if self.len == self.capacity() {
            self.try_reserve(1)?;
        }
        // SAFETY: `len < capacity`, so the slot is inside the buffer and unused.
        unsafe { self.as_mut_ptr().add(self.len).write(value) };
        self.len += 1;
        Ok(())
    }

    /// Appends `value`.
    ///
    /// # Panics
    ///
    /// When growing fails; [`try_push`](Self::try_push) returns the error instead.
    #[inline]
    pub fn push(&mut self, value: T) {
        if let Err(e) = self.try_push(value) {
            panic!("PinnedVec::push: {}", crate::ErrorChain(&e));
        }
    }

    /// Removes and returns the last element.
    pub fn pop(&mut self) -> Option<T> {
        if self.len == 0 {
            return None;
        }
        self.len -= 1;
        // SAFETY: the slot held an initialised value, now outside `len`, read once.
        Some(unsafe { self.as_ptr().add(self.len).read() })
    }

    /// Keeps the first `len` elements and drops the rest.
    pub fn truncate(&mut self, len: usize) {
        if len >= self.len {
            return;
        }
        let tail = ptr::slice_from_raw_parts_mut(
            // SAFETY: `len < self.len`, inside the buffer.
            unsafe { self.as_mut_ptr().add(len) },
            self.len - len,
        );
        // Shorten first: if a destructor panics, the vector never sees a dropped value.
        self.len = len;
        // SAFETY: the tail holds initialised values no longer reachable from the vector.
        unsafe { ptr::drop_in_place(tail) };
    }

    /// Drops every element; keeps the buffer.
    pub fn clear(&mut self) {
        self.truncate(0);
    }

    /// Marks the buffer as used by work on `stream` that this crate cannot see (a kernel reading it
    /// through [`device_ptr`](Self::device_ptr), a copy by another library).
    ///
    /// When the buffer is freed or returned to a pool, that work is waited for, or deferred on,
    /// first. Copies made through this crate record their use themselves. Freed while `stream` is
    /// capturing a CUDA graph, the buffer is never released: the graph may use it at any launch.
    pub fn record_stream(&mut self, stream: &Stream) {
        self.block.record_stream(stream);
    }

    pub(crate) fn uses_mut(&mut self) -> &mut StreamUses {
        self.block.uses_mut()
    }

    /// The address of the buffer in the device's address space, for kernels that use it.
    ///
    /// Such kernels read or write host memory directly (mapped memory:
    /// [`HostAllocFlags::MAPPED`](crate::HostAllocFlags::MAPPED),
    /// [`RegisterFlags::MAPPED`](crate::RegisterFlags::MAPPED), or any CUDA-pinned memory on
    /// systems with unified addressing). Use [`record_stream`](Self::record_stream) for the streams
    /// such kernels run on.
    ///
    /// # Errors
    ///
    /// [`Error::Unsupported`] for empty vectors and `mlock`ed memory; the CUDA error when
    /// the memory is not mapped.
    pub fn device_ptr(&self) -> Result<u64> {
        self.block
            .allocation()
            .ok_or(Error::Unsupported("an empty vector has no buffer"))?
            .device_ptr()
    }

    /// Takes the vector apart: the allocation (if any), the length and the allocator.
    ///
    /// Uses recorded with [`record_stream`](Self::record_stream) are forgotten: whoever frees the
    /// memory (through [`from_raw_parts`](Self::from_raw_parts) or the allocator) answers for them.
    pub fn into_raw_parts(self) -> (Option<Allocation>, usize, A) {
        let this = ManuallyDrop::new(self);
        // SAFETY: `this` is never used or dropped again; the block is moved out once.
        let block = unsafe { ptr::read(&this.block) };
        let (allocation, allocator) = block.into_parts();
        (allocation, this.len, allocator)
    }

    /// Rebuilds a vector from [`into_raw_parts`](Self::into_raw_parts).
    ///
    /// # Safety
    ///
    /// - `allocation` came from `allocator` (or an equal clone) and is unused elsewhere;
    ///   `None` only with `len == 0` or a zero-sized `T`;
    /// - its first `len` elements are initialised `T`s, and `len` ≤ its capacity;
    /// - no device work still uses the memory.
    pub unsafe fn from_raw_parts(allocation: Option<Allocation>, len: usize, allocator: A) -> Self {
        Self {
            // SAFETY: forwarded from the caller.
            block: unsafe {
                Block::from_parts(allocation, NonNull::<T>::dangling().cast(), allocator)
            },
            len,
            _owns: PhantomData,
        }
    }

    /// Writes `count` values from `next` after the elements; room for them is reserved.
    /// Keeps the length right if `next` unwinds.
    #[inline]
    fn write_reserved(&mut self, count: usize, mut next: impl FnMut(usize) -> T) {
        let ptr = self.as_mut_ptr();
        let mut len = SetLenOnDrop {
            local: self.len,
            len: &mut self.len,
        };
        for i in 0..count {
            // SAFETY: the caller reserved room for `count` more elements.
            unsafe { ptr.add(len.local).write(next(i)) };
            len.local += 1;
        }
    }
}

impl<T: Clone, A: PinnedAllocator> PinnedVec<T, A> {
    /// A pinned copy of `slice`, from `allocator`.
    ///
    /// # Errors
    ///
    /// The allocator's error.
    pub fn from_slice_in(slice: &[T], allocator: A) -> Result<Self> {
        let mut vec = Self::with_capacity_in(slice.len(), allocator)?;
        vec.try_extend_from_slice(slice)?;
        Ok(vec)
    }

    /// Appends clones of `slice`'s elements (for `Copy` types, one `memcpy`).
    ///
    /// # Errors
    ///
    /// The allocator's error; the vector is unchanged.
    #[inline]
    pub fn try_extend_from_slice(&mut self, slice: &[T]) -> Result<()> {
        self.try_reserve(slice.len())?;
        self.write_reserved(slice.len(), |i| slice[i].clone());
        Ok(())
    }

    /// Appends clones of `slice`'s elements (for `Copy` types, one `memcpy`).
    ///
    /// # Panics
    ///
    /// When growing fails.
    #[inline]
    pub fn extend_from_slice(&mut self, slice: &[T]) {
        if let Err(e) = self.try_extend_from_slice(slice) {
            panic!("PinnedVec::extend_from_slice: {}", crate::ErrorChain(&e));
        }
    }

    /// Grows or shrinks to `len` elements, filling with clones of `value`.
    ///
    /// # Errors
    ///
    /// The allocator's error; the vector is unchanged.
    pub fn try_resize(&mut self, len: usize, value: T) -> Result<()> {
        if len <= self.len {
            self.truncate(len);
            return Ok(());
        }
        let extra = len - self.len;
        self.try_reserve(extra)?;
        self.write_reserved(extra, |_| value.clone());
        Ok(())
    }

    /// Grows or shrinks to `len` elements, filling with clones of `value`.
    ///
    /// # Panics
    ///
    /// When growing fails.
    pub fn resize(&mut self, len: usize, value: T) {
        if let Err(e) = self.try_resize(len, value) {
            panic!("PinnedVec::resize: {}", crate::ErrorChain(&e));
        }
    }
}

impl<T: Clone, A: PinnedAllocator + Clone> PinnedVec<T, A> {
    /// A copy in new pinned memory from the same allocator.
    ///
    /// # Errors
    ///
    /// The allocator's error.
    pub fn try_clone(&self) -> Result<Self> {
        Self::from_slice_in(self, self.allocator().clone())
    }
}

impl<T: Zeroable, A: PinnedAllocator> PinnedVec<T, A> {
    /// `len` zeroed elements from `allocator`.
    ///
    /// # Errors
    ///
    /// [`Error::CapacityOverflow`] or the allocator's error.
    pub fn zeroed_in(len: usize, allocator: A) -> Result<Self> {
        let mut vec = Self::with_capacity_in(len, allocator)?;
        // SAFETY: capacity ≥ len; all-zero bytes are a valid `T` (`Zeroable`).
        unsafe {
            ptr::write_bytes(vec.as_mut_ptr(), 0, len);
            vec.set_len(len);
        }
        Ok(vec)
    }
}

impl<T: NoUninit, A: PinnedAllocator> PinnedVec<T, A> {
    /// The elements as bytes.
    pub fn as_bytes(&self) -> &[u8] {
        bytemuck::cast_slice(self.as_slice())
    }
}

impl<T: NoUninit + AnyBitPattern, A: PinnedAllocator> PinnedVec<T, A> {
    /// The elements as mutable bytes.
    pub fn as_bytes_mut(&mut self) -> &mut [u8] {
        bytemuck::cast_slice_mut(self.as_mut_slice())
    }
}

impl<T, A: PinnedAllocator> Drop for PinnedVec<T, A> {
    #[inline]
    fn drop(&mut self) {
        // SAFETY: the first `len` elements are initialised and dropped once here. The block
        // field gives the memory back afterwards, also if a destructor panics.
        unsafe { ptr::drop_in_place(ptr::slice_from_raw_parts_mut(self.as_mut_ptr(), self.len)) };
    }
}

impl<T, A: PinnedAllocator> Deref for PinnedVec<T, A> {
    type Target = [T];
    fn deref(&self) -> &[T] {
        self.as_slice()
    }
}

impl<T, A: PinnedAllocator> DerefMut for PinnedVec<T, A> {
    fn deref_mut(&mut self) -> &mut [T] {
        self.as_mut_slice()
    }
}

impl<T, A: PinnedAllocator> AsRef<[T]> for PinnedVec<T, A> {
    fn as_ref(&self) -> &[T] {
        self
    }
}

impl<T, A: PinnedAllocator> AsMut<[T]> for PinnedVec<T, A> {
    fn as_mut(&mut self) -> &mut [T] {
        self
    }
}

impl<T> Default for PinnedVec<T> {
    fn default() -> Self {
        Self::new()
    }
}

impl<T: Clone, A: PinnedAllocator + Clone> Clone for PinnedVec<T, A> {
    /// # Panics
    ///
    /// When the allocation fails; [`try_clone`](PinnedVec::try_clone) returns the error.
    fn clone(&self) -> Self {
        self.try_clone()
            .unwrap_or_else(|e| panic!("PinnedVec::clone: {}", crate::ErrorChain(&e)))
    }
}

impl<T: fmt::Debug, A: PinnedAllocator> fmt::Debug for PinnedVec<T, A> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_list().entries(self.iter()).finish()
    }
}

impl<T: PartialEq<U>, U, A: PinnedAllocator, B: PinnedAllocator> PartialEq<PinnedVec<U, B>>
    for PinnedVec<T, A>
{
    fn eq(&self, other: &PinnedVec<U, B>) -> bool {
        self.as_slice() == other.as_slice()
    }
}

impl<T: PartialEq<U>, U, A: PinnedAllocator> PartialEq<[U]> for PinnedVec<T, A> {
    fn eq(&self, other: &[U]) -> bool {
        self.as_slice() == other
    }
}

impl<T: PartialEq<U>, U, A: PinnedAllocator> PartialEq<Vec<U>> for PinnedVec<T, A> {
    fn eq(&self, other: &Vec<U>) -> bool {
        self.as_slice() == other.as_slice()
    }
}

impl<T: Eq, A: PinnedAllocator> Eq for PinnedVec<T, A> {}

/// # Panics
///
/// When growing fails (as `Vec`'s `Extend` aborts); use `try_push` to handle it.
impl<T, A: PinnedAllocator> Extend<T> for PinnedVec<T, A> {
    fn extend<I: IntoIterator<Item = T>>(&mut self, iter: I) {
        let iter = iter.into_iter();
        self.reserve(iter.size_hint().0);
        for value in iter {
            self.push(value);
        }
    }
}

/// # Panics
///
/// When growing fails.
impl<'a, T: Copy + 'a, A: PinnedAllocator> Extend<&'a T> for PinnedVec<T, A> {
    fn extend<I: IntoIterator<Item = &'a T>>(&mut self, iter: I) {
        self.extend(iter.into_iter().copied());
    }
}

impl<A: PinnedAllocator> std::io::Write for PinnedVec<u8, A> {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.try_extend_from_slice(buf)
            .map_err(|e| std::io::Error::new(std::io::ErrorKind::OutOfMemory, e))?;
        Ok(buf.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

impl<'a, T, A: PinnedAllocator> IntoIterator for &'a PinnedVec<T, A> {
    type Item = &'a T;
    type IntoIter = std::slice::Iter<'a, T>;
    fn into_iter(self) -> Self::IntoIter {
        self.iter()
    }
}

impl<'a, T, A: PinnedAllocator> IntoIterator for &'a mut PinnedVec<T, A> {
    type Item = &'a mut T;
    type IntoIter = std::slice::IterMut<'a, T>;
    fn into_iter(self) -> Self::IntoIter {
        self.iter_mut()
    }
}

impl<T, A: PinnedAllocator> IntoIterator for PinnedVec<T, A> {
    type Item = T;
    type IntoIter = IntoIter<T, A>;
    fn into_iter(mut self) -> IntoIter<T, A> {
        let end = mem::replace(&mut self.len, 0);
        IntoIter {
            buffer: self,
            next: 0,
            end,
        }
    }
}

/// The owning iterator of a [`PinnedVec`]; frees the buffer when dropped.
pub struct IntoIter<T, A: PinnedAllocator = DefaultPinned> {
    /// Holds the memory; its `len` is 0, so it drops no elements itself.
    buffer: PinnedVec<T, A>,
    next: usize,
    end: usize,
}

impl<T, A: PinnedAllocator> Iterator for IntoIter<T, A> {
    type Item = T;
    fn next(&mut self) -> Option<T> {
        if self.next == self.end {
            return None;
        }
        // SAFETY: slots `next..end` hold initialised values not yet yielded; each is read once.
        let value = unsafe { self.buffer.as_ptr().add(self.next).read() };
        self.next += 1;
        Some(value)
    }

    fn size_hint(&self) -> (usize, Option<usize>) {
        let left = self.end - self.next;
        (left, Some(left))
    }
}

impl<T, A: PinnedAllocator> ExactSizeIterator for IntoIter<T, A> {}

impl<T, A: PinnedAllocator> Drop for IntoIter<T, A> {
    fn drop(&mut self) {
        let rest = ptr::slice_from_raw_parts_mut(
            // SAFETY: `next ≤ end ≤ capacity`.
            unsafe { self.buffer.as_mut_ptr().add(self.next) },
            self.end - self.next,
        );
        // SAFETY: the values not yet yielded are initialised and dropped once, here.
        unsafe { ptr::drop_in_place(rest) };
    }
}
