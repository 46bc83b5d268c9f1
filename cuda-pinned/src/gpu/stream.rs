//! Minimal CUDA streams and events: enough to enqueue tracked copies and to know when they end.

use std::fmt;
use std::sync::Arc;

use cuda_pinned_sys::{self as sys, cudaStream_t};

use crate::error::Error;
use crate::error::Result;
use crate::gpu::device::Device;
use crate::gpu::event::Event;
struct StreamHandle {
    raw: cudaStream_t,
    owner: Owner,
    device: i32,
}

/// Who answers for a stream's life.
pub(crate) enum Owner {
    /// This crate created it and destroys it with the last handle.
    Crate,
    /// Someone else keeps it alive (the caller of [`Stream::from_raw`] promised so).
    Borrowed,
    /// Another library's handle, held until the last of ours goes (cudarc's `Arc<CudaStream>`).
    #[allow(dead_code, reason = "never read: held for its drop")]
    Kept(Box<dyn Send + Sync>),
}

// SAFETY: a CUDA stream handle may be used from any thread (the runtime and driver APIs are
// thread-safe for streams); the handle is only destroyed once, in Drop, when the last clone
// goes, and the kept owner is `Send + Sync` itself.
unsafe impl Send for StreamHandle {}

// SAFETY: as above; every operation through `&StreamHandle` is a thread-safe runtime or
// driver call.
unsafe impl Sync for StreamHandle {}

impl Drop for StreamHandle {
    fn drop(&mut self) {
        if let Owner::Crate = self.owner {
            // SAFETY: the last reference to a stream this crate created is going; the runtime
            // releases its resources once its pending work is done, so destroying it with
            // work queued is allowed.
            let _ = crate::context::on_device(self.device, || unsafe {
                crate::raw::stream::stream_destroy(self.raw)
            });
        }
    }
}

/// A CUDA stream: one this crate created ([`Stream::new`], [`Stream::on`]) or one adopted
/// from other code ([`Stream::from_raw`], `Stream::from_cudarc` with the `cudarc` feature).
///
/// A stream belongs to one device ([`device`](Self::device)), and work queued through it runs
/// there whichever device is current on the calling thread: the crate makes the stream's
/// device current for the calls that need it and puts the caller's back before returning.
///
/// Cloning is cheap and gives another handle to the same stream; a stream this crate created
/// is destroyed when the last handle goes, so buffers that recorded a use on it can still
/// record events there. Two handles are equal when they name the same CUDA stream.
#[derive(Clone)]
pub struct Stream {
    handle: Arc<StreamHandle>,
}

impl fmt::Debug for Stream {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Stream")
            .field("raw", &self.handle.raw)
            .field("device", &self.handle.device)
            .finish()
    }
}

impl PartialEq for Stream {
    fn eq(&self, other: &Self) -> bool {
        self.handle.raw == other.handle.raw
    }
}

impl Eq for Stream {}

impl Stream {
    /// Creates a non-blocking stream on the calling thread's current device.
    ///
    /// # Examples
    ///
    /// ```no_run
    /// use cuda_pinned::{DeviceBuffer, PinnedVec, Stream};
    /// let stream = Stream::new()?;
    /// let mut device = DeviceBuffer::<u8>::zeroed(4096)?;
    /// let host = PinnedVec::from_slice(&[7u8; 4096])?;
    /// stream.copy_to_device(host, &mut device)?.wait()?;
    /// stream.synchronize()?;
    /// # Ok::<(), cuda_pinned::Error>(())
    /// ```
    ///
    /// # Errors
    ///
    /// [`Error::Unavailable`](crate::Error::Unavailable) without CUDA, or the CUDA error.
    pub fn new() -> Result<Self> {
        Self::on(Device::current()?)
    }

    /// Creates a non-blocking stream on `device`, leaving the calling thread's current
    /// device as it was.
    ///
    /// # Errors
    ///
    /// [`Error::Unavailable`](crate::Error::Unavailable) without CUDA, or the CUDA error.
    pub fn on(device: Device) -> Result<Self> {
        let device = device.raw();
        let raw = crate::context::on_device(device, || {
            crate::raw::stream::stream_create(sys::cudaStreamNonBlocking)
        })?;
        Ok(Self {
            handle: Arc::new(StreamHandle {
                raw,
                owner: Owner::Crate,
                device,
            }),
        })
    }

    /// The device the stream belongs to.
    pub fn device(&self) -> Device {
        Device::from_raw(self.handle.device)
    }

