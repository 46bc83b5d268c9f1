//! Views of ranges of a device buffer, as copy sources and destinations.

use std::fmt;
use std::marker::PhantomData;
use std::ops::{Bound, RangeBounds};
use std::sync::Arc;

use crate::error::{Error, Result};
use crate::gpu::device::Device;
use crate::gpu::pending::PendingCopies;
use crate::gpu::stream::Stream;
/// Where a view lies: the device address of its first element, its length, and the copies
/// of the buffer it belongs to.
#[derive(Clone, Copy)]
pub(crate) struct DeviceRange<'a> {
    pub(crate) address: u64,
    pub(crate) len: usize,
    pub(crate) device: i32,
    pub(crate) pending: &'a PendingCopies,
}

impl<'a> DeviceRange<'a> {
    fn split_at<T>(self, mid: usize) -> (Self, Self) {
        let tail = Self {
            address: self.address + (mid * size_of::<T>()) as u64,
            len: self.len - mid,
            device: self.device,
            pending: self.pending,
        };
        (Self { len: mid, ..self }, tail)
    }

    /// [`Error::DeviceMismatch`] unless `stream` belongs to the range's device.
    pub(crate) fn check_stream(&self, stream: &Stream) -> Result<()> {
        crate::gpu::device::check_same_device("the stream", self.device, stream.device().raw())
    }
}

/// A read-only view of a range of a [`DeviceBuffer`](crate::DeviceBuffer): a copy source.
///
/// With the `cudarc` feature it is also a cudarc kernel argument (`launch.arg(&view)`); the
/// kernel must run on a stream that was ordered with the memory: a batch's or tensor's
/// `ready_on` stream, or one the buffer [recorded](crate::DeviceBuffer::record_stream).
pub struct DeviceSlice<'a, T> {
    pub(crate) range: DeviceRange<'a>,
    pub(crate) _elements: PhantomData<&'a [T]>,
}

impl<T> Clone for DeviceSlice<'_, T> {
    fn clone(&self) -> Self {
        *self
    }
}

impl<T> Copy for DeviceSlice<'_, T> {}

/// A unique view of a range of a [`DeviceBuffer`](crate::DeviceBuffer): a copy destination (and source).
///
/// With the `cudarc` feature it is also a cudarc kernel argument the kernel may write
/// (`launch.arg(&mut view)`), under the rule [`DeviceSlice`] states.
pub struct DeviceSliceMut<'a, T> {
    pub(crate) range: DeviceRange<'a>,
    pub(crate) _unique: PhantomData<&'a mut [T]>,
}

impl<T> fmt::Debug for DeviceSlice<'_, T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("DeviceSlice")
            .field("address", &format_args!("{:#x}", self.range.address))
            .field("len", &self.range.len)
            .finish()
    }
}

impl<T> fmt::Debug for DeviceSliceMut<'_, T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("DeviceSliceMut")
            .field("address", &format_args!("{:#x}", self.range.address))
            .field("len", &self.range.len)
            .finish()
    }
}

impl<'a, T> From<DeviceSliceMut<'a, T>> for DeviceSlice<'a, T> {
    fn from(view: DeviceSliceMut<'a, T>) -> Self {
        DeviceSlice {
            range: view.range,
            _elements: PhantomData,
        }
    }
}

impl<'a, T> DeviceSlice<'a, T> {
    /// The device the memory is on.
    pub fn device(&self) -> Device {
        Device::from_raw(self.range.device)
    }

    /// The view as elements of another type, if the sizes allow.
    ///
    /// The same bytes seen as elements of `U` (as `bytemuck::try_cast_slice`); `None` when
    /// the length in bytes is not a multiple of `U`'s size or the address is not aligned
    /// for `U`.
    pub fn cast<U>(self) -> Option<DeviceSlice<'a, U>>
    where
        T: bytemuck::Pod,
        U: bytemuck::Pod,
    {
        let bytes = self.range.len * size_of::<T>();
        let fits = if size_of::<U>() == 0 {
            bytes == 0
        } else {
            bytes.is_multiple_of(size_of::<U>())
                && self.range.address.is_multiple_of(align_of::<U>() as u64)
        };
        fits.then(|| DeviceSlice {
            range: DeviceRange {
                len: bytes.checked_div(size_of::<U>()).unwrap_or(0),
                ..self.range
            },
            _elements: PhantomData,
        })
    }

    /// Number of elements.
    pub fn len(&self) -> usize {
        self.range.len
    }

    /// Whether the view is empty.
    pub fn is_empty(&self) -> bool {
        self.range.len == 0
    }

    /// The device address of the first element.
    pub fn as_raw(&self) -> u64 {
        self.range.address
    }

    /// A narrower view; `range` is relative to this view.
    ///
    /// # Panics
    ///
    /// When the range is out of bounds or decreasing.
    #[track_caller]
    pub fn slice(self, range: impl RangeBounds<usize>) -> DeviceSlice<'a, T> {
        let (start, end) = bounds(&range, self.range.len);
        assert!(
            start <= end && end <= self.range.len,
            "range {start}..{end} out of bounds for {}",
            self.range.len
        );
        let (_, rest) = self.range.split_at::<T>(start);
        let (range, _) = rest.split_at::<T>(end - start);
        DeviceSlice {
            range,
            _elements: PhantomData,
        }
    }
}

impl<'a, T> DeviceSlice<'a, std::mem::MaybeUninit<T>> {
    /// The same range as initialised elements.
    ///
    /// # Safety
    ///
    /// Every element of the range has been written (each with a valid `T`) by work that
    /// every use of the returned view is ordered after: on the stream that uses it, or
    /// waited for on the host.
    pub unsafe fn assume_init(self) -> DeviceSlice<'a, T> {
        DeviceSlice {
            range: self.range,
            _elements: PhantomData,
        }
    }
}

