//! `DeviceBuffer<T>`: device memory, and views of ranges of it as copy sources and
//! destinations.

use std::fmt;
use std::marker::PhantomData;
use std::mem::MaybeUninit;
use std::ops::RangeBounds;
use std::sync::Arc;

use bytemuck::{AnyBitPattern, NoUninit, Zeroable};

use crate::error::Error;
use crate::error::Result;
use crate::gpu::device::Device;
use crate::gpu::event::Event;

use crate::gpu::pending::PendingCopies;
use crate::gpu::stream::Stream;
use crate::gpu::views::{DeviceRange, DeviceSlice, DeviceSliceMut, bounds, checked_bounds};
/// `len` elements of `T` in device memory (`cudaMalloc`, or memory other code lent:
/// [`from_lent`](DeviceBuffer::from_lent)), on the device current when it was made or the one
/// named ([`zeroed_on`](Self::zeroed_on)).
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
/// # Examples
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
    /// The owner of memory other code allocated and frees ([`from_lent`](DeviceBuffer::from_lent)):
    /// dropped, not freed, once the buffer's copies are done. `None`: `cudaMalloc`'s, ours.
    lent: Option<Box<dyn LentDeviceMemory>>,
    _owns: PhantomData<T>,
}

/// Device memory that other code allocated and frees, lent to a [`DeviceBuffer`]: another
/// library's allocation (a cudarc `CudaSlice`, a candle tensor's storage), kept alive by the
/// buffer, which drops it once its copies are done.
///
/// # Safety
///
/// Implementors promise, for as long as the value lives:
/// - `address()..address() + bytes()` is device memory of device `device()` (in its primary
///   context), readable and writable by any stream of that device: an allocation made in
///   stream order on another stream has been waited for;
/// - the three methods return the same values every time;
/// - nothing else writes that memory, or reads it while the buffer's copies may write it,
///   unless ordered after them (through the buffer's views, which wait for them, or after
///   waiting for the events the buffer's users are given).
pub unsafe trait LentDeviceMemory: Send + Sync + 'static {
    /// The device the memory is on.
    fn device(&self) -> Device;
    /// The device address of its first byte.
    fn address(&self) -> u64;
    /// Its length in bytes.
    fn bytes(&self) -> usize;
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
    /// # Examples
    ///
    /// ```no_run
    /// use cuda_pinned::DeviceBuffer;
    /// let buffer = DeviceBuffer::<f32>::zeroed(1 << 20)?;
    /// assert_eq!(buffer.to_vec()?[0], 0.0);
    /// # Ok::<(), cuda_pinned::Error>(())
    /// ```
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
            crate::context::on_device(device, || crate::raw::memory::device_malloc(bytes))?
        };
        let buffer = Self {
            ptr,
            len,
            device,
            pending: PendingCopies::default(),
            lent: None,
            _owns: PhantomData,
        };
        if bytes > 0 {
            let stream = Stream::on(buffer.device())?;
            // SAFETY: `ptr` is `bytes` bytes of device memory we own, on the stream's device;
            // we wait for the memset.
            crate::context::on_device(device, || unsafe {
                crate::raw::memory::memset_async(ptr, 0, bytes, stream.as_raw())
            })?;
            stream.synchronize()?;
        }
        Ok(buffer)
    }

    /// A copy of `slice` on the calling thread's current device.
    ///
    /// # Examples
    ///
    /// ```no_run
    /// use cuda_pinned::DeviceBuffer;
    /// let weights = DeviceBuffer::from_slice(&[0.5f32; 256])?;
    /// assert_eq!(weights.len(), 256);
    /// # Ok::<(), cuda_pinned::Error>(())
    /// ```
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

impl<T> DeviceBuffer<MaybeUninit<T>> {
    /// The buffer as `T`s, its memory, tracked copies and owner kept.
    ///
    /// # Safety
    ///
    /// Every element has been written (or work that writes it is queued, and every use of
    /// the memory is ordered after that work).
    pub(crate) unsafe fn assume_init(self) -> DeviceBuffer<T> {
        let mut this = std::mem::ManuallyDrop::new(self);
        DeviceBuffer {
            ptr: this.ptr,
            len: this.len,
            device: this.device,
            // SAFETY: moved out of a value that is never dropped or used again.
            pending: unsafe { std::ptr::read(&this.pending) },
            lent: this.lent.take(),
            _owns: PhantomData,
        }
    }
}

