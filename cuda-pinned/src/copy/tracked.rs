//! Tracked async copies: a copy takes the host buffer by value and gives it back when the
//! device is done with it.

use std::fmt;
use std::mem::ManuallyDrop;
use std::sync::Arc;

use bytemuck::{AnyBitPattern, NoUninit};

use crate::containers::boxed::PinnedBox;
use crate::error::Error;
use crate::error::Result;
use crate::gpu::views::DeviceRange;
use crate::gpu::views::DeviceSlice;
use crate::gpu::views::DeviceSliceMut;
use crate::memory::allocator::PendingUses;
use crate::memory::allocator::PinnedAllocator;
use crate::raw::copy::Direction;

use crate::containers::vec::PinnedVec;
use crate::gpu::event::Event;
use crate::gpu::stream::Stream;
use crate::memory::registration::RegisteredVec;

/// A host buffer that async copies can take by value: [`PinnedVec`], [`PinnedBox`],
/// [`RegisteredVec`], and allocator-api2's `Vec` over this crate's allocators (or a pool).
///
/// Implement it for a container of your own to copy from and into it.
///
/// # Safety
///
/// Implementors promise that:
/// - [`host_parts`](Self::host_parts) returns the address and length (in elements) of memory
///   the buffer owns, valid for reads and writes of that many `Elem`s, that stays valid and
///   in place — also when the buffer value itself is moved (the memory is on the heap or
///   elsewhere outside the value, never inline) — and that nothing but the buffer reaches, for
///   as long as the buffer lives and is not used (a [`Transfer`] holds it untouched);
/// - [`release_after`](Self::release_after) keeps that memory valid until every event of
///   `pending` has completed: it waits for them, hands them to an allocator that defers reuse
///   on them, or leaks the memory (when waiting fails).
///
/// Page-locked memory makes the copy asynchronous; it is not needed for soundness.
pub unsafe trait HostBuffer {
    /// The element type copied.
    type Elem;

    /// The buffer's address and length in elements.
    fn host_parts(&mut self) -> (*mut Self::Elem, usize);

    /// Drops the buffer once the device work in `pending` no longer uses it.
    fn release_after(self, pending: PendingUses);
}

// SAFETY: the vector owns its block; `pending` joins its recorded uses, which its allocator
// waits for or defers reuse on when the vector drops.
unsafe impl<T, A: PinnedAllocator> HostBuffer for PinnedVec<T, A> {
    type Elem = T;
    #[inline]
    fn host_parts(&mut self) -> (*mut T, usize) {
        (self.as_mut_ptr(), self.len())
    }
    fn release_after(mut self, pending: PendingUses) {
        self.uses_mut().extend(pending);
    }
}

// SAFETY: as for `PinnedVec`.
unsafe impl<T, A: PinnedAllocator> HostBuffer for PinnedBox<T, A> {
    type Elem = T;
    #[inline]
    fn host_parts(&mut self) -> (*mut T, usize) {
        (self.as_mut_ptr(), 1)
    }
    fn release_after(mut self, pending: PendingUses) {
        self.uses_mut().extend(pending);
    }
}

// SAFETY: the registered `Vec` is owned and its length fixed while registered; `pending`
// joins the recorded uses, which the drop waits for before unregistering and freeing.
unsafe impl<T> HostBuffer for RegisteredVec<T> {
    type Elem = T;
    #[inline]
    fn host_parts(&mut self) -> (*mut T, usize) {
        (self.as_mut_ptr(), self.len())
    }
    fn release_after(mut self, pending: PendingUses) {
        self.uses_mut().extend(pending);
    }
}

// SAFETY: the `Vec` owns its buffer; it is dropped only after the events have completed, and
// leaked when that cannot be known.
unsafe impl<T, A> HostBuffer for allocator_api2::vec::Vec<T, A>
where
    A: PinnedAllocator + allocator_api2::alloc::Allocator,
{
    type Elem = T;
    #[inline]
    fn host_parts(&mut self) -> (*mut T, usize) {
        (self.as_mut_ptr(), self.len())
    }
    fn release_after(self, pending: PendingUses) {
        if pending.wait().is_err() {
            std::mem::forget(self);
        }
    }
}

/// An async copy in flight, holding its host buffer until the device is done with it.
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

    /// The event that completes with the copy, for ordering other work after it
    /// ([`Stream::wait_event`]).
    pub fn event(&self) -> &Event {
        &self.event
    }

    /// Waits for the copy to finish and returns the buffer.
    ///
    /// # Errors
    ///
    /// A CUDA error (the device is then in an error state). The buffer is not returned and
    /// its memory is leaked: nothing can prove the device has stopped using it.
    pub fn wait(self) -> Result<B> {
        let _span = tracing::debug_span!("wait", what = %"copy").entered();
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
        // memory is freed or reused only after the copy.
        let buffer = unsafe { ManuallyDrop::take(&mut self.buffer) };
        buffer.release_after(PendingUses::from_event(self.event.clone()));
    }
}

