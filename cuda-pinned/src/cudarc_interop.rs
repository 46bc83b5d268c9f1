//! Working with cudarc (the `cudarc` feature): its streams adopted as ours, tracked copies
//! between our buffers and its device memory, and `HostSlice` for our buffers.
//!
//! Both crates use the device's primary context, so a stream, an event or device memory of
//! one is valid in the other.

use std::sync::Arc;

use bytemuck::{AnyBitPattern, NoUninit};
use cudarc::driver::{CudaStream, DevicePtr, DevicePtrMut, HostSlice, SyncOnDrop};

use crate::alloc::PinnedAllocator;
use crate::boxed::PinnedBox;
use crate::error::{Error, Result};
use crate::ffi;
use crate::registration::{RegisteredVec, Registration};
use crate::stream::{Owner, Stream};
use crate::transfer::{HostBuffer, Transfer};
use crate::vec::PinnedVec;

impl Stream {
    /// Adopts a cudarc stream: copies can be queued on it, and buffers can record their use on
    /// it ([`PinnedVec::record_stream`]) so that work queued through cudarc (kernels, its own
    /// copies) holds them back from reuse and free. The returned handle keeps the cudarc
    /// stream alive.
    ///
    /// ```no_run
    /// use cuda_pinned::{PinnedVec, Stream};
    /// let ctx = cudarc::driver::CudaContext::new(0)?;
    /// let cudarc_stream = ctx.new_stream()?;
    /// let mut batch = PinnedVec::from_slice(&[1.0f32; 256])?;
    /// // ... a cudarc kernel reads `batch` through its mapped address ...
    /// batch.record_stream(&Stream::from_cudarc(&cudarc_stream)?);
    /// drop(batch); // freed (or reused by a pool) only after that kernel
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    ///
    /// # Errors
    ///
    /// [`Error::Unsupported`] for cudarc's `default_stream()` and `per_thread_stream()`, which
    /// name a different stream on every device or thread (see [`from_raw`](Self::from_raw)).
    /// [`CudarcCopies`] works on them.
    pub fn from_cudarc(stream: &Arc<CudaStream>) -> Result<Self> {
        // SAFETY: the handle belongs to `stream`, kept alive by the returned stream; cudarc
        // streams live in a context of the device, and work recorded there by this crate
        // fails cleanly (falling back to a stream synchronisation) if it is not the primary one.
        unsafe {
            Self::adopt(
                stream.cu_stream().cast(),
                Owner::Kept(Box::new(stream.clone())),
                Some(ordinal(stream)),
            )
        }
    }
}

/// Tracked async copies on a cudarc stream, between this crate's pinned buffers and cudarc's
/// device memory (`CudaSlice`, `CudaView`, `CudaViewMut`). As with [`Stream::copy_to_device`],
/// the host buffer moves into the returned [`Transfer`] and comes back from
/// [`Transfer::wait`] after the copy, so the host cannot touch it while the DMA runs; the device
/// side takes part in cudarc's own event tracking, like its `memcpy_htod`.
///
/// ```no_run
/// use cuda_pinned::{CudarcCopies, PinnedVec};
/// let ctx = cudarc::driver::CudaContext::new(0)?;
/// let stream = ctx.new_stream()?;
/// let mut on_device = stream.alloc_zeros::<f32>(1024)?;
/// let batch = PinnedVec::from_slice(&[1.0f32; 1024])?;
/// let upload = stream.copy_to_device(batch, &mut on_device)?; // returns at once
/// // ... launch cudarc kernels on `stream` ...
/// let batch = upload.wait()?; // the buffer, free to refill
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
pub trait CudarcCopies {
    /// Queues a copy of `src` into `dst` on this stream.
    ///
    /// # Errors
    ///
    /// [`Error::LengthMismatch`] when the lengths differ, [`Error::DeviceMismatch`] when the
    /// device memory belongs to another context than the stream, [`Error::Capturing`] on a
    /// stream capturing a graph (before cudarc's own calls), or the CUDA error (making
    /// the stream's device current among them). `src` is then dropped: given back to its
    /// allocator once nothing can still use it.
    fn copy_to_device<B, D>(&self, src: B, dst: &mut D) -> Result<Transfer<B>>
    where
        B: HostBuffer,
        B::Elem: NoUninit,
        D: DevicePtrMut<B::Elem>;

