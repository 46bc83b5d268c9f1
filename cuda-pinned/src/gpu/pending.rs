//! The copies of a device buffer still running, by stream, and the streams whose work uses it
//! unseen.

use std::sync::{Arc, Mutex, PoisonError};

use crate::error::Result;
use crate::gpu::event::Event;
use crate::gpu::stream::Stream;

/// What may still use one device buffer on the device: the latest async copy event per stream
/// (stream order covers the earlier ones), and the streams recorded with
/// [`record_stream`](crate::DeviceBuffer::record_stream), whose work this crate cannot see
/// (kernels), so each of them counts as using the buffer up to its latest work. Each entry
/// keeps its stream alive, so that a stream created later cannot take the handle of a
/// finished one and pass for it.
#[derive(Default)]
pub(crate) struct PendingCopies(Mutex<Pending>);

#[derive(Default)]
struct Pending {
    copies: Vec<(Stream, Arc<Event>)>,
    recorded: Vec<Stream>,
}

impl PendingCopies {
    /// Makes `stream` wait (on the device) for unfinished copies on other streams, and for the
    /// work queued so far on the recorded streams; its own earlier work is ordered by the
    /// stream already.
    pub(crate) fn order_before(&self, stream: &Stream) -> Result<()> {
        let mut pending = self.0.lock().unwrap_or_else(PoisonError::into_inner);
        let mut result = Ok(());
        pending.copies.retain(|(other, event)| {
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
        result?;
        pending.recorded.retain(|other| !other.is_spent());
        for other in pending.recorded.iter().filter(|other| *other != stream) {
            stream.wait_event(&latest_work(other)?)?;
        }
        Ok(())
    }

    /// Remembers an async copy's event as the latest on `stream`.
    pub(crate) fn track(&self, stream: &Stream, event: Arc<Event>) {
        let mut pending = self.0.lock().unwrap_or_else(PoisonError::into_inner);
        match pending.copies.iter_mut().find(|(other, _)| other == stream) {
            Some(slot) => slot.1 = event,
            None => pending.copies.push((stream.clone(), event)),
        }
    }

    /// Counts every piece of work on `stream`, queued before or after this call, as a use.
    pub(crate) fn record_stream(&self, stream: &Stream) {
        let mut pending = self.0.lock().unwrap_or_else(PoisonError::into_inner);
        // A stream of this crate's own that nobody else holds and that has finished can use
        // the buffer no more.
        pending.recorded.retain(|other| !other.is_spent());
        if !pending.recorded.contains(stream) {
            pending.recorded.push(stream.clone());
        }
    }

    /// Waits for every copy and for the recorded streams' work so far; `false` if waiting
    /// failed (the device is in an error state, or a recorded stream is capturing a graph,
    /// which may use the buffer at any launch).
    pub(crate) fn wait_all(&mut self) -> bool {
        let pending = self.0.get_mut().unwrap_or_else(PoisonError::into_inner);
        pending
            .copies
            .iter()
            .all(|(_, event)| event.synchronize().is_ok())
            && pending
                .recorded
                .iter()
                .all(|stream| latest_work(stream).and_then(|e| e.synchronize()).is_ok())
    }
}

/// An event that completes once the work queued on `stream` so far has finished. Recorded
/// through the capture fence: a capture that other code begins on an adopted stream cannot
/// take it in (the call fails with [`Error::Capturing`](crate::Error::Capturing) instead).
fn latest_work(stream: &Stream) -> Result<Event> {
    crate::gpu::fence::enqueue(stream, Stream::record_event_untimed)
}