impl<'a, T> DeviceSliceMut<'a, T> {
    /// Number of elements.
    pub fn len(&self) -> usize {
        self.range.len
    }

    /// The device the memory is on.
    pub fn device(&self) -> Device {
        Device::from_raw(self.range.device)
    }

    /// Lends the view's device address to `write`, which queues writes of it on `stream`,
    /// ordered with the buffer's other copies: after those already queued on other streams,
    /// and before those made through the buffer later.
    ///
    /// For code that fills device memory with copies of its own (raw copies, kernels).
    ///
    /// # Errors
    ///
    /// [`Error::DeviceMismatch`] for a stream of another device, [`Error::Capturing`] on a
    /// stream capturing a graph (`write` is not called), `write`'s error (of any type that a
    /// CUDA error converts into), or the CUDA error of ordering the stream or recording the
    /// writes' end.
    pub fn track_writes<R, E: From<Error>>(
        &mut self,
        stream: &Stream,
        write: impl FnOnce(u64) -> std::result::Result<R, E>,
    ) -> std::result::Result<R, E> {
        self.range.check_stream(stream)?;
        crate::context::on_device(self.range.device, || {
            stream.refuse_capture()?;
            self.range.pending.order_before(stream)
        })?;
        let written = write(self.range.address);
        // Recorded whatever `write` returned: it may have queued some writes.
        let ended = stream.record_event_untimed()?;
        self.range.pending.track(stream, std::sync::Arc::new(ended));
        written
    }

    /// Whether the view is empty.
    pub fn is_empty(&self) -> bool {
        self.range.len == 0
    }

    /// The device address of the first element.
    pub fn as_raw(&self) -> u64 {
        self.range.address
    }

    /// A read-only view of the same range, for as long as this one is borrowed.
    pub fn as_slice(&self) -> DeviceSlice<'_, T> {
        DeviceSlice {
            range: self.range,
            _elements: PhantomData,
        }
    }

    /// Splits the view in two at `mid`, as `split_at_mut` does.
    ///
    /// # Panics
    ///
    /// When `mid > len`.
    #[track_caller]
    pub fn split_at_mut(self, mid: usize) -> (DeviceSliceMut<'a, T>, DeviceSliceMut<'a, T>) {
        assert!(mid <= self.range.len, "mid {mid} > len {}", self.range.len);
        let (head, tail) = self.range.split_at::<T>(mid);
        let view = |range| DeviceSliceMut {
            range,
            _unique: PhantomData,
        };
        (view(head), view(tail))
    }

    /// Queues setting every byte of the view to `value` on `stream`.
    ///
    /// It is a `cudaMemsetAsync`, ordered after this buffer's copies on other streams; later copies
    /// on other streams are ordered after it, and the buffer is freed only after it.
    ///
    /// # Errors
    ///
    /// [`Error::DeviceMismatch`] for a stream of another device, [`Error::Capturing`] on a
    /// stream capturing a graph, or the CUDA error.
    pub fn set_bytes_async(&mut self, value: u8, stream: &Stream) -> Result<()> {
        let bytes = self.range.len * size_of::<T>();
        if bytes == 0 {
            return Ok(());
        }
        self.range.check_stream(stream)?;
        let range = self.range;
        crate::gpu::fence::enqueue(stream, |stream| {
            range.pending.order_before(stream)?;
            // SAFETY: the view is `bytes` bytes of a live device allocation of the stream's
            // device, borrowed uniquely; the buffer keeps the memory until the event recorded
            // below has completed.
            unsafe {
                crate::raw::memory::memset_async(range.address, value, bytes, stream.as_raw())?
            };
            match stream.record_event_untimed() {
                Ok(event) => {
                    range.pending.track(stream, Arc::new(event));
                    Ok(())
                }
                Err(error) => {
                    // The memset is queued but cannot be tracked: it is waited for instead.
                    stream.synchronize()?;
                    Err(error)
                }
            }
        })
    }
}

/// The start and end of `range` within `len` elements, unchecked.
pub(crate) fn bounds(range: &impl RangeBounds<usize>, len: usize) -> (usize, usize) {
    let start = match range.start_bound() {
        Bound::Included(&s) => s,
        Bound::Excluded(&s) => s.saturating_add(1),
        Bound::Unbounded => 0,
    };
    let end = match range.end_bound() {
        Bound::Included(&e) => e.saturating_add(1),
        Bound::Excluded(&e) => e,
        Bound::Unbounded => len,
    };
    (start, end)
}

/// As [`bounds`], `None` when out of bounds or decreasing.
pub(crate) fn checked_bounds(
    range: &impl RangeBounds<usize>,
    len: usize,
) -> Option<(usize, usize)> {
    let (start, end) = bounds(range, len);
    (start <= end && end <= len).then_some((start, end))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bounds_follow_slice_indexing() {
        assert_eq!(checked_bounds(&(..), 10), Some((0, 10)));
        assert_eq!(checked_bounds(&(2..=4), 10), Some((2, 5)));
        assert_eq!(checked_bounds(&(3..), 10), Some((3, 10)));
        assert_eq!(checked_bounds(&(10..10), 10), Some((10, 10)));
        let (start, end) = (5, 4);
        assert_eq!(checked_bounds(&(start..end), 10), None);
        assert_eq!(checked_bounds(&(0..11), 10), None);
        assert_eq!(checked_bounds(&(..=usize::MAX), 10), None);
    }
}
