//! `DeviceBuffer<T>`: device memory for tests, benchmarks and examples.

use std::fmt;
use std::marker::PhantomData;
use std::sync::{Arc, Mutex, PoisonError};

use bytemuck::{AnyBitPattern, NoUninit};

use crate::error::{Error, Result};
use crate::ffi::{self, Direction};
use crate::stream::{Event, Stream};

/// `len` elements of `T` in device memory (`cudaMalloc`), on the device current when it was
/// made. Async copies record their events here too: copies on other streams are ordered after
/// them, and the buffer is freed only after they end.
pub struct DeviceBuffer<T> {
    ptr: u64,
    len: usize,
    /// The latest copy event per stream (by raw handle): stream order covers the earlier ones.
    pending: Mutex<Vec<(usize, Arc<Event>)>>,
    _owns: PhantomData<T>,
}

impl<T> fmt::Debug for DeviceBuffer<T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("DeviceBuffer")
            .field("ptr", &format_args!("{:#x}", self.ptr))
            .field("len", &self.len)
            .finish()
    }
}

impl<T: Copy> DeviceBuffer<T> {
    /// `len` zeroed elements.
    ///
    /// # Errors
    ///
    /// [`Error::CapacityOverflow`], [`Error::Unavailable`], or the CUDA error (out of device
    /// memory among them).
    pub fn zeroed(len: usize) -> Result<Self>
    where
        T: bytemuck::Zeroable,
    {
        let bytes = len
            .checked_mul(size_of::<T>())
            .ok_or(Error::CapacityOverflow)?;
        let ptr = if bytes == 0 {
            0
        } else {
            ffi::device_malloc(bytes)?
        };
        let buffer = Self {
            ptr,
            len,
            pending: Mutex::new(Vec::new()),
            _owns: PhantomData,
        };
        if bytes > 0 {
            let stream = Stream::new()?;
            // SAFETY: `ptr` is `bytes` bytes of device memory we own; we wait for the memset.
            unsafe { ffi::memset_async(ptr, 0, bytes, stream.as_raw())? };
            stream.synchronize()?;
        }
        Ok(buffer)
    }

    /// A device copy of `slice`.
    ///
    /// # Errors
    ///
    /// As [`zeroed`](Self::zeroed).
    pub fn from_slice(slice: &[T]) -> Result<Self>
    where
        T: NoUninit + bytemuck::Zeroable,
    {
        let mut buffer = Self::zeroed(slice.len())?;
        buffer.copy_from_host(slice)?;
        Ok(buffer)
    }

    /// Copies `src` in and waits for it: safe from any host memory, pageable or pinned.
    ///
    /// # Errors
    ///
    /// [`Error::LengthMismatch`] when the lengths differ, or the CUDA error.
    pub fn copy_from_host(&mut self, src: &[T]) -> Result<()>
    where
        T: NoUninit,
    {
        check_lengths(src.len(), self.len)?;
        self.blocking_copy(
            self.ptr as *mut _,
            src.as_ptr().cast(),
            Direction::HostToDevice,
        )
    }

    /// Copies the buffer out into `dst` and waits for it.
    ///
    /// # Errors
    ///
    /// [`Error::LengthMismatch`] when the lengths differ, or the CUDA error.
    pub fn copy_to_host(&self, dst: &mut [T]) -> Result<()>
    where
        T: AnyBitPattern,
    {
        check_lengths(self.len, dst.len())?;
        self.blocking_copy(
            dst.as_mut_ptr().cast(),
            self.ptr as *const _,
            Direction::DeviceToHost,
        )
    }

    /// The buffer's contents in a new `Vec`.
    ///
    /// # Errors
    ///
    /// The CUDA error.
    pub fn to_vec(&self) -> Result<Vec<T>>
    where
        T: AnyBitPattern,
    {
        let mut out = vec![T::zeroed(); self.len];
        self.copy_to_host(&mut out)?;
        Ok(out)
    }

    fn blocking_copy(
        &self,
        dst: *mut std::ffi::c_void,
        src: *const std::ffi::c_void,
        direction: Direction,
    ) -> Result<()> {
        let bytes = self.len * size_of::<T>();
        if bytes == 0 {
            return Ok(());
        }
        let stream = Stream::new()?;
        self.order_after_pending(&stream)?;
        // SAFETY: both ranges are `bytes` long and borrowed for this whole call, which waits
        // for the copy to finish before returning (also on the error path below).
        unsafe { ffi::memcpy_async(dst, src, bytes, direction, stream.as_raw())? };
        stream.synchronize()
    }
}

impl<T> DeviceBuffer<T> {
    /// Number of elements.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether the buffer is empty.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The device address (0 when empty).
    pub fn as_raw(&self) -> u64 {
        self.ptr
    }

    /// Makes `stream` wait (on the device) for unfinished async copies of this buffer on other
    /// streams; its own earlier copies are ordered by the stream already.
    pub(crate) fn order_after_pending(&self, stream: &Stream) -> Result<()> {
        let mut pending = self.pending.lock().unwrap_or_else(PoisonError::into_inner);
        let own = stream.as_raw() as usize;
        let mut result = Ok(());
        pending.retain(|(other, event)| {
            if *other == own || result.is_err() {
                return true;
            }
            match event.query() {
                Ok(true) => false,
                Ok(false) => {
                    result = stream.wait_event(event);
                    true
                }
                Err(e) => {
                    result = Err(e);
                    true
                }
            }
        });
        result
    }

    /// Remembers an async copy's event as the latest on `stream`.
    pub(crate) fn track(&self, stream: &Stream, event: Arc<Event>) {
        let mut pending = self.pending.lock().unwrap_or_else(PoisonError::into_inner);
        let own = stream.as_raw() as usize;
        match pending.iter_mut().find(|(other, _)| *other == own) {
            Some(slot) => slot.1 = event,
            None => pending.push((own, event)),
        }
    }
}

fn check_lengths(host: usize, device: usize) -> Result<()> {
    if host == device {
        Ok(())
    } else {
        Err(Error::LengthMismatch { host, device })
    }
}

impl<T> Drop for DeviceBuffer<T> {
    fn drop(&mut self) {
        if self.ptr == 0 {
            return;
        }
        let pending = self
            .pending
            .get_mut()
            .unwrap_or_else(PoisonError::into_inner);
        if pending.iter().all(|(_, event)| event.synchronize().is_ok()) {
            // SAFETY: our allocation; the copies that used it have finished.
            let _ = unsafe { ffi::device_free(self.ptr) };
        }
        // If waiting failed the device is in an error state; leaking is the safe choice.
    }
}
