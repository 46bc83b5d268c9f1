//! Working with cudarc (the `cudarc` feature): its streams adopted as ours, our device views as
//! its kernel arguments, and tracked copies between our buffers and its device memory.
//!
//! Our buffers do not implement cudarc's `HostSlice`, through which `stream.memcpy_htod(&buf,
//! ..)` would take them by reference. cudarc ends such a copy by waiting for the stream in
//! the thread's own capture mode: while another thread captures a graph in global mode CUDA
//! refuses that wait, and cudarc records the error in its context and returns, the borrow
//! over while the DMA still reads or writes the buffer, which could then be freed or given to
//! a new owner. `CudarcCopies` moves the buffer into a `Transfer` instead, and waits for it
//! in relaxed mode.
//!
//! Both crates use the device's primary context, so a stream, an event or device memory of
//! one is valid in the other.

use std::sync::Arc;

use bytemuck::{AnyBitPattern, NoUninit};
use cudarc::driver::{CudaStream, DevicePtr, DevicePtrMut, LaunchArgs, PushKernelArg};

use crate::copy::tracked::HostBuffer;
use crate::copy::tracked::Transfer;
use crate::error::Error;
use crate::error::Result;
use crate::gpu::pending::PendingCopies;
use crate::gpu::stream::Owner;
use crate::gpu::stream::Stream;
use crate::gpu::views::{DeviceRange, DeviceSlice, DeviceSliceMut};
use crate::memory::allocator::PinnedAllocator;
use crate::staging::{StagedCopy, Stager};

impl Stream {
    /// Adopts a cudarc stream for copies and for buffers' recorded uses.
    ///
    /// Adopts a cudarc stream: copies can be queued on it, and buffers can record their use on
    /// it ([`PinnedVec::record_stream`](crate::PinnedVec::record_stream)) so that work queued
    /// through cudarc (kernels, its own copies) holds them back from reuse and free. The
    /// returned handle keeps the cudarc stream alive.
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
    /// Work this crate queues for an adopted stream runs on a companion stream of its own,
    /// forked from it and joined back: a capture that other code begins on the stream during
    /// the call cannot take that work into a graph. The call either fails with
    /// [`Error::Capturing`] before anything is queued, or its work runs now and the graph
    /// waits for it. Still, never begin or end a capture on a stream while another thread
    /// queues work on it, through any library: CUDA's driver itself can crash in that race.
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

/// Tracked async copies on a cudarc stream, between this crate's pinned buffers and cudarc's device
/// memory (`CudaSlice`, `CudaView`, `CudaViewMut`).
///
/// As with [`Stream::copy_to_device`], the host buffer moves into the returned [`Transfer`] and
/// comes back from [`Transfer::wait`] after the copy, so the host cannot touch it while the DMA
/// runs; the device side takes part in cudarc's own event tracking, like its `memcpy_htod`.
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

    /// Queues a copy of `src` (a [`DeviceBuffer`](crate::DeviceBuffer) of this crate, or a view
    /// of one: a loader batch's field) into cudarc's `dst` on this stream, tracked on both
    /// sides: after the buffer's copies on other streams and cudarc's earlier uses of `dst`;
    /// the buffer is freed only after it, and cudarc orders later uses of `dst` after it.
    ///
    /// # Errors
    ///
    /// [`Error::LengthsDiffer`] when the lengths differ; otherwise as
    /// [`copy_to_device`](Self::copy_to_device), with [`Error::DeviceMismatch`] also for a
    /// buffer of another device than the stream's.
    fn copy_device_to_cudarc<'s, T, D>(
        &self,
        src: impl Into<DeviceSlice<'s, T>>,
        dst: &mut D,
    ) -> Result<()>
    where
        T: Copy + 's,
        D: DevicePtrMut<T>;

    /// Queues a copy of cudarc's `src` into `dst` (a [`DeviceBuffer`](crate::DeviceBuffer) of
    /// this crate, or a view of one) on this stream, tracked on both sides as in
    /// [`copy_device_to_cudarc`](Self::copy_device_to_cudarc).
    ///
    /// # Errors
    ///
    /// As [`copy_device_to_cudarc`](Self::copy_device_to_cudarc).
    fn copy_cudarc_to_device<'d, T, S>(
        &self,
        src: &S,
        dst: impl Into<DeviceSliceMut<'d, T>>,
    ) -> Result<()>
    where
        T: Copy + 'd,
        S: DevicePtr<T>;
}

