//! The copies of a device buffer still running, by stream.

use std::sync::{Arc, Mutex, PoisonError};

use crate::error::Result;
use crate::gpu::event::Event;
use crate::gpu::stream::Stream;

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
    pub(crate) fn wait_all(&mut self) -> bool {
        let pending = self.0.get_mut().unwrap_or_else(PoisonError::into_inner);
        pending.iter().all(|(_, event)| event.synchronize().is_ok())
    }
}
