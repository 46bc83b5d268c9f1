//! `DeviceBuffer<T>`: device memory, and views of ranges of it as copy sources and
//! destinations.

use std::fmt;
use std::marker::PhantomData;
use std::ops::{Bound, RangeBounds};
use std::sync::{Arc, Mutex, PoisonError};

use bytemuck::{AnyBitPattern, NoUninit, Zeroable};

use crate::device::Device;
use crate::error::{Error, Result};
use crate::ffi::{self, Direction};
use crate::stream::{Event, Stream};

/// `len` elements of `T` in device memory (`cudaMalloc`), on the device current when it was
/// made or the one named ([`zeroed_on`](Self::zeroed_on)).
///
/// Copies into or out of a buffer go on a stream of the buffer's device; a stream of another
/// device is refused with [`Error::DeviceMismatch`].
///
/// Async copies ([`Stream::copy_to_device`], [`Stream::copy_from_device`]) take the whole
/// buffer or a view of a range of it ([`slice`](Self::slice), [`slice_mut`](Self::slice_mut)),
/// and record their events here: a copy on another stream is ordered after them on the
/// device, and the memory is freed only after they end. Host and device lengths must match;
/// a view is how a short batch goes into a larger buffer, or a few elements come back:
///
/// Blocking copies (`copy_from_host`, `copy_to_host`, `from_slice`, `to_vec`, and the views'
/// own) return once the copy has finished. Should CUDA fail even to wait for it (an error
/// that leaves the device's context unusable), they abort the process: the device could
/// otherwise still reach the borrowed host memory after the call.
///
/// ```no_run
/// # use cuda_pinned::{DeviceBuffer, PinnedVec, Stream};
/// let stream = Stream::new()?;
/// let mut device = DeviceBuffer::<f32>::zeroed(1 << 20)?;
/// let last_batch = PinnedVec::from_slice(&[1.0f32; 1000])?;
/// let upload = stream.copy_to_device(last_batch, device.slice_mut(..1000))?;
/// upload.wait()?;
/// let mut head = [0.0f32; 4];
/// device.slice(..4).copy_to_host(&mut head)?;
/// assert_eq!(head, [1.0; 4]);
/// # Ok::<(), cuda_pinned::Error>(())
/// ```
pub struct DeviceBuffer<T> {
    ptr: u64,
    len: usize,
    device: i32,
    pending: PendingCopies,
    _owns: PhantomData<T>,
}

/// The latest async copy event per stream of one device buffer: stream order covers the
/// earlier ones. Each entry keeps its stream alive, so that a stream created later cannot
/// take the handle of a finished one and pass for it.
#[derive(Default)]
pub(crate) struct PendingCopies(Mutex<Vec<(Stream, Arc<Event>)>>);

impl PendingCopies {
    /// Makes `stream` wait (on the device) for unfinished copies on other streams; its own
    /// earlier copies are ordered by the stream already.
    pub(crate) fn order_before(&self, stream: &Stream) -> Result<()> {
        let mut pending = self.0.lock().unwrap_or_else(PoisonError::into_inner);
        let mut result = Ok(());
        pending.retain(|(other, event)| {
            if other == stream || result.is_err() {
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
        let mut pending = self.0.lock().unwrap_or_else(PoisonError::into_inner);
        match pending.iter_mut().find(|(other, _)| other == stream) {
            Some(slot) => slot.1 = event,
            None => pending.push((stream.clone(), event)),
        }
    }

    /// Waits for every copy; `false` if waiting failed (the device is in an error state).
    fn wait_all(&mut self) -> bool {
        let pending = self.0.get_mut().unwrap_or_else(PoisonError::into_inner);
        pending.iter().all(|(_, event)| event.synchronize().is_ok())
    }
}

impl<T> fmt::Debug for DeviceBuffer<T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("DeviceBuffer")
            .field("ptr", &format_args!("{:#x}", self.ptr))
            .field("len", &self.len)
            .field("device", &self.device)
            .finish()
    }
}

impl<T: Copy> DeviceBuffer<T> {
    /// `len` zeroed elements on the calling thread's current device.
    ///
    /// # Errors
    ///
    /// [`Error::CapacityOverflow`], [`Error::Unavailable`], or the CUDA error (out of device
    /// memory among them).
    pub fn zeroed(len: usize) -> Result<Self>
    where
        T: Zeroable,
    {
        Self::zeroed_on(Device::current()?, len)
    }

