//! Kind 3: registering memory the caller already owns.

use std::fmt;
use std::ops::{Deref, DerefMut};
use std::ptr::NonNull;

use crate::error::{Error, Result};
use crate::gpu::stream::Stream;
use crate::memory::allocator::MemoryKind;
use crate::memory::flags::RegisterFlags;
use crate::memory::uses::StreamUses;

/// Registers `bytes` at `ptr`; `None` for an empty range (nothing to register). Memory CUDA
/// cannot pin is refused before the driver is asked.
fn register(ptr: *mut u8, bytes: usize, flags: RegisterFlags) -> Result<Option<NonNull<u8>>> {
    let Some(ptr) = NonNull::new(ptr).filter(|_| bytes > 0) else {
        return Ok(None);
    };
    if crate::os::in_private_file_mapping(ptr.as_ptr() as usize, bytes) {
        return Err(Error::Unsupported(
            "registering memory of a private (copy-on-write) file mapping, which CUDA cannot \
             pin (the call may never return): read the file into page-locked memory instead",
        ));
    }
    // SAFETY: the callers hold the memory (a unique borrow or an owned `Vec`) for as long as
    // the registration lives, and unregister it before giving the memory up; or, for a
    // `Registration` forgotten with `mem::forget`, never: the driver then keeps the pages
    // locked and its mapping of them to itself, so its copies reach those old pages, never
    // memory the process reuses at that address.
    crate::context::on_current_device(|| unsafe {
        crate::raw::memory::host_register(ptr, bytes, flags.bits())
    })?;
    Ok(Some(ptr))
}

/// A caller's slice, page-locked with `cudaHostRegister` for as long as it is borrowed.
///
/// Copies to and from it run at pinned speed through the blocking copies
/// ([`DeviceBuffer::copy_from_host`](crate::DeviceBuffer::copy_from_host)). Async copies need
/// an owned buffer ([`RegisteredVec`]): a borrowed one could be given back to its owner while
/// the device still writes it.
///
/// A shared mapping of a file on disk cannot be registered for writing (the driver answers
/// `invalid argument`): register it read-only with [`ReadOnlyRegistration`]. Files in tmpfs
/// (`/dev/shm`) can be.
///
/// Registration works on whole pages: two registrations of memory sharing a page fail with
/// `cudaErrorHostMemoryAlreadyRegistered`. Registering costs about as much as allocating
/// pinned memory; it pays off for large buffers that stay registered a while.
///
/// Drop it rather than forget it: a registration forgotten (`mem::forget`) stays in place
/// after the borrow ends, its pages locked until the process exits, and CUDA goes on taking
/// the address range for those pages whatever the owner maps there later, so copies of
/// memory later placed there would read or write the old pages instead.
pub struct Registration<'a, T> {
    slice: &'a mut [T],
    registered: Option<NonNull<u8>>,
}

impl<'a, T> Registration<'a, T> {
    /// Registers `slice` (portable).
    ///
    /// # Errors
    ///
    /// [`Error::Unavailable`](crate::Error::Unavailable) without CUDA, or the CUDA error.
    pub fn new(slice: &'a mut [T]) -> Result<Self> {
        Self::with_flags(slice, RegisterFlags::default())
    }

    /// Registers `slice` with `flags`.
    ///
    /// # Errors
    ///
    /// As [`new`](Self::new).
    pub fn with_flags(slice: &'a mut [T], flags: RegisterFlags) -> Result<Self> {
        let registered = register(slice.as_mut_ptr().cast(), size_of_val(slice), flags)?;
        Ok(Self { slice, registered })
    }

    /// Always [`MemoryKind::Registration`].
    pub fn memory_kind(&self) -> MemoryKind {
        MemoryKind::Registration
    }
}