impl CudarcCopies for Arc<CudaStream> {
    fn copy_to_device<B, D>(&self, mut src: B, dst: &mut D) -> Result<Transfer<B>>
    where
        B: HostBuffer,
        B::Elem: NoUninit,
        D: DevicePtrMut<B::Elem>,
    {
        let stream = prepare(self, src.host_parts().1, dst.len(), dst.stream())?;
        crate::context::on_device(ordinal(self), || {
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
        crate::context::on_device(ordinal(self), || {
            stream.refuse_capture()?;
            let (address, _read) = src.device_ptr(self);
            // SAFETY: as in `copy_to_device`, with the device range read; cudarc orders later
            // writes of `src` after the read event recorded when `_read` drops.
            unsafe { stream.copy_from_device_ptr(address, dst) }
        })
    }

    fn copy_device_to_cudarc<'s, T, D>(
        &self,
        src: impl Into<DeviceSlice<'s, T>>,
        dst: &mut D,
    ) -> Result<()>
    where
        T: Copy + 's,
        D: DevicePtrMut<T>,
    {
        let src = src.into().range;
        check_lengths(src.len, dst.len())?;
        let stream = prepare(self, src.len, dst.len(), dst.stream())?;
        src.check_stream(&stream)?;
        crate::context::on_device(ordinal(self), || {
            stream.refuse_capture()?;
            let (address, _written) = dst.device_ptr_mut(self);
            // SAFETY: `dst` is a live cudarc allocation of the view's length (checked), freed
            // by cudarc only after the write event recorded when `_written` drops (after the
            // copy is queued), and borrowed uniquely; the view lies in a live buffer that
            // records the copy and is freed only after it. The two are different allocations.
            unsafe {
                crate::copy::device::queue_tracked(
                    &stream,
                    address,
                    src.address,
                    src.len * size_of::<T>(),
                    &[src],
                )
            }
        })
    }

    fn copy_cudarc_to_device<'d, T, S>(
        &self,
        src: &S,
        dst: impl Into<DeviceSliceMut<'d, T>>,
    ) -> Result<()>
    where
        T: Copy + 'd,
        S: DevicePtr<T>,
    {
        let dst = dst.into().range;
        check_lengths(src.len(), dst.len)?;
        let stream = prepare(self, dst.len, src.len(), src.stream())?;
        dst.check_stream(&stream)?;
        crate::context::on_device(ordinal(self), || {
            stream.refuse_capture()?;
            let (address, _read) = src.device_ptr(self);
            // SAFETY: as in `copy_device_to_cudarc`, with cudarc's memory read (cudarc orders
            // its later writes after the read event recorded when `_read` drops) and this
            // crate's view written, borrowed uniquely.
            unsafe {
                crate::copy::device::queue_tracked(
                    &stream,
                    dst.address,
                    address,
                    dst.len * size_of::<T>(),
                    &[dst],
                )
            }
        })
    }
}

// SAFETY: what cudarc's launch receives for the argument is a pointer to the view's device
// address (a `u64`, as a kernel's pointer parameter takes it), borrowed for the builder's
// life. Ordering the kernel's stream with the memory is the launch's caller's part (cudarc's
// `launch` is `unsafe`), as the views' docs say.
unsafe impl<'a, 'b: 'a, T> PushKernelArg<&'b DeviceSlice<'_, T>> for LaunchArgs<'a> {
    #[inline(always)]
    fn arg(&mut self, arg: &'b DeviceSlice<'_, T>) -> &mut Self {
        self.arg(&arg.range.address)
    }
}

// SAFETY: as for `DeviceSlice`, for a view the kernel may write.
unsafe impl<'a, 'b: 'a, T> PushKernelArg<&'b mut DeviceSliceMut<'_, T>> for LaunchArgs<'a> {
    #[inline(always)]
    fn arg(&mut self, arg: &'b mut DeviceSliceMut<'_, T>) -> &mut Self {
        self.arg(&arg.range.address)
    }
}