    /// Adopts a stream created by other code, like PyTorch's `torch.cuda.ExternalStream`.
    ///
    /// `stream` is a `cudaStream_t` or a driver API `CUstream` (they are the same handle): copies
    /// can be queued on it and buffers can record their use on it ([`PinnedVec::record_stream`]),
    /// so work this crate did not queue still holds them back from reuse and free. The stream is
    /// never destroyed through the returned handle.
    ///
    /// Work this crate queues for an adopted stream runs on a companion stream of its own,
    /// forked from it and joined back, so that a capture the other code begins on it during
    /// the call cannot take that work into a graph (see `Stream::from_cudarc`).
    ///
    /// # Errors
    ///
    /// The CUDA error when the runtime cannot tell the stream's device (an invalid handle);
    /// [`Error::Unsupported`] for the default streams (null, `cudaStreamLegacy`,
    /// `cudaStreamPerThread`): they name a different stream on every device or thread, so a
    /// use recorded from one thread could be looked for on another stream later.
    ///
    /// # Safety
    ///
    /// - `raw` is a live stream of a device's primary context (the one the runtime API and
    ///   cudarc's `CudaContext::new` use). Its device is asked of the runtime (CUDA 12.8 and
    ///   later); older runtimes cannot say, and the stream is taken to be the current
    ///   device's;
    /// - it stays live as long as the returned handle, or any clone of it, lives. Buffers and
    ///   device buffers that were used on it keep clones until they drop.
    ///
    /// [`PinnedVec::record_stream`]: crate::PinnedVec::record_stream
    /// [`Error::Unsupported`]: crate::Error::Unsupported
    pub unsafe fn from_raw(raw: cudaStream_t) -> Result<Self> {
        // SAFETY: forwarded from the caller.
        unsafe { Self::adopt(raw, Owner::Borrowed, None) }
    }

    /// # Safety
    ///
    /// As [`from_raw`](Self::from_raw), with `owner` keeping `raw` live when it is `Kept`;
    /// `device`, when given, is the stream's.
    pub(crate) unsafe fn adopt(
        raw: cudaStream_t,
        owner: Owner,
        device: Option<i32>,
    ) -> Result<Self> {
        // The default streams are macros in the headers: null and `cudaStreamLegacy` (1) name
        // the legacy stream of whichever device is current, `cudaStreamPerThread` (2) the
        // calling thread's. A use recorded on one would be looked for later on another device
        // or thread, and miss the work it was meant to cover.
        match raw as usize {
            0 | 1 => Err(Error::Unsupported(
                "the legacy default stream is a different stream on every device; \
                 adopt a stream created for the purpose",
            )),
            2 => Err(Error::Unsupported(
                "the per-thread default stream is a different stream on every thread; \
                 adopt a stream created for the purpose",
            )),
            _ => {
                let device = match device {
                    Some(device) => device,
                    // SAFETY: the caller vouches that `raw` is live.
                    None => match unsafe { crate::raw::device::stream_device(raw) } {
                        Ok(device) => device,
                        // A runtime before 12.8 cannot say: the documented assumption.
                        Err(Error::Unavailable(_)) => crate::raw::device::current_device()?,
                        Err(error) => return Err(error),
                    },
                };
                // SAFETY: forwarded from the caller.
                Ok(unsafe { Self::borrow(raw, owner, device) })
            }
        }
    }

    /// Wraps `raw` without the checks of [`adopt`](Self::adopt): for work queued and recorded
    /// within one call, on the calling thread and its current device, where the default
    /// streams name the right stream.
    ///
    /// # Safety
    ///
    /// `raw` is a stream of `device`, live (or a default stream) while the returned stream
    /// lives, and the stream is not kept beyond the call (no buffer records a use on it).
    pub(crate) unsafe fn borrow(raw: cudaStream_t, owner: Owner, device: i32) -> Self {
        Self {
            handle: Arc::new(StreamHandle { raw, owner, device }),
        }
    }

    /// Whether other code created the stream (it was adopted): that code may capture it.
    pub(crate) fn is_adopted(&self) -> bool {
        !matches!(self.handle.owner, Owner::Crate)
    }

    /// The raw `cudaStream_t`, for passing to other CUDA libraries (cudarc's and cust's
    /// stream handles are the same object). Its type comes from [`cuda_pinned::sys`](crate::sys):
    ///
    /// ```no_run
    /// let stream = cuda_pinned::Stream::new()?;
    /// let raw: cuda_pinned::sys::cudaStream_t = stream.as_raw();
    /// # Ok::<(), cuda_pinned::Error>(())
    /// ```
    pub fn as_raw(&self) -> cudaStream_t {
        self.handle.raw
    }

    /// Blocks until all work queued on the stream has finished.
    ///
    /// # Errors
    ///
    /// A CUDA error, including errors of earlier asynchronous work.
    pub fn synchronize(&self) -> Result<()> {
        let _span = tracing::debug_span!("wait", what = %"stream").entered();
        // SAFETY: the handle is live while `self` exists. (On a thread without a context the
        // runtime would make its default device's current: the stream's own is used.)
        crate::context::on_device(self.handle.device, || unsafe {
            crate::raw::stream::stream_synchronize(self.as_raw())
        })
    }

    /// Whether no work can be queued on the stream any more and none is left: a stream this
    /// crate created, of which `self` is the last handle, that has finished its work.
    pub(crate) fn is_spent(&self) -> bool {
        matches!(self.handle.owner, Owner::Crate)
            && Arc::strong_count(&self.handle) == 1
            && matches!(self.query(), Ok(true))
    }

