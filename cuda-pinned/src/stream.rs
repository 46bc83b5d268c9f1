//! Minimal CUDA streams and events: enough to enqueue tracked copies and to know when they end.

use std::ffi::c_void;
use std::fmt;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use cuda_pinned_sys::{self as sys, cudaEvent_t, cudaStream_t};

use crate::device::Device;
use crate::error::{Error, Result};
use crate::ffi;

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
            let _ = ffi::on_device(self.device, || unsafe { ffi::stream_destroy(self.raw) });
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
        let raw = ffi::on_device(device, || ffi::stream_create(sys::cudaStreamNonBlocking))?;
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

    /// Adopts a stream created by other code (a `cudaStream_t` or a driver API `CUstream`:
    /// they are the same handle), like PyTorch's `torch.cuda.ExternalStream`: copies can be
    /// queued on it and buffers can record their use on it ([`PinnedVec::record_stream`]),
    /// so work this crate did not queue still holds them back from reuse and free. The
    /// stream is never destroyed through the returned handle.
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
                    None => match unsafe { ffi::stream_device(raw) } {
                        Ok(device) => device,
                        // A runtime before 12.8 cannot say: the documented assumption.
                        Err(Error::Unavailable(_)) => ffi::current_device()?,
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
        // SAFETY: the handle is live while `self` exists. (On a thread without a context the
        // runtime would make its default device's current: the stream's own is used.)
        ffi::on_device(self.handle.device, || unsafe {
            ffi::stream_synchronize(self.as_raw())
        })
    }

    /// Whether all work queued on the stream has finished, without blocking.
    ///
    /// # Errors
    ///
    /// A CUDA error, including errors of earlier asynchronous work.
    pub fn query(&self) -> Result<bool> {
        // SAFETY: the handle is live while `self` exists.
        ffi::on_device(self.handle.device, || unsafe {
            ffi::stream_query(self.as_raw())
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
        if unsafe { ffi::stream_is_capturing(self.as_raw())? } {
            return Err(Error::Capturing);
        }
        Ok(())
    }

    /// Whether work queued on the stream now would be captured into a CUDA graph rather than
    /// run: a capture began on it, or it waits on work of a capture (which joins it to that
    /// capture). This crate's copies, tracked work and host functions refuse such a stream
    /// with [`Error::Capturing`].
    ///
    /// # Errors
    ///
    /// A CUDA error (a default stream while another stream captures in global mode, say).
    pub fn is_capturing(&self) -> Result<bool> {
        // SAFETY: the stream is live while borrowed.
        ffi::on_device(self.handle.device, || unsafe {
            ffi::stream_is_capturing(self.as_raw())
        })
    }

    /// An event created on the stream's device (CUDA records an event only on a stream of its
    /// own device) and recorded here; refused while the stream captures a graph if the event
    /// is to track work.
    fn record_new_event(&self, flags: u32, tracking: bool) -> Result<Event> {
        let device = self.handle.device;
        ffi::on_device(device, || {
            if tracking {
                self.refuse_capture()?;
            }
            let event = Event {
                raw: ffi::event_create(flags)?,
                device,
                finished: AtomicBool::new(false),
            };
            // SAFETY: both handles are live, and of the same device, whose primary context
            // `on_device` made current.
            unsafe { ffi::event_record(event.raw, self.as_raw())? };
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
        // SAFETY: both handles are live while borrowed.
        ffi::on_device(self.handle.device, || unsafe {
            ffi::stream_wait_event(self.as_raw(), event.raw)
        })
    }

    /// Runs `work`, which queues this crate's work for this stream, on the stream itself or,
    /// for a stream adopted from other code, on a companion stream fenced against a capture
    /// that code may begin meanwhile (see `fence`). Refuses a stream capturing a graph
    /// ([`Error::Capturing`]) before anything is queued. Runs with the stream's device current.
    pub(crate) fn enqueue<R>(&self, work: impl FnOnce(&Stream) -> Result<R>) -> Result<R> {
        ffi::on_device(self.handle.device, || {
            self.refuse_capture()?;
            match self.handle.owner {
                Owner::Crate => work(self),
                _ => crate::fence::run(self, work),
            }
        })
    }

    /// Queues `function` to run on a driver thread once the work before it has finished;
    /// work queued after it waits for it to return.
    ///
    /// The function must not call CUDA: CUDA may refuse such calls or deadlock in them. That
    /// includes dropping values of this crate that wait for the device first (a `Transfer`,
    /// a `DeviceBuffer` with copies pending, a buffer with recorded uses): a wait that fails
    /// there leaks the memory rather than free it early, but one may never return. A panic
    /// inside the function is caught and its payload leaked, since neither may unwind into
    /// the driver.
    ///
    /// The function runs at most once, however often the driver calls it (a graph that
    /// took it in, launched again and again), and never after this call returned an error.
    ///
    /// # Errors
    ///
    /// [`Error::Capturing`] on a stream capturing a graph, or a CUDA error; then `function`
    /// is dropped without running.
    pub fn launch_host_fn<F: FnOnce() + Send + 'static>(&self, function: F) -> Result<()> {
        let id = host_fn::park(Box::new(function));
        let queued = self.enqueue(|stream| {
            // SAFETY: the stream is live; the trampoline is handed a number, not a pointer,
            // runs the function parked under it at most once, lets no panic unwind into the
            // driver, and does nothing on a later call; the function is `Send + 'static`, so
            // running it later on another thread is sound. A function that calls CUDA
            // regardless gets errors or a deadlock, which touch no memory.
            unsafe { ffi::launch_host_func(stream.as_raw(), host_fn::trampoline, id) }
        });
        if queued.is_err() {
            // Not queued, or queued into a capture: it never runs now.
            drop(host_fn::unpark(id));
        }
        queued
    }
}

/// Host functions waiting for the driver to call them, each under a number of its own. The
/// driver is handed the number, never a pointer: a call it makes more than once (each launch
/// of a graph that captured the function calls it) or never leaves nothing freed under it.
mod host_fn {
    use std::collections::HashMap;
    use std::ffi::c_void;
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::sync::{Mutex, PoisonError};

    type Parked = Box<dyn FnOnce() + Send>;

    static PARKED: Mutex<Option<HashMap<usize, Parked>>> = Mutex::new(None);
    static NEXT: AtomicUsize = AtomicUsize::new(1);

    /// Parks `function`; the number to hand the driver (as its data pointer).
    pub(super) fn park(function: Parked) -> *mut c_void {
        let id = NEXT.fetch_add(1, Ordering::Relaxed);
        lock().get_or_insert_with(HashMap::new).insert(id, function);
        std::ptr::without_provenance_mut(id)
    }

    /// Takes the function parked under `id` back, if it has not run.
    pub(super) fn unpark(id: *mut c_void) -> Option<Parked> {
        lock().as_mut()?.remove(&id.addr())
    }

    fn lock() -> std::sync::MutexGuard<'static, Option<HashMap<usize, Parked>>> {
        PARKED.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// What the driver calls: runs the function parked under `data`'s number, if still there.
    pub(super) unsafe extern "C" fn trampoline(data: *mut c_void) {
        if let Some(function) = unpark(data) {
            // A payload whose own drop panicked would unwind here: it is leaked instead.
            if let Err(payload) = std::panic::catch_unwind(std::panic::AssertUnwindSafe(function)) {
                std::mem::forget(payload);
            }
        }
    }
}

/// One copy of a batch queued with [`Stream::copy_batch_raw`]: `bytes` bytes from `src` to
/// `dst`, host or device addresses either way (unified addressing tells which).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RawCopy {
    /// Where the bytes go.
    pub dst: u64,
    /// Where they come from.
    pub src: u64,
    /// How many.
    pub bytes: usize,
}

impl Stream {
    /// Queues many copies at once: one `cudaMemcpyBatchAsync` where the runtime has it
    /// (CUDA 13 and later), one `cudaMemcpyAsync` each otherwise. Gathering many small pieces
    /// (the samples of a batch) this way runs at the link's speed where separate calls reach
    /// half of it.
    ///
    /// # Errors
    ///
    /// [`Error::Capturing`] on a stream capturing a graph (nothing is queued), or the CUDA
    /// error; copies queued before it stay queued.
    ///
    /// # Safety
    ///
    /// - each `src` is readable and each `dst` writable for its `bytes`, until the copies
    ///   have finished on this stream; host memory among them is page-locked or stays put;
    /// - nothing else writes any of the ranges (or reads a destination) meanwhile.
    pub unsafe fn copy_batch_raw(&self, copies: &[RawCopy]) -> Result<()> {
        let copies: Vec<_> = copies.iter().filter(|c| c.bytes > 0).collect();
        if copies.is_empty() {
            return Ok(());
        }
        ffi::on_device(self.handle.device, || {
            // A graph would copy at each launch, after the memory may be gone.
            self.refuse_capture()?;
            if copies.len() > 1 && ffi::has_memcpy_batch() {
                let dsts: Vec<_> = copies.iter().map(|c| c.dst as *mut c_void).collect();
                let srcs: Vec<_> = copies.iter().map(|c| c.src as *const c_void).collect();
                let sizes: Vec<_> = copies.iter().map(|c| c.bytes).collect();
                // SAFETY: one length for the three lists, the batch call exists with this
                // signature (checked), and the caller vouches for every range.
                return unsafe { ffi::memcpy_batch_async(&dsts, &srcs, &sizes, self.as_raw()) };
            }
            for copy in &copies {
                // SAFETY: the caller vouches for the ranges; the default kind lets unified
                // addressing tell the direction.
                unsafe {
                    ffi::memcpy_async_any(
                        copy.dst as *mut c_void,
                        copy.src as *const c_void,
                        copy.bytes,
                        self.as_raw(),
                    )?
                };
            }
            Ok(())
        })
    }
}

/// A CUDA event: a marker in a stream's work that can be waited for and timed.
///
/// An event belongs to one device and records only streams of that device; it can be waited
/// for, queried and waited on by streams of any device.
pub struct Event {
    raw: cudaEvent_t,
    device: i32,
    /// The work recorded last has been seen finished: queries answer without a driver call
    /// (about 0.3 µs), which makes reusing memory the event released nearly free.
    finished: AtomicBool,
}

// SAFETY: event handles may be used from any thread; destroyed once, in Drop.
unsafe impl Send for Event {}
// SAFETY: every operation through `&Event` is a thread-safe runtime or driver call.
unsafe impl Sync for Event {}

impl fmt::Debug for Event {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Event")
            .field("raw", &self.raw)
            .field("device", &self.device)
            .finish()
    }
}