    /// Queues a copy of `src` into `dst` on this stream; `dst` holds the data once
    /// [`Transfer::wait`] returns it.
    ///
    /// # Errors
    ///
    /// As [`copy_to_device`](Self::copy_to_device).
    fn copy_from_device<B, D>(&self, src: &D, dst: B) -> Result<Transfer<B>>
    where
        B: HostBuffer,
        B::Elem: AnyBitPattern,
        D: DevicePtr<B::Elem>;
}

impl CudarcCopies for Arc<CudaStream> {
    fn copy_to_device<B, D>(&self, mut src: B, dst: &mut D) -> Result<Transfer<B>>
    where
        B: HostBuffer,
        B::Elem: NoUninit,
        D: DevicePtrMut<B::Elem>,
    {
        let stream = prepare(self, src.host_parts().1, dst.len(), dst.stream())?;
        ffi::on_device(ordinal(self), || {
            // Before cudarc's wait below, which a capture would take in.
            stream.refuse_capture()?;
            // cudarc makes the stream wait for earlier uses of `dst`, and records this write
            // on drop of `_written`, after the copy is queued.
            let (address, _written) = dst.device_ptr_mut(self);
            // SAFETY: `dst` is a live cudarc allocation of exactly the buffer's length; cudarc
            // frees it only after the write event recorded above (on its stream), and `&mut`
            // keeps other host-side users away while the copy is queued.
            unsafe { stream.copy_to_device_ptr(src, address) }
        })
    }

    fn copy_from_device<B, D>(&self, src: &D, mut dst: B) -> Result<Transfer<B>>
    where
        B: HostBuffer,
        B::Elem: AnyBitPattern,
        D: DevicePtr<B::Elem>,
    {
        let stream = prepare(self, dst.host_parts().1, src.len(), src.stream())?;
        ffi::on_device(ordinal(self), || {
            stream.refuse_capture()?;
            let (address, _read) = src.device_ptr(self);
            // SAFETY: as in `copy_to_device`, with the device range read; cudarc orders later
            // writes of `src` after the read event recorded when `_read` drops.
            unsafe { stream.copy_from_device_ptr(address, dst) }
        })
    }
}

/// Checks the lengths and that the device memory lives in the stream's context (cudarc could
/// not record its use on the stream otherwise, and would free it while the copy runs), and
/// wraps the stream for this call, its default streams included: the copy and its event are
/// queued now, from this thread, with the stream's device current, where a default stream
/// names the right one. The caller's current device is put back afterwards, where cudarc
/// itself would leave its context bound.
fn prepare(
    stream: &Arc<CudaStream>,
    host: usize,
    device: usize,
    memory: &Arc<CudaStream>,
) -> Result<Stream> {
    if host != device {
        return Err(Error::LengthMismatch { host, device });
    }
    if memory.context().cu_ctx() != stream.context().cu_ctx() {
        return Err(Error::DeviceMismatch {
            what: "the cudarc device memory",
            expected: stream.context().ordinal(),
            found: memory.context().ordinal(),
        });
    }
    // SAFETY: the handle is kept alive by the clone held, and is a stream of the context's
    // device; the wrapper lives for this call only (copies record their event at once and
    // keep the event, not the stream).
    Ok(unsafe {
        Stream::borrow(
            stream.cu_stream().cast(),
            Owner::Kept(Box::new(stream.clone())),
            ordinal(stream),
        )
    })
}

/// The ordinal of the stream's device.
fn ordinal(stream: &CudaStream) -> i32 {
    stream.context().ordinal() as i32
}

