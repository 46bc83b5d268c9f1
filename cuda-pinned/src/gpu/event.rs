//! Events: markers in a stream's work that can be waited for and timed.

use std::fmt;
use std::sync::atomic::{AtomicBool, Ordering};

use cuda_pinned_sys::{self as sys, cudaEvent_t};

use crate::context::relaxed;
use crate::error::Result;
use crate::gpu::device::Device;
use crate::gpu::device::check_same_device;

/// A CUDA event: a marker in a stream's work that can be waited for and timed.
///
/// An event belongs to one device and records only streams of that device; it can be waited
/// for, queried and waited on by streams of any device.
pub struct Event {
    raw: cudaEvent_t,
    device: i32,
    /// The work recorded last has been seen finished: queries answer without a driver call,
    /// which makes reusing memory the event released nearly free.
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
        let _ = crate::context::on_device(self.device, || unsafe {
            crate::raw::event::event_destroy(self.raw)
        });
    }
}

impl Event {
    /// Creates an event that can be timed, on the calling thread's current device.
    ///
    /// # Examples
    ///
    /// ```no_run
    /// use cuda_pinned::{Event, Stream};
    /// let stream = Stream::new()?;
    /// let (mut start, mut end) = (Event::new()?, Event::new()?);
    /// start.record(&stream)?;
    /// // ... queue work on `stream` ...
    /// end.record(&stream)?;
    /// end.synchronize()?;
    /// println!("{} ms", end.elapsed_ms_since(&start)?);
    /// # Ok::<(), cuda_pinned::Error>(())
    /// ```
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

    /// An event for ordering only, without timing (cheaper to make, record and query), on
    /// `device`.
    ///
    /// # Errors
    ///
    /// As [`on`](Self::on).
    pub fn untimed_on(device: Device) -> Result<Self> {
        Self::create(device.raw(), sys::cudaEventDisableTiming)
    }

    pub(crate) fn create(device: i32, flags: u32) -> Result<Self> {
        let raw = crate::context::on_device(device, || crate::raw::event::event_create(flags))?;
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

    /// Records the event on the raw stream `stream` of device `stream_device`: the work
    /// for `Event::record` (which streams do, in `stream.rs`).
    ///
    /// # Safety
    ///
    /// - `stream` is a live stream of `stream_device`, or one of its default streams.
    pub(crate) unsafe fn record_on(
        &self,
        stream: sys::cudaStream_t,
        stream_device: i32,
    ) -> Result<()> {
        check_same_device("the stream", self.device, stream_device)?;
        // Before the record: nobody else reaches the event meanwhile (see `Event::record`),
        // so no query or wait of an earlier record can set it again.
        self.finished.store(false, Ordering::Relaxed);
        // SAFETY: both handles are live (the caller vouches for the stream), and of the same
        // device, whose primary context `on_device` makes current.
        crate::context::on_device(self.device, || unsafe {
            crate::raw::event::event_record(self.raw, stream)
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
        // In relaxed capture mode, which a global capture on another thread does not refuse.
        // SAFETY: the handle is live.
        let finished = relaxed(|| unsafe { crate::raw::event::event_query(self.raw) })?;
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
        // SAFETY: the handle is live. (Relaxed, as for `query`.)
        relaxed(|| unsafe { crate::raw::event::event_synchronize(self.raw) })?;
        self.finished.store(true, Ordering::Release);
        Ok(())
    }

    /// Milliseconds between `start` and this event, both recorded and finished.
    ///
    /// # Errors
    ///
    /// [`Error::DeviceMismatch`](crate::Error::DeviceMismatch) when the events belong to different devices (CUDA times
    /// only events of one device), or a CUDA error (`cudaErrorNotReady` if either has not
    /// finished, `cudaErrorInvalidResourceHandle` for an event without timing, as those that
    /// `Transfer::event` lends are).
    pub fn elapsed_ms_since(&self, start: &Event) -> Result<f32> {
        check_same_device("the start event", self.device, start.device)?;
        // SAFETY: both handles are live. An event created without timing (the crate's own,
        // lent by `Transfer::event`) makes CUDA return an error, not read anything.
        relaxed(|| unsafe { crate::raw::event::event_elapsed_ms(start.raw, self.raw) })
    }

    /// The raw `cudaEvent_t`, for waiting on it or querying it.
    ///
    /// Record it through [`record`](Self::record) only: the event remembers when its recorded work
    /// was seen finished, and a record made behind its back would leave that stale.
    pub fn as_raw(&self) -> cudaEvent_t {
        self.raw
    }
}