impl<T: Copy> DeviceBuffer<MaybeUninit<T>> {
    /// Memory that other code allocated and frees, as a buffer of `memory.bytes() /
    /// size_of::<T>()` elements, not initialised; the buffer keeps `memory` and drops it
    /// (rather than freeing the address) once the copies it queued are done.
    ///
    /// For copies into another library's memory through this crate's tracked paths: a
    /// checkpoint loaded into memory its user's framework owns, say.
    ///
    /// # Errors
    ///
    /// [`Error::Unsupported`] for an address not aligned for `T` or a length that is not a
    /// whole number of elements.
    pub fn from_lent(memory: impl LentDeviceMemory) -> Result<Self> {
        let (address, bytes) = (memory.address(), memory.bytes());
        let size = size_of::<T>().max(1);
        if !address.is_multiple_of(align_of::<T>() as u64) || !bytes.is_multiple_of(size) {
            return Err(Error::Unsupported(
                "lent device memory must be aligned for its elements and hold a whole number \
                 of them",
            ));
        }
        Ok(Self {
            ptr: address,
            len: bytes / size,
            device: memory.device().raw(),
            pending: PendingCopies::default(),
            lent: Some(Box::new(memory)),
            _owns: PhantomData,
        })
    }

    /// `len` elements on `device`, not initialised: memory that copies fill next, without
    /// a memset first.
    ///
    /// Its views give `MaybeUninit<T>`; a range that work has filled becomes `T` through
    /// [`DeviceSlice::assume_init`].
    ///
    /// # Errors
    ///
    /// As [`zeroed`](DeviceBuffer::zeroed).
    pub fn uninit_on(device: Device, len: usize) -> Result<Self> {
        let bytes = len
            .checked_mul(size_of::<T>())
            .ok_or(Error::CapacityOverflow)?;
        let ptr = if bytes == 0 {
            0
        } else {
            crate::context::on_device(device.raw(), || crate::raw::memory::device_malloc(bytes))?
        };
        Ok(Self {
            ptr,
            len,
            device: device.raw(),
            pending: PendingCopies::default(),
            lent: None,
            _owns: PhantomData,
        })
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

    /// Makes work queued on `stream` from now on wait (on the device) for the copies of this buffer
    /// that this crate queued on other streams and that may still run.
    ///
    /// This crate's own copies and memsets order themselves so; work on the buffer's raw address
    /// ([`as_raw`](Self::as_raw): a kernel, [`Stream::copy_batch_raw`]) needs this call first.
    ///
    /// # Errors
    ///
    /// [`Error::DeviceMismatch`] for a stream of another device, or the CUDA error.
    pub fn order_after_copies(&self, stream: &Stream) -> Result<()> {
        crate::gpu::device::check_same_device("the stream", self.device, stream.device().raw())?;
        self.pending.order_before(stream)
    }

    /// Tells the buffer that work on `stream`, up to `event` (recorded there), writes it:
    /// copies through the buffer and its views on other streams then wait for `event` first,
    /// and dropping the buffer waits for it.
    ///
    /// For memory that other code fills with copies or kernels of its own, whose views are
    /// handed out before that work has finished on the device.
    pub fn track_event(&self, stream: &Stream, event: Arc<Event>) {
        self.pending.track(stream, event);
    }

    /// Counts all work on `stream` as a use of the buffer: work this crate cannot see, such as
    /// kernels that read or write it (through cudarc's launch builder, or its
    /// [raw address](Self::as_raw)).
    ///
    /// The stream is ordered after the buffer's copies queued on other streams so far: call it
    /// again (or [`order_after_copies`](Self::order_after_copies)) before work that follows
    /// later copies. From then on, copies through the buffer on other streams wait for
    /// everything queued on `stream` before them, and the buffer is freed only after `stream`
    /// has passed the work queued before the drop: kernels launched before or after this call
    /// are covered alike. The buffer's name for what
    /// [`PinnedVec::record_stream`](crate::PinnedVec::record_stream) does for host memory.
    ///
    /// While `stream` captures a graph, copies of the buffer on any stream fail with
    /// [`Error::Capturing`] (its work could not be waited for), and the buffer, if dropped
    /// then, is never freed. A graph whose capture has ended is not covered: its launches are
    /// work queued later, which this buffer does not see.
    ///
    /// # Errors
    ///
    /// [`Error::DeviceMismatch`] for a stream of another device, [`Error::Capturing`] on a
    /// stream capturing a graph, or the CUDA error of ordering the stream.
    pub fn record_stream(&self, stream: &Stream) -> Result<()> {
        crate::gpu::device::check_same_device("the stream", self.device, stream.device().raw())?;
        crate::context::on_device(self.device, || {
            stream.refuse_capture()?;
            self.pending.order_before(stream)
        })?;
        self.pending.record_stream(stream);
        Ok(())
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
            range: range_of(self, start, end),
            _elements: PhantomData,
        })
    }

    /// A mutable view of the elements in `range`; `None` when it is out of bounds.
    pub fn get_mut(&mut self, range: impl RangeBounds<usize>) -> Option<DeviceSliceMut<'_, T>> {
        let (start, end) = checked_bounds(&range, self.len)?;
        Some(DeviceSliceMut {
            range: range_of(self, start, end),
            _unique: PhantomData,
        })
    }
}

