//! A buffer's record of the streams it was used on, which holds its memory back from reuse
//! until their work is done.

use std::sync::Arc;

use crate::error::{Error, Result};
use crate::gpu::stream::Stream;
use crate::memory::allocator::PendingUses;

/// A buffer's record of the streams it was used on (PyTorch's `record_stream`): at drop, one
/// event per stream marks the end of those uses. One pointer wide, and empty (no allocation)
/// until a use is recorded, so a buffer that never meets a stream carries and checks one word.
#[derive(Debug, Default)]
pub(crate) struct StreamUses(Option<Box<Uses>>);

#[derive(Debug, Default)]
struct Uses {
    streams: Vec<Stream>,
    events: PendingUses,
}

impl StreamUses {
    pub(crate) const fn new() -> Self {
        Self(None)
    }

    fn uses(&mut self) -> &mut Uses {
        self.0.get_or_insert_with(Box::default)
    }

    pub(crate) fn record_stream(&mut self, stream: &Stream) {
        let uses = self.uses();
        if !uses.streams.contains(stream) {
            uses.streams.push(stream.clone());
        }
    }

    /// Adds every event of `pending`.
    pub(crate) fn extend(&mut self, pending: PendingUses) {
        if !pending.is_empty() {
            self.uses().events.extend(pending);
        }
    }

    #[inline]
    pub(crate) fn is_empty(&self) -> bool {
        self.0.is_none()
    }

    /// The uses as events. An error when a stream is capturing a graph
    /// ([`Error::Capturing`]), or an event could not be recorded and the stream could not be
    /// waited for either (that wait's error): then nobody can know when the memory is free.
    pub(crate) fn finish(self) -> Result<PendingUses> {
        let Some(uses) = self.0 else {
            return Ok(PendingUses::none());
        };
        let Uses {
            streams,
            events: mut pending,
        } = *uses;
        for stream in streams {
            match stream.record_event_untimed() {
                Ok(event) => pending.push(Arc::new(event)),
                // A graph captured there may use the memory at any launch; waiting for the
                // stream would only break the capture.
                Err(Error::Capturing) => return Err(Error::Capturing),
                Err(_) => stream.synchronize()?,
            }
        }
        Ok(pending)
    }
}