/// Copies between ordinary memory and cudarc's device memory through a [`Stager`]'s ring, on
/// cudarc's streams (its per-thread and default streams included: the call's own thread
/// queues everything): several times the driver's path from pageable memory, which is what
/// cudarc's `memcpy_htod` of a `Vec` takes.
impl<A: PinnedAllocator> Stager<A> {
    /// Copies `src` into cudarc's `dst` on cudarc's `stream`, and returns once `src` has been
    /// read, as [`copy_to_device`](Self::copy_to_device) does.
    ///
    /// cudarc's own tracking sees the write: `stream` first waits for `dst`'s earlier uses,
    /// and `dst`'s write event is recorded after the copy.
    ///
    /// ```no_run
    /// use cuda_pinned::Stager;
    /// let stream = cudarc::driver::CudaContext::new(0)?.new_stream()?;
    /// let stager = Stager::new()?;
    /// let weights = vec![0.5f32; 1 << 26]; // ordinary memory
    /// let mut on_device = unsafe { stream.alloc::<f32>(weights.len()) }?;
    /// stager.copy_to_cudarc(&stream, &weights, &mut on_device)?; // work on `stream` sees it
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    ///
    /// # Errors
    ///
    /// [`Error::LengthMismatch`], [`Error::DeviceMismatch`] for memory or a stream of another
    /// device than the stager's, then as [`copy_to_device`](Self::copy_to_device).
    pub fn copy_to_cudarc<T, D>(
        &self,
        stream: &Arc<CudaStream>,
        src: &[T],
        dst: &mut D,
    ) -> Result<StagedCopy>
    where
        T: NoUninit,
        D: DevicePtrMut<T>,
    {
        let ours = prepare(stream, src.len(), dst.len(), dst.stream())?;
        // The copy's event goes to cudarc's write event; nothing of this crate keeps it.
        let pending = PendingCopies::default();
        crate::context::on_device(ordinal(stream), || {
            ours.refuse_capture()?;
            let len = dst.len();
            // cudarc makes the stream wait for earlier uses of `dst`, and records this write
            // on drop of `_written`, after the copy is queued.
            let (address, _written) = dst.device_ptr_mut(stream);
            let dst = DeviceSliceMut::<'_, T> {
                range: DeviceRange {
                    address,
                    len,
                    device: ordinal(stream),
                    pending: &pending,
                },
                _unique: std::marker::PhantomData,
            };
            // A live cudarc allocation of exactly `src`'s length, borrowed uniquely, freed by
            // cudarc only after the write event above.
            self.copy_to_device(&ours, src, dst)
        })
    }

    /// Copies cudarc's `src` into `dst` (ordinary memory) on cudarc's `stream`, and returns
    /// once `dst` is filled, as [`copy_from_device`](Self::copy_from_device) does; `stream`
    /// first waits for `src`'s last write (cudarc's tracking).
    ///
    /// # Errors
    ///
    /// As [`copy_to_cudarc`](Self::copy_to_cudarc).
    pub fn copy_from_cudarc<T, S>(
        &self,
        stream: &Arc<CudaStream>,
        src: &S,
        dst: &mut [T],
    ) -> Result<()>
    where
        T: AnyBitPattern,
        S: DevicePtr<T>,
    {
        let ours = prepare(stream, dst.len(), src.len(), src.stream())?;
        let pending = PendingCopies::default();
        crate::context::on_device(ordinal(stream), || {
            ours.refuse_capture()?;
            let len = src.len();
            let (address, _read) = src.device_ptr(stream);
            let src = DeviceSlice::<'_, T> {
                range: DeviceRange {
                    address,
                    len,
                    device: ordinal(stream),
                    pending: &pending,
                },
                _elements: std::marker::PhantomData,
            };
            self.copy_from_device(&ours, src, dst)
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

/// [`Error::LengthsDiffer`] unless a device-to-device copy's two sides have one length.
fn check_lengths(src: usize, dst: usize) -> Result<()> {
    if src == dst {
        Ok(())
    } else {
        Err(Error::LengthsDiffer { src, dst })
    }
}

/// The ordinal of the stream's device.
fn ordinal(stream: &CudaStream) -> i32 {
    stream.context().ordinal() as i32
}