    /// `len` zeroed elements on `device`, leaving the calling thread's current device as it
    /// was.
    ///
    /// # Errors
    ///
    /// As [`zeroed`](Self::zeroed).
    pub fn zeroed_on(device: Device, len: usize) -> Result<Self>
    where
        T: Zeroable,
    {
        let bytes = len
            .checked_mul(size_of::<T>())
            .ok_or(Error::CapacityOverflow)?;
        let device = device.raw();
        let ptr = if bytes == 0 {
            0
        } else {
            ffi::on_device(device, || ffi::device_malloc(bytes))?
        };
        let buffer = Self {
            ptr,
            len,
            device,
            pending: PendingCopies::default(),
            _owns: PhantomData,
        };
        if bytes > 0 {
            let stream = Stream::on(buffer.device())?;
            // SAFETY: `ptr` is `bytes` bytes of device memory we own, on the stream's device;
            // we wait for the memset.
            ffi::on_device(device, || unsafe {
                ffi::memset_async(ptr, 0, bytes, stream.as_raw())
            })?;
            stream.synchronize()?;
        }
        Ok(buffer)
    }

    /// A copy of `slice` on the calling thread's current device.
    ///
    /// # Errors
    ///
    /// As [`zeroed`](Self::zeroed).
    pub fn from_slice(slice: &[T]) -> Result<Self>
    where
        T: NoUninit + Zeroable,
    {
        Self::from_slice_on(Device::current()?, slice)
    }

    /// A copy of `slice` on `device`, leaving the calling thread's current device as it was.
    ///
    /// # Errors
    ///
    /// As [`zeroed`](Self::zeroed).
    pub fn from_slice_on(device: Device, slice: &[T]) -> Result<Self>
    where
        T: NoUninit + Zeroable,
    {
        let mut buffer = Self::zeroed_on(device, slice.len())?;
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
        self.slice_mut(..).copy_from_host(src)
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
        self.slice(..).copy_to_host(dst)
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
        self.slice(..).to_vec()
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

    /// The device the memory is on.
    pub fn device(&self) -> Device {
        Device::from_raw(self.device)
    }

    /// Makes work queued on `stream` from now on wait (on the device) for the copies of this
    /// buffer that this crate queued on other streams and that may still run. This crate's
    /// own copies and memsets order themselves so; work on the buffer's raw address
    /// ([`as_raw`](Self::as_raw): a kernel, [`Stream::copy_batch_raw`]) needs this call
    /// first.
    ///
    /// # Errors
    ///
    /// [`Error::DeviceMismatch`] for a stream of another device, or the CUDA error.
    pub fn order_after_copies(&self, stream: &Stream) -> Result<()> {
        crate::stream::check_same_device("the stream", self.device, stream.device().raw())?;
        self.pending.order_before(stream)
    }

    /// A view of the elements in `range`, to copy from.
    ///
    /// # Panics
    ///
    /// When the range is out of bounds or decreasing, as slice indexing does;
    /// [`get`](Self::get) returns `None` instead.
    #[track_caller]
    pub fn slice(&self, range: impl RangeBounds<usize>) -> DeviceSlice<'_, T> {
        let (start, end) = bounds(&range, self.len);
        self.get(start..end)
            .unwrap_or_else(|| panic!("range {start}..{end} out of bounds for {}", self.len))
    }

    /// A view of the elements in `range`, to copy into.
    ///
    /// # Panics
    ///
    /// As [`slice`](Self::slice); [`get_mut`](Self::get_mut) returns `None` instead.
    #[track_caller]
    pub fn slice_mut(&mut self, range: impl RangeBounds<usize>) -> DeviceSliceMut<'_, T> {
        let (start, end) = bounds(&range, self.len);
        let len = self.len;
        self.get_mut(start..end)
            .unwrap_or_else(|| panic!("range {start}..{end} out of bounds for {len}"))
    }