impl Drop for Event {
    fn drop(&mut self) {
        // SAFETY: the event is ours; destroying an event whose work is pending is allowed
        // (the runtime releases it when the work completes).
        let _ = ffi::on_device(self.device, || unsafe { ffi::event_destroy(self.raw) });
    }
}

impl Event {
    /// Creates an event that can be timed, on the calling thread's current device.
    ///
    /// # Errors
    ///
    /// [`Error::Unavailable`](crate::Error::Unavailable) without CUDA, or the CUDA error.
    pub fn new() -> Result<Self> {
        Self::on(Device::current()?)
    }

    /// Creates an event that can be timed on `device`, leaving the calling thread's current
    /// device as it was.
    ///
    /// # Errors
    ///
    /// [`Error::Unavailable`](crate::Error::Unavailable) without CUDA, or the CUDA error.
    pub fn on(device: Device) -> Result<Self> {
        Self::create(device.raw(), sys::cudaEventDefault)
    }

    /// An event for ordering only, without timing (cheaper to record and query), on
    /// `device`.
    pub(crate) fn untimed_on(device: Device) -> Result<Self> {
        Self::create(device.raw(), sys::cudaEventDisableTiming)
    }

    fn create(device: i32, flags: u32) -> Result<Self> {
        let raw = ffi::on_device(device, || ffi::event_create(flags))?;
        Ok(Self {
            raw,
            device,
            finished: AtomicBool::new(false),
        })
    }