impl<T> Drop for Registration<'_, T> {
    fn drop(&mut self) {
        if let Some(ptr) = self.registered {
            // SAFETY: registered in `with_flags`; only blocking copies used it, and they
            // finished before returning.
            let _ = crate::context::on_current_device(|| unsafe {
                crate::raw::memory::host_unregister(ptr)
            });
        }
    }
}

impl<T> Deref for Registration<'_, T> {
    type Target = [T];
    fn deref(&self) -> &[T] {
        self.slice
    }
}

impl<T> DerefMut for Registration<'_, T> {
    fn deref_mut(&mut self) -> &mut [T] {
        self.slice
    }
}

impl<T: fmt::Debug> fmt::Debug for Registration<'_, T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_list().entries(self.slice.iter()).finish()
    }
}

/// A caller's slice, registered read-only (`cudaHostRegisterReadOnly`) for as long as it is
/// borrowed: for memory the device only reads.
///
/// Blocking uploads from it ([`DeviceBuffer::copy_from_host`](crate::DeviceBuffer::copy_from_host))
/// run at pinned speed. It needs a device that supports read-only registration
/// ([`Device::supports_read_only_registration`](crate::Device::supports_read_only_registration)).
/// As with [`Registration`], memory of a private file mapping is refused, and forgetting it
/// leaves its pages locked. A shared mapping of a file (`memmap2::Mmap`, say) can be
/// registered this way: the device then reads the file's pages in the page cache.
///
/// # Examples
///
/// ```no_run
/// use cuda_pinned::{DeviceBuffer, ReadOnlyRegistration};
/// let weights = vec![0.5f32; 1 << 24];
/// let pinned = ReadOnlyRegistration::new(&weights)?;
/// let mut on_device = DeviceBuffer::<f32>::zeroed(pinned.len())?;
/// on_device.copy_from_host(&pinned)?;
/// # Ok::<(), cuda_pinned::Error>(())
/// ```
pub struct ReadOnlyRegistration<'a, T> {
    slice: &'a [T],
    registered: Option<NonNull<u8>>,
}

impl<'a, T> ReadOnlyRegistration<'a, T> {
    /// Registers `slice` read-only (and portable).
    ///
    /// # Errors
    ///
    /// [`Error::Unsupported`](crate::Error::Unsupported) for memory of a private file mapping;
    /// [`Error::Unavailable`](crate::Error::Unavailable) without CUDA, or the CUDA error.
    pub fn new(slice: &'a [T]) -> Result<Self> {
        let flags = RegisterFlags::PORTABLE | RegisterFlags::READ_ONLY;
        // Read-only registration never writes through the pointer.
        let registered = register(slice.as_ptr().cast_mut().cast(), size_of_val(slice), flags)?;
        Ok(Self { slice, registered })
    }

    /// Always [`MemoryKind::Registration`].
    pub fn memory_kind(&self) -> MemoryKind {
        MemoryKind::Registration
    }
}

impl<T> Drop for ReadOnlyRegistration<'_, T> {
    fn drop(&mut self) {
        if let Some(ptr) = self.registered {
            // SAFETY: registered in `new`; only blocking copies used it, and they finished
            // before returning.
            let _ = crate::context::on_current_device(|| unsafe {
                crate::raw::memory::host_unregister(ptr)
            });
        }
    }
}

impl<T> Deref for ReadOnlyRegistration<'_, T> {
    type Target = [T];
    fn deref(&self) -> &[T] {
        self.slice
    }
}

impl<T: fmt::Debug> fmt::Debug for ReadOnlyRegistration<'_, T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_list().entries(self.slice.iter()).finish()
    }
}

/// A `Vec<T>` made page-locked with `cudaHostRegister`, for data that already lives in a `Vec`
/// (read from a file, produced by another library).
///
/// It takes part in async copies like [`PinnedVec`](crate::PinnedVec);
/// [`into_inner`](Self::into_inner) unregisters it and gives the `Vec` back. The length is fixed
/// while registered.
pub struct RegisteredVec<T> {
    vec: Vec<T>,
    registered: Option<NonNull<u8>>,
    uses: StreamUses,
}

