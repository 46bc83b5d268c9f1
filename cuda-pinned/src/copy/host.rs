//! Copies between a device view and any host memory, waited for before they return: the
//! host side is borrowed for the call alone.

use bytemuck::{AnyBitPattern, NoUninit};

use crate::error::{Error, Result};
use crate::gpu::device::Device;
use crate::gpu::stream::Stream;
use crate::gpu::views::{DeviceRange, DeviceSlice, DeviceSliceMut};
use crate::raw::copy::Direction;

impl DeviceRange<'_> {
    /// A copy between this range and host memory of `host_len` elements, waited for.
    ///
    /// # Safety
    ///
    /// - `host` is valid for `self.len` elements of `T`, readable (`HostToDevice`) or
    ///   writable (`DeviceToHost`) and not used by anyone else for the whole call;
    /// - the range is writable by this copy (`HostToDevice`): borrowed uniquely.
    unsafe fn blocking_copy<T>(
        self,
        host: *mut u8,
        host_len: usize,
        direction: Direction,
    ) -> Result<()> {
        if host_len != self.len {
            return Err(Error::LengthMismatch {
                host: host_len,
                device: self.len,
            });
        }
        let bytes = self.len * size_of::<T>();
        if bytes == 0 {
            return Ok(());
        }
        let stream = Stream::on(Device::from_raw(self.device))?;
        self.pending.order_before(&stream)?;
        let device = self.address as *mut std::ffi::c_void;
        let (dst, src) = match direction {
            Direction::HostToDevice => (device, host.cast_const().cast()),
            _ => (host.cast(), device.cast_const()),
        };
        let mut copying = false;
        let queued = crate::context::on_device(self.device, || {
            // Waiting for a copy that a capture took in would have joined the new stream to
            // that capture: this copy would then run at the graph's launch, after the borrow.
            stream.refuse_capture()?;
            copying = true;
            // SAFETY: both sides are `bytes` long (lengths checked; the device range lies in
            // a live allocation) and the caller keeps the host side for this whole call,
            // which waits for the copy before returning (or never returns).
            unsafe { crate::copy::split::queue(dst, src, bytes, direction, stream.as_raw()) }
        });
        // A copy split at chunk boundaries may fail after its first pieces were queued: the
        // host side is borrowed only for this call, so they are waited for either way.
        if copying && let Err(error) = stream.synchronize() {
            stop_unwaited(&error);
        }
        queued
    }
}

/// Stops the process: a copy of borrowed host memory was queued and could not be waited for,
/// so the device may still read or write that memory once the borrow ends, and no error
/// value could keep its owner from freeing or reusing it. The wait is made in relaxed
/// capture mode on a stream of the call's own, so neither graph capture nor another stream's
/// work can refuse it: what fails it is an error that leaves the device's context unusable,
/// after which CUDA says the process must be restarted.
#[cold]
fn stop_unwaited(error: &Error) -> ! {
    use std::io::Write;
    // Not `eprintln!`, which panics when stderr fails: unwinding would give the memory up.
    let _ = writeln!(
        std::io::stderr(),
        "cuda-pinned: a copy of borrowed host memory could not be waited for ({}); the \
         device might still access that memory after the call, so the process stops",
        crate::ErrorChain(error)
    );
    std::process::abort()
}

impl<T> DeviceSlice<'_, T> {
    /// Copies the view out into `dst` and waits for it (any host memory).
    ///
    /// # Errors
    ///
    /// [`Error::LengthMismatch`] when the lengths differ, or the CUDA error.
    pub fn copy_to_host(&self, dst: &mut [T]) -> Result<()>
    where
        T: AnyBitPattern,
    {
        // SAFETY: `dst` is borrowed uniquely for the call and holds `dst.len()` elements;
        // any bit pattern is a valid `T`.
        unsafe {
            self.range.blocking_copy::<T>(
                dst.as_mut_ptr().cast(),
                dst.len(),
                Direction::DeviceToHost,
            )
        }
    }

    /// The view's contents in a new `Vec`.
    ///
    /// Like every copy through a view, it waits (on the device) for the copies its buffer
    /// tracks: this crate's async copies into it, and the events other code told it of
    /// ([`DeviceBuffer::track_event`](crate::DeviceBuffer::track_event): a loader batch's
    /// upload, a loaded tensor's copies). Kernels writing it are not seen: see
    /// [`DeviceBuffer::record_stream`](crate::DeviceBuffer::record_stream).
    ///
    /// # Errors
    ///
    /// The CUDA error.
    pub fn to_vec(&self) -> Result<Vec<T>>
    where
        T: AnyBitPattern,
    {
        let mut out = vec![T::zeroed(); self.range.len];
        self.copy_to_host(&mut out)?;
        Ok(out)
    }
}

impl<T> DeviceSliceMut<'_, T> {
    /// Copies `src` (any host memory) into the view and waits for it.
    ///
    /// # Errors
    ///
    /// [`Error::LengthMismatch`] when the lengths differ, or the CUDA error.
    pub fn copy_from_host(&mut self, src: &[T]) -> Result<()>
    where
        T: NoUninit,
    {
        // SAFETY: `src` is borrowed for the call and holds `src.len()` initialised elements
        // (`NoUninit`); the view is borrowed uniquely.
        unsafe {
            self.range.blocking_copy::<T>(
                src.as_ptr().cast_mut().cast(),
                src.len(),
                Direction::HostToDevice,
            )
        }
    }

    /// Copies the view out into `dst` and waits for it.
    ///
    /// # Errors
    ///
    /// As [`DeviceSlice::copy_to_host`].
    pub fn copy_to_host(&self, dst: &mut [T]) -> Result<()>
    where
        T: AnyBitPattern,
    {
        self.as_slice().copy_to_host(dst)
    }
}