    /// The device the event belongs to.
    pub fn device(&self) -> Device {
        Device::from_raw(self.device)
    }

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
        check_same_device("the stream", self.device, stream.handle.device)?;
        // Before the record: nobody else reaches the event meanwhile (see above), so no
        // query or wait of an earlier record can set it again.
        self.finished.store(false, Ordering::Relaxed);
        // SAFETY: both handles are live while borrowed, and of the same device, whose primary
        // context `on_device` makes current.
        ffi::on_device(self.device, || unsafe {
            ffi::event_record(self.raw, stream.as_raw())
        })
    }

    /// Whether the captured work has finished.
    ///
    /// # Errors
    ///
    /// A CUDA error, including errors of the captured work.
    pub fn query(&self) -> Result<bool> {
        if self.seen_finished() {
            return Ok(true);
        }
        // SAFETY: the handle is live.
        let finished = unsafe { ffi::event_query(self.raw)? };
        if finished {
            self.finished.store(true, Ordering::Release);
        }
        Ok(finished)
    }

    /// Whether the captured work was seen finished already (by a query or a wait), without
    /// asking the device.
    pub(crate) fn seen_finished(&self) -> bool {
        self.finished.load(Ordering::Acquire)
    }

    /// Blocks until the captured work has finished.
    ///
    /// # Errors
    ///
    /// A CUDA error, including errors of the captured work.
    pub fn synchronize(&self) -> Result<()> {
        if self.seen_finished() {
            return Ok(());
        }
        // SAFETY: the handle is live.
        unsafe { ffi::event_synchronize(self.raw)? };
        self.finished.store(true, Ordering::Release);
        Ok(())
    }

    /// Milliseconds between `start` and this event, both recorded and finished.
    ///
    /// # Errors
    ///
    /// [`Error::DeviceMismatch`] when the events belong to different devices (CUDA times
    /// only events of one device), or a CUDA error (`cudaErrorNotReady` if either has not
    /// finished, `cudaErrorInvalidResourceHandle` for an event without timing, as those that
    /// `Transfer::event` lends are).
    pub fn elapsed_ms_since(&self, start: &Event) -> Result<f32> {
        check_same_device("the start event", self.device, start.device)?;
        // SAFETY: both handles are live. An event created without timing (the crate's own,
        // lent by `Transfer::event`) makes CUDA return an error, not read anything.
        unsafe { ffi::event_elapsed_ms(start.raw, self.raw) }
    }

    /// The raw `cudaEvent_t`, for waiting on it or querying it. Record it through
    /// [`record`](Self::record) only: the event remembers when its recorded work was seen
    /// finished, and a record made behind its back would leave that stale.
    pub fn as_raw(&self) -> cudaEvent_t {
        self.raw
    }
}

/// [`Error::DeviceMismatch`] unless `found` is `expected`.
pub(crate) fn check_same_device(what: &'static str, expected: i32, found: i32) -> Result<()> {
    if expected == found {
        return Ok(());
    }
    Err(Error::DeviceMismatch {
        what,
        expected: expected as usize,
        found: found as usize,
    })
}