impl Stream {
    /// Queues a copy of `src` into `dst` (a [`DeviceBuffer`](crate::DeviceBuffer) or a view of part
    /// of one: `&mut device`, `device.slice_mut(..n)`) on this stream.
    ///
    /// `src` travels with the returned [`Transfer`] until the copy has finished.
    ///
    /// The error is this crate's [`Error`], so `?` converts it into `Box<dyn Error>` or any
    /// error type that takes a `std::error::Error`, whatever allocator the buffer has:
    ///
    /// # Examples
    ///
    /// ```no_run
    /// # use cuda_pinned::{DeviceBuffer, PinnedVec, Stream};
    /// fn upload(stream: &Stream, data: &[f32]) -> Result<(), Box<dyn std::error::Error>> {
    ///     let mut device = DeviceBuffer::<f32>::zeroed(data.len())?;
    ///     let host = PinnedVec::from_slice(data)?;
    ///     stream.copy_to_device(host, &mut device)?.wait()?;
    ///     Ok(())
    /// }
    /// ```
    ///
    /// # Errors
    ///
    /// [`Error::LengthMismatch`] when the lengths differ, [`Error::DeviceMismatch`] when the
    /// device buffer is not on the stream's device, [`Error::Capturing`] on a stream capturing
    /// a graph, or the CUDA error. `src` is then dropped:
    /// given back to its allocator once nothing can still use it.
    pub fn copy_to_device<'d, B>(
        &self,
        src: B,
        dst: impl Into<DeviceSliceMut<'d, B::Elem>>,
    ) -> Result<Transfer<B>>
    where
        B: HostBuffer,
        B::Elem: NoUninit + 'd,
    {
        let dst = dst.into();
        // SAFETY: the range lies in a live device allocation that outlives the call and
        // records the copy's event, freeing its memory only after it; it is borrowed
        // uniquely, so nothing else writes it meanwhile.
        unsafe {
            self.copy_host(
                src,
                Some(dst.range),
                dst.range.address,
                Direction::HostToDevice,
            )
        }
    }

    /// Queues a copy of `src` into `dst` on this stream, tracked until it ends.
    ///
    /// `src` is a [`DeviceBuffer`](crate::DeviceBuffer) or a view of part of one; `dst` travels
    /// with the returned [`Transfer`] and holds the data once [`Transfer::wait`] returns it.
    ///
    /// # Examples
    ///
    /// ```no_run
    /// use cuda_pinned::{DeviceBuffer, PinnedVec, Stream};
    /// let stream = Stream::new()?;
    /// let device = DeviceBuffer::from_slice(&[3u32; 1024])?;
    /// let host = PinnedVec::<u32>::zeroed(1024)?;
    /// let host = stream.copy_from_device(&device, host)?.wait()?;
    /// assert_eq!(host[0], 3);
    /// # Ok::<(), cuda_pinned::Error>(())
    /// ```
    ///
    /// # Errors
    ///
    /// [`Error::LengthMismatch`] when the lengths differ, [`Error::DeviceMismatch`] when the
    /// device buffer is not on the stream's device, [`Error::Capturing`] on a stream capturing
    /// a graph, or the CUDA error. `dst` is then dropped:
    /// given back to its allocator once nothing can still use it.
    pub fn copy_from_device<'d, B>(
        &self,
        src: impl Into<DeviceSlice<'d, B::Elem>>,
        dst: B,
    ) -> Result<Transfer<B>>
    where
        B: HostBuffer,
        B::Elem: AnyBitPattern + 'd,
    {
        let src = src.into();
        // SAFETY: as in `copy_to_device`, with the device range read.
        unsafe {
            self.copy_host(
                dst,
                Some(src.range),
                src.range.address,
                Direction::DeviceToHost,
            )
        }
    }

    /// Queues a copy of `src` to the raw device address `dst`.
    ///
    /// # Errors
    ///
    /// [`Error::Capturing`] on a stream capturing a graph, or the CUDA error; `src` is then
    /// dropped once nothing can still use it.
    ///
    /// # Safety
    ///
    /// - `dst` is device memory writable for `src`'s length in bytes until the copy has
    ///   finished, and nothing else reads or writes it meanwhile.
    pub unsafe fn copy_to_device_ptr<B>(&self, src: B, dst: u64) -> Result<Transfer<B>>
    where
        B: HostBuffer,
        B::Elem: NoUninit,
    {
        // SAFETY: forwarded from the caller; no length check is possible for a raw address.
        unsafe { self.copy_host(src, None, dst, Direction::HostToDevice) }
    }

    /// Queues a copy from the raw device address `src` into `dst`.
    ///
    /// # Errors
    ///
    /// [`Error::Capturing`] on a stream capturing a graph, or the CUDA error; `dst` is then
    /// dropped once nothing can still use it.
    ///
    /// # Safety
    ///
    /// - `src` is device memory readable for `dst`'s length in bytes until the copy has
    ///   finished, and nothing writes it meanwhile.
    pub unsafe fn copy_from_device_ptr<B>(&self, src: u64, dst: B) -> Result<Transfer<B>>
    where
        B: HostBuffer,
        B::Elem: AnyBitPattern,
    {
        // SAFETY: forwarded from the caller.
        unsafe { self.copy_host(dst, None, src, Direction::DeviceToHost) }
    }

    /// # Safety
    ///
    /// - `device` is device memory valid for the copy until it has finished (for
    ///   `tracked.len` elements when `tracked` is given, which is then the range at
    ///   `device` and records the copy), and not used by anyone else meanwhile.
    unsafe fn copy_host<B: HostBuffer>(
        &self,
        mut host: B,
        tracked: Option<DeviceRange<'_>>,
        device: u64,
        direction: Direction,
    ) -> Result<Transfer<B>> {
        let (host_ptr, len) = host.host_parts();
        let bytes = check_sizes::<B::Elem>(self, len, tracked)?;
        let _span = tracing::debug_span!(
            "copy",
            direction = %direction.name(),
            bytes,
            memory = %"page-locked",
            stream = ?self.as_raw(),
            device = self.device().raw(),
        )
        .entered();
        let (dst, src) = match direction {
            Direction::HostToDevice => (device as *mut _, host_ptr.cast_const().cast()),
            _ => (host_ptr.cast(), device as *const _),
        };
        // What was queued, for the error paths: the copy's event once it is recorded; whether
        // the buffer must be leaked (the copy was queued and nothing can tell when it ends).
        let mut ended = None;
        let mut leak = false;
        let queued = crate::gpu::fence::enqueue(self, |stream| {
            if let Some(range) = tracked {
                range.pending.order_before(stream)?;
            }
            let copied = if bytes > 0 {
                // SAFETY: the host side is `bytes` long and owned by `host`, which the
                // returned `Transfer` keeps (or leaks) until the copy has finished; the
                // device side is valid per this function's contract.
                unsafe { crate::copy::split::queue(dst, src, bytes, direction, stream.as_raw()) }
            } else {
                Ok(())
            };
            let event = copied.and_then(|()| stream.record_event_untimed());
            match event {
                Ok(event) => {
                    let event = Arc::new(event);
                    if let Some(range) = tracked {
                        range.pending.track(stream, event.clone());
                    }
                    ended = Some(event.clone());
                    Ok(event)
                }
                Err(error) => {
                    // The copy (or its first pieces) may be queued without an event: the
                    // buffer is dropped only once the stream has finished, and leaked when
                    // even that cannot be known (the device is in an error state).
                    leak = stream.synchronize().is_err();
                    Err(error)
                }
            }
        });
        finish(host, queued, ended, leak)
    }
}