// `stream.memcpy_htod(&pinned, &mut slice)` and `stream.memcpy_dtoh(&slice, &mut pinned)`:
// cudarc takes the buffer by reference, so the borrow ends when the call returns, while the
// DMA from page-locked memory is still running. These impls have cudarc synchronise the
// stream before the call returns (cudarc's own `[T]` impl relies on the driver doing that for
// pageable memory, which it does not do for pinned memory). For copies that overlap compute,
// use `CudarcCopies`. A stream that is capturing a graph would copy at each launch instead,
// after the borrow: cudarc's calls give no way to refuse it but a panic. cudarc's wait is
// its own: made in the thread's capture mode, it is refused while another thread captures a
// graph in global mode, and cudarc then records the error in its context and returns while
// the copy runs. This crate's own waits are made in relaxed mode and are not refused.

/// Panics if `stream` is capturing a graph (see above). A stream whose state cannot be read
/// is left to cudarc, whose copy call meets the same error.
fn assert_not_capturing(stream: &CudaStream) {
    use cudarc::driver::sys::CUstreamCaptureStatus;
    let capturing = stream
        .capture_status()
        .is_ok_and(|status| status != CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE);
    assert!(
        !capturing,
        "a page-locked buffer lent to cudarc's memcpy on a stream capturing a CUDA graph: the \
         graph would copy at each launch, after the borrow ends; copy before capturing, or \
         capture copies of memory the graph owns"
    );
}

/// `HostSlice` for a buffer that dereferences to `[T]`: the slice, and a stream
/// synchronisation when cudarc is done queueing.
macro_rules! synced_host_slice {
    ($(#[$doc:meta])* impl[$($generics:tt)*] for $buffer:ty) => {
        $(#[$doc])*
        impl<$($generics)*> HostSlice<T> for $buffer {
            fn len(&self) -> usize {
                <[T]>::len(self)
            }

            unsafe fn stream_synced_slice<'s>(
                &'s self,
                stream: &'s CudaStream,
            ) -> (&'s [T], SyncOnDrop<'s>) {
                assert_not_capturing(stream);
                (self, SyncOnDrop::sync_stream(stream))
            }

            unsafe fn stream_synced_mut_slice<'s>(
                &'s mut self,
                stream: &'s CudaStream,
            ) -> (&'s mut [T], SyncOnDrop<'s>) {
                assert_not_capturing(stream);
                (self, SyncOnDrop::sync_stream(stream))
            }
        }
    };
}

synced_host_slice! {
    /// `stream.memcpy_htod(&vec, ..)` and `memcpy_dtoh(.., &mut vec)` return after the copy;
    /// on a stream capturing a graph they panic (for `memcpy_dtoh`, after cudarc has made the
    /// stream wait for earlier writes of the device memory, which the capture takes in).
    /// cudarc waits for the stream in the thread's own capture mode: while another thread
    /// captures a graph in global mode, CUDA refuses that wait and cudarc returns before the
    /// copy has finished (the error kept in its context). Use `CudarcCopies` where graphs are
    /// captured in global mode.
    impl[T, A: PinnedAllocator] for PinnedVec<T, A>
}
synced_host_slice! {
    /// As for [`PinnedVec`]: registered memory is page-locked too.
    impl[T] for RegisteredVec<T>
}
synced_host_slice! {
    /// As for [`PinnedVec`]: registered memory is page-locked too.
    impl['a, T] for Registration<'a, T>
}

/// As for [`PinnedVec`], for the box's one element.
impl<T, A: PinnedAllocator> HostSlice<T> for PinnedBox<T, A> {
    fn len(&self) -> usize {
        1
    }

    unsafe fn stream_synced_slice<'s>(
        &'s self,
        stream: &'s CudaStream,
    ) -> (&'s [T], SyncOnDrop<'s>) {
        assert_not_capturing(stream);
        (
            std::slice::from_ref(&**self),
            SyncOnDrop::sync_stream(stream),
        )
    }

    unsafe fn stream_synced_mut_slice<'s>(
        &'s mut self,
        stream: &'s CudaStream,
    ) -> (&'s mut [T], SyncOnDrop<'s>) {
        assert_not_capturing(stream);
        (
            std::slice::from_mut(&mut **self),
            SyncOnDrop::sync_stream(stream),
        )
    }
}
