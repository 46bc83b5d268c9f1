//! Tracked async copies: a copy takes the pinned buffer by value and gives it back when the
//! device is done with it.

use std::fmt;
use std::mem::ManuallyDrop;
use std::sync::Arc;

use bytemuck::{AnyBitPattern, NoUninit};

use crate::alloc::{PinnedAllocator, StreamUses};
use crate::boxed::PinnedBox;
use crate::device_buffer::DeviceBuffer;
use crate::error::{Error, Result};
use crate::ffi::{self, Direction};
use crate::registration::RegisteredVec;
use crate::stream::{Event, Stream};
use crate::vec::PinnedVec;

pub(crate) mod sealed {
    use crate::alloc::StreamUses;

    /// The buffer's address, length in elements, and use record.
    pub trait Sealed {
        fn raw_parts(&mut self) -> (*mut u8, usize, &mut StreamUses);
    }
}

use sealed::Sealed;

/// A page-locked buffer that async copies can take: [`PinnedVec`], [`PinnedBox`] and
/// [`RegisteredVec`]. Sealed: the crate's safety argument depends on each implementation.
pub trait HostBuffer: Sealed {
    /// The element type copied.
    type Elem;
}

impl<T, A: PinnedAllocator> HostBuffer for PinnedVec<T, A> {
    type Elem = T;
}
impl<T, A: PinnedAllocator> Sealed for PinnedVec<T, A> {
    fn raw_parts(&mut self) -> (*mut u8, usize, &mut StreamUses) {
        (self.as_mut_ptr().cast(), self.len(), self.uses_mut())
    }
}

impl<T, A: PinnedAllocator> HostBuffer for PinnedBox<T, A> {
    type Elem = T;
}
impl<T, A: PinnedAllocator> Sealed for PinnedBox<T, A> {
    fn raw_parts(&mut self) -> (*mut u8, usize, &mut StreamUses) {
        (self.as_mut_ptr().cast(), 1, self.uses_mut())
    }
}

impl<T> HostBuffer for RegisteredVec<T> {
    type Elem = T;
}
impl<T> Sealed for RegisteredVec<T> {
    fn raw_parts(&mut self) -> (*mut u8, usize, &mut StreamUses) {
        let len = self.len();
        let ptr = self.as_mut_ptr().cast();
        (ptr, len, self.uses_mut())
    }
}

/// A copy that could not be queued; the buffer comes back untouched.
pub struct CopyError<B> {
    /// What went wrong.
    pub error: Error,
    /// The buffer, as it was.
    pub buffer: B,
}

impl<B> fmt::Debug for CopyError<B> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("CopyError")
            .field("error", &self.error)
            .finish_non_exhaustive()
    }
}

impl<B> fmt::Display for CopyError<B> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.error.fmt(f)
    }
}

impl<B> std::error::Error for CopyError<B> {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        Some(&self.error)
    }
}

impl<B> From<CopyError<B>> for Error {
    fn from(e: CopyError<B>) -> Self {
        e.error
    }
}

/// An async copy in flight, holding its pinned buffer until the device is done with it.
///
/// - [`wait`](Self::wait) blocks until the copy has finished and returns the buffer;
/// - [`is_done`](Self::is_done) asks without blocking;
/// - dropping it gives the buffer back to its allocator *after* the copy: a plain allocator
///   waits, a caching pool keeps the block aside until the copy's event has completed;
/// - `mem::forget` leaks the buffer, so the device never writes into freed memory.
#[must_use = "dropping a transfer frees its buffer once the copy ends; call `wait` to get it back"]
pub struct Transfer<B: HostBuffer> {
    buffer: ManuallyDrop<B>,
    event: Arc<Event>,
}

impl<B: HostBuffer> fmt::Debug for Transfer<B> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Transfer")
            .field("event", &self.event)
            .finish_non_exhaustive()
    }
}

impl<B: HostBuffer> Transfer<B> {
    /// Whether the copy has finished.
    ///
    /// # Errors
    ///
    /// A CUDA error, including one of the copy itself.
    pub fn is_done(&self) -> Result<bool> {
        self.event.query()
    }

    /// Waits for the copy to finish and returns the buffer.
    ///
    /// # Errors
    ///
    /// A CUDA error (the device is then in an error state). The buffer is not returned and
    /// its memory is leaked: nothing can prove the device has stopped using it.
    pub fn wait(self) -> Result<B> {
        let mut this = ManuallyDrop::new(self);
        this.event.synchronize()?;
        // SAFETY: `this` is never dropped, so the buffer is moved out exactly once; the copy
        // has finished, so the host may use the buffer again.
        let buffer = unsafe { ManuallyDrop::take(&mut this.buffer) };
        // SAFETY: the event is moved out once and dropped (`this` itself never is).
        drop(unsafe { std::ptr::read(&this.event) });
        Ok(buffer)
    }
}

impl<B: HostBuffer> Drop for Transfer<B> {
    fn drop(&mut self) {
        // SAFETY: the buffer is taken once, here; the copy's event goes with it, so its
        // allocator frees or reuses the memory only after the copy.
        let mut buffer = unsafe { ManuallyDrop::take(&mut self.buffer) };
        buffer.raw_parts().2.push_event(self.event.clone());
        drop(buffer);
    }
}