    /// Whether all work queued on the stream has finished, without blocking.
    ///
    /// # Errors
    ///
    /// A CUDA error, including errors of earlier asynchronous work.
    pub fn query(&self) -> Result<bool> {
        // SAFETY: the handle is live while `self` exists.
        crate::context::on_device(self.handle.device, || unsafe {
            crate::raw::stream::stream_query(self.as_raw())
        })
    }

    /// Records a new event capturing all work queued on the stream so far.
    ///
    /// # Errors
    ///
    /// A CUDA error from creating or recording the event.
    pub fn record_event(&self) -> Result<Event> {
        self.record_new_event(sys::cudaEventDefault, false)
    }

    /// Like [`record_event`](Self::record_event), without timing (cheaper), for tracking:
    /// refused on a stream that is capturing a graph, where it would mark nothing.
    pub(crate) fn record_event_untimed(&self) -> Result<Event> {
        self.record_new_event(sys::cudaEventDisableTiming, true)
    }

    /// [`Error::Capturing`] while the stream is capturing a CUDA graph. Work queued there
    /// then runs at each launch of the graph, not now, and an event recorded there completes
    /// at once: host memory that the work reads or fills, lent for a call or released by an
    /// event, could be gone or reused by then. Runs with the stream's device current.
    pub(crate) fn refuse_capture(&self) -> Result<()> {
        // SAFETY: the stream is live while borrowed.
        if unsafe { crate::raw::stream::stream_is_capturing(self.as_raw())? } {
            return Err(Error::Capturing);
        }
        Ok(())
    }

    /// Whether work queued on the stream now would be captured into a CUDA graph rather than run: a
    /// capture began on it, or it waits on work of a capture (which joins it to that capture).
    ///
    /// This crate's copies, tracked work and host functions refuse such a stream with
    /// [`Error::Capturing`].
    ///
    /// # Errors
    ///
    /// A CUDA error (a default stream while another stream captures in global mode, say).
    pub fn is_capturing(&self) -> Result<bool> {
        // SAFETY: the stream is live while borrowed.
        crate::context::on_device(self.handle.device, || unsafe {
            crate::raw::stream::stream_is_capturing(self.as_raw())
        })
    }

    /// An event created on the stream's device (CUDA records an event only on a stream of its
    /// own device) and recorded here; refused while the stream captures a graph if the event
    /// is to track work.
    fn record_new_event(&self, flags: u32, tracking: bool) -> Result<Event> {
        let device = self.handle.device;
        crate::context::on_device(device, || {
            if tracking {
                self.refuse_capture()?;
            }
            let event = Event::create(device, flags)?;
            // SAFETY: the stream is live while borrowed, and of the device it names.
            unsafe { event.record_on(self.as_raw(), device)? };
            Ok(event)
        })
    }

    /// Makes future work on this stream wait (on the device) for `event`, which may belong
    /// to another device.
    ///
    /// # Errors
    ///
    /// A CUDA error.
    pub fn wait_event(&self, event: &Event) -> Result<()> {
        self.wait_event_with(event, 0)
    }

    /// As [`wait_event`](Self::wait_event), waiting as a node of its own in a graph that a
    /// capture on this stream is taking in (`cudaEventWaitExternal`): such a capture is not
    /// broken by an event recorded outside it, and each launch of its graph waits for the
    /// event.
    pub(crate) fn wait_event_external(&self, event: &Event) -> Result<()> {
        self.wait_event_with(event, crate::raw::stream::EVENT_WAIT_EXTERNAL)
    }

    fn wait_event_with(&self, event: &Event, flags: u32) -> Result<()> {
        // SAFETY: both handles are live while borrowed.
        crate::context::on_device(self.handle.device, || unsafe {
            crate::raw::stream::stream_wait_event(self.as_raw(), event.as_raw(), flags)
        })
    }
}

/// Recording belongs to streams: an event is recorded on one.
impl Event {
    /// Captures the work queued on `stream` so far.
    ///
    /// Recording needs the event to itself: an event this crate lends out (a [`Transfer`]'s,
    /// say) marks the end of a copy, and memory is released when it completes, so recording
    /// it again at an earlier point would release memory that the copy still uses.
    ///
    /// ```compile_fail,E0596
    /// # use cuda_pinned::{PinnedVec, Stream, Transfer};
    /// fn record_again(transfer: &Transfer<PinnedVec<u8>>, idle: &Stream) {
    ///     transfer.event().record(idle).unwrap();
    /// }
    /// ```
    ///
    /// # Errors
    ///
    /// [`Error::DeviceMismatch`] when the stream belongs to another device (CUDA records
    /// only there; [`Stream::record_event`] makes an event on the stream's device), or a
    /// CUDA error.
    ///
    /// [`Transfer`]: crate::Transfer
    pub fn record(&mut self, stream: &Stream) -> Result<()> {
        self.record_shared(stream)
    }

    /// [`record`](Self::record) through a shared reference, for events only this crate can
    /// reach while it records them.
    pub(crate) fn record_shared(&self, stream: &Stream) -> Result<()> {
        // SAFETY: the stream is live while borrowed, and of the device it names.
        unsafe { self.record_on(stream.as_raw(), stream.handle.device) }
    }
}
