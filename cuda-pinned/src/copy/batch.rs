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

/// A strided copy queued with [`Stream::copy_2d_raw`]: `rows` rows of `width` bytes, whose
/// starts lie `src_pitch` bytes apart at the source and `dst_pitch` apart at the destination;
/// host or device addresses either way (unified addressing tells which).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RawCopy2d {
    /// Where the first row goes.
    pub dst: u64,
    /// Bytes between row starts at the destination.
    pub dst_pitch: usize,
    /// Where the first row comes from.
    pub src: u64,
    /// Bytes between row starts at the source.
    pub src_pitch: usize,
    /// Bytes per row.
    pub width: usize,
    /// Rows.
    pub rows: usize,
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

    /// Queues a strided copy (`cudaMemcpy2DAsync`): a slice of a tensor's columns, rows
    /// gathered into a dense block or scattered from one.
    ///
    /// # Errors
    ///
    /// [`Error::Unsupported`](crate::Error::Unsupported) for a pitch shorter than the width
    /// or a span past the address space (nothing is queued),
    /// [`Error::Capturing`](crate::Error::Capturing) on a stream capturing a graph (nothing
    /// is queued), or the CUDA error; rows queued before it stay queued.
    ///
    /// # Safety
    ///
    /// - every source row is readable and every destination row writable for `width` bytes,
    ///   until the copy has finished on this stream; host memory among them is page-locked
    ///   or stays put;
    /// - nothing else writes any of the rows (or reads a destination row) meanwhile.
    pub unsafe fn copy_2d_raw(&self, copy: &RawCopy2d) -> Result<()> {
        if copy.width == 0 || copy.rows == 0 {
            return Ok(());
        }
        let span = |pitch: usize| {
            (copy.rows - 1)
                .checked_mul(pitch)
                .and_then(|rows| rows.checked_add(copy.width))
        };
        let (Some(src_span), Some(dst_span)) = (span(copy.src_pitch), span(copy.dst_pitch)) else {
            return Err(crate::Error::Unsupported(
                "a strided copy's rows span more than the address space",
            ));
        };
        if copy.src_pitch < copy.width || copy.dst_pitch < copy.width {
            return Err(crate::Error::Unsupported(
                "a strided copy's pitches must be at least its width",
            ));
        }
        let whole = |addr: u64, span: usize| {
            crate::memory::chunks::pieces(addr as usize, span).count() == 1
        };
        crate::gpu::fence::enqueue(self, |stream| {
            let (dst, src) = (copy.dst as *mut c_void, copy.src as *const c_void);
            if whole(copy.src, src_span) && whole(copy.dst, dst_span) {
                // SAFETY: the caller vouches for every row; neither side spans two chunk
                // registrations (checked), and the pitches are at least the width (checked).
                return unsafe {
                    crate::raw::copy::copy_2d(
                        dst,
                        copy.dst_pitch,
                        src,
                        copy.src_pitch,
                        copy.width,
                        copy.rows,
                        stream.as_raw(),
                    )
                };
            }
            // A side crosses registrations: row by row, each cut where they end.
            for row in 0..copy.rows {
                // Plain address arithmetic: either side may be a device address.
                let (dst, src) = (
                    dst.wrapping_byte_add(row * copy.dst_pitch),
                    src.wrapping_byte_add(row * copy.src_pitch),
                );
                // SAFETY: the caller vouches for every row; the default kind lets unified
                // addressing tell the direction.
                unsafe {
                    crate::copy::split::queue_default(dst, src, copy.width, stream.as_raw())?
                };
            }
            Ok(())
        })
    }
}