/// The copy's bytes, after checking the lengths and that a tracked device range belongs to
/// `stream`'s device.
fn check_sizes<T>(stream: &Stream, len: usize, tracked: Option<DeviceRange<'_>>) -> Result<usize> {
    if let Some(range) = tracked {
        if range.len != len {
            return Err(Error::LengthMismatch {
                host: len,
                device: range.len,
            });
        }
        range.check_stream(stream)?;
    }
    len.checked_mul(size_of::<T>())
        .ok_or(Error::CapacityOverflow)
}

/// The transfer of a queued copy, or the error, with `host` kept until nothing can use it:
/// released after the copy's event where one was recorded (never, for an event a capture
/// took: waiting for it fails), leaked where the copy was queued and its end is unknown.
fn finish<B: HostBuffer>(
    host: B,
    queued: Result<Arc<Event>>,
    ended: Option<Arc<Event>>,
    leak: bool,
) -> Result<Transfer<B>> {
    match (queued, ended) {
        (Ok(event), _) => Ok(Transfer {
            buffer: ManuallyDrop::new(host),
            event,
        }),
        (Err(error), Some(event)) => {
            host.release_after(PendingUses::from_event(event));
            Err(error)
        }
        (Err(error), None) => {
            if leak {
                std::mem::forget(host);
            }
            Err(error)
        }
    }
}