impl<T> Drop for DeviceBuffer<T> {
    fn drop(&mut self) {
        let lent = self.lent.take();
        if self.ptr == 0 && lent.is_none() {
            return;
        }
        if !self.pending.wait_all() {
            // The device is in an error state and copies may still use the memory: leaking it
            // (not freeing, not giving it back to its owner) is the safe choice.
            std::mem::forget(lent);
            return;
        }
        match lent {
            // Its owner frees it, now that the copies that used it have finished.
            Some(lent) => drop(lent),
            None => {
                // SAFETY: our allocation; the copies that used it have finished.
                let _ = crate::context::on_device(self.device, || unsafe {
                    crate::raw::memory::device_free(self.ptr)
                });
            }
        }
    }
}

/// The range `start..end` of a buffer (in elements, within its length).
fn range_of<T>(buffer: &DeviceBuffer<T>, start: usize, end: usize) -> DeviceRange<'_> {
    DeviceRange {
        // In bounds of a live allocation, so the byte offset cannot overflow.
        address: buffer.ptr + (start * size_of::<T>()) as u64,
        len: end - start,
        device: buffer.device,
        pending: &buffer.pending,
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

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicUsize, Ordering};

    /// Memory lent by "other code": an address that is never touched (nothing copies here),
    /// counting its drops.
    struct Lent {
        address: u64,
        bytes: usize,
        dropped: Arc<AtomicUsize>,
    }

    // SAFETY: no copy is ever queued into this memory in these tests: the buffer only holds
    // and drops it.
    unsafe impl LentDeviceMemory for Lent {
        fn device(&self) -> Device {
            Device::from_raw(0)
        }
        fn address(&self) -> u64 {
            self.address
        }
        fn bytes(&self) -> usize {
            self.bytes
        }
    }

    impl Drop for Lent {
        fn drop(&mut self) {
            self.dropped.fetch_add(1, Ordering::Relaxed);
        }
    }

    #[test]
    fn lent_memory_goes_back_to_its_owner_once_and_is_never_freed_here() {
        let dropped = Arc::new(AtomicUsize::new(0));
        let lent = |address, bytes| Lent {
            address,
            bytes,
            dropped: dropped.clone(),
        };
        let buffer = DeviceBuffer::<MaybeUninit<f32>>::from_lent(lent(1 << 20, 4096)).unwrap();
        assert_eq!((buffer.len(), buffer.as_raw()), (1024, 1 << 20));
        assert_eq!(dropped.load(Ordering::Relaxed), 0);
        // Freeing it here (`cudaFree` of an address CUDA never gave) would fail or worse;
        // the drop hands it back instead, without CUDA.
        drop(buffer);
        assert_eq!(dropped.load(Ordering::Relaxed), 1);
        // Misaligned, or not a whole number of elements: refused, and handed back.
        for (address, bytes) in [((1 << 20) + 2, 4096), (1 << 20, 4094)] {
            let error = DeviceBuffer::<MaybeUninit<f32>>::from_lent(lent(address, bytes));
            assert!(matches!(error, Err(Error::Unsupported(_))));
        }
        assert_eq!(dropped.load(Ordering::Relaxed), 3);
    }

    #[test]
    fn a_buffer_taken_as_initialised_keeps_its_memory_tracking_and_owner_once() {
        let dropped = Arc::new(AtomicUsize::new(0));
        let lent = Lent {
            address: 1 << 20,
            bytes: 64,
            dropped: dropped.clone(),
        };
        let buffer = DeviceBuffer::<MaybeUninit<u16>>::from_lent(lent).unwrap();
        // SAFETY: nothing reads the elements here; the test checks what moves across.
        let buffer: DeviceBuffer<u16> = unsafe { buffer.assume_init() };
        assert_eq!((buffer.len(), buffer.as_raw()), (32, 1 << 20));
        assert_eq!(dropped.load(Ordering::Relaxed), 0);
        drop(buffer);
        // Handed back once: the moved-out tracking and owner are dropped by the new buffer
        // alone (Miri reports a double drop of either).
        assert_eq!(dropped.load(Ordering::Relaxed), 1);
    }
}
