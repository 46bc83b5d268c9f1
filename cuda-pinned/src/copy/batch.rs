//! Many copies queued at once.

use std::ffi::c_void;

use crate::error::Result;
use crate::gpu::stream::Stream;

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
    /// Queues many copies at once: one `cudaMemcpyBatchAsync` where the runtime has it (CUDA 13 and
    /// later), one `cudaMemcpyAsync` each otherwise.
    ///
    /// Gathering many small pieces (the samples of a batch) this way runs at the link's speed where
    /// separate calls reach half of it.
    ///
    /// # Errors
    ///
    /// [`Error::Capturing`](crate::Error::Capturing) on a stream capturing a graph (nothing
    /// is queued), or the CUDA error; copies queued before it stay queued.
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
        // A graph would copy at each launch, after the memory may be gone: refused, and fenced
        // against a capture that other code begins on an adopted stream meanwhile.
        crate::gpu::fence::enqueue(self, |stream| {
            if copies.len() > 1 && crate::raw::copy::has_memcpy_batch() {
                let dsts: Vec<_> = copies.iter().map(|c| c.dst as *mut c_void).collect();
                let srcs: Vec<_> = copies.iter().map(|c| c.src as *const c_void).collect();
                let sizes: Vec<_> = copies.iter().map(|c| c.bytes).collect();
                // SAFETY: one length for the three lists, the batch call exists with this
                // signature (checked), and the caller vouches for every range.
                return unsafe {
                    crate::copy::split::queue_batch(&dsts, &srcs, &sizes, stream.as_raw())
                };
            }
            for copy in &copies {
                // SAFETY: the caller vouches for the ranges; the default kind lets unified
                // addressing tell the direction.
                unsafe {
                    crate::copy::split::queue_default(
                        copy.dst as *mut c_void,
                        copy.src as *const c_void,
                        copy.bytes,
                        stream.as_raw(),
                    )?
                };
            }
            Ok(())
        })
    }
}
