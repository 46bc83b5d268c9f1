//! What the staging engine needs from a device: CUDA, or a fake in the tests.

use crate::error::Result;
use crate::gpu::device::Device;
use crate::gpu::event::Event;
use crate::gpu::stream::Stream;
use crate::raw::copy::Direction;

/// What the engine needs from a device: CUDA, or a fake in the tests.
pub(crate) trait Dma: Send + Sync + 'static {
    type Stream: Clone + Send + Sync;
    type Event: Send + Sync;

    fn event(&self) -> Result<Self::Event>;

    /// Queues a copy of `bytes` between `host` and the device address `device`.
    ///
    /// # Safety
    ///
    /// `host` is valid for the copy (read for host → device, written for device → host) and
    /// the device range too, until the copy has finished.
    unsafe fn queue(
        &self,
        stream: &Self::Stream,
        host: *mut u8,
        device: u64,
        bytes: usize,
        direction: Direction,
    ) -> Result<()>;

    fn record(&self, event: &Self::Event, stream: &Self::Stream) -> Result<()>;
    fn wait(&self, event: &Self::Event) -> Result<()>;
    /// Whether the event's work is known to have finished, without asking the device.
    fn seen_finished(&self, event: &Self::Event) -> bool;
    /// Whether the event's work has finished, asking the device.
    fn finished(&self, event: &Self::Event) -> Result<bool>;
    fn wait_stream(&self, stream: &Self::Stream) -> Result<()>;
    /// The device the copies go to.
    fn device(&self) -> i32;
    /// Makes that device current on one of the engine's own threads.
    fn use_device(&self) -> Result<()>;
}

/// The CUDA runtime, on one device.
pub(crate) struct Cuda {
    pub(super) device: Device,
}

impl Dma for Cuda {
    type Stream = Stream;
    type Event = Event;

    fn event(&self) -> Result<Event> {
        Event::untimed_on(self.device)
    }

    unsafe fn queue(
        &self,
        stream: &Stream,
        host: *mut u8,
        device: u64,
        bytes: usize,
        direction: Direction,
    ) -> Result<()> {
        let device = device as *mut std::ffi::c_void;
        let (dst, src) = match direction {
            Direction::HostToDevice => (device, host.cast_const().cast()),
            Direction::DeviceToHost => (host.cast(), device.cast_const()),
        };
        // SAFETY: forwarded from the caller; the stream is live while borrowed.
        unsafe { crate::copy::split::queue(dst, src, bytes, direction, stream.as_raw()) }
    }

    fn record(&self, event: &Event, stream: &Stream) -> Result<()> {
        event.record_shared(stream)?;
        // A capture begun on the stream (by another thread) since the copy was checked took
        // in the piece and this event: the engine then loses the chunk.
        stream.refuse_capture()
    }

    fn wait(&self, event: &Event) -> Result<()> {
        event.synchronize()
    }

    fn seen_finished(&self, event: &Event) -> bool {
        event.seen_finished()
    }

    fn finished(&self, event: &Event) -> Result<bool> {
        event.query()
    }

    fn wait_stream(&self, stream: &Stream) -> Result<()> {
        stream.synchronize()
    }

    fn device(&self) -> i32 {
        self.device.raw()
    }

    fn use_device(&self) -> Result<()> {
        self.device.set_current()
    }
}