// SAFETY: owns its `Vec<T>`; the raw pointer is the Vec's own buffer.
unsafe impl<T: Send> Send for RegisteredVec<T> {}
// SAFETY: `&RegisteredVec<T>` only gives `&[T]`.
unsafe impl<T: Sync> Sync for RegisteredVec<T> {}

impl<T> RegisteredVec<T> {
    /// Registers the whole capacity of `vec` (portable).
    ///
    /// # Errors
    ///
    /// [`Error::Unavailable`](crate::Error::Unavailable) without CUDA, or the CUDA error;
    /// the `Vec` is dropped. Use [`with_flags`](Self::with_flags) to choose flags.
    pub fn new(vec: Vec<T>) -> Result<Self> {
        Self::with_flags(vec, RegisterFlags::default())
    }

    /// Registers the whole capacity of `vec` with `flags`.
    ///
    /// # Errors
    ///
    /// As [`new`](Self::new).
    pub fn with_flags(mut vec: Vec<T>, flags: RegisterFlags) -> Result<Self> {
        let bytes = vec.capacity() * size_of::<T>();
        let registered = register(vec.as_mut_ptr().cast(), bytes, flags)?;
        Ok(Self {
            vec,
            registered,
            uses: StreamUses::new(),
        })
    }

    /// Always [`MemoryKind::Registration`].
    pub fn memory_kind(&self) -> MemoryKind {
        MemoryKind::Registration
    }

    /// Marks the buffer as used by work on `stream` this crate cannot see; see
    /// [`PinnedVec::record_stream`](crate::PinnedVec::record_stream).
    pub fn record_stream(&mut self, stream: &Stream) {
        self.uses.record_stream(stream);
    }

    pub(crate) fn uses_mut(&mut self) -> &mut StreamUses {
        &mut self.uses
    }

    /// Waits for recorded uses, unregisters, and returns the `Vec`.
    ///
    /// # Errors
    ///
    /// A CUDA error while waiting or unregistering, or
    /// [`Error::Capturing`](crate::Error::Capturing) when a stream it was used on is
    /// capturing a graph; the memory is then leaked, since the device may still use it.
    pub fn into_inner(self) -> Result<Vec<T>> {
        let mut this = std::mem::ManuallyDrop::new(self);
        let uses = std::mem::take(&mut this.uses);
        uses.finish()?.wait()?;
        if let Some(ptr) = this.registered {
            // SAFETY: registered by us; every device use has finished.
            crate::context::on_current_device(|| unsafe {
                crate::raw::memory::host_unregister(ptr)
            })?;
        }
        // SAFETY: `this` is never dropped; the Vec is moved out once.
        Ok(unsafe { std::ptr::read(&this.vec) })
    }
}

impl<T> Drop for RegisteredVec<T> {
    fn drop(&mut self) {
        let uses = std::mem::take(&mut self.uses);
        let finished = uses.finish().is_ok_and(|pending| pending.wait().is_ok());
        let unregistered = match self.registered {
            // SAFETY: registered by us; every device use has finished.
            Some(ptr) if finished => crate::context::on_current_device(|| unsafe {
                crate::raw::memory::host_unregister(ptr)
            })
            .is_ok(),
            Some(_) => false,
            None => true,
        };
        if !unregistered {
            // The device may still use the memory: leak it rather than free it.
            std::mem::forget(std::mem::take(&mut self.vec));
        }
    }
}

impl<T> Deref for RegisteredVec<T> {
    type Target = [T];
    fn deref(&self) -> &[T] {
        &self.vec
    }
}

impl<T> DerefMut for RegisteredVec<T> {
    fn deref_mut(&mut self) -> &mut [T] {
        &mut self.vec
    }
}

impl<T: fmt::Debug> fmt::Debug for RegisteredVec<T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_list().entries(self.vec.iter()).finish()
    }
}
