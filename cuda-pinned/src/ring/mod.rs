//! The ring: the engine beneath the [`Stager`](crate::Stager) and the file readers of the
//! crates built on this one.
//!
//! A ring of page-locked chunks, each with an event; threads of a [`Crew`] that live as long
//! as their owner fill chunks (from ordinary memory, from files) and queue their copies to
//! the device, or queue copies into them and empty them; a chunk is reused once the event
//! recorded after its copies has completed. Reads or fills and the DMA overlap, and the
//! page-locked memory held is the ring's, whatever the size of a copy.
//!
//! | file | what |
//! |---|---|
//! | `mod.rs` | the contract with the device: [`Dma`], one call per thing the engine asks of it, and the copy it queues ([`RingCopy`]) |
//! | `cuda.rs` | [`Cuda`]: the contract kept by the CUDA runtime, through this crate's streams and events |
//! | `chunks.rs` | [`Ring`]: the chunks, free or [`Taken`], and which may never be reused |
//! | `crew.rs` | [`Crew`]: the threads, the queue of jobs they take pieces of |
//!
//! The jobs themselves (what a piece is, where it is read from, what completes as pieces
//! land) belong to their users: the stager's copies in `staging/`, a file reader's loads in
//! its own crate. Both test their jobs against a fake [`Dma`] whose copies run late, only
//! when an event behind them is waited for, so a chunk reused too early shows as wrong bytes.

use std::sync::{Condvar, Mutex, MutexGuard, PoisonError};

use crate::error::Result;

mod chunks;
mod crew;
mod cuda;

pub use chunks::{Census, Chunk, Ring, Taken};
pub use crew::{Crew, CrewConfig, CrewJob, Pick};
pub use cuda::Cuda;

/// Which way a copy goes.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Way {
    /// From host memory to the device.
    Upload,
    /// From the device to host memory.
    Download,
}

/// One copy between host memory (a chunk of the ring) and the device: `rows` rows of
/// `width` bytes, `host_pitch` bytes apart on the host and packed on the device.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RingCopy {
    /// The first byte on the host.
    pub host: *mut u8,
    /// Bytes from one row's start to the next on the host (`width` for one row).
    pub host_pitch: usize,
    /// The first byte on the device.
    pub device: u64,
    /// Bytes of a row.
    pub width: usize,
    /// Rows (one for a plain copy).
    pub rows: usize,
}

impl RingCopy {
    /// A plain copy of `bytes` between `host` and `device`.
    pub fn plain(host: *mut u8, device: u64, bytes: usize) -> Self {
        Self {
            host,
            host_pitch: bytes,
            device,
            width: bytes,
            rows: 1,
        }
    }
}

/// What the engine needs from a device: the CUDA runtime ([`Cuda`]), or a fake in tests.
///
/// Each chunk has an event of its own; the engine records it after the copies out of (or
/// into) the chunk and waits for it before the chunk is filled again.
pub trait Dma: Send + Sync + 'static {
    /// Where copies are queued, in order.
    type Stream: Clone + Send + Sync;
    /// A point on a stream that can be waited for.
    type Event: Send + Sync;

    /// A new event.
    ///
    /// # Errors
    ///
    /// The device's.
    fn event(&self) -> Result<Self::Event>;

    /// Queues `copies` on `stream`, the way `way` says.
    ///
    /// # Errors
    ///
    /// The device's: copies may then be queued that no event covers.
    ///
    /// # Safety
    ///
    /// - each copy's host rows are page-locked memory valid for the copy (read for an upload,
    ///   written for a download) and the device range too, until an event recorded after
    ///   them on `stream` has completed (or the stream has been waited for); nobody else
    ///   writes either side meanwhile, nor reads what a download writes;
    /// - the call runs inside [`enqueue`](Self::enqueue), on the stream it hands over (or
    ///   inside the same fence taken by the caller, as the stager's copies do).
    unsafe fn queue(&self, stream: &Self::Stream, copies: &[RingCopy], way: Way) -> Result<()>;

    /// Runs `work`, which queues copies for `stream` and records their events, the way the
    /// device runs such work safely: for CUDA, with the stream's device current and, on a
    /// stream adopted from other code, fenced against a capture begun there meanwhile (see
    /// [`Stream::from_cudarc`](crate::Stream::from_cudarc)); `work` gets the stream to queue
    /// on.
    ///
    /// # Errors
    ///
    /// [`Error::Capturing`](crate::Error::Capturing) for a stream capturing a graph (nothing
    /// queued), or `work`'s.
    fn enqueue<R>(
        &self,
        stream: &Self::Stream,
        work: impl FnOnce(&Self::Stream) -> Result<R>,
    ) -> Result<R>;

    /// Records `event` on `stream`, after the work queued there so far.
    ///
    /// # Errors
    ///
    /// The device's; [`Error::Capturing`](crate::Error::Capturing) where the stream captures a
    /// graph (which may then hold the copies: their chunk is never reused).
    fn record(&self, event: &Self::Event, stream: &Self::Stream) -> Result<()>;

    /// Blocks until `event`'s work has finished.
    ///
    /// # Errors
    ///
    /// The device's, or its work's.
    fn wait(&self, event: &Self::Event) -> Result<()>;

    /// Whether `event`'s work is known to have finished, without asking the device.
    fn seen_finished(&self, event: &Self::Event) -> bool;

    /// Whether `event`'s work has finished, asking the device.
    ///
    /// # Errors
    ///
    /// The device's, or its work's.
    fn finished(&self, event: &Self::Event) -> Result<bool>;

    /// Blocks until the work queued on `stream` has finished.
    ///
    /// # Errors
    ///
    /// The device's, or its work's.
    fn wait_stream(&self, stream: &Self::Stream) -> Result<()>;

    /// The device the copies go to or come from (its ordinal).
    fn device(&self) -> i32;

    /// Makes that device current on one of the engine's own threads.
    ///
    /// # Errors
    ///
    /// The device's.
    fn use_device(&self) -> Result<()>;
}

/// Locks `mutex`; nothing panics while the engine's locks are held, so a poisoned lock holds
/// consistent data.
pub(crate) fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(PoisonError::into_inner)
}

/// Waits on `condvar` (see [`lock`] for poisoning).
pub(crate) fn wait<'a, T>(condvar: &Condvar, guard: MutexGuard<'a, T>) -> MutexGuard<'a, T> {
    condvar.wait(guard).unwrap_or_else(PoisonError::into_inner)
}