impl Stream {
    /// Queues a copy of `src` into `dst` on this stream. `src` travels with the returned
    /// [`Transfer`] until the copy has finished.
    ///
    /// # Errors
    ///
    /// [`Error::LengthMismatch`] or the CUDA error, with `src` handed back untouched.
    pub fn copy_to_device<B>(
        &self,
        src: B,
        dst: &mut DeviceBuffer<B::Elem>,
    ) -> Result<Transfer<B>, CopyError<B>>
    where
        B: HostBuffer,
        B::Elem: NoUninit,
    {
        // SAFETY: `dst` is a live device allocation of `dst.len()` elements; the element
        // counts are checked against it; `dst` records the copy's event and frees its memory
        // only after it.
        unsafe {
            self.copy_device(
                src,
                dst.as_raw(),
                dst.len(),
                Direction::HostToDevice,
                Some(dst),
            )
        }
    }

    /// Queues a copy of `src` into `dst` on this stream; `dst` travels with the returned
    /// [`Transfer`] and holds the data once [`Transfer::wait`] returns it.
    ///
    /// # Errors
    ///
    /// [`Error::LengthMismatch`] or the CUDA error, with `dst` handed back untouched.
    pub fn copy_from_device<B>(
        &self,
        src: &DeviceBuffer<B::Elem>,
        dst: B,
    ) -> Result<Transfer<B>, CopyError<B>>
    where
        B: HostBuffer,
        B::Elem: AnyBitPattern,
    {
        // SAFETY: as in `copy_to_device`, with the device buffer read.
        unsafe {
            self.copy_device(
                dst,
                src.as_raw(),
                src.len(),
                Direction::DeviceToHost,
                Some(src),
            )
        }
    }

    /// Queues a copy of `src` to the raw device address `dst`.
    ///
    /// # Errors
    ///
    /// The CUDA error, with `src` handed back.
    ///
    /// # Safety
    ///
    /// - `dst` is device memory writable for `src`'s length in bytes until the copy has
    ///   finished, and nothing else reads or writes it meanwhile.
    pub unsafe fn copy_to_device_ptr<B>(
        &self,
        src: B,
        dst: u64,
    ) -> Result<Transfer<B>, CopyError<B>>
    where
        B: HostBuffer,
        B::Elem: NoUninit,
    {
        // SAFETY: forwarded from the caller; no length check is possible for a raw address.
        unsafe {
            self.copy_device::<B, B::Elem>(src, dst, usize::MAX, Direction::HostToDevice, None)
        }
    }

    /// Queues a copy from the raw device address `src` into `dst`.
    ///
    /// # Errors
    ///
    /// The CUDA error, with `dst` handed back.
    ///
    /// # Safety
    ///
    /// - `src` is device memory readable for `dst`'s length in bytes until the copy has
    ///   finished, and nothing writes it meanwhile.
    pub unsafe fn copy_from_device_ptr<B>(
        &self,
        src: u64,
        dst: B,
    ) -> Result<Transfer<B>, CopyError<B>>
    where
        B: HostBuffer,
        B::Elem: AnyBitPattern,
    {
        // SAFETY: forwarded from the caller.
        unsafe {
            self.copy_device::<B, B::Elem>(dst, src, usize::MAX, Direction::DeviceToHost, None)
        }
    }

    /// # Safety
    ///
    /// - `device` is device memory valid for the copy (for `device_len` elements when
    ///   `tracked` is given, in which case `device_len` is that buffer's length) until the
    ///   copy has finished.
    unsafe fn copy_device<B: HostBuffer, T>(
        &self,
        mut host: B,
        device: u64,
        device_len: usize,
        direction: Direction,
        tracked: Option<&DeviceBuffer<T>>,
    ) -> Result<Transfer<B>, CopyError<B>> {
        let (host_ptr, len, _) = host.raw_parts();
        let queued = (|| {
            if tracked.is_some() && len != device_len {
                return Err(Error::LengthMismatch {
                    host: len,
                    device: device_len,
                });
            }
            let bytes = len
                .checked_mul(size_of::<B::Elem>())
                .ok_or(Error::CapacityOverflow)?;
            if let Some(buffer) = tracked {
                buffer.order_after_pending(self)?;
            }
            let (dst, src) = match direction {
                Direction::HostToDevice => (device as *mut _, host_ptr.cast_const().cast()),
                _ => (host_ptr.cast(), device as *const _),
            };
            if bytes > 0 {
                // SAFETY: the host side is `bytes` long and owned by `host`, which the
                // returned `Transfer` keeps (or leaks) until the copy has finished; the device
                // side is valid per this function's contract.
                unsafe { ffi::memcpy_async(dst, src, bytes, direction, self.as_raw())? };
            }
            Ok(Arc::new(self.record_event_untimed()?))
        })();
        match queued {
            Ok(event) => {
                if let Some(buffer) = tracked {
                    buffer.track(self, event.clone());
                }
                Ok(Transfer {
                    buffer: ManuallyDrop::new(host),
                    event,
                })
            }
            Err(error) => {
                // The copy may have been queued before recording the event failed; wait for
                // the stream so that handing the buffer back is safe. If even that fails the
                // device is in an error state and runs nothing more.
                if !matches!(error, Error::LengthMismatch { .. }) {
                    let _ = self.synchronize();
                }
                Err(CopyError {
                    error,
                    buffer: host,
                })
            }
        }
    }
}