    /// A view of the elements in `range`; `None` when it is out of bounds.
    pub fn get(&self, range: impl RangeBounds<usize>) -> Option<DeviceSlice<'_, T>> {
        let (start, end) = checked_bounds(&range, self.len)?;
        Some(DeviceSlice {
            range: DeviceRange::new(self, start, end),
            _elements: PhantomData,
        })
    }

    /// A mutable view of the elements in `range`; `None` when it is out of bounds.
    pub fn get_mut(&mut self, range: impl RangeBounds<usize>) -> Option<DeviceSliceMut<'_, T>> {
        let (start, end) = checked_bounds(&range, self.len)?;
        Some(DeviceSliceMut {
            range: DeviceRange::new(self, start, end),
            _unique: PhantomData,
        })
    }
}

impl<T> Drop for DeviceBuffer<T> {
    fn drop(&mut self) {
        if self.ptr == 0 {
            return;
        }
        if self.pending.wait_all() {
            // SAFETY: our allocation; the copies that used it have finished.
            let _ = ffi::on_device(self.device, || unsafe { ffi::device_free(self.ptr) });
        }
        // If waiting failed the device is in an error state; leaking is the safe choice.
    }
}

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
    fn new<T>(buffer: &'a DeviceBuffer<T>, start: usize, end: usize) -> Self {
        Self {
            // In bounds of a live allocation, so the byte offset cannot overflow.
            address: buffer.ptr + (start * size_of::<T>()) as u64,
            len: end - start,
            device: buffer.device,
            pending: &buffer.pending,
        }
    }

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
        crate::stream::check_same_device("the stream", self.device, stream.device().raw())
    }

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
        let queued = ffi::on_device(self.device, || {
            // Waiting for a copy that a capture took in would have joined the new stream to
            // that capture: this copy would then run at the graph's launch, after the borrow.
            stream.refuse_capture()?;
            copying = true;
            // SAFETY: both sides are `bytes` long (lengths checked; the device range lies in
            // a live allocation) and the caller keeps the host side for this whole call,
            // which waits for the copy before returning (or never returns).
            unsafe { ffi::memcpy_async(dst, src, bytes, direction, stream.as_raw()) }
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
        "cuda-pinned: a copy of borrowed host memory could not be waited for ({error}); the \
         device might still access that memory after the call, so the process stops"
    );
    std::process::abort()
}

/// A read-only view of a range of a [`DeviceBuffer`]: a copy source.
pub struct DeviceSlice<'a, T> {
    pub(crate) range: DeviceRange<'a>,
    _elements: PhantomData<&'a [T]>,
}

impl<T> Clone for DeviceSlice<'_, T> {
    fn clone(&self) -> Self {
        *self
    }
}

impl<T> Copy for DeviceSlice<'_, T> {}

/// A unique view of a range of a [`DeviceBuffer`]: a copy destination (and source).
pub struct DeviceSliceMut<'a, T> {
    pub(crate) range: DeviceRange<'a>,
    _unique: PhantomData<&'a mut [T]>,
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

impl<'a, T> From<&'a DeviceBuffer<T>> for DeviceSlice<'a, T> {
    fn from(buffer: &'a DeviceBuffer<T>) -> Self {
        buffer.slice(..)
    }
}

impl<'a, T> From<&'a mut DeviceBuffer<T>> for DeviceSlice<'a, T> {
    fn from(buffer: &'a mut DeviceBuffer<T>) -> Self {
        buffer.slice(..)
    }
}

impl<'a, T> From<&'a mut DeviceBuffer<T>> for DeviceSliceMut<'a, T> {
    fn from(buffer: &'a mut DeviceBuffer<T>) -> Self {
        buffer.slice_mut(..)
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

impl<'a, T> DeviceSliceMut<'a, T> {
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

    /// Queues setting every byte of the view to `value` on `stream` (`cudaMemsetAsync`),
    /// ordered after this buffer's copies on other streams; later copies on other streams are
    /// ordered after it, and the buffer is freed only after it.
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
        stream.enqueue(|stream| {
            range.pending.order_before(stream)?;
            // SAFETY: the view is `bytes` bytes of a live device allocation of the stream's
            // device, borrowed uniquely; the buffer keeps the memory until the event recorded
            // below has completed.
            unsafe { ffi::memset_async(range.address, value, bytes, stream.as_raw())? };
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

/// The start and end of `range` within `len` elements, unchecked.
fn bounds(range: &impl RangeBounds<usize>, len: usize) -> (usize, usize) {
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
fn checked_bounds(range: &impl RangeBounds<usize>, len: usize) -> Option<(usize, usize)> {
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
